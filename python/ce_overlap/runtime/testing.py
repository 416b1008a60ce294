"""Test and benchmark hooks of the CE runtime (the ops of torch.ops.ce_overlap_testing): tuning a group between ops,
probes of single mechanisms, counters. Not part of the production API: training code needs none of them."""
from __future__ import annotations

import torch

from . import group_name_and_size, load_library


def _ops():
    load_library()
    return torch.ops.ce_overlap_testing


def tune(group=None, *, pull_split: int | None = None, reduce_sms: int | None = None,
         rs_round_mb: float | None = None, peer_lanes: int | None = None,
         bcast_segments: int | None = None, copy_rate_gbps: float | None = None,
         peer_sync: int | None = None) -> str:
    """Changes the group's tuning knobs between ops (benchmarks sweep them); None leaves a knob as it is. Returns
    the resulting "pull_split=.. reduce_ctas=.. rs_round_bytes=..". pull_split (1..4: pieces of every pulled peer
    copy, each on its own stream) and reduce_sms (CTAs of the reduce-scatter reduction) are local to this rank.
    rs_round_mb must be set to the same value on every rank before the next reduce-scatter (it is part of the ops'
    signature: ranks that disagree get a "different collective" timeout, not wrong data). peer_lanes (local) spreads
    each round's peer copies over that many streams (0: one per peer, every peer at once; 1: one after another).
    bcast_segments (0..64, 0: chosen from the size) pipelines a broadcast of 3+ ranks; like rs_round_mb it must be
    the same on every rank. copy_rate_gbps (local, >= 0, 0: unlimited) holds each of this rank's collective peer
    copies, and each send channel's pushes, to that rate: chunks spaced by a one-thread pacer on the copy's stream.
    peer_sync (local) groups a round's peer signals: 0 = each peer's wait, copies and done post in turn; 1 = wait for
    every peer's ready, then the copies, then every done post; 2 = as 1, each post's small peer copies in one
    cudaMemcpyBatchAsync."""
    name, _ = group_name_and_size(group)
    round_bytes = 0 if rs_round_mb is None else max(1, int(rs_round_mb * (1 << 20)))
    lanes = -1 if peer_lanes is None else int(peer_lanes)
    if peer_lanes is not None and lanes < 0:
        raise ValueError(f"peer_lanes must be >= 0 (0: one lane per peer), got {peer_lanes}")
    segments = -1 if bcast_segments is None else int(bcast_segments)
    if copy_rate_gbps is not None and not copy_rate_gbps >= 0:
        raise ValueError(f"copy_rate_gbps must be >= 0 (0: unlimited), got {copy_rate_gbps}")
    rate = -1.0 if copy_rate_gbps is None else float(copy_rate_gbps)
    sync = -1 if peer_sync is None else int(peer_sync)
    if peer_sync is not None and sync not in (0, 1, 2):
        raise ValueError(f"peer_sync must be 0, 1 or 2, got {peer_sync}")
    return _ops()._tune(name, int(pull_split or 0), int(reduce_sms or 0), round_bytes, lanes, segments, rate, sync)


def set_all_gather_mode(mode: str) -> str:
    """'pull' or 'push' for all-gathers whose output lies in the symmetric pool (others always pull); returns the
    previous mode. Process-wide; every rank must use the same mode for an op. RuntimeConfig.all_gather_mode sets it
    at rendezvous; this switches it between ops (benchmarks compare the two)."""
    return _ops()._set_all_gather_mode(mode)


def reduce_scatter_round_bytes(group=None) -> int:
    """Bytes per rank and round of the group's reduce-scatters (min of RuntimeConfig.rs_round_mb and a staging slot)."""
    name, _ = group_name_and_size(group)
    return int(_ops()._reduce_scatter_round_bytes(name))


def p2p_round_bytes(group=None) -> int:
    """Bytes per landing bank of the group's point-to-point channels (one round of a staged message)."""
    name, _ = group_name_and_size(group)
    return int(_ops()._p2p_round_bytes(name))


def reduce_bench(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctas: int) -> None:
    """The reduce-scatter's reduction kernel alone, as it runs for 2 ranks: out = a + b on at most `ctas` CTAs."""
    _ops()._reduce_bench(out, a, b, int(ctas))


def local_copy(dst: torch.Tensor, src: torch.Tensor, mode: str) -> None:
    """One same-GPU copy by `mode` ("memcpy", "batch_hint", "batch" or "peer"), no fallback."""
    _ops()._local_copy(dst, src, mode)


def local_copy_mode() -> str:
    """How the runtime copies within one GPU: "ce-hint", or "memcpy" with the reason."""
    return str(_ops()._local_copy_mode())


def stashed_tensors() -> int:
    """Tensors held by functional ops not yet waited for (a stash never dropped is a leak)."""
    return int(_ops()._stashed_tensors())


def reaped_unwaited() -> int:
    """Functional ops whose results were dropped without a wait, handed back to the allocator so far."""
    return int(_ops()._reaped_unwaited())


def keep_alive_mode() -> str:
    """"stash" or "record_stream" (RuntimeConfig.keep_alive)."""
    return str(_ops()._keep_alive_mode())


def range_allocator_self_test(seed: int, steps: int) -> int:
    """Randomized self-test of the pool's range allocator; returns steps + 1 when every invariant held."""
    return int(_ops()._range_allocator_self_test(int(seed), int(steps)))
