"""Capture: run torch.compile on fake tensors over a fake process group and keep Inductor's
post-grad forward and backward graphs as IR.

Inductor is driven through its real pipeline (Dynamo, AOTAutograd with Inductor's decompositions,
joint-graph passes, partitioner, post-grad passes); only code generation is replaced: our inner
compile runs the same pre-lowering steps as Inductor's, records the graph, and returns the graph
itself to run on fake tensors. No real memory is touched, so an 8B model captures on a laptop.
Fake tensors live on the CPU: autograd cannot run fake CUDA tensors on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .fsdp import fully_shard_in_graph
from .to_ir import CaptureError, graph_to_ir


@dataclasses.dataclass(kw_only=True)
class CaptureOptions:
    world_size: int
    """Ranks in the (fake) FSDP group. Must match an already initialized process group, if any."""
    rank: int = 0
    """Rank whose graph is captured (graphs are identical across ranks for FSDP)."""
    fsdp: bool = True
    """Wrap the model in in-graph FSDP (ce_overlap.fx.fsdp). Off: capture the model as it is."""
    param_dtype: torch.dtype | None = torch.bfloat16
    """Dtype parameters are cast to before the all-gather (bf16 mixed precision); None keeps them."""
    reshard_after_forward: bool = True
    """Re-gather parameters in the backward instead of saving them (FSDP's default)."""
    inductor_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """torch._inductor.config patches in force while compiling (e.g. Inductor's own bucketing)."""


def _inductor_pre_lowering(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], is_inference: bool):
    """What Inductor's fx_codegen_and_compile does to a graph before lowering it.

    Inductor re-runs FakeTensorProp over the partitioned graph; AOTAutograd already left a fake value on
    every node, and re-propagating them changes no shape, dtype or stride we record (the IR is
    byte-identical either way: tests/test_capture.py), so it is skipped when every node has one: 7-10%
    of a capture.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop, view_to_reshape
    from torch._inductor.virtualized import V

    view_to_reshape(gm)
    fake_mode = detect_fake_mode(example_inputs)
    has_vals = all("val" in n.meta for n in gm.graph.nodes if n.op != "output")
    if fake_mode is None or not has_vals or _REFRESH_FAKE_VALUES:
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
    with V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(gm, is_inference=is_inference)


# Tests set this to compare a capture with Inductor's own re-propagation against one without.
_REFRESH_FAKE_VALUES = False


class _Recorder:
    def __init__(self):
        self.graphs: list[tuple[str, torch.fx.GraphModule]] = []

    def inner_compile(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        is_backward = bool(kwargs.get("is_backward", False))
        is_inference = bool(kwargs.get("is_inference", False))
        _inductor_pre_lowering(gm, example_inputs, is_inference)
        name = "backward" if is_backward else "forward"
        if any(n == name for n, _ in self.graphs):
            raise CaptureError(f"capture expected one {name} graph, got another: the model has a graph break "
                               "or recompiled; make it compile with fullgraph=True")
        self.graphs.append((name, gm))

        def run(args):
            return gm(*args)

        run._boxed_call = True  # AOTAutograd passes a list it may clear
        return run


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A 'fake' backend default group (no communication, shapes only), unless one exists already."""
    if world_size < 1:
        raise CaptureError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise CaptureError(f"rank must be in [0, {world_size}), got {rank}")
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise CaptureError(f"a process group of size {dist.get_world_size()} is already initialized; "
                               f"cannot capture at world_size {world_size}")
        yield dist.group.WORLD
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _to_fake_cpu(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of the same shape and dtype, created under the active fake mode."""
    return torch.zeros(t.shape, dtype=t.dtype, device="cpu") if not t.is_floating_point() else \
        torch.empty(t.shape, dtype=t.dtype, device="cpu")


def _fakeify_module(model: nn.Module, fsdp: bool, group, options: CaptureOptions) -> nn.Module:
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = _to_fake_cpu(buf)
    if fsdp:
        return fully_shard_in_graph(model, group, param_dtype=options.param_dtype,
                                    reshard_after_forward=options.reshard_after_forward, device="cpu")
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module._parameters[name] = nn.Parameter(_to_fake_cpu(p), requires_grad=p.requires_grad)
    return model


def _scalar_loss(out) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = next((o for o in out if isinstance(o, torch.Tensor)), None)
    elif isinstance(out, dict):
        out = next((o for o in out.values() if isinstance(o, torch.Tensor)), None)
    if not isinstance(out, torch.Tensor):
        raise CaptureError("the model's forward returned no tensor; capture needs one to differentiate")
    return out if out.dim() == 0 else out.float().sum()


def capture_graphs(model: nn.Module, example_inputs: Sequence[Any], options: CaptureOptions
                   ) -> tuple[list[tuple[str, torch.fx.GraphModule]], dict]:
    """Compiles one training step of `model` (forward, scalar loss, backward) on fake tensors.

    The model is modified in place (sharded, parameters replaced by fake shards): pass a fresh one,
    ideally built on the meta device. Returns the post-grad graphs and capture metadata.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .pass_ import capture_mode  # the graphs only run on fake tensors: a pass in inductor_config may emit CE ops

    num_params = sum(p.numel() for p in model.parameters())
    recorder = _Recorder()
    started = time.perf_counter()
    torch._dynamo.reset()
    patches = {"fx_graph_cache": False, **options.inductor_config}
    # Our regather policy is pure (no in-place ops); torch warns about any context_fn once.
    sac_log = logging.getLogger("torch._higher_order_ops.wrap")
    sac_level = sac_log.level
    sac_log.setLevel(logging.ERROR)
    # Tracing allocates millions of short-lived objects; the cyclic collector's passes over them cost
    # ~20% of an 8B capture and free nothing that matters before the capture ends.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with fake_process_group(options.world_size, options.rank) as group, \
                torch._inductor.config.patch(patches), \
                torch._functorch.config.patch(enable_autograd_cache=False), \
                capture_mode(), FakeTensorMode(allow_non_fake_inputs=True):
            model = _fakeify_module(model, options.fsdp, group, options)
            inputs = [_to_fake_cpu(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
            backend = functools.partial(compile_fx, inner_compile=recorder.inner_compile)
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            try:
                loss = _scalar_loss(compiled(*inputs))
                if loss.requires_grad:
                    loss.backward()
            except CaptureError:
                raise
            except Exception as e:  # the model failed to compile or run: a user-facing error, not a crash
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise CaptureError(f"torch.compile of the model failed: {type(e).__name__}: {first}") from e
    finally:
        sac_log.setLevel(sac_level)
        torch._dynamo.reset()
        if gc_was_enabled:
            gc.enable()
    meta = {
        "capture_seconds": round(time.perf_counter() - started, 3),
        "world_size": options.world_size,
        "rank": options.rank,
        "fsdp": options.fsdp,
        "param_dtype": str(options.param_dtype).removeprefix("torch.") if options.param_dtype else "none",
        "reshard_after_forward": options.reshard_after_forward,
        "num_params": num_params,
        "torch": torch.__version__,
    }
    return recorder.graphs, meta


def capture_ir(model: nn.Module, example_inputs: Sequence[Any], options: CaptureOptions,
               extra_meta: dict | None = None) -> dict:
    """capture_graphs, converted to an IR document dict (blocks not yet detected)."""
    graphs, meta = capture_graphs(model, example_inputs, options)
    if not graphs:
        raise CaptureError("torch.compile produced no graph (nothing to compile in forward?)")
    meta.update(extra_meta or {})
    return {"schema": "ce_overlap.ir/1", "meta": meta, "blocks": [],
            "graphs": [graph_to_ir(gm, name) for name, gm in graphs]}
