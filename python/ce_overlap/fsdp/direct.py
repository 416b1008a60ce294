"""ce_overlap.fsdp's direct path: FSDP2's all-gather lands in the unsharded parameters themselves and its
reduce-scatter reads the unsharded gradients where autograd left them, on copy engines, without FSDP2's copy kernels.

What FSDP2 runs around its collectives (torch 2.11 and 2.14, `_fsdp_collectives.py`), per FSDP group:
  all-gather: a cast of the fp32 shards into a bf16 buffer, a copy of it into the all-gather output (copy-in, on its
    copy-in stream), the collective, then `split_with_sizes_copy` of the whole output into the unsharded parameters
    (copy-out, on the compute stream);
  reduce-scatter: `chunk_cat` of the bf16 gradients into an fp32 input (on the compute stream), the collective.
Measured on 2x H200 (Llama-3-8B widths, 8 layers, seq 4096; bench/results/fsdp2-2026-11-26): 24 ms of copy kernels
per 151 ms step, 17 ms of them on the compute stream. Swapping the collectives (FSDP2's AllGather / ReduceScatter
extension points) cannot remove them: FSDP2 calls the kernels itself.

Here, per FSDP group:
  all-gather: the shards are cast into a slot of the group's symmetric pool (one ring of slots per process group,
    taken in the same order on every rank, so no allocation is agreed per call); every parameter's all-gather output
    storage is pointed into one block of a stream-ordered cache (`_block_acquire` / `_storage_lease`, freed by
    FSDP2's own resize_(0) at reshard); the copy engines pull every peer's shard of every parameter from its slot
    straight into the parameter (`all_gather_into_tensors_out`). No copy-in, no copy-out kernel.
  reduce-scatter: the copy engines push each gradient's chunks from the gradients themselves; one bounded reduction
    kernel sums them in fp32 into the fp32 output (`reduce_scatter_tensors_out`, widening: 16-bit gradients move,
    half the bytes of FSDP2's fp32 cast), which becomes the sharded gradient as in FSDP2. No chunk_cat.

FSDP2's module-level functions that its param group calls (`foreach_all_gather`, `foreach_all_gather_copy_out`,
`foreach_reduce`) are wrapped once (`install`): an FSDP group whose comm objects are this module's `DirectAllGather`
/ `DirectReduceScatter` takes the direct path, every other group runs FSDP2's own code unchanged. A group the direct
path does not cover (`unsupported`) keeps ce_overlap.fsdp's comm objects on FSDP2's own path.
"""
from __future__ import annotations

import functools

from ..errors import CeOverlapError

# Slots per process group: the cast of all-gather n + SLOTS waits until all-gather n left its slot on every rank.
SLOTS = 2
# Byte alignment of each parameter inside a block (vector loads of the compute that reads them).
BLOCK_ALIGN = 256

_originals: dict[str, object] = {}
_reduce_returns = 0  # how many values this torch's foreach_reduce returns (set by install)


def _fsdp_modules():
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group

    return collectives, param_group


def _reduce_arity(foreach_reduce) -> int:
    """How many values this torch's foreach_reduce returns (2.11: 6, 2.14: 7, with the post-reduce stream), 0 when its
    annotation does not say."""
    import inspect
    import typing

    try:
        ann = inspect.signature(foreach_reduce).return_annotation
        if isinstance(ann, str):
            return 0
        return len(typing.get_args(ann))
    except (TypeError, ValueError):
        return 0


def missing() -> str:
    """Why this torch cannot take the direct path ("" when it can)."""
    try:
        collectives, param_group = _fsdp_modules()
    except ImportError as e:
        return f"torch has no FSDP2 internals to hook ({e})"
    for name in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce"):
        if not callable(getattr(param_group, name, None)):
            return f"torch's FSDP2 param group has no {name}"
    if not hasattr(collectives, "AllGatherResult") or not hasattr(collectives, "_get_gradient_divide_factors"):
        return "torch's FSDP2 has no AllGatherResult / _get_gradient_divide_factors"
    arity = _reduce_arity(_originals.get("foreach_reduce", param_group.foreach_reduce))
    if arity not in (6, 7):
        return f"torch's FSDP2 foreach_reduce returns {arity or 'an unknown number of'} values (2.11: 6, 2.14: 7)"
    return ""


def install() -> None:
    """Wraps FSDP2's foreach_all_gather / foreach_all_gather_copy_out / foreach_reduce in its param-group module, once.
    Groups without this module's comm objects run the originals."""
    if _originals:
        return
    why = missing()
    if why:
        raise CeOverlapError(f"ce_overlap.fsdp: the direct path cannot hook this torch: {why}")
    global _reduce_returns
    _, param_group = _fsdp_modules()
    _reduce_returns = _reduce_arity(param_group.foreach_reduce)
    _originals.update(foreach_all_gather=param_group.foreach_all_gather,
                      foreach_all_gather_copy_out=param_group.foreach_all_gather_copy_out,
                      foreach_reduce=param_group.foreach_reduce)
    param_group.foreach_all_gather = _foreach_all_gather
    param_group.foreach_all_gather_copy_out = _foreach_all_gather_copy_out
    param_group.foreach_reduce = _foreach_reduce


def unsupported(param_group) -> str:
    """Why the direct path does not cover this FSDP group ("" when it does). It covers FSDP2's common case: 1-D
    sharding on dim 0, no CPU offload, no tensor-subclass all-gather extensions, one all-gather dtype, no
    reshard_after_forward=int (a post-forward group), no HSDP, gradients whose dim 0 the group size divides."""
    if getattr(param_group, "_use_post_forward_mesh", False):
        return "reshard_after_forward=int (a post-forward group)"
    if param_group.mesh_info.__class__.__name__ != "FSDPMeshInfo":
        return f"{param_group.mesh_info.__class__.__name__} (HSDP / replicated meshes keep FSDP2's path)"
    world = param_group.mesh_info.shard_process_group.size()
    dtypes = set()
    for p in param_group.fsdp_params:
        if p.fsdp_placement.dim != 0:
            return f"a parameter sharded on dim {p.fsdp_placement.dim}"
        if p.offload_to_cpu:
            return "CPU offload"
        if hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "a tensor subclass with its own all-gather (fsdp_pre_all_gather)"
        if p._orig_size[0] % world:
            return f"a parameter of {p._orig_size[0]} rows over {world} ranks (padded shards)"
        dtypes.add(param_group.mp_policy.param_dtype or p.sharded_param.dtype)
    if len(dtypes) != 1:
        return f"parameters gathered in several dtypes {sorted(str(d) for d in dtypes)}"
    return ""


class _SlotRing:
    """SLOTS symmetric byte buffers of one process group (each at the same pool offset on every rank), taken in turn:
    slot i is written again only after the all-gather that read it ended on every rank (its event, waited on the
    stream that writes it; the all-gather's end includes every peer's done)."""

    def __init__(self, group, nbytes: int):
        import torch

        from .. import runtime as rt

        self.nbytes = nbytes
        self.slots = [rt.empty_symmetric([nbytes], torch.uint8, group) for _ in range(SLOTS)]
        self.events = [None] * SLOTS
        self.next = 0

    def take(self, stream):
        i = self.next
        self.next = (i + 1) % SLOTS
        if self.events[i] is not None:
            stream.wait_event(self.events[i])
        return i, self.slots[i]


_rings: dict[str, _SlotRing] = {}


def slot_ring(group, nbytes: int) -> _SlotRing:
    """The slot ring of `group` (rendezvoused), created on first use with slots of at least `nbytes` (collective: every
    rank creates it at the same point, in use_copy_engines)."""
    ring = _rings.get(group.group_name)
    if ring is None or ring.nbytes < nbytes:
        ring = _rings[group.group_name] = _SlotRing(group, nbytes)
    return ring


def forget_rings(group_names) -> None:
    """Drops the slot rings of these groups (before their pools close)."""
    for name in group_names:
        _rings.pop(name, None)


def _aligned(n: int) -> int:
    return -(-n // BLOCK_ALIGN) * BLOCK_ALIGN


class _Counters:
    """Collectives the direct path ran (tests check that every FSDP2 collective took it)."""

    all_gathers = 0
    reduce_scatters = 0


counters = _Counters()


@functools.cache
def _classes():
    """(DirectResult, DirectAllGather, DirectReduceScatter): made once, on first use (they subclass FSDP2's types)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    collectives, _ = _fsdp_modules()

    class DirectResult(collectives.AllGatherResult):
        """FSDP2's all-gather result for a direct all-gather: the parameters already hold the gathered bytes."""

        __slots__ = ()

    class DirectAllGather(AllGather):
        """FSDP2's all-gather straight into the unsharded parameters on copy engines. Called on FSDP2's own path (a
        call `gather` declined), it runs torch.distributed's all-gather."""

        def __init__(self, param_group, ring: _SlotRing):
            self.param_group, self.ring = param_group, ring

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

        def gather(self, fsdp_params, group, copy_in_stream, all_gather_stream, device):
            """The direct all-gather of `fsdp_params` (enqueued; FSDP2 waits for the returned event), or None where
            FSDP2's own path must run (a parameter not in its sharded state)."""
            world = group.size()
            if any(p.sharded_state != ShardedState.SHARDED for p in fsdp_params):
                return None
            shards = [p._sharded_param_data for p in fsdp_params]
            dtype = self.param_group.mp_policy.param_dtype or shards[0].dtype
            numels = [s.numel() for s in shards]
            esize = dtype.itemsize
            with torch.cuda.stream(copy_in_stream):
                index, slot = self.ring.take(copy_in_stream)
                inputs = list(torch.split(slot[: sum(numels) * esize].view(dtype), numels))
                torch._foreach_copy_(inputs, shards)
                offsets, total = [], 0
                for p, n in zip(fsdp_params, numels):
                    p.init_all_gather_outputs([n], [dtype], world, device)
                    offsets.append(total)
                    total += _aligned(n * world * esize)
                outs = [p.all_gather_outputs[0] for p in fsdp_params]
                block = torch.ops.ce_overlap._block_acquire(total, device)
                torch.ops.ce_overlap._storage_lease(outs, block, offsets)
            all_gather_stream.wait_stream(copy_in_stream)
            with torch.cuda.stream(all_gather_stream):
                torch.ops.ce_overlap.all_gather_into_tensors_out(inputs, world, group.group_name, outs=outs)
                event = all_gather_stream.record_event()
            self.ring.events[index] = event
            counters.all_gathers += 1
            return DirectResult(slot[:0], event, None, [[dtype] for _ in numels], [[n] for n in numels], numels)

    class DirectReduceScatter(ReduceScatter):
        """FSDP2's reduce-scatter from the unsharded gradients on copy engines. Called on FSDP2's own path (a call
        `reduce` declined), it runs torch.distributed's reduce-scatter."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

        def reduce(self, fsdp_params, grads, group, rs_stream, orig_dtype, reduce_dtype, device, divide_factor,
                   force_sum):
            """The direct reduce-scatter, returning what FSDP2's foreach_reduce returns (its arity for this torch),
            or None where FSDP2's own foreach_reduce must run."""
            world = group.size()
            grad_dtype = grads[0].dtype
            reduce_dtype = reduce_dtype or grad_dtype
            widen = reduce_dtype == torch.float32 and grad_dtype in (torch.bfloat16, torch.float16)
            if (reduce_dtype != grad_dtype and not widen) or any(g.dtype != grad_dtype for g in grads):
                return None
            if any(not g.is_contiguous() or g.dim() == 0 or g.size(0) % world for g in grads):
                return None
            pre, post, op, _ = collectives._get_gradient_divide_factors(group, None, reduce_dtype, device.type,
                                                                        divide_factor, force_sum)
            if pre not in (None, 1) or post not in (None, 1) or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                return None
            rs_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(rs_stream):
                out = torch.empty(sum(g.numel() for g in grads) // world, dtype=reduce_dtype, device=device)
                torch.ops.ce_overlap.reduce_scatter_tensors_out(list(grads), "avg" if op == dist.ReduceOp.AVG else "sum",
                                                                world, group.group_name, out=out)
                rs_event = rs_stream.record_event()
                if orig_dtype is not None and orig_dtype != reduce_dtype:
                    out = out.to(orig_dtype)
                offset = 0
                for p, g in zip(fsdp_params, grads):
                    shard = torch.as_strided(out, size=p.sharded_size, stride=p.contiguous_sharded_stride,
                                             storage_offset=offset)
                    if p.sharded_param.grad is None:
                        p.sharded_param.grad = p.to_sharded_dtensor(shard)
                    else:
                        p.sharded_param.grad._local_tensor += shard
                    for hook in (getattr(p.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                        hook(p.sharded_param)
                    offset += g.numel() // world
                post_event = rs_stream.record_event()
            held = list(grads)  # read by the copy engines until rs_event: FSDP2 keeps this until it waited for it
            grads.clear()
            counters.reduce_scatters += 1
            if _reduce_returns == 7:  # torch 2.14: the post-reduce stream too
                return held, rs_event, rs_stream, post_event, None, None, None
            return held, rs_event, post_event, None, None, None

    return DirectResult, DirectAllGather, DirectReduceScatter


def make_comms(param_group, ring: _SlotRing | None, reduce_scatter: bool):
    """(DirectAllGather or None, DirectReduceScatter or None) for one FSDP group: the all-gather when `ring` is given,
    the reduce-scatter when `reduce_scatter`."""
    _, DirectAllGather, DirectReduceScatter = _classes()
    return (DirectAllGather(param_group, ring) if ring is not None else None,
            DirectReduceScatter() if reduce_scatter else None)


def _foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
                        all_gather_comm):
    if isinstance(all_gather_comm, _classes()[1]) and group.size() > 1:
        result = all_gather_comm.gather(fsdp_params, group, all_gather_copy_in_stream, all_gather_stream, device)
        if result is not None:
            return result
    return _originals["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream,
                                            all_gather_stream, device, all_gather_comm)


def _foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    import torch

    if isinstance(all_gather_result, _classes()[0]):  # the parameters already hold the gathered bytes
        torch.cuda.current_stream().wait_event(all_gather_result.all_gather_event)
        return None
    return _originals["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)


def _foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm,
                    orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group, all_reduce_stream,
                    all_reduce_grads, partial_reduce_output, all_reduce_hook, *rest, **kwargs):
    if (isinstance(reduce_scatter_comm, _classes()[2]) and reduce_scatter_group is not None
            and reduce_scatter_group.size() > 1 and all_reduce_group is None and all_reduce_hook is None
            and partial_reduce_output is None and unsharded_grads):
        force_sum = bool(rest[0] if rest else kwargs.get("force_sum_reduction_for_comms", False))
        result = reduce_scatter_comm.reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                                            orig_dtype, reduce_dtype, device, gradient_divide_factor, force_sum)
        if result is not None:
            return result
    return _originals["foreach_reduce"](fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                                        reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
                                        all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                                        all_reduce_hook, *rest, **kwargs)

