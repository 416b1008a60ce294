"""Apply a Plan (docs/plan.md, schema ce_overlap.plan/1) to the post-grad FX graph it was made from.

check_plan() (inductor/plan_check.py: the C++ core's rules, bound to the FX nodes) refuses a Plan that breaks a
rule with PlanRuleError naming the rule and the node; apply_plan() then reorders the nodes to the Plan's
`order` and rewrites each bucket: one copy-in, one collective (NCCL `_c10d_functional.*` or `ce_overlap.*`),
one wait, and a copy-out that replaces every member wait. A CE bucket (unless packed on request) is instead ONE multi-tensor op,
`ce_overlap.all_gather_into_tensors` / `reduce_scatter_tensors`, over the members' own inputs: the copy
engines read every input and (all-gather) write every output where they lie, so it has no copy-in and
no copy-out kernel; an all-gather has one wait per member output, a reduce-scatter one wait and views.
check_invariants() is the structural checker the pass runs on its result (and the tests run on every
rewritten graph).

Layouts (G = group size, members in bucket layout order, n_i = member i's per-rank element count):
  all-gather      copy-in:  cat(flatten(x_i))                          -> [N]      N = sum n_i
                  output:   [G * N]; rank r's bucket input at [r*N, (r+1)*N)
                  copy-out: out.view(G, N)[:, off_i:off_i+n_i] (a [G, n_i] slice) made contiguous and
                            viewed as [G * x_i.shape[0], *x_i.shape[1:]] == all_gather_into_tensor(x_i)
  reduce-scatter  copy-in:  cat(x_i.view(G, n_i), dim=1).view(G * N)   (each rank's shard contiguous)
                  output:   [N]; copy-out: out[off_i:off_i+n_i].view(x_i.shape[0] // G, *x_i.shape[1:])
  all-reduce      copy-in:  cat(flatten(x_i)); copy-out: out[off_i:off_i+n_i].view(x_i.shape)
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import operator
from typing import Callable, Iterable

import torch
import torch.fx
from torch.utils import _pytree as pytree

from .collectives import (CE_MANY_OPS, CE_OPS, CE_UNREDUCED_OP, RATE_ARG, STORED_OP, Collective,  # noqa: F401
                          collectives_in, group_of, is_ce_collective, is_functional_collective, is_wait,
                          read_collective)
from .plan_check import CheckedBucket, CheckedPlan, PlanRuleError, check_plan  # noqa: F401 (rewrite's API)

log = logging.getLogger("ce_overlap")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops a multi-member bucket can merge (the plain functional forms; _out and _coalesced variants stay
# as they are and may only be singleton NCCL buckets).
_MERGEABLE = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}
_SUMMABLE = ("sum", "avg")


class InvariantError(RuntimeError):
    """A rewritten graph breaks a structural invariant (a bug in the rewriter, never user input)."""


# --------------------------------------------------------------------------------------------------
# Rewriting


def _fake_mode_of(nodes: Iterable[torch.fx.Node]):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta.get("val") for n in nodes])


class _Builder:
    """Creates nodes with meta["val"] computed on the graph's fake tensors, and provenance meta."""

    def __init__(self, graph: torch.fx.Graph, sources: list[torch.fx.Node], prefix: str):
        self.graph = graph
        self.sources = sources
        self.prefix = prefix
        self.fake_mode = _fake_mode_of(n for s in sources for n in [s, *s.all_input_nodes])
        self.created: list[torch.fx.Node] = []

    def __call__(self, target, args, kwargs=None, name: str = "", like: torch.fx.Node | None = None) -> torch.fx.Node:
        """`like`: an elementwise op whose result has that node's shape, strides and dtype: its fake value is
        shared instead of computed (long pointwise chains would otherwise pay a fake-tensor dispatch per node)."""
        kwargs = kwargs or {}
        node = self.graph.create_node("call_function", target, tuple(args), kwargs,
                                      name=f"{self.prefix}_{name}" if name else None)
        if like is not None:
            node.meta["val"] = like.meta["val"]
        else:
            vargs, vkwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            with self.fake_mode if self.fake_mode is not None else contextlib.nullcontext():
                node.meta["val"] = target(*vargs, **vkwargs)
        first = self.sources[0]
        for key in ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "custom"):
            if key in first.meta:
                node.meta[key] = first.meta[key]
        node.meta["ce_overlap"] = {"bucket_sources": [s.name for s in self.sources]}
        self.created.append(node)
        return node

    def contiguous(self, x: torch.fx.Node, name: str) -> torch.fx.Node:
        val = x.meta["val"]
        if val.is_contiguous():
            return x
        return self(aten.clone.default, [x], {"memory_format": torch.contiguous_format}, name)


def _meta_equal(a, b) -> bool:
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and (x.dtype != y.dtype or x.device != y.device or x.shape != y.shape
                                            or x.stride() != y.stride() or x.storage_offset() != y.storage_offset()):
            return False
    return True


def _repair_user_meta(users: list[torch.fx.Node]) -> None:
    """After replacing a wait with an equivalent value of different layout (a view at an offset of the
    bucket buffer), re-run the users' meta on fake tensors so strides/offsets stay truthful."""
    work = collections.deque(users)
    queued = set(users)
    while work:
        node = work.popleft()
        queued.discard(node)
        if node.op != "call_function" or "val" not in node.meta:
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val", n))
        if any(isinstance(leaf, torch.fx.Node) for leaf in pytree.tree_leaves((args, kwargs))):
            continue
        fake_mode = _fake_mode_of([node, *node.all_input_nodes])
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                new = node.target(*args, **kwargs)
        except Exception:  # noqa: BLE001 (metadata repair is best effort, as in Inductor's bucketing)
            log.debug("ce_overlap: skipped meta repair of %s", node.name, exc_info=True)
            continue
        if _meta_equal(node.meta["val"], new):
            continue
        node.meta["val"] = new
        for user in node.users:
            if user not in queued:
                queued.add(user)
                work.append(user)


def reorder(graph: torch.fx.Graph, order: list[torch.fx.Node]) -> None:
    """Moves the nodes into `order` (which ends with the output node)."""
    output = order[-1]
    for node in order[:-1]:
        output.prepend(node)


@dataclasses.dataclass
class BucketResult:
    id: int
    type: str
    members: int
    bytes: int
    planned_backend: str
    backend: str
    reason: str
    nodes: list[str]
    copy_rate_gbps: float = 0.0  # the rate its CE op paces its copies at (the plan's); 0: unpaced, or on NCCL
    role: str | None = None      # the plan's: "dp", "tp" (tensor parallelism's, kept where captured), or unknown


def ce_op_for(ctype: str):
    """(torch.ops.ce_overlap op, "") for a collective type, or (None, why not)."""
    name = CE_OPS.get(ctype)
    if name is None:
        return None, f"the CE runtime has no {ctype} collective"
    from .. import runtime

    lib = runtime.library_loaded()  # registers torch.ops.ce_overlap.* (never raises)
    if not lib:
        return None, f"CE runtime unavailable ({lib.reason})"
    try:
        op = getattr(torch.ops.ce_overlap, name).default
    except (AttributeError, RuntimeError):
        return None, f"torch.ops.ce_overlap.{name} does not exist (the CE runtime has no {ctype} op yet)"
    names = [a.name for a in op._schema.arguments]
    if "input" not in names or not set(names) <= {"input", "group_size", "group_name", "reduce_op", RATE_ARG}:
        return None, f"torch.ops.ce_overlap.{name} has an unexpected schema: {op._schema}"
    return op, ""


def _runtime_op(ctype: str, name: str | None, schema_ok: Callable[[list[str]], bool]):
    """torch.ops.ce_overlap.<name>.default if the runtime serves `ctype` at all and the op's argument names pass
    `schema_ok`, else None."""
    if name is None or not ce_op_for(ctype)[0]:
        return None
    try:
        op = getattr(torch.ops.ce_overlap, name).default
    except (AttributeError, RuntimeError):
        return None
    return op if schema_ok([a.name for a in op._schema.arguments]) else None


def ce_many_op_for(ctype: str):
    """The runtime's multi-tensor op for a collective type, or None (then a bucket is packed into one buffer)."""
    return _runtime_op(ctype, CE_MANY_OPS.get(ctype), lambda names: bool(names) and names[0] == "inputs" and set(
        names) <= {"inputs", "group_size", "group_name", "reduce_op", RATE_ARG})


def ce_unreduced_op():
    """The runtime's unreduced reduce-scatter op (torch.ops.ce_overlap.reduce_scatter_tensors_unreduced), or None
    (then a CE reduce-scatter keeps the runtime's reduction kernel). Needs the runtime's pass-through
    (STORED_OP) too, through which the graph reads the own chunks (_rewrite_unreduced)."""
    if _runtime_op("reduce_scatter", STORED_OP, lambda names: names == ["tensor"]) is None:
        return None
    return _runtime_op("reduce_scatter", CE_UNREDUCED_OP,
                       lambda names: names in (["inputs", "group_size", "group_name"],
                                               ["inputs", "group_size", "group_name", RATE_ARG]))


def _ce_args(op, **values) -> list:
    """The op's arguments in schema order. Its copy rate (RATE_ARG: the plan's per-bucket rate) only where the op
    takes one, and then only when set: an unpaced bucket's node reads as before."""
    args = [values[a.name] for a in op._schema.arguments]
    names = [a.name for a in op._schema.arguments]
    if names and names[-1] == RATE_ARG and not values[RATE_ARG]:
        args.pop()
    return args


def _add_check(build: "_Builder", graph: torch.fx.Graph, result: torch.fx.Node, inp: torch.fx.Node,
               cb: CheckedBucket, where: str) -> None:
    """check_numerics: compare the CE result with torch.distributed's on the first call (inductor/check.py)."""
    from . import check

    c0 = cb.members[0]
    with graph.inserting_after(result):
        token = build(aten.empty.memory_format, [[1]], {"dtype": torch.uint8, "device": result.meta["val"].device},
                      name="check_token")
    with graph.inserting_after(token):
        build(check.compare_op(), [result, inp, cb.type, str(c0.reduce_op_arg or ""), c0.group_size,
                                   str(c0.group_name), f"{where} bucket {cb.id}", token], name="check")


def _sum_in_consumer(cb: CheckedBucket, backend: str, ce_reduction: str) -> tuple:
    """(op, rank) when this bucket is a CE reduce-scatter whose sum the graph does (PassConfig.ce_reduction), else
    (None, None): the reducing CE op then runs."""
    c0 = cb.members[0]
    if backend != "ce" or cb.type != "reduce_scatter" or ce_reduction != "consumer" or c0.group_size is None:
        return None, None
    if str(c0.reduce_op_arg or "").lower() not in _SUMMABLE:
        return None, None
    # bfloat16 and float32 only: a float16 sum would need its own rounding on the bits (see _round_to_bfloat16).
    if any(c.input.meta["val"].dtype not in (torch.bfloat16, torch.float32) for c in cb.members):
        return None, None
    pg = group_of(c0.group_name)  # unresolvable (e.g. a captured graph outside its group): the reducing op
    rank = int(pg.rank()) if pg is not None else None
    if rank is None or not 0 <= rank < c0.group_size:
        return None, None
    if c0.group_size == 1:  # nothing to move: the result is the input
        return "identity", rank
    op = ce_unreduced_op()
    return (op, rank) if op is not None else (None, None)


def _round_to_bfloat16(build: "_Builder", x: torch.fx.Node, name: str) -> torch.fx.Node:
    """x (float32) rounded to the nearest bfloat16, ties to even, NaN kept; still float32. Inductor drops a
    float32 -> bfloat16 -> float32 round trip inside a fused kernel (it computes bfloat16 in float32), so a
    reduced bfloat16 gradient that a kernel upcasts again would skip the rounding NCCL's bfloat16 sum does. This is
    that rounding done on the bits (what c10::BFloat16's conversion does), which no fusion can drop."""
    bits = build(aten.view.dtype, [x, torch.int32], name=f"{name}_bits")
    lsb = build(aten.bitwise_and.Scalar, [build(aten.__rshift__.Scalar, [bits, 16], name=f"{name}_hi", like=bits), 1],
                name=f"{name}_lsb", like=bits)
    biased = build(aten.add.Tensor, [build(aten.add.Scalar, [bits, 0x7FFF], name=f"{name}_half", like=bits), lsb],
                   name=f"{name}_biased", like=bits)
    kept = build(aten.bitwise_and.Scalar, [biased, -65536], name=f"{name}_kept", like=bits)  # the bfloat16 bits
    rounded = build(aten.view.dtype, [kept, torch.float32], name=f"{name}_rne", like=x)
    return build(aten.where.self, [build(aten.isnan.default, [x], name=f"{name}_nan"), x, rounded], name=name, like=x)


def _rewrite_unreduced(build: "_Builder", graph: torch.fx.Graph, cb: CheckedBucket, op, rank: int,
                       first_coll: torch.fx.Node, first_wait: torch.fx.Node, wait_op,
                       check_where: str | None) -> list[torch.fx.Node]:
    """A CE reduce-scatter whose sum is left to the graph: one unreduced op over the members' own inputs (rows: the
    peers' chunks for this rank), one wait, and per member own chunk + the rows' sum in fp32, rounded once to the
    dtype (avg: times 1 / group size first, as the runtime's kernel; bfloat16 rounded on the bits, see _round_to_bfloat16, and so is
    the own chunk as read). Inductor fuses all of it into the kernel that reads the result. bfloat16 and float32
    buckets only (_sum_in_consumer)."""
    members = cb.members
    c0 = members[0]
    g = c0.group_size
    convert = torch.ops.prims.convert_element_type.default
    with graph.inserting_before(first_coll):
        ins = [build.contiguous(c.input, f"in{i}") for i, c in enumerate(members)]
        # The own chunks are read through the runtime's pass-through (ce_overlap.stored): Inductor, which cannot
        # see through it, then reads the input where it is stored. Read directly, a pointwise input (the
        # embedding's gradient: an fp32 accumulation cast to bfloat16) is recomputed from its source inside the
        # consumer, which keeps that source (twice the bytes) alive until the consumer runs (measured 2026-11-27:
        # +1.4 GiB at the training step's peak, bench/results/memory-2026-11-27).
        stored_op = getattr(torch.ops.ce_overlap, STORED_OP).default
        pinned = [build(stored_op, [x], name=f"stored{i}", like=x) for i, x in enumerate(ins)]
        coll = None if op == "identity" else build(
            op, _ce_args(op, inputs=ins, group_size=g, group_name=str(c0.group_name), copy_rate_gbps=cb.copy_rate_gbps),
            name="reduce_scatter_unreduced")
    outs, totals = [], []
    with graph.inserting_before(first_wait):
        rows = build(wait_op, [coll], name="wait") if coll is not None else None
        off = 0
        for i, (c, x) in enumerate(zip(members, pinned)):
            v = c.input.meta["val"]
            m = int(v.numel()) // g
            own = build(aten.select.int, [build(aten.view.default, [x, [g, m]], name=f"chunks{i}"), 0, rank],
                        name=f"own{i}")
            if rows is None:
                total = own
            else:
                total = own32 = build(convert, [own, torch.float32], name=f"own{i}_f32")
                if v.dtype == torch.bfloat16:
                    # Should Inductor still compute the own chunk inside this kernel instead of reading the stored
                    # bfloat16 (a float32 value cast to bfloat16, a cast it then drops), the copy engines send the
                    # stored, rounded value: round it here too (a no-op on stored data).
                    total = _round_to_bfloat16(build, total, f"own{i}_rounded")
                peers = build(aten.slice.Tensor, [rows, 1, off, off + m], name=f"peers{i}")
                peer_sum = build(aten.sum.dim_IntList, [build(convert, [peers, torch.float32], name=f"peers{i}_f32"),
                                                        [0]], name=f"peer_sum{i}", like=own32)
                total = build(aten.add.Tensor, [total, peer_sum], name=f"sum{i}", like=own32)
                if str(c0.reduce_op_arg).lower() == "avg":
                    # times the reciprocal, as the runtime's kernel does: Inductor turns a division by a constant
                    # into this on GPUs but not on CPUs, and at 3 ranks the two round differently.
                    total = build(aten.mul.Tensor, [total, 1.0 / g], name=f"mean{i}", like=own32)
                if v.dtype == torch.bfloat16:
                    total = _round_to_bfloat16(build, total, f"rounded{i}")
                total = build(convert, [total, v.dtype], name=f"reduced{i}")
            outs.append(build(aten.view.default, [total, [v.shape[0] // g, *v.shape[1:]]], name=f"out{i}"))
            totals.append(total)
            off += m
        if check_where is not None and coll is not None:
            # Check mode: the bucket's result (concatenated) against torch.distributed on the packed bucket.
            # The packed input first: the check goes right after the result, so everything it reads must come before.
            packed = _pack_reduce_scatter(build, members, g, ins)
            flat = [build(aten.view.default, [t, [-1]], name=f"flat{i}") for i, t in enumerate(totals)]
            result = build(aten.cat.default, [flat], name="result")
            _add_check(build, graph, result, packed, cb, check_where)
    return outs


def _rewrite_bucket(graph: torch.fx.Graph, cb: CheckedBucket, backend: str, pos: dict[torch.fx.Node, int],
                    check_where: str | None = None, pack_ce: bool = False,
                    ce_reduction: str = "kernel", replaced: dict | None = None) -> list[str]:
    """Rewrites one bucket. `replaced` maps the waits of buckets rewritten before to what replaced them: a member
    whose input was such a wait (chained collectives: tensor parallelism's all-reduce of a gradient, then its
    data-parallel reduce-scatter) reads the replacement; the bucket's own waits are added to it."""
    replaced = {} if replaced is None else replaced
    for c in cb.members:
        while c.input in replaced:
            c.input = replaced[c.input]
    members = cb.members
    first_coll = min((c.node for c in members), key=pos.__getitem__)
    first_wait = min(cb.waits, key=pos.__getitem__)
    c0 = members[0]
    g = c0.group_size
    build = _Builder(graph, [c.node for c in members], f"ce_overlap_b{cb.id}")
    ce = backend == "ce"
    wait_op = torch.ops.ce_overlap.wait_tensor.default if ce else c10d.wait_tensor.default
    unreduced_op, rank = _sum_in_consumer(cb, backend, ce_reduction) if not pack_ce else (None, None)

    if unreduced_op is not None:
        outs = _rewrite_unreduced(build, graph, cb, unreduced_op, rank, first_coll, first_wait, wait_op, check_where)
    elif len(members) == 1:  # CE swap of a singleton bucket
        with graph.inserting_before(first_coll):
            x = build.contiguous(c0.input, "in")
            op, _ = ce_op_for(c0.type)
            coll = build(op, _ce_args(op, input=x, reduce_op=c0.reduce_op_arg, group_size=g,
                                      group_name=str(c0.group_name), copy_rate_gbps=cb.copy_rate_gbps), name=c0.type)
        with graph.inserting_before(first_wait):
            wait = build(wait_op, [coll], name="wait")
        outs = [wait]
        if check_where is not None:
            _add_check(build, graph, wait, x, cb, check_where)
    elif ce and not pack_ce and (op := ce_many_op_for(cb.type)) is not None:  # one multi-tensor op: no copy kernels
        with graph.inserting_before(first_coll):
            ins = [build.contiguous(c.input, f"in{i}") for i, c in enumerate(members)]
            coll = build(op, _ce_args(op, inputs=ins, reduce_op=c0.reduce_op_arg, group_size=g,
                                      group_name=str(c0.group_name), copy_rate_gbps=cb.copy_rate_gbps), name=cb.type)
        if cb.type == "all_gather":
            with graph.inserting_before(first_wait):
                outs = [build(wait_op, [build(operator.getitem, [coll, i], name=f"part{i}")], name=f"wait{i}")
                        for i in range(len(members))]
            if check_where is not None:
                for out, x in zip(outs, ins):
                    _add_check(build, graph, out, x, cb, check_where)
        else:
            with graph.inserting_before(first_wait):
                # The check compares with torch.distributed on the packed bucket (check mode only).
                buf = _pack_reduce_scatter(build, members, g, ins) if check_where is not None else None
                wait = build(wait_op, [coll], name="wait")
                outs = _scattered_views(build, wait, members, g)
            if check_where is not None:
                _add_check(build, graph, wait, buf, cb, check_where)
    else:
        vals = [c.input.meta["val"] for c in members]
        numels = [int(v.numel()) for v in vals]
        with graph.inserting_before(first_coll):
            if cb.type == "reduce_scatter":
                buf = _pack_reduce_scatter(build, members, g, [build.contiguous(c.input, f"in{i}")
                                                              for i, c in enumerate(members)])
            else:
                buf = _pack_all_gather(build, members, numels)
            if ce:
                op, _ = ce_op_for(cb.type)
                args = _ce_args(op, input=buf, reduce_op=c0.reduce_op_arg, group_size=g, group_name=str(c0.group_name),
                                copy_rate_gbps=cb.copy_rate_gbps)
            else:
                op = getattr(c10d, _MERGEABLE[cb.type]).default
                args = _ce_args(op, input=buf, reduce_op=c0.reduce_op_arg, group_size=g, group_name=c0.group_name)
            coll = build(op, args, name=cb.type)
        if ce and check_where is not None:
            with graph.inserting_before(first_wait):
                wait = build(wait_op, [coll], name="wait")
            _add_check(build, graph, wait, buf, cb, check_where)  # between the wait and the copy-outs
        with graph.inserting_before(first_wait):
            if not (ce and check_where is not None):
                wait = build(wait_op, [coll], name="wait")
            outs = []
            if cb.type == "all_gather":
                total = sum(numels)
                grid = build(aten.view.default, [wait, [g, total]], name="grid")
                outs = _gathered_views(build, grid, vals, numels, g)
            elif cb.type == "reduce_scatter":
                outs = _scattered_views(build, wait, members, g)
            else:
                off = 0
                for i, (v, n) in enumerate(zip(vals, numels)):
                    sl = build(aten.slice.Tensor, [wait, 0, off, off + n], name=f"slice{i}")
                    outs.append(build(aten.view.default, [sl, list(v.shape)], name=f"out{i}"))
                    off += n
    _replace_waits(graph, cb, outs, members, replaced, "copy-out")
    return [n.name for n in build.created]


def _window_middle(order: list[torch.fx.Node], pos: dict, first_coll: torch.fx.Node,
                   first_wait: torch.fx.Node) -> torch.fx.Node:
    """The node halfway through a bucket's window in the plan's order (a node no rewrite erases: not a collective or
    a wait), where a hierarchical bucket's second half is issued: its first half has had half the window."""
    lo, hi = pos[first_coll], pos[first_wait]
    for i in range((lo + hi + 1) // 2, hi):
        n = order[i]
        if n.graph is not None and not getattr(n, "_erased", False) and not is_functional_collective(n) \
                and not is_wait(n):
            return n
    return first_wait


def _rewrite_hier(graph: torch.fx.Graph, cb: CheckedBucket, pos: dict, order: list[torch.fx.Node],
                  replaced: dict) -> list[str]:
    """Rewrites a hierarchical bucket (ce_overlap.runtime.hierarchical's order, in the graph): an all-gather is the
    rail all-gather (the group's backend, over the nodes) issued where the bucket was, the node all-gather on copy
    engines issued halfway through the window, and at the first wait one copy into group-rank order; a
    reduce-scatter is that copy and the node reduce-scatter on copy engines where the bucket was, then the rail
    reduce-scatter halfway. Members are packed into one buffer as a merged NCCL bucket is."""
    from ..runtime import hierarchical

    for c in cb.members:
        while c.input in replaced:
            c.input = replaced[c.input]
    members = cb.members
    c0 = members[0]
    h = hierarchical.lookup(c0.group)
    if h is None or h.nodes * h.per_node != c0.group_size:
        raise InvariantError(f"bucket {cb.id}: group '{c0.group}' has no hierarchy of {c0.group_size} ranks")
    m, p, n = h.nodes, h.per_node, c0.group_size
    rail, node = h.rail.group_name, h.node.group_name
    first_coll = min((c.node for c in members), key=pos.__getitem__)
    first_wait = min(cb.waits, key=pos.__getitem__)
    middle = _window_middle(order, pos, first_coll, first_wait)
    build = _Builder(graph, [c.node for c in members], f"ce_overlap_b{cb.id}")
    vals = [c.input.meta["val"] for c in members]
    numels = [int(v.numel()) for v in vals]
    total = sum(numels)
    ce_wait = torch.ops.ce_overlap.wait_tensor.default
    ce_op, why = ce_op_for(cb.type)
    if ce_op is None:
        raise InvariantError(f"bucket {cb.id}: hierarchical without the CE op ({why})")
    if cb.type == "all_gather":
        with graph.inserting_before(first_coll):
            buf = _pack_all_gather(build, members, numels)
            across = build(c10d.all_gather_into_tensor.default,
                           _ce_args(c10d.all_gather_into_tensor.default, input=buf, group_size=m, group_name=rail),
                           name="rail_all_gather")
        with graph.inserting_before(middle):
            got = build(c10d.wait_tensor.default, [across], name="rail_wait")
            inside = build(ce_op, _ce_args(ce_op, input=got, group_size=p, group_name=node, reduce_op=None,
                                           copy_rate_gbps=0.0), name="node_all_gather")
        with graph.inserting_before(first_wait):
            w = build(ce_wait, [inside], name="node_wait")
            ranked = build(aten.permute.default, [build(aten.view.default, [w, [p, m, total]], name="by_local"),
                                                  [1, 0, 2]], name="by_rank")
            dense = build(aten.clone.default, [ranked], {"memory_format": torch.contiguous_format}, "ranked")
            grid = build(aten.view.default, [dense, [n, total]], name="grid")
            outs = _gathered_views(build, grid, vals, numels, n)
    else:
        chunk = total // n
        with graph.inserting_before(first_coll):
            buf = _pack_reduce_scatter(build, members, n, [build.contiguous(c.input, f"in{i}")
                                                           for i, c in enumerate(members)])
            by_local = build(aten.permute.default, [build(aten.view.default, [buf, [m, p, chunk]], name="by_rank"),
                                                    [1, 0, 2]], name="by_local")
            dense = build(aten.clone.default, [by_local], {"memory_format": torch.contiguous_format}, "local_major")
            flat = build(aten.view.default, [dense, [total]], name="flat")
            inside = build(ce_op, _ce_args(ce_op, input=flat, reduce_op=c0.reduce_op_arg, group_size=p,
                                           group_name=node, copy_rate_gbps=0.0), name="node_reduce_scatter")
        with graph.inserting_before(middle):
            summed = build(ce_wait, [inside], name="node_wait")
            across = build(c10d.reduce_scatter_tensor.default,
                           _ce_args(c10d.reduce_scatter_tensor.default, input=summed, reduce_op=c0.reduce_op_arg,
                                    group_size=m, group_name=rail), name="rail_reduce_scatter")
        with graph.inserting_before(first_wait):
            w = build(c10d.wait_tensor.default, [across], name="rail_wait")
            outs = _scattered_views(build, w, members, n)
    _replace_waits(graph, cb, outs, members, replaced, "hierarchical copy-out")
    return [x.name for x in build.created]


def _pack_all_gather(build: "_Builder", members: list, numels: list[int]) -> torch.fx.Node:
    """The packed input of a merged all-gather: every member's shard, flattened, in member order."""
    parts = [build(aten.view.default, [build.contiguous(c.input, f"in{i}"), [n]], name=f"in{i}")
             for i, (c, n) in enumerate(zip(members, numels))]
    return build(aten.cat.default, [parts], name="buf")


def _gathered_views(build: "_Builder", grid: torch.fx.Node, vals: list, numels: list[int],
                    g: int) -> list[torch.fx.Node]:
    """Each member's gathered tensor from a merged all-gather's (g ranks x packed shards) grid: its columns, made
    dense, viewed as g times its shard's rows."""
    outs, off = [], 0
    for i, (v, n) in enumerate(zip(vals, numels)):
        sl = build(aten.slice.Tensor, [grid, 1, off, off + n], name=f"slice{i}")
        dense = build(aten.clone.default, [sl], {"memory_format": torch.contiguous_format}, f"copy{i}")
        outs.append(build(aten.view.default, [dense, [g * v.shape[0], *v.shape[1:]]], name=f"out{i}"))
        off += n
    return outs


def _replace_waits(graph: torch.fx.Graph, cb, outs: list[torch.fx.Node], members: list, replaced: dict,
                   what: str) -> None:
    """The bucket's copy-outs take its waits' place (checked against each wait's shape and dtype), then the waits and
    the collectives they waited on leave the graph."""
    for w, out in zip(cb.waits, outs):
        want, got = w.meta.get("val"), out.meta["val"]
        if isinstance(want, torch.Tensor) and (tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype):
            raise InvariantError(f"bucket {cb.id}: {what} for {w.name} has shape {tuple(got.shape)} {got.dtype}, "
                                 f"the wait had {tuple(want.shape)} {want.dtype}")
        users = list(w.users)
        w.replace_all_uses_with(out)
        replaced[w] = out
        _repair_user_meta(users)
    for w in cb.waits:
        graph.erase_node(w)
    for c in members:
        graph.erase_node(c.node)


def _pack_reduce_scatter(build: "_Builder", members: list, g: int, ins: list[torch.fx.Node]) -> torch.fx.Node:
    """The packed input of a merged reduce-scatter: rank p's chunk is every member's chunk p, in member order."""
    numels = [int(c.input.meta["val"].numel()) for c in members]
    parts = [build(aten.view.default, [x, [g, n // g]], name=f"in{i}") for i, (x, n) in enumerate(zip(ins, numels))]
    cat = build(aten.cat.default, [parts, 1], name="cat")
    return build(aten.view.default, [cat, [sum(numels)]], name="buf")


def _scattered_views(build: "_Builder", wait: torch.fx.Node, members: list, g: int) -> list[torch.fx.Node]:
    """Each member's reduce-scattered result: a view of the bucket's output (the members' chunks, concatenated)."""
    outs, off = [], 0
    for i, c in enumerate(members):
        v = c.input.meta["val"]
        m = int(v.numel()) // g
        sl = build(aten.slice.Tensor, [wait, 0, off, off + m], name=f"slice{i}")
        outs.append(build(aten.view.default, [sl, [v.shape[0] // g, *v.shape[1:]]], name=f"out{i}"))
        off += m
    return outs


BackendChooser = Callable[[CheckedBucket], "tuple[str, str]"]


def apply_plan(graph: torch.fx.Graph, checked: CheckedPlan, choose_backend: BackendChooser | None = None,
               check_where: str | None = None, pack_ce: bool = False,
               ce_reduction: str = "kernel") -> list[BucketResult]:
    """Reorders `graph` to the checked plan's order and rewrites its buckets. `choose_backend(bucket)`
    returns the backend to use and why (default: the plan's backend); "ce" needs the CE op. With
    `check_where` (a label such as the graph's name), every CE bucket gets a first-call comparison against
    torch.distributed (inductor/check.py). `pack_ce`: CE buckets are packed into one buffer like NCCL buckets
    instead of running as one multi-tensor op (PassConfig.pack_ce_buckets). `ce_reduction` (PassConfig's):
    "consumer" leaves a CE reduce-scatter's sum (sum / avg of bfloat16 or float32 data) to the graph, "kernel"
    keeps the runtime's reduction kernel."""
    reorder(graph, checked.order)
    pos = {n: i for i, n in enumerate(checked.order)}
    results = []
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}  # rewritten waits -> their copy-outs (_rewrite_bucket)
    for cb in checked.buckets:
        backend, reason = choose_backend(cb) if choose_backend else (cb.backend, cb.reason)
        if backend in ("ce", "hier"):
            op, why = ce_op_for(cb.type)
            if op is None:
                backend, reason = "nccl", f"nccl: {why}"
        nodes: list[str] = []
        if backend == "hier":
            nodes = _rewrite_hier(graph, cb, pos, checked.order, replaced)
        elif len(cb.members) > 1 or backend == "ce":
            nodes = _rewrite_bucket(graph, cb, backend, pos, check_where if backend == "ce" else None, pack_ce,
                                    ce_reduction, replaced)
        results.append(BucketResult(id=cb.id, type=cb.type, members=len(cb.members), bytes=int(cb.raw["bytes"]),
                                    planned_backend=cb.backend, backend=backend, reason=reason, nodes=nodes,
                                    copy_rate_gbps=cb.copy_rate_gbps if backend == "ce" else 0.0,
                                    role=cb.raw.get("role")))
    graph.lint()
    graph.eliminate_dead_code()
    return results


# --------------------------------------------------------------------------------------------------
# Structural invariants of a (rewritten) graph


def check_invariants(graph: torch.fx.Graph) -> None:
    """Raises InvariantError unless: every node comes after its inputs; every collective (functional or
    ce_overlap) is consumed only by waits of its own family (directly, or through getitem for
    coalesced ones) and has at least one; every wait consumes a collective; so every use of a
    collective's result comes after its wait. Across graphs (docs/ir.md): a functional collective's result may
    also be a graph output, and a wait may consume a graph input (a collective of an earlier graph, which the
    pass never rewrites: only functional waits can wait on it)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    problems = []
    for node in graph.nodes:
        for inp in node.all_input_nodes:
            if pos[inp] >= pos[node]:
                problems.append(f"{node.name} comes before its input {inp.name}")
        functional = is_functional_collective(node)
        if functional or is_ce_collective(node):
            if not node.users and node.target._opname != "all_gather_into_tensor_out":
                problems.append(f"collective {node.name} is never waited on")
            family = "ce_overlap" if not functional else None
            for user in node.users:
                if user.op == "output" and functional:
                    continue  # handed to the next graph, which waits on it
                waits = [user]
                if user.op == "call_function" and user.target is operator.getitem:
                    waits = list(user.users)
                    if not waits:
                        continue
                for w in waits:
                    if not is_wait(w):
                        problems.append(f"{w.name} uses collective {node.name}'s result without a wait")
                    elif (w.target.namespace == "ce_overlap") != (family == "ce_overlap"):
                        problems.append(f"{w.name} ({w.target}) waits on {node.name} ({node.target}) of another "
                                        "runtime")
                    elif pos[w] <= pos[node]:
                        problems.append(f"wait {w.name} comes before its collective {node.name}")
        if is_wait(node):
            src = node.args[0] if node.args else None
            if isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is operator.getitem:
                src = src.args[0]
            if isinstance(src, torch.fx.Node) and src.op == "placeholder":
                if node.target.namespace == "ce_overlap":
                    problems.append(f"wait {node.name} is a ce_overlap wait on graph input {src.name}")
                continue
            if not (isinstance(src, torch.fx.Node) and (is_functional_collective(src) or is_ce_collective(src))):
                problems.append(f"wait {node.name} consumes {getattr(src, 'name', src)}, not a collective")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise InvariantError("graph invariant broken: " + "; ".join(problems[:5]) + more)
