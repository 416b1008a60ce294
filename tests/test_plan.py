"""The planner on real captures (llama3-tiny, llama3-1b): one bucket per block and type, every collective
in exactly one bucket, a topological order that keeps the bucket rules, the memory budget respected, Plan
JSON loading and checking, and `ce-overlap analyze --plan`."""
from __future__ import annotations

import collections
import json

import pytest

import ce_overlap
from ce_overlap import CeOverlapError, _core
from ce_overlap import ir as ir_mod

BIG_CAP = {"bucket_cap_bytes": 1 << 40}


@pytest.fixture(scope="module", params=["llama3-tiny", "llama3-1b"])
def capture(request, capture_zoo):
    ir = capture_zoo(request.param, 8)
    return request.param, ir, ir.to_dict()


def _graph(doc: dict, name: str) -> list[dict]:
    return next(g for g in doc["graphs"] if g["name"] == name)["nodes"]


def _check_order_and_rules(nodes: list[dict], plan: dict):
    by_name = {n["name"]: n for n in nodes}
    pos = {name: i for i, name in enumerate(plan["order"])}
    assert len(plan["order"]) == len(pos) == len(nodes)
    for n in nodes:  # topological
        for i in n["inputs"]:
            assert pos[nodes[i]["name"]] < pos[n["name"]], (nodes[i]["name"], n["name"])
    assert by_name[plan["order"][-1]]["op"] == "output"
    users = collections.defaultdict(list)
    for n in nodes:
        for i in n["inputs"]:
            users[i].append(n["name"])
    for b in plan["buckets"]:
        cpos = sorted(pos[m["collective"]] for m in b["members"])
        wpos = sorted(pos[m["wait"]] for m in b["members"] if m["wait"])
        assert cpos == list(range(cpos[0], cpos[0] + len(cpos))), b["id"]
        assert wpos == list(range(wpos[0], wpos[0] + len(wpos))), b["id"]
        for m in b["members"]:
            c = by_name[m["collective"]]
            assert all(pos[nodes[i]["name"]] < cpos[0] for i in c["inputs"])
            if m["wait"]:
                assert all(pos[u] > wpos[-1] for u in users[by_name[m["wait"]]["id"]])
            assert m["bytes"] == c["collective"]["bytes"]
        assert b["bytes"] == sum(m["bytes"] for m in b["members"])


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_one_bucket_per_block_and_type(capture, graph):
    model, ir, doc = capture
    nodes = _graph(doc, graph)
    plan = ir_mod.plan(ir, graph, "h200-sxm", BIG_CAP)
    ir_mod.check_plan(ir, plan)
    _check_order_and_rules(nodes, plan)

    # Every collective in exactly one bucket.
    collectives = [n["name"] for n in nodes if n["kind"] == "collective"]
    members = [m["collective"] for b in plan["buckets"] for m in b["members"]]
    assert sorted(members) == sorted(collectives)
    assert plan["summary"]["collectives"] == len(collectives)

    # Per block and type, the block's collectives form one bucket, in graph order.
    expected = collections.defaultdict(list)
    for n in nodes:
        if n["kind"] == "collective" and n["block"] >= 0:
            expected[(n["block"], n["collective"]["type"])].append(n["name"])
    got = {(b["block"], b["type"]): [m["collective"] for m in b["members"]]
           for b in plan["buckets"] if b["block"] is not None}
    assert got == dict(expected)
    blocks = len(doc["blocks"])
    if graph == "forward":
        assert {t for _, t in got} == {"all_gather"} and len(got) == blocks
    else:  # FSDP re-gathers in the backward (reshard after forward) and reduce-scatters the gradients
        assert {t for _, t in got} == {"all_gather", "reduce_scatter"} and len(got) == 2 * blocks
    for b in plan["buckets"]:
        assert b["block_path"] == (doc["blocks"][b["block"]]["path"] if b["block"] is not None else None)

    s = plan["summary"]
    assert s["peak_memory_bytes_after"] - s["peak_memory_bytes_before"] <= s["memory_budget_bytes"]
    assert s["exposed_comm_us_after"] <= s["exposed_comm_us_before"]
    analysis = ce_overlap.analyze(ir, "h200-sxm")
    g = next(x for x in analysis["graphs"] if x["name"] == graph)
    assert s["exposed_comm_us_before"] == pytest.approx(g["exposed_comm_us"])
    assert s["peak_memory_bytes_before"] == g["peak_memory_bytes"]


def test_all_gathers_are_prefetched_one_block(capture):
    model, ir, doc = capture
    nodes = _graph(doc, "forward")
    plan = ir_mod.plan(ir, "forward", "h200-sxm", BIG_CAP)
    pos = {name: i for i, name in enumerate(plan["order"])}
    first_of_block = {}
    for n in nodes:
        if n["kind"] == "compute" and n["flops"] > 0 and n["block"] >= 0:
            first_of_block.setdefault(n["block"], pos[n["name"]])
    for b in plan["buckets"]:
        if b["type"] == "all_gather" and b["block"] is not None and b["block"] >= 1:
            issue = pos[b["members"][0]["collective"]]
            assert issue < first_of_block[b["block"] - 1], b["id"]      # before the previous block's GEMMs
            if b["block"] >= 2:
                assert issue > first_of_block[b["block"] - 2], b["id"]  # but only one block early
            assert b["predicted"]["window_us"] > 0


@pytest.mark.parametrize("budget_mib", [0, 8, 64])
def test_memory_budget_is_respected(capture, budget_mib):
    model, ir, doc = capture
    for graph in ("forward", "backward"):
        plan = ir_mod.plan(ir, graph, "h100-sxm", {"prefetch_blocks": 3, "memory_budget_bytes": budget_mib << 20})
        ir_mod.check_plan(ir, plan)
        s = plan["summary"]
        assert s["peak_memory_bytes_after"] - s["peak_memory_bytes_before"] <= budget_mib << 20


def test_ce_modes(tiny_ir):
    off = ir_mod.plan(tiny_ir, "backward", "h200-sxm", {"ce": "off"})
    assert off["summary"]["ce_buckets"] == 0
    assert {b["reason"] for b in off["buckets"]} == {"nccl: config.ce is off"}
    on = ir_mod.plan(tiny_ir, "backward", "h200-sxm", {"ce": "on", "min_ce_bytes": 0})
    assert on["summary"]["ce_buckets"] == on["summary"]["buckets"]
    auto = ir_mod.plan(tiny_ir, "backward", "h200-sxm")
    for b in auto["buckets"]:
        assert b["reason"].startswith(b["backend"] + ": ")
        if b["bytes"] < 1 << 20:
            assert b["backend"] == "nccl" and "under min_ce_bytes" in b["reason"]
    assert auto["config"] == {"bucket_cap_bytes": 512 << 20, "memory_budget_bytes": 4 << 30, "ce": "auto",
                              "min_ce_bytes": 1 << 20, "prefetch_blocks": 1, "bucket_patterns": []}


def test_bucket_patterns(tiny_ir):
    plan = ir_mod.plan(tiny_ir, "forward", "h200-sxm", {"bucket_patterns": [r"^(layers)\.\d+$"]})
    ir_mod.check_plan(tiny_ir, plan)
    keyed = [b for b in plan["buckets"] if b["block_path"] == "layers"]
    assert len(keyed) == 1 and keyed[0]["block"] is None  # both blocks' all-gathers in one bucket
    in_blocks = [n for n in _graph(tiny_ir.to_dict(), "forward") if n["kind"] == "collective" and n["block"] >= 0]
    assert len(keyed[0]["members"]) == len(in_blocks)


def test_plan_json_load_and_check(tiny_ir):
    text = _core.plan(tiny_ir._doc, "forward", ce_overlap.profiles.load("h100-sxm"), None)
    assert _core.load_plan(text) == text  # canonical
    plan = json.loads(text)
    assert ir_mod.load_plan(text) == plan
    broken = json.loads(text)
    broken["buckets"][1]["bytes"] += 1
    with pytest.raises(CeOverlapError, match=r"^buckets\[1\]\.bytes: expected the sum of the members' bytes"):
        ir_mod.load_plan(json.dumps(broken))
    swapped = json.loads(text)
    order = swapped["order"]
    i = order.index(swapped["buckets"][1]["members"][0]["wait"])
    order.insert(0, order.pop(i))  # a wait before its collective
    with pytest.raises(CeOverlapError):
        ir_mod.check_plan(tiny_ir, swapped)
    with pytest.raises(CeOverlapError, match=r"graph: no graph named \"fwd\""):
        ir_mod.plan(tiny_ir, "fwd")
    with pytest.raises(CeOverlapError, match=r"^config\.ce: expected \"auto\", \"on\" or \"off\", got \"yes\""):
        ir_mod.plan(tiny_ir, "forward", "h100-sxm", {"ce": "yes"})
    with pytest.raises(CeOverlapError, match=r"^config: unknown key \"cap\""):
        ir_mod.plan(tiny_ir, "forward", "h100-sxm", {"cap": 1})
    # IR JSON text works as well as a loaded document.
    assert json.loads(_core.plan(tiny_ir.to_json(), "forward", ce_overlap.profiles.load("h100-sxm"), None))[
        "order"] == plan["order"]


def test_cli_analyze_plan(cli, tiny_ir, tmp_path):
    path = tmp_path / "tiny.json"
    tiny_ir.save(str(path))
    out = tmp_path / "plans.json"
    proc = cli("analyze", str(path), "--plan", "--plan-json", str(out), "--profile", "h200-sxm")
    assert proc.returncode == 0, proc.stderr
    assert "plan forward (h200-sxm; cap 512 MiB, prefetch 1 block, ce auto" in proc.stdout
    assert "plan backward" in proc.stdout and "window us" in proc.stdout and "exposed comm" in proc.stdout
    plans = json.loads(out.read_text())
    assert [p["graph"] for p in plans] == ["forward", "backward"]
    # the conclusion comes last: the recommendation, with the plans' sums (tests/test_report.py checks them all)
    tail = proc.stdout.split("\n\nplans written to")[0].split("\n\n")[-1].splitlines()
    assert tail[0].startswith("recommendation (h200-sxm): ") and tail[-4].startswith("  predicted step ")
    after = sum(p["summary"]["exposed_comm_us_after"] for p in plans) / 1000
    assert f" ms per step with Inductor's overlap scheduler, {after:.2f} ms with ce_overlap" in "\n".join(tail)
    assert " ms with Inductor's overlap scheduler -> " in tail[-4]  # the user's baseline, not everything exposed
    assert tail[-3].startswith("    (the overlap scheduler modelled as")
    assert tail[-2].startswith("  -> ")  # what to do (report.advice)
    assert tail[-1].startswith("  -> host-bound: ")  # h200-sxm prices the host: this tiny step is the host's
    assert "  input MiB: what each rank puts in" in proc.stdout
    for p in plans:
        ir_mod.check_plan(tiny_ir, p)
    proc = cli("analyze", str(path), "--plan", "--json", "--ce", "off", "--prefetch-blocks", "0")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == "ce_overlap.analysis/1"
    assert [p["summary"]["ce_buckets"] for p in report["plans"]] == [0, 0]
    assert report["plans"][0]["config"]["prefetch_blocks"] == 0
    proc = cli("analyze", str(path), "--plan", "--bucket-pattern", "(")
    assert proc.returncode == 2 and "config.bucket_patterns[0]: invalid regular expression" in proc.stderr
