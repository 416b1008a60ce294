"""Capturing a model into the IR (docs/ir.md): `ce_overlap.capture` (a model and its inputs) and `capture_named` (a
zoo model, deep ones extrapolated from shallow captures: ce_overlap.extrapolate), on fake tensors over a fake process
group (inductor/capture.py runs torch.compile). What `ce-overlap capture / analyze` run first."""
from __future__ import annotations

import json
from typing import Any, Sequence

from .. import _core, profiles, progress
from ..errors import CeOverlapError
from ..ir import Ir


def _capture_options(world_size, rank, fsdp, param_dtype, reshard_after_forward, inductor_config,
                     cast_forward_inputs=True, device=None, vocab_parallel_embeddings=False, keep_gathered=(),
                     overlap_scheduler=None, tp=1, tensor_parallel=None, async_tp=False, nodes=1, hsdp=False):
    import torch

    from ..inductor.capture import CaptureOptions

    if not isinstance(world_size, int) or world_size < 1:
        raise CeOverlapError(f"world_size must be an integer >= 1, got {world_size!r}")
    if vocab_parallel_embeddings and not fsdp:
        raise CeOverlapError("vocab_parallel_embeddings shards embeddings by rows, which needs fsdp (in-graph FSDP); "
                             "without it there is no table to gather")
    if isinstance(keep_gathered, str) or not all(isinstance(p, str) and p for p in keep_gathered):
        raise CeOverlapError(f"keep_gathered must be a sequence of submodule paths, got {keep_gathered!r}")
    if keep_gathered and not fsdp:
        raise CeOverlapError("keep_gathered names modules whose gathered weights in-graph FSDP keeps for the "
                             "backward, which needs fsdp")
    dtype = None
    if param_dtype is not None:
        dtype = param_dtype if isinstance(param_dtype, torch.dtype) else getattr(torch, str(param_dtype), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise CeOverlapError(f"param_dtype must be a floating torch dtype or its name, got {param_dtype!r}")
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise CeOverlapError(f"tp must be an integer >= 1 that divides world_size ({world_size}), got {tp!r}")
    if tp > 1 and not fsdp:
        raise CeOverlapError("tp captures tensor parallelism with in-graph FSDP over the other mesh dimension, "
                             "which needs fsdp")
    if tp > 1 and not callable(tensor_parallel):
        raise CeOverlapError(f"tp={tp} needs the model's tensor-parallel plan: a callable (module, tp_mesh) that "
                             "parallelizes it (torch's parallelize_module); a build file defines "
                             "tensor_parallel(module, tp_mesh) beside build()")
    if async_tp and tp <= 1:
        raise CeOverlapError("async_tp (torch's micro-pipeline TP) needs tensor parallelism: tp > 1")
    if not isinstance(nodes, int) or nodes < 1 or world_size % nodes:
        raise CeOverlapError(f"nodes must be an integer >= 1 that divides world_size ({world_size}): the ranks are "
                             f"world_size / nodes per node, got {nodes!r}")
    if tp > 1 and (world_size // nodes) % tp:
        raise CeOverlapError(f"tp={tp} must divide the {world_size // nodes} ranks of a node (tensor parallelism "
                             "stays inside one)")
    if hsdp and (nodes < 2 or not fsdp or tp > 1):
        raise CeOverlapError("hsdp shards inside each node and replicates across nodes: it needs nodes >= 2 and "
                             "fsdp, without tp (HSDP x TP is not supported)")
    if overlap_scheduler is not None:
        profiles.read_text(overlap_scheduler)  # a bad profile is named before the capture starts
    device, reason = capture_device(device)
    return CaptureOptions(world_size=world_size, rank=rank, fsdp=fsdp, param_dtype=dtype,
                          reshard_after_forward=reshard_after_forward, inductor_config=dict(inductor_config or {}),
                          cast_forward_inputs=bool(cast_forward_inputs), device=device, device_reason=reason,
                          vocab_parallel_embeddings=bool(vocab_parallel_embeddings),
                          keep_gathered=tuple(keep_gathered), overlap_scheduler=overlap_scheduler, tp=tp,
                          tensor_parallel=tensor_parallel if tp > 1 else None, async_tp=bool(async_tp),
                          nodes=nodes, hsdp=bool(hsdp))


def capture_device(device: str | None) -> tuple[str, str | None]:
    """The device capture's fake tensors live on, and why when it is not the one asked for. None (the default):
    fake CUDA tensors, the graphs a GPU compiles, unless this torch cannot make them here (then the CPU's)."""
    from ..inductor import fake_cuda

    if device not in (None, "cpu", "cuda"):
        raise CeOverlapError(f"device must be 'cpu' or 'cuda' (fake CUDA tensors, no GPU needed), got {device!r}")
    if device == "cpu":
        return "cpu", None
    reason = fake_cuda.unavailable_reason()
    if reason is None:
        return "cuda", None
    if device == "cuda":
        raise CeOverlapError(f"capture on fake CUDA tensors is not possible here: {reason}; capture with "
                             "device='cpu' (--device cpu)")
    return "cpu", f"fake CUDA tensors are not possible here ({reason})"


def _capture_doc(model, example_inputs, options, meta: dict) -> dict:
    from ..inductor.capture import capture_ir
    from ..inductor.to_ir import CaptureError

    try:
        doc = capture_ir(model, example_inputs, options, meta)
    except BaseException as e:
        progress.end_stage(failed=True)
        if isinstance(e, CaptureError):
            raise CeOverlapError(str(e)) from None
        raise
    progress.end_stage()
    return doc


def _from_doc(doc: dict) -> Ir:
    ir = _core.IrDocument.from_json(json.dumps(doc))
    ir.detect_blocks()
    return Ir(ir)


def capture(model, example_inputs: Sequence[Any], *, world_size: int, rank: int = 0, fsdp: bool = True,
            param_dtype="bfloat16", reshard_after_forward: bool = True, cast_forward_inputs: bool = True,
            inductor_config: dict | None = None, name: str | None = None, meta: dict | None = None,
            device: str | None = None, vocab_parallel_embeddings: bool = False,
            keep_gathered: Sequence[str] = (), overlap_scheduler: str | None = None, tp: int = 1,
            tensor_parallel=None, async_tp: bool = False, nodes: int = 1, hsdp: bool = False) -> Ir:
    """Capture one training step of `model` as Inductor's post-grad graphs, as IR.

    Runs on any machine (fake process group, fake tensors): build the model on the meta device to
    capture large configurations without memory. With `fsdp` the model is wrapped in in-graph FSDP
    over `world_size` ranks (modified in place); with `cast_forward_inputs` (FSDP2's default) its floating
    forward inputs are cast to `param_dtype`. The fake tensors are CUDA tensors (no GPU needed), so the graphs hold
    the kernels Inductor uses on a GPU (SDPA's flash / cuDNN ops, flex attention), unless `device` is "cpu" or this
    torch cannot make them (meta["capture_device"] says which, meta["capture_device_reason"] why).
    `vocab_parallel_embeddings`: fully_shard's (embeddings look up on their row shards). `keep_gathered`: submodules
    (dotted paths) sharded first by a call of their own with reshard_after_forward=False, as torchtitan's FSDP2 wrap
    does for ("norm", "output"): their weights are gathered once per step. The loss is
    the forward's output, or the first tensor of a tuple, list or dict it returns, summed unless it is a scalar
    (meta["loss"] says which). `overlap_scheduler`: a profile; the step is compiled with Inductor's overlap scheduler
    on, its compute estimates from that profile's model, so the graphs hold its order (inductor/overlap_scheduler.py).
    `tp` > 1: tensor parallelism inside, in-graph FSDP across: a ("dp", "tp") mesh of world_size / tp x tp ranks,
    `tensor_parallel(model, tp_mesh)` (the model's plan: torch's parallelize_module) applied first, then the model
    sharded over "dp" (meta["tp"]; each collective's role in the IR says which dimension it serves); `async_tp`: with
    torch's micro-pipeline TP on (async TP: its fused all-gather-matmul and matmul-reduce-scatter ops in the graphs).
    `nodes` > 1: the ranks on that many nodes, world_size / nodes each (consecutive ranks, as torchrun places them;
    meta["nodes"], and each collective's "nodes" in the IR: the cost model prices a group across nodes there);
    `hsdp`: HSDP, a ("replicate", "shard") mesh of nodes x world_size / nodes, shards inside each node.
    Raises CeOverlapError for bad arguments or a model that does not compile to one graph.
    """
    options = _capture_options(world_size, rank, fsdp, param_dtype, reshard_after_forward, inductor_config,
                               cast_forward_inputs, device, vocab_parallel_embeddings, keep_gathered,
                               overlap_scheduler, tp, tensor_parallel, async_tp, nodes, hsdp)
    return _from_doc(_capture_doc(model, example_inputs, options,
                                  {"model": name or type(model).__name__, **(meta or {})}))


# Zoo models deeper than this + 1 blocks are captured at this depth and one deeper, then extrapolated.
EXTRAPOLATE_FROM_BLOCKS = 3


def capture_named(name: str, *, world_size: int, seq_len: int | None = None, batch: int = 1, rank: int = 0,
                  fsdp: bool = True, param_dtype="bfloat16", reshard_after_forward: bool = True,
                  cast_forward_inputs: bool = True, inductor_config: dict | None = None, full: bool = False,
                  device: str | None = None, vocab_parallel_embeddings: bool = False,
                  keep_gathered: Sequence[str] = (), overlap_scheduler: str | None = None, tp: int = 1,
                  async_tp: bool = False, nodes: int = 1, hsdp: bool = False) -> Ir:
    """Capture a zoo model (ce_overlap.models) by name (`tp` > 1: with torchtitan's tensor-parallel plan, capture's
    `tp`; `nodes`, `hsdp`: capture's).

    Its blocks are identical, so unless `full` the model is captured at 3 and 4 blocks and the graphs of all
    its blocks are extrapolated from the two (ce_overlap.extrapolate: exact, node for node, or refused), which
    takes a fixed ~20 s instead of ~2.5 s per block. Where a run of nodes has no interior copy at those depths
    it tries 4 and 5 blocks, and so on; a refused extrapolation falls back to capturing every block and says
    why in meta["capture"].
    """
    import time

    from .. import models
    from ..extrapolate import NeedsDeeperCaptures, NotExtrapolable, extrapolate

    with progress.stage(f"build {name}"):
        built = models.build_named(name, seq_len=seq_len, batch=batch)
    options = _capture_options(world_size, rank, fsdp, param_dtype, reshard_after_forward, inductor_config,
                               cast_forward_inputs, device, vocab_parallel_embeddings, keep_gathered,
                               overlap_scheduler, tp, built.tensor_parallel, async_tp, nodes, hsdp)
    tokens = built.example_inputs[0]
    meta = {"model": name, "batch": int(tokens.shape[0]), "seq_len": int(tokens.shape[1])}
    depth = models.depth(name)
    how = "every block traced"
    started = time.perf_counter()
    docs: dict[int, dict] = {}
    a = EXTRAPOLATE_FROM_BLOCKS
    while not full and a + 2 <= depth:
        for d in (a, a + 1):
            if d not in docs:
                small = models.build_named(name, seq_len=seq_len, batch=batch, n_layers=d)
                with progress.scope(f" ({d} blocks)"):
                    docs[d] = _capture_doc(small.module, small.example_inputs, options, dict(meta))
        try:
            with progress.stage(f"extrapolate to {depth} blocks"):
                doc = extrapolate(docs[a], docs[a + 1], a, depth)
        except NeedsDeeperCaptures as e:
            how = f"every block traced (extrapolation refused: {e})"
            if sum(docs) + a + 2 >= depth:  # one more small capture would cost about what a full one does
                break
            a += 1
            continue
        except NotExtrapolable as e:
            how = f"every block traced (extrapolation refused: {e})"
            break
        doc["meta"].update(num_params=sum(p.numel() for p in built.module.parameters()),
                           capture_seconds=round(time.perf_counter() - started, 3),
                           capture=f"blocks traced at depths {a} and {a + 1}, extrapolated to {depth}")
        return _from_doc(doc)
    with progress.scope(f" ({depth} blocks)"):
        doc = _capture_doc(built.module, built.example_inputs, options, meta)
    doc["meta"]["capture"] = how
    return _from_doc(doc)
