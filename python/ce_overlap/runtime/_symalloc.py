"""The agreement step of the collective `empty_symmetric`, torch-free: every rank publishes a Request (its size and
the free ranges of its pool's user region) through a c10d-style store (`StoreExchange`), every rank runs `decide` on
the same list of Requests and so reaches the same Decision (`agree` runs the whole step). CPU tests cover it with a
HashStore and one thread per rank (tests/runtime/test_runtime_cpu.py).

Why: the CE collectives address a peer's tensor at the same pool offset as their own, so a symmetric tensor must
have one offset on every rank. Each rank's own first fit is not enough: frees are deferred until the GPU is done
with a tensor, and Python frees objects at different times on different ranks, so the free lists differ. The
intersection of the free lists is free everywhere; its first fit is the same everywhere.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ..store import wait_for_ranks

Range = tuple[int, int]  # (offset, size), size > 0


class SymmetricAllocError(RuntimeError):
    """Raised identically on every rank when the ranks cannot agree on an offset."""


@dataclass(frozen=True)
class Request:
    rank: int
    nbytes: int
    free: tuple[Range, ...]
    pending_bytes: int = 0  # freed bytes the GPU may still use (not in `free` yet)
    shape: tuple[int, ...] = ()
    dtype: str = ""

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "nbytes": self.nbytes, "free": [list(r) for r in self.free],
                           "pending_bytes": self.pending_bytes, "shape": list(self.shape), "dtype": self.dtype})

    @staticmethod
    def from_json(text: str | bytes) -> "Request":
        d = json.loads(text)
        return Request(rank=int(d["rank"]), nbytes=int(d["nbytes"]),
                       free=tuple((int(o), int(s)) for o, s in d["free"]),
                       pending_bytes=int(d.get("pending_bytes", 0)), shape=tuple(int(x) for x in d.get("shape", ())),
                       dtype=str(d.get("dtype", "")))


@dataclass(frozen=True)
class Decision:
    offset: int | None            # the agreed pool offset, or None: retry after waiting for pending frees
    common: tuple[Range, ...] = field(default=())


def footprint(nbytes: int, alignment: int) -> int:
    """Bytes one allocation occupies (as the C++ RangeAllocator::footprint): at least one aligned unit."""
    return -(-max(nbytes, 1) // alignment) * alignment


def normalize(ranges: Iterable[Range]) -> list[Range]:
    """Sorted, non-empty, with overlapping or touching ranges merged."""
    out: list[list[int]] = []
    for off, size in sorted((int(o), int(s)) for o, s in ranges if int(s) > 0):
        if out and off <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][0] + out[-1][1], off + size) - out[-1][0]
        else:
            out.append([off, size])
    return [(o, s) for o, s in out]


def intersect(range_lists: Sequence[Iterable[Range]]) -> list[Range]:
    """The ranges free in every list (an empty input list means: nothing is free)."""
    if not range_lists:
        return []
    common = normalize(range_lists[0])
    for other in range_lists[1:]:
        b = normalize(other)
        out: list[Range] = []
        i = j = 0
        while i < len(common) and j < len(b):
            lo = max(common[i][0], b[j][0])
            hi = min(common[i][0] + common[i][1], b[j][0] + b[j][1])
            if hi > lo:
                out.append((lo, hi - lo))
            if common[i][0] + common[i][1] <= b[j][0] + b[j][1]:
                i += 1
            else:
                j += 1
        common = out
    return common


def first_fit(ranges: Iterable[Range], need: int, alignment: int) -> int | None:
    """Lowest aligned offset where `need` bytes fit inside one of `ranges`."""
    for off, size in normalize(ranges):
        start = -(-off // alignment) * alignment
        if start + need <= off + size:
            return start
    return None


def _who(r: Request) -> str:
    shape = f" (shape {list(r.shape)}, {r.dtype})" if r.dtype else ""
    return f"rank {r.rank}: {r.nbytes} bytes{shape}"


def decide(group: str, seq: int, requests: Sequence[Request], alignment: int, attempt: int = 0) -> Decision:
    """The offset every rank allocates for allocation #`seq` of `group`; raises SymmetricAllocError when the ranks
    asked for different sizes or nothing fits. Returns Decision(None) (retry: every rank then waits for its pending
    frees and publishes again) when nothing fits on attempt 0 but some rank still has frees pending."""
    reqs = sorted(requests, key=lambda r: r.rank)
    where = f"ce_overlap.empty_symmetric on group '{group}' (allocation #{seq})"
    sizes = {r.nbytes for r in reqs}
    if len(sizes) != 1:
        raise SymmetricAllocError(
            f"{where}: the ranks asked for different sizes: " + "; ".join(_who(r) for r in reqs)
            + ". Every rank must call empty_symmetric with the same shape and dtype, in the same order.")
    nbytes = reqs[0].nbytes
    need = footprint(nbytes, alignment)
    common = intersect([r.free for r in reqs])
    offset = first_fit(common, need, alignment)
    if offset is not None:
        return Decision(offset, tuple(common))
    if attempt == 0 and any(r.pending_bytes > 0 for r in reqs):
        return Decision(None, tuple(common))
    per_rank = "; ".join(
        f"rank {r.rank}: {sum(s for _, s in r.free)} bytes free, largest range {max((s for _, s in r.free), default=0)}"
        + (f", {r.pending_bytes} bytes still held by the GPU" if r.pending_bytes else "") for r in reqs)
    raise SymmetricAllocError(
        f"{where}: no range of {nbytes} bytes ({need} with alignment) is free on every rank: free on all ranks "
        f"together {sum(s for _, s in common)} bytes, largest common range {max((s for _, s in common), default=0)} "
        f"bytes ({per_rank}). Free symmetric tensors, or raise CE_OVERLAP_POOL_MB (the same on every rank, before "
        "the first rendezvous).")


class StoreExchange:
    """Publishes one rank's Request per agreement step under ce_overlap/symm/<group>/<seq>/<attempt>/<rank> and
    reads everyone's. Duck-typed store: set, get, wait(keys, timedelta), check(keys), optionally delete_key.
    One instance per rank and process (it remembers this rank's previous key, to delete it)."""

    def __init__(self, store, timeout_s: float):
        self.store = store
        self.timeout_s = timeout_s
        self.last_key: dict[str, str] = {}  # group -> this rank's key of the previous step
        self.deletes = True                 # False once the store refused delete_key

    def exchange(self, group: str, seq: int, attempt: int, rank: int, world: int, mine: Request) -> list[Request]:
        prefix = f"ce_overlap/symm/{group}/{seq}/{attempt}/"
        keys = [f"{prefix}{r}" for r in range(world)]
        self.store.set(keys[rank], mine.to_json())
        t0 = time.monotonic()
        missing, error = wait_for_ranks(self.store, keys, range(world), self.timeout_s)
        if missing:
            raise SymmetricAllocError(
                f"ce_overlap.empty_symmetric on group '{group}' (allocation #{seq}, rank {rank} of {world}): ranks "
                f"{missing} did not reach this allocation within {self.timeout_s} s (waited "
                f"{time.monotonic() - t0:.1f} s). empty_symmetric is collective: every rank must allocate the same "
                f"symmetric tensors in the same order. Store error: {error}")
        requests = [Request.from_json(self.store.get(k)) for k in keys]
        # A rank publishes step s+1 only after it read every key of step s: once all keys of this step exist,
        # nobody needs our key of the previous step any more. (The last step's keys stay: one per rank.)
        previous = self.last_key.get(group)
        self.last_key[group] = keys[rank]
        if previous is not None and self.deletes:
            try:
                self.store.delete_key(previous)
            except Exception:  # noqa: BLE001 (a store without delete_key keeps the keys; harmless)
                self.deletes = False
        return requests


def agree(exchange: StoreExchange | None, group: str, seq: int, rank: int, world: int, nbytes: int,
          free_ranges: Callable[[bool], tuple[int, Sequence[Range]]], alignment: int, shape: Sequence[int] = (),
          dtype: str = "") -> int:
    """One collective allocation: returns the agreed offset (the same on every rank) or raises SymmetricAllocError
    (on every rank). `free_ranges(block)` returns (pending_bytes, ranges) of this rank; block=True first waits for
    the GPU to release deferred frees (only asked for on the retry). `exchange` may be None for a group of one."""
    for attempt in (0, 1):
        pending, ranges = free_ranges(attempt > 0)
        mine = Request(rank=rank, nbytes=nbytes, free=tuple((int(o), int(s)) for o, s in ranges),
                       pending_bytes=int(pending), shape=tuple(int(x) for x in shape), dtype=dtype)
        if world == 1 or exchange is None:
            requests = [mine]
        else:
            requests = exchange.exchange(group, seq, attempt, rank, world, mine)
        decision = decide(group, seq, requests, alignment, attempt)
        if decision.offset is not None:
            return decision.offset
    raise AssertionError("decide() returns an offset or raises on the second attempt")
