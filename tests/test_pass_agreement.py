"""The ranks agree on the pass's plan before it rewrites a graph (python/ce_overlap/inductor/agreement.py): what a
plan issues per group, the verdict over a component of ranks, the store exchange (threads as ranks on one real
HashStore), and two real gloo launches of a compiled ce_overlap.fully_shard model planned differently on purpose
(tests/pass_agreement/worker.py). The 2-D meshes whose uneven shards made the ranks' graphs differ:
tests/test_fully_shard_2d.py (compiled-ac-pass)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch.distributed as dist

from ce_overlap.errors import CeOverlapError
from ce_overlap.inductor import agreement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(order, buckets):
    return {"order": order, "buckets": [{"group": g, "backend": be, "members": [{"collective": m} for m in ms]}
                                        for g, be, ms in buckets]}


def test_group_plans_name_collectives_by_their_captured_position_in_their_group():
    captured = ["ag0", "rs0", "ag1", "rs1"]
    group_of = {"ag0": "dp", "ag1": "dp", "rs0": "tp", "rs1": "tp"}
    plan = _plan(["x", "ag1", "ag0", "rs1", "rs0"], [("dp", "ce", ["ag0"]), ("dp", "nccl", ["ag1"]),
                                                     ("tp", "nccl", ["rs0", "rs1"])])
    assert agreement.group_plans(plan, captured, group_of) == {
        "dp": [[[1], "nccl", "ag1"], [[0], "ce", "ag0"]], "tp": [[[0, 1], "nccl", "rs0"]]}


def _entry(groups):
    return {"groups": {g: {"ranks": ranks, "plan": p} for g, (ranks, p) in groups.items()}}


def test_the_verdict_names_the_first_group_two_ranks_plan_differently():
    same = [[[0], "nccl", "a"], [[1], "nccl", "b"]]
    swapped = [[[1], "nccl", "b"], [[0], "nccl", "a"]]
    entries = {0: _entry({"1": ([0, 1], same), "3": ([0, 2], same)}), 1: _entry({"1": ([0, 1], same)}),
               2: _entry({"3": ([0, 2], same)})}
    assert agreement.verdict(entries) is None
    entries[2] = _entry({"3": ([0, 2], swapped)})
    why = agreement.verdict(entries)
    assert why.startswith("ranks 0 and 2 planned group '3' differently: its bucket #0 in issue order is a (members "
                          "[0], nccl) on rank 0 and b (members [1], nccl) on rank 2"), why
    entries[2] = _entry({"3": ([0, 2], "left as captured")})
    assert "rank 0: planned, rank 2: left as captured" in agreement.verdict(entries)


def _run_ranks(store, plans, ranks_of, timeout_s=5.0, graph="g"):
    """Each rank of `plans` (rank -> its group plans) exchanges on its own thread; rank -> entries or the error."""
    out = {}

    def one(rank):
        try:
            out[rank] = agreement.exchange(graph, plans[rank], ranks_of, timeout_s, store=store, rank=rank)
        except CeOverlapError as e:
            out[rank] = e

    for r in plans:
        agreement._SEQ.pop((graph, r), None)
    threads = [threading.Thread(target=one, args=(r,)) for r in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_every_rank_of_a_component_reads_the_whole_component_and_no_more():
    # A 2x2 mesh: TP groups {0,1}, {2,3}, DP groups {0,2}, {1,3}: one component, although rank 0 shares no group with
    # rank 3. Two more ranks, 4 and 5, form a component of their own (another pipeline stage).
    groups = {"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3], "s1": [4, 5]}
    member = {r: [g for g, rs in groups.items() if r in rs] for r in range(6)}
    plans = {r: {g: [[[0], "nccl", "x"]] for g in member[r]} for r in range(6)}
    plans[3]["tp1"] = [[[1], "nccl", "y"]]  # rank 3 disagrees with rank 2 only
    # The ranks_of callable is global knowledge here, but each rank is only ever asked about its own groups.
    got = _run_ranks(dist.HashStore(), plans, lambda g: groups[g])
    assert sorted(got[0]) == [0, 1, 2, 3] and sorted(got[4]) == [4, 5]
    verdicts = {r: agreement.verdict(e) for r, e in got.items()}
    assert len({verdicts[r] for r in range(4)}) == 1 and "ranks 2 and 3 planned group 'tp1'" in verdicts[0]
    assert verdicts[4] is None and verdicts[5] is None


def test_a_rank_that_never_publishes_is_named_after_the_timeout():
    plans = {0: {"dp": [[[0], "nccl", "x"]]}}  # rank 1 of group dp never comes
    got = _run_ranks(dist.HashStore(), plans, lambda g: [0, 1], timeout_s=0.5)
    assert isinstance(got[0], CeOverlapError)
    assert "timed out after 0.5 s on rank 0: ranks [1] never published theirs" in str(got[0]), got[0]


def _launch(what, tmp):
    # An Inductor cache of its own: a graph loaded from a cache is not planned, so there would be nothing to agree on.
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           os.path.join(ROOT, "tests", "pass_agreement", "worker.py"), what, "--out", str(tmp)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def test_ranks_that_plan_a_graph_differently_all_leave_it_as_captured_and_train(tmp_path):
    proc = _launch("differ", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        refused = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(refused) == {"forward", "backward"}, refused
        assert all(why.startswith("ranks 0 and 1 planned group '") for why in refused.values()), refused


def test_a_rank_that_never_plans_stops_the_others_compile_naming_it(tmp_path):
    proc = _launch("silent", tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    assert "agreeing on the plan of graph 'forward' (#0) timed out after 10 s on rank 0: ranks [1] never " \
           "published theirs" in out, out[-4000:]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5"])
def test_agree_timeout_s_must_be_a_positive_number(bad):
    from ce_overlap import PassConfig

    with pytest.raises(CeOverlapError, match="PassConfig.agree_timeout_s: expected a positive number of seconds"):
        PassConfig(agree_timeout_s=bad)


def test_the_planner_orders_a_tensor_parallel_group_alike_on_ranks_whose_graphs_differ_by_a_pad():
    """The backward graphs of ranks 0 and 1 of a 2x2 ("dp", "tp") mesh (the Llama of tests/fully_shard/worker.py,
    activation checkpointing, vocabulary 1001 over 2 tensor-parallel ranks: rank 0's graph pads a gradient shard,
    rank 1's does not), as the pass dumped them (`CE_OVERLAP_PASS_DUMP_DIR=... torchrun --nproc-per-node=4
    tests/fully_shard/worker.py check --tp 2 --compile --variants compiled-ac-pass`, torch 2.14.1). The planner keyed
    a data-parallel reduce-scatter by its last input, the pad's concatenation, captured after the next GEMM on rank 0
    only: rank 0 issued the tensor-parallel all-gather before the reduce-scatter of group '3', rank 1 after, and gloo
    hung. Keyed by the last node both graphs have (schedule.cc, `anchor`), both issue group '3' alike."""
    import gzip

    from ce_overlap import PassConfig, ir

    plans = {}
    for rank in (0, 1):
        with gzip.open(os.path.join(ROOT, "tests", "data", f"tp2x2_ac_backward_rank{rank}.ir.json.gz"), "rt") as f:
            text = f.read()
        nodes = json.loads(text)["graphs"][0]["nodes"]
        group_of = {n["name"]: n["collective"]["group"] for n in nodes if n.get("collective")}
        plan = ir.plan(text, graph="backward", profile="h100-sxm", config=PassConfig().plan_config())
        plans[rank] = agreement.group_plans(plan, list(group_of), group_of)
    assert len(plans[0]["3"]) == len(plans[1]["3"]) == 22
    assert [b[:2] for b in plans[0]["3"]] == [b[:2] for b in plans[1]["3"]]
