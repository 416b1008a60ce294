"""A Plan (docs/plan.md) against the FX graph it rewrites. The C++ core owns the Plan's schema and rules
(csrc/graph/plan_check.cc): check_plan() runs them on the IR of the graph (the same IR the planner read) and turns
a broken rule into PlanRuleError(rule, node, detail); then it binds the Plan's names to the FX nodes (CheckedPlan)
and checks the one precondition that belongs to the FX rewriter rather than to the Plan (`_check_waited`)."""
from __future__ import annotations

import dataclasses
import json

import torch
import torch.fx

from .. import _core
from .. import ir as ir_mod
from ..errors import CeOverlapError
from .collectives import Collective, collectives_in
from .to_ir import core_document


class PlanRuleError(CeOverlapError):
    """A Plan breaks a rule of docs/plan.md against the FX graph. `rule` names the rule, `node` the FX
    node (or bucket) where it broke."""

    def __init__(self, rule: str, node: str | None, detail: str):
        self.rule, self.node, self.detail = rule, node, detail
        where = f" at {node}" if node else ""
        super().__init__(f"plan rule '{rule}' broken{where}: {detail}")


@dataclasses.dataclass
class CheckedBucket:
    id: int
    type: str
    backend: str
    reason: str
    members: list[Collective]  # layout order
    waits: list[torch.fx.Node]
    raw: dict
    copy_rate_gbps: float = 0.0  # the plan's per-bucket copy rate (GB/s per peer copy); 0: unpaced


@dataclasses.dataclass
class CheckedPlan:
    order: list[torch.fx.Node]
    buckets: list[CheckedBucket]
    plan: dict


def check_plan(graph: torch.fx.Graph, plan: dict, ir=None) -> CheckedPlan:
    """Every rule of docs/plan.md against `graph`; raises PlanRuleError(rule, node, detail). `ir`: the IR the
    Plan was made from (an Ir, an IrDocument or IR JSON text, holding `graph` under the Plan's graph name);
    None builds it from `graph`."""
    try:
        text = json.dumps(plan, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise PlanRuleError("schema", None, f"a Plan is JSON, this is not: {e}") from None
    if ir is None:
        name = plan.get("graph") if isinstance(plan, dict) else None
        ir = core_document(graph, name if isinstance(name, str) and name else "graph")
    try:
        ir_mod.check_plan(ir, text)
    except _core.PlanRuleError as e:
        raise PlanRuleError(e.rule, e.node, str(e)) from None
    return _bind(graph, plan)


def _bind(graph: torch.fx.Graph, plan: dict) -> CheckedPlan:
    """The checked Plan's names as FX nodes. A name the graph lacks means `ir` was not this graph's IR."""
    by_name = {n.name: n for n in graph.nodes}
    colls = collectives_in(graph)

    def node(name: str, table: dict):
        if name not in table:
            raise PlanRuleError("order.complete", name, "the Plan was checked against an IR that is not this graph's: "
                                                        f"{name!r} is no {'collective' if table is colls else 'node'} "
                                                        "of the FX graph")
        return table[name]

    if len(plan["order"]) != len(by_name):
        raise PlanRuleError("order.complete", None, f"the Plan was checked against an IR that is not this graph's: "
                                                    f"order names {len(plan['order'])} nodes, the FX graph has "
                                                    f"{len(by_name)}")
    order = [node(name, by_name) for name in plan["order"]]
    buckets = []
    for b in plan["buckets"]:
        members = [node(m["collective"], colls) for m in b["members"]]
        waits = [node(m["wait"], by_name) for m in b["members"] if m["wait"] is not None]
        for c in members:
            _check_waited(c)
        buckets.append(CheckedBucket(id=b["id"], type=b["type"], backend=b["backend"], reason=b["reason"],
                                     members=members, waits=waits, raw=b,
                                     copy_rate_gbps=float(b.get("copy_rate_gbps") or 0.0)))
    return CheckedPlan(order=order, buckets=buckets, plan=plan)


def _check_waited(c: Collective) -> None:
    """The rewriter's precondition, not a Plan rule (the planner keeps such a collective where it was captured, on
    NCCL): every use of a collective's result goes through a wait, or is the graph's output (the next graph waits
    on it: a collective issued in the forward and waited on in the backward). The rewritten graph's invariants
    (rewrite.check_invariants) would fail on any other use, so such a graph is refused up front."""
    unwaited = [u for u in c.other_users if u.op != "output"]
    if unwaited:
        raise PlanRuleError("bucket.wait", c.node.name, f"its result is used without a wait by "
                            f"{[u.name for u in unwaited]}")
