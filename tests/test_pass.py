"""The ce_overlap graph pass (docs/pass.md): config, Plan rules, the FX rewriter on real captured graphs,
exact numerics of the bucket layouts, and torch.compile end to end on CPU.

Graphs come from the real torch.compile pipeline on fake tensors over the `fake` process group
(ce_overlap.inductor.capture); each model is captured once per session and every test works on a copy.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import logging
import warnings
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.fx

import ce_overlap
from ce_overlap import PassConfig, logs, models
from ce_overlap.inductor import backend_choice, pass_, rewrite
from ce_overlap.inductor.capture import CaptureOptions, capture_graphs, fake_process_group
from ce_overlap.models.llama import LLAMA_CONFIGS

from conftest import DATA
from test_pass_helpers import (EmulatedCollectives, ir_graph, make_planner, peak_memory, plan_from_ir, real_inputs,
                               run_emulated)

WORLD = 8
MIB = 1 << 20


@functools.cache
def _captured(model: str):
    from ce_overlap import models

    built = models.build_named(model)
    graphs, _ = capture_graphs(built.module, built.example_inputs, CaptureOptions(world_size=WORLD))
    return dict(graphs)


def fresh(model: str, graph: str) -> torch.fx.GraphModule:
    """A private copy of a captured graph (nodes copied, fake values shared read-only)."""
    gm = _captured(model)[graph]
    g = torch.fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return torch.fx.GraphModule(gm, g)


@pytest.fixture(autouse=True)
def _fresh_log_once():
    logs.forget_said()
    yield
    logs.forget_said()


def _type_of(node: torch.fx.Node) -> str:
    name = node.target._opname
    return "all_gather" if name.startswith("all_gather") else "reduce_scatter" if name.startswith("reduce_scatter") \
        else name


def collectives_by_block(gm: torch.fx.GraphModule, name: str) -> collections.Counter:
    """(block, type) -> count of NCCL and CE collectives, blocks as the C++ detection assigns them."""
    blocks = {n["name"]: n["block"] for n in ir_graph(gm, name)["nodes"]}
    return collections.Counter((blocks[n.name], _type_of(n)) for n in gm.graph.nodes
                               if rewrite.is_functional_collective(n) or rewrite.is_ce_collective(n))


def measured_peak(gm: torch.fx.GraphModule, name: str) -> int:
    nodes = ir_graph(gm, name)["nodes"]
    return peak_memory(nodes, [n["id"] for n in nodes])


# --------------------------------------------------------------------------------------------------
# PassConfig and the Inductor hooks


def test_config_defaults_and_plan_config():
    c = PassConfig()
    assert (c.enabled, c.ce, c.profile, c.dump_dir, c.verbose) == (True, "auto", "auto", None, False)
    assert c.plan_config() == {"bucket_cap_bytes": 512 * MIB, "memory_budget_bytes": 4096 * MIB, "ce": "auto",
                               "min_ce_bytes": MIB, "prefetch_blocks": 1, "bucket_patterns": [],
                               "ce_reduction": "consumer", "ce_collectives": ["all_gather", "reduce_scatter"],
                               "copy_pace_fill": 0.0}
    c2 = PassConfig(bucket_patterns=[r"layers\.\d+"], bucket_cap_mb=0.5)
    assert c2.bucket_patterns == (r"layers\.\d+",) and c2.plan_config()["bucket_cap_bytes"] == MIB // 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.ce = "on"
    for f in dataclasses.fields(PassConfig):  # a docstring per field (the attribute docstring in the source)
        assert re.search(rf"    {f.name}: [^\n]+\n    \"\"\"\S", open(ce_overlap.config.__file__).read()), f.name


@pytest.mark.parametrize("field,value", [
    ("enabled", 1), ("bucket_cap_mb", 0), ("bucket_cap_mb", -3), ("bucket_cap_mb", float("nan")),
    ("bucket_cap_mb", "512"), ("memory_budget_mb", -1), ("memory_budget_mb", True), ("ce", "always"),
    ("ce", None), ("min_ce_bytes", -1), ("min_ce_bytes", 1.5), ("prefetch_blocks", -1), ("prefetch_blocks", 5000),
    ("bucket_patterns", "layers"), ("bucket_patterns", ["("]), ("bucket_patterns", [""]), ("profile", "h900"),
    ("profile", ""), ("profile", "/nonexistent/profile.json"), ("dump_dir", 3), ("verbose", "yes"),
    ("ce_collectives", "all_gather"), ("ce_collectives", ["all_reduce"]), ("keep_inductor_overlap", None),
    ("check_numerics", "yes"), ("pack_ce_buckets", 0), ("ce_reduction", "sm"), ("ce_reduction", None),
    ("copy_pace_fill", 1.5), ("copy_pace_fill", -0.1), ("copy_pace_fill", "half"), ("copy_pace_fill", float("nan")),
])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ce_overlap.CeOverlapError, match=rf"PassConfig\.{field}"):
        PassConfig(**{field: value})


def test_config_dump_dir_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ce_overlap.CeOverlapError, match="PassConfig.dump_dir"):
        PassConfig(dump_dir=str(f))
    assert PassConfig(dump_dir=tmp_path / "new").dump_dir == str(tmp_path / "new")


def test_config_from_env_and_default_config():
    env = {"CE_OVERLAP_PASS_CE": "on", "CE_OVERLAP_PASS_BUCKET_CAP_MB": "64", "CE_OVERLAP_PASS_VERBOSE": "1",
           "CE_OVERLAP_PASS_BUCKET_PATTERNS": '["layers\\\\.\\\\d+"]', "CE_OVERLAP_PASS_PROFILE": "h200-sxm"}
    c = PassConfig.from_env(env, min_ce_bytes=0)
    assert (c.ce, c.bucket_cap_mb, c.verbose, c.bucket_patterns, c.profile, c.min_ce_bytes) == \
        ("on", 64.0, True, (r"layers\.\d+",), "h200-sxm", 0)
    with pytest.raises(ce_overlap.CeOverlapError, match="CE_OVERLAP_PASS_PREFETCH_BLOCKS"):
        PassConfig.from_env({"CE_OVERLAP_PASS_PREFETCH_BLOCKS": "two"})
    with pytest.raises(ce_overlap.CeOverlapError, match="PassConfig.ce"):
        PassConfig.from_env({"CE_OVERLAP_PASS_CE": "maybe"})
    try:
        assert ce_overlap.set_default_config(ce="off").ce == "off"
        assert ce_overlap.get_default_config().ce == "off"
        assert ce_overlap.set_default_config(PassConfig(prefetch_blocks=2)).prefetch_blocks == 2
        with pytest.raises(ce_overlap.CeOverlapError):
            ce_overlap.set_default_config(PassConfig(), ce="on")
    finally:
        ce_overlap.set_default_config(None)
    assert ce_overlap.get_default_config() == PassConfig.from_env()


def test_inductor_options_install_the_pass_and_turn_off_conflicting_passes(caplog):
    current = torch._inductor.config.get_config_copy()
    with caplog.at_level(logging.INFO, logger="ce_overlap"):
        opts = ce_overlap.inductor_options(ce="on", bucket_cap_mb=256)
    p = opts["post_grad_custom_post_pass"]
    assert isinstance(p, torch._inductor.custom_graph_pass.CustomGraphPass)
    assert p.config == PassConfig(ce="on", bucket_cap_mb=256)
    for key, off in pass_.CONFLICTING_INDUCTOR_OPTIONS:
        assert (opts.get(key) == off) if key in current else key not in opts
    # the keys Inductor must know on this torch (2.11 has these too)
    for key in ("reorder_for_compute_comm_overlap", "aten_distributed_optimizations.enable_overlap_scheduling",
                "bucket_all_gathers_fx", "bucket_reduce_scatters_fx"):
        assert key in opts
    assert "turning off Inductor's own collective bucketing" in caplog.text
    kept = ce_overlap.inductor_options(keep_inductor_overlap=True)
    assert set(kept) == {"post_grad_custom_post_pass"}
    # torch.compile accepts every key and value (it validates them against Inductor's config)
    torch._TorchCompileInductorWrapper("default", opts, dynamic=False)
    with torch._inductor.config.patch(opts):
        assert torch._inductor.config.post_grad_custom_post_pass is p
    with pytest.raises(ce_overlap.CeOverlapError, match="PassConfig.ce"):
        ce_overlap.inductor_options(ce="sometimes")


def test_uuid_hashes_config_and_sources():
    a = pass_.CeOverlapPass(PassConfig())
    assert a.uuid() == pass_.CeOverlapPass(PassConfig()).uuid()
    assert a.uuid() != pass_.CeOverlapPass(PassConfig(ce="off")).uuid()
    assert a.uuid() != pass_.CeOverlapPass(PassConfig(bucket_cap_mb=1)).uuid()
    assert len(pass_.source_fingerprint()) == 64
    import pickle

    assert pickle.loads(pickle.dumps(a.uuid())) == a.uuid()
    # Ranks get different keys, whatever the config: the ranks agree on each plan before the rewrite (a rank loading
    # a graph another compiled would never publish its plan), and a rewritten graph may read this rank's own chunk.
    for config in (PassConfig(), PassConfig(ce_reduction="kernel"), PassConfig(ce="off")):
        keys = []
        for rank in (0, 1):
            with fake_process_group(2, rank):
                keys.append(pass_.CeOverlapPass(config).uuid())
        assert keys[0] != keys[1] and a.uuid() not in keys


def test_backend_is_registered():
    assert "ce_overlap" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("ce_overlap") is pass_.ce_overlap_backend


def test_profile_auto_falls_back_to_h100_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert pass_.resolve_profile("auto") == "h100-sxm"
    assert pass_.resolve_profile("h200-sxm") == "h200-sxm"


# --------------------------------------------------------------------------------------------------
# The rewriter on real graphs, with Plans built by an independent Python planner


@pytest.mark.parametrize("model", ["llama3-tiny", "llama3-1b"])
@pytest.mark.parametrize("backend", ["nccl", "ce"])
def test_python_plans_bucket_per_block_and_keep_invariants(model, backend):
    n_layers = LLAMA_CONFIGS[model].n_layers
    for name in ("forward", "backward"):
        gm = fresh(model, name)
        before = measured_peak(gm, name)
        plan = plan_from_ir(ir_graph(gm, name), backend=backend, prefetch=True)
        results = rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan))
        gm.graph.lint()
        rewrite.check_invariants(gm.graph)
        gm.recompile()
        assert {r.backend for r in results} == {backend}
        counts = collectives_by_block(gm, name)
        for i in range(n_layers):
            assert counts[(i, "all_gather")] == 1, (name, i, counts)
            assert counts[(i, "reduce_scatter")] == (name == "backward"), (name, i, counts)
        kinds = collections.Counter(rewrite.is_ce_collective(n) for n in gm.graph.nodes
                                    if rewrite.is_functional_collective(n) or rewrite.is_ce_collective(n))
        assert set(kinds) == {backend == "ce"}
        # the plan's memory accounting and ours agree on the direction; the growth stays in the plan's budget
        after = measured_peak(gm, name)
        assert after - before <= plan["config"]["memory_budget_bytes"]


def _check_one_bucket_per_block(gm, name, n_layers):
    counts = collectives_by_block(gm, name)
    for i in range(n_layers):
        assert counts[(i, "all_gather")] == 1, (name, i, counts)
        assert counts[(i, "reduce_scatter")] == (name == "backward"), (name, i, counts)


def test_ce_collectives_reach_the_planner_so_the_summary_is_what_is_applied():
    config = PassConfig(bucket_cap_mb=4096, ce="on", min_ce_bytes=0, profile="h200-sxm", ce_collectives=("all_gather",))
    gm = fresh("llama3-tiny", "backward")
    with pass_.capture_mode(), fake_process_group(WORLD, 1):
        report = pass_.run_pass(gm.graph, config)
    assert report.changed and report.refused is None
    rs = [b for b in report.buckets if b.type == "reduce_scatter"]
    ag = [b for b in report.buckets if b.type == "all_gather"]
    assert rs and ag
    for b in rs:  # planned on NCCL by the planner itself, not overruled after planning
        assert (b.planned_backend, b.backend, b.reason) == \
            ("nccl", "nccl", "nccl: config.ce_collectives excludes reduce_scatter"), b
    assert all(b.backend == "ce" for b in ag)
    assert report.summary["ce_buckets"] == report.ce_buckets == len(ag)


@pytest.mark.parametrize("model", ["llama3-tiny", "llama3-1b"])
def test_pass_with_the_cpp_planner(model, caplog, tmp_path):
    n_layers = LLAMA_CONFIGS[model].n_layers
    config = PassConfig(bucket_cap_mb=4096, ce="on", min_ce_bytes=0, dump_dir=str(tmp_path), profile="h200-sxm")
    for name in ("forward", "backward"):
        gm = fresh(model, name)
        before = measured_peak(gm, name)
        # In the captured group (rank 1), so reduce-scatters on CE sum in the graph (the default ce_reduction).
        with caplog.at_level(logging.INFO, logger="ce_overlap"), pass_.capture_mode(), \
                fake_process_group(WORLD, 1):
            report = pass_.run_pass(gm.graph, config)
        assert report.changed and report.refused is None and report.graph == name
        op = torch.ops.ce_overlap.reduce_scatter_tensors_unreduced.default
        unreduced = [n for n in gm.graph.nodes if n.target == op]
        assert len(unreduced) == sum(b.type == "reduce_scatter" for b in report.buckets)
        assert bool(unreduced) == (name == "backward")
        # Each own chunk is read through the runtime's pass-through of the op's own input (the stored bytes, not a
        # recomputation that would keep the input's source alive: _rewrite_unreduced).
        pinned = [p for n in unreduced for x in n.args[0] for p in x.users
                  if p.target == torch.ops.ce_overlap.stored.default]
        assert len(pinned) == sum(len(n.args[0]) for n in unreduced)
        selects = [u for p in pinned for v in p.users for u in v.users if u.target == torch.ops.aten.select.int]
        assert len(selects) == len(pinned) and all(u.args[1:] == (0, 1) for u in selects)
        gm.graph.lint()
        rewrite.check_invariants(gm.graph)
        _check_one_bucket_per_block(gm, name, n_layers)
        # ce="on": every bucket the runtime serves runs on CE (all-gather and reduce-scatter ops exist)
        assert all(b.backend == "ce" for b in report.buckets), [(b.id, b.reason) for b in report.buckets]
        assert not any(rewrite.is_functional_collective(n) for n in gm.graph.nodes)
        s = report.summary
        assert s["peak_memory_bytes_after"] - s["peak_memory_bytes_before"] <= s["memory_budget_bytes"]
        assert measured_peak(gm, name) - before <= config.plan_config()["memory_budget_bytes"]
        line = next(r.message for r in caplog.records if r.message.startswith(f"ce_overlap: {name} graph"))
        assert f"{report.collectives} collectives -> {len(report.buckets)} buckets" in line
        assert "predicted exposed comm" in line and "peak memory" in line and "moved to CE" in line
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 4 and {f.split("-")[0] for f in files} == {"forward", "backward"}
    for f in files:
        doc = json.loads((tmp_path / f).read_text())
        assert doc["schema"] == ("ce_overlap.plan/1" if f.endswith(".plan.json") else "ce_overlap.ir/1")


def test_hierarchical_buckets_across_two_nodes_run_the_rail_on_nccl_and_the_node_on_copy_engines():
    """FSDP over 8 ranks as 2 simulated nodes of 4, ce="on" through a capture: every all-gather and reduce-scatter
    bucket is hierarchical; its rail collective (4 x 2 ranks: the group of this rank's local index) is a functional
    collective on 2 ranks, its node collective a CE op on 4, the rail wait sits before the CE issue inside the window
    (not at the issue), and the graph keeps every invariant."""
    from ce_overlap.runtime import hierarchical

    built = models.build_named("llama3-tiny")
    config = PassConfig(ce="on", min_ce_bytes=0, profile="h200-sxm")
    opts = ce_overlap.inductor_options(config)
    graphs, meta = capture_graphs(built.module, built.example_inputs, CaptureOptions(
        world_size=8, nodes=2, inductor_config={"post_grad_custom_post_pass": opts["post_grad_custom_post_pass"]}))
    assert meta["nodes"] == 2
    reports = opts["post_grad_custom_post_pass"].reports
    assert sorted(r.graph for r in reports) == ["backward", "forward"]
    assert hierarchical.lookup("0") is None  # the capture's fake groups ended with it, their hierarchy forgotten
    for (name, gm), r in zip(graphs, sorted(reports, key=lambda r: r.graph != "forward")):
        assert r.graph == name and not r.refused
        assert {b.backend for b in r.buckets} == {"hier"}, [(b.id, b.reason) for b in r.buckets]
        assert "hierarchical (CE inside nodes)" in r.line()
        rewrite.check_invariants(gm.graph)
        nodes = list(gm.graph.nodes)
        where = {n: i for i, n in enumerate(nodes)}
        rails = [n for n in nodes if rewrite.is_functional_collective(n)]
        ces = [n for n in nodes if rewrite.is_ce_collective(n)]
        assert len(rails) == len(ces) == len(r.buckets)
        rail_groups = {rail.args[-1] for rail in rails}
        node_groups = {ce.args[ce.args.index(4) + 1] for ce in ces if 4 in ce.args}
        assert all(rail.args[-2] == 2 for rail in rails) and len(rail_groups) == 1, [r.args for r in rails]
        assert len(node_groups) == 1 and not node_groups & rail_groups and "0" not in rail_groups | node_groups
        if name == "forward":  # all-gathers: rail first; its wait comes after some compute, before the CE issue
            for rail, ce in zip(rails, ces):
                (wait,) = rail.users
                assert where[rail] + 1 < where[wait] < where[ce] and ce.args[0] is wait


def test_paced_buckets_give_their_ce_op_the_plans_copy_rate():
    """PassConfig.copy_pace_fill reaches the planner, and each CE bucket the plan paces passes its rate to its op as
    the last argument (copy_rate_gbps); an unpaced bucket's op reads as before (no rate argument)."""
    config = PassConfig(bucket_cap_mb=4096, ce="on", min_ce_bytes=0, profile="h200-sxm", copy_pace_fill=0.5)
    assert ce_overlap.runtime.library_loaded()
    ce_ops = {getattr(torch.ops.ce_overlap, n).default
              for n in (*rewrite.CE_OPS.values(), *rewrite.CE_MANY_OPS.values(), rewrite.CE_UNREDUCED_OP)}
    paced_total = 0
    for name in ("forward", "backward"):
        gm = fresh("llama3-1b", name)
        with pass_.capture_mode(), fake_process_group(WORLD, 1):
            report = pass_.run_pass(gm.graph, config)
        rates = {b.id: b.copy_rate_gbps for b in report.buckets}
        paced = {i: r for i, r in rates.items() if r}
        paced_total += len(paced)
        assert all(r >= 10 for r in paced.values())
        assert all("GB/s per peer copy" in b.reason for b in report.buckets if b.copy_rate_gbps)
        ops = [n for n in gm.graph.nodes if n.target in ce_ops]
        schema_len = {n: len(n.target._schema.arguments) for n in ops}
        with_rate = sorted(float(n.args[-1]) for n in ops if len(n.args) == schema_len[n])
        assert with_rate == sorted(paced.values())
        rewrite.check_invariants(gm.graph)
    assert paced_total > 0


def test_peak_memory_holds_a_collective_input_until_its_wait():
    """The tests' own liveness model agrees with the planner's: a reduce-scatter reads its input until the wait."""
    def node(i, kind, op, inputs, nbytes):
        return {"id": i, "kind": kind, "op": op, "inputs": inputs, "outputs": [{"bytes": nbytes}]}

    nodes = [node(0, "placeholder", "placeholder", [], 0),
             node(1, "compute", "aten.mm.default", [0], 100),                          # the gradient
             node(2, "collective", "_c10d_functional.reduce_scatter_tensor.default", [1], 50),
             node(3, "compute", "aten.mm.default", [0], 1000),                         # runs before the wait
             node(4, "wait", "_c10d_functional.wait_tensor.default", [2], 50),
             node(5, "output", "output", [3, 4], 0)]
    assert peak_memory(nodes, [0, 1, 2, 3, 4, 5]) == 100 + 50 + 1000  # the gradient is still held at node 3
    assert peak_memory(nodes, [0, 1, 2, 4, 3, 5]) == 50 + 1000        # waited first: freed before node 3


@pytest.mark.parametrize("budget_mb", [0, 2])
def test_memory_budget_holds(budget_mb):
    """The planner's order and buckets keep the measured peak (our own liveness model over the rewritten
    graph, copy-in/copy-out buffers included) within the budget."""
    for name in ("forward", "backward"):
        gm = fresh("llama3-tiny", name)
        before = measured_peak(gm, name)
        report = pass_.run_pass(gm.graph, PassConfig(memory_budget_mb=budget_mb, bucket_cap_mb=4096, ce="off"))
        assert report.changed
        assert measured_peak(gm, name) - before <= budget_mb * MIB
        s = report.summary
        assert s["peak_memory_bytes_after"] - s["peak_memory_bytes_before"] <= budget_mb * MIB


# --------------------------------------------------------------------------------------------------
# Plan rules: every broken rule is refused, naming the rule and the node


def _tiny_forward_plan():
    gm = fresh("llama3-tiny", "forward")
    return gm, plan_from_ir(ir_graph(gm, "forward"), prefetch=True)


def _bucket(plan, n_members=None):
    return next(b for b in plan["buckets"] if n_members is None or len(b["members"]) >= n_members)


def _move_last_past_next(plan, gm, names):
    """Moves the last of `names` (contiguous in `order`) one step later, past the next node, which must not
    use it (so `order` stays topological). Returns the node it moved past, or None if that node uses it."""
    order = plan["order"]
    last = max(order.index(n) for n in names)
    nodes = {n.name: n for n in gm.graph.nodes}
    nxt = order[last + 1]
    if order[last] in [a.name for a in nodes[nxt].all_input_nodes] or nodes[nxt].op == "output":
        return None
    order.insert(last + 1, order.pop(last))
    return nxt


def _split(plan, gm, field):
    for b in plan["buckets"]:
        if len(b["members"]) >= 2:
            gap = _move_last_past_next(plan, gm, [m[field] for m in b["members"]])
            if gap is not None:
                return gap
    raise AssertionError("no bucket whose last member can move")


def _mutations():
    def drop_node(plan, gm):
        return "order.complete", plan["order"].pop(5)

    def duplicate(plan, gm):
        plan["order"].insert(3, plan["order"][7])
        return "order.complete", plan["order"][8]

    def unknown(plan, gm):
        plan["order"][4] = "no_such_node"
        return "order.complete", "no_such_node"

    def not_topological(plan, gm):
        b = _bucket(plan, 2)
        coll = b["members"][0]["collective"]
        wait = b["members"][0]["wait"]
        order = plan["order"]
        order.remove(wait)
        order.insert(order.index(coll), wait)
        return "order.topological", wait

    def placeholder_late(plan, gm):
        order = plan["order"]
        ph = order.pop(0)
        order.insert(len(order) - 1, ph)
        return "order.placeholders_first", ph

    def output_early(plan, gm):
        order = plan["order"]
        out = order.pop()
        order.insert(len(order) - 1, out)
        return "order.output_last", order[-1]

    def member_type(plan, gm):
        b = _bucket(plan, 2)
        b["type"] = "reduce_scatter"
        return "bucket.members_match", b["members"][0]["collective"]

    def member_group(plan, gm):
        b = _bucket(plan, 2)
        b["group_size"] = 4
        return "bucket.members_match", b["members"][0]["collective"]

    def member_bytes(plan, gm):
        b = _bucket(plan, 2)
        b["members"][1]["bytes"] += 2
        return "bucket.bytes", b["members"][1]["collective"]

    def bucket_bytes(plan, gm):
        b = _bucket(plan, 2)
        b["bytes"] += 1
        return "bucket.bytes", f"bucket {b['id']}"

    def over_cap(plan, gm):
        b = _bucket(plan, 2)
        plan["config"]["bucket_cap_bytes"] = b["bytes"] - 1
        return "bucket.cap", f"bucket {b['id']}"

    def not_covered(plan, gm):
        b = _bucket(plan, 2)
        m = b["members"].pop()
        b["bytes"] -= m["bytes"]
        return "bucket.coverage", m["collective"]

    def twice(plan, gm):
        b0, b1 = plan["buckets"][0], plan["buckets"][1]
        b1["members"].append(dict(b0["members"][0]))
        return "bucket.coverage", b0["members"][0]["collective"]

    def wrong_wait(plan, gm):
        b = _bucket(plan, 2)
        b["members"][0]["wait"], b["members"][1]["wait"] = b["members"][1]["wait"], b["members"][0]["wait"]
        return "bucket.wait", b["members"][0]["collective"]

    def bad_backend(plan, gm):
        b = _bucket(plan)
        b["backend"] = "gpu"
        return "bucket.backend", f"bucket {b['id']}"

    def bad_reason(plan, gm):
        b = _bucket(plan)
        b["reason"] = "because"
        return "bucket.reason", f"bucket {b['id']}"

    def collectives_split(plan, gm):
        return "order.bucket_collectives_contiguous", _split(plan, gm, "collective")

    def waits_split(plan, gm):
        return "order.bucket_waits_contiguous", _split(plan, gm, "wait")

    def over_budget(plan, gm):
        plan["summary"]["peak_memory_bytes_after"] = plan["summary"]["peak_memory_bytes_before"] + 10
        plan["config"]["memory_budget_bytes"] = 9
        return "summary.memory_budget", None

    def schema(plan, gm):
        plan["schema"] = "ce_overlap.plan/2"
        return "schema", None

    def missing_field(plan, gm):
        del _bucket(plan)["predicted"]
        return "schema", f"buckets[{_bucket(plan)['id']}]"

    return [drop_node, duplicate, unknown, not_topological, placeholder_late, output_early, member_type,
            member_group, member_bytes, bucket_bytes, over_cap, not_covered, twice, wrong_wait, bad_backend,
            bad_reason, collectives_split, waits_split, over_budget, schema, missing_field]


def test_the_unmodified_test_plan_passes():
    gm, plan = _tiny_forward_plan()
    rewrite.check_plan(gm.graph, plan)


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_broken_plans_are_refused_naming_rule_and_node(mutate):
    gm, plan = _tiny_forward_plan()
    rule, node = mutate(plan, gm)
    with pytest.raises(rewrite.PlanRuleError) as err:
        rewrite.check_plan(gm.graph, plan)
    assert err.value.rule == rule, str(err.value)
    if node is not None:
        assert err.value.node == node, str(err.value)
        assert node in str(err.value)
    assert f"'{rule}'" in str(err.value)


def test_a_refused_plan_warns_and_leaves_the_graph_unchanged(caplog, tmp_path):
    gm = fresh("llama3-tiny", "forward")
    code = gm.code

    def broken(ir, graph_name, config, profile):
        plan = plan_from_ir(ir.to_dict()["graphs"][0])
        plan["order"].reverse()
        return plan

    with caplog.at_level(logging.WARNING, logger="ce_overlap"):
        report = pass_.run_pass(gm.graph, PassConfig(dump_dir=str(tmp_path)), planner=broken)
    assert report.refused and not report.changed
    gm.recompile()
    assert gm.code == code
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1 and "refused the plan" in warning[0].message and "graph unchanged" in warning[0].message
    assert "'order.placeholders_first'" in warning[0].message
    assert sorted(p.rsplit(".", 2)[-2] for p in os.listdir(tmp_path)) == ["ir", "plan"]  # dumped for inspection


def test_disabled_pass_and_graphs_without_collectives_are_untouched():
    gm = fresh("llama3-tiny", "forward")
    code = gm.code
    assert pass_.run_pass(gm.graph, PassConfig(enabled=False)) is None
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    report = pass_.run_pass(g, PassConfig())
    assert report.collectives == 0 and not report.changed
    gm.recompile()
    assert gm.code == code


def test_runtime_absent_keeps_nccl_and_says_so_once(monkeypatch, caplog):
    from ce_overlap import runtime

    monkeypatch.setattr(runtime, "library_loaded",
                        lambda: runtime.Availability(False, "_runtime.so not found (test)"))
    with caplog.at_level(logging.INFO, logger="ce_overlap"), pass_.capture_mode():
        for name in ("forward", "backward"):
            gm = fresh("llama3-tiny", name)
            report = pass_.run_pass(gm.graph, PassConfig(), planner=make_planner(backend="ce"))
            assert report.changed and report.ce_buckets == 0
            assert all(b.reason.startswith("nccl: CE runtime unavailable") for b in report.buckets)
            assert not any(rewrite.is_ce_collective(n) for n in gm.graph.nodes)
            rewrite.check_invariants(gm.graph)
    msgs = [r.message for r in caplog.records if "CE runtime unavailable" in r.message]
    assert msgs == ["ce_overlap: CE runtime unavailable (_runtime.so not found (test)): keeping NCCL"]


def test_ce_collectives_keeps_other_types_on_nccl_with_the_same_plan():
    gm = fresh("llama3-tiny", "backward")
    with pass_.capture_mode():
        report = pass_.run_pass(gm.graph, PassConfig(ce="on", ce_collectives=("all_gather",)),
                                planner=make_planner(backend="ce", prefetch=True))
    by_type = collections.defaultdict(set)
    for b in report.buckets:
        by_type[b.type].add(b.backend)
        assert b.planned_backend == "ce"
        if b.type == "reduce_scatter":
            assert b.reason == "nccl: PassConfig.ce_collectives excludes reduce_scatter"
    assert by_type == {"all_gather": {"ce"}, "reduce_scatter": {"nccl"}}
    rewrite.check_invariants(gm.graph)


def test_graphs_with_symbolic_sizes_are_left_alone(caplog):
    from torch.fx.experimental.proxy_tensor import make_fx

    with fake_process_group(4, 0):
        group = dist.group.WORLD.group_name

        def f(x):
            c10d = torch.ops._c10d_functional
            return c10d.wait_tensor(c10d.all_gather_into_tensor(x * 2, 4, group)) + 1

        gm = make_fx(f, tracing_mode="symbolic")(torch.randn(6, 3))
        code = gm.code
        with caplog.at_level(logging.WARNING, logger="ce_overlap"):
            report = pass_.run_pass(gm.graph, PassConfig(), planner=make_planner())
    assert report.refused and "symbolic" in report.refused
    gm.recompile()
    assert gm.code == code


def test_cpu_graphs_outside_capture_stay_on_nccl(caplog):
    gm = fresh("llama3-tiny", "forward")
    with caplog.at_level(logging.WARNING, logger="ce_overlap"):
        report = pass_.run_pass(gm.graph, PassConfig(), planner=make_planner(backend="ce"))
    assert report.ce_buckets == 0
    assert "CE ops need CUDA tensors" in caplog.text


# --------------------------------------------------------------------------------------------------
# Numerics: the rewritten graph computes exactly what the original does (emulated ranks, real tensors)


@pytest.mark.parametrize("backend", ["nccl", "ce"])
@pytest.mark.parametrize("singletons", [False, True])
def test_rewritten_tiny_graphs_are_bit_identical(backend, singletons):
    for name in ("forward", "backward"):
        gm = fresh("llama3-tiny", name)
        inputs = real_inputs(gm, int_high=LLAMA_CONFIGS["llama3-tiny"].vocab_size)
        want = run_emulated(gm, inputs, WORLD, rank=3)
        plan = plan_from_ir(ir_graph(gm, name), backend=backend, prefetch=True,
                            max_members=1 if singletons else None)
        rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan))
        gm.recompile()
        got = run_emulated(gm, inputs, WORLD, rank=3)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(want, got)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (name, i)


# --------------------------------------------------------------------------------------------------
# A tied weight (GPT-2: the output projection reuses the token embedding's weight), tests/data/gpt2_tied.py


@functools.cache
def _captured_gpt2(gather_once: bool = True):
    """The tied GPT-2's graphs. gather_once=False: as in-graph FSDP without its gather-once window captures it,
    the tied weight gathered twice in the forward (Inductor merges the two), the second read's wait in the
    checkpointed region of the backward: the backward waits on the forward's collective, a graph input."""
    from ce_overlap import models
    from ce_overlap.in_graph import fully_shard as in_graph

    class GatherEveryRead(in_graph._ForwardState):  # no gather-once window
        gather_once = False

    built = models.build_from_file(os.path.join(DATA, "gpt2_tied.py") + ":build")
    state = in_graph._ForwardState
    try:
        if not gather_once:
            in_graph._ForwardState = GatherEveryRead
        graphs, _ = capture_graphs(built.module, built.example_inputs, CaptureOptions(world_size=WORLD))
    finally:
        in_graph._ForwardState = state
    return dict(graphs)


def fresh_gpt2(graph: str, gather_once: bool = True) -> torch.fx.GraphModule:
    gm = _captured_gpt2(gather_once)[graph]
    g = torch.fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, g)


def test_pass_plans_the_tied_weight_like_any_other(caplog):
    """The C++ planner through the pass, CE everywhere: the tied weight's one all-gather and one reduce-scatter are
    bucketed with the embeddings outside the blocks, and every block gets one bucket per collective type."""
    config = PassConfig(bucket_cap_mb=4096, ce="on", min_ce_bytes=0, profile="h200-sxm")
    for name in ("forward", "backward"):
        gm = fresh_gpt2(name)
        n_collectives = sum(rewrite.is_functional_collective(n) for n in gm.graph.nodes)
        assert n_collectives == (28 if name == "forward" else 14 + 28)
        with pass_.capture_mode(), fake_process_group(WORLD, 1):
            report = pass_.run_pass(gm.graph, config)
        assert report.changed and report.refused is None and report.collectives == n_collectives
        gm.graph.lint()
        rewrite.check_invariants(gm.graph)
        _check_one_bucket_per_block(gm, name, 2)
        assert all(b.backend == "ce" for b in report.buckets), [(b.id, b.reason) for b in report.buckets]
        assert sum(b.members for b in report.buckets) == n_collectives
        assert not any(rewrite.is_functional_collective(n) for n in gm.graph.nodes)
        # outside the blocks: wte, wpe and ln_f's two in the forward; the backward re-gathers wte and ln_f.weight
        outside = collectives_by_block(gm, name)
        assert outside[(-1, "all_gather")] >= 1
        assert sum(b.members for b in report.buckets if b.type == "all_gather") == (28 if name == "forward" else 14)


@pytest.mark.parametrize("backend", ["nccl", "ce"])
def test_rewritten_tied_graphs_are_bit_identical(backend):
    for name in ("forward", "backward"):
        gm = fresh_gpt2(name)
        inputs = real_inputs(gm, int_high=1001)
        want = run_emulated(gm, inputs, WORLD, rank=3)
        plan = plan_from_ir(ir_graph(gm, name), backend=backend, prefetch=True)
        results = rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan))
        rewrite.check_invariants(gm.graph)
        gm.recompile()
        assert {r.backend for r in results} == {backend} and len(results) == (3 if name == "forward" else 6)
        got = run_emulated(gm, inputs, WORLD, rank=3)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(want, got)):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), (name, i)


def test_a_wait_on_a_graph_input_stays_put_and_counts_nothing():
    """The forward's collective, handed to the backward unwaited and waited on there (docs/ir.md): the IR takes it,
    the analysis counts the all-gather once (in the forward), the planner keeps that all-gather on NCCL where it
    was captured (its result leaves the graph), and the backward's wait on the graph input is left as it is."""
    fwd, bwd = fresh_gpt2("forward", gather_once=False), fresh_gpt2("backward", gather_once=False)
    shared = next(n for n in fwd.graph.nodes if rewrite.is_functional_collective(n)
                  and any(u.op == "output" for u in n.users))
    assert len([u for u in shared.users if rewrite.is_wait(u)]) == 2
    waits = [n for n in bwd.graph.nodes if rewrite.is_wait(n) and n.args[0].op == "placeholder"]
    assert [w.args[0].name for w in waits] == [shared.name]
    rewrite.check_invariants(fwd.graph)
    rewrite.check_invariants(bwd.graph)

    import ce_overlap._core as core
    from ce_overlap.inductor.to_ir import graph_to_ir

    doc = core.IrDocument.from_json(json.dumps({"schema": "ce_overlap.ir/1", "meta": {"world_size": WORLD},
                                                "blocks": [], "graphs": [graph_to_ir(fwd, "forward"),
                                                                         graph_to_ir(bwd, "backward")]}))
    doc.detect_blocks()
    ir = ce_overlap.ir.Ir(doc)
    totals = ce_overlap.analyze(ir, "h100-sxm")["totals"]
    gathered = [n for n in fwd.graph.nodes if rewrite.is_functional_collective(n)]
    assert totals["forward_all_gather_count"] == len(gathered) == 28  # the two reads' gathers merged: one
    assert totals["forward_all_gather_bytes"] == sum(rewrite.read_collective(n).bytes for n in gathered) * WORLD
    assert totals["backward_all_gather_count"] == 6 * 2 + 1  # no re-gather of the tied weight: its wait is no gather

    config = PassConfig(bucket_cap_mb=4096, ce="on", min_ce_bytes=0, profile="h200-sxm")
    for name, gm in (("forward", fwd), ("backward", bwd)):
        inputs = real_inputs(gm, int_high=1001)
        want = run_emulated(gm, inputs, WORLD, rank=1)
        with pass_.capture_mode(), fake_process_group(WORLD, 1):
            report = pass_.run_pass(gm.graph, config)
        assert report.changed and report.refused is None, report.refused
        rewrite.check_invariants(gm.graph)
        gm.recompile()
        if name == "forward":
            kept = [b for b in report.buckets if b.backend == "nccl"]
            assert [(b.members, b.reason) for b in kept] == [
                (1, "nccl: read by 2 waits (coalesced); kept where captured")]
            assert shared in gm.graph.nodes and shared.target == torch.ops._c10d_functional.all_gather_into_tensor.default
            got = run_emulated(gm, inputs, WORLD, rank=1)
            assert all(torch.equal(a, b) for a, b in zip(want, got) if isinstance(a, torch.Tensor))
        else:
            wait = next(n for n in gm.graph.nodes if rewrite.is_wait(n) and n.args[0].op == "placeholder")
            assert wait.target == torch.ops._c10d_functional.wait_tensor.default and wait.args[0].name == shared.name
            assert all(b.backend == "ce" for b in report.buckets)


def _handmade_graph(group_size: int):
    """Collectives of every layout case: N-d, 1-d, non-contiguous inputs, two dtypes, RS and AR, and
    waited values that are graph outputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    g = group_size

    def f(a, b, c, d, e, h, k, m):
        outs = []
        for x in (a * 2, b + 1, c.transpose(0, 1), h):
            outs.append(c10d.wait_tensor(c10d.all_gather_into_tensor(x, g, group)))
        for x in (d, e * 3):
            outs.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", g, group)))
        for x in (k, m):
            outs.append(c10d.wait_tensor(c10d.all_reduce(x, "sum", group)))
        return [o * 1 if i % 2 else o for i, o in enumerate(outs)] + [sum(o.float().sum() for o in outs)]

    shapes = [((3, 5), torch.float32), ((7,), torch.float32), ((2, 4, 3), torch.float32),  # a b c
              ((g * 2, 3), torch.float32), ((g, 2, 2), torch.float32),  # d e
              ((3, 2), torch.bfloat16), ((5,), torch.float32), ((2, 3), torch.float32)]  # h k m
    gen = torch.Generator().manual_seed(1)
    real = [torch.randn(s, generator=gen).to(dt) for s, dt in shapes]
    gm = make_fx(f, tracing_mode="fake")(*real)
    return gm, real


@pytest.mark.parametrize("backend", ["nccl", "ce"])
def test_handmade_layouts_are_exact(backend):
    g = 4
    with fake_process_group(g, 1):
        gm, real = _handmade_graph(g)
        ir = ir_graph(gm, "forward")
        want = run_emulated(gm, real, g, rank=2)
        plan = plan_from_ir(ir, by_block=False,
                            backend=lambda b: backend if b["type"] != "all_reduce" else "nccl")
        assert sorted(len(b["members"]) for b in plan["buckets"]) == [1, 2, 2, 3]  # bf16 AG alone
        with pass_.capture_mode():
            results = rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan))
        gm.recompile()
        rewrite.check_invariants(gm.graph)
        assert [r.backend for r in results if r.type != "all_reduce"] == [backend] * 3
        got = run_emulated(gm, real, g, rank=2)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i
    # every new node carries a fake value (a list of them for a multi-tensor CE op)
    created = [n for n in gm.graph.nodes if n.name.startswith("ce_overlap_b")]
    for n in created:
        val = n.meta.get("val")
        vals = val if isinstance(val, list) else [val]
        assert vals and all(isinstance(v, torch.Tensor) for v in vals), n.name
    # NCCL buckets are packed into one buffer (cat) and unpacked (clones); a CE bucket is one multi-tensor op
    # that reads and writes the members where they lie: its only copy makes the transposed input contiguous.
    targets = collections.Counter(n.target for n in created)
    if backend == "ce":
        assert targets[torch.ops.aten.cat.default] == 1, targets  # the all-reduce bucket (NCCL)
        assert targets[torch.ops.aten.clone.default] == 1, targets
        assert targets[torch.ops.ce_overlap.all_gather_into_tensors.default] == 1, targets
        assert targets[torch.ops.ce_overlap.reduce_scatter_tensors.default] == 1, targets
    else:
        assert targets[torch.ops.aten.cat.default] == 3, targets  # the all-gather, reduce-scatter and all-reduce buckets


@pytest.mark.parametrize("g", [2, 4])
def test_ce_reduce_scatter_with_the_sum_in_the_consumer(g):
    """ce_reduction="consumer": a CE reduce-scatter bucket is one unreduced op (the peers' chunks, no reduction)
    plus graph ops that add them to this rank's own chunk, in fp32, rounded once. Two ranks: bit-exact (a + b in
    either order); four: the order of the sum differs from the emulated reference, so within rounding."""
    with fake_process_group(g, 1):
        gm, real = _handmade_graph(g)
        want = run_emulated(gm, real, g, rank=1)
        plan = plan_from_ir(ir_graph(gm, "forward"), by_block=False,
                            backend=lambda b: "ce" if b["type"] == "reduce_scatter" else "nccl")
        with pass_.capture_mode():
            results = rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan), ce_reduction="consumer")
        gm.recompile()
        rewrite.check_invariants(gm.graph)
        assert [r.backend for r in results if r.type == "reduce_scatter"] == ["ce"]
        got = run_emulated(gm, real, g, rank=1)
    created = [n for n in gm.graph.nodes if n.name.startswith("ce_overlap_b")]
    targets = collections.Counter(n.target for n in created)
    assert targets[torch.ops.ce_overlap.reduce_scatter_tensors_unreduced.default] == 1, targets
    assert targets[torch.ops.ce_overlap.reduce_scatter_tensors.default] == 0, targets
    assert targets[torch.ops.aten.select.int] == 2, targets  # each member's own chunk, read where it lies
    (unreduced,) = [n for n in created if n.target == torch.ops.ce_overlap.reduce_scatter_tensors_unreduced.default]
    assert tuple(unreduced.meta["val"].shape) == (g - 1, 2 * 3 + 2 * 2)  # the rows: both members' chunks
    for i, (a, b) in enumerate(zip(want, got)):
        if g == 2:
            assert torch.equal(a, b), i
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"output {i}")


def test_consumer_mean_at_three_ranks_is_the_kernels_bit_for_bit():
    """An avg reduce-scatter with the sum in the graph, 3 ranks, integer-valued data: the graph's mean is the fp32
    sum times float32(1 / 3), the runtime kernel's (emulated), in every bit. A division in the graph would round
    differently on CPUs (Inductor makes it a multiplication by the reciprocal only on GPUs): found at 3 ranks on a
    shared H100, where a few elements per rank differed in the last bit."""
    from torch.fx.experimental.proxy_tensor import make_fx

    g, c10d = 3, torch.ops._c10d_functional
    with fake_process_group(g, 1):
        group = dist.group.WORLD.group_name

        def f(x, y):
            return [c10d.wait_tensor(c10d.reduce_scatter_tensor(t, "avg", g, group)) for t in (x, y)]

        class Squares(EmulatedCollectives):  # rank k's input x + (k - rank)^2: sums that 3 does not divide
            def _ranks(self, x):
                return [x + (k - self.rank) ** 2 for k in range(self.g)]

        real = [torch.randint(-8, 9, (g * 50, 3)).float(), torch.randint(-8, 9, (g * 70,)).float()]
        gm = make_fx(f, tracing_mode="fake")(*real)
        with torch.no_grad():
            want = Squares(gm, g, 1).run(*real)
        plan = plan_from_ir(ir_graph(gm, "forward"), by_block=False, backend=lambda b: "ce")
        with pass_.capture_mode():
            rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan), ce_reduction="consumer")
        gm.recompile()
        with torch.no_grad():
            got = Squares(gm, g, 1).run(*real)
    targets = {n.target for n in gm.graph.nodes}
    assert torch.ops.ce_overlap.reduce_scatter_tensors_unreduced.default in targets
    assert torch.ops.aten.div.Tensor not in targets
    sums = torch.cat([(3 * x + 2).reshape(-1) for x in real])  # what rank 1's chunks sum to, and more
    assert (sums / 3 != sums * (1.0 / 3)).any(), "the data must tell a division from the reciprocal's product"
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), (i, (a != b).sum())


def test_check_mode_compares_the_sum_in_the_graph():
    """check_numerics with the sum in the graph: the bucket's check compares the members' reduced results,
    concatenated, with torch.distributed's reduce-scatter of the packed bucket."""
    g = 2
    with fake_process_group(g, 1):
        gm, _ = _handmade_graph(g)
        plan = plan_from_ir(ir_graph(gm, "forward"), by_block=False,
                            backend=lambda b: "ce" if b["type"] == "reduce_scatter" else "nccl")
        with pass_.capture_mode():
            rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan), check_where="forward",
                               ce_reduction="consumer")
        rewrite.check_invariants(gm.graph)
    (check,) = [n for n in gm.graph.nodes if n.name.endswith("_check")]
    result, packed = check.args[0], check.args[1]
    assert result.target == torch.ops.aten.cat.default
    assert [tuple(x.meta["val"].shape) for x in result.args[0]] == [(2 * 3,), (2 * 2,)]  # each member's chunk
    assert all(x.args[0].name.startswith("ce_overlap_b") and "reduced" in x.args[0].name for x in result.args[0])
    assert packed.meta["val"].numel() == g * result.meta["val"].numel()
    assert check.args[2] == "reduce_scatter"


def test_ce_reduction_kernel_and_packed_buckets_keep_the_reducing_op():
    g = 2
    for kwargs in ({"ce_reduction": "kernel"}, {"ce_reduction": "consumer", "pack_ce": True}):
        with fake_process_group(g, 0):
            gm, real = _handmade_graph(g)
            plan = plan_from_ir(ir_graph(gm, "forward"), by_block=False,
                                backend=lambda b: "ce" if b["type"] == "reduce_scatter" else "nccl")
            with pass_.capture_mode():
                rewrite.apply_plan(gm.graph, rewrite.check_plan(gm.graph, plan), **kwargs)
        names = {n.target for n in gm.graph.nodes}
        assert torch.ops.ce_overlap.reduce_scatter_tensors_unreduced.default not in names, kwargs
        assert names & {torch.ops.ce_overlap.reduce_scatter_tensors.default,
                        torch.ops.ce_overlap.reduce_scatter_tensor.default}, kwargs


# --------------------------------------------------------------------------------------------------
# torch.compile end to end on CPU (gloo, one rank): Inductor lowers the rewritten graphs and runs them


def _tiny_fsdp_pair():
    from ce_overlap.models.llama import Llama
    from test_pass_helpers import gathered_in_graph

    torch.manual_seed(0)
    cfg = dataclasses.replace(LLAMA_CONFIGS["llama3-tiny"], seq_len=32)
    model = Llama(cfg)
    ref = copy.deepcopy(model)
    gathered_in_graph(model)
    gathered_in_graph(ref)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    return model, ref, tokens


def _compare_step(model, ref, tokens, compiled):
    loss = compiled(tokens, tokens)
    loss.backward()
    ref_loss = ref(tokens, tokens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_backend_ce_overlap_compiles_and_runs(gloo_world1, caplog, inductor_codegen):
    model, ref, tokens = _tiny_fsdp_pair()
    try:
        ce_overlap.set_default_config(bucket_cap_mb=4096)
        with caplog.at_level(logging.INFO, logger="ce_overlap"), torch._inductor.config.patch(fx_graph_cache=False):
            _compare_step(model, ref, tokens, torch.compile(model, backend="ce_overlap", fullgraph=True))
    finally:
        ce_overlap.set_default_config(None)
    lines = [r.message for r in caplog.records if re.match(r"ce_overlap: (forward|backward) graph", r.message)]
    assert len(lines) == 2 and all("merged" in ln for ln in lines), lines


def test_backend_ce_overlap_trains_a_tied_gpt2_without_recompiling(gloo_world1, caplog):
    """Real tensors: the sharded tied GPT-2 compiled with the pass matches the unsharded model in eager, two steps,
    one compile (the gather-once window and the cast are in the graph, not in guards)."""
    from ce_overlap import models
    from ce_overlap.in_graph.fully_shard import fully_shard

    gpt2 = models.build_from_file(os.path.join(DATA, "gpt2_tied.py") + ":build")
    mod = __import__(type(gpt2.module).__module__)
    cfg = mod.Gpt2Config(vocab_size=64, n_ctx=16, dim=32, n_layers=2, seq_len=16)
    torch.manual_seed(0)
    ref = mod.Gpt2(cfg)
    model = copy.deepcopy(ref)
    fully_shard(model)
    compiled = torch.compile(model, backend="ce_overlap", fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    try:
        ce_overlap.set_default_config(bucket_cap_mb=4096)
        with caplog.at_level(logging.INFO, logger="ce_overlap"), torch._inductor.config.patch(fx_graph_cache=False), \
                torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(2):
                tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
                loss, logits = compiled(tokens, tokens)
                loss.backward()
                ref_loss, _ = ref(tokens, tokens)
                ref_loss.backward()
                torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    finally:
        ce_overlap.set_default_config(None)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for name, q in ref.named_parameters():  # two steps' gradients, accumulated; wte's from both its uses
        torch.testing.assert_close(grads[name], q.grad, rtol=1e-4, atol=1e-5, msg=name)
    lines = [r.message for r in caplog.records if re.match(r"ce_overlap: (forward|backward) graph", r.message)]
    assert len(lines) == 2, lines


@pytest.fixture
def cpu_ce_kernels(monkeypatch):
    """CPU kernels for the CE ops (one rank: the all-gather and reduce-scatter of a group of one), and the
    pass told the runtime can serve CPU tensors, so Inductor lowers and runs the CE path."""
    from ce_overlap import runtime

    runtime.load_library()
    lib = torch.library.Library("ce_overlap", "IMPL")

    def all_gather(inp, group_size, group_name):
        assert group_size == 1 and inp.is_contiguous()
        return inp.clone()

    def reduce_scatter(inp, reduce_op, group_size, group_name):
        assert group_size == 1 and reduce_op == "sum" and inp.is_contiguous()
        return inp.clone()

    def all_gather_many(inputs, group_size, group_name):
        return [all_gather(x, group_size, group_name) for x in inputs]

    def reduce_scatter_many(inputs, reduce_op, group_size, group_name):
        return torch.cat([reduce_scatter(x, reduce_op, group_size, group_name).reshape(-1) for x in inputs])

    lib.impl("all_gather_into_tensor", all_gather, "CPU")
    lib.impl("reduce_scatter_tensor", reduce_scatter, "CPU")
    lib.impl("all_gather_into_tensors", all_gather_many, "CPU")
    lib.impl("reduce_scatter_tensors", reduce_scatter_many, "CPU")
    monkeypatch.setattr(backend_choice, "ce_runtime_state", lambda device: (True, "test: CPU kernels"))
    monkeypatch.setattr(backend_choice, "group_ready", lambda group: (True, ""))
    yield
    lib._destroy()


def test_inductor_options_ce_path_compiles_and_runs(gloo_world1, cpu_ce_kernels, caplog):
    model, ref, tokens = _tiny_fsdp_pair()
    # One rank: the C++ planner keeps a group of one on NCCL under ce="auto"; "on" puts it on CE (the runtime's
    # self copy), so Inductor has to lower and run the CE ops as it does on one GPU.
    opts = ce_overlap.inductor_options(ce="on", min_ce_bytes=0, bucket_cap_mb=4096)
    with caplog.at_level(logging.INFO, logger="ce_overlap"), torch._inductor.config.patch(fx_graph_cache=False):
        _compare_step(model, ref, tokens, torch.compile(model, options=opts, fullgraph=True))
    reports = opts["post_grad_custom_post_pass"].reports
    assert [r.graph for r in reports] == ["forward", "backward"]
    for r in reports:
        assert r.ce_buckets == len(r.buckets) > 0


def test_ce_reduce_scatter_of_one_rank_moves_nothing(gloo_world1, cpu_ce_kernels):
    """ce_reduction="consumer" at one rank: a reduce-scatter of a group of one is its input, so the bucket needs no
    op at all; the step still matches eager."""
    model, ref, tokens = _tiny_fsdp_pair()
    opts = _ce_opts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _compare_step(model, ref, tokens, torch.compile(model, options=opts, fullgraph=True))
    (backward,) = [r for r in opts["post_grad_custom_post_pass"].reports if r.graph == "backward"]
    rs = [b for b in backward.buckets if b.type == "reduce_scatter"]
    assert rs and all(b.backend == "ce" for b in rs)
    assert not any("reduce_scatter" in n for b in rs for n in b.nodes), [b.nodes for b in rs]


def _ce_opts(**fields):
    opts = ce_overlap.inductor_options(ce="on", min_ce_bytes=0, bucket_cap_mb=4096, **fields)
    opts["post_grad_custom_post_pass"] = pass_.CeOverlapPass(opts["post_grad_custom_post_pass"].config,
                                                             planner=make_planner(backend="ce", prefetch=True))
    return opts


def test_check_numerics_compares_every_ce_bucket_once(gloo_world1, cpu_ce_kernels, caplog):
    from ce_overlap.inductor import check

    check.reset()
    model, ref, tokens = _tiny_fsdp_pair()
    # The reducing CE op: at one rank the default (the sum in the consumer) moves nothing, so it has nothing to check.
    opts = _ce_opts(check_numerics=True, ce_reduction="kernel")
    compiled = torch.compile(model, options=opts, fullgraph=True)
    with caplog.at_level(logging.INFO, logger="ce_overlap"), torch._inductor.config.patch(fx_graph_cache=False):
        _compare_step(model, ref, tokens, compiled)  # the checks do not change the step's numbers
        reports = opts["post_grad_custom_post_pass"].reports
        buckets = {(r.graph, b.id, b.type) for r in reports for b in r.buckets if b.backend == "ce"}
        assert len(buckets) >= 4 and {t for _, _, t in buckets} == {"all_gather", "reduce_scatter"}
        assert all(any(n.endswith("_check") for n in b.nodes) for r in reports for b in r.buckets)
        assert sorted(r["where"] for r in check.results) == sorted(f"{g} bucket {i}" for g, i, _ in buckets)
        assert all(r["ok"] and r["mismatches"] == 0 for r in check.results)
        assert {r["rule"] for r in check.results if r["type"] == "all_gather"} == {"bit for bit"}
        assert any("matches torch.distributed" in r.message for r in caplog.records)
        compiled(tokens, tokens).backward()  # second step: the check is off
    assert len(check.results) == len(buckets)


def test_check_numerics_stops_a_wrong_ce_all_gather(gloo_world1, cpu_ce_kernels):
    from ce_overlap.inductor import check

    check.reset()
    lib = torch.library.Library("ce_overlap", "IMPL")

    def wrong_all_gather(inp, group_size, group_name):
        out = inp.clone()
        out.view(-1)[3] += 1  # one element off
        return out

    def wrong_all_gather_many(inputs, group_size, group_name):
        return [wrong_all_gather(x, group_size, group_name) if i == 0 else x.clone() for i, x in enumerate(inputs)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # overriding the fixture's kernels warns
        lib.impl("all_gather_into_tensor", wrong_all_gather, "CPU")
        lib.impl("all_gather_into_tensors", wrong_all_gather_many, "CPU")
    try:
        model, _, tokens = _tiny_fsdp_pair()
        compiled = torch.compile(model, options=_ce_opts(check_numerics=True), fullgraph=True)
        with torch._inductor.config.patch(fx_graph_cache=False), \
                pytest.raises(Exception, match=r"check_numerics: forward bucket \d+: the copy-engine all_gather "
                                                r"differs .* in 1 of \d+ elements \(bit for bit\); first at flat "
                                                r"index 3"):
            compiled(tokens, tokens)
    finally:
        lib._destroy()
    assert [r["ok"] for r in check.results] == [False]


def test_without_check_numerics_no_compare_nodes(gloo_world1, cpu_ce_kernels):
    model, _, tokens = _tiny_fsdp_pair()
    opts = _ce_opts()
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(model, options=opts, fullgraph=True)(tokens, tokens).backward()
    nodes = [n for r in opts["post_grad_custom_post_pass"].reports for b in r.buckets for n in b.nodes]
    assert nodes and not any("check" in n for n in nodes)


def test_bfloat16_rounding_on_the_bits_matches_eager_and_survives_inductor():
    """_round_to_bfloat16 (the unreduced reduce-scatter's rounding of a bfloat16 sum that a fused kernel would
    otherwise keep in float32) equals eager's float32 -> bfloat16 conversion bit for bit, specials included, in
    eager and compiled by Inductor with the bfloat16 value upcast again in the same kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = torch.empty(64, dtype=torch.float32)
    build = rewrite._Builder(graph, [x], "t")
    build.fake_mode = mode
    rounded = rewrite._round_to_bfloat16(build, x, "r")
    low = build(torch.ops.prims.convert_element_type.default, [rounded, torch.bfloat16], name="low")
    up = build(torch.ops.prims.convert_element_type.default, [low, torch.float32], name="up")
    graph.output(build(torch.ops.aten.mul.Tensor, [up, 2.0], name="out"))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(1 << 16, generator=gen) * torch.logspace(-40, 38, 1 << 16)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3.4028235e38, -3.4028235e38,
                             1e-45, 1.00390625, 1.01171875, 1.0078125 + 2 ** -24])
    data = torch.cat([data, specials])
    want = data.to(torch.bfloat16).float() * 2
    for fn in (gm, torch.compile(gm, backend="inductor")):
        got = fn(data)
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert bool(same.all()), (fn, data[~same][:5], got[~same][:5], want[~same][:5])


def test_own_chunks_read_through_the_pass_through_free_their_source_early(inductor_codegen):
    """Inductor inlines a pointwise tensor whose producer it sees as read-free (an fp32 embedding-gradient
    accumulation cast to bfloat16) into every kernel that reads it: a CE reduce-scatter's consumer then recomputed
    its own chunk from the fp32 source, which stayed allocated until the end of the backward (+1.4 GiB at the
    training step's peak, 2026-11-27). Read through the runtime's pass-through (ce_overlap.stored, as
    _rewrite_unreduced does), the consumer reads the stored bfloat16 and the fp32 source is freed right after the
    cast. On the CPU with Inductor's real code generation; a stand-in op plays the unreduced collective."""
    import ce_overlap.runtime as rt
    from torch._inductor.utils import run_and_get_code

    rt.available()  # loads the runtime's ops where the build has them
    if not hasattr(torch.ops.ce_overlap, "stored"):
        pytest.skip("this build has no ce_overlap runtime ops")
    lib = torch.library.Library("ce_overlap_test_stored", "DEF")
    lib.define("peers(Tensor[] xs) -> Tensor")
    lib.impl("peers", lambda xs: xs[0].view(2, -1)[1:].clone(), "CPU")
    torch.library.register_fake("ce_overlap_test_stored::peers", lambda xs: xs[0].new_empty((1, xs[0].numel() // 2)),
                                lib=lib)

    def read_through_stored(graph: torch.fx.Graph) -> None:
        for n in list(graph.nodes):
            if n.target is torch.ops.ce_overlap_test_stored.peers.default:
                x = n.args[0][0]
                with graph.inserting_before(n):
                    pinned = graph.call_function(torch.ops.ce_overlap.stored.default, (x,))
                pinned.meta["val"] = x.meta["val"]
                for u in [u for u in x.users if u is not n and u is not pinned]:
                    u.replace_input_with(x, pinned)

    def f(grad, idx):
        source = torch.ops.aten.embedding_dense_backward(grad, idx, 128, -1, False).view(-1)  # fp32
        x = source.to(torch.bfloat16)
        rows = torch.ops.ce_overlap_test_stored.peers([x])
        own = x.view(2, -1)[0].float()
        return (own + rows[0].float()).to(torch.bfloat16)

    grad, idx = torch.randn(8, 16), torch.randint(0, 64, (8,))
    torch._dynamo.reset()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=read_through_stored, force_disable_caches=True):
        out, (code,) = run_and_get_code(torch.compile(f), grad, idx)
    torch._dynamo.reset()
    torch.testing.assert_close(out, f(grad, idx), rtol=0, atol=0)
    call = code[code.index("def call"):]
    source = re.search(r"(buf\d+) = empty_strided_cpu\(\(128, 16\), \(16, 1\), torch.float32\)", call).group(1)
    assert f"del {source}\n" in call and call.index(f"del {source}\n") < call.index("ce_overlap_test_stored.peers"), \
        call
    assert "torch.ops.ce_overlap.stored.default(" in call
