"""Every rank of a process group must issue that group's collectives in one order, in the same buckets, on the same
backend, or the step hangs (or reads garbage). The planner plans each rank's graph on its own, and the graphs differ
where shards are uneven (a short rank's pad, its slices and concatenations): its heuristics (the memory budget, where
a reduce-scatter's inputs are ready, what follows a bucket before the next GEMM) can then order one group's
collectives differently on two ranks of it. Measured: a 2x2 ("dp", "tp") mesh with activation checkpointing and an
uneven vocabulary (1001 rows) issued the tensor-parallel all-gather before the reduce-scatter on rank 0 and after it
on rank 1, and gloo hung (2026-12-03).

So the pass checks before it rewrites. Each rank publishes, under one key of the job's store per graph it plans, what
its plan issues on each of its groups (the collectives by their position among the group's collectives in the
captured graph, which is the same on every rank, with the bucket and backend of each) and the ranks of each group;
it then reads the plans of every rank its groups reach, and of every rank theirs reach, until it has the whole set of
ranks that this graph's groups connect (the component: a 2-D mesh connects all ranks, the stages of a pipeline stay
apart). Every rank of the component reads the same entries and so reaches the same verdict: where two ranks of one
group disagree (or one left the graph as captured: its planning failed), every rank of the component leaves the
graph as captured, which is the same on every rank because the captured graph's collectives are.

The exchange costs each rank one store write and one read per rank of its component per graph compiled, at compile
time only. A rank that never publishes (it died, or it loaded this graph from Inductor's cache while another
compiled it: the pass keys its cache per rank for this reason) is named after PassConfig.agree_timeout_s."""
from __future__ import annotations

import json
from typing import Callable, Sequence

import torch.distributed as dist
import torch.fx

from ..errors import CeOverlapError
from ..store import wait_for_ranks
from .capture_state import capturing
from .collectives import collectives_in, group_of as process_group

_KEY = "ce_overlap/plan/"
_SEQ: dict[tuple[str, int], int] = {}  # (graph name, rank) -> how many times it agreed on a graph of that name


def group_plans(plan: dict, captured: Sequence[str], group_of: dict[str, str]) -> dict[str, list]:
    """What `plan` issues on each group: per group, its buckets in issue order, each [the members' positions among
    the group's collectives in the captured graph (`captured`: every collective's name in graph order; `group_of`:
    collective name -> group name), the backend, the first member's name (for messages; names may differ by rank)]."""
    index: dict[str, int] = {}
    count: dict[str, int] = {}
    for name in captured:
        g = group_of[name]
        index[name] = count.get(g, 0)
        count[g] = index[name] + 1
    position = {name: i for i, name in enumerate(plan["order"])}
    buckets = sorted(plan["buckets"], key=lambda b: min(position[m["collective"]] for m in b["members"]))
    out: dict[str, list] = {}
    for b in buckets:
        names = [m["collective"] for m in b["members"]]
        out.setdefault(group_of[names[0]], []).append([[index[n] for n in names], b["backend"], names[0]])
    return out


def _describe(ra: int, a, rb: int, b) -> str:
    if not isinstance(a, list) or not isinstance(b, list):  # a rank that leaves the graph as captured
        def what(p) -> str:
            return p if isinstance(p, str) else "planned"

        return f"rank {ra}: {what(a)}, rank {rb}: {what(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x[:2] != y[:2]:
            return (f"its bucket #{i} in issue order is {x[2]} (members {x[0]}, {x[1]}) on rank {ra} and {y[2]} "
                    f"(members {y[0]}, {y[1]}) on rank {rb} (members: positions among the group's collectives in "
                    f"the captured graph)")
    return f"rank {ra} issues {len(a)} buckets, rank {rb} {len(b)}"


def verdict(entries: dict[int, dict]) -> str | None:
    """None when every group of the component (rank -> its published entry) is planned alike on all its ranks, else
    why not (the first disagreement, by group name and rank)."""
    groups: dict[str, dict[int, list]] = {}
    for rank in sorted(entries):
        for g, e in entries[rank]["groups"].items():
            groups.setdefault(g, {})[rank] = e["plan"]
    for g in sorted(groups):
        plans = groups[g]
        first = min(plans)
        for rank in sorted(plans):
            if plans[rank] != plans[first]:
                return (f"ranks {first} and {rank} planned group '{g}' differently: "
                        f"{_describe(first, plans[first], rank, plans[rank])}")
    return None


def exchange(graph: str, mine: dict[str, list], ranks_of: Callable[[str], list[int]], timeout_s: float,
             store=None, rank: int | None = None) -> dict[int, dict]:
    """Publishes this rank's group plans for the next graph called `graph` and returns every entry of its component
    (rank -> {"groups": {group: {"ranks": [...], "plan": [...]}}}). Raises CeOverlapError naming the ranks that did
    not publish within `timeout_s`."""
    store = store if store is not None else dist.distributed_c10d._get_default_store()
    rank = dist.get_rank() if rank is None else rank
    seq = _SEQ.get((graph, rank), 0)
    _SEQ[(graph, rank)] = seq + 1
    prefix = f"{_KEY}{graph}/{seq}/"
    entry = {"groups": {g: {"ranks": list(ranks_of(g)), "plan": p} for g, p in mine.items()}}
    store.set(f"{prefix}{rank}", json.dumps(entry))
    entries = {rank: entry}
    frontier = sorted({r for e in entry["groups"].values() for r in e["ranks"]} - {rank})
    while frontier:
        missing, error = wait_for_ranks(store, [f"{prefix}{r}" for r in frontier], frontier, timeout_s)
        if missing:
            raise CeOverlapError(
                f"ce_overlap: agreeing on the plan of graph '{graph}' (#{seq}) timed out after {timeout_s} s on rank "
                f"{rank}: ranks {missing} never published theirs. Every rank of a group must compile the same graphs "
                f"in the same order; a rank that died, or one that loaded this graph from a cache the others did not "
                f"have, never does (PassConfig.agree_timeout_s). Store error: {error}")
        reached = set()
        for r in frontier:
            entries[r] = json.loads(store.get(f"{prefix}{r}"))
            reached |= {x for e in entries[r]["groups"].values() for x in e["ranks"]}
        frontier = sorted(reached - set(entries))
    return entries


def agree(graph: torch.fx.Graph, name: str, plan: dict | None, timeout_s: float) -> str | None:
    """Before the pass rewrites `graph` by `plan` (None: this rank leaves it as captured), the ranks its groups
    connect compare what they would issue; None when all agree (or there is nobody to agree with: no process group,
    a world of one, a fake process group, a capture), else why not, the same text on every rank of the component."""
    if capturing() or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1 \
            or dist.get_backend() == "fake":  # a fake process group: one process stands for every rank
        return None
    group_of = {name: c.group for name, c in collectives_in(graph).items()}  # in graph order
    if plan is None:
        mine = {g: "left as captured" for g in set(group_of.values())}
    else:
        mine = group_plans(plan, list(group_of), group_of)

    def ranks_of(g: str) -> list[int]:
        pg = process_group(g)
        return list(dist.get_process_group_ranks(pg)) if pg is not None else [dist.get_rank()]

    return verdict(exchange(name, mine, ranks_of, timeout_s))
