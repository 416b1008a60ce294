"""`ce-overlap calibrate` without GPUs: its refusals, the profile writer (fed synthetic measurements: this tests the
writer, not the numbers), and the pure functions of bench/cost_model_validation.py."""
from __future__ import annotations

import copy
import io
import json
import math
import os
import struct
import sys
import zlib

import pytest

from conftest import REPO, run_cli
from ce_overlap import CeOverlapError, _core, calibrate, profiles

sys.path.insert(0, os.path.join(REPO, "bench"))
import cost_model_validation as V  # noqa: E402

MIB = 1 << 20
SIZES = [64 << 10, 256 << 10, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
PEAK = 989.0


def _assert_one_line_exit_2(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def synthetic() -> dict:
    """Measurements as `calibrate --measurements` writes them, made up from the h200-sxm model with known
    deviations: NCCL 1.5x slower, CE 0.9x, GEMM efficiency 0.75 with a 4e9-FLOP ramp, memory efficiency 0.78."""
    p = profiles.load("h200-sxm")

    def pts(coll, backend, factor):
        out = []
        for s in SIZES:
            b = 2 * s if coll == "reduce_scatter" else s
            out.append([b, factor * _core.estimate_collective(p, coll, b, 2, backend)])
        return out

    def slow(coll, backend, compute, pct, own):
        return {"collective": coll, "backend": backend, "group_size": 2, "bytes": (2 if coll == "reduce_scatter" else 1) * 256 * MIB,
                "compute": compute, "compute_alone_us": 1400.0, "compute_beside_us": 1400.0 * (1 + pct / 100),
                "collective_alone_us": 1000.0, "collective_beside_us": 1000.0 * (1 + own)}

    return {
        "schema": "ce_overlap.calibration/1", "world_size": 2, "host": "testbox", "time": "2026-11-22 00:00:00",
        "gpu": {"name": "NVIDIA H200", "sms": 132, "memory_gib": 139.8},
        "versions": {"torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9"},
        "gemm": [{"n": n, "us": (2 * n ** 3 + 4e9) / (PEAK * 1e6 * 0.75)} for n in (2048, 4096, 8192)],
        "memory_bound": {"bytes": 3 << 30, "us": (3 << 30) / (4800 * 0.78) / 1e3},
        "collectives": [
            {"collective": "all_gather", "backend": "nccl", "group_size": 2, "points": pts("all_gather", "nccl", 1.5)},
            {"collective": "all_gather", "backend": "ce", "group_size": 2, "points": pts("all_gather", "ce", 0.9)},
            {"collective": "reduce_scatter", "backend": "nccl", "group_size": 2,
             "points": pts("reduce_scatter", "nccl", 1.4)},
            {"collective": "send", "backend": "nccl", "group_size": 2, "points": pts("send", "nccl", 1.0)},
        ],
        "slowdowns": [
            slow("all_gather", "nccl", "gemm", 24.0, 0.05), slow("all_gather", "ce", "gemm", 3.0, 0.01),
            slow("reduce_scatter", "nccl", "gemm", 22.0, 0.04),
            slow("all_gather", "nccl", "memory_bound", 20.0, 0.15), slow("all_gather", "ce", "memory_bound", 24.0, 0.2),
        ],
        "peer_copy": {"bytes": 256 * MIB, "us": 256 * MIB / 395e3},
        "skipped": {"ce reduce_scatter": "torch.ops.ce_overlap.reduce_scatter_tensor is not in this build"},
    }


@pytest.fixture(scope="module")
def base():
    return json.loads(profiles.read_text("h200-sxm"))


@pytest.fixture(scope="module")
def built(base):
    return calibrate.build_profile(base, synthetic())


# --------------------------------------------------------------------------------------------------------------
# The command's refusals

def test_calibrate_without_gpu_exits_2_with_one_line(tmp_path):
    out = tmp_path / "p.json"
    proc = run_cli("calibrate", "-o", str(out), env_extra={"CUDA_VISIBLE_DEVICES": ""})
    _assert_one_line_exit_2(proc, "calibrate needs a CUDA GPU", "none is visible")
    assert not out.exists()


def test_calibrate_more_gpus_without_torchrun_explains(tmp_path):
    proc = run_cli("calibrate", "-o", str(tmp_path / "p.json"), "--gpus", "2", env_extra={"CUDA_VISIBLE_DEVICES": ""})
    _assert_one_line_exit_2(proc, "--gpus 2 needs one process per GPU", "torchrun --standalone --nproc-per-node 2")


def test_calibrate_bad_size_exits_2(tmp_path):
    proc = run_cli("calibrate", "-o", str(tmp_path / "p.json"), "--max-size", "12Q")
    _assert_one_line_exit_2(proc, "bad size '12Q'")


# --------------------------------------------------------------------------------------------------------------
# The writer

def test_written_profile_loads_through_the_cpp_loader(built, tmp_path):
    prof, notes = built
    path = tmp_path / "cal.json"
    calibrate.write_profile(str(path), prof)
    loaded = profiles.load(str(path))
    assert loaded.name == "h200-sxm-calibrated"
    assert json.loads(loaded.to_json())["curves"]  # the loader kept the curves
    text = json.loads(path.read_text())
    assert text["schema"] == "ce_overlap.profile/2"
    assert text["description"].startswith("CALIBRATED by `ce-overlap calibrate` on testbox")
    assert "KEPT FROM THE BASE" in text["description"] and "SKIPPED: ce reduce_scatter" in text["description"]
    assert any("kept from h200-sxm: topology" == n for n in notes)  # no topology in the synthetic measurements


def test_writer_fits_what_was_measured(built):
    prof, _ = built
    assert prof["efficiency"]["gemm"] == pytest.approx(0.75, rel=1e-3)
    assert prof["efficiency"]["gemm_ramp_flops"] == pytest.approx(4e9, rel=1e-2)
    assert prof["efficiency"]["memory"] == pytest.approx(0.78, rel=1e-3)
    assert prof["ce"]["one_way_efficiency"] == pytest.approx(395 / 478, rel=1e-3)
    # the mean of AG, RS; calibrate does not measure the fixed time per collective: the base's is kept, and said
    assert prof["contention"]["nccl_beside_compute"] == {"compute_bound": 0.045, "memory_bound": 0.15,
                                                         "residency_us": 75}
    assert "contention.nccl_beside_compute.residency_us" in prof["description"]
    m = synthetic()
    curves = {(c["collective"], c["backend"]): c for c in prof["curves"]}
    assert set(curves) == {("all_gather", "nccl"), ("all_gather", "ce"), ("reduce_scatter", "nccl"),
                           ("send", "nccl")}
    assert [p[0] for p in curves[("all_gather", "nccl")]["points"]] == SIZES
    # Curves: the model now returns the measured times for 2 ranks.
    p = _core.Profile.from_json(json.dumps(prof))
    for c in m["collectives"]:
        for b, us in c["points"][::3]:
            assert _core.estimate_collective(p, c["collective"], b, 2, c["backend"]) == pytest.approx(us, rel=1e-3)
    # The analytic model (used for other group sizes) moved toward the measurement: NCCL 1.5x slower at large sizes.
    h200 = profiles.load("h200-sxm")
    nocurves = _core.Profile.from_json(json.dumps({k: v for k, v in prof.items() if k != "curves"}))
    big = 256 * MIB
    ratio = (_core.estimate_collective(nocurves, "all_gather", big, 2, "nccl")
             / _core.estimate_collective(h200, "all_gather", big, 2, "nccl"))
    assert ratio == pytest.approx(1.5, rel=0.02)
    ratio = (_core.estimate_collective(nocurves, "all_gather", big, 2, "ce")
             / _core.estimate_collective(h200, "all_gather", big, 2, "ce"))
    assert ratio == pytest.approx(0.9, rel=0.02)
    # 8 ranks have no curve: the fitted analytic model answers, slower than the built-in's as measured.
    assert (_core.estimate_collective(p, "all_gather", big, 8, "nccl")
            > 1.3 * _core.estimate_collective(h200, "all_gather", big, 8, "nccl"))
    # Contention: the fitted sensitivities reproduce the measured slowdowns (within a point; 5 rows, 4 unknowns).
    for s in m["slowdowns"]:
        pred = calibrate.predicted_slowdown(p, s["collective"], s["bytes"], 2, s["backend"], s["compute"])
        meas = s["compute_beside_us"] / s["compute_alone_us"] - 1
        assert abs(pred - meas) * 100 < 1.5, s


def test_compute_kernels_fit_attention_optimizer_and_memory(base):
    """Attention efficiencies on executed (causal) FLOPs, the fused AdamW bandwidth, and the memory efficiency as
    the median of the activation-sized kernels (the 1 GiB add only where those are missing)."""
    from ce_overlap.inductor.flops import attention_backward_flops, attention_flops

    m = synthetic()
    q = (1, 32, 4096, 128)
    fwd, bwd = attention_flops(q, q, q, True), attention_backward_flops(q, q, q, True)
    assert fwd == 4 * 32 * 128 * (4096 * 4097 // 2)  # causal: the pairs at or below the diagonal
    m["attention"] = {"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128, "causal": True,
                      "forward_us": fwd / (PEAK * 1e6 * 0.5), "backward_us": bwd / (PEAK * 1e6 * 0.4)}
    m["optimizer"] = {"params": 1 << 28, "bytes": 28 << 28, "us": (28 << 28) / (4800 * 0.7) / 1e3}
    m["memory_kernels"] = [{"name": f"k{e}", "bytes": 1 << 26, "us": (1 << 26) / (4800 * e) / 1e3}
                           for e in (0.6, 0.7, 0.9)]
    prof, notes = calibrate.build_profile(base, m)
    eff = prof["efficiency"]
    assert eff["attention"] == pytest.approx(0.5, abs=1e-4)
    assert eff["attention_backward"] == pytest.approx(0.4, abs=1e-4)
    assert eff["optimizer"] == pytest.approx(0.7, abs=1e-4)
    assert eff["memory"] == pytest.approx(0.7, abs=1e-4)  # the median, not the add's 0.78
    assert any(n.startswith("efficiency.attention 0.500 / attention_backward 0.400") for n in notes)
    # The C++ loader takes the new fields, and attention ops are charged by them.
    p = _core.Profile.from_json(json.dumps(prof))
    assert json.loads(p.to_json())["efficiency"]["attention_backward"] == eff["attention_backward"]
    # Above-peak attention (non-causal counting of a causal kernel would do that) is refused.
    m["attention"]["forward_us"] /= 3
    with pytest.raises(CeOverlapError, match="attention.forward_us: .* above the base profile's bf16 peak"):
        calibrate.build_profile(base, m)
    m = synthetic()
    m["attention"] = {"batch": 1, "heads": 0, "seq": 4096, "head_dim": 128, "causal": True, "forward_us": 1.0,
                      "backward_us": 1.0}
    with pytest.raises(CeOverlapError, match="attention.heads: expected a number > 0"):
        calibrate.build_profile(base, m)


def test_ce_reduce_scatter_curve_fits_the_reduction_rate(base):
    m = synthetic()
    h200 = profiles.load("h200-sxm")
    pts = [[2 * s, 1.3 * _core.estimate_collective(h200, "reduce_scatter", 2 * s, 2, "ce")] for s in SIZES]
    m["collectives"].append({"collective": "reduce_scatter", "backend": "ce", "group_size": 2, "points": pts})
    m["ce_reduce_sms"] = 20
    m["skipped"] = {}
    prof, notes = calibrate.build_profile(base, m)
    assert prof["ce"]["reduce_sms"] == 20
    assert prof["ce"]["reduce_gbps_per_sm"] < base["ce"]["reduce_gbps_per_sm"]  # measured slower than the model
    assert any(n.startswith("ce.reduce_gbps_per_sm") for n in notes)
    nocurves = _core.Profile.from_json(json.dumps({k: v for k, v in prof.items() if k != "curves"}))
    b1, b2 = pts[-2][0], pts[-1][0]
    slope = (_core.estimate_collective(nocurves, "reduce_scatter", b2, 2, "ce")
             - _core.estimate_collective(nocurves, "reduce_scatter", b1, 2, "ce"))
    assert slope == pytest.approx(pts[-1][1] - pts[-2][1], rel=0.01)
    assert "SKIPPED" not in prof["description"]


def test_analyze_uses_the_calibrated_profile(cli, tmp_path):
    mfile, pfile = tmp_path / "m.json", tmp_path / "cal.json"
    mfile.write_text(json.dumps(synthetic()))
    proc = cli("calibrate", "--from-measurements", str(mfile), "-o", str(pfile))
    assert proc.returncode == 0, proc.stderr
    assert "loaded back through the C++ loader: ok" in proc.stdout
    assert "measured vs the written profile" in proc.stdout
    builtin = cli("analyze", "llama3-tiny", "--world-size", "2", "--profile", "h200-sxm", "--json")
    calibrated = cli("analyze", "llama3-tiny", "--world-size", "2", "--profile", str(pfile), "--json")
    assert builtin.returncode == 0 and calibrated.returncode == 0, calibrated.stderr
    a, b = json.loads(builtin.stdout), json.loads(calibrated.stdout)
    assert b["profile"] == "h200-sxm-calibrated"
    # NCCL measured 1.5x slower than the built-in model: the analyzer's communication time grows.
    assert b["graphs"][0]["comm_us"] > 1.2 * a["graphs"][0]["comm_us"]


def test_reduction_kernel_measured_directly_sets_its_rate_and_contention(base):
    """One GPU measures the CE reduction kernel alone and a GEMM / memory-bound kernel beside it: ce.reduce_sms,
    ce.reduce_gbps_per_sm and contention.ce_reduction come from it, and the model then prices the kernel by it."""
    m = synthetic()
    m["reduction_kernel"] = {"ctas": 24, "bytes": 3 * 256 * MIB, "us": 400.0,
                             "gemm": {"alone_us": 1400.0, "beside_us": 1540.0},
                             "memory_bound": {"alone_us": 900.0, "beside_us": 1800.0}}
    prof, notes = calibrate.build_profile(base, m)
    assert prof["ce"]["reduce_sms"] == 24
    assert prof["ce"]["reduce_gbps_per_sm"] == pytest.approx(3 * 256 * MIB / 400.0 / 1e3 / 24, rel=1e-3)
    assert prof["contention"]["ce_reduction"] == {"compute_bound": pytest.approx(0.1), "memory_bound": pytest.approx(1.0)}
    assert any("contention.ce_reduction" in n for n in notes)
    # The kernel of a CE reduce-scatter now costs a GEMM beside it about the measured 10% while it runs (the copies'
    # traffic adds a little), not the SM formula's 24/(132-24) = 22%.
    p = _core.Profile.from_json(json.dumps(prof))
    gemm = calibrate.predicted_slowdown(p, "reduce_scatter", 2 * 256 * MIB, 2, "ce", "gemm")
    assert 0.0 < gemm < 0.2
    # The class sensitivities are still fitted from the collectives (the measured kernel's share held fixed).
    assert any(n.startswith("contention.compute_bound") for n in notes)


def test_collectives_own_slowdowns_and_the_copy_engine_term(base):
    """The collectives' own slowdown beside compute is measured directly: NCCL's from both collectives, CE's from the
    all-gather only (the copy-only op; calibrate's CE reduce-scatter runs the reduction kernel). contention.ce_copies is
    what the fitted SM/HBM formula leaves of the slowdown beside the CE all-gather, never below 0."""
    m = synthetic()
    m["slowdowns"].append({**m["slowdowns"][1], "collective": "reduce_scatter", "bytes": 512 * MIB,
                           "collective_beside_us": 3500.0})  # +250% (the kernel vs the GEMM): not CE's own slowdown
    prof, notes = calibrate.build_profile(base, m)
    con = prof["contention"]
    assert con["nccl_beside_compute"]["compute_bound"] == pytest.approx(0.045)  # mean of +5% and +4%
    assert con["ce_beside_compute"]["compute_bound"] == pytest.approx(0.01)
    p = _core.Profile.from_json(json.dumps({**prof, "contention": {k: v for k, v in con.items() if k != "ce_copies"}}))
    formula = calibrate.predicted_slowdown(p, "all_gather", 256 * MIB, 2, "ce", "gemm")
    assert con["ce_copies"]["compute_bound"] == pytest.approx(max(0.0, 0.03 - formula), abs=1e-4)
    assert con["ce_copies"]["memory_bound"] >= 0.0
    assert any(n.startswith("contention.ce_copies") for n in notes)
    # With the term the model gives the measured GEMM slowdown beside the CE all-gather.
    full = _core.Profile.from_json(json.dumps(prof))
    assert calibrate.predicted_slowdown(full, "all_gather", 256 * MIB, 2, "ce", "gemm") == \
        pytest.approx(max(0.03, formula), abs=2e-3)


def test_kernel_gap_measured_sets_the_gap_the_analysis_charges(base, cli, tmp_path):
    """The GPU's idle time between kernels of compiled steps, divided by their kernel count, is
    efficiency.kernel_gap_us; without the measurement the base profile's gap is kept and said so."""
    m = synthetic()
    m["kernel_gap"] = {"workload": "test", "steps": 3, "kernels": 400.0, "idle_us": 1000.0, "largest_gaps": []}
    prof, notes = calibrate.build_profile(base, m)
    assert prof["efficiency"]["kernel_gap_us"] == 2.5
    assert any(n.startswith("efficiency.kernel_gap_us 2.50") for n in notes)
    kept, notes = calibrate.build_profile(base, synthetic())
    assert kept["efficiency"]["kernel_gap_us"] == base["efficiency"]["kernel_gap_us"]
    assert "efficiency.kernel_gap_us" in kept["description"]  # listed among what was kept from the base
    # The analysis charges it once per kernel: a larger gap, a proportionally larger kernel_gap_us in the report.
    m["kernel_gap"]["idle_us"] = 4000.0  # 10 us per kernel
    big, _ = calibrate.build_profile(base, m)
    pfile = tmp_path / "gap.json"
    pfile.write_text(json.dumps(big))
    a = json.loads(cli("analyze", "llama3-tiny", "--world-size", "2", "--profile", "h200-sxm", "--json").stdout)
    b = json.loads(cli("analyze", "llama3-tiny", "--world-size", "2", "--profile", str(pfile), "--json").stdout)
    ga, gb = a["graphs"][0], b["graphs"][0]
    assert ga["kernels"] == gb["kernels"] > 0
    assert gb["kernel_gap_us"] == pytest.approx(10.0 * gb["kernels"])
    assert ga["kernel_gap_us"] == pytest.approx(base["efficiency"]["kernel_gap_us"] * ga["kernels"])


def _training_step(base, gemm_slower: float, attention_slower: float) -> dict:
    """A training_step measurement of calibrate's workload whose GEMMs / attention ran this much slower than
    `base`'s efficiencies say (as the bursts of synthetic() fit them: 0.75 with a 4e9 ramp)."""
    from ce_overlap.models.llama import LlamaConfig

    cfg = LlamaConfig(**calibrate.STEP_MODEL)
    gemms = calibrate.step_gemms(cfg)
    gemm_us = sum(c * (2 * m * n * k + 4e9) / (PEAK * 1e6 * 0.75) for m, n, k, c in gemms)
    fwd, bwd = calibrate.attention_executed_flops(1, cfg.n_heads, cfg.seq_len, cfg.head_dim, True)
    eff = base["efficiency"]
    att_us = cfg.n_layers * (fwd / (PEAK * 1e6 * eff["attention"]) + bwd / (PEAK * 1e6 * eff["attention_backward"]))
    return {"workload": "test", "gemms": gemms, "gemm_us": gemm_us * gemm_slower,
            "attention": {"batch": 1, "heads": cfg.n_heads, "seq": cfg.seq_len, "head_dim": cfg.head_dim,
                          "causal": True, "layers": cfg.n_layers},
            "attention_us": att_us * attention_slower}


def test_training_step_scales_the_burst_efficiencies_to_steady_clocks(base):
    """GEMMs and attention inside a compiled step (steady, power-limited clocks) ran slower than the short bursts
    the curve was fitted to: the efficiencies are scaled so the model charges the step's kernels what they took."""
    m = synthetic()
    m["training_step"] = _training_step(base, 1.10, 1.20)
    prof, notes = calibrate.build_profile(base, m)
    eff = prof["efficiency"]
    assert eff["gemm"] == pytest.approx(0.75 / 1.10, abs=1e-4)
    assert eff["gemm_ramp_flops"] == pytest.approx(4e9, rel=1e-3)  # the ramp (the curve's shape) stays the bursts'
    assert eff["attention"] == pytest.approx(base["efficiency"]["attention"] / 1.20, abs=1e-4)
    assert eff["attention_backward"] == pytest.approx(base["efficiency"]["attention_backward"] / 1.20, abs=1e-4)
    assert any("inside a compiled training step" in n and "+10.0%" in n and "+20.0%" in n for n in notes)
    # The step's own AdamW (every parameter shape of a model, steady clocks) wins over the burst's.
    m["optimizer"] = {"params": 1 << 28, "bytes": 28 << 28, "us": (28 << 28) / (4800 * 0.74) / 1e3}
    m["training_step"]["optimizer"] = {"params": 1 << 30, "bytes": 28 << 30, "us": (28 << 30) / (4800 * 0.68) / 1e3}
    prof2, notes2 = calibrate.build_profile(base, m)
    assert prof2["efficiency"]["optimizer"] == pytest.approx(0.68, abs=1e-4)
    assert any(n.startswith("efficiency.optimizer 0.680") and "inside the training step" in n for n in notes2)
    del m["training_step"]["optimizer"]
    assert calibrate.build_profile(base, m)[0]["efficiency"]["optimizer"] == pytest.approx(0.74, abs=1e-4)
    # The C++ loader takes it, and the model charges a step GEMM what the step measured.
    p = _core.Profile.from_json(json.dumps(prof))
    assert json.loads(p.to_json())["efficiency"]["gemm"] == eff["gemm"]
    # A step whose kernels make no sense against the bursts (another kernel mix, a broken profile) is refused.
    m["training_step"] = _training_step(base, 3.0, 1.0)
    with pytest.raises(CeOverlapError, match="training_step.gemm_us: .* inconsistent"):
        calibrate.build_profile(base, m)
    m["training_step"] = _training_step(base, 1.0, 1.0)
    m["training_step"]["gemms"][0] = [4096, 0, 4096, 1]
    with pytest.raises(CeOverlapError, match=r"training_step.gemms\[0\]: expected \[m, n, k, count\]"):
        calibrate.build_profile(base, m)
    # The clock the step ran at, where measured, is said beside the efficiencies it holds for; a malformed one is an
    # error naming it.
    m["training_step"] = {**_training_step(base, 1.10, 1.20), "clock": {"sm_mhz": 1540.0, "power_w": 690.2}}
    assert any("steady clocks, SM 1540 MHz at 690 W" in n for n in calibrate.build_profile(base, m)[1])
    m["training_step"]["clock"] = {"sm_mhz": "fast", "power_w": 690.2}
    with pytest.raises(CeOverlapError, match="training_step.clock.sm_mhz: expected a finite number"):
        calibrate.build_profile(base, m)
    m["training_step"]["clock"] = [1540.0]
    with pytest.raises(CeOverlapError, match="training_step.clock: expected an object"):
        calibrate.build_profile(base, m)


def test_training_step_time_by_kind_is_checked_and_keeps_fused_memory(base):
    """The step's time by kind is recorded, not fitted from (calibrate's own step does not give efficiency.fused_memory:
    bench/results/compute-2026-11-28): the base's value is kept and said so; a malformed entry names its field."""
    m = synthetic()
    m["training_step"] = {**_training_step(base, 1.0, 1.0), "by_kind_us": {"loss": 1500.0, "cast": 1400.0}}
    prof, notes = calibrate.build_profile(base, m)
    assert prof["efficiency"].get("fused_memory") == base["efficiency"].get("fused_memory")
    if "fused_memory" in base["efficiency"]:
        assert any(n.endswith("efficiency.fused_memory") for n in notes)
    m["training_step"]["by_kind_us"] = {"loss": "slow"}
    with pytest.raises(CeOverlapError, match=r"training_step.by_kind_us.loss: expected a finite number"):
        calibrate.build_profile(base, m)


def test_clock_and_power_is_none_without_a_gpu_to_ask():
    """sm_clock_and_power answers None, never raises, where neither NVML nor nvidia-smi can say (this CPU machine)."""
    from ce_overlap.calibrate.timing import sm_clock_and_power

    assert sm_clock_and_power() is None


def test_step_gemms_are_every_linear_three_times():
    from ce_overlap.models.llama import LlamaConfig, Llama

    cfg = LlamaConfig(**{**calibrate.STEP_MODEL, "vocab_size": 1000})
    gemms = calibrate.step_gemms(cfg)
    flops = sum(2 * m * n * k * c for m, n, k, c in gemms)
    import torch

    with torch.device("meta"):
        model = Llama(cfg)
    linear_params = sum(mod.weight.numel() for mod in model.modules() if isinstance(mod, torch.nn.Linear))
    assert flops == 3 * 2 * cfg.seq_len * linear_params  # forward, input grad, weight grad of every linear


def _mutate(f):
    m = synthetic()
    f(m)
    return m


def _curve(m, coll="all_gather", backend="nccl"):
    return next(c for c in m["collectives"] if c["collective"] == coll and c["backend"] == backend)


# A compute grid as `calibrate --compute-grid` writes it (one row per part).
_GRID = {"gemms": [{"m": 4096, "n": 4096, "k": 4096, "layout": "nt", "us": 190.0}],
         "attention": [{"batch": 2, "heads": 32, "seq": 4096, "head_dim": 128, "causal": True, "forward_us": 600.0,
                        "backward_us": 1500.0}],
         "memory": [{"name": "add", "mib": 64, "bytes": 3 * 64 << 20, "us": 50.0},
                    {"name": "rmsnorm", "mib": 64, "bytes": 2 * 64 << 20, "us": 40.0}], "tiny_kernel_us": 2.0}


def test_a_compute_grid_becomes_the_profiles_shape_tables(base):
    """calibrate --compute-grid's rows pass the check, stay in the clean measurements, and become the profile's
    "shapes": this GPU's burst efficiencies (FLOPs or bytes over time against the base's peaks), the base's in-step
    factors kept (fitted to training steps, not to bursts); the C++ loader takes the result."""
    clean, _ = calibrate.check_measurements(_mutate(lambda m: m.update(compute_grid=_GRID)))
    assert clean["compute_grid"] == _GRID
    prof, notes = calibrate.build_profile(base, _mutate(lambda m: m.update(compute_grid=_GRID)))
    sh = prof["shapes"]
    assert sh["gemm"] == {"dims": [4096], "efficiency": [round(2 * 4096**3 / (190.0 * 989e6), 4)]}
    flops = 4 * 2 * 32 * 4096**2 * 128 / 2  # causal: half the square
    assert sh["attention"]["causal"]["forward"] == [round(flops / (600.0 * 989e6), 4)]
    assert sh["attention"]["causal"]["backward"] == [round(2.5 * flops / (1500.0 * 989e6), 4)]
    assert sh["memory"]["bytes"] == [3 * 64 << 20]
    assert sh["memory"]["pointwise"] == [round((3 * 64 << 20) / (50.0 * 4800e3), 4)]
    assert sh["memory"]["reduction"] == [round((2 * 64 << 20) / (40.0 * 4800e3), 4)]  # one size: its value
    assert sh["in_step"] == json.loads(profiles.read_text("h200-sxm"))["shapes"]["in_step"]
    assert any("shapes from the compute grid" in n for n in notes)
    without, _ = calibrate.build_profile(base, _mutate(lambda m: None))
    assert without["shapes"] == json.loads(profiles.read_text("h200-sxm"))["shapes"]  # kept from the base


def test_a_compute_grid_without_reduction_kernels_is_refused(base):
    grid = {**_GRID, "memory": _GRID["memory"][:1]}
    with pytest.raises(CeOverlapError, match=r"compute grid: no reduction kernels \(rmsnorm, layernorm, column_sum\)"):
        calibrate.build_profile(base, _mutate(lambda m: m.update(compute_grid=grid)))


REJECTED = {
    "schema": (lambda m: m.update(schema="ce_overlap.calibration/0"), "schema: expected 'ce_overlap.calibration/1'"),
    "time_drops": (lambda m: _curve(m)["points"][5].__setitem__(1, _curve(m)["points"][4][1] * 0.5),
                   "collectives[0].points[5][1]: all_gather on nccl took"),
    "negative_time": (lambda m: _curve(m)["points"][2].__setitem__(1, -3.0),
                      "collectives[0].points[2][1]: expected a time > 0 us"),
    "sizes_not_increasing": (lambda m: _curve(m)["points"][3].__setitem__(0, 1024),
                             "collectives[0].points[3][0]: sizes must increase"),
    "duplicate_curve": (lambda m: m["collectives"].append(copy.deepcopy(_curve(m))),
                        "collectives[4]: a second curve for all_gather on nccl with 2 ranks (also at collectives[0])"),
    "group_too_big": (lambda m: _curve(m, "all_gather", "ce").update(group_size=4),
                      "collectives[1].group_size: expected an integer in 2..world_size (2), got 4"),
    "one_point": (lambda m: _curve(m)["points"].__delitem__(slice(1, None)), "at least 2 [bytes, us] points"),
    "gemm_above_peak": (lambda m: m["gemm"][2].update(us=100.0),
                        "gemm n=8192: 10995 TFLOP/s, above the base profile's bf16 peak of 989"),
    "memory_above_hbm": (lambda m: m["memory_bound"].update(us=10.0), "above the base profile's HBM 4800 GB/s"),
    "faster_beside": (lambda m: m["slowdowns"][0].update(compute_beside_us=1000.0),
                      "slowdowns[0]: the gemm kernel took 1000.0 us beside all_gather on nccl but 1400.0 us alone"),
    "peer_copy_above_link": (lambda m: m["peer_copy"].update(us=1.0), "above the 478 GB/s link between GPUs 0 and 1"),
    "missing_gpu": (lambda m: m.pop("gpu"), "gpu.name: missing"),
    "bad_compute": (lambda m: m["slowdowns"][1].update(compute="attention"),
                    "slowdowns[1].compute: expected gemm or memory_bound, got 'attention'"),
    "reduction_kernel_ctas": (lambda m: m.update(reduction_kernel={"ctas": 500, "bytes": 1.0, "us": 1.0}),
                              "reduction_kernel.ctas: expected an integer in 1..gpu.sms - 1, got 500"),
    "reduction_kernel_no_gemm": (lambda m: m.update(reduction_kernel={"ctas": 32, "bytes": 1.0, "us": 1.0}),
                                 "reduction_kernel.gemm: expected an object with alone_us and beside_us"),
    "kernel_gap_negative": (lambda m: m.update(kernel_gap={"kernels": 800, "idle_us": -5.0}),
                            "kernel_gap.idle_us: expected a number >= 0, got -5.0"),
    "kernel_gap_no_kernels": (lambda m: m.update(kernel_gap={"kernels": 0, "idle_us": 10.0}),
                              "kernel_gap.kernels: expected a number > 0, got 0"),
    "grid_bad_layout": (lambda m: m.update(compute_grid={**_GRID, "gemms": [{**_GRID["gemms"][0], "layout": "tt"}]}),
                        "compute_grid.gemms[0].layout: expected 'nt', 'nn' or 'tn', got 'tt'"),
    "grid_negative_attention": (lambda m: m.update(compute_grid={**_GRID, "attention": [
        {**_GRID["attention"][0], "backward_us": -1.0}]}), "compute_grid.attention[0].backward_us: expected a number > 0"),
    "grid_no_tiny_kernel": (lambda m: m.update(compute_grid={k: v for k, v in _GRID.items() if k != "tiny_kernel_us"}),
                            "compute_grid.tiny_kernel_us: missing"),
    "reduction_kernel_faster_beside": (
        lambda m: m.update(reduction_kernel={"ctas": 32, "bytes": 1.0, "us": 1.0,
                                             "gemm": {"alone_us": 1400.0, "beside_us": 1000.0},
                                             "memory_bound": {"alone_us": 900.0, "beside_us": 950.0}}),
        "reduction_kernel.gemm: 1000.0 us beside the reduction kernel but 1400.0 us alone"),
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_inconsistent_measurements_are_rejected_naming_the_field(base, case):
    mutate, fragment = REJECTED[case]
    with pytest.raises(CeOverlapError) as e:
        calibrate.build_profile(base, _mutate(mutate))
    assert fragment in str(e.value)
    assert str(e.value).startswith("measurements: ")


def test_a_stalled_size_is_measured_again_before_the_check_sees_it():
    """The 4x H200 send curve of 2026-11-28: 42.6 us at a smaller size, 15.9 at 1 MiB. calibrate measures the stalled
    size again (keeping the lower median) instead of stopping; one that stays inconsistent after REMEASURES tries is
    left for the check to reject; a consistent curve is measured once."""
    from ce_overlap.calibrate.common import REMEASURES
    from ce_overlap.calibrate.measurements import remeasure_stalls

    sizes = [1 << 16, 1 << 18, 1 << 20]
    asked = []
    again = {1 << 18: [14.0]}
    pts = [[1 << 16, 12.0], [1 << 18, 42.6], [1 << 20, 15.9]]

    def measure(nbytes):
        asked.append(nbytes)
        return again[nbytes].pop(0)

    remeasure_stalls(pts, sizes, measure)
    assert asked == [1 << 18] and pts[1][1] == 14.0 and pts[0][1] == 12.0 and pts[2][1] == 15.9

    stuck = [[1 << 16, 12.0], [1 << 18, 42.6], [1 << 20, 15.9]]
    asked.clear()
    remeasure_stalls(stuck, sizes, lambda nbytes: asked.append(nbytes) or 50.0)
    assert asked == [1 << 18] * REMEASURES and stuck[1][1] == 42.6  # the lower median kept; the check rejects it

    asked.clear()
    remeasure_stalls([[1 << 16, 12.0], [1 << 18, 13.0], [1 << 20, 15.9]], sizes, lambda nbytes: asked.append(nbytes))
    assert asked == []


def test_small_dips_are_raised_with_a_note(base):
    m = synthetic()
    pts = _curve(m, "all_gather", "ce")["points"]
    pts[1][1] = pts[0][1] * 0.97  # noise at the latency floor
    prof, notes = calibrate.build_profile(base, m)
    curve = next(c for c in prof["curves"] if c["collective"] == "all_gather" and c["backend"] == "ce")
    assert curve["points"][1][1] == pytest.approx(curve["points"][0][1])
    assert any("raised to" in n for n in notes)


def test_a_dip_at_the_latency_floor_is_jitter_not_an_error(base):
    """2x H100's CE all-gather read 38.0 us at 256 KiB and 29.8 us at 1 MiB (22% less, 8.2 us): within
    MAX_DECREASE_US, so raised to 38.0 with a note; the same 22% on a bandwidth-bound point is still rejected."""
    m = synthetic()
    pts = _curve(m, "all_gather", "ce")["points"]
    pts[0][1], pts[1][1] = 38.0, 29.8
    for later in pts[2:]:
        later[1] = max(later[1], 38.0)
    prof, notes = calibrate.build_profile(base, m)
    curve = next(c for c in prof["curves"] if c["collective"] == "all_gather" and c["backend"] == "ce")
    assert curve["points"][1][1] == pytest.approx(38.0)
    assert any("29.8 us" in n and "raised to 38.0 us" in n for n in notes)
    big = synthetic()
    bp = _curve(big, "all_gather", "ce")["points"]
    bp[-1][1] = bp[-2][1] * 0.78
    assert bp[-2][1] - bp[-1][1] > 10.0
    with pytest.raises(CeOverlapError, match=r"inconsistent \(more than 10% and 10 us\)"):
        calibrate.build_profile(base, big)


def test_inconsistent_measurements_via_the_cli_exit_2(cli, tmp_path):
    m = _mutate(REJECTED["time_drops"][0])
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    out = tmp_path / "p.json"
    proc = cli("calibrate", "--from-measurements", str(path), "-o", str(out))
    _assert_one_line_exit_2(proc, "inconsistent", "measure again")
    assert not out.exists()


def test_unknown_gpu_needs_base(tmp_path, cli):
    m = synthetic()
    m["gpu"]["name"] = "NVIDIA GH200 480GB"
    path = tmp_path / "m.json"
    path.write_text(json.dumps(m))
    _assert_one_line_exit_2(cli("calibrate", "--from-measurements", str(path), "-o", str(tmp_path / "p.json")),
                            "no built-in profile for 'NVIDIA GH200 480GB': pass --base")
    proc = cli("calibrate", "--from-measurements", str(path), "-o", str(tmp_path / "p.json"), "--base", "h200-sxm",
               "--name", "gh200-lab")
    assert proc.returncode == 0, proc.stderr
    assert profiles.load(str(tmp_path / "p.json")).name == "gh200-lab"


def test_detected_topology_replaces_the_base_keeping_inter_node(base):
    m = synthetic()
    m["topology"] = {"gpus_per_node": 2, "numa_node": [0, 0],
                     "matrix": {"kind": [["X", "nvlink4"], ["nvlink4", "X"]],
                                "gbps_per_direction": [[0, 478.0], [478.0, 0]], "p2p": [[True, True], [True, True]]}}
    prof, _ = calibrate.build_profile(base, m)
    assert prof["topology"]["gpus_per_node"] == 2 and "matrix" in prof["topology"]
    assert prof["topology"]["inter_node"] == base["topology"]["inter_node"]
    kept, _ = calibrate.build_profile(base, m, keep_topology=True)
    assert kept["topology"] == base["topology"]
    # One visible GPU (a 1-GPU calibration) detects no links: the base's node is kept, and the analysis of a 2-GPU
    # group still sees NVLink (a 1-GPU topology would make every group span nodes).
    m["world_size"] = 1
    m["collectives"], m["slowdowns"] = [], []
    m["topology"] = {"gpus_per_node": 1, "numa_node": [0]}
    one, notes = calibrate.build_profile(base, m)
    assert one["topology"] == base["topology"]
    assert any("one GPU visible" in n for n in notes)
    p = _core.Profile.from_json(json.dumps(one))
    assert _core.estimate_collective(p, "all_gather", 64 << 20, 2, "ce") == pytest.approx(
        _core.estimate_collective(profiles.load("h200-sxm"), "all_gather", 64 << 20, 2, "ce"))


def test_builtin_for_gpu_and_parse_size():
    assert profiles.builtin_for_device("NVIDIA H200") == "h200-sxm"
    assert profiles.builtin_for_device("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert profiles.builtin_for_device("NVIDIA H100 PCIe") == "h100-pcie"
    assert profiles.builtin_for_device("NVIDIA A100-SXM4-80GB") == "a100-sxm"
    assert profiles.builtin_for_device("NVIDIA B200") == "b200"
    assert profiles.builtin_for_device("NVIDIA GH200 480GB") is None
    assert profiles.builtin_for_device("Tesla T4") is None
    assert calibrate.parse_size("64K") == 65536 and calibrate.parse_size("256MiB") == 256 * MIB
    assert calibrate.parse_size("1G") == 1 << 30 and calibrate.parse_size("4096") == 4096
    with pytest.raises(CeOverlapError, match="bad size"):
        calibrate.parse_size("0.3K")


def test_progress_bar_plain_text():
    buf = io.StringIO()
    p = calibrate.Progress(4, stream=buf, width=8)
    for label in ("gemm", "nccl all_gather 1 MiB", "ce all_gather 1 MiB", "profile"):
        p.step(label)
    p.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 4  # not a terminal: one line per step
    assert lines[0].startswith("calibrate [##......] 1/4") and lines[0].endswith("gemm")
    assert lines[-1].startswith("calibrate [########] 4/4")
    quiet = io.StringIO()
    calibrate.Progress(3, enabled=False, stream=quiet).step("x")
    assert quiet.getvalue() == ""


def test_solvers():
    x, ok = calibrate.solve(lambda v: 1000 / v, 250.0, 0.1, 100.0)
    assert ok and x == pytest.approx(4.0, rel=1e-6)
    x, ok = calibrate.solve(lambda v: 1000 / v, 1e6, 0.1, 100.0)  # out of range: the nearer bound
    assert not ok and x == 0.1
    rows = [(0.2, 0.01, 0.201), (0.0, 0.3, 0.03)]
    sm, hbm = calibrate.nnls2(rows)
    assert sm == pytest.approx(1.0, rel=1e-3) and hbm == pytest.approx(0.1, rel=1e-3)
    assert calibrate.nnls2([(1.0, 0.0, -0.5)]) == (0.0, 0.0)  # never negative


# --------------------------------------------------------------------------------------------------------------
# bench/cost_model_validation.py's pure functions

def test_error_stats():
    assert V.error_pct(110.0, 100.0) == pytest.approx(10.0)
    assert V.error_pct(90.0, 100.0) == pytest.approx(-10.0)
    with pytest.raises(ValueError):
        V.error_pct(1.0, 0.0)
    rows = [
        {"op": "all_gather", "backend": "nccl", "predicted_us": 110, "measured_us": 100},
        {"op": "all_gather", "backend": "nccl", "predicted_us": 80, "measured_us": 100},
        {"op": "all_gather", "backend": "nccl", "predicted_us": 101, "measured_us": 100},
        {"op": "all_gather", "backend": "nccl", "predicted_us": 500, "measured_us": 100, "main": False},
        {"op": "all_gather", "backend": "ce", "predicted_us": 50, "measured_us": None},
        {"op": "reduce_scatter", "backend": "ce", "predicted_us": 95, "measured_us": 100},
    ]
    assert V.median_abs_errors(rows) == {"all_gather/nccl": pytest.approx(10.0),
                                         "reduce_scatter/ce": pytest.approx(5.0)}


def test_crossover():
    sizes = [1 * MIB, 4 * MIB, 16 * MIB]
    # CE faster from between 1 and 4 MiB: log(nccl/ce) goes -log2 .. +log2 -> crossover at the geometric middle.
    c = V.crossover(sizes, [10.0, 40.0, 160.0], [20.0, 20.0, 40.0])
    assert c["bytes"] == pytest.approx(2 * MIB, rel=1e-9)
    assert V.crossover(sizes, [10, 20, 30], [5, 6, 7]) == {"below": MIB}
    assert V.crossover(sizes, [5, 6, 7], [10, 20, 30]) == {"above": 16 * MIB}
    # A tie at 4 MiB, CE ahead at 16 MiB: CE becomes faster right after the tie.
    assert V.crossover(sizes, [10, 20, 30], [10, 20, 29]) == {"bytes": pytest.approx(4 * MIB)}
    assert V.crossover([4 * MIB, MIB], [40.0, 10.0], [20.0, 20.0]) == {"bytes": pytest.approx(2 * MIB)}  # unsorted
    # Ties stay on NCCL.
    assert V.crossover(sizes, [10, 10, 10], [10, 10, 10]) == {"above": 16 * MIB}


def test_crossover_agreement():
    ok, text = V.crossover_ok({"bytes": 1.3 * MIB}, {"bytes": 2.5 * MIB})
    assert ok and "1.92x apart" in text
    assert not V.crossover_ok({"bytes": 1.0 * MIB}, {"bytes": 2.5 * MIB})[0]
    assert V.crossover_ok({"bytes": 0.3 * MIB}, {"below": 0.25 * MIB})[0]  # within 2x of the bound
    assert V.crossover_ok({"bytes": 0.1 * MIB}, {"below": 0.25 * MIB})[0]  # on the bound's side
    assert not V.crossover_ok({"bytes": 0.6 * MIB}, {"below": 0.25 * MIB})[0]
    assert V.crossover_ok({"above": 1024 * MIB}, {"above": 256 * MIB})[0]
    assert not V.crossover_ok({"bytes": 64 * MIB}, {"above": 256 * MIB})[0]


def test_checks_pass_and_fail():
    rows = V.checks({"all_gather/nccl": 9.0, "all_gather/ce": 16.0},
                    {"all_gather": {"predicted": {"bytes": 1.3 * MIB}, "measured": {"bytes": 3 * MIB}}},
                    [{"op": "all_gather", "backend": "nccl", "compute": "gemm", "predicted_pct": 20.6, "measured_pct": 24.0},
                     {"op": "all_gather", "backend": "ce", "compute": "memory_bound", "predicted_pct": 18.0,
                      "measured_pct": 24.0},
                     {"op": "reduce_scatter", "backend": "ce", "compute": "gemm", "predicted_pct": 9.0,
                      "measured_pct": None}])
    verdict = {r["check"]: r["pass"] for r in rows}
    assert verdict == {"median |error| all_gather/nccl": True, "median |error| all_gather/ce": False,
                       "NCCL/CE crossover all_gather": False,
                       "gemm slowdown beside all_gather/nccl": True,
                       "memory_bound slowdown beside all_gather/ce": False,
                       "gemm slowdown beside reduce_scatter/ce": None}  # not measured: shown as n/a
    # Expected targets without numbers are listed as n/a too, never dropped.
    rows = V.checks({}, {}, [], expected=["reduce_scatter/ce"], expected_ops=["reduce_scatter"])
    assert [(r["check"], r["pass"]) for r in rows] == [("median |error| reduce_scatter/ce", None),
                                                       ("NCCL/CE crossover reduce_scatter", None)]


def test_score_and_report_from_the_model(tmp_path):
    p = profiles.load("h200-sxm")
    sizes = [int(x * MIB) for x in (0.25, 0.5, 1, 2, 4, 16, 64, 256)]
    main = [int(x * MIB) for x in (1, 4, 16, 64, 256)]
    slow = [{"op": op, "backend": b, "compute": c, "bytes_per_rank": 256 * MIB, "measured_pct": 21.0 if b == "nccl" else 2.0}
            for op in V.OPS for b in V.BACKENDS for c in V.COMPUTES]
    pred = V.predict(p, 2, sizes, slow)
    measured = {k: (1.1 * v if v else None) for k, v in pred["times"].items()}
    measured[("reduce_scatter", "ce", 4 * MIB)] = None  # n/a rows are shown, not scored
    sc = V.score("h200-sxm", pred, measured, sizes, main)
    assert sc["median_abs_error_pct"]["all_gather/nccl"] == pytest.approx(100 / 11, rel=1e-6)
    assert sc["crossovers"]["all_gather"]["predicted"]["bytes"] == pytest.approx(
        sc["crossovers"]["all_gather"]["measured"]["bytes"], rel=0.1)
    report = V.format_report(sc)
    assert "PASS  median |error| all_gather/nccl: 9.1%" in report
    assert "(crossover only)" in report and "n/a" in report
    json.dumps(sc)  # goes into validation.json as is
    # The fallback PNG writer (used when matplotlib is not importable) writes a valid PNG.
    path = tmp_path / "v.png"
    V.plot_fallback(str(path), sc, pred)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    idat_len = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + idat_len])
    assert len(raw) == h * (1 + 3 * w)
    assert len(set(raw[1:3 * w * h:997])) > 2  # something was drawn


def test_dense_sizes():
    d = V.dense_sizes(MIB, 4 * MIB, per_octave=2)
    assert [x / MIB for x in d] == pytest.approx([1, math.sqrt(2), 2, 2 * math.sqrt(2), 4])


def test_flex_attention_efficiency_is_kept_and_said(base):
    """calibrate runs no flex attention: the base's efficiency.flex_attention / _backward stay, and the notes say so."""
    prof, notes = calibrate.build_profile(base, synthetic())
    for key in ("flex_attention", "flex_attention_backward"):
        assert prof["efficiency"].get(key) == base["efficiency"].get(key)
    if "flex_attention" in base["efficiency"]:
        assert any("efficiency.flex_attention" in n for n in notes)


def test_kernel_times_are_split_per_call_at_the_head_starts():
    """The grid's kernel timing (calibrate/timing.py kernel_us_per_call): a trace of two functions run twice each, each
    behind a head start (torch.cuda._sleep's kernel), split into per-call sums; copies and memsets are not the op's
    kernels; a trace that does not split evenly is refused, not misread."""
    from ce_overlap.calibrate.timing import SLEEP_KERNEL, NotAvailable, kernel_us_per_call

    sleep = f"at::cuda::(anonymous namespace)::{SLEEP_KERNEL}(long)"
    trace = [(0, 500.0, sleep), (501, 3.0, "gemm"), (505, 4.0, "gemm"),            # function 0: one kernel a call
             (600, 500.0, sleep), (1101, 1.0, "fused_a"), (1102, 2.0, "fused_b"),   # function 1: two a call
             (1104.5, 0.5, "Memset (Device)"), (1105, 1.5, "fused_a"), (1107, 2.5, "fused_b")]
    assert kernel_us_per_call(list(reversed(trace)), 2, 2) == [[3.0, 4.0], [3.0, 4.0]]
    with pytest.raises(NotAvailable, match="function 1 ran 3 kernels in 2 calls"):
        kernel_us_per_call(trace[:-1], 2, 2)
    with pytest.raises(NotAvailable, match="1 head starts in the trace for 2 functions"):
        kernel_us_per_call(trace[:3], 2, 2)
