"""Finding and loading the native library _runtime.so (which registers torch.ops.ce_overlap.*); whether CE
collectives can run here."""
from __future__ import annotations

import glob
import importlib.util
import os
import threading
from typing import NamedTuple

import torch

from .. import environment


class Availability(NamedTuple):
    """`ok, reason = available()`; also usable as a bool (`if available(): ...`)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:  # a plain tuple would always be truthy
        return self.ok


_lock = threading.Lock()
_loaded_from: str | None = None
_load_error: str | None = None


def library_candidates() -> list[str]:
    """Where the library is looked for, first match wins."""
    found: list[str] = []
    explicit = environment.read("CE_OVERLAP_RUNTIME_LIB")
    if explicit:
        return [explicit]
    try:  # installed or editable (scikit-build-core's redirecting finder knows the built file)
        spec = importlib.util.find_spec("ce_overlap._runtime")
        if spec is not None and spec.origin:
            found.append(spec.origin)
    except (ImportError, ValueError):
        pass
    import ce_overlap

    for pkg_dir in list(getattr(ce_overlap, "__path__", [])):
        found += sorted(glob.glob(os.path.join(pkg_dir, "_runtime*.so")))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    found += sorted(glob.glob(os.path.join(repo, "build", "*", "csrc", "runtime", "_runtime.so")))
    return list(dict.fromkeys(found))


def _ops_registered() -> bool:
    try:
        torch.ops.ce_overlap._pool_blob_bytes  # noqa: B018 (attribute lookup raises when absent)
        return True
    except (AttributeError, RuntimeError):
        return False


def load_library() -> str:
    """Loads _runtime.so once (registering torch.ops.ce_overlap.*); returns its path. RuntimeError if it cannot."""
    global _loaded_from, _load_error
    with _lock:
        if _loaded_from is not None:
            return _loaded_from
        if _load_error is not None:
            raise RuntimeError(_load_error)
        if _ops_registered():  # loaded by someone else (e.g. torch.ops.load_library by hand)
            _loaded_from = "(already registered)"
            return _loaded_from
        candidates = [p for p in library_candidates() if os.path.exists(p)]
        if not candidates:
            _load_error = ("ce_overlap runtime library (_runtime.so) not found: it is built only when a CUDA "
                           "toolkit and a CUDA build of torch are present at install time (CE_OVERLAP_BUILD_RUNTIME); "
                           f"looked at {library_candidates() or ['<package dir>']}")
            raise RuntimeError(_load_error)
        errors = []
        for path in candidates:
            try:
                torch.ops.load_library(path)
                _loaded_from = path
                break
            except Exception as e:  # noqa: BLE001 (any loader failure is reported, never raised raw)
                errors.append(f"{path}: {type(e).__name__}: {e}")
        if _loaded_from is None:
            _load_error = "ce_overlap runtime library failed to load: " + "; ".join(errors)
            raise RuntimeError(_load_error)
        return _loaded_from


def library_loaded() -> Availability:
    """Whether the library loads (true on CPU-only machines too, where only the Meta kernels can run)."""
    try:
        return Availability(True, f"loaded from {load_library()}")
    except RuntimeError as e:
        return Availability(False, str(e))


def available() -> Availability:
    """Whether CE collectives can run in this process: library loaded and a CUDA device present."""
    lib = library_loaded()
    if not lib:
        return lib
    try:
        if not torch.cuda.is_available():
            return Availability(False, "torch.cuda.is_available() is False: no GPU or no CUDA driver on this machine")
    except Exception as e:  # noqa: BLE001
        return Availability(False, f"CUDA initialization failed: {e}")
    return Availability(True, f"{lib.reason}; {torch.cuda.device_count()} CUDA device(s)")
