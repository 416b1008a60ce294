"""Which node (machine) each rank of a process group runs on: its hostname, or simulated nodes of
CE_OVERLAP_RANKS_PER_NODE consecutive global ranks (tests and benchmarks that stand for several machines on one).

Copy engines reach only the GPUs of one NVLink domain, and tensor parallelism belongs inside one: a group that spans
nodes is refused where that matters (ce_overlap.fully_shard's tensor-parallel mesh).
"""
from __future__ import annotations

import socket

import torch.distributed as dist

from . import environment
from .errors import CeOverlapError

_HOSTS: dict[tuple[int, ...], tuple[str, ...]] = {}  # global ranks of a group -> their hosts (fixed for the job)


def ranks_per_node() -> int | None:
    """CE_OVERLAP_RANKS_PER_NODE as a positive integer, or None when unset."""
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


def nodes_of(group: dist.ProcessGroup) -> list[str]:
    """The node of each rank of `group`, in group-rank order. Hostnames are exchanged once per set of ranks (an
    all_gather_object over the group, on every rank of it); a fake process group (capture) is one host."""
    ranks = tuple(dist.get_process_group_ranks(group))
    per_node = ranks_per_node()
    if per_node is not None:
        return [f"simulated node {r // per_node}" for r in ranks]
    if dist.get_backend(group) == "fake":
        return [socket.gethostname()] * len(ranks)
    if ranks not in _HOSTS:
        hosts: list[str | None] = [None] * len(ranks)
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _HOSTS[ranks] = tuple(str(h) for h in hosts)
    return list(_HOSTS[ranks])


def describe(group: dist.ProcessGroup) -> str:
    """"ranks 0, 1 on host-a; ranks 2, 3 on host-b": the group's global ranks by node."""
    by_node: dict[str, list[int]] = {}
    for rank, node in zip(dist.get_process_group_ranks(group), nodes_of(group)):
        by_node.setdefault(node, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} on {node}"
                     for node, r in by_node.items())
