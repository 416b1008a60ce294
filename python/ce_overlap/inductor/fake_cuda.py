"""Fake CUDA tensors on a machine without a GPU, for capture (docs/notes/fake_cuda_capture.md).

Capture on fake `cuda` tensors gives the post-grad graphs Inductor builds for a GPU (its SDPA kernels, flex
attention, which has no CPU backward) instead of its CPU graphs. Dynamo, AOTAutograd and the post-grad passes run
on fake CUDA tensors without a driver given three changes, each in force only inside `enabled()`:

1. `CUDAHooks::hasPrimaryContext(i)` answers true. The autograd engine asks it for every device the CUDA guard
   reports before any backward (FakeTensorMode installs a guard that reports devices) and otherwise raises
   "hasPrimaryContext expects a valid device index". The method is virtual and torch has no Python switch for it, so
   the hooks object's vtable pointer is swapped for a copy with that one slot replaced (the slot found from the
   installed torch's own header, checked by calling `isBuilt` through the computed table first), and swapped back
   on exit.
2. Inductor's joint-graph constant folding evaluates size-1 tensors on the graph's device to learn their value: those
   ops run on the CPU instead (only the value is kept).
3. The SDPA backend choice: the C++ selector needs a device and otherwise picks the math path; ours picks as torch
   does on the target, sm90 (cuDNN first, as torch 2.11 did on 4x H200 with the zoo's Llama,
   bench/results/fully-shard-2026-11-27; then flash, memory-efficient, math) from the basic constraints.

On a machine with a GPU nothing is patched: fake CUDA tensors work there as they are.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import threading

import torch

_lock = threading.Lock()
_active = 0  # nesting depth of enabled()
_registered = False
_keep: list = []  # ctypes objects a patched vtable points into: they live as long as the process


class FakeCudaUnavailable(RuntimeError):
    """This torch cannot capture on fake CUDA tensors here; the message says why."""


def _torch_dir() -> str:
    return os.path.dirname(torch.__file__)


def _vtable_slot(method: str) -> int:
    """Itanium-ABI vtable slot of `method` in at::AcceleratorHooksInterface (CUDAHooksInterface derives from it and
    appends its own virtuals after): the header's virtual functions in order, a destructor taking two slots."""
    header = os.path.join(_torch_dir(), "include", "ATen", "detail", "AcceleratorHooksInterface.h")
    try:
        src = open(header).read()
    except OSError as e:
        raise FakeCudaUnavailable(f"torch's header {header} is not installed ({e.strerror})") from None
    src = re.sub(r"//[^\n]*", "", src)
    start = src.find("struct TORCH_API AcceleratorHooksInterface")
    if start < 0:
        raise FakeCudaUnavailable(f"{header} does not declare AcceleratorHooksInterface as expected")
    body = src[start:src.index("\n};", start)]
    slots: list[str] = []
    for name in re.findall(r"virtual\s+(?:[\w:<>*&,\s]+?\s)?(~?\w+)\s*\(", body):
        slots += [name, name] if name.startswith("~") else [name]
    if method not in slots:
        raise FakeCudaUnavailable(f"{header} has no virtual {method}")
    return slots.index(method)


class _HooksPatch:
    """The CUDA hooks object's vtable pointer, swapped for a copy whose hasPrimaryContext answers true."""

    _TABLE = 64  # entries copied: more than AcceleratorHooksInterface + CUDAHooksInterface declare

    def __init__(self):
        lib = os.path.join(_torch_dir(), "lib", "libtorch_cpu.so")
        try:
            get = ctypes.CDLL(lib)._ZN2at6detail12getCUDAHooksEv
        except (OSError, AttributeError) as e:
            raise FakeCudaUnavailable(f"at::detail::getCUDAHooks is not exported by {lib} ({e})") from None
        get.restype = ctypes.c_void_p
        self.hooks = get()
        self.original = ctypes.c_void_p.from_address(self.hooks).value
        ptr = ctypes.sizeof(ctypes.c_void_p)
        # offset-to-top and typeinfo precede the address the object points at
        old = (ctypes.c_void_p * (2 + self._TABLE)).from_address(self.original - 2 * ptr)
        is_built = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(old[2 + _vtable_slot("isBuilt")])
        if not is_built(self.hooks):
            raise FakeCudaUnavailable("the CUDA hooks' vtable is not laid out as torch's header says (isBuilt "
                                      "through the computed slot answered false), or this torch has no CUDA")
        answer_true = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_int8)(lambda this, index: True)
        table = (ctypes.c_void_p * (2 + self._TABLE))(*old)
        table[2 + _vtable_slot("hasPrimaryContext")] = ctypes.cast(answer_true, ctypes.c_void_p).value
        _keep.extend([answer_true, table])
        self.patched = ctypes.addressof(table) + 2 * ptr

    def apply(self, on: bool) -> None:
        ctypes.c_void_p.from_address(self.hooks).value = self.patched if on else self.original


_hooks: _HooksPatch | None = None


class _CudaOpsOnCpu(torch.utils._python_dispatch.TorchDispatchMode):
    """Runs real (not fake) ops that target CUDA on the CPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def cpu(x):
            return torch.device("cpu") if isinstance(x, torch.device) and x.type == "cuda" else x

        args, kwargs = torch.utils._pytree.tree_map(cpu, (args, kwargs or {}))
        return func(*args, **kwargs)


# Which kernels take grouped-query attention (fewer K/V heads) as it is: torch 2.11's SDPA documents flash and math
# only, torch 2.14's flash, cuDNN, memory-efficient and math.
_GQA_IN_CUDNN_AND_EFFICIENT = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 14)


def _sdpa_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False) -> int:
    """The SDPBackend torch would pick on the target GPU, from the basic constraints of each kernel. The target is
    sm90, the GPU of every built-in profile (H100, H200)."""
    from torch.nn.attention import SDPBackend as B

    half = q.dtype in (torch.float16, torch.bfloat16)
    d, dv = q.shape[-1], v.shape[-1]
    gqa_everywhere = not enable_gqa or _GQA_IN_CUDNN_AND_EFFICIENT
    ok = {
        B.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled() and half and d == dv and d <= 128
                           and d % 8 == 0 and gqa_everywhere,
        B.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled() and half and attn_mask is None and d == dv
                           and d <= 256 and d % 8 == 0,
        B.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled() and gqa_everywhere
                               and (q.dtype == torch.float32 or half) and d % (8 if half else 4) == 0,
        B.MATH: torch.backends.cuda.math_sdp_enabled(),
    }
    order = [B(i) for i in torch._C._get_sdp_priority_order()]
    order = [B.CUDNN_ATTENTION] + [b for b in order if b != B.CUDNN_ATTENTION]  # sm90: cuDNN first (H200, 2.11)
    return next((int(b.value) for b in order if ok.get(b)), int(B.ERROR.value))


def _register_once() -> None:
    """The process-wide registrations (fake impl, py_impl, constant folder); each does nothing unless enabled()."""
    global _registered
    if _registered:
        return
    from torch._C import DispatchKey
    from torch._inductor.fx_passes import joint_graph
    from torch._subclasses import fake_impls
    from torch.nn.attention import SDPBackend as B

    folder = joint_graph.UniformValueConstantFolder
    fold = folder.run

    def run(self, *args, **kwargs):  # called under _disable_current_modes(): ours goes inside
        if not _active:
            return fold(self, *args, **kwargs)
        with _CudaOpsOnCpu():
            return fold(self, *args, **kwargs)

    folder.run = run

    choice_op = torch.ops.aten._fused_sdp_choice.default
    if choice_op not in fake_impls.op_implementations_dict:
        @fake_impls.register_op_impl(choice_op)
        def fused_sdp_choice(fake_mode, func, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                             enable_gqa=False):
            if not _active or q.device.type != "cuda":
                return NotImplemented  # FakeTensorMode uses the meta kernel
            return _sdpa_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    # SDPA's C++ composite calls the selector stub directly; with the Python dispatcher on (AOTAutograd, make_fx) a
    # py_impl at its key replaces the C++ decomposition.
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    aten = torch.ops.aten

    def decompose(*args, **kwargs):  # the C++ composite itself (sdpa.decompose would call sdpa_impl again)
        return sdpa._op_dk(DispatchKey.CompositeImplicitAutograd, *args, **kwargs)

    def sdpa_impl(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        if _active and q.device.type == "cuda" and q.dim() == 4:
            c = B(_sdpa_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa))
            lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            if c == B.CUDNN_ATTENTION and attn_mask is None:
                return aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, dropout_p, is_causal,
                                                                scale=scale)[0]
            if c == B.FLASH_ATTENTION:  # grouped K / V heads go in as they are
                return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
            if c == B.EFFICIENT_ATTENTION and (attn_mask is None or attn_mask.dtype != torch.bool):
                return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, lse, dropout_p, is_causal,
                                                                    scale=scale)[0]
        return decompose(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    sdpa.py_impl(DispatchKey.CompositeImplicitAutograd)(sdpa_impl)
    _registered = True


def unavailable_reason() -> str | None:
    """None when capture on fake CUDA tensors works in this process, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if torch.cuda.is_available():
        return None
    global _hooks
    try:
        with _lock:
            if _hooks is None:
                _hooks = _HooksPatch()
    except FakeCudaUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 (a header or library unlike the one this was written against)
        return f"the CUDA hooks could not be prepared ({type(e).__name__}: {e})"
    return None


@contextlib.contextmanager
def enabled():
    """Fake CUDA tensors can be compiled and differentiated inside; raises FakeCudaUnavailable where they cannot."""
    global _active
    reason = unavailable_reason()
    if reason is not None:
        raise FakeCudaUnavailable(reason)
    if torch.cuda.is_available():  # a real device answers for itself: nothing to change
        yield
        return
    with _lock:
        _register_once()
        if _active == 0 and _hooks is not None:
            _hooks.apply(True)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0 and _hooks is not None:
                _hooks.apply(False)
