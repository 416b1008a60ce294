"""Capture: run torch.compile on fake tensors over a fake process group and keep Inductor's
post-grad forward and backward graphs as IR.

Inductor is driven through its real pipeline (Dynamo, AOTAutograd with Inductor's decompositions,
joint-graph passes, partitioner, post-grad passes); only code generation is replaced: our inner
compile runs the same pre-lowering steps as Inductor's, records the graph, and returns the graph
itself to run on fake tensors. No real memory is touched, so an 8B model captures on a laptop.
Fake tensors live where options.device says: on a fake CUDA device (ce_overlap.inductor.fake_cuda; what ce_overlap.capture
picks unless it cannot), the graphs a GPU compiles, or on the CPU (Inductor's CPU graphs: SDPA as its CPU flash op,
no flex attention backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import itertools
import logging
import os
import re
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import progress
from ..in_graph.fully_shard import fully_shard, shard_rows
from .overlap_scheduler import INDUCTOR_CONFIG as _SCHEDULER_CONFIG
from .overlap_scheduler import inline_control_deps, running as _scheduler_running
from .to_ir import CaptureError, graph_to_ir, remember_group_sizes


@dataclasses.dataclass(kw_only=True)
class CaptureOptions:
    world_size: int
    """Ranks in the (fake) FSDP group. Must match an already initialized process group, if any."""
    rank: int = 0
    """Rank whose graph is captured (graphs are identical across ranks for FSDP)."""
    fsdp: bool = True
    """Wrap the model in in-graph FSDP (ce_overlap.in_graph.fully_shard). Off: capture the model as it is."""
    param_dtype: torch.dtype | None = torch.bfloat16
    """Dtype parameters are cast to before the all-gather (bf16 mixed precision); None keeps them."""
    reshard_after_forward: bool = True
    """Re-gather parameters in the backward instead of saving them (FSDP's default)."""
    vocab_parallel_embeddings: bool = False
    """With FSDP: embeddings look up their tokens on their row shards (fully_shard's vocab_parallel_embeddings)."""
    keep_gathered: tuple[str, ...] = ()
    """With FSDP: submodules (dotted paths in the model) sharded by a call of their own with reshard_after_forward=False
    before the model's: their gathered weights are kept from the forward to the backward (torchtitan's FSDP2 wrap keeps
    [norm, output] this way: the backward starts with them)."""
    cast_forward_inputs: bool = True
    """With FSDP and a param_dtype: cast the model's floating-point forward inputs to param_dtype, as FSDP2's
    MixedPrecisionPolicy does by default (a float32 image meets bf16 conv weights as bf16)."""
    inductor_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """torch._inductor.config patches in force while compiling (e.g. Inductor's own bucketing)."""
    device: str = "cpu"
    """Where the fake tensors live: "cpu", or "cuda" (fake CUDA tensors on a machine without a GPU, so the graphs are
    the ones Inductor compiles for a GPU: its SDPA kernels, flex attention; ce_overlap.inductor.fake_cuda)."""
    device_reason: str | None = None
    """Why `device` is not the default one, for the capture's meta (capture_device_reason)."""
    overlap_scheduler: str | None = None
    """A profile name or file: compile with Inductor's overlap scheduler on, its compute estimates from that profile's
    cost model (inductor/overlap_scheduler.py), so the graphs hold the order it gives. None: Inductor's config as it is."""
    tp: int = 1
    """Tensor parallelism over this many ranks: a ("dp", "tp") mesh of world_size / tp x tp ranks, the model
    parallelized over "tp" by `tensor_parallel`, then sharded over "dp" (FSDP2 + TP's order)."""
    tensor_parallel: Any = None
    """With tp > 1: the model's tensor-parallel plan, a callable (module, tp_mesh) that parallelizes it in place
    (torch's parallelize_module; ce_overlap.models.llama.tensor_parallel for the zoo)."""
    nodes: int = 1
    """The ranks on this many nodes, world_size / nodes each (consecutive ranks): each group's node count goes into
    the IR (collective "nodes"), and meta["nodes"]."""
    hsdp: bool = False
    """HSDP: a ("replicate", "shard") mesh of nodes x world_size / nodes, shards inside each node, replicas across."""
    async_tp: bool = False
    """With tp > 1: compile with torch's micro-pipeline TP (Inductor's _micro_pipeline_tp, symmetric memory on the TP
    group: what async TP runs), so the graphs hold its fused all-gather-matmul and matmul-reduce-scatter ops."""


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
        inline_control_deps(gm)  # an order Inductor's overlap scheduler fixed, as ordinary nodes
        remember_group_sizes(gm)  # the IR is made after the fake groups are gone
        name = "backward" if is_backward else "forward"
        if not is_backward and not is_inference:  # the backward is compiled when the loss's backward runs
            progress.next_stage(progress.labelled("compile the backward"))
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


_CAPTURES = itertools.count()
COMPILE_FAILED = "torch.compile of the model failed: "  # how a capture error for a model that does not compile begins


def _to_fake(t: torch.Tensor, device: str) -> torch.Tensor:
    """An empty tensor of the same shape and dtype on `device`, created under the active fake mode."""
    return torch.zeros(t.shape, dtype=t.dtype, device=device) if not t.is_floating_point() else \
        torch.empty(t.shape, dtype=t.dtype, device=device)


def _submodule(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise CaptureError(f"keep_gathered: the model has no submodule {path!r}") from None


def _fakeify_module(model: nn.Module, fsdp: bool, group, options: CaptureOptions) -> nn.Module:
    for module in model.modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            module._buffers[name] = _to_fake(buf, options.device)
    if fsdp:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        # A dim name of its own per capture: DTensor caches sharding decisions keyed on meshes, which compare equal
        # across process groups over the same ranks, and each capture's fake group ends with it (a later capture
        # would be handed specs naming an ended group: "Could not resolve the process group ...").
        name = f"ce_overlap_capture_{next(_CAPTURES)}"
        with unset_fake_temporarily():  # the mesh holds real rank tensors
            if options.tp > 1:
                ws = options.world_size
                grid = DeviceMesh(options.device, torch.arange(ws).view(ws // options.tp, options.tp),
                                  mesh_dim_names=(f"{name}_dp", f"{name}_tp"))
                mesh, tp_mesh = grid[f"{name}_dp"], grid[f"{name}_tp"]
            elif options.hsdp:  # FSDP2's HSDP names: fully_shard takes the 2-D mesh itself
                ws = options.world_size
                mesh = DeviceMesh(options.device, torch.arange(ws).view(options.nodes, ws // options.nodes),
                                  mesh_dim_names=("replicate", "shard"))
            else:
                mesh = DeviceMesh.from_group(group, options.device, mesh_dim_names=(name,))
        if options.tp > 1:
            try:
                options.tensor_parallel(model, tp_mesh)
            except Exception as e:  # the user's plan: a capture error naming it, never a crash
                raise CaptureError(f"the tensor-parallel plan failed on the model: {type(e).__name__}: {e}") from e
        mp = MixedPrecisionPolicy(param_dtype=options.param_dtype, cast_forward_inputs=options.cast_forward_inputs)
        for path in options.keep_gathered:
            fully_shard(_submodule(model, path), mesh, mp_policy=mp, reshard_after_forward=False, device=options.device)
        return fully_shard(model, mesh, mp_policy=mp, reshard_after_forward=options.reshard_after_forward,
                           device=options.device, vocab_parallel_embeddings=options.vocab_parallel_embeddings)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            module._parameters[name] = nn.Parameter(_to_fake(p, options.device), requires_grad=p.requires_grad)
    return model


@contextlib.contextmanager
def _async_tp(options: CaptureOptions):
    """With options.async_tp: micro-pipeline TP on, symmetric memory taken as enabled for the tensor-parallel groups
    (torch's test mode: nothing is allocated; the fused ops run on fake tensors)."""
    if not options.async_tp:
        yield
        return
    from torch.distributed import _symmetric_memory as symm_mem

    from ..in_graph.fully_shard import groups_with_role

    with torch._inductor.config.patch(_micro_pipeline_tp=True), symm_mem._test_mode(set(groups_with_role("tp"))):
        yield


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(int(d)) for d in t.shape) + "]"


def _scalar_loss(out) -> tuple[torch.Tensor, dict]:
    """The loss to differentiate: the output if it is a tensor, else the first tensor of a tuple, list or dict;
    summed unless it is a scalar. The meta says which (`loss`) and how many other tensors went unused."""
    where, others = "the output", 0
    if isinstance(out, (tuple, list, dict)):
        items = list(out.items()) if isinstance(out, dict) else list(enumerate(out))
        tensors = [(k, v) for k, v in items if isinstance(v, torch.Tensor)]
        kind = type(out).__name__
        if tensors:
            key, out = tensors[0]
            others = len(tensors) - 1
            where = f"output[{key!r}]" if isinstance(key, str) else f"output[{key}]"
            where += f" (the first of {len(tensors)} tensors in a {kind})" if others else f" (of a {kind})"
        else:
            out = None
    if not isinstance(out, torch.Tensor):
        raise CaptureError("the model's forward returned no tensor; capture needs one to differentiate")
    if out.dim() == 0:
        return out, {"loss": f"{where}, a scalar", "loss_unused_outputs": others}
    return out.float().sum(), {"loss": f"the sum of {where}, shape {_shape(out)} (not a scalar)",
                               "loss_unused_outputs": others}


def _fsdp_padding(model: nn.Module, options: CaptureOptions) -> dict:
    """What FSDP's dim-0 padding adds to each gather (and reduce-scatter) of the parameters whose first dim the
    world size does not divide: bytes in the gathered dtype, how many parameters, the largest one."""
    ws = options.world_size
    total, count, largest = 0, 0, None
    for name, p in model.named_parameters():  # a tied Parameter once
        if p.dim() == 0:
            continue
        rows = p.shape[0]
        pad_rows = shard_rows(rows, ws) * ws - rows
        if not pad_rows:
            continue
        itemsize = torch.empty((), dtype=options.param_dtype or p.dtype).element_size()
        nbytes = pad_rows * (p.numel() // rows if rows else 0) * itemsize
        total += nbytes
        count += 1
        if largest is None or nbytes > largest[0]:
            largest = (nbytes, f"{name}: {rows} -> {rows + pad_rows} rows")
    return {"fsdp_padding_bytes": total, "fsdp_padded_params": count,
            **({"fsdp_padding_largest": largest[1]} if largest else {})}


_PACKAGE_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _failure_message(e: BaseException) -> str:
    """One line for a failed compile: the error that caused it first (torch wraps it, e.g. a fake tensor call's
    RuntimeError inside TorchRuntimeError or Dynamo's Unsupported, and shows the wrapper), then the user's code
    line torch names, then the wrapper."""
    def first_line(x: BaseException) -> str:
        text = str(x).strip()
        return text.splitlines()[0].strip() if text else ""

    chain, x = [], e
    while x is not None and all(x is not c for c in chain) and len(chain) < 20:
        chain.append(x)
        x = x.__cause__ or (None if x.__suppress_context__ else x.__context__)
    texts = "\n".join(str(c) for c in chain)
    # Dynamo's wrappers quote the op's own error as `got RuntimeError('...')`.
    quoted = re.findall(r"got (\w+)\((['\"])(.*?)\2\)", texts)
    # A backend's failure: BackendCompilerFailed names it on the line after "raised:" (torch 2.11 chains no cause).
    raised = re.findall(r"raised:\n(\w+): ([^\n]*)", texts)
    if quoted:
        cause = f"{quoted[-1][0]}: {quoted[-1][2]}"
    elif raised and len(chain) == 1:
        cause = f"{raised[-1][0]}: {raised[-1][1]}".rstrip(": ")
    else:
        inner = chain[-1]
        cause = f"{type(inner).__name__}: {first_line(inner)}".rstrip(": ")
    outer = f"{type(e).__name__}: {first_line(e)}".rstrip(": ")
    text = cause
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', texts)
    user = [f for f in frames if not os.path.abspath(f[0]).startswith(_PACKAGE_DIRS)]
    if user or frames:
        path, line, fn = (user or frames)[-1]
        text += f" (in {fn}, {path}:{line})"
    if outer != cause:
        text += f"; raised as {outer}"
    return text


def capture_graphs(model: nn.Module, example_inputs: Sequence[Any], options: CaptureOptions
                   ) -> tuple[list[tuple[str, torch.fx.GraphModule]], dict]:
    """Compiles one training step of `model` (forward, scalar loss, backward) on fake tensors.

    The model is modified in place (sharded, parameters replaced by fake shards): pass a fresh one,
    ideally built on the meta device. Returns the post-grad graphs and capture metadata.
    """
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .capture_state import capture_mode  # the graphs only run on fake tensors: a pass in inductor_config may emit CE ops

    num_params = sum(p.numel() for p in model.parameters())
    padding = _fsdp_padding(model, options) if options.fsdp else {}
    cast_dtype = options.param_dtype if options.fsdp and options.cast_forward_inputs else None
    inputs_cast = sum(1 for x in torch.utils._pytree.tree_leaves(list(example_inputs))
                      if cast_dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point()
                      and x.dtype != cast_dtype)
    recorder = _Recorder()
    started = time.perf_counter()
    torch._dynamo.reset()
    patches = {"fx_graph_cache": False, **options.inductor_config}
    scheduler_ctx = contextlib.nullcontext()
    if options.overlap_scheduler:
        patches.update(_SCHEDULER_CONFIG)
        scheduler_ctx = _scheduler_running(options.overlap_scheduler)
    # Our regather policy is pure (no in-place ops); torch warns about any context_fn once.
    sac_log = logging.getLogger("torch._higher_order_ops.wrap")
    sac_level = sac_log.level
    sac_log.setLevel(logging.ERROR)
    # Tracing allocates millions of short-lived objects; the cyclic collector's passes over them cost
    # ~20% of an 8B capture and free nothing that matters before the capture ends.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    device_ctx = contextlib.nullcontext()
    if options.device == "cuda":
        from . import fake_cuda

        device_ctx = fake_cuda.enabled()
    elif options.device != "cpu":
        raise CaptureError(f"capture device must be 'cpu' or 'cuda', got {options.device!r}")
    from .. import nodes
    from ..runtime import hierarchical

    try:
        with device_ctx, nodes.simulated(options.world_size // options.nodes), nodes.kept_apart(), \
                hierarchical.kept_apart(), \
                torch.autograd.set_multithreading_enabled(False), \
                fake_process_group(options.world_size, options.rank) as group, \
                torch._inductor.config.patch(patches), scheduler_ctx, \
                torch._functorch.config.patch(enable_autograd_cache=False), \
                capture_mode(), FakeTensorMode(allow_non_fake_inputs=True):
            progress.next_stage(progress.labelled("trace and compile the forward"))
            model = _fakeify_module(model, options.fsdp, group, options)
            inputs = [_to_fake(x, options.device) if isinstance(x, torch.Tensor) else x for x in example_inputs]
            backend = functools.partial(compile_fx, inner_compile=recorder.inner_compile)
            compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
            try:
                with _async_tp(options):
                    loss, loss_meta = _scalar_loss(compiled(*inputs))
                    if loss.requires_grad:
                        loss.backward()
            except CaptureError:
                raise
            except Exception as e:  # the model failed to compile or run: a user-facing error, not a crash
                raise CaptureError(f"{COMPILE_FAILED}{_failure_message(e)}") from e
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
        **({"tp": options.tp} if options.tp > 1 else {}),
        **({"async_tp": True} if options.async_tp else {}),
        **({"nodes": options.nodes} if options.nodes > 1 else {}),
        **({"hsdp": True} if options.hsdp else {}),
        **({"vocab_parallel_embeddings": True} if options.fsdp and options.vocab_parallel_embeddings else {}),
        **({"keep_gathered": ",".join(options.keep_gathered)} if options.fsdp and options.keep_gathered else {}),
        "num_params": num_params,
        "torch": torch.__version__,
        "capture_device": options.device,
        **({"overlap_scheduler": options.overlap_scheduler} if options.overlap_scheduler else {}),
        **({"capture_device_reason": options.device_reason} if options.device_reason else {}),
        **loss_meta,
        **padding,
    }
    if options.fsdp and options.param_dtype is not None:
        meta["cast_forward_inputs"] = options.cast_forward_inputs
        meta["forward_inputs_cast"] = inputs_cast
    return recorder.graphs, meta


def capture_ir(model: nn.Module, example_inputs: Sequence[Any], options: CaptureOptions,
               extra_meta: dict | None = None) -> dict:
    """capture_graphs, converted to an IR document dict (blocks not yet detected)."""
    graphs, meta = capture_graphs(model, example_inputs, options)
    progress.next_stage(progress.labelled("convert to the IR"))
    if not graphs:
        raise CaptureError("torch.compile produced no graph (nothing to compile in forward?)")
    meta.update(extra_meta or {})
    return {"schema": "ce_overlap.ir/1", "meta": meta, "blocks": [],
            "graphs": [graph_to_ir(gm, name) for name, gm in graphs]}
