"""bench/pipeline.py's model of a schedule (CPU): the action orders it reads (torch's own pipeline_order for the
multi-stage schedules, 1F1B's warmup / 1B1F / cooldown written out) and the no-communication makespan it derives the
bubble and the communication on the critical path from, against the closed forms of the schedules."""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.pipelining import schedules as S  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import pipeline as P  # noqa: E402


class _Stage(S._PipelineStageBase):
    """Just what a schedule's constructor reads of a stage (index, count, group size and rank): no process group."""

    _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None

    def __init__(self, index: int, num_stages: int, rank: int, world: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, num_stages, world, rank
        self.group, self.submod, self.has_backward, self.dw_builder = None, None, True, None


class _Pipe:
    def __init__(self, sched):
        self.sched = sched


def _multi(cls_name: str, world: int, n_mb: int) -> dict:
    cls = getattr(S, cls_name, None)
    if cls is None:
        pytest.skip(f"this torch has no {cls_name}")
    stages = [_Stage(k * world, 2 * world, 0, world) for k in range(2)]  # rank 0's stages, loop layout
    return P.action_orders(_Pipe(cls(stages, n_microbatches=n_mb)), "multi", world, n_mb)


@pytest.mark.parametrize("world,n_mb", [(2, 8), (4, 8), (4, 16)])
def test_1f1b_makespan_is_the_closed_form(world, n_mb):
    """Equal stages, forward f and backward b: 1F1B takes (m + p - 1)(f + b); every rank runs m forwards and m
    backwards, in torch's order (rank r warms up with min(m, p - r) forwards)."""
    orders = P.action_orders(None, "1f1b", world, n_mb)
    assert all(sorted(orders[r]) == sorted([(k, r, i) for k in "FB" for i in range(n_mb)]) for r in range(world))
    assert [a[0] for a in orders[world - 1][:3]] == ["F", "B", "F"]  # the last stage: one forward, then 1B1F
    assert P.makespan(orders, {s: (1.0, 2.0) for s in range(world)}, world) == (n_mb + world - 1) * 3.0


def test_communication_on_the_critical_path_adds_per_hop():
    """With c ms per hop between ranks, 1F1B's critical path crosses at least the fill's and the drain's p - 1 hops
    each: the makespan grows by at least 2(p - 1)c."""
    world, n_mb = 4, 8
    orders = P.action_orders(None, "1f1b", world, n_mb)
    times = {s: (1.0, 2.0) for s in range(world)}
    base = P.makespan(orders, times, world)
    assert P.makespan(orders, times, world, comm_ms=0.5) >= base + 2 * (world - 1) * 0.5


def test_interleaved_1f1b_bubble_is_the_papers():
    """Interleaved 1F1B with v = 2 stages per rank: the bubble shrinks to (p - 1)(f + b) / v, f + b a rank's work for
    one microbatch (here its two stages' 1.5 each), on torch's own order."""
    world, n_mb = 4, 8
    orders = _multi("ScheduleInterleaved1F1B", world, n_mb)
    assert {k for acts in orders.values() for k, _, _ in acts} == {"F", "B"}
    compute = n_mb * 2 * (0.5 + 1.0)  # per rank: m microbatches through 2 stages of f = 0.5, b = 1
    assert P.makespan(orders, {s: (0.5, 1.0) for s in range(2 * world)}, 2 * world) == \
        pytest.approx(compute + (world - 1) * (2 * 1.5) / 2)


def test_zero_bubble_splits_backwards_and_beats_interleaved():
    """ZB1P: input and weight backwards (I, W) in torch's order, each after its dependencies; its makespan below
    interleaved 1F1B's on the same stages, above the compute."""
    world, n_mb = 4, 8
    zb = _multi("ScheduleInterleavedZeroBubble", world, n_mb)
    assert {k for acts in zb.values() for k, _, _ in acts} == {"F", "I", "W"}
    times = {s: (0.5, 1.0) for s in range(2 * world)}
    inter = P.makespan(_multi("ScheduleInterleaved1F1B", world, n_mb), times, 2 * world)
    got = P.makespan(zb, times, 2 * world)
    assert n_mb * 2 * 1.5 < got < inter


def test_an_order_that_cannot_run_is_refused():
    """A rank whose first action waits for one that never comes: a clear error, not a hang."""
    orders = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
    with pytest.raises(RuntimeError, match="deadlocks"):
        P.makespan(orders, {0: (1.0, 1.0), 1: (1.0, 1.0)}, 2)


def test_pipelining_over_fsdp2_matches_the_unsharded_model():
    """2 pipeline stages x 2-way FSDP2 on 4 gloo ranks (tests/pipeline_fsdp/worker.py): 1F1B, GPipe and interleaved
    1F1B, each pipeline's losses and every stage's gradients equal to the unsharded, unpipelined model's on all
    pipelines' tokens (within fp32 reduction order)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "CE_TEST_DEVICE": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           os.path.join(root, "tests", "pipeline_fsdp", "worker.py"), "--pp", "2"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "2 stages x 2-way FSDP, 4 ranks, transport default): all checks passed" in proc.stdout
    for sched in ("1f1b", "gpipe", "interleaved-1f1b"):
        assert f"PASS  [rank 0] {sched}: stage(s)" in proc.stdout
        assert f"PASS  [rank 2] {sched}: pipeline 0's microbatch losses" in proc.stdout


@pytest.mark.parametrize("dp", [1, 2])
def test_pipeline_bench_runs_on_cpu(dp, tmp_path):
    """bench/pipeline.py --device cpu at 4 gloo ranks: every schedule's row (4 stages; or 2 stages x 2-way FSDP2, zero
    bubble skipped with the reason), the step model's columns and the JSON, every path but the GPU's (streams, the
    GEMM test, the copy-engine transport): what a GPU run would otherwise find first."""
    import json
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           os.path.join(root, "bench", "pipeline.py"), "--device", "cpu", "--model", "llama3-tiny",
                           "--layers", "8", "--seq-len", "64", "--microbatches", "4", "--steps", "2", "--warmup", "1",
                           "--dp", str(dp), "--schedules", "1f1b,interleaved-1f1b,zero-bubble", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = {r["schedule"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1f1b", "interleaved-1f1b", "zero-bubble"}
    timed = ["1f1b", "interleaved-1f1b"] + (["zero-bubble"] if dp == 1 else [])
    for name in timed:
        r = rows[name]
        assert r["transport"] == "gloo" and len(r["step_ms"]) == 2 and r["median_ms"] > 0
        chunks = 1 if name == "1f1b" else 2  # stages per rank
        assert r["ideal_ms"] >= r["compute_ms"] > 0 and len(r["stage_ms"]) == (4 // dp) * chunks
    if dp == 2:
        assert "zero bubble with FSDP2 computes wrong gradients" in rows["zero-bubble"]["skipped"]
    assert "on the CPU: a smoke test, not a measurement" in proc.stdout


def test_copy_rates_parse_and_refuse_bad_values(capsys):
    assert P.parse_args([]).copy_rates == []
    assert P.parse_args(["--copy-rates", "100, 300,0"]).copy_rates == [100.0, 300.0, 0.0]
    for bad in ("fast", "-5", "nan", "inf"):
        with pytest.raises(SystemExit):
            P.parse_args(["--copy-rates", bad])
        assert "--copy-rates" in capsys.readouterr().err
