"""The collectives on copy engines (each one op of torch.ops.ce_overlap.*, stream-ordered on the current stream)."""
from __future__ import annotations

import torch

from .groups import group_name_and_size
from .library import load_library


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like torch.distributed.all_gather_into_tensor, over copy engines. `output` holds world_size * input.numel()
    elements (any contiguous shape); shard r lands at output.flatten()[r * n:(r + 1) * n]. Stream-ordered on the
    current stream. Zero-copy when `input` comes from empty_symmetric (on every rank, at the same offsets)."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.all_gather_into_tensor_out(input, world, name, out=output)


def all_gather(input: torch.Tensor, group=None) -> torch.Tensor:
    """Functional form: returns a new tensor of shape [world_size * input.shape[0], *input.shape[1:]], ready on the
    current stream (the op plus its wait_tensor)."""
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(torch.ops.ce_overlap.all_gather_into_tensor(input, world, name))


def all_gather_many(inputs: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Several tensors gathered as ONE collective (a bucket without a bucket buffer): output i is what
    all_gather(inputs[i]) returns; every byte goes from its input to its output on copy engines, with no kernel to
    pack or unpack a bucket. Ready on the current stream."""
    if not inputs:
        raise ValueError("all_gather_many: needs at least one input tensor")
    name, world = group_name_and_size(group)
    outs = torch.ops.ce_overlap.all_gather_into_tensors(list(inputs), world, name)
    return [torch.ops.ce_overlap.wait_tensor(t) for t in outs]


def reduce_scatter_many(inputs: list[torch.Tensor], op: str = "sum", group=None) -> torch.Tensor:
    """Several tensors of one dtype reduce-scattered as ONE collective: returns a 1-D tensor, the concatenation in
    input order of reduce_scatter(inputs[i]).flatten(). The copies read each input's chunks where they lie (no
    bucket buffer). Ready on the current stream."""
    if not inputs:
        raise ValueError("reduce_scatter_many: needs at least one input tensor")
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(
        torch.ops.ce_overlap.reduce_scatter_tensors(list(inputs), _reduce_op_name(op), world, name))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None) -> None:
    """Like torch.distributed.reduce_scatter_tensor, on copy engines plus one small reduction kernel (at most
    CE_OVERLAP_REDUCE_SMS CTAs). `input` holds world_size chunks along dim 0 (any contiguous tensor whose numel is
    world_size * output.numel()); rank r gets the sum (op="sum") or mean (op="avg") of every rank's chunk r, summed in
    fp32. float32, float16, bfloat16. Stream-ordered on the current stream. `output` may be input's own chunk."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.reduce_scatter_tensor_out(input, _reduce_op_name(op), world, name, out=output)


def reduce_scatter(input: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Functional form: returns a new tensor of shape [input.shape[0] // world_size, *input.shape[1:]], ready on the
    current stream (the op plus its wait_tensor)."""
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(
        torch.ops.ce_overlap.reduce_scatter_tensor(input, _reduce_op_name(op), world, name))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like torch.distributed.all_to_all_single with equal splits, over copy engines: `input` holds world_size chunks
    along dim 0, chunk p goes to rank p; `output` (as many elements, not overlapping `input`) receives rank p's chunk r
    as its chunk p. Stream-ordered on the current stream. Zero-copy when `input` comes from empty_symmetric (on every
    rank, at the same offset); otherwise staged through the pool."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.all_to_all_single_out(input, world, name, out=output)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Like torch.distributed.broadcast, over copy engines: every rank's `tensor` gets the bytes of rank `src`'s (the
    rank in `group`). Stream-ordered on the current stream. Zero-copy when `tensor` comes from empty_symmetric on every
    rank (one allocation, the same offset); otherwise staged through the root's pool."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.broadcast_(tensor, int(src), world, name)


def _reduce_op_name(op) -> str:
    if isinstance(op, str):
        return op
    import torch.distributed as dist

    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}
    if op in names:
        return names[op]
    raise RuntimeError(f"ce_overlap reduce_scatter: reduce op {op!r} is not supported (sum and avg are)")


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Identity on the stream (ops are stream-ordered); raises if any CE group has failed."""
    load_library()
    return torch.ops.ce_overlap.wait_tensor(tensor)
