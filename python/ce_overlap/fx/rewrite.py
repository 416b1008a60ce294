"""Apply a Plan (docs/plan.md, schema ce_overlap.plan/1) to the post-grad FX graph it was made from.

check_plan() verifies every rule of the Plan against the FX graph and raises PlanRuleError naming the
rule and the node; apply_plan() then reorders the nodes to the Plan's `order` and rewrites each bucket:
one copy-in, one collective (NCCL `_c10d_functional.*` or `ce_overlap.*`), one wait, and a copy-out
that replaces every member wait. A CE bucket (unless packed on request) is instead ONE multi-tensor op,
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
from torch.fx.operator_schemas import normalize_function
from torch.utils import _pytree as pytree

from ..errors import CeOverlapError
from .to_ir import _COLLECTIVE_TYPES, _DTYPE_NAMES, _FUNCTIONAL_NAMESPACES, _REDUCE_OPS

log = logging.getLogger("ce_overlap")

PLAN_SCHEMA = "ce_overlap.plan/1"
BACKENDS = ("nccl", "ce")

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# Ops a multi-member bucket can merge (the plain functional forms; _out and _coalesced variants stay
# as they are and may only be singleton NCCL buckets).
_MERGEABLE = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}
# The CE runtime's op per collective type (torch.ops.ce_overlap.<name>), if the runtime has it.
CE_OPS = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
}
# Its multi-tensor form: a whole bucket as one collective that reads every member's input where it lies (and, for
# all-gathers, writes every member's output), so the bucket needs no copy-in / copy-out kernels.
CE_MANY_OPS = {
    "all_gather": "all_gather_into_tensors",
    "reduce_scatter": "reduce_scatter_tensors",
}
# A reduce-scatter's exchange without its reduction (PassConfig.ce_reduction="consumer"): the graph adds the peers'
# chunks to this rank's own, and Inductor fuses that add into the kernel that reads the result.
CE_UNREDUCED_OP = "reduce_scatter_tensors_unreduced"
_SUMMABLE = ("sum", "avg")


class PlanRuleError(CeOverlapError):
    """A Plan breaks a rule of docs/plan.md against the FX graph. `rule` names the rule, `node` the FX
    node (or bucket) where it broke."""

    def __init__(self, rule: str, node: str | None, detail: str):
        self.rule, self.node, self.detail = rule, node, detail
        where = f" at {node}" if node else ""
        super().__init__(f"plan rule '{rule}' broken{where}: {detail}")


class InvariantError(RuntimeError):
    """A rewritten graph breaks a structural invariant (a bug in the rewriter, never user input)."""


# --------------------------------------------------------------------------------------------------
# Reading collectives out of the FX graph


def _is_op(node: torch.fx.Node, namespaces: Iterable[str]) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target.namespace in namespaces


def is_functional_collective(node: torch.fx.Node) -> bool:
    return _is_op(node, _FUNCTIONAL_NAMESPACES) and node.target._opname != "wait_tensor" \
        and node.target._opname.rstrip("_") in _COLLECTIVE_TYPES


def is_ce_collective(node: torch.fx.Node) -> bool:
    return _is_op(node, ("ce_overlap",)) and node.target._opname in set(CE_OPS.values()) | set(
        CE_MANY_OPS.values()) | {CE_UNREDUCED_OP, "all_gather_into_tensor_out"}


def is_wait(node: torch.fx.Node) -> bool:
    return _is_op(node, _FUNCTIONAL_NAMESPACES | {"ce_overlap"}) and node.target._opname == "wait_tensor"


def _kwargs(node: torch.fx.Node) -> dict:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else dict(node.kwargs)


@dataclasses.dataclass
class Collective:
    node: torch.fx.Node
    type: str                  # IR collective type
    opname: str                # all_gather_into_tensor, reduce_scatter_tensor, ...
    input: torch.fx.Node | None
    group: str
    group_name: object         # the argument as it appears in the graph
    group_size: int | None
    reduce_op: str | None      # normalized (IR) name
    reduce_op_arg: str | None  # as in the graph
    dtype: str | None
    bytes: int                 # per-rank input bytes (IR collective.bytes)
    waits: list[torch.fx.Node]  # wait_tensor nodes consuming it (directly or through getitem)
    other_users: list[torch.fx.Node]


def _val_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_val_bytes(v) for v in val)
    return 0


def read_collective(node: torch.fx.Node) -> Collective:
    opname = node.target._opname
    kw = _kwargs(node)
    inp = kw.get("input", kw.get("inputs"))
    inp_node = inp if isinstance(inp, torch.fx.Node) else None
    nbytes = sum(_val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    dtype = None
    val = inp_node.meta.get("val") if inp_node is not None else None
    if isinstance(val, torch.Tensor):
        dtype = _DTYPE_NAMES.get(val.dtype)
    group_name = kw.get("group_name")
    group_size = kw.get("group_size")
    if group_size is None and group_name is not None:
        pg = _group_of(group_name)  # an unknown group: the size stays unknown, checked later
        group_size = pg.size() if pg is not None else None
    reduce_arg = kw.get("reduce_op")
    reduce_op = _REDUCE_OPS.get(str(reduce_arg).lower(), str(reduce_arg).lower()) if reduce_arg is not None else None
    waits, others = [], []
    for user in node.users:
        if is_wait(user):
            waits.append(user)
        elif user.op == "call_function" and user.target is operator.getitem and all(is_wait(u) for u in user.users) \
                and user.users:
            waits.extend(user.users)
        else:
            others.append(user)
    ctype = _COLLECTIVE_TYPES.get(opname.rstrip("_"), "all_gather" if "all_gather" in opname else opname)
    return Collective(node=node, type=ctype, opname=opname, input=inp_node, group=str(group_name),
                      group_name=group_name, group_size=int(group_size) if group_size is not None else None,
                      reduce_op=reduce_op, reduce_op_arg=reduce_arg, dtype=dtype, bytes=int(nbytes), waits=waits,
                      other_users=others)


def collectives_in(graph: torch.fx.Graph) -> dict[str, Collective]:
    return {n.name: read_collective(n) for n in graph.nodes if is_functional_collective(n)}


# --------------------------------------------------------------------------------------------------
# The rules of docs/plan.md, checked against the FX graph


def _need(obj: dict, key: str, types, where: str):
    if not isinstance(obj, dict) or key not in obj:
        raise PlanRuleError("schema", where, f"missing field {key!r}")
    value = obj[key]
    if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
        raise PlanRuleError("schema", where, f"field {key!r} has the wrong type ({type(value).__name__})")
    return value


@dataclasses.dataclass
class CheckedBucket:
    id: int
    type: str
    backend: str
    reason: str
    members: list[Collective]  # layout order
    waits: list[torch.fx.Node]
    raw: dict


@dataclasses.dataclass
class CheckedPlan:
    order: list[torch.fx.Node]
    buckets: list[CheckedBucket]
    plan: dict


def check_plan(graph: torch.fx.Graph, plan: dict) -> CheckedPlan:
    """Every rule of docs/plan.md against `graph`; raises PlanRuleError(rule, node, detail)."""
    if not isinstance(plan, dict):
        raise PlanRuleError("schema", None, f"a Plan is a JSON object, got {type(plan).__name__}")
    if plan.get("schema") != PLAN_SCHEMA:
        raise PlanRuleError("schema", None, f"expected schema {PLAN_SCHEMA!r}, got {plan.get('schema')!r}")
    config = _need(plan, "config", dict, "plan")
    cap = _need(config, "bucket_cap_bytes", int, "config")
    budget = _need(config, "memory_budget_bytes", int, "config")
    order_names = _need(plan, "order", list, "plan")
    buckets = _need(plan, "buckets", list, "plan")
    summary = _need(plan, "summary", dict, "plan")

    # -- order: every node exactly once, topological, placeholders first, output last
    by_name = {n.name: n for n in graph.nodes}
    pos: dict[str, int] = {}
    for i, name in enumerate(order_names):
        if not isinstance(name, str):
            raise PlanRuleError("order.complete", None, f"order[{i}] is not a node name: {name!r}")
        if name not in by_name:
            raise PlanRuleError("order.complete", name, f"order[{i}] names no node of the graph")
        if name in pos:
            raise PlanRuleError("order.complete", name, f"named twice in order (at {pos[name]} and {i})")
        pos[name] = i
    if len(pos) != len(by_name):
        missing = next(n for n in by_name if n not in pos)
        raise PlanRuleError("order.complete", missing,
                            f"order names {len(pos)} of the graph's {len(by_name)} nodes; this one is missing")
    order = [by_name[n] for n in order_names]
    seen_other = None
    for node in order:
        if node.op == "placeholder" and seen_other is not None:
            raise PlanRuleError("order.placeholders_first", node.name, f"placeholder after {seen_other}")
        if node.op != "placeholder":
            seen_other = node.name
    if order and order[-1].op != "output":
        raise PlanRuleError("order.output_last", order[-1].name, "the last node of order is not the output")
    for node in order:
        for inp in node.all_input_nodes:
            if pos[inp.name] > pos[node.name]:
                raise PlanRuleError("order.topological", node.name,
                                    f"comes before its input {inp.name} in order ({pos[node.name]} < {pos[inp.name]})")

    # -- buckets
    colls = collectives_in(graph)
    owner: dict[str, int] = {}
    checked: list[CheckedBucket] = []
    for bi, b in enumerate(buckets):
        where = f"buckets[{bi}]"
        bid = _need(b, "id", int, where)
        btype = _need(b, "type", str, where)
        group = _need(b, "group", str, where)
        gsize = _need(b, "group_size", int, where)
        if "dtype" not in b or not (b["dtype"] is None or isinstance(b["dtype"], str)):
            raise PlanRuleError("schema", where, "field 'dtype' must be a dtype name or null")
        dtype = b["dtype"]
        if "reduce_op" not in b:
            raise PlanRuleError("schema", where, "missing field 'reduce_op'")
        reduce_op = b["reduce_op"]
        members = _need(b, "members", list, where)
        nbytes = _need(b, "bytes", int, where)
        backend = _need(b, "backend", str, where)
        reason = _need(b, "reason", str, where)
        _need(b, "predicted", dict, where)
        where = f"bucket {bid}"
        if any(cb.id == bid for cb in checked):
            raise PlanRuleError("schema", where, "bucket id used twice")
        if backend not in BACKENDS:
            raise PlanRuleError("bucket.backend", where, f"backend must be 'nccl' or 'ce', got {backend!r}")
        if not reason.startswith(backend) or "\n" in reason:
            raise PlanRuleError("bucket.reason", where,
                                f"reason must be one line starting with {backend!r}: {reason!r}")
        if not members:
            raise PlanRuleError("bucket.members", where, "a bucket has at least one member")
        mcolls, mwaits, total = [], [], 0
        for mi, m in enumerate(members):
            mwhere = f"{where}.members[{mi}]"
            cname = _need(m, "collective", str, mwhere)
            if "wait" not in m:
                raise PlanRuleError("schema", mwhere, "missing field 'wait'")
            wname = m["wait"]
            if wname is not None and not isinstance(wname, str):
                raise PlanRuleError("schema", mwhere, f"field 'wait' must be a node name or null, got {wname!r}")
            mbytes = _need(m, "bytes", int, mwhere)
            if cname not in colls:
                raise PlanRuleError("bucket.coverage", cname, f"{mwhere} names no collective of the graph")
            if cname in owner:
                raise PlanRuleError("bucket.coverage", cname, f"in two buckets ({owner[cname]} and {bid})")
            owner[cname] = bid
            c = colls[cname]
            for field, want, got in (("type", btype, c.type), ("group", group, c.group),
                                     ("group_size", gsize, c.group_size), ("dtype", dtype, c.dtype),
                                     ("reduce_op", reduce_op, c.reduce_op)):
                if want != got:
                    raise PlanRuleError("bucket.members_match", cname,
                                        f"bucket {bid} has {field}={want!r} but this member has {got!r}")
            if mbytes != c.bytes:
                raise PlanRuleError("bucket.bytes", cname, f"member bytes {mbytes} but the collective's per-rank "
                                                           f"input is {c.bytes} bytes")
            total += mbytes
            direct = [w for w in c.node.users if is_wait(w)]
            if wname is None:
                if c.waits:
                    raise PlanRuleError("bucket.wait", cname,
                                        f"the plan names no wait but {c.waits[0].name} waits on it")
                if len(members) > 1 or backend == "ce":
                    raise PlanRuleError("bucket.wait", cname, "a collective without a wait cannot be merged or "
                                                              "moved to CE")
                mcolls.append(c)
                total += mbytes
                continue
            if wname not in by_name:
                raise PlanRuleError("bucket.wait", cname, f"wait {wname!r} is no node of the graph")
            w = by_name[wname]
            if w not in c.waits:
                raise PlanRuleError("bucket.wait", cname, f"{wname} is not a wait_tensor of this collective")
            simple = len(direct) == 1 and not c.other_users and len(c.waits) == 1
            if not simple and (len(members) > 1 or backend == "ce"):
                raise PlanRuleError("bucket.wait", cname, "the collective must be consumed by exactly one wait_tensor "
                                    f"to be merged or moved to CE (users: {[u.name for u in c.node.users]})")
            # The graph's output may take the result unwaited: the next graph waits on it (a collective issued in
            # the forward and waited on in the backward). Such a collective is never simple: it stays as it is.
            unwaited = [u for u in c.other_users if u.op != "output"]
            if unwaited:
                raise PlanRuleError("bucket.wait", cname, f"its result is used without a wait by "
                                    f"{[u.name for u in unwaited]}")
            mcolls.append(c)
            mwaits.append(w)
        if nbytes != total:
            raise PlanRuleError("bucket.bytes", where, f"bytes {nbytes} but its members sum to {total}")
        if len(members) > 1 and nbytes > cap:
            raise PlanRuleError("bucket.cap", where, f"{nbytes} bytes over config.bucket_cap_bytes {cap}")
        if len(members) > 1:
            for c in mcolls:
                if _MERGEABLE.get(c.type) != c.opname:
                    raise PlanRuleError("bucket.supported", c.node.name,
                                        f"{c.opname} cannot be merged into a bucket (only "
                                        f"{', '.join(sorted(_MERGEABLE.values()))})")
                val = c.input.meta.get("val") if c.input is not None else None
                if not isinstance(val, torch.Tensor) or val.dim() == 0:
                    raise PlanRuleError("bucket.supported", c.node.name, "merged collectives need a tensor input of "
                                        "at least one dimension with a known shape")
                if c.type == "reduce_scatter" and (c.group_size is None or val.shape[0] % c.group_size):
                    raise PlanRuleError("bucket.supported", c.node.name, f"reduce-scatter input dim 0 ({val.shape[0]}) "
                                        f"is not a multiple of the group size {c.group_size}")
        # -- order: member collectives contiguous, waits contiguous, inputs first, wait users after
        cpos = sorted(pos[c.node.name] for c in mcolls)
        wpos = sorted(pos[w.name] for w in mwaits) or [cpos[-1]]
        if cpos[-1] - cpos[0] != len(cpos) - 1:
            gap = order[next(p for p in range(cpos[0], cpos[-1]) if p not in set(cpos))]
            raise PlanRuleError("order.bucket_collectives_contiguous", gap.name,
                                f"between member collectives of bucket {bid}")
        if mwaits and wpos[-1] - wpos[0] != len(wpos) - 1:
            gap = order[next(p for p in range(wpos[0], wpos[-1]) if p not in set(wpos))]
            raise PlanRuleError("order.bucket_waits_contiguous", gap.name, f"between member waits of bucket {bid}")
        for c in mcolls:
            for inp in c.node.all_input_nodes:
                if pos[inp.name] > cpos[0]:
                    raise PlanRuleError("order.bucket_inputs_first", inp.name,
                                        f"input of {c.node.name} comes after bucket {bid}'s first collective")
        for w in mwaits:
            for user in w.users:
                if pos[user.name] < wpos[-1]:
                    raise PlanRuleError("order.wait_users_after", user.name,
                                        f"uses {w.name} before bucket {bid}'s last wait")
        checked.append(CheckedBucket(id=bid, type=btype, backend=backend, reason=reason, members=mcolls,
                                     waits=mwaits, raw=b))
    for name in colls:
        if name not in owner:
            raise PlanRuleError("bucket.coverage", name, "collective of the graph in no bucket")

    # -- memory
    before = _need(summary, "peak_memory_bytes_before", int, "summary")
    after = _need(summary, "peak_memory_bytes_after", int, "summary")
    if after - before > budget:
        raise PlanRuleError("summary.memory_budget", None, f"peak memory grows by {after - before} bytes, over "
                            f"config.memory_budget_bytes {budget}")
    return CheckedPlan(order=order, buckets=checked, plan=plan)


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
    if "input" not in names or not set(names) <= {"input", "group_size", "group_name", "reduce_op"}:
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
        names) <= {"inputs", "group_size", "group_name", "reduce_op"})


def ce_unreduced_op():
    """The runtime's unreduced reduce-scatter op (torch.ops.ce_overlap.reduce_scatter_tensors_unreduced), or None
    (then a CE reduce-scatter keeps the runtime's reduction kernel)."""
    return _runtime_op("reduce_scatter", CE_UNREDUCED_OP, lambda names: names == ["inputs", "group_size", "group_name"])


def _group_of(group_name):
    """The process group a collective names, or None if it cannot be resolved (no process group, unknown name)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(str(group_name))
    except Exception:  # noqa: BLE001
        return None


def _ce_args(op, **values) -> list:
    return [values[a.name] for a in op._schema.arguments]


def _add_check(build: "_Builder", graph: torch.fx.Graph, result: torch.fx.Node, inp: torch.fx.Node,
               cb: CheckedBucket, where: str) -> None:
    """check_numerics: compare the CE result with torch.distributed's on the first call (fx/check.py)."""
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
    pg = _group_of(c0.group_name)  # unresolvable (e.g. a captured graph outside its group): the reducing op
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
        coll = None if op == "identity" else build(op, [ins, g, str(c0.group_name)], name="reduce_scatter_unreduced")
    outs, totals = [], []
    with graph.inserting_before(first_wait):
        rows = build(wait_op, [coll], name="wait") if coll is not None else None
        off = 0
        for i, (c, x) in enumerate(zip(members, ins)):
            v = c.input.meta["val"]
            m = int(v.numel()) // g
            own = build(aten.select.int, [build(aten.view.default, [x, [g, m]], name=f"chunks{i}"), 0, rank],
                        name=f"own{i}")
            if rows is None:
                total = own
            else:
                total = own32 = build(convert, [own, torch.float32], name=f"own{i}_f32")
                if v.dtype == torch.bfloat16:
                    # Inductor may compute the own chunk inside this kernel instead of reading the stored bfloat16
                    # (e.g. a norm weight's gradient: a float32 sum cast to bfloat16, a cast it then drops); the
                    # copy engines send the stored, rounded value, so round it here too (a no-op on stored data).
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
                    ce_reduction: str = "kernel") -> list[str]:
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
                                      group_name=str(c0.group_name)), name=c0.type)
        with graph.inserting_before(first_wait):
            wait = build(wait_op, [coll], name="wait")
        outs = [wait]
        if check_where is not None:
            _add_check(build, graph, wait, x, cb, check_where)
    elif ce and not pack_ce and (op := ce_many_op_for(cb.type)) is not None:  # one multi-tensor op: no copy kernels
        with graph.inserting_before(first_coll):
            ins = [build.contiguous(c.input, f"in{i}") for i, c in enumerate(members)]
            coll = build(op, _ce_args(op, inputs=ins, reduce_op=c0.reduce_op_arg, group_size=g,
                                      group_name=str(c0.group_name)), name=cb.type)
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
                parts = [build(aten.view.default, [build.contiguous(c.input, f"in{i}"), [n]], name=f"in{i}")
                         for i, (c, n) in enumerate(zip(members, numels))]
                buf = build(aten.cat.default, [parts], name="buf")
            if ce:
                op, _ = ce_op_for(cb.type)
                args = _ce_args(op, input=buf, reduce_op=c0.reduce_op_arg, group_size=g, group_name=str(c0.group_name))
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
                off = 0
                for i, (v, n) in enumerate(zip(vals, numels)):
                    sl = build(aten.slice.Tensor, [grid, 1, off, off + n], name=f"slice{i}")
                    dense = build(aten.clone.default, [sl], {"memory_format": torch.contiguous_format}, f"copy{i}")
                    outs.append(build(aten.view.default, [dense, [g * v.shape[0], *v.shape[1:]]], name=f"out{i}"))
                    off += n
            elif cb.type == "reduce_scatter":
                outs = _scattered_views(build, wait, members, g)
            else:
                off = 0
                for i, (v, n) in enumerate(zip(vals, numels)):
                    sl = build(aten.slice.Tensor, [wait, 0, off, off + n], name=f"slice{i}")
                    outs.append(build(aten.view.default, [sl, list(v.shape)], name=f"out{i}"))
                    off += n
    for w, out in zip(cb.waits, outs):
        want = w.meta.get("val")
        got = out.meta["val"]
        if isinstance(want, torch.Tensor) and (tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype):
            raise InvariantError(f"bucket {cb.id}: copy-out for {w.name} has shape {tuple(got.shape)} {got.dtype}, "
                                 f"the wait had {tuple(want.shape)} {want.dtype}")
        users = list(w.users)
        w.replace_all_uses_with(out)
        _repair_user_meta(users)
    for w in cb.waits:
        graph.erase_node(w)
    for c in members:
        graph.erase_node(c.node)
    return [n.name for n in build.created]


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
    torch.distributed (fx/check.py). `pack_ce`: CE buckets are packed into one buffer like NCCL buckets
    instead of running as one multi-tensor op (PassConfig.pack_ce_buckets). `ce_reduction` (PassConfig's):
    "consumer" leaves a CE reduce-scatter's sum (sum / avg of bfloat16 or float32 data) to the graph, "kernel"
    keeps the runtime's reduction kernel."""
    reorder(graph, checked.order)
    pos = {n: i for i, n in enumerate(checked.order)}
    results = []
    for cb in checked.buckets:
        backend, reason = choose_backend(cb) if choose_backend else (cb.backend, cb.reason)
        if backend == "ce":
            op, why = ce_op_for(cb.type)
            if op is None:
                backend, reason = "nccl", f"nccl: {why}"
        nodes: list[str] = []
        if len(cb.members) > 1 or backend == "ce":
            nodes = _rewrite_bucket(graph, cb, backend, pos, check_where if backend == "ce" else None, pack_ce,
                                    ce_reduction)
        results.append(BucketResult(id=cb.id, type=cb.type, members=len(cb.members), bytes=int(cb.raw["bytes"]),
                                    planned_backend=cb.backend, backend=backend, reason=reason, nodes=nodes))
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
