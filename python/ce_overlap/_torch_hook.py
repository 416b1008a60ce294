"""What `import ce_overlap` arranges with torch without importing it: the torch.distributed backend "ce_overlap" is
registered (ce_overlap.distributed.register) now if torch is imported, else right after torch.distributed is. Keeps
`import ce_overlap` torch-free for the CLI."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys

_TARGET = "torch.distributed"  # the package: registering needs it fully initialized


def _register() -> None:
    try:
        from .distributed import register

        register()
    except Exception as e:  # noqa: BLE001 (never break the user's import of torch or of ce_overlap)
        logging.getLogger("ce_overlap").warning("ce_overlap: registering the torch.distributed backend failed: %s", e)


class _RegisterAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps the loader of torch.distributed so the backend is registered right after it ran; removes
    itself from sys.meta_path then."""

    def __init__(self):
        self._loader = None

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _register()


def register_c10d_backend_when_torch_is_imported() -> None:
    if _TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
