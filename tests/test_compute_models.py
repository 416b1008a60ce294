"""Compute priced by shape: the profile section built from a compute grid (ce_overlap.calibrate.shapes), the shipped
h200-sxm tables reproduced from the grid its results folder keeps, the in-step factors' rule, and bench/compute_models.py
(the seven-model check at world size 1) run end to end on the CPU at small sizes: measured (gloo, one rank), predicted
(a capture on fake CUDA tensors) and held against each other by kernel class."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO
from ce_overlap import CeOverlapError, profiles
from ce_overlap.calibrate.shapes import in_step_factors, shapes_from_grid

RESULTS = os.path.join(REPO, "bench", "results", "compute-grid-2026-12-04")


def test_the_shipped_h200_tables_are_the_results_grid():
    """h200-sxm's shapes section is shapes_from_grid of the grid bench/results keeps (only source and in_step are
    the fit's): rebuilding it from that file gives the same numbers."""
    spec = json.loads(profiles.read_text("h200-sxm"))
    with open(os.path.join(RESULTS, "compute_grid.json")) as f:
        grid = json.load(f)
    rebuilt = shapes_from_grid(grid, spec["gpu"], "x", spec["shapes"]["in_step"])
    shipped = {k: v for k, v in spec["shapes"].items() if k != "source"}
    assert {k: v for k, v in rebuilt.items() if k != "source"} == shipped
    assert len(shipped["gemm"]["efficiency"]) == 6**3
    assert set(shipped["memory"]) == {"bytes", "pointwise", "reduction", "gelu_tanh", "gelu_erf", "loss_forward",
                                      "loss_backward"}
    # What the grid says, in numbers: a 512^3 GEMM under 10% of peak, 4096^3 near 80%; erf GELU and the loss's
    # forward far below an add at 1 GiB of traffic, the loss's backward near twice its forward's rate.
    eff = shipped["gemm"]["efficiency"]
    assert eff[0] < 0.1 and 0.75 < eff[(3 * 6 + 3) * 6 + 3] < 0.85
    mem = shipped["memory"]
    assert mem["loss_forward"][-1] < mem["gelu_erf"][-1] < mem["gelu_tanh"][-1] < mem["pointwise"][-1]
    assert 1.7 < mem["loss_backward"][-1] / mem["loss_forward"][-1] < 2.3


def test_a_grid_missing_a_shape_names_it():
    spec = json.loads(profiles.read_text("h200-sxm"))
    with open(os.path.join(RESULTS, "compute_grid.json")) as f:
        grid = json.load(f)
    holes = {**grid, "gemms": [g for g in grid["gemms"] if not (g["m"] == 1024 and g["n"] == 2048 and g["k"] == 512)]}
    with pytest.raises(CeOverlapError, match=r"no GEMM of m=1024, n=2048, k=512"):
        shapes_from_grid(holes, spec["gpu"], "x")
    no_attention = {**grid, "attention": []}
    with pytest.raises(CeOverlapError, match="no attention shapes"):
        shapes_from_grid(no_attention, spec["gpu"], "x")


def test_in_step_factors_are_the_median_ratio_per_class():
    def rows(gemm, att, mem):
        return [{"class": "GEMMs", "predicted_ms": gemm[0], "measured_ms": gemm[1]},
                {"class": "attention", "predicted_ms": att[0], "measured_ms": att[1]},
                {"class": "fused / memory-bound kernels", "predicted_ms": mem[0], "measured_ms": mem[1]}]
    steps = [rows((90, 100), (8, 10), (17, 20)), rows((95, 100), (9, 10), (16, 20)),
             rows((50, 100), (5, 10), (10, 20))]  # the third's clocks sagged: the median ignores it
    assert in_step_factors(steps) == {"gemm": 0.9, "attention": 0.8, "memory": 0.8}
    with pytest.raises(CeOverlapError, match="no measured attention time"):
        in_step_factors([[r for r in rows((1, 1), (1, 1), (1, 1)) if r["class"] != "attention"]])


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(REPO, "bench", "compute_models.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_compute_models_measures_and_predicts_at_small_sizes(tmp_path, inductor_codegen):
    """The harness as the GPU runs it, on a CPU at the test files' small sizes (the MoE): a process of its own, steps
    timed, losses finite; then --predict against that result: the table and a row per kernel class."""
    measured = tmp_path / "measured.json"
    proc = _run("--device", "cpu", "--tiny", "--models", "moe-2048", "--steps", "2", "--warmup", "2",
                "--kernel-profile", "0", "--out", str(measured))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(measured.read_text())["rows"][0]
    assert row["ok"] and row["model"] == "moe-2048" and row["measured_ms"] > 0
    assert len(row["losses"]) == 4 and all(math.isfinite(x) for x in row["losses"])
    # A kernel profile as the GPU writes one, so the class rows have something to hold the prediction against.
    row["kernels"] = {"by_class_ms": {"gemm": 1.0, "attention": 0.1, "fused": 0.5, "optimizer": 0.1}, "busy_ms": 1.7}
    measured.write_text(json.dumps({"rows": [row]}))
    out = tmp_path / "predicted.json"
    proc = _run("--predict", "--tiny", "--models", "moe-2048", "--measured", str(measured), "--ir-dir",
                str(tmp_path / "irs"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    pred = json.loads(out.read_text())["rows"][0]
    assert pred["predicted_ms"] > 0 and pred["measured_ms"] == row["measured_ms"]
    assert [c["class"] for c in pred["classes"]][:4] == ["GEMMs", "attention", "fused / memory-bound kernels",
                                                         "optimizer"]
    assert "moe-2048" in proc.stdout and "kernel time per class" in proc.stdout
    assert (tmp_path / "irs" / "moe-2048-tiny.ir.json").exists()  # the capture kept for the next profile


def test_the_host_setups_run_side_by_side_with_their_host_profile(tmp_path):
    """Issue 56's harness on a CPU: the GPT-2 host model (small) under fully_shard, plain compile and FSDP2 with
    per-block compile, each in its own process, with the host profile (enqueue, its CPU time, the step behind
    another, cProfile's functions); the three setups' losses agree."""
    out = tmp_path / "host.json"
    proc = _run("--device", "cpu", "--tiny", "--models", "gpt2-1536-host", "--setups", "fully_shard,plain,fsdp2",
                "--host-profile", "--steps", "2", "--warmup", "2", "--kernel-profile", "0", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["setup"] for r in rows] == ["fully_shard", "plain", "fsdp2"] and all(r["ok"] for r in rows)
    for r in rows:
        host = r["host"]
        assert min(host["enqueue_ms"], host["enqueue_cpu_ms"], host["enqueue_busy_ms"], host["synced_ms"]) > 0
        assert any("run_step" in f["function"] for f in host["by_cumulative_time"])
        assert any(o["op"].startswith("aten::") and o["calls"] > 0 for o in host["by_op"])
    first = [r["losses"][0] for r in rows]
    assert max(first) - min(first) < 1e-3 * abs(first[0])  # one model, one batch: the same first loss


def test_host_time_at_two_ranks_and_side_by_side_then_fitted(tmp_path):
    """Issue 56's other host measurements on a CPU: fully_shard at 2 ranks (two processes, the host profile's steps
    in step on both ranks, the slowest rank's host ms), the two setups side by side in one process (--paired: both
    setups' enqueue samples and run-ahead blocks, their ratio to plain's), and the rows bench/fit_host.py reads from
    both runs (the 2-rank run's slowest rank; a paired run's fully_shard enqueue)."""
    two = tmp_path / "two.json"
    proc = _run("--device", "cpu", "--tiny", "--models", "gpt2-1536-host", "--world", "2", "--host-profile",
                "--steps", "2", "--warmup", "2", "--kernel-profile", "0", "--out", str(two))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(two.read_text())["rows"][0]
    assert row["ok"], (row.get("error"), proc.stderr[-3000:])
    assert row["world"] == 2 and len(row["ranks"]) == 2
    assert row["host_ms"] == max(r["host_ms"] for r in row["ranks"]) and row["host"]["enqueue_ms"] > 0
    paired = tmp_path / "paired.json"
    proc = _run("--device", "cpu", "--tiny", "--models", "gpt2-1536-host", "--setups", "fully_shard,plain",
                "--paired", "4", "--warmup", "2", "--out", str(paired))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(paired.read_text())["rows"]
    assert [r["setup"] for r in rows] == ["fully_shard", "plain"] and all(r["paired"] for r in rows)
    assert all(len(r["enqueue_samples"]) == 4 and len(r["run_ahead_blocks"]) == 2 for r in rows)
    assert rows[1]["enqueue_ratio"] == 1.0 and rows[0]["enqueue_ratio"] > 0
    assert "--world > 1 takes --kernel-profile 0" in _run("--world", "2").stderr
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from fit_host import measured_rows

    fit_rows = measured_rows([str(two), str(paired)])
    assert [(r["world"], r["enqueue_ms"]) for r in fit_rows] == [
        (2, max(x["enqueue_ms"] for x in row["ranks"])), (1, rows[0]["host_ms"])]


def test_fit_host_is_a_non_negative_least_squares():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from fit_host import TERMS, nnls

    rows = [{"step_us": 1, "launch_us": k, "graph_input_us": i, "collective_us": c}
            for k, i, c in ((100, 50, 0), (300, 80, 0), (200, 200, 0), (250, 90, 40), (120, 60, 10))]
    truth = {"step_us": 1500.0, "launch_us": 20.0, "graph_input_us": 8.0, "collective_us": 35.0}
    fit = nnls(rows, [sum(truth[t] * r[t] for t in TERMS) for r in rows])
    assert fit == pytest.approx(truth)
    # A term the data would make negative stays 0 and the others take its place.
    fit = nnls(rows[:3], [1000.0 + 10 * r["launch_us"] - 0.5 * r["graph_input_us"] for r in rows[:3]])
    assert min(fit.values()) >= 0 and fit["collective_us"] == 0


def test_compute_models_refuses_an_unknown_model():
    proc = _run("--models", "gpt5")
    assert proc.returncode == 2 and "--models: unknown ['gpt5']" in proc.stderr


def test_repredict_holds_recorded_runs_against_the_model_with_and_without_a_profile_key(tmp_path):
    """bench/repredict.py over a results folder of two recorded runs of one shape (llama3-tiny, 2 ranks): one capture,
    each mode's error with the profile as shipped and without its shape tables; a run with a pacing override is
    listed but left out of the summary."""
    def run(env=None):
        return {"args": {"model": "llama3-tiny", "layers": 2, "seq_len": 128, "batch": 1, "in_graph_wrap": "torchtitan",
                         "fsdp2_wrap": "torchtitan"},
                "info": {"world_size": 2, "gpu": "NVIDIA H200", "env": env or {}},
                "results": [{"mode": "no-comm", "median_ms": 1.0}, {"mode": "compile", "median_ms": 2.0},
                            {"mode": "eager", "median_ms": 9.0}]}
    for name, env in (("a", None), ("paced", {"CE_OVERLAP_PASS_COPY_PACE_FILL": "0.5"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.json").write_text(json.dumps(run(env)))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "repredict.py"), "--results", str(tmp_path),
                           "--without", "shapes"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "a/train.json (world 2, 2 layers" in out
    assert "paced/train.json" in out and "[not in the summary: run with {'CE_OVERLAP_PASS_COPY_PACE_FILL'" in out
    assert "  eager                      meas     9.0\n" in out  # a mode the step model does not predict
    rows = [l for l in out.splitlines() if l.startswith("  no-comm")]
    assert len(rows) == 2 and "(without shapes:" in rows[0]
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("h200-sxm: 2 mode rows") and "without shapes: median" in summary
