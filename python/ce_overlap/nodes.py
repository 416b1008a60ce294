"""Which node (machine) each rank of a process group runs on: its hostname, or simulated nodes of
CE_OVERLAP_RANKS_PER_NODE consecutive global ranks (tests and benchmarks that stand for several machines on one; a
capture of several nodes sets the same with `simulated`).

Copy engines reach only the GPUs of one NVLink domain, and tensor parallelism belongs inside one: a group that spans
nodes is refused where that matters (the CE runtime's rendezvous, ce_overlap.fully_shard's tensor-parallel mesh), and
the IR records how many nodes each group ce_overlap.fully_shard named spans (`recorded`), so the cost model prices it
across nodes.
"""
from __future__ import annotations

import contextlib
import socket

import torch.distributed as dist

from . import environment
from .errors import CeOverlapError
from .store import wait_for_ranks

_HOSTS: dict[tuple[int, ...], tuple[str, ...]] = {}  # global ranks of a group -> their hosts (fixed for the job)
_GROUP_NODES: dict[str, int] = {}  # process group name -> the nodes its ranks are on (groups `record` was given)
_SIMULATED: list[int] = []  # ranks per node set by `simulated` (innermost last)


@contextlib.contextmanager
def simulated(ranks_per_node: int):
    """Within: global rank r runs on node r // ranks_per_node (a capture of several nodes on one machine), over
    CE_OVERLAP_RANKS_PER_NODE."""
    if ranks_per_node < 1:
        raise CeOverlapError(f"ranks per simulated node must be >= 1, got {ranks_per_node}")
    _SIMULATED.append(int(ranks_per_node))
    try:
        yield
    finally:
        _SIMULATED.pop()


def ranks_per_node() -> int | None:
    """The ranks per simulated node: `simulated`'s, else CE_OVERLAP_RANKS_PER_NODE as a positive integer, or None
    (the hostname decides)."""
    if _SIMULATED:
        return _SIMULATED[-1]
    text = environment.read("CE_OVERLAP_RANKS_PER_NODE")
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise CeOverlapError(f"CE_OVERLAP_RANKS_PER_NODE={text!r}: expected a positive integer (ranks per simulated "
                             "node: global rank r runs on node r // N)")
    return value


def nodes_of(group: dist.ProcessGroup, timeout_s: float | None = None) -> list[str]:
    """The node of each rank of `group`, in group-rank order. Hostnames are exchanged once per set of ranks (through
    the job's store: `_hosts`); a fake process group (capture) is one host."""
    ranks = tuple(dist.get_process_group_ranks(group))
    per_node = ranks_per_node()
    if per_node is not None:
        return [f"simulated node {r // per_node}" for r in ranks]
    if dist.get_backend(group) == "fake":
        return [socket.gethostname()] * len(ranks)
    if ranks not in _HOSTS:
        _HOSTS[ranks] = _hosts(ranks, timeout_s)
    return list(_HOSTS[ranks])


_HOST_KEY = "ce_overlap/host/"


def _hosts(ranks: tuple[int, ...], timeout_s: float | None) -> tuple[str, ...]:
    """The hostnames of these global ranks: each rank publishes its own under one key of the job's store and reads
    the others' within `timeout_s` (the store's own timeout by default). Not a collective over the group: a rank that
    died or never asks is named after the timeout (a gloo collective raised "Connection closed by peer" naming no
    rank, measured on one H200, 2026-12-03; NCCL's would wait for its own timeout)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(f"{_HOST_KEY}{dist.get_rank()}", socket.gethostname())
    keys = [f"{_HOST_KEY}{r}" for r in ranks]
    missing, error = wait_for_ranks(store, keys, ranks, timeout_s)
    if missing:
        waited = f"{timeout_s} s" if timeout_s is not None else "the store's timeout"
        raise RuntimeError(f"ce_overlap: finding the nodes of ranks {list(ranks)} timed out after {waited}: ranks "
                           f"{missing} never published their host (is every rank of the group alive and in the same "
                           f"call?). Store error: {error}")
    return tuple(store.get(k).decode() for k in keys)


def describe(group: dist.ProcessGroup) -> str:
    """"ranks 0, 1 on host-a; ranks 2, 3 on host-b": the group's global ranks by node."""
    by_node: dict[str, list[int]] = {}
    for rank, node in zip(dist.get_process_group_ranks(group), nodes_of(group)):
        by_node.setdefault(node, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on {node}"
                     for node, r in by_node.items())


def this_node() -> str:
    """The node of this process: its simulated node (by global rank), else its hostname."""
    per_node = ranks_per_node()
    if per_node is not None and dist.is_initialized():
        return f"simulated node {dist.get_rank() // per_node}"
    return socket.gethostname()


def count(group: dist.ProcessGroup, timeout_s: float | None = None) -> int:
    """How many nodes the ranks of `group` are on (`timeout_s`: nodes_of's)."""
    return len(set(nodes_of(group, timeout_s)))


def record(group: dist.ProcessGroup) -> int:
    """Remembers (for the IR, inductor/to_ir.py) and returns how many nodes the ranks of `group` are on."""
    n = _GROUP_NODES[group.group_name] = count(group)
    return n


@contextlib.contextmanager
def kept_apart():
    """Within: groups recorded are forgotten on exit (a capture's fake groups end with it, and their names, "0" ...,
    are the next process group's)."""
    saved = dict(_GROUP_NODES)
    try:
        yield
    finally:
        _GROUP_NODES.clear()
        _GROUP_NODES.update(saved)


def recorded(group_name: str) -> int | None:
    """The node count `record` found for the group of this name, or None."""
    return _GROUP_NODES.get(str(group_name))


def require_one_node(group: dist.ProcessGroup, what: str, timeout_s: float | None = None) -> None:
    """Raises CeOverlapError naming the ranks and their nodes when `group` spans nodes: `what` ("copy-engine
    collectives") needs one NVLink domain. RuntimeError naming the ranks that never answered after `timeout_s`
    (nodes_of's)."""
    if count(group, timeout_s) > 1:
        raise CeOverlapError(f"{what} on group '{group.group_name}' need one node (one NVLink domain), but it spans "
                             f"nodes: {describe(group)}; keep this group on NCCL (HSDP: copy engines on the 'shard' "
                             "dimension inside each node)")
