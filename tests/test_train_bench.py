"""bench/train.py's harness on CPU (gloo, two ranks, llama3-tiny): the modes run, the table and JSON come out.
The numbers mean nothing here; the GPU run is bench/train_device.sh."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.parametrize("isolate", [False, True], ids=["same-process", "process-per-mode"])
def test_train_harness_runs_eager_no_comm_and_the_pass_on_cpu(tmp_path, isolate):
    """Both ways of running the modes: in the one process (every mode family), and (the default on GPUs) each mode in
    a fresh process per rank joined into its own process group, its result handed back to the parent's table and
    JSON (eager and a compiled in-graph mode: a child runs whatever mode it is given the same way, and a fresh
    process pair per mode is the costly part; FSDP2's modes are the same-process run's)."""
    out = tmp_path / "train.json"
    run = ["eager", "ce_overlap-nccl"] if isolate else \
        ["eager", "no-comm", "ce_overlap-nccl", "ce_overlap+ac", "fsdp2", "fsdp2-no-comm", "fsdp2+ac"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(REPO, "bench", "train.py"), "--device", "cpu", "--model", "llama3-tiny", "--seq-len", "32",
           "--steps", "2", "--warmup", "1", "--modes", ",".join(run), "--out", str(out)]
    cmd += ["--isolate", "--loss-reduce", "step"] if isolate else []  # both ways of averaging the losses
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    modes = {r["mode"]: r for r in result["results"]}
    assert set(modes) == set(run)
    for r in modes.values():
        assert r["ok"], r
        assert len(r["step_ms"]) == 2 and len(r["losses"]) == 3
        # Per timed step the host's time and its part in the garbage collector; per rank its median step.
        assert len(r["host_ms"]) == len(r["gc_ms"]) == 2 and len(r["step_ms_by_rank"]) == 2
        assert all(0 <= g <= h for g, h in zip(r["gc_ms"], r["host_ms"]))
    assert result["args"]["gc"] == "torchtitan" and result["args"]["loss_reduce"] == ("step" if isolate else "end")
    # Same weights and data: the pass (NCCL only) computes the same first loss as eager, up to fp32 rounding.
    assert abs(modes["eager"]["losses"][0] - modes["ce_overlap-nccl"]["losses"][0]) < 1e-3
    if not isolate:
        # FSDP2 (fully_shard, bf16 parameters) from the same full weights: the same first loss up to bf16 rounding.
        assert abs(modes["eager"]["losses"][0] - modes["fsdp2"]["losses"][0]) < 2e-2
        # Activation checkpointing per block recomputes the same forward: the same losses up to fp32 rounding.
        assert all(abs(a - b) < 1e-3
                   for a, b in zip(modes["ce_overlap-nccl"]["losses"], modes["ce_overlap+ac"]["losses"]))
        # FSDP2 with each block checkpointed recomputes the same forward: fsdp2's losses up to fp32 rounding.
        assert all(abs(a - b) < 1e-3 for a, b in zip(modes["fsdp2"]["losses"], modes["fsdp2+ac"]["losses"]))
        # The FSDP2 bound's all-gather writes this rank's shard into every slot: the first forward sees other weights
        # than fsdp2's (every rank's slot holds this rank's shard), so only its being a finite training run is checked.
        assert all(math.isfinite(v) for v in modes["fsdp2-no-comm"]["losses"])
    assert "ce_overlap-nccl" in proc.stdout and "tok/s/GPU" in proc.stdout
    assert ("(in its own process)" in proc.stdout) == isolate
    assert proc.stdout.count("tok/s/GPU") == 1  # one table: a child leaves it to the parent


def test_inductor_config_values_are_python_literals():
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import train

    assert train.inductor_config_items(["reorder_for_peak_memory=False", "max_autotune=True", "x.y=3"]) == {
        "reorder_for_peak_memory": False, "max_autotune": True, "x.y": 3}
    for bad in ["no_equals_sign", "=3", "reorder_for_peak_memory=maybe"]:
        with pytest.raises(ValueError, match="--inductor-config"):
            train.inductor_config_items([bad])


def test_gc_pauses_sum_the_collections_since_zeroed():
    """The timed loop's measure of the host in Python's garbage collector: a collection forced inside the window
    counts, one before it does not, and closing unhooks it."""
    import gc
    import time

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from lib import titan as _titan

    with _titan.step_loop_gc("torchtitan") as inside:  # off inside, restored after, even when the loop raises
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _titan.step_loop_gc("torchtitan"):
        raise RuntimeError("a step failed")
    assert gc.isenabled() and inside._on_gc not in gc.callbacks

    pauses = _titan.GcPauses()
    try:
        gc.collect()
        pauses.since = 0.0
        t0 = time.perf_counter()
        gc.collect()
        elapsed = time.perf_counter() - t0
        assert 0 < pauses.since <= elapsed
    finally:
        pauses.close()
    assert pauses._on_gc not in gc.callbacks


def test_memory_peak_replay_finds_the_live_blocks_at_the_maximum():
    """bench/lib/memory.py's replay of the allocator's trace: the peak, its live blocks, and what was allocated before
    the record (here 100 bytes) from the bytes allocated at the end."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from lib.memory import replay_peak

    a = [{"filename": "a.py", "line": 1}]
    b = [{"filename": "b.py", "line": 2}]
    events = [{"action": "alloc", "addr": 1, "size": 10, "frames": a},
              {"action": "alloc", "addr": 2, "size": 30, "frames": b},
              {"action": "free_requested", "addr": 1, "size": 10},
              {"action": "free_completed", "addr": 1, "size": 10},
              {"action": "alloc", "addr": 3, "size": 5, "frames": a},
              {"action": "segment_alloc", "addr": 9, "size": 1000},
              {"action": "free_requested", "addr": 2, "size": 30}]
    peak, index, base, live = replay_peak(events, allocated_now=105)
    assert (peak, index, base) == (140, 1, 100)
    assert sorted(size for size, _ in live) == [10, 30]
    assert replay_peak([], allocated_now=7) == (7, -1, 7, [])


def test_train_harness_in_graph_torchtitan_wrap_with_the_vocabulary_parallel_lookup_on_cpu(tmp_path):
    """--in-graph-wrap torchtitan (the default: [norm, output] sharded by a call of their own, kept gathered into the
    backward) with --vocab-parallel-embeddings: eager and compiled with the pass train the same losses as the blocks
    wrap's eager run, up to fp32 rounding."""
    def run(name, *extra):
        out = tmp_path / f"{name}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.join(REPO, "bench", "train.py"), "--device", "cpu", "--model", "llama3-tiny", "--seq-len", "32",
               "--steps", "2", "--warmup", "1", "--out", str(out), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        result = json.loads(out.read_text())
        return result, {r["mode"]: r["losses"] for r in result["results"] if r["ok"]}

    result, kept = run("kept", "--modes", "eager,ce_overlap-nccl", "--vocab-parallel-embeddings")
    assert result["args"]["in_graph_wrap"] == "torchtitan" and set(kept) == {"eager", "ce_overlap-nccl"}
    plain_result, plain = run("plain", "--modes", "eager", "--in-graph-wrap", "blocks")
    assert plain_result["args"]["in_graph_wrap"] == "blocks"
    for mode in ("eager", "ce_overlap-nccl"):
        assert all(abs(a - b) < 1e-3 for a, b in zip(kept[mode], plain["eager"])), (mode, kept[mode], plain["eager"])


def test_train_harness_tensor_parallel_modes_on_cpu(tmp_path):
    """--tp 2 on 4 gloo ranks (a 2x2 ("dp", "tp") mesh): FSDP2 + TP and ce_overlap + TP with the pass train the same
    losses up to bf16 rounding (bf16 gathers, fp32 against bf16 gradient reductions), each GPU counts the tokens of
    its TP group once; async TP is refused off CUDA, naming why; the TP modes and the others do not mix."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from lib import tp as _tp
    import train

    out = tmp_path / "tp.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           os.path.join(REPO, "bench", "train.py"), "--device", "cpu", "--model", "llama3-tiny", "--seq-len", "32",
           "--steps", "1", "--warmup", "1", "--tp", "2", "--modes", "fsdp2+tp,ce_overlap+tp", "--same-process",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    modes = {r["mode"]: r for r in result["results"]}
    assert all(r["ok"] and not r["async_tp"] for r in modes.values()) and result["args"]["tp"] == 2
    assert all(abs(a - b) < 2e-2 for a, b in zip(modes["fsdp2+tp"]["losses"], modes["ce_overlap+tp"]["losses"]))
    assert "tensor parallelism over 2 ranks, FSDP over 2; TP on NCCL (not on CUDA)" in proc.stdout
    with pytest.raises(RuntimeError, match="fsdp2\\+tp\\+async-tp: torch's async TP cannot run here: not on CUDA"):
        _tp.async_tp_for("fsdp2+tp+async-tp", None, "cpu")
    assert _tp.async_tp_for("ce_overlap+tp", None, "cpu") == (False, "not on CUDA")
    for bad, why in ((["--tp", "2", "--modes", "ce_overlap"], "need --tp 1"),
                     (["--modes", "ce_overlap+tp"], "need --tp > 1"), (["--tp", "0"], "--tp must be >= 1")):
        with pytest.raises(SystemExit):
            train.parse_args(bad)
    assert train.parse_args(["--tp", "2"]).modes == ",".join(_tp.MODES)
