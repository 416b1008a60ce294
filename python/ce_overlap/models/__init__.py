"""Models to capture: the built-in zoo by name, or a user's `file.py:build`."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import Any

from ..errors import CeOverlapError


@dataclasses.dataclass
class BuiltModel:
    module: Any               # torch.nn.Module
    example_inputs: tuple     # positional inputs of one training step
    name: str
    tensor_parallel: Any = None  # (module, tp_mesh) -> None: its tensor-parallel plan, where it has one


def names() -> list[str]:
    from .llama import LLAMA_CONFIGS

    return list(LLAMA_CONFIGS)


def depth(name: str) -> int:
    """Blocks of a zoo model."""
    from .llama import LLAMA_CONFIGS

    if name not in LLAMA_CONFIGS:
        raise CeOverlapError(f"unknown model {name!r} (known: {', '.join(names())}; or path/to/file.py:build)")
    return LLAMA_CONFIGS[name].n_layers


def build_named(name: str, *, seq_len: int | None = None, batch: int = 1, n_layers: int | None = None) -> BuiltModel:
    """A zoo model on the meta device (no memory), with token/label inputs of (batch, seq_len);
    `n_layers` builds it with that many blocks instead of its own."""
    import torch

    from .llama import LLAMA_CONFIGS, Llama, tensor_parallel

    if name not in LLAMA_CONFIGS:
        raise CeOverlapError(f"unknown model {name!r} (known: {', '.join(names())}; or path/to/file.py:build)")
    cfg = LLAMA_CONFIGS[name]
    seq = cfg.seq_len if seq_len is None else seq_len
    if seq < 1 or batch < 1:
        raise CeOverlapError(f"sequence length and batch must be >= 1, got seq_len={seq}, batch={batch}")
    if seq > cfg.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    if n_layers is not None:
        if n_layers < 1:
            raise CeOverlapError(f"n_layers must be >= 1, got {n_layers}")
        cfg = dataclasses.replace(cfg, n_layers=n_layers)
    with torch.device("meta"):
        module = Llama(cfg)
    tokens = torch.zeros((batch, seq), dtype=torch.long, device="meta")
    return BuiltModel(module, (tokens, tokens), name, tensor_parallel)


def is_build_target(target: str) -> bool:
    path, sep, _ = target.rpartition(":")
    return bool(sep) and path.endswith(".py")


def load_file(path: str, label: str | None = None):
    """The Python file at `path` imported as a module (registered in sys.modules while it runs, as an import would:
    dataclasses and pickling look the module up by name). Raises CeOverlapError, prefixed with `label` (default the
    path), for a missing file or one whose import raises."""
    label = label or path
    if not os.path.isfile(path):
        raise CeOverlapError(f"{label}: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"ce_overlap_user_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:  # the user's file: report, never crash or exit
        sys.modules.pop(spec.name, None)
        raise CeOverlapError(f"{label}: importing {path} raised {type(e).__name__}: {e}") from None
    return module


def build_from_file(target: str) -> BuiltModel:
    """`path/to/file.py:fn`: import the file and call fn(), which returns (module, example_inputs). A function
    `tensor_parallel(module, tp_mesh)` in the file is the model's tensor-parallel plan (captures with tp > 1)."""
    path, _, fn_name = target.rpartition(":")
    module = load_file(path, target)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise CeOverlapError(f"{target}: {path} has no callable {fn_name!r}")
    try:
        result = fn()
    except (Exception, SystemExit) as e:
        raise CeOverlapError(f"{target}: {fn_name}() raised {type(e).__name__}: {e}") from None
    built = _check_built(result, target)
    plan = getattr(module, "tensor_parallel", None)
    built.tensor_parallel = plan if callable(plan) else None
    return built


def _check_built(result, target: str) -> BuiltModel:
    import torch

    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise CeOverlapError(f"{target}: expected build() to return (module, example_inputs), got {type(result).__name__}")
    module, inputs = result
    if not isinstance(module, torch.nn.Module):
        raise CeOverlapError(f"{target}: build()[0] must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise CeOverlapError(f"{target}: build()[1] must be a tensor or a tuple of inputs, got {type(inputs).__name__}")
    return BuiltModel(module, tuple(inputs), target)


def fingerprint(built: BuiltModel) -> str:
    """What a capture of `built` depends on, as a hash: its module tree (names and classes), its parameters and
    buffers (names, shapes, dtypes, whether trained), the source files of its modules' classes outside torch (an
    edited class in any file the model imports), the file of its tensor-parallel plan, and its example inputs'
    shapes and dtypes (or values, for plain numbers and strings). Two builds of one file that differ in any of these
    (a size chosen by an environment variable) are different models to the capture cache."""
    import hashlib
    import inspect

    import torch

    h = hashlib.sha256()
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    files: set[str] = set()

    def add(*parts) -> None:
        h.update(repr(parts).encode())

    def source_file(obj) -> None:
        try:
            path = inspect.getsourcefile(obj)
        except (TypeError, OSError):
            return
        if path and not os.path.abspath(path).startswith(torch_dir):
            files.add(os.path.abspath(path))

    for name, sub in built.module.named_modules(remove_duplicate=False):
        cls = type(sub)
        add("module", name, cls.__module__, cls.__qualname__)
        for base in cls.__mro__:
            if base is not object:
                source_file(base)
    for name, p in built.module.named_parameters(remove_duplicate=False):
        add("param", name, tuple(p.shape), str(p.dtype), p.requires_grad)
    for name, b in built.module.named_buffers(remove_duplicate=False):
        add("buffer", name, tuple(b.shape), str(b.dtype))
    if built.tensor_parallel is not None:
        source_file(built.tensor_parallel)
    for leaf in torch.utils._pytree.tree_leaves(built.example_inputs):
        if isinstance(leaf, torch.Tensor):
            add("input", tuple(leaf.shape), str(leaf.dtype), leaf.requires_grad)
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            add("input", leaf)
        else:
            add("input", type(leaf).__module__, type(leaf).__qualname__)
    for path in sorted(files):
        try:
            with open(path, "rb") as f:
                add("file", path, hashlib.sha256(f.read()).hexdigest())
        except OSError:
            add("file", path)
    return h.hexdigest()
