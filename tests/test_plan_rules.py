"""The Plan's rules have one owner, the C++ core (csrc/graph/plan_check.cc): the FX rewriter's check_plan reports
the core's rule and node, binds the Plan to the FX nodes, and keeps only the rewriter's own precondition.
Graphs are small and made by hand (make_fx on fake tensors over the `fake` process group)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import ce_overlap
from ce_overlap import _core
from ce_overlap.inductor import rewrite
from ce_overlap.inductor.capture import fake_process_group
from ce_overlap.inductor.to_ir import core_document

GROUP_SIZE = 2
c10d = torch.ops._c10d_functional


def _graph(f, *shapes):
    """The FX graph of f traced on fake float32 tensors of `shapes`, its collectives over a group of GROUP_SIZE."""
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(f, tracing_mode="fake")(*[torch.zeros(s) for s in shapes]).graph


def _unwaited_graph():
    """An all-gather whose result leaves the graph without a wait (the next graph waits on it: docs/ir.md), beside
    a waited one."""
    group = dist.group.WORLD.group_name

    def f(x, y):
        handed_on = c10d.all_gather_into_tensor(x, GROUP_SIZE, group)
        waited = c10d.wait_tensor(c10d.all_gather_into_tensor(y * 2, GROUP_SIZE, group))
        return handed_on, waited + 1

    return _graph(f, (4, 2), (3, 2))  # x: 32 bytes per rank


def _plan(graph, **config):
    return ce_overlap.ir.plan(core_document(graph, "forward"), "forward", "h100-sxm", config or None)


def _refusal(graph, plan, **kw) -> rewrite.PlanRuleError:
    with pytest.raises(rewrite.PlanRuleError) as err:
        rewrite.check_plan(graph, plan, **kw)
    return err.value


def test_a_collective_without_a_wait_is_a_singleton_counted_once():
    """The Python checker added such a member's bytes twice and refused the planner's correct plan ("bucket.bytes
    ... bytes 32 but its members sum to 64")."""
    with fake_process_group(GROUP_SIZE, 0):
        graph = _unwaited_graph()
        plan = _plan(graph, ce="off")
        handed_on = next(n for n in graph.nodes if rewrite.is_functional_collective(n)
                         and any(u.op == "output" for u in n.users))
        bucket = next(b for b in plan["buckets"] if b["members"][0]["collective"] == handed_on.name)
        assert bucket["members"] == [{"collective": handed_on.name, "wait": None, "bytes": 32}]
        assert bucket["bytes"] == 32 and bucket["backend"] == "nccl"

        checked = rewrite.check_plan(graph, plan)
        cb = checked.buckets[bucket["id"]]
        assert [c.node for c in cb.members] == [handed_on] and cb.waits == []
        assert [n.name for n in checked.order] == plan["order"]
        rewrite.apply_plan(graph, checked)
        rewrite.check_invariants(graph)
        assert handed_on in graph.nodes  # kept where it was captured

        wrong = copy.deepcopy(plan)
        wrong["buckets"][bucket["id"]]["members"][0]["bytes"] = 64
        wrong["buckets"][bucket["id"]]["bytes"] = 64
        err = _refusal(graph, wrong)
        assert (err.rule, err.node) == ("bucket.bytes", handed_on.name), str(err)
        assert "members[0].bytes: expected 32" in str(err)

        wrong = copy.deepcopy(plan)
        wrong["buckets"][bucket["id"]]["bytes"] = 64
        err = _refusal(graph, wrong)
        assert (err.rule, err.node) == ("bucket.bytes", f"bucket {bucket['id']}"), str(err)


def test_a_result_read_without_a_wait_is_refused_by_the_rewriter():
    """The planner keeps such a collective where it was captured (a valid Plan, which the core accepts), but the
    rewritten graph could not keep its invariants: the rewriter refuses it, naming the collective."""
    group = None

    def f(x):
        gathered = c10d.all_gather_into_tensor(x, GROUP_SIZE, group)
        return gathered * 2  # read without a wait

    with fake_process_group(GROUP_SIZE, 0):
        group = dist.group.WORLD.group_name
        graph = _graph(f, (4, 2))
        plan = _plan(graph)
        ce_overlap.ir.check_plan(core_document(graph, "forward"), plan)  # the Plan itself breaks no rule
        coll = next(n for n in graph.nodes if rewrite.is_functional_collective(n))
        err = _refusal(graph, plan)
    assert (err.rule, err.node) == ("bucket.wait", coll.name)
    assert "used without a wait" in str(err)


def test_rules_only_the_core_checked_before_are_refused_by_the_rewriter_too():
    """The union of the two checkers' rules: what only C++ checked now refuses a Plan in the pass as well."""
    with fake_process_group(GROUP_SIZE, 0):
        graph = _unwaited_graph()
        plan = _plan(graph, ce="off")
        ir = core_document(graph, "forward")
        rewrite.check_plan(graph, plan, ir=ir)  # the IR the planner read, as the pass gives it

        counts = copy.deepcopy(plan)
        counts["summary"]["collectives"] += 1
        err = _refusal(graph, counts, ir=ir)
        assert (err.rule, err.node) == ("summary.counts", None) and "summary.collectives: expected 2" in str(err)

        other = copy.deepcopy(plan)
        other["graph"] = "backward"
        err = _refusal(graph, other, ir=ir)
        assert err.rule == "plan.graph" and 'no graph named "backward"' in str(err)

        ce = copy.deepcopy(plan)
        waited = next(b for b in ce["buckets"] if b["members"][0]["wait"] is not None)
        waited.update(backend="ce", reason="ce: forced")
        waited["predicted"]["ce_us"] = waited["predicted"]["ce_cost_us"] = None
        ce["summary"]["ce_buckets"] = 1
        err = _refusal(graph, ce, ir=ir)
        assert (err.rule, err.node) == ("bucket.predicted", f"bucket {waited['id']}")

        unwaited = copy.deepcopy(plan)
        kept = next(b for b in unwaited["buckets"] if b["members"][0]["wait"] is None)
        kept.update(backend="ce", reason="ce: forced")
        kept["predicted"]["ce_us"] = kept["predicted"]["ce_cost_us"] = 1.0
        unwaited["summary"]["ce_buckets"] = 1
        err = _refusal(graph, unwaited, ir=ir)
        assert (err.rule, err.node) == ("bucket.wait", kept["members"][0]["collective"])
        assert "no wait reads it" in str(err)


def test_the_core_reports_rule_and_node_to_every_caller():
    with fake_process_group(GROUP_SIZE, 0):
        graph = _unwaited_graph()
        plan = _plan(graph)
        ir = core_document(graph, "forward")
    plan["order"].append(plan["order"][0])
    with pytest.raises(_core.PlanRuleError) as err:
        ce_overlap.ir.check_plan(ir, plan)
    assert isinstance(err.value, ce_overlap.CeOverlapError)
    assert (err.value.rule, err.value.node) == ("order.complete", plan["order"][0])
    assert str(err.value).startswith(f"order[{len(plan['order']) - 1}]: ")
    with pytest.raises(_core.PlanRuleError) as err:
        ce_overlap.ir.load_plan("{")
    assert (err.value.rule, err.value.node) == ("schema", None)


def test_plans_that_are_not_json_are_refused_as_schema():
    with fake_process_group(GROUP_SIZE, 0):
        graph = _unwaited_graph()
    for plan in ({"schema": object()}, {"schema": float("nan")}, ["a", "list"]):
        err = _refusal(graph, plan)
        assert (err.rule, err.node) == ("schema", None), str(err)
