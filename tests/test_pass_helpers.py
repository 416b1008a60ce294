"""Helpers for the pass tests (no tests here): an independent Python plan builder that produces Plans
obeying every rule of docs/plan.md for a real FX graph, a liveness peak-memory model, and an FX
interpreter that runs graphs on real CPU tensors with collectives emulated exactly (G simulated ranks).
"""
from __future__ import annotations

import heapq
import json

import torch
import torch.fx

from ce_overlap.inductor.to_ir import graph_to_ir


# --------------------------------------------------------------------------------------------------
# Plan builder


def ir_graph(gm: torch.fx.GraphModule, name: str = "g") -> dict:
    """The IR graph dict of `gm` with block ids, as the pass gives it to the planner."""
    import ce_overlap._core as core

    doc = {"schema": "ce_overlap.ir/1", "meta": {}, "blocks": [], "graphs": [graph_to_ir(gm, name)]}
    ir = core.IrDocument.from_json(json.dumps(doc))
    ir.detect_blocks()
    return json.loads(ir.to_json())["graphs"][0]


def peak_memory(nodes: list[dict], order: list[int]) -> int:
    """Peak bytes of IR node outputs under `order` (node ids): allocated when produced, freed after the
    last use of anything aliasing them (views and waits alias their first input); a wait also uses what its
    collective reads (the collective reads it until it completes); placeholders are the caller's; graph
    outputs live to the end."""
    root = {}
    is_wait = {}
    for i in order:
        n = nodes[i]
        is_wait[i] = n["kind"] == "wait" or n["op"] == "ce_overlap.wait_tensor.default"
        aliases = n["kind"] == "view" or is_wait[i]
        root[i] = root[n["inputs"][0]] if aliases and n["inputs"] else i
    pos = {i: p for p, i in enumerate(order)}

    def waited_collective(i):
        j = nodes[i]["inputs"][0] if nodes[i]["inputs"] else None
        while j is not None and nodes[j]["kind"] == "view" and nodes[j]["inputs"]:
            j = nodes[j]["inputs"][0]
        return j if j is not None and nodes[j]["kind"] == "collective" else None

    last = {}
    for i in order:
        used = list(nodes[i]["inputs"])
        c = waited_collective(i) if is_wait[i] else None
        if c is not None:
            used += nodes[c]["inputs"]
        for j in used:
            last[root[j]] = max(last.get(root[j], -1), pos[i])
    frees: dict[int, int] = {}
    size = {}
    for i in order:
        n = nodes[i]
        if root[i] == i and n["op"] not in ("placeholder", "output"):
            size[i] = sum(o["bytes"] for o in n["outputs"])
            end = last.get(i, pos[i])
            if nodes[order[end]]["op"] != "output":
                frees[end] = frees.get(end, 0) + size[i]
    cur = peak = 0
    for p, i in enumerate(order):
        cur += size.get(i, 0)
        peak = max(peak, cur)
        cur -= frees.get(p, 0)
    return peak


_MERGEABLE_OPS = {"_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default",
                  "_c10d_functional.all_reduce.default"}


def plan_from_ir(g: dict, *, cap_bytes: int = 1 << 40, budget_bytes: int = 1 << 40, backend="nccl",
                 prefetch: bool = False, by_block: bool = True, max_members: int | None = None) -> dict:
    """A Plan for IR graph `g`, built independently of the C++ planner. Buckets: per (block, type,
    group, dtype, reduce op) in graph order, split at `cap_bytes` / `max_members`. Order: a priority
    topological sort of bucket units (a bucket's collectives form one unit, its waits another) that
    keeps the graph order (or, with `prefetch`, issues bucket collectives as soon as their inputs
    allow). `backend`: "nccl", "ce" or a function(bucket dict) -> backend."""
    nodes = g["nodes"]
    users = {n["id"]: [] for n in nodes}
    for n in nodes:
        for j in n["inputs"]:
            users[j].append(n["id"])
    waits = {}
    for n in nodes:
        if n["kind"] == "wait":
            src = n["inputs"][0]
            if nodes[src]["kind"] == "view":
                src = nodes[src]["inputs"][0]
            waits.setdefault(src, []).append(n["id"])
    groups: dict[tuple, list] = {}
    for n in nodes:
        if n["kind"] != "collective":
            continue
        c = n["collective"]
        mergeable = n["op"] in _MERGEABLE_OPS and len(users[n["id"]]) == 1 and len(waits.get(n["id"], [])) == 1
        dtype = nodes[n["inputs"][0]]["outputs"][0]["dtype"]
        key = (n["block"] if by_block else -1, c["type"], c["group"], c["group_size"], dtype, c["reduce_op"],
               "" if mergeable else n["name"])
        groups.setdefault(key, []).append(n)
    buckets = []
    for key, members in sorted(groups.items(), key=lambda kv: kv[1][0]["id"]):
        cur: list = []
        for n in members:
            if cur and (sum(m["collective"]["bytes"] for m in cur) + n["collective"]["bytes"] > cap_bytes or
                        (max_members is not None and len(cur) >= max_members)):
                buckets.append(cur)
                cur = []
            cur.append(n)
        if cur:
            buckets.append(cur)
    plan_buckets = []
    for bid, members in enumerate(buckets):
        c0 = members[0]["collective"]
        b = {"id": bid, "type": c0["type"], "block": members[0]["block"] if members[0]["block"] >= 0 else None,
             "block_path": None,
             "group": c0["group"], "group_size": c0["group_size"],
             "dtype": nodes[members[0]["inputs"][0]]["outputs"][0]["dtype"], "reduce_op": c0["reduce_op"],
             "members": [{"collective": m["name"], "wait": nodes[waits[m["id"]][0]]["name"],
                          "bytes": m["collective"]["bytes"]} for m in members],
             "bytes": sum(m["collective"]["bytes"] for m in members)}
        be = backend(b) if callable(backend) else backend
        b.update({"backend": be, "reason": f"{be}: test plan",
                  "predicted": {"nccl_us": 0.0, "ce_us": 0.0, "window_us": 0.0, "nccl_cost_us": 0.0,
                                "ce_cost_us": 0.0, "exposed_us": 0.0}})
        plan_buckets.append(b)

    unit_of = {}
    for bid, members in enumerate(buckets):
        for m in members:
            unit_of[m["id"]] = ("c", bid)
            unit_of[waits[m["id"]][0]] = ("w", bid)
    for n in nodes:
        unit_of.setdefault(n["id"], ("n", n["id"]))
    unit_nodes: dict = {}
    for n in nodes:
        unit_nodes.setdefault(unit_of[n["id"]], []).append(n["id"])
    deps = {u: set() for u in unit_nodes}
    unit_users = {u: set() for u in unit_nodes}
    for n in nodes:
        for j in n["inputs"]:
            a, b = unit_of[j], unit_of[n["id"]]
            if a != b:
                deps[b].add(a)
                unit_users[a].add(b)

    def prio(u):
        first = min(unit_nodes[u])
        if nodes[first]["op"] == "placeholder":
            return (0, first)
        if nodes[first]["op"] == "output":
            return (3, first)
        if prefetch and u[0] == "c":
            return (1, first)
        return (2, first)

    missing = {u: len(d) for u, d in deps.items()}
    heap = [(prio(u), u) for u in unit_nodes if missing[u] == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, u = heapq.heappop(heap)
        order.extend(sorted(unit_nodes[u]))
        for v in unit_users[u]:
            missing[v] -= 1
            if missing[v] == 0:
                heapq.heappush(heap, (prio(v), v))
    assert len(order) == len(nodes), "bucket units form a cycle"
    before, after = peak_memory(nodes, [n["id"] for n in nodes]), peak_memory(nodes, order)
    return {
        "schema": "ce_overlap.plan/1", "graph": g["name"], "profile": "h100-sxm",
        "config": {"bucket_cap_bytes": cap_bytes, "memory_budget_bytes": budget_bytes, "ce": "auto",
                   "min_ce_bytes": 0, "prefetch_blocks": 1 if prefetch else 0, "bucket_patterns": []},
        "buckets": plan_buckets,
        "order": [nodes[i]["name"] for i in order],
        "summary": {"collectives": sum(len(b) for b in buckets), "buckets": len(plan_buckets),
                    "ce_buckets": sum(b["backend"] == "ce" for b in plan_buckets),
                    "exposed_comm_us_before": 0.0, "exposed_comm_us_after": 0.0,
                    "peak_memory_bytes_before": before, "peak_memory_bytes_after": after,
                    "memory_budget_bytes": budget_bytes, "plan_ms": 0.0},
    }


def build_plan(gm: torch.fx.GraphModule, *, name: str = "forward", **kw) -> dict:
    return plan_from_ir(ir_graph(gm, name), **kw)


def make_planner(**kw):
    """A planner for ce_overlap.inductor.pass_.run_pass / CeOverlapPass that uses plan_from_ir."""
    def planner(ir, graph_name, config, profile):
        return plan_from_ir(ir.to_dict()["graphs"][0], **kw)
    planner.__name__ = f"make_planner({kw})"
    return planner


# --------------------------------------------------------------------------------------------------
# Running graphs on real CPU tensors with emulated collectives


class EmulatedCollectives(torch.fx.Interpreter):
    """Runs a graph on real tensors as rank `rank` of `group_size` simulated ranks: rank k's input to a
    collective is `x + (k - rank)` (in the input's dtype; this rank's is x itself), so a wrong layout or rank
    order changes the result. all-gather: cat over k; reduce-scatter: sum over k of the input (avg: the fp32 sum
    times float32(1 / g), rounded once, as the runtime's kernel), then this rank's dim-0 chunk; all-reduce: sum over k. The ce_overlap ops behave like their _c10d_functional twins;
    reduce_scatter_tensors_unreduced gives the other ranks' chunks `rank`, one row per rank, unsummed."""

    def __init__(self, gm, group_size: int, rank: int):
        super().__init__(gm)
        self.g, self.rank = group_size, rank

    def _ranks(self, x):
        if not x.dtype.is_floating_point:
            return [x for _ in range(self.g)]
        return [x if k == self.rank else x + (k - self.rank) for k in range(self.g)]

    def _all_gather(self, x):
        return torch.cat(self._ranks(x))

    def _reduce_scatter(self, x, reduce_op="sum"):
        if str(reduce_op).lower() == "avg":  # the runtime's avg: the fp32 sum times float32(1 / g), rounded once
            total = sum(xk.float() for xk in self._ranks(x)) * (1.0 / self.g)
            return total.to(x.dtype).chunk(self.g)[self.rank].clone()
        total = torch.zeros_like(x)
        for xk in self._ranks(x):
            total = total + xk
        return total.chunk(self.g)[self.rank].clone()

    def call_function(self, target, args, kwargs):
        if isinstance(target, torch._ops.OpOverload) and target.namespace in ("_c10d_functional", "c10d_functional",
                                                                              "ce_overlap"):
            name = target._opname
            if name == "stored":  # the runtime's pass-through runs on any device: the real op
                return super().call_function(target, args, kwargs)
            if name == "wait_tensor":
                return args[0]
            if name == "all_gather_into_tensor":
                return self._all_gather(args[0])
            if name == "all_gather_into_tensors":  # ce_overlap's multi-tensor form: one all-gather per input
                return [self._all_gather(x) for x in args[0]]
            if name == "reduce_scatter_tensor":
                return self._reduce_scatter(args[0], args[1])
            if name == "reduce_scatter_tensors":  # the inputs' reduce-scatters, flattened and concatenated
                return torch.cat([self._reduce_scatter(x, args[1]).reshape(-1) for x in args[0]])
            if name == "reduce_scatter_tensors_unreduced":  # [g - 1, N]: the peers' chunks for this rank
                rows = [[xk.reshape(self.g, -1)[self.rank] for k, xk in enumerate(self._ranks(x)) if k != self.rank]
                        for x in args[0]]
                return torch.stack([torch.cat([per_input[j] for per_input in rows]) for j in range(self.g - 1)])
            if name == "all_reduce":
                total = torch.zeros_like(args[0])
                for xk in self._ranks(args[0]):
                    total = total + xk
                return total
            raise NotImplementedError(f"no emulation for {target}")
        return super().call_function(target, args, kwargs)


def real_inputs(gm: torch.fx.GraphModule, seed: int = 0, int_high: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor):  # an opaque object (torch 2.14 lifts the mesh's process group): as is
            out.append(v)
            continue
        if v.dtype.is_floating_point:
            t = torch.randn(v.shape, dtype=torch.float32, generator=gen).to(v.dtype)
        elif v.dtype == torch.bool:
            t = torch.ones(v.shape, dtype=torch.bool)
        else:
            t = torch.randint(0, int_high, v.shape, generator=gen).to(v.dtype)
        out.append(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype).copy_(t))
    return out


def run_emulated(gm: torch.fx.GraphModule, inputs, group_size: int, rank: int = 1):
    with torch.no_grad():
        return EmulatedCollectives(gm, group_size, rank).run(*inputs)


class _GatherOverWorld(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
        return gather(x, gather_dim=0, group=dist.group.WORLD)


def gathered_in_graph(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter read through torch's autograd-aware all-gather over the world, for the end-to-end compiles
    in one process (a gloo group of one rank): ce_overlap.fully_shard's DTensors skip a one-rank mesh's
    collectives, which these tests need in the graph for the pass to plan and the CE kernels to run."""
    from torch.nn.utils import parametrize

    for module in list(model.modules()):
        for name, _ in list(module.named_parameters(recurse=False)):
            parametrize.register_parametrization(module, name, _GatherOverWorld(), unsafe=True)
    return model
