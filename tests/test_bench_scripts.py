"""The GPU benchmarks in bench/ run only on the device, so CPU CI at least imports each one and parses its arguments
(an import error or a broken option list would otherwise surface first on the lent machine, costing device time); the
pieces that need no GPU are checked for real: the size sweep, the step model's arithmetic and the fault repeats'
bookkeeping."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)


@pytest.mark.parametrize("script", ["collectives.py", "p2p.py", "overlap.py", "ce_probe.py", "train.py",
                                    "step_prediction.py", "cost_model_validation.py", "fault_repeats.py"])
def test_bench_script_imports_and_parses_help(script):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower()


@pytest.mark.parametrize("script,flag,value", [("overlap.py", "--sustain-ms", "-1"),
                                                ("ce_probe.py", "--sustain-gemms", "many")])
def test_sustained_measurement_flags_reject_bad_values(script, flag, value):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), flag, value], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"argument {flag}: expected a" in proc.stderr and ">= 0" in proc.stderr and "Traceback" not in proc.stderr


def test_size_sweep_is_nccl_tests_style():
    import _common as C

    assert C.size_sweep("64K", "1M", 4) == [65536, 262144, 1048576]
    assert C.size_sweep("1G", "1G", 4) == [1 << 30]
    from ce_overlap.errors import CeOverlapError

    with pytest.raises(CeOverlapError, match="bad size"):
        C.size_sweep("lots", "1G", 4)


def test_step_model_pieces_add_up():
    import train

    pieces = {"optimizer_us": 1000.0,
              "analyze": {"forward": {"compute_us": 3000.0, "exposed_comm_us": 900.0},
                          "backward": {"compute_us": 6000.0, "exposed_comm_us": 700.0}},
              "plan": {"forward": {"exposed_comm_us_after": 100.0, "slowdown_us": 50.0, "bucket_copy_us": 20.0},
                       "backward": {"exposed_comm_us_after": 200.0, "slowdown_us": 70.0, "bucket_copy_us": 30.0}}}
    assert train.predicted_step_ms(pieces) == pytest.approx((1000 + 3000 + 170 + 6000 + 300) / 1e3)
    assert train.predicted_step_ms(pieces, no_comm=True) == pytest.approx((1000 + 3000 + 6000) / 1e3)
    # The no-comm mode runs local stand-ins of the collectives (repeat / narrow copies): charged to it only.
    pieces["local_gather_us"] = {"forward": 400.0, "backward": 250.0}
    assert train.predicted_step_ms(pieces, no_comm=True) == pytest.approx((1000 + 3000 + 6000 + 650) / 1e3)
    assert train.predicted_step_ms(pieces) == pytest.approx((1000 + 3000 + 170 + 6000 + 300) / 1e3)
    assert train.predicted_step_ms({}) is None
    # AdamW over fp32 master shards moves 28 bytes per local parameter.
    assert train.ADAMW_BYTES_PER_PARAM == 7 * 4


def test_local_gather_bytes_follow_the_no_comm_stand_ins(tiny_ir):
    """_LocalGather: the forward gathers every parameter once in bf16, so its stand-ins (repeat: read the shard,
    write world x shard) move (1 + world) / world x 2 bytes per parameter, up to the shard padding."""
    import train

    world, params = 8, tiny_ir.meta["num_params"]
    got, kernels = train.local_gather_us(tiny_ir, 1.0)
    assert got["forward"] == pytest.approx((1 + world) / world * 2 * params, rel=0.05)
    assert got["backward"] > 0  # the re-gathers and the reduce-scatters' narrow copies
    stand_ins = sum(n["collective"]["type"] in ("all_gather", "reduce_scatter")
                    for g in tiny_ir.to_dict()["graphs"] for n in g["nodes"] if n["kind"] == "collective")
    assert kernels == stand_ins > 0
    # Each stand-in is a kernel and pays the gap between kernels once.
    with_gap, _ = train.local_gather_us(tiny_ir, 1.0, kernel_gap_us=3.0)
    assert sum(with_gap.values()) == pytest.approx(sum(got.values()) + 3.0 * stand_ins)
    # At world 1 the stand-ins are no copies: nothing to charge.
    import copy

    one = copy.deepcopy(tiny_ir.to_dict())
    for g in one["graphs"]:
        for n in g["nodes"]:
            if n["kind"] == "collective":
                n["collective"]["group_size"] = 1
    world1 = type("IR", (), {"to_dict": lambda self: one})()
    assert train.local_gather_us(world1, 1.0, kernel_gap_us=3.0) == ({g["name"]: 0.0 for g in one["graphs"]}, 0)


def test_gpu_idle_between_kernels():
    """The GPU timeline's idle time (ce_overlap.gpu_trace, used by train.py and calibrate): what no kernel or copy
    covers between the first start and the last end (overlapping streams count once)."""
    from ce_overlap import gpu_trace as T

    assert T.idle_between([]) == 0
    assert T.idle_between([(0, 10)]) == 0
    assert T.idle_between([(0, 10), (12, 20), (25, 30)]) == 2 + 5
    assert T.idle_between([(12, 20), (0, 15), (16, 18), (22, 24)]) == 2  # unordered, overlapping, nested
    assert T.covered([]) == 0 and T.covered([(12, 20), (0, 15), (16, 18), (22, 24)]) == 22
    # Compute stream 7 runs 0-10 and 30-40; a copy stream runs 5-35; nothing runs 40-45; a kernel 45-50 on stream 7.
    spans = [(0, 10), (30, 40), (5, 35), (45, 50), (12, 14)]
    by_stream = {7: [(0, 10), (30, 40), (45, 50)], 9: [(12, 14)]}
    # Compute idle 10-30 (others busy: waiting) and 40-45 (nothing runs: GPU idle, not waiting).
    assert T.compute_stream_wait(spans, by_stream) == 20
    assert T.compute_stream_wait(spans, {}) == 0 and T.compute_stream_wait([], by_stream) == 0
    # The longest gaps name what ran last before them (the longest-reaching span, not the last to start) and what
    # ends them.
    named = [(0, 10, "a"), (2, 4, "nested"), (15, 20, "b"), (40, 41, "c"), (41.5, 42, "d")]
    assert T.largest_gaps(named, 2) == [{"us": 20.0, "after": "b", "before": "c"},
                                        {"us": 5.0, "after": "a", "before": "b"}]
    assert T.largest_gaps([], 3) == [] and T.largest_gaps([(0, 1, "x")], 3) == []
    # Time per kernel class per step, from (start, end, name, stream) activities.
    acts = [(0, 10, "nvjet_sm90_tst_x", 7), (10, 14, "triton_poi_fused_add_0", 7), (2, 8, "Memcpy DtoD", 9),
            (20, 30, "nvjet_sm90_tst_x", 7)]
    assert T.time_by_class(acts, steps=2) == {"gemm": 10.0, "fused": 2.0, "copy": 3.0}
    # A profile without GPU work has no activities (this machine has no GPU).
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(4).add_(1)
    assert T.gpu_activities(prof) == []
    import train

    assert train.idle_between is T.idle_between  # one implementation


def test_kernel_classes_and_the_class_comparison():
    """train.py's kernel classes (by name, as torch.profiler reports them) and step_prediction.py's pairing of them
    with the analysis report's compute_by_class_us."""
    import step_prediction
    import train

    for name, cls in (("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"), ("triton_tem_fused_mm_3", "gemm"),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
                      ("flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
                      ("triton_poi_fused__to_copy_7", "fused"), ("Memcpy DtoD (Device -> Device)", "copy"),
                      ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", "optimizer"),
                      ("ncclDevKernel_AllGather_RING_LL", "collective"),
                      ("void at::native::vectorized_elementwise_kernel<4>", "other")):
        assert train.kernel_class(name) == cls, name
    pieces = {"optimizer_us": 20000.0,
              "analyze": {"forward": {"compute_by_class_us": {"matmul": 30000.0, "attention": 3000.0,
                                                              "memory_bound": 6000.0}},
                          "backward": {"compute_by_class_us": {"matmul": 40000.0, "attention": 5000.0,
                                                               "memory_bound": 12000.0}}}}
    kernels = {"by_class_ms": {"gemm": 80.0, "attention": 8.0, "fused": 15.0, "other": 2.0, "copy": 1.0,
                               "optimizer": 25.0}, "busy_ms": 131.0}
    rows = {r["class"]: r for r in step_prediction.compare_classes(pieces, kernels)}
    assert rows["GEMMs"]["predicted_ms"] == 70.0 and rows["GEMMs"]["measured_ms"] == 80.0
    assert rows["GEMMs"]["error_pct"] == pytest.approx(-12.5)
    assert rows["fused / memory-bound kernels"]["measured_ms"] == 18.0  # fused + other + copy
    assert rows["optimizer"]["predicted_ms"] == 20.0
    assert rows["kernel busy time (sum of the above)"]["predicted_ms"] == pytest.approx(70 + 8 + 18 + 20)
    assert step_prediction.compare_classes(pieces, None) == []


def _fake_launch(modes, timeout_s, env):
    """Stands in for one torchrun launch of the GPU worker (the repeat loop's bookkeeping is under test, not CUDA)."""
    ok = modes != "mismatch"
    return {"modes": modes, "rc": 0 if ok else 1, "hang": False, "wall_s": 0.1, "ok": ok, "failed_lines": [],
            "raised": [], "tail": "" if ok else "[rank 0] FAILED: made up"}


def test_fault_repeats_reports_every_launch_and_failures(tmp_path, monkeypatch, capsys):
    import fault_repeats

    monkeypatch.setattr(fault_repeats, "gpu_count", lambda: 2)
    monkeypatch.setattr(fault_repeats, "launch", _fake_launch)
    out = tmp_path / "faults.json"
    rc = fault_repeats.main(["--repeats", "3", "--faults", "timeout,mismatch", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "FAILURES" in text and "[6/6" in text
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["launches_planned"] == 6
    assert [len(data["results"][m]) for m in ("timeout", "mismatch")] == [3, 3]
    assert not any(r["ok"] for r in data["results"]["mismatch"])


def test_fault_repeats_cut_short_keeps_what_finished(tmp_path):
    """A time limit's SIGTERM: the table of what finished is printed and the JSON kept, marked incomplete."""
    out = tmp_path / "faults.json"
    script = f"""
import os, signal, sys, threading, time
sys.path.insert(0, {BENCH!r})
import fault_repeats
fault_repeats.gpu_count = lambda: 2
def slow(modes, timeout_s, env):
    if modes == "mismatch":
        time.sleep(60)
    return {{"modes": modes, "rc": 0, "hang": False, "wall_s": 0.1, "ok": True, "failed_lines": [], "raised": [],
            "tail": ""}}
fault_repeats.launch = slow
threading.Timer(2.0, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
sys.exit(fault_repeats.main(["--repeats", "2", "--parallel", "2", "--faults", "timeout,mismatch",
                             "--out", {str(out)!r}]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert "CUT SHORT" in proc.stdout and "timeout" in proc.stdout
    data = json.loads(out.read_text())
    assert data["complete"] is False and data["launches_planned"] == 4
    assert len(data["results"]["timeout"]) == 2 and data["results"]["mismatch"] == []


def test_clock_sampler_without_nvml_changes_nothing():
    """On a machine without a GPU (or NVML) the sampler reports why and gives no numbers; the block still runs."""
    import _common as C

    s = C.ClockSampler(period_s=0.001)
    ran = []
    with s:
        ran.append(1)
    assert ran == [1]
    if s.error:
        assert s.stats() == {}


VALIDATION_2GPU = os.path.join(REPO, "bench", "results", "cost_model_validation-2026-11-24", "validation.json")


def test_validation_rescore_built_in_h200_meets_collective_time_targets(tmp_path):
    """The built-in h200-sxm profile against the collective times measured on 2x H200 (2026-11-24): median |error|
    <= 15% per op and backend, crossovers within 2x. (Its CE terms were fitted to these numbers; the device run of
    bench/cost_model_validation.py is the independent check.)"""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "cost_model_validation.py"), "--rescore",
                           VALIDATION_2GPU, "--profile", "h200-sxm", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads((tmp_path / "rescore.json").read_text())
    assert data["rescored_from"] == VALIDATION_2GPU and data["scores"][0]["profile"] == "h200-sxm"
    time_checks = [c for c in data["scores"][0]["checks"] if "slowdown" not in c["check"]]
    assert len(time_checks) == 6 and all(c["pass"] for c in time_checks), time_checks


def test_validation_rescore_rejects_a_file_without_measurements(tmp_path):
    bad = tmp_path / "v.json"
    bad.write_text('{"schema": "something else"}')
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "cost_model_validation.py"), "--rescore", str(bad)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and "not a ce_overlap.bench.cost_model_validation/1 file" in proc.stderr


def test_train_lr_warmup_and_loss_agreement():
    import types

    import train

    args = train.parse_args(["--lr", "3e-4", "--lr-warmup-steps", "200", "--device", "cpu"])
    assert train.lr_at(1, args) == 3e-4 / 200 and train.lr_at(200, args) == 3e-4 and train.lr_at(500, args) == 3e-4
    assert train.lr_at(7, train.parse_args(["--lr-warmup-steps", "0", "--device", "cpu"])) == 3e-4
    with pytest.raises(SystemExit):
        train.parse_args(["--lr-warmup-steps", "-1", "--device", "cpu"])
    mode = lambda name, losses: types.SimpleNamespace(mode=name, losses=losses)  # noqa: E731
    # One bf16 spacing at 12.5 is 2^-7 * 12.5 ~= 0.098: 0.05 apart agrees, 0.25 apart does not.
    ok, why = train.losses_agree([mode("a", [12.5, 12.4]), mode("b", [12.5, 12.45])])
    assert ok, why
    ok, why = train.losses_agree([mode("a", [12.5, 12.4]), mode("b", [12.5, 12.65]), mode("c", [12.5, 12.4])])
    assert not ok and "step 2" in why and "b 12.6500" in why
