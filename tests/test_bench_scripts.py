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


# Every runnable script in bench/ (bench/README.md lists them); the collectives' subcommands are checked in-process.
SCRIPTS = ["collectives.py", "train.py", "step_prediction.py", "plot_train.py", "cost_model_validation.py",
           "capture_speed.py", "capture_devices.py", "plan_speed.py", "fault_repeats.py", "pipeline.py", "repro_nccl_unbatched_p2p.py", "timeline.py",
           "torchtitan_fsdp2.py", "copy_timeline.py", "clocks.py", "ce_ops.py", "tp_predictions.py",
           "node_predictions.py", "compute_models.py", "fit_shapes.py", "fit_host.py", "repredict.py", "wrapper_profile.py"]
SUBCOMMANDS = ["all-gather", "reduce-scatter", "all-to-all", "broadcast", "all", "p2p", "overlap", "probe"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_imports_and_parses_help(script):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower()


def test_the_runnable_scripts_are_the_listed_ones():
    """bench/ has these entry points and no other runnable script (modules imported by them start with '_')."""
    runnable = sorted(f for f in os.listdir(BENCH) if f.endswith(".py") and not f.startswith("_"))
    assert runnable == sorted(SCRIPTS)


def test_tp_predictions_table_from_its_json_and_its_bad_degrees(tmp_path, capsys):
    """bench/tp_predictions.py: the table again from the rows a run wrote (tokens/s/GPU: batch x seq / TP degree per GPU
    and step), and a TP degree that does not divide the world is refused before any capture."""
    import tp_predictions

    row = {"model": "m", "world_size": 4, "tp": 2, "data_parallel": 2, "seq_len": 1000, "batch": 2,
           "predicted_step_ms": {"fsdp2+tp": 120.0, "fsdp2+tp+async-tp": 100.0, "ce_overlap+tp": 80.0,
                                 "no-comm+tp": 70.0}, "ce_overlap_vs_best_fsdp2": 1.25, "tp_comm_ms": 9.5,
           "async_tp_fused_ops": 3, "fsdp_buckets_sharing_nvlink": 1}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [row]}))
    assert tp_predictions.main(["--from-json", str(path)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == ("| m | 4 | 2 x 2 | 120.0 | 100.0 | 80.0 | 70.0 | 1.250x | 10,000, 12,500 | 9.5 | 3 | 1 |")
    with pytest.raises(SystemExit):
        tp_predictions.main(["--world-size", "6", "--tp", "4"])
    assert "each degree must divide --world-size 6" in capsys.readouterr().err


def test_node_predictions_table_from_its_json_and_its_bad_counts(tmp_path, capsys):
    """bench/node_predictions.py: the table again from the rows a run wrote (a mode that does not apply is "-", the
    best mode named against flat FSDP on NCCL), and a node count below 1 is refused before any capture."""
    import node_predictions

    row = {"model": "m", "nodes": 2, "gpus_per_node": 8, "world_size": 16, "seq_len": 1000, "batch": 1,
           "predicted_step_ms": {"fsdp": 120.0, "fsdp-hierarchical": 125.0, "fsdp-ce_overlap": 119.0, "hsdp": 130.0,
                                 "hsdp-ce_overlap": 100.0, "no-comm": 90.0}}
    one = {**row, "nodes": 1, "world_size": 8, "predicted_step_ms": {"fsdp": 110.0, "fsdp-hierarchical": None,
                                                                      "fsdp-ce_overlap": 100.0, "no-comm": 90.0}}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [one, row]}))
    assert node_predictions.main(["--from-json", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "| m | 1 x 8 | 110.0 | - | 100.0 | - | - | 90.0 | FSDP, ce_overlap, 1.100x |"
    assert lines[-1] == "| m | 2 x 8 | 120.0 | 125.0 | 119.0 | 130.0 | 100.0 | 90.0 | HSDP, CE inside nodes, 1.200x |"
    with pytest.raises(SystemExit):
        node_predictions.main(["--nodes", "0,2"])
    assert "--nodes and --gpus-per-node must be >= 1" in capsys.readouterr().err


def _collectives(argv, capsys) -> tuple[int, str, str]:
    """bench/collectives.py's main in this process: (exit code, stdout, stderr)."""
    import collectives

    try:
        rc = collectives.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_collectives_subcommand_parses_help(sub, capsys):
    rc, out, _ = _collectives([sub, "--help"], capsys)
    assert rc == 0 and f"usage: bench/collectives.py {sub}" in out and "--out" in out


@pytest.mark.parametrize("script,flag,value", [("collectives.py overlap", "--sustain-ms", "-1"),
                                                ("collectives.py probe", "--sustain-gemms", "many")])
def test_sustained_measurement_flags_reject_bad_values(script, flag, value):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script.split()[0]), *script.split()[1:], flag, value],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"argument {flag}: expected a" in proc.stderr and ">= 0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv,names", [
    (["all-reduce"], ["invalid choice: 'all-reduce'", "all-gather", "probe"]),
    (["all-gather", "--bogus"], ["unrecognized arguments: --bogus"]),
    ([], ["required: SUBCOMMAND"]),
    (["all-gather", "-b", "lots"], ["-b/--min-bytes", "bad size 'lots'"]),
    (["p2p", "-e", "0"], ["-e/--max-bytes", "bad size '0'"]),
    (["all", "-b", "1G", "-e", "64K"], ["-b/--min-bytes 1G is larger than -e/--max-bytes 64K"]),
    (["broadcast", "-f", "1"], ["-f/--step-factor", "'1'"]),
    (["all-gather", "-n", "0"], ["-n/--iters", "'0'"]),
    (["all-gather", "--variants", "nccl,ce_magic"], ["--variants", "'ce_magic'"]),
    (["reduce-scatter", "-d", "int32"], ["-d/--dtype", "'int32'"]),
    (["all", "--colls", "all_gather,gossip"], ["--colls", "'gossip'"]),
    (["p2p", "--patterns", "ring"], ["--patterns", "'ring'"]),
    (["overlap", "--compute", "fft"], ["--compute", "'fft'"]),
    (["overlap", "-n", "2"], ["-n/--iters", ">= 3", "'2'"]),
    (["probe", "--rs-mib", "64,big"], ["--rs-mib", "'big'"]),
    (["probe", "--parts", "copy,everything"], ["--parts", "'everything'"]),
])
def test_collectives_usage_errors_are_one_line_naming_the_input(argv, names, capsys):
    rc, out, err = _collectives(argv, capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("bench/collectives.py") and "error: " in err, err
    assert all(n in err for n in names), err
    assert "Traceback" not in err


def test_collectives_one_line_error_from_the_real_process():
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "collectives.py"), "all-gather", "-b", "lots"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "bench/collectives.py all-gather: error: argument -b/--min-bytes: bad size 'lots': expected bytes with an "
        "optional K/M/G suffix (64K, 256M) (bench/collectives.py all-gather --help for usage)"]


def test_collectives_dry_run_sizes_and_variants(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("CE_OVERLAP_STAGING_MB", "CE_OVERLAP_POOL_MB", "CE_OVERLAP_TIMEOUT_S"):
        monkeypatch.delenv(k, raising=False)
    rc, out, _ = _collectives(["all-gather", "-b", "1M", "-e", "16M", "-f", "2", "--variants", "nccl,ce_staged",
                               "--dry-run"], capsys)
    assert rc == 0
    plan = json.loads(out)
    assert plan["sizes"] == [1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
    assert plan["variants"] == {"all_gather": ["nccl", "ce_staged"]}
    assert plan["pool_env"] == {"CE_OVERLAP_STAGING_MB": "16", "CE_OVERLAP_POOL_MB": str(3 * 16 + 64),
                                "CE_OVERLAP_TIMEOUT_S": "30"}
    # bf16 only: a reduce-scatter of int32 is left out of `all` (it says so when run), the rest stays.
    rc, out, _ = _collectives(["all", "-d", "int32", "--dry-run"], capsys)
    assert rc == 0 and list(json.loads(out)["variants"]) == ["all_gather", "all_to_all", "broadcast"]


LAST_2GPU_RUN = os.path.join(REPO, "bench", "results", "runtime-2026-11-24-2gpu")


@pytest.mark.parametrize("argv,recorded", [(["all"], "collectives.json"), (["p2p"], "p2p.json"),
                                           (["overlap"], "overlap.json"), (["probe"], "ce_probe.json")])
def test_collectives_defaults_match_the_last_2gpu_run(argv, recorded, capsys, monkeypatch):
    """What bench/run_device.sh's stages (default options) ask for is what the scripts of the last 2-GPU run asked
    for: the same arguments under the same JSON keys, and the same pool and timeout settings at world size 2."""
    import collectives

    monkeypatch.setenv("WORLD_SIZE", "2")
    for k in ("CE_OVERLAP_STAGING_MB", "CE_OVERLAP_POOL_MB", "CE_OVERLAP_TIMEOUT_S"):
        monkeypatch.delenv(k, raising=False)
    with open(os.path.join(LAST_2GPU_RUN, recorded)) as f:
        run = json.load(f)
    from lib import args as _args

    args = collectives.parse_args(argv + ["--out", run["args"]["out"]])
    # Defaults changed on purpose since that run: overlap's collectives per compute launch, 2 then, sized from the
    # alone times now (a fixed 2 queued paced copies far past the compute window, bench/lib/overlap.py).
    changed = {"overlap.json": {"per_launch": (2, None)}}.get(recorded, {})
    for k, (then, now) in changed.items():
        assert run["args"][k] == then and getattr(args, k) == now
        run["args"][k] = now
    assert {k: v for k, v in _args.recorded(args).items() if k in run["args"]} == run["args"]
    assert set(run["args"]) <= set(_args.recorded(args))
    rc, out, _ = _collectives(argv + ["--dry-run"], capsys)
    assert rc == 0
    want = {k: v for k, v in run["info"]["env"].items() if k.startswith("CE_OVERLAP_")}
    assert json.loads(out)["pool_env"] == want


def test_collectives_tables_from_recorded_results(capsys):
    """The tables of the sweeps, p2p and the probe, printed from the last 2-GPU run's JSON (no GPU): nccl-tests'
    columns, the variant's numbers in them, the summary's ratio."""
    from lib import ce_variants as V
    from lib import p2p as _p2p
    from lib import probe as _probe
    from lib import sweep as _sweep

    with open(os.path.join(LAST_2GPU_RUN, "collectives.json")) as f:
        rows = [r for r in json.load(f)["results"] if r["coll"] == "reduce_scatter"]
    sizes = sorted({r["bytes_per_rank"] for r in rows})
    _sweep.print_tables("reduce_scatter", V.RS_VARIANTS, V.RS_HELP, sizes, rows)
    text = capsys.readouterr().out
    assert "#  size(B/rank)        count      type    time(us)  algbw(GB/s)  busbw(GB/s)   #wrong" in text
    assert "      268435456    134217728      bf16      936.93       573.01       286.51        0" in text
    assert "   268435456              245.7              286.5              284.1              194.7          1.17" in text
    with open(os.path.join(LAST_2GPU_RUN, "p2p.json")) as f:
        rows = json.load(f)["results"]
    _p2p.print_tables("one_way", _p2p.VARIANTS, sorted({r["bytes"] for r in rows}), rows)
    text = capsys.readouterr().out
    assert "      268435456    268435456     uint8      710.61       377.75       377.75        0" in text
    with open(os.path.join(LAST_2GPU_RUN, "ce_probe.json")) as f:
        probe = json.load(f)
    _probe._print_rows("# (c)", probe["reduce_scatter"], 2)
    text = capsys.readouterr().out
    assert text.count("\n") == 3 + len(probe["reduce_scatter"]) + 2 and "ce sms=32 round=32M" in text


def test_sweep_runs_every_ce_variant_once_per_tuning():
    import argparse

    from lib import sweep as _sweep

    args = argparse.Namespace(peer_lanes=[1, 0], bcast_segments=[0, 2])
    runs = _sweep.tuned_variants("broadcast", ["nccl", "ce_staged"], args)
    assert runs[0] == ("nccl", "nccl", {})  # NCCL once, untuned
    assert [label for label, _, _ in runs[1:]] == ["ce_staged@lanes=1,segments=0", "ce_staged@lanes=1,segments=2",
                                                    "ce_staged@lanes=0,segments=0", "ce_staged@lanes=0,segments=2"]
    assert runs[-1][1:] == ("ce_staged", {"peer_lanes": 0, "bcast_segments": 2})
    # Segments apply to broadcasts only; no knob given: the runtime's own, unlabelled.
    assert [r[0] for r in _sweep.tuned_variants("all_gather", ["ce_staged"], args)] == [
        "ce_staged@lanes=1", "ce_staged@lanes=0"]
    # Every combination of the knobs, the first knob outermost.
    both = argparse.Namespace(peer_lanes=[1, 0], peer_sync=[0, 2])
    assert [r[0] for r in _sweep.tuned_variants("all_to_all", ["ce_symmetric"], both)] == [
        "ce_symmetric@lanes=1,sync=0", "ce_symmetric@lanes=1,sync=2", "ce_symmetric@lanes=0,sync=0",
        "ce_symmetric@lanes=0,sync=2"]
    assert _sweep.tuned_variants("all_to_all", ["ce_symmetric"], both)[1][2] == {"peer_lanes": 1, "peer_sync": 2}
    none = argparse.Namespace(peer_lanes=None)
    assert _sweep.tuned_variants("all_gather", ["nccl", "ce_symmetric"], none) == [
        ("nccl", "nccl", {}), ("ce_symmetric", "ce_symmetric", {})]
    # The dry-run plan keeps the base variants and lists the labelled runs beside them.
    plan = _sweep.plan(argparse.Namespace(subcommand="broadcast", colls="broadcast", variants="nccl,ce_staged",
                                          dtype="bf16", min="16M", max="16M", factor=4, peer_lanes=[0],
                                          bcast_segments=None))
    assert plan["variants"] == {"broadcast": ["nccl", "ce_staged"]}
    assert plan["runs"] == {"broadcast": ["nccl", "ce_staged@lanes=0"]}


def test_copy_timeline_summarizes_copies_per_stream(tmp_path, capsys):
    import gzip

    from lib import sweep as _sweep
    import copy_timeline

    def copy(ts, dur, nbytes, stream):
        return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": ts, "dur": dur,
                "args": {"stream": stream, "bytes": nbytes}}

    events = [copy(0, 100, 32 << 20, 7), copy(110, 200, 32 << 20, 7), copy(330, 100, 32 << 20, 7),  # gaps 10, 20
              copy(100, 2, 32, 7), copy(105, 4, 32, 7),  # two signal copies
              {"ph": "X", "cat": "kernel", "name": "pace", "ts": 50, "dur": 1, "args": {"stream": 9}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 999}]  # not GPU work: ignored
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = copy_timeline.summarize(copy_timeline.load(str(path)))
    assert summary["span_us"] == 430
    s7, s9 = summary["streams"]["7"], summary["streams"]["9"]
    assert s7["large_copies"] == 3 and s7["large_bytes"] == 96 << 20 and s7["large_busy_us"] == 400
    assert s7["large_median_gbps"] == pytest.approx((32 << 20) / 100 / 1e3)  # bytes / us / 1e3 = GB/s
    assert (s7["large_gap_median_us"], s7["large_gap_max_us"]) == (15, 20)
    assert (s7["signal_copies"], s7["signal_median_us"]) == (2, 3)
    assert s9["kernels"] == 1 and s9["kernel_names"] == {"pace": 1} and s9["large_copies"] == 0
    assert copy_timeline.main([str(path)]) == 0 and "span 0.430 ms" in capsys.readouterr().out
    assert copy_timeline.main([str(tmp_path / "missing.json")]) == 2
    # The sweep's trace names are file-name-safe.
    name = os.path.basename(_sweep.trace_path("d", "all_gather", "ce_symm_push@lanes=1,sync=2", 1 << 24, True, 3))
    assert name == "all_gather-ce_symm_push_lanes1_sync2-16777216-ahead-rank3.json.gz"


def test_size_sweep_is_nccl_tests_style():
    from lib import common as C

    assert C.size_sweep("64K", "1M", 4) == [65536, 262144, 1048576]
    assert C.size_sweep("1G", "1G", 4) == [1 << 30]
    from ce_overlap.errors import CeOverlapError

    with pytest.raises(CeOverlapError, match="bad size"):
        C.size_sweep("lots", "1G", 4)


def test_step_model_prices_the_host_and_takes_the_larger_step():
    """With the profile's host section the step is the larger of the GPU's and the host's: per graph launch_us x
    kernels + graph_input_us x inputs + collective_us x the copy-engine buckets the mode issues, an NCCL collective
    (a plan's NCCL buckets, the captured ones for compile) one launch more, none for no-comm, plus step_us; FSDP2's
    modes keep their GPU step (not modelled)."""
    from ce_overlap.analyzer import step_model as sm

    plan = {"forward": {"exposed_comm_us_after": 100.0, "buckets": 3, "ce_buckets": 2},
            "backward": {"exposed_comm_us_after": 0.0, "buckets": 5, "ce_buckets": 4}}
    nccl = {name: {**p, "ce_buckets": 0} for name, p in plan.items()}
    pieces = {"optimizer_us": 1000.0, "plan": plan, "plan_nccl": nccl,
              "analyze": {"forward": {"compute_us": 3000.0, "comm_us": 500.0, "kernels": 100, "inputs": 40,
                                      "collectives": 20},
                          "backward": {"compute_us": 6000.0, "comm_us": 500.0, "kernels": 200, "inputs": 60,
                                       "collectives": 30}}}
    gpu = sm.gpu_step_ms(pieces)
    assert gpu == pytest.approx(10.1) and sm.host_step_us(pieces) is None  # no host section: the GPU's step
    assert sm.predicted_step_ms(pieces) == gpu
    pieces["host"] = {"launch_us": 20.0, "graph_input_us": 10.0, "collective_us": 50.0, "step_us": 2000.0}
    assert sm.host_step_us(pieces) == pytest.approx(2000 + 20 * (300 + 2) + 10 * 100 + 50 * 6)
    assert sm.host_step_us(pieces, "ce_overlap-nccl") == pytest.approx(2000 + 20 * (300 + 8) + 10 * 100)
    assert sm.host_step_us(pieces, "compile") == pytest.approx(2000 + 20 * (300 + 50) + 10 * 100)
    assert sm.host_step_us(pieces, "no-comm") == pytest.approx(2000 + 20 * 300 + 10 * 100)
    assert sm.predicted_step_ms(pieces) == gpu  # 9.3 ms of host under 10.1 of GPU
    pieces["host"]["launch_us"] = 40.0  # 15.38 ms of host: host-bound
    assert sm.predicted_step_ms(pieces) == pytest.approx(15.38) and sm.gpu_step_ms(pieces) == gpu
    assert sm.host_step_us(pieces, "fsdp2") is None  # FSDP2's host is other work
    assert sm.predicted_step_ms({**pieces, "plan": {}}) is None
    # A mode over another's formula takes that mode's host: across nodes, the flat FSDP over ce_overlap-nccl's.
    assert sm.predicted_step_ms(pieces, "fsdp") == sm.predicted_step_ms(pieces, "ce_overlap-nccl")


def test_step_model_pieces_add_up():
    from ce_overlap.analyzer import step_model as sm

    plan = {"forward": {"exposed_comm_us_after": 100.0, "slowdown_us": 50.0, "bucket_copy_us": 20.0},
            "backward": {"exposed_comm_us_after": 200.0, "slowdown_us": 70.0, "bucket_copy_us": 30.0}}
    nccl = {"forward": {"exposed_comm_us_after": 300.0, "slowdown_us": 150.0, "bucket_copy_us": 40.0},
            "backward": {"exposed_comm_us_after": 400.0, "slowdown_us": 170.0, "bucket_copy_us": 60.0}}
    pieces = {"optimizer_us": 1000.0,
              "analyze": {"forward": {"compute_us": 3000.0, "comm_us": 1200.0, "exposed_comm_us": 900.0},
                          "backward": {"compute_us": 6000.0, "comm_us": 1500.0, "exposed_comm_us": 700.0}},
              "plan": plan, "plan_nccl": nccl}
    assert sm.predicted_step_ms(pieces) == pytest.approx((1000 + 3000 + 170 + 6000 + 300) / 1e3)
    assert sm.predicted_step_ms(pieces, "ce_overlap") == sm.predicted_step_ms(pieces)
    # The overlap scheduler and ce_overlap-nccl: the same plan with every bucket on NCCL.
    assert sm.predicted_step_ms(pieces, "ce_overlap-nccl") == pytest.approx((1000 + 3000 + 490 + 6000 + 630) / 1e3)
    assert sm.predicted_step_ms(pieces, "compile+inductor-overlap") == sm.predicted_step_ms(pieces, "ce_overlap-nccl")
    assert sm.predicted_step_ms(pieces, "no-comm") == pytest.approx((1000 + 3000 + 6000) / 1e3)
    # The no-comm mode runs local stand-ins of the collectives (repeat / narrow copies): charged to it only.
    pieces["local_gather_us"] = {"forward": 400.0, "backward": 250.0}
    assert sm.predicted_step_ms(pieces, "no-comm") == pytest.approx((1000 + 3000 + 6000 + 650) / 1e3)
    assert sm.predicted_step_ms(pieces) == pytest.approx((1000 + 3000 + 170 + 6000 + 300) / 1e3)
    # compile (no overlap scheduler): every collective's whole time on the step, in the captured order.
    assert sm.predicted_step_ms(pieces, "compile") == pytest.approx((1000 + 3000 + 1200 + 6000 + 1500) / 1e3)
    # Pieces without what a mode needs: None, never a made-up number (here: FSDP2's copies).
    assert sm.predicted_step_ms(pieces, "fsdp2") is None and sm.predicted_step_ms(pieces, "fsdp2-ce") is None
    # FSDP2: compute + its plan's exposure + that plan's slowdown x 4/3 (fp32 reduce-scatters) + its copies + optimizer.
    pieces["fsdp2_copy_us"] = sm.fsdp2_copy_us({"all_gather": 4e9, "reduce_scatter": 2e9}, 4800)
    assert pieces["fsdp2_copy_us"]["fsdp2"] == pytest.approx((2 * 4e9 + 3 * 2e9) / (4800e3 * 0.45))
    assert pieces["fsdp2_copy_us"]["fsdp2-ce"] == pytest.approx(2e9 / (4800e3 * 0.45))
    assert sm.predicted_step_ms(pieces, "fsdp2") == pytest.approx(
        (1000 + 3000 + 6000 + 700 + 320 * 4 / 3 + pieces["fsdp2_copy_us"]["fsdp2"]) / 1e3)
    assert sm.predicted_step_ms(pieces, "fsdp2-ce") == pytest.approx(
        (1000 + 3000 + 6000 + 300 + 120 * 4 / 3 + pieces["fsdp2_copy_us"]["fsdp2-ce"]) / 1e3)
    # Their eager loss (F.cross_entropy on fp32 logits outside the compiled blocks): 32 B per logit more than the
    # captured step's fused loss, at 0.55 of the HBM peak, in both FSDP2 modes and no other.
    in_graph = sm.predicted_step_ms(pieces, "ce_overlap")
    pieces["fsdp2_loss_us"] = sm.fsdp2_eager_loss_us(4096 * 128256, 4800)
    assert pieces["fsdp2_loss_us"] == pytest.approx(4096 * 128256 * 32 / (4800e3 * 0.55))
    assert sm.predicted_step_ms(pieces, "fsdp2") == pytest.approx(
        (1000 + 3000 + 6000 + 700 + 320 * 4 / 3 + pieces["fsdp2_copy_us"]["fsdp2"] + pieces["fsdp2_loss_us"]) / 1e3)
    assert sm.predicted_step_ms(pieces, "ce_overlap") == in_graph
    assert sm.fsdp2_eager_loss_us(0, 4800) == 0.0
    assert sm.predicted_step_ms({**pieces, "plan": {}}, "fsdp2-ce") is None
    assert sm.predicted_step_ms(pieces, "fsdp2-ce-hooks") is None  # not modelled
    assert sm.predicted_step_ms({**pieces, "plan_nccl": {}}, "ce_overlap-nccl") is None
    assert sm.predicted_step_ms({}) is None
    # AdamW over fp32 master shards moves 28 bytes per local parameter (one constant with ce-overlap calibrate's).
    from ce_overlap.calibrate import ADAMW_BYTES_PER_PARAM

    assert sm.ADAMW_BYTES_PER_PARAM is ADAMW_BYTES_PER_PARAM == 7 * 4
    assert sm.optimizer_us(1001, 8, 1.0) == 28 * 126


def test_local_gather_bytes_follow_the_no_comm_stand_ins(tiny_ir):
    """_LocalGather's stand-ins as Inductor runs them (the no-comm traces: `..._to_copy_repeat`, `..._to_copy_slice`):
    each all-gather's repeat fused into the cast that produces its shard, which writes (world - 1) x shard bytes more,
    no kernel of its own; each reduce-scatter's narrow fused into the cast that reads the gradient, nothing more. A
    stand-in without a pointwise neighbour is a kernel: repeat reads the shard and writes world x shard, narrow reads
    and writes this rank's rows."""
    import copy

    from ce_overlap.analyzer.step_model import collectives_by_graph, local_gather_us

    world, params = 8, tiny_ir.meta["num_params"]
    graphs = tiny_ir.to_dict()["graphs"]
    got, kernels = local_gather_us(graphs, 1.0, kernel_gap_us=3.0)
    # The forward casts every parameter's shard to bf16 and gathers it once: (world - 1) / world x 2 bytes per
    # parameter written more, up to the shard padding, and no stand-in kernel anywhere.
    assert got["forward"] == pytest.approx((world - 1) / world * 2 * params, rel=0.05)
    assert kernels == 0 and got["backward"] > 0  # the backward's re-gathers; its narrows are fused
    colls = [c for cs in collectives_by_graph(graphs).values() for c in cs]
    assert sum(got.values()) == pytest.approx(sum((c["group_size"] - 1) * c["bytes"] for c in colls
                                                  if c["type"] == "all_gather"))

    # Without pointwise neighbours (the shards gathered as they are, the reduce-scatters' results read by a GEMM):
    # every stand-in is a kernel of its own and pays the gap between kernels once.
    alone = copy.deepcopy(graphs)
    for g in alone:
        for n in g["nodes"]:
            if n["kind"] == "compute" and not n["flops"]:
                n["flops"] = 1
    got, kernels = local_gather_us(alone, 1.0, kernel_gap_us=3.0)
    colls = [c for cs in collectives_by_graph(alone).values() for c in cs]
    assert kernels == sum(c["type"] in ("all_gather", "reduce_scatter") for c in colls) > 0
    assert sum(got.values()) == pytest.approx(
        sum(c["bytes"] * (1 + c["group_size"]) for c in colls if c["type"] == "all_gather")
        + sum(2 * c["bytes"] // c["group_size"] for c in colls if c["type"] == "reduce_scatter") + 3.0 * kernels)
    # At world 1 the stand-ins are no copies: nothing to charge.
    for g in alone:
        for n in g["nodes"]:
            if n["kind"] == "collective":
                n["collective"]["group_size"] = 1
    assert local_gather_us(alone, 1.0, kernel_gap_us=3.0) == ({g["name"]: 0.0 for g in alone}, 0)


def test_kernel_kinds_hold_the_models_kernels_against_a_traces_by_kind(tiny_ir):
    """bench/lib/kernel_kinds.py (step_prediction.py --trace): each side's kernels sorted into kinds by name, per step,
    and the rate a memory-bound kind's measured kernels reached on the bytes the model counts."""
    import ce_overlap
    from lib.kernel_kinds import table
    from ce_overlap.kernel_kinds import model_kind, time_by_kind, trace_kind

    assert trace_kind("triton_poi_fused__to_copy_3") == trace_kind("triton_poi_fused__to_copy_repeat_1") == "cast"
    assert trace_kind("triton_red_fused__fused_rms_norm__unsafe_view_add_6") == "RMSNorm + residual"
    assert trace_kind("triton_red_fused__log_softmax__to_copy_prepare_softmax_online_0") == "loss"
    assert trace_kind("triton_poi_fused__to_copy_add_cat_mul_neg_slice_4") == "RoPE"
    assert trace_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coo") == "GEMM"
    assert trace_kind("triton_poi_fused_clone_squeeze_sum_transpose_view_2") == "other fused"
    for left_out in ("Memcpy PtoP (Device -> Device)", "ncclDevKernel_AllGather_RING_LL(x)",
                     "void at::native::multi_tensor_apply_kernel<adam>"):
        assert trace_kind(left_out) is None
    assert model_kind({"ops": ["aten.mm.default"], "fused": False}) == "GEMM"
    assert model_kind({"ops": ["prims.convert_element_type.default"], "fused": True}) == "cast"
    assert model_kind({"ops": ["aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.rsqrt.default"], "fused": True}) == \
        "RMSNorm + residual"
    assert model_kind({"ops": ["aten.sigmoid.default", "aten.mul.Tensor"], "fused": True}) == "SiLU"

    # The model's kernels of a real capture: every graph's kernels, their times the analysis's compute.
    model = [k for name in tiny_ir.graph_names for k in ce_overlap.ir.kernels(tiny_ir, name, "h200-sxm")]
    report = ce_overlap.ir.analyze(tiny_ir, "h200-sxm")
    assert sum(k["us"] for k in model) == pytest.approx(sum(g["compute_us"] for g in report["graphs"]))
    assert {model_kind(k) for k in model} >= {"GEMM", "cast"}
    casts = [k for k in model if model_kind(k) == "cast"]
    gb = sum(k["bytes"] for k in casts) / 1e9
    # Two steps of a trace whose casts took 1 ms per step: the rate is the casts' bytes per ms of the HBM peak.
    trace = [{"name": "triton_poi_fused__to_copy_0", "dur": 500.0}] * 4 + \
            [{"name": "Memcpy DtoD (Device -> Device)", "dur": 9999.0}]
    rows = {r["kind"]: r for r in table(model, trace, steps=2, hbm_gbps=4800.0)}
    assert rows["cast"]["measured_ms"] == pytest.approx(1.0) and rows["cast"]["measured_kernels"] == 2
    assert rows["cast"]["rate"] == pytest.approx(gb / 1.0 * 1e3 / 4800.0)
    assert rows["cast"]["model_kernels"] == len(casts)
    assert rows["GEMM"]["rate"] is None and rows["GEMM"]["measured_ms"] == 0.0
    assert "copy" not in rows  # copies are the step model's, not a kernel kind
    # The rated kinds together: efficiency.fused_memory on this trace (here the casts alone).
    from lib.kernel_kinds import fused_rate

    fused = fused_rate(list(rows.values()), 4800.0)
    assert fused["gb"] == pytest.approx(gb) and fused["rate"] == pytest.approx(rows["cast"]["rate"])
    assert fused_rate([rows["GEMM"]], 4800.0) is None
    # calibrate's compiled step records its time by kind the same way (activities: start, end, name, stream).
    acts = [(0.0, 30.0, "triton_red_fused__fused_rms_norm_view_6", 7), (30.0, 40.0, "triton_poi_fused__to_copy_0", 7),
            (40.0, 90.0, "Memcpy DtoD (Device -> Device)", 9), (90.0, 110.0, "triton_red_fused__fused_rms_norm_3", 7)]
    assert time_by_kind(acts, steps=2) == {"RMSNorm + residual": 25.0, "cast": 5.0}
    # A missing trace or no steps: one line naming the option, exit 2, before any capture.
    for bad, says in ((["--trace", "/nonexistent.json.gz"], "--trace: no such file"),
                      (["--trace", __file__, "--trace-steps", "0"], "--trace-steps: must be at least 1")):
        proc = subprocess.run([sys.executable, os.path.join(BENCH, "step_prediction.py"), "--layers", "2",
                               "--world-size", "2", "--profile", "h200-sxm", *bad], capture_output=True, text=True)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr


def test_fsdp2_modes_are_predicted_from_a_capture_sharded_as_fsdp2_shards():
    """train.py's FSDP2 modes gather the embedding table (no vocabulary-parallel lookup) and keep [norm, output] as
    --fsdp2-wrap says: with the lookup on, predict_steps prices them on a second capture that has the table's
    all-gather, and the in-graph modes on the lookup's; without it one capture serves both."""
    import argparse

    import train
    from ce_overlap.analyzer.step_model import predicted_step_ms, step_model

    args = argparse.Namespace(model="llama3-tiny", layers=2, seq_len=64, batch=1, gqa="expand",
                              vocab_parallel_embeddings=True, in_graph_wrap="torchtitan", fsdp2_wrap="torchtitan")

    def all_gather_bytes(ir):
        return sum(n["collective"]["bytes"] for g in ir.to_dict()["graphs"] for n in g["nodes"]
                   if n.get("kind") == "collective" and n["collective"]["type"] == "all_gather")

    lookup, gathered = train.capture_step(args, 2), train.capture_step(args, 2, fsdp2=True)
    assert all_gather_bytes(gathered) > all_gather_bytes(lookup)  # the table gathered
    assert not train.fsdp2_shards_alike(args)
    pieces, step_ms = train.predict_steps(args, 2, "h200-sxm", ir=lookup)
    assert step_ms["ce_overlap"] == pytest.approx(predicted_step_ms(pieces, "ce_overlap"))
    fsdp2 = step_model(gathered, "h200-sxm", 2, loss_logits=train.loss_logits(args))
    assert step_ms["fsdp2"] == pytest.approx(predicted_step_ms(fsdp2, "fsdp2"))
    assert step_ms["fsdp2"] != pytest.approx(predicted_step_ms(pieces, "fsdp2"), rel=1e-9)  # not the lookup's
    args.vocab_parallel_embeddings = False
    assert train.fsdp2_shards_alike(args)


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
    from lib import kernel_profile as _kernel_profile

    assert _kernel_profile.idle_between is T.idle_between  # one implementation (train.py's kernel profile)


def test_kernel_classes_and_the_class_comparison():
    """train.py's kernel classes (by name, as torch.profiler reports them) and step_prediction.py's pairing of them
    with the analysis report's compute_by_class_us."""
    from lib import kernel_profile as _kernel_profile
    import step_prediction

    for name, cls in (("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "gemm"), ("triton_tem_fused_mm_3", "gemm"),
                      ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16", "attention"),
                      ("flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
                      ("triton_poi_fused__to_copy_7", "fused"), ("Memcpy DtoD (Device -> Device)", "copy"),
                      ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>>", "optimizer"),
                      ("ncclDevKernel_AllGather_RING_LL", "collective"),
                      ("void at::native::vectorized_elementwise_kernel<4>", "other"),
                      ("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel<>", "copy_kernel"),
                      ("void at::native::(anonymous namespace)::chunk_cat_cuda_kernel<float, c10::BFloat16>",
                       "copy_kernel"),
                      ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<2>, "
                       "CopyFunctor<c10::BFloat16, float, 2, 1, 1>>", "copy_kernel")):
        assert _kernel_profile.kernel_class(name) == cls, name
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


def _fake_launch(modes, timeout_s, env, ranks=2):
    """Stands in for one torchrun launch of the GPU worker (the repeat loop's bookkeeping is under test, not CUDA)."""
    ok = modes != "mismatch"
    return {"modes": modes, "ranks": ranks, "rc": 0 if ok else 1, "hang": False, "wall_s": 0.1, "ok": ok,
            "failed_lines": [], "raised": [], "tail": "" if ok else "[rank 0] FAILED: made up"}


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
def slow(modes, timeout_s, env, ranks=2):
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
    from lib import common as C

    s = C.ClockSampler(period_s=0.001)
    ran = []
    with s:
        ran.append(1)
    assert ran == [1]
    if s.error:
        assert s.stats() == {}


def test_fed_timing_keeps_both_queues_short_and_times_every_compute(monkeypatch):
    """time_beside_fed's loop on a fake GPU whose work completes some host steps after it is enqueued: the loop ends,
    every compute is issued and timed, side ops ran beside them, and the duty and window come back."""
    import contextlib
    import types

    from lib import common as C

    clock = {"t": 0}

    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = clock["t"] + 3  # done three host steps later

        def query(self):
            clock["t"] += 1
            return self.at is not None and clock["t"] >= self.at

        def elapsed_time(self, other):
            return float(other.at - self.at)

    class Stream:
        def wait_stream(self, other):
            pass

    fake_cuda = types.SimpleNamespace(Event=Event, Stream=Stream, current_stream=lambda: Stream(),
                                      stream=lambda s: contextlib.nullcontext())
    monkeypatch.setattr(C.torch, "cuda", fake_cuda)
    monkeypatch.setattr(C, "max_over_ranks", lambda x: x)
    monkeypatch.setattr(C.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + 1))
    calls = {"compute": 0, "side": 0}

    def compute():
        calls["compute"] += 1
        clock["t"] += 1

    def side():
        calls["side"] += 1

    info: dict = {}
    ms, side_ms = C.time_beside_fed(compute, side, iters=12, warmup=2, side_ops=7, settle=lambda: None, info=info,
                                    side_depth=2, compute_depth=4)
    assert calls["compute"] == 12 + 2 and calls["side"] == 7  # the same count on every rank, whatever the timing
    assert ms > 0 and side_ms > 0 and info["duty_pct"] > 0 and len(info["window"]) == 2
    # The interleaved form: a lead-in, then 1.5 side ops per compute (3 per 2), its window from a polling thread.
    calls.update(compute=0, side=0)
    info = {}
    ms, side_ms = C.time_beside(compute, side, iters=12, warmup=2, per_launch=1.5, lead_in=3, settle=lambda: None,
                                info=info)
    assert calls["compute"] == 14 and calls["side"] == 3 + 18 and ms > 0 and len(info["window"]) == 2


def test_clock_sampler_stats_keep_the_window_and_count_the_clock_events():
    """stats(window) keeps only the samples taken while the compute ran (paced copies outlasting it would otherwise
    set the median clock and power), and says in what share of them NVML flagged the power cap or a slowdown."""
    from lib import common as C

    s = C.ClockSampler(period_s=0.001)
    # (time, SM MHz, W, reasons): a power-capped GEMM from t=1 to t=2, then the copies alone at full clock
    s.samples = [(0.5, 1980, 120, 0x1), (1.1, 1470, 699, 0x4), (1.5, 1485, 700, 0x4), (1.9, 1500, 690, 0x4 | 0x20),
                 (2.5, 1980, 280, 0), (3.0, 1980, 275, 0)]
    inside = s.stats([1.0, 2.0])
    assert (inside["samples"], inside["sm_clock_mhz"], inside["power_w"]) == (3, 1485, 699)
    assert inside["power_cap_pct"] == 100.0 and round(inside["sw_thermal_pct"], 1) == 33.3
    assert inside["hw_slowdown_pct"] == 0.0
    every = s.stats()
    assert every["samples"] == 6 and every["sm_clock_mhz"] == 1740 and every["power_cap_pct"] == 50.0
    assert s.stats([5.0, 6.0]) == {}


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
    for bad in ("-1", "nan"):  # the kernel profile's lead: seconds of unrecorded steps, never negative
        with pytest.raises(SystemExit):
            train.parse_args(["--kernel-profile-lead-s", bad, "--device", "cpu"])
    assert "--kernel-profile-lead-s" in train.child_argv(train.parse_args(["--device", "cpu"]))  # children get it
    mode = lambda name, losses: types.SimpleNamespace(mode=name, losses=losses)  # noqa: E731
    # One bf16 spacing at 12.5 is 2^-7 * 12.5 ~= 0.098: 0.05 apart agrees, 0.25 apart does not.
    ok, why = train.losses_agree([mode("a", [12.5, 12.4]), mode("b", [12.5, 12.45])])
    assert ok, why
    ok, why = train.losses_agree([mode("a", [12.5, 12.4]), mode("b", [12.5, 12.65]), mode("c", [12.5, 12.4])])
    assert not ok and "step 2" in why and "b 12.6500" in why


# The device drivers (bench/*_device.sh, bench/device_session.sh), dry: CE_DEVICE_DRY_RUN=1 logs every stage's
# command and runs none, so the commands the knobs make can be checked here.

def _driver(script: str, out, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "PYTHON" and not k.startswith(
        ("CE_DEVICE_", "CE_TRAIN_", "CE_SESSION_", "CE_COMPUTE_", "CE_FSDP2_", "CE_FS_"))}
    return subprocess.run(["bash", os.path.join(BENCH, script)], capture_output=True, text=True, timeout=120,
                          env={**clean, "CE_DEVICE_DRY_RUN": "1", "CE_DEVICE_PACK": "0", "OUT": str(out), **env})


def _stage_commands(out) -> dict[str, str]:
    """stage name -> the command its log says it would run."""
    cmds = {}
    for log in sorted(out.glob("*.log")):
        first = log.read_text().splitlines()[0]
        if "(timeout" in first:
            cmds[log.stem] = first.split(") ", 1)[1]
    return cmds


def test_run_device_dry_runs_the_stages_in_order_with_the_entry_points(tmp_path):
    proc = _driver("run_device.sh", tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    summary = (tmp_path / "summary.txt").read_text().splitlines()[1:]
    assert [line.split(":")[0].strip() for line in summary] == [
        "env", "build", "collectives", "p2p", "overlap", "overlap_sustained", "gpu_tests", "backend_tests", "fsdp2-2", "fsdp2-3", "pass_gpu", "probe",
        "cpu_tests", "memcheck", "racecheck", "synccheck"]
    cmds = _stage_commands(tmp_path)
    assert cmds["collectives"] == f"torchrun2 bench/collectives.py all --out {tmp_path}/collectives.json"
    assert cmds["p2p"] == f"torchrun2 bench/collectives.py p2p --out {tmp_path}/p2p.json"
    assert cmds["overlap_sustained"] == (f"torchrun2 bench/collectives.py overlap --sustain-ms 1000 --compute gemm "
                                         f"--out {tmp_path}/overlap-sustained.json")
    assert cmds["probe"] == f"torchrun2 bench/collectives.py probe --out {tmp_path}/ce_probe.json"
    assert cmds["pass_gpu"] == (f"torchrun2 tests/pass_gpu/run_pass_gpu.py --models llama3-tiny,llama3-1b "
                                f"--out {tmp_path}/pass_gpu.json")
    # Every collectives command the driver composes parses (and plans) as the entry point sees it.
    import collectives

    for name in ("collectives", "p2p", "overlap", "overlap_sustained", "probe"):
        collectives.parse_args(cmds[name].split()[2:])


def test_driver_invocations_from_the_notes(tmp_path):
    """The exact invocations the previous sessions' notes hand on keep doing what they did."""
    out = tmp_path / "a"
    proc = _driver("run_device.sh", out, {"CE_DEVICE_BUDGET_S": "560", "CE_DEVICE_STAGES": "pass_gpu",
                                          "CE_DEVICE_PASS_MODELS": "llama3-1b", "CE_DEVICE_PASS_S": "500",
                                          "CE_DEVICE_PASS_VARIANTS": "inductor,pass-on-nccl,pass-ce-ag,pass-ce-all"})
    assert proc.returncode == 0, proc.stderr
    assert _stage_commands(out)["pass_gpu"] == (
        f"torchrun2 tests/pass_gpu/run_pass_gpu.py --models llama3-1b --variants "
        f"inductor,pass-on-nccl,pass-ce-ag,pass-ce-all --out {out}/pass_gpu.json")
    assert "pass_gpu: dry run (timeout 500s)" in (out / "summary.txt").read_text()

    out = tmp_path / "b"
    proc = _driver("run_device.sh", out, {"CE_DEVICE_BUDGET_S": "570", "CE_DEVICE_FAULTS_S": "330",
                                          "CE_DEVICE_STAGES": "collectives overlap probe faults"})
    assert proc.returncode == 0, proc.stderr
    assert list(_stage_commands(out)) == ["build", "collectives", "env", "faults", "overlap", "probe"]
    assert _stage_commands(out)["faults"] == (
        f"python3 bench/fault_repeats.py --repeats 20 --parallel 6 --out {out}/faults.json")
    assert "faults: dry run (timeout 330s)" in (out / "summary.txt").read_text()

    out = tmp_path / "c"
    proc = _driver("device_session.sh", out, {
        "CE_TRAIN_CE": "on", "CE_TRAIN_PASS_CHECK": "0", "CE_SESSION_TRAIN_S": "560", "CE_SESSION_VALIDATION_S": "1",
        "CE_TRAIN_KERNEL_PROFILE": "3", "CE_TRAIN_MODES": "compile,ce_overlap,ce_overlap-rs-kernel,no-comm"})
    assert proc.returncode == 0, proc.stderr
    train = _stage_commands(out / "train")
    assert "pass_gpu" not in train and train["train"] == (
        f"torchrun_all bench/train.py --layers 8 --seq-len 4096 --steps 25 --warmup 5 --modes "
        f"compile,ce_overlap,ce_overlap-rs-kernel,no-comm --predict --kernel-profile 3 --ce on "
        f"--out {out}/train/train.json")
    assert "train: dry run (timeout 540s)" in (out / "train" / "summary.txt").read_text()
    assert (out / "cal" / "validation.log").read_text().startswith(
        f"(dry run) timeout 1 python3 -m torch.distributed.run --standalone --nproc-per-node 2 "
        f"bench/cost_model_validation.py --out {out}/cal")
    assert (out / "all.tgz").exists() and not (out / "faults").exists()

    out = tmp_path / "d"
    proc = _driver("train_device.sh", out, {"CE_TRAIN_LAYERS": "32"})
    assert proc.returncode == 0, proc.stderr
    assert _stage_commands(out)["train"].startswith("torchrun_all bench/train.py --layers 32 --seq-len 4096")

    out = tmp_path / "d-vocab"  # the vocabulary-parallel lookup in the pass check and in every training mode
    proc = _driver("train_device.sh", out, {"CE_TRAIN_PASS_CHECK": "1", "CE_DEVICE_PASS_VOCAB_PARALLEL": "1",
                                            "CE_TRAIN_VOCAB_PARALLEL": "1", "CE_TRAIN_IN_GRAPH_WRAP": "torchtitan"})
    assert proc.returncode == 0, proc.stderr
    assert _stage_commands(out)["pass_gpu"] == (f"torchrun2 tests/pass_gpu/run_pass_gpu.py --models llama3-tiny "
                                                f"--vocab-parallel-embeddings --out {out}/pass_gpu.json")
    assert " --vocab-parallel-embeddings --in-graph-wrap torchtitan " in _stage_commands(out)["train"]

    out = tmp_path / "e"
    proc = _driver("calibrate_device.sh", out, {})
    assert proc.returncode == 0, proc.stderr
    assert list(_stage_commands(out)) == ["analyze", "build", "calibrate", "calibrate_1gpu", "env", "validation"]


def test_device_session_runs_the_faults_stage_when_given_its_seconds(tmp_path):
    proc = _driver("device_session.sh", tmp_path, {"CE_DEVICE_FAULTS_S": "180"})
    assert proc.returncode == 0, proc.stderr
    assert _stage_commands(tmp_path / "faults")["faults"].startswith("python3 bench/fault_repeats.py --repeats 20")
    assert "faults: dry run (timeout 180s)" in (tmp_path / "faults" / "summary.txt").read_text()
    train = _stage_commands(tmp_path / "train")  # the session's defaults: the pass check first, five modes
    assert train["pass_gpu"].startswith("torchrun2 tests/pass_gpu/run_pass_gpu.py --models llama3-tiny --out")
    assert "--modes compile,compile+inductor-overlap,ce_overlap,ce_overlap-rs-kernel,no-comm " in train["train"]


def test_compute_device_takes_the_training_knobs(tmp_path):
    proc = _driver("compute_device.sh", tmp_path, {"CE_TRAIN_LAYERS": "12"})
    assert proc.returncode == 0, proc.stderr
    assert "bench/train.py --layers 12 --seq-len 4096 --steps 10" in _stage_commands(tmp_path)["train_1gpu"]


@pytest.mark.parametrize("script,env,message", [
    ("compute_device.sh", {"CE_COMPUTE_LAYERS": "12"}, "CE_COMPUTE_LAYERS is now CE_TRAIN_LAYERS"),
    ("train_device.sh", {"CE_TRAIN_PASS_MODELS": "llama3-1b"}, "CE_TRAIN_PASS_MODELS is now CE_DEVICE_PASS_MODELS"),
    ("train_device.sh", {"CE_TRAIN_PASS_VARIANTS": "inductor"}, "CE_TRAIN_PASS_VARIANTS is now CE_DEVICE_PASS_VARIANTS"),
    ("device_session.sh", {"CE_SESSION_FAULTS_S": "180"}, "CE_SESSION_FAULTS_S is now CE_DEVICE_FAULTS_S"),
    ("run_device.sh", {"CE_DEVICE_BUDGET_S": "9m"}, "CE_DEVICE_BUDGET_S=9m: expected a whole number"),
    ("train_device.sh", {"CE_TRAIN_LAYERS": "eight"}, "CE_TRAIN_LAYERS=eight: expected a whole number"),
    ("run_device.sh", {"CE_DEVICE_STAGES": "probe probes"}, "unknown stage 'probes'"),
])
def test_drivers_refuse_renamed_and_bad_knobs(script, env, message, tmp_path):
    proc = _driver(script, tmp_path, env)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not any(tmp_path.glob("*.log"))  # nothing ran


def test_train_kernel_table_shows_gemm_beside_the_collectives(capsys):
    """--kernel-profile's table: per mode the GEMM busy time beside the NCCL kernels and the copy-engine copies, and
    the compute stream's wait; modes without a profile or that failed are left out."""
    from lib import kernel_profile as _kernel_profile
    import train

    kernels = {"by_class_ms": {"gemm": 12.5, "attention": 3.25, "collective": 4.0, "copy": 1.5, "copy_kernel": 2.0},
               "compute_wait_ms": 0.75, "wall_ms": 25.0}
    results = [train.ModeResult("fsdp2", kernels=kernels),
               train.ModeResult("fsdp2-ce", kernels={**kernels, "by_class_ms": {"gemm": 11.0}}),
               train.ModeResult("no-profile"), train.ModeResult("failed", ok=False, kernels=kernels)]
    _kernel_profile.log_kernel_table(results)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["kernels,", "ms/step", "(rank", "0)", "GEMM", "attention", "NCCL", "copies",
                                "copy", "kern.", "compute", "wait", "wall"]
    assert lines[1].split() == ["fsdp2", "12.50", "3.25", "4.00", "1.50", "2.00", "0.75", "25.0"]
    assert lines[2].split() == ["fsdp2-ce", "11.00", "0.00", "0.00", "0.00", "0.00", "0.75", "25.0"]
    assert lines[3].startswith("# copies:") and len(lines) == 4
    _kernel_profile.log_kernel_table([train.ModeResult("fsdp2")])
    assert capsys.readouterr().out == ""


def test_train_low_contention_mode_turns_on_pytorchs_pass_or_names_what_torch_lacks(monkeypatch):
    """compile+low-contention: Inductor's overlap scheduler plus PyTorch's low-contention copy-engine pass where the
    installed torch has the option; a torch without it fails that mode with a message naming the option."""
    import types

    import train

    ic = train.inductor_config()
    have = hasattr(getattr(ic, "aten_distributed_optimizations", None), "enable_low_contention_collectives")
    if have:  # torch 2.14 (this machine); 2.11 lacks it
        assert train.compile_options("compile+low-contention") == {
            "aten_distributed_optimizations.enable_overlap_scheduling": True,
            "aten_distributed_optimizations.enable_low_contention_collectives": True}
    older = types.SimpleNamespace(aten_distributed_optimizations=types.SimpleNamespace(enable_overlap_scheduling=False))
    monkeypatch.setattr(train, "inductor_config", lambda: older)
    assert train.compile_options("compile+inductor-overlap") == {
        "aten_distributed_optimizations.enable_overlap_scheduling": True}
    with pytest.raises(RuntimeError, match="has no aten_distributed_optimizations.enable_low_contention_collectives"):
        train.compile_options("compile+low-contention")


def test_fsdp2_device_runs_the_harness_at_each_rank_count_and_train_only_on_several_gpus(tmp_path):
    """bench/fsdp2_device.sh: the runtime checks, the FSDP2 harness once per CE_FSDP2_RANKS entry (ranks share one GPU
    where there are fewer GPUs), and the training comparison only where there are 2+ GPUs (here none: skipped, said);
    an unknown stage stops it before anything runs."""
    proc = _driver("fsdp2_device.sh", tmp_path, {"CE_FSDP2_RANKS": "2 3", "CE_FSDP2_SETUPS": "default,bf16-reduce"})
    assert proc.returncode == 0, proc.stderr
    cmds = _stage_commands(tmp_path)
    assert list(cmds) == ["build", "env", "harness-2", "harness-3", "runtime"]
    assert "tests/runtime/gpu_worker.py reduce_scatter,parts" in cmds["runtime"]
    assert cmds["harness-3"].startswith("env CE_TEST_SHARED_GPU=1 ") and "--nproc-per-node 3" in cmds["harness-3"]
    assert "--setups default,bf16-reduce --paths direct,hooks" in cmds["harness-2"]
    assert "train: SKIPPED (one GPU)" in (tmp_path / "summary.txt").read_text()
    bad = _driver("fsdp2_device.sh", tmp_path / "bad", {"CE_FSDP2_STAGES": "harness trian"})
    assert bad.returncode == 2 and "unknown stage 'trian'" in bad.stderr


def test_fully_shard_device_checks_each_rank_count_with_a_gpu_per_rank(tmp_path):
    """bench/fully_shard_device.sh: the check and resume stages per CE_FS_RANKS entry only where every rank has its
    own GPU (NCCL), said where not (here: no GPU); train only with 2+ GPUs; an unknown stage stops it, naming the
    knob."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\necho 'GPU 1: NVIDIA H200'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    proc = _driver("fully_shard_device.sh", out, {"CE_FS_RANKS": "2 4", "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    assert proc.returncode == 0, proc.stderr
    cmds = _stage_commands(out)
    assert list(cmds) == ["build", "check-2", "env", "resume-2", "train"]
    assert cmds["check-2"].endswith("--nproc-per-node 2 tests/fully_shard/worker.py check --compile")
    assert cmds["resume-2"] == "resume 2"
    assert "--modes compile+inductor-overlap,ce_overlap,no-comm,fsdp2" in cmds["train"]
    assert "check-4 resume-4: SKIPPED (2 GPUs)" in (out / "summary.txt").read_text()
    bad = _driver("fully_shard_device.sh", tmp_path / "bad", {"CE_FS_STAGES": "check trian"})
    assert bad.returncode == 2 and "CE_FS_STAGES: unknown stage 'trian'" in bad.stderr


def _chrome_trace(path, events) -> None:
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
                                   for cat, name, ts, dur, tid in events]}, f)


def test_timeline_splits_the_last_step_and_names_what_the_compute_stream_waited_for(tmp_path, capsys):
    """bench/timeline.py on a synthetic two-step trace: the last step runs from the end of the first step's optimizer
    to the end of its own; the compute stream (most GEMM time) idles 2 ms beside an NCCL kernel and 1 ms with the whole
    GPU idle (the host); the picture has one row per stream."""
    import timeline

    adam = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"
    events = [("kernel", adam, 0, 1000, 7),                                      # step 1's optimizer ends at 1 ms
              ("kernel", "nvjet_sm90_gemm", 1000, 4000, 7),                      # 1-5 ms GEMM
              ("kernel", "ncclDevKernel_AllGather_RING_LL", 4000, 3000, 22),     # 4-7 ms NCCL, compute idle 5-7
              ("kernel", "nvjet_sm90_gemm", 7000, 2000, 7),                      # 7-9 ms
              ("kernel", "void split_with_sizes_copy_out_contiguous_no_cast_kernel", 10000, 1000, 7),  # idle 9-10
              ("kernel", adam, 41000, 1000, 7),                                  # step 2's optimizer, 30 ms later
              ("cpu_op", "aten::mm", 1000, 10, 1)]
    # The gap before step 2's optimizer is 30 ms (> --step-gap-ms 20): two clusters, two steps.
    trace = tmp_path / "trace-x.json.gz"
    _chrome_trace(trace, events)
    acts = timeline.load(str(trace))
    assert len(acts) == 6  # the CPU op is not a GPU activity
    step, start, end = timeline.last_step(acts)
    assert (start, end) == (1000.0, 42000.0)
    r = timeline.analyze(step, start, end)
    assert r["compute_stream"] == 7 and r["step_ms"] == 41.0
    assert r["compute_idle_beside_ms"] == {"collective": 2.0}
    assert abs(r["gpu_idle_ms"] - (1.0 + 30.0)) < 1e-9  # 9-10 ms, and 11-41 ms before the optimizer
    assert r["streams"][7]["by_class_ms"] == {"gemm": 6.0, "copy_kernel": 1.0, "optimizer": 1.0}
    # The longest wait first, with its place: the 30 ms before the optimizer, then the NCCL wait, then the host's 1 ms.
    w = r["compute_waits"]
    assert [(x["at_ms"], x["ms"]) for x in w] == [(10.0, 30.0), (4.0, 2.0), (8.0, 1.0)]
    assert w[1]["after"] == "nvjet_sm90_gemm" and w[1]["before"] == "nvjet_sm90_gemm"
    assert w[1]["beside_ms"] == {"collective": 2.0} and w[2]["beside_ms"] == {}
    assert timeline.main([str(trace), "--ms-per-char", "5", "--json", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "compute |" in out and "stream 22 |" in out and "beside it ran: collective 2.0" in out
    assert "wait   2.00 ms at    4.00 after nvjet_sm90_gemm before nvjet_sm90_gemm; beside: collective 2.00" in out
    assert "beside: nothing (the host)" in out
    one_step = tmp_path / "one.json.gz"
    _chrome_trace(one_step, events[:5])
    assert timeline.main([str(one_step)]) == 2
    assert "need 2" in capsys.readouterr().err


def test_clocks_reads_each_modes_windows_and_skips_what_nvidia_smi_could_not_fill(tmp_path, capsys):
    """bench/clocks.py: per mode, the mean SM clock / power / temperature of each GPU's samples inside the mode's
    timed and profiled windows (train.json `windows`), from clocks.csv or clocks.csv.gz; a missing file is an error
    naming it, not a traceback."""
    import gzip

    import clocks

    run = {"results": [{"mode": "no-comm", "median_ms": 380.8,
                        "windows": {"timed": [100.0, 102.0], "profiled": [103.0, 104.0]}},
                       {"mode": "old", "median_ms": 1.0}]}  # a train.json from before `windows`: no row
    (tmp_path / "train.json").write_text(json.dumps(run))
    lines = [f"{t}, {g}, {1500 + 10 * g + t}, 690, 60" for t in (100.5, 101.5, 103.5, 105.0) for g in (0, 1)]
    lines += ["101.0, 0, [N/A], 690, 60", "garbage"]
    with gzip.open(tmp_path / "clocks.csv.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    rows = clocks.report(run, clocks.read_samples(str(tmp_path / "clocks.csv.gz")))
    assert [(r["mode"], r["window"]) for r in rows] == [("no-comm", "timed"), ("no-comm", "profiled")]
    assert rows[0]["gpus"][1]["mhz"] == pytest.approx(1500 + 10 + 101.0) and rows[0]["gpus"][0]["samples"] == 2
    assert rows[1]["gpus"][0] == {"mhz": 1603.5, "w": 690.0, "c": 60.0, "samples": 1}
    assert clocks.main([str(tmp_path)]) == 0
    assert "no-comm" in capsys.readouterr().out
    os.remove(tmp_path / "clocks.csv.gz")
    assert clocks.main([str(tmp_path)]) == 2
    assert "clocks.csv" in capsys.readouterr().err


def test_ce_ops_owns_copies_by_correlation_and_names_the_copy_that_ended_each_wait(tmp_path, capsys):
    """bench/ce_ops.py on two synthetic ranks: an op owns the copies its runtime calls enqueued (correlation ids), on
    rank 0's clock; the compute stream's 0.2 ms wait ends 10 us after the peer's 4-byte signal, which is named."""
    import gzip

    import ce_ops
    import timeline

    adam = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"

    def trace(path, shift, with_wait):
        ev = [{"ph": "X", "cat": "kernel", "name": adam, "ts": shift, "dur": 1000, "tid": 7, "args": {}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": shift + 1000, "dur": 3000, "tid": 7, "args": {}},
              {"ph": "X", "cat": "kernel", "name": "nvjet_gemm", "ts": shift + (4200 if with_wait else 4000),
               "dur": 2000, "tid": 7, "args": {}},
              {"ph": "X", "cat": "kernel", "name": adam, "ts": shift + 40000, "dur": 1000, "tid": 7, "args": {}},
              {"ph": "X", "cat": "cpu_op", "name": "ce_overlap::all_gather_into_tensors", "ts": shift + 100,
               "dur": 50, "tid": 1, "args": {}},
              {"ph": "X", "cat": "cpu_op", "name": "ce_overlap::wait_tensor", "ts": shift + 160, "dur": 5, "tid": 1,
               "args": {}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": shift + 110, "dur": 5, "tid": 1,
               "args": {"correlation": 1}},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": shift + 120, "dur": 5, "tid": 1,
               "args": {"correlation": 2}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": shift + 2000,
               "dur": 100, "tid": 147, "args": {"correlation": 1, "bytes": 1 << 20, "stream": 147}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": shift + 3000,
               "dur": 1000 if with_wait else 190, "tid": 146,
               "args": {"correlation": 2, "bytes": 4 if not with_wait else 1 << 22, "stream": 146}}]
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)

    r0, r1 = tmp_path / "trace-ce_overlap.json.gz", tmp_path / "trace-ce_overlap-rank1.json.gz"
    trace(r0, 0, with_wait=True)   # rank 0 waits 4.0 .. 4.2 ms (trace time) for its op
    trace(r1, 1000, with_wait=False)  # rank 1, 1 ms later on the clock: its 4-byte signal ends at 4.19 ms
    ops = ce_ops.ce_ops(timeline.trace_events(str(r0)))
    assert [(o["name"], o["bytes"], o["streams"]) for o in ops] == [
        ("all_gather_into_tensors", {"DtoD": 1 << 20, "PtoP": 1 << 22}, [146, 147])]
    assert (ops[0]["start_us"], ops[0]["end_us"]) == (2000.0, 4000.0)
    assert ce_ops.main([str(r0), str(r1), "--min-wait-ms", "0.1", "--slack-us", "15"]) == 0
    out = capsys.readouterr().out
    assert "[1] trace-ce_overlap-rank1.json.gz: its step starts at 1.000 ms" in out
    # Rank 0's step starts after its first optimizer (1 ms): the clock's zero for both traces.
    assert "copies     1.000 ..     3.000 ( 2.000 ms)  DtoD 1.0 MB, PtoP 4.2 MB  streams [146, 147]" in out
    assert "wait  0.200 ms at     3.000 before nvjet_gemm: ended by a 4-byte copy at 3.190 of [1]" in out
    assert ce_ops.main([str(r0), "--slack-us", "5", "--min-wait-ms", "0.1"]) == 0
    assert "no copy ended just before it" in capsys.readouterr().out
    assert ce_ops.main([str(tmp_path / "missing.json.gz")]) == 2
    capsys.readouterr()
    for bad, why in ((["--slack-us", "-1"], "--slack-us must be >= 0, got -1"),
                     (["--min-wait-ms", "-0.1"], "--min-wait-ms must be >= 0, got -0.1"),
                     (["--from-ms", "5", "--to-ms", "1"], "--from-ms 5 is after --to-ms 1")):
        with pytest.raises(SystemExit):
            ce_ops.main([str(r0), *bad])
        assert why in capsys.readouterr().err


def test_ce_ops_tells_a_stall_from_a_data_wait_by_the_host_launches_between_the_kernels(tmp_path, capsys):
    """A compute-stream gap is a data wait only if the host made the stream wait between launching the kernels around
    it; a ce_overlap op's own cudaStreamWaitEvent (its copy streams waiting on the caller's) does not count."""
    import gzip

    import ce_ops

    adam = "void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>"

    def trace(path, data_wait):
        kernels = [(adam, 0, 1000), ("nvjet_a", 1000, 3000), ("nvjet_b", 4300, 2000), (adam, 40000, 1000)]
        ev = []
        for i, (name, ts, dur) in enumerate(kernels):
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7,
                       "args": {"correlation": 10 + i}})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": -500 + 100 * i, "dur": 5,
                       "tid": 1, "args": {"correlation": 10 + i}})
        # Between nvjet_a's launch (-400) and nvjet_b's (-300): a ce_overlap op whose launch makes its copy stream wait
        # on the compute stream, and (data_wait) a wait of the compute stream outside it (a wait_tensor's).
        ev.append({"ph": "X", "cat": "cpu_op", "name": "ce_overlap::all_gather_into_tensors", "ts": -390, "dur": 40,
                   "tid": 1, "args": {}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": -380, "dur": 2, "tid": 1,
                   "args": {"correlation": 50}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": -370, "dur": 5, "tid": 1,
                   "args": {"correlation": 51}})
        ev.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)", "ts": 3000, "dur": 1290,
                   "tid": 146, "args": {"correlation": 51, "bytes": 1 << 22, "stream": 146}})
        if data_wait:
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamWaitEvent", "ts": -320, "dur": 2,
                       "tid": 1, "args": {"correlation": 52}})
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)

    stall, wait = tmp_path / "stall.json.gz", tmp_path / "wait.json.gz"
    trace(stall, data_wait=False)
    trace(wait, data_wait=True)
    assert ce_ops.main([str(stall), "--min-wait-ms", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "wait  0.300 ms at     3.000 before nvjet_b: no stream wait launched between the two kernels" in out
    assert ce_ops.main([str(wait), "--min-wait-ms", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "wait  0.300 ms at     3.000 before nvjet_b: ended by a 4,194,304-byte copy" in out
    # The next step's optimizer, launched at -200 us, waited for nothing: the stream had run out of work.
    assert "before void at::native::multi_tensor_apply_kern: no stream wait launched" in out
    # A kernel the host launched only after the stream ran dry is the host's gap, whatever copies ran beside it.
    late = tmp_path / "late.json.gz"
    with gzip.open(wait, "rt") as f:
        ev = json.load(f)["traceEvents"]
    for e in ev:
        if e.get("name") == "cudaLaunchKernel" and e["args"]["correlation"] == 12:  # nvjet_b's launch
            e["ts"] = 4100  # after nvjet_a ended (4000)
    with gzip.open(late, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    assert ce_ops.main([str(late), "--min-wait-ms", "0.1"]) == 0
    assert "before nvjet_b: the host launched the next kernel after the gap began" in capsys.readouterr().out


def test_run_env_records_the_cuda_queue_setting_and_every_override_that_is_set():
    from lib import common as _common

    env = _common.run_env({"CE_OVERLAP_LOCAL_COPY": "memcpy", "CE_OVERLAP_PASS_PREFETCH_BLOCKS": "2",
                           "CE_OVERLAP_NOT_A_VARIABLE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "32", "HOME": "/root"})
    assert env == {"NCCL_NVLS_ENABLE": None, "TORCH_SYMM_MEM_DISABLE_MULTICAST": None,
                   "CUDA_DEVICE_MAX_CONNECTIONS": "32", "CE_OVERLAP_LOCAL_COPY": "memcpy",
                   "CE_OVERLAP_PASS_PREFETCH_BLOCKS": "2"}


def test_wrapper_profile_tallies_the_samples_inside_the_compiled_wrappers(tmp_path, capsys):
    """bench/wrapper_profile.py on py-spy raw lines as py-spy writes them (`Runner.call` and `call` frames naming the
    generated module's base name): a compile's samples do not count; the wrapper lines carry their source."""
    import wrapper_profile

    name = "c" + "a" * 51 + ".py"
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / name).write_text("def call(args):\n    buf0 = empty_strided_cuda((4,), (1,), torch.bfloat16)\n"
                                        "    triton_poi_fused__to_copy_0.run(buf0)\n")
    raw = tmp_path / "w.spy"
    raw.write_text(
        f"<module> (x.py:1);run_step (bench/compute_models.py:279);Runner.call ({name}:3);"
        "CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1407) 7\n"
        f"process 12:\"python3\";thread (0x1);backward (torch/_functorch/x.py:9);call ({name}:2) 3\n"
        "<module> (x.py:1);_compile (torch/_dynamo/convert_frame.py:1902) 90\n"
        "not a sample line\n")
    total, inside, tables = wrapper_profile.tally(raw.read_text().splitlines())
    assert (total, inside) == (100, 10)
    assert tables["by wrapper line"] == {f"{name}:3": 7, f"{name}:2": 3}
    assert tables["by callee"]["CachingAutotuner.run (torch/_inductor/runtime/triton_heuristics.py:1407)"] == 7
    assert tables["by callee"]["(the line itself)"] == 3
    assert wrapper_profile.main([str(raw), "--sources", str(tmp_path / "*" / "*.py")]) == 0
    out = capsys.readouterr().out
    assert "100 samples, 10 inside" in out and "| triton_poi_fused__to_copy_0.run(buf0)" in out
