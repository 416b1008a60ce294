"""torch's fused Adam and AdamW (`fused=True`) over DTensor parameters, run on the local shards.

A fused optimizer step is one op over lists (`aten._fused_adamw_(params, grads, exp_avgs, ...)`), elementwise per
index. Over DTensors, DTensor's dispatcher propagates a sharding for the op's hundreds of list entries and wraps three
outputs per parameter back into DTensors on every step: at world size 1 with 100 parameters that was 4.5x the
optimizer's host time over plain tensors (bench/results/host-time-2026-12-01-b). Where every DTensor at an index has
the parameter's mesh and placements, none of them Partial, DTensor's own rule runs the op on the local tensors with
no redistribution, and writes nothing else; this handler does exactly that without the propagation. Any other case
(a Partial placement, specs that differ at an index, a DTensor outside the lists) goes through DTensor's dispatcher
as before.

The handler is DTensor's `_custom_op_handlers` hook (the mechanism torch's loss_parallel uses), installed by the first
`ce_overlap.fully_shard` call, not by importing ce_overlap; a torch whose DTensor has no such hook keeps DTensor's
dispatch, said once in the log.
"""
from __future__ import annotations

import logging
import threading

import torch
from torch.distributed.tensor import DTensor, Partial

from ..logs import log_once

_FUSED = ("_fused_adamw_", "_fused_adam_")  # the fused ops DTensor has a rule for (SGD's and Adagrad's it has not)
_lock = threading.Lock()
_previous: dict = {}   # op -> the handler ours replaced (None: DTensor's dispatch)
_checked: dict = {}    # id -> spec: specs without a Partial placement


def _ops() -> list:
    ops = []
    for name in _FUSED:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops += [getattr(packet, overload) for overload in packet.overloads()]
    return ops


def _handlers() -> dict | None:
    return getattr(getattr(DTensor, "_op_dispatcher", None), "_custom_op_handlers", None)


def _no_partial(spec) -> bool:
    """Whether no placement of `spec` is Partial (remembered per spec object: a parameter's lives as long as it)."""
    if _checked.get(id(spec)) is spec:
        return True
    if any(isinstance(pl, Partial) for pl in spec.placements):
        return False
    if len(_checked) > 100_000:  # specs of parameters long gone
        _checked.clear()
    _checked[id(spec)] = spec
    return True


def _local_lists(args: tuple, kwargs: dict) -> list | None:
    """The op's arguments with every DTensor in its lists replaced by its local tensor, or None where DTensor's own
    rule could do more than that (see the module docstring). A list entry whose spec equals its parameter's but is
    another object (an optimizer state made by zeros_like) takes the parameter's spec object, so that the next step
    compares identities only."""
    if any(isinstance(v, DTensor) for v in kwargs.values()):
        return None
    specs = [p._spec if isinstance(p, DTensor) else None for p in args[0]]
    if not all(spec is not None and _no_partial(spec) for spec in specs):
        return None  # a plain parameter beside DTensors, or a Partial one
    out = []
    for arg in args:
        if not isinstance(arg, (list, tuple)):
            if isinstance(arg, DTensor):
                return None
            out.append(arg)
            continue
        if not arg or not isinstance(arg[0], DTensor):  # state_steps: plain scalars
            if not all(not isinstance(t, DTensor) and t.dim() == 0 for t in arg):
                return None
            out.append(arg)
            continue
        for t, spec in zip(arg, specs):
            own = getattr(t, "_spec", None)
            if own is not spec:
                if own is None or not isinstance(t, DTensor) or own != spec:
                    return None
                t._spec = spec
        out.append([t._local_tensor for t in arg])
    return out


def _on_local_shards(op, args, kwargs):
    local = _local_lists(args, kwargs)
    if local is not None:
        return op(*local, **kwargs)
    previous = _previous.get(op)
    if previous is not None:
        return previous(op, args, kwargs)
    handlers = _handlers()
    with _lock:  # DTensor's own dispatch for this call: the handler out of the way while it runs
        handlers.pop(op, None)
        try:
            return op(*args, **kwargs)
        finally:
            handlers[op] = _on_local_shards


def install() -> None:
    """Routes the fused optimizers' ops over DTensors through _on_local_shards (idempotent)."""
    handlers = _handlers()
    if not isinstance(handlers, dict):
        log_once(logging.INFO, "ce_overlap.fully_shard: this torch's DTensor has no custom op handlers; fused "
                               "optimizers over the sharded parameters go through DTensor's dispatch")
        return
    for op in _ops():
        if handlers.get(op) is not _on_local_shards:
            _previous[op] = handlers.get(op)
            handlers[op] = _on_local_shards
