"""Hierarchical all-gather and reduce-scatter over a group that spans nodes: copy engines among the ranks of one node,
NCCL (the group's own backend) among the rail-aligned ranks of different nodes (local rank l of every node: the GPUs
that share a rail of a rail-optimized fabric).

A group of N = M nodes x p ranks, its ranks node after node (group rank m * p + l: torchrun's order); `hierarchy`
splits it once into its node group (p ranks) and its rail group (M ranks).

    all-gather:      the rail all-gather (M shards over the NICs: each crosses the network once), then the node
                     all-gather of those M shards on copy engines, then one copy that puts the N shards in group-rank
                     order (node-major);
    reduce-scatter:  one copy that orders the N chunks local-rank-major, the node reduce-scatter on copy engines (each
                     rank keeps the node's sum of its M chunks), then the rail reduce-scatter (the sum over nodes).

The results are the flat collective's: an all-gather moves bytes (bit-exact); a reduce-scatter sums in another order
(exact on integer-valued data; tests/runtime/hierarchical_check.py). Stream-ordered on the current stream, as the
runtime's other `_out` ops. Where the hierarchical choice pays is the cost model's (Backend "hier": docs/cost_model.md).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import CeOverlapError


@dataclasses.dataclass(frozen=True)
class Hierarchy:
    """A group split into its node group and its rail group (this rank's of each)."""

    nodes: int                     # M
    per_node: int                  # p
    node: dist.ProcessGroup        # the p ranks of this rank's node (copy engines)
    rail: dist.ProcessGroup        # the M ranks of this rank's local index, one per node (NCCL)


_HIERARCHIES: dict[tuple[str, tuple[int, ...]], Hierarchy] = {}
_BY_NAME: dict[str, Hierarchy] = {}  # group name -> its latest hierarchy (what the graph pass looks up)


def layout(node_of_rank: list[str]) -> tuple[int, int]:
    """(nodes M, ranks per node p) of a group whose rank g runs on node_of_rank[g]; CeOverlapError unless every node
    holds p consecutive group ranks (node after node, as torchrun places them) and there are at least 2 nodes."""
    order: list[str] = []
    for name in node_of_rank:
        if not order or order[-1] != name:
            if name in order:
                raise CeOverlapError(f"hierarchical collectives need each node's ranks consecutive in the group, but "
                                     f"{name} holds group ranks {[g for g, n in enumerate(node_of_rank) if n == name]}")
            order.append(name)
    m = len(order)
    if m < 2:
        raise CeOverlapError("hierarchical collectives need a group that spans nodes; this one is on one node "
                             f"({order[0] if order else 'none'}): use the copy-engine collectives directly")
    counts = {name: node_of_rank.count(name) for name in order}
    if len(set(counts.values())) != 1:
        raise CeOverlapError(f"hierarchical collectives need as many ranks on every node; the group has "
                             f"{', '.join(f'{c} on {n}' for n, c in counts.items())}")
    return m, len(node_of_rank) // m


def hierarchy(group: dist.ProcessGroup) -> Hierarchy:
    """The node and rail groups of `group` (created once per group: collective over the group's ranks, each creating
    the two subgroups it belongs to, in the same order)."""
    from .. import nodes

    ranks = tuple(dist.get_process_group_ranks(group))
    key = (group.group_name, ranks)
    if key in _HIERARCHIES:
        return _HIERARCHIES[key]
    m, p = layout(nodes.nodes_of(group))
    g = dist.get_rank(group)
    node_index, local = divmod(g, p)
    node_ranks = list(ranks[node_index * p:(node_index + 1) * p])
    rail_ranks = [ranks[k * p + local] for k in range(m)]
    node = dist.new_group(node_ranks, use_local_synchronization=True)
    rail = dist.new_group(rail_ranks, use_local_synchronization=True)
    h = _HIERARCHIES[key] = _BY_NAME[group.group_name] = Hierarchy(m, p, node, rail)
    return h


@contextlib.contextmanager
def kept_apart():
    """Within: hierarchies made are forgotten on exit (a capture's, over fake groups that end with it)."""
    saved, saved_names = dict(_HIERARCHIES), dict(_BY_NAME)
    try:
        yield
    finally:
        _HIERARCHIES.clear()
        _HIERARCHIES.update(saved)
        _BY_NAME.clear()
        _BY_NAME.update(saved_names)


def lookup(group_name: str) -> Hierarchy | None:
    """The hierarchy `hierarchy` made for the group of this name (ce_overlap.fully_shard makes one for a
    data-parallel group that spans nodes), or None."""
    return _BY_NAME.get(str(group_name))


# The two halves of each collective, over a subgroup: (output, input, group) -> None; (output, input, op, group).
AllGatherFn = Callable[[torch.Tensor, torch.Tensor, dist.ProcessGroup], None]
ReduceScatterFn = Callable[[torch.Tensor, torch.Tensor, str, dist.ProcessGroup], None]


def _nccl_all_gather(output, input, group) -> None:
    dist.all_gather_into_tensor(output, input, group=group)


def _nccl_reduce_scatter(output, input, op, group) -> None:
    # torch 2.14 names it reduce_scatter_single (reduce_scatter_tensor deprecated); 2.11 has only the old name.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=dist.ReduceOp.AVG if op == "avg" else dist.ReduceOp.SUM, group=group)


def _ce_all_gather(output, input, group) -> None:
    from . import all_gather_into_tensor

    all_gather_into_tensor(output, input, group)


def _ce_reduce_scatter(output, input, op, group) -> None:
    from . import reduce_scatter_tensor

    reduce_scatter_tensor(output, input, op, group)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup,
                           inside: AllGatherFn = _ce_all_gather, across: AllGatherFn = _nccl_all_gather) -> None:
    """Like torch.distributed.all_gather_into_tensor over `group` (which spans nodes): `inside` (copy engines) among
    the ranks of each node, `across` (the group's backend) among the rail-aligned ranks of the nodes. `output` holds
    N * input.numel() elements; group rank g's shard lands at output.flatten()[g * n:(g + 1) * n]."""
    h = hierarchy(group)
    n = input.numel()
    if output.numel() != h.nodes * h.per_node * n:
        raise CeOverlapError(f"hierarchical all_gather: output holds {output.numel()} elements, expected "
                             f"{h.nodes * h.per_node} x {n}")
    x = input.contiguous().view(-1)
    rail = torch.empty(h.nodes * n, dtype=input.dtype, device=input.device)
    across(rail, x, h.rail)                      # [node m] shards of this rank's rail
    gathered = torch.empty(h.per_node * h.nodes * n, dtype=input.dtype, device=input.device)
    inside(gathered, rail, h.node)               # [local l][node m]
    output.view(h.nodes, h.per_node, n).copy_(gathered.view(h.per_node, h.nodes, n).transpose(0, 1))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str, group: dist.ProcessGroup,
                          inside: ReduceScatterFn = _ce_reduce_scatter,
                          across: ReduceScatterFn = _nccl_reduce_scatter) -> None:
    """Like torch.distributed.reduce_scatter_tensor over `group` (which spans nodes), op "sum" or "avg": `inside`
    (copy engines) among the ranks of each node, then `across` (the group's backend) over the rail. `input` holds N
    chunks of output.numel() elements in group-rank order."""
    if op not in ("sum", "avg"):
        raise CeOverlapError(f"hierarchical reduce_scatter: op must be 'sum' or 'avg', got {op!r}")
    h = hierarchy(group)
    c = output.numel()
    if input.numel() != h.nodes * h.per_node * c:
        raise CeOverlapError(f"hierarchical reduce_scatter: input holds {input.numel()} elements, expected "
                             f"{h.nodes * h.per_node} x {c}")
    by_local = input.contiguous().view(h.nodes, h.per_node, c).transpose(0, 1).contiguous().view(-1)
    node_sum = torch.empty(h.nodes * c, dtype=input.dtype, device=input.device)
    inside(node_sum, by_local, op, h.node)       # [node m] chunks of this rank's rail, summed over its node
    across(output.view(-1), node_sum, op, h.rail)
