"""Tensors in a group's symmetric pool: what the collectives read and write in place (the zero-copy path)."""
from __future__ import annotations

import threading

import torch

from .groups import resolve_group, config_of, group_name_and_size

_alloc_lock = threading.Lock()
_alloc_seq: dict[str, int] = {}  # group name -> number of empty_symmetric calls so far (SPMD: equal on every rank)
_exchange = None  # _symalloc.StoreExchange over the default store, made on first use


def empty_symmetric(shape, dtype: torch.dtype, group=None) -> torch.Tensor:
    """An uninitialized CUDA tensor inside the group's symmetric pool, so collectives read (and, push mode, write)
    it in place, at the same pool offset on every rank. COLLECTIVE: every rank of the group must call it, the same
    number of times and with the same sizes (else it raises, on every rank, naming the ranks and sizes). The ranks
    agree on the offset through the default c10d store: each publishes the free ranges of its pool, all intersect
    them and take the same first fit (_symalloc.py). One store round trip per call (two when nothing fits until a
    rank waits for the GPU to release freed symmetric tensors)."""
    import torch.distributed as dist

    from . import _symalloc

    global _exchange
    name, world = group_name_and_size(group)
    if isinstance(shape, int):
        shape = (shape,)
    shape = [int(s) for s in shape]
    numel = 1
    for s in shape:
        if s < 0:
            raise RuntimeError(f"ce_overlap.empty_symmetric: negative size {s} in {shape}")
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    rank = dist.get_rank(resolve_group(group))

    def free_ranges(block: bool):
        flat = [int(v) for v in torch.ops.ce_overlap._symmetric_free_ranges(name, block)]
        return flat[0], list(zip(flat[1::2], flat[2::2]))

    with _alloc_lock:
        if _exchange is None and world > 1:
            _exchange = _symalloc.StoreExchange(dist.distributed_c10d._get_default_store(), config_of(group).timeout_s)
        seq = _alloc_seq.get(name, 0) + 1
        _alloc_seq[name] = seq
        offset = _symalloc.agree(_exchange, name, seq, rank, world, nbytes, free_ranges,
                                 int(torch.ops.ce_overlap._pool_alignment()), shape, str(dtype).replace("torch.", ""))
        return torch.ops.ce_overlap._empty_symmetric_at(shape, dtype, name, offset)


def is_symmetric(tensor: torch.Tensor, group=None) -> bool:
    """Whether `tensor`'s bytes lie in the group's symmetric pool (the zero-copy path)."""
    name, _ = group_name_and_size(group)
    return torch.ops.ce_overlap._symmetric_offset(tensor, name) >= 0
