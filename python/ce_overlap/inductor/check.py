"""Numerics check mode of the pass (PassConfig.check_numerics, docs/pass.md).

With the check on, the pass puts one `ce_overlap_check::compare` node after the wait of every bucket it moves to
the copy engine. The first time a compare runs, it runs the same collective on the same input through
torch.distributed (NCCL on GPUs, the group's own backend elsewhere) and compares: all-gathers bit for bit,
reduce-scatters within a tolerance that allows for another reduction order. A mismatch raises NumericsMismatch
naming the graph, the bucket and the first differing element, before the result is used. Every later call of that
node returns at once: the check turns itself off after the first step.

The op returns nothing and writes only a one-byte token the graph allocates for it, so that FX and Inductor keep it
(an op that mutates an argument is never dead code) without it aliasing anything the model reads.
"""
from __future__ import annotations

import logging
import threading
import warnings

import torch

from ..errors import CeOverlapError

log = logging.getLogger("ce_overlap")


class NumericsMismatch(CeOverlapError):
    """A CE collective's result differs from the same collective over torch.distributed."""


# Reduction tolerances per element, per rank summed: reduce-scatter over NCCL and over the CE runtime may add
# the ranks' contributions in different orders.
_RTOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-12}
_ATOL = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3, torch.float64: 1e-12}

_lock = threading.Lock()
_done: set[str] = set()
results: list[dict] = []
"""Every check made in this process: where, type, dtype, bytes, ok, mismatches, max_abs_error."""

_lib = None


def compare_op():
    """torch.ops.ce_overlap_check.compare.default, defined on first use."""
    global _lib
    if _lib is None:
        lib = torch.library.Library("ce_overlap_check", "DEF")
        lib.define("compare(Tensor result, Tensor input, str type, str reduce_op, int group_size, str group_name, "
                   "str where, Tensor(a!) token) -> ()")
        lib.impl("compare", _compare, "CompositeExplicitAutograd")
        torch.library.register_fake("ce_overlap_check::compare", lambda *args: None, lib=lib)
        _lib = lib
    return torch.ops.ce_overlap_check.compare.default


def reset() -> None:
    """Arms every check again (tests; a new run in the same process)."""
    with _lock:
        _done.clear()
        results.clear()


def _reference(result: torch.Tensor, inp: torch.Tensor, ctype: str, reduce_op: str, group_name: str) -> torch.Tensor:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    ref = torch.empty_like(result)
    with warnings.catch_warnings():  # the *_tensor names are deprecated in newer torch, the only ones in older
        warnings.simplefilter("ignore", FutureWarning)
        if ctype == "all_gather":
            dist.all_gather_into_tensor(ref, inp.contiguous(), group=group)
        elif ctype == "reduce_scatter":
            ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                   "min": dist.ReduceOp.MIN}
            if reduce_op not in ops:
                raise NumericsMismatch(f"check mode cannot check a reduce-scatter with reduce_op {reduce_op!r}")
            dist.reduce_scatter_tensor(ref, inp.contiguous(), op=ops[reduce_op], group=group)
        else:
            raise NumericsMismatch(f"check mode has no reference for collective type {ctype!r}")
    return ref


def _compare(result, inp, ctype, reduce_op, group_size, group_name, where, token):
    with _lock:
        if where in _done:
            return
        _done.add(where)
    ref = _reference(result, inp, ctype, reduce_op, group_name)
    got, want = result.reshape(-1), ref.reshape(-1)
    if ctype == "all_gather" or not got.is_floating_point():
        bad = got.view(torch.uint8).view(-1, got.element_size()).ne(
            want.view(torch.uint8).view(-1, want.element_size())).any(dim=1)
        max_err = None
        rule = "bit for bit"
    else:
        rtol = _RTOL.get(got.dtype, 1e-3) * group_size
        atol = _ATOL.get(got.dtype, 1e-4) * group_size
        diff = (got.double() - want.double()).abs()
        bad = diff > atol + rtol * want.double().abs()
        bad |= got.isnan() != want.isnan()
        max_err = float(diff.nan_to_num(0.0).max()) if diff.numel() else 0.0
        rule = f"within rtol {rtol:g}, atol {atol:g}"
    mismatches = int(bad.sum())
    record = {"where": where, "type": ctype, "dtype": str(got.dtype).removeprefix("torch."),
              "bytes": got.numel() * got.element_size(), "ok": mismatches == 0, "mismatches": mismatches,
              "max_abs_error": max_err, "rule": rule}
    with _lock:
        results.append(record)
    if mismatches:
        i = int(bad.nonzero()[0, 0])
        msg = (f"check_numerics: {where}: the copy-engine {ctype} differs from torch.distributed's in {mismatches} "
               f"of {got.numel()} elements ({rule}); first at flat index {i}: CE {got[i].item()!r}, "
               f"reference {want[i].item()!r}")
        log.error(msg)
        raise NumericsMismatch(msg)
    log.info("ce_overlap check_numerics: %s: %s of %d bytes matches torch.distributed %s", where, ctype,
             record["bytes"], rule)
