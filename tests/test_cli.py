"""The `ce-overlap` CLI end to end (each command in the test's process as in one of its own: conftest.run_cli),
including every bad-input path: exit 2, one line."""
from __future__ import annotations

import json
import os
import re

import pytest

from conftest import DATA, run_cli


# A capture's stages as they pass (ce_overlap.progress, on stderr): status lines before any error.
_PROGRESS = re.compile(r"^capture .+: \d+\.\d s$")


def _assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip() and not _PROGRESS.match(l)]
    assert len(lines) == 1, proc.stderr          # one error line (after the stages that passed), no traceback
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


def test_analyze_tiny_prints_the_block_table(cli_private):
    cli = cli_private
    proc = cli("analyze", "llama3-tiny", "--world-size", "8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "blocks: 2 x TransformerBlock (layers.0 .. layers.1)" in out
    assert "exposed ms" in out and "layers.1" in out and "(outside blocks)" in out
    assert out.strip().splitlines()[-1].startswith("total")
    assert "captured in" in proc.stderr   # provenance goes to stderr, the report alone to stdout
    again = cli("analyze", "llama3-tiny", "--world-size", "8")
    assert again.returncode == 0 and again.stdout == out
    assert "capture from cache" in again.stderr


def test_analyze_json_and_trace(cli, tmp_path):
    trace = tmp_path / "trace.json"
    proc = cli("analyze", "llama3-tiny", "--world-size", "2", "--profile", "h200-sxm", "--json", "--trace", str(trace))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["schema"] == "ce_overlap.analysis/1"
    assert report["profile"] == "h200-sxm"
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(report["timeline"]) > 0
    assert {e["tid"] for e in spans} == {0, 1}


def test_analyze_plans_with_the_pass_config_its_flags_describe(cli):
    from ce_overlap import PassConfig

    default = json.loads(cli("analyze", "llama3-tiny", "--world-size", "2", "--plan", "--json").stdout)
    want = PassConfig().plan_config()
    for p in default["plans"]:  # the optional keys are written only where they differ from the default
        assert p["config"] == {k: v for k, v in want.items()
                               if k not in ("ce_reduction", "ce_collectives", "copy_pace_fill")}
    flags = ["--ce", "on", "--min-ce-bytes", "0", "--ce-reduction", "kernel", "--ce-collectives", "all_gather",
             "--memory-budget-mib", "100", "--bucket-cap-mib", "64", "--prefetch-blocks", "0", "--copy-pace-fill", "0.5"]
    proc = cli("analyze", "llama3-tiny", "--world-size", "2", "--plan", "--json", *flags)
    assert proc.returncode == 0, proc.stderr
    want = PassConfig(ce="on", min_ce_bytes=0, ce_reduction="kernel", ce_collectives=("all_gather",),
                      memory_budget_mb=100, bucket_cap_mb=64, prefetch_blocks=0, copy_pace_fill=0.5).plan_config()
    plans = json.loads(proc.stdout)["plans"]
    assert [p["config"] for p in plans] == [want] * len(plans)
    buckets = [b for p in plans for b in p["buckets"]]
    assert {b["backend"] for b in buckets if b["type"] == "all_gather"} == {"ce"}
    rs = [b for b in buckets if b["type"] == "reduce_scatter"]
    assert rs and all(b["reason"] == "nccl: config.ce_collectives excludes reduce_scatter" for b in rs)


def test_capture_then_analyze_the_file_gives_the_same_report(cli, tmp_path):
    ir = tmp_path / "tiny.json"
    proc = cli("capture", "llama3-tiny", "-o", str(ir), "--world-size", "4")
    assert proc.returncode == 0, proc.stderr
    assert "forward" in proc.stdout and "2 blocks" in proc.stdout
    direct = json.loads(cli("analyze", "llama3-tiny", "--world-size", "4", "--json").stdout)
    from_file = json.loads(cli("analyze", str(ir), "--json").stdout)
    assert direct == from_file


def test_deep_zoo_models_are_extrapolated_and_say_so(cli, tmp_path):
    ir = tmp_path / "1b.json"
    proc = cli("capture", "llama3-1b", "-o", str(ir), "--world-size", "8", "--seq-len", "256")
    assert proc.returncode == 0, proc.stderr
    how = json.loads(ir.read_text())["meta"]["capture"]
    # at short sequences a run of nodes has no interior copy at 3 and 4 blocks: 4 and 5 are traced
    assert re.fullmatch(r"blocks traced at depths (3 and 4|4 and 5), extrapolated to 16", how), how
    assert "16 blocks" in proc.stdout and how in proc.stdout


_BLOCKS = """import torch


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))
"""

_MODEL = """import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from blocks import Block  # noqa: E402


def build():
    width = int(os.environ.get("CE_TEST_WIDTH", "64"))  # a size chosen by the environment, as torchtitan's flavors
    return torch.nn.Sequential(Block(width), Block(width)), (torch.randn(4, width),)
"""


def test_the_capture_cache_follows_what_build_returns(tmp_path):
    """The cache holds a capture of what build() returned, not of the file that builds it: the same model again comes
    from the cache; the same file building another size (an environment variable) or with a class edited in a file
    it imports is captured again."""
    (tmp_path / "blocks.py").write_text(_BLOCKS)
    (tmp_path / "model.py").write_text(_MODEL)
    target = f"{tmp_path / 'model.py'}:build"

    def analyze(width: str):
        proc = run_cli("analyze", target, "--world-size", "2", "--json",
                       env_extra={"CE_OVERLAP_CACHE": str(tmp_path / "cache"), "CE_TEST_WIDTH": width})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc

    first = analyze("64")
    assert "captured in" in first.stderr
    # The stages as they passed (ce_overlap.progress; stderr is not a terminal here: plain lines).
    stages = [line.split(": ")[1] for line in first.stderr.splitlines() if _PROGRESS.match(line)]
    assert stages == ["build", "trace and compile the forward", "compile the backward", "convert to the IR"], \
        first.stderr
    assert "capture from cache" in analyze("64").stderr
    wider = analyze("96")
    assert "captured in" in wider.stderr and wider.stdout != first.stdout
    (tmp_path / "blocks.py").write_text(_BLOCKS.replace("torch.relu", "torch.nn.functional.gelu"))
    edited = analyze("64")
    assert "captured in" in edited.stderr, edited.stderr
    # The capture the cache holds now is the edited model's.
    ir = tmp_path / "edited.json"
    proc = run_cli("capture", target, "--world-size", "2", "-o", str(ir),
                   env_extra={"CE_OVERLAP_CACHE": str(tmp_path / "cache"), "CE_TEST_WIDTH": "64"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "aten.erf" in ir.read_text()  # GELU, decomposed; the ReLU of the first capture has no erf


def test_user_build_target(cli):
    proc = cli("analyze", os.path.join(DATA, "resnetish.py") + ":build", "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert "blocks: 3 x Stage (stage_a .. stage_c)" in proc.stdout


def test_tied_gpt2_analyzes_and_captures_with_the_defaults_and_says_what_it_assumed(cli, tmp_path):
    target = os.path.join(DATA, "gpt2_tied.py") + ":build"
    proc = cli("analyze", target)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "blocks: 2 x Block (h.0 .. h.1)" in lines
    assert ("note: the loss is output[0] (the first of 2 tensors in a tuple), a scalar; the other 1 tensor output is "
            "not differentiated") in lines
    assert any(line.startswith("note: world size 8 does not divide dim 0 of 1 parameter (largest: wte.weight: "
                               "1001 -> 1008 rows)") for line in lines)
    assert any(line.startswith("per rank and step: fwd AG out MiB = ") for line in lines)
    ir = tmp_path / "gpt2.json"
    proc = cli("capture", target, "-o", str(ir))
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(ir.read_text())["meta"]
    assert (meta["loss_unused_outputs"], meta["fsdp_padded_params"], meta["fsdp_padding_bytes"]) == (1, 1, 1792)
    assert proc.stdout.splitlines()[1] == ("note: the loss is output[0] (the first of 2 tensors in a tuple), a scalar; "
                                           "the other 1 tensor output is not differentiated")


def test_a_model_that_fails_to_compile_shows_the_error_underneath(cli):
    proc = cli("analyze", os.path.join(DATA, "vit.py") + ":build", "--no-cast-inputs")
    _assert_clean_error(proc, "torch.compile of the model failed: RuntimeError: Input type (float) and bias type "
                              "(c10::BFloat16) should be the same", "vit.py:")


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.fixture(scope="module")
def tiny_doc(tiny_ir):
    return tiny_ir.to_dict()


def _variant(tmp_path, tiny_doc, name, mutate):
    doc = json.loads(json.dumps(tiny_doc))
    mutate(doc)
    return _write(tmp_path, name, json.dumps(doc))


def test_bad_inputs_exit_2_with_one_line(cli, tmp_path, tiny_doc):
    cases = [
        (["analyze", _write(tmp_path, "bad.json", "{not json")], ["malformed JSON"]),
        (["analyze", _variant(tmp_path, tiny_doc, "v2.json", lambda d: d.update(schema="ce_overlap.ir/2"))],
         ["schema", "ce_overlap.ir/2"]),
        (["analyze", _variant(tmp_path, tiny_doc, "kind.json",
                              lambda d: d["graphs"][1]["nodes"][4].update(kind="kernel"))], ["kind", "kernel"]),
        (["analyze", _variant(tmp_path, tiny_doc, "neg.json",
                              lambda d: d["graphs"][0]["nodes"][0]["outputs"][0]["shape"].__setitem__(0, -1))],
         ["graphs[0].nodes[0].outputs[0].shape"]),
        (["analyze", _variant(tmp_path, tiny_doc, "huge.json",
                              lambda d: d["graphs"][0]["nodes"][7].update(flops=10**19))], ["flops"]),
        (["analyze", "llama9-70b"], ["unknown model", "llama3-8b"]),
        (["analyze", "llama3-tiny", "--profile", "tpu-v9"], ["unknown profile", "h100-sxm"]),
        (["analyze", "llama3-tiny", "--world-size", "0"], ["--world-size must be >= 1"]),
        (["analyze", os.path.join(DATA, "raises.py") + ":build"], ["build() raised RuntimeError", "checkpoint not found"]),
        (["analyze", os.path.join(DATA, "resnetish.py") + ":nothing"], ["no callable"]),
        (["analyze", str(tmp_path / "absent.json")], ["absent.json"]),
        (["analyze", "llama3-tiny", "--world-size", "2", "--keep-gathered", "head"], ["no submodule 'head'"]),
        (["analyze", "llama3-tiny", "--world-size", "2", "--no-fsdp", "--keep-gathered", "output"],
         ["keep_gathered", "needs fsdp"]),
        (["analyze", "llama3-tiny", "--world-size", "6", "--tp", "4"], ["tp must be an integer >= 1 that divides"]),
        (["analyze", "llama3-tiny", "--world-size", "8", "--tp", "8"], ["n_heads (4) does not divide"]),
        (["analyze", os.path.join(DATA, "resnetish.py") + ":build", "--world-size", "4", "--tp", "2"],
         ["tp=2 needs the model's tensor-parallel plan", "tensor_parallel(module, tp_mesh)"]),
        (["analyze", "llama3-tiny", "--world-size", "6", "--nodes", "4"], ["nodes must be an integer >= 1 that divides"]),
        (["analyze", "llama3-tiny", "--world-size", "4", "--hsdp"], ["hsdp", "needs nodes >= 2"]),
        (["analyze", "llama3-tiny", "--world-size", "8", "--nodes", "2", "--tp", "8"],
         ["tp=8 must divide the 4 ranks of a node"]),
    ]
    results = [run_cli(*args, env_extra={"CE_OVERLAP_CACHE": str(tmp_path / "cache")}) for args, _ in cases]
    for (args, fragments), proc in zip(cases, results):
        _assert_clean_error(proc, *fragments)


def test_tensor_parallel_analysis_names_what_shares_nvlink_and_predicts_the_tp_modes(cli):
    """--tp 2 at 8 ranks: the IR's collectives carry their roles (meta tp 2), the plans keep every TP collective on
    NCCL where captured, name for each FSDP bucket the TP collectives it runs beside, and the report predicts
    bench/train.py's TP modes (without the async-TP capture: --no-async-tp)."""
    proc = cli("analyze", "llama3-1b", "--world-size", "8", "--tp", "2", "--no-async-tp", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["meta"]["tp"] == 2 and r["totals"]["tp_collective_count"] > 0
    tp_names = {b["members"][0]["collective"] for p in r["plans"] for b in p["buckets"] if b.get("role") == "tp"}
    assert tp_names and all(b["backend"] == "nccl" and len(b["members"]) == 1
                            for p in r["plans"] for b in p["buckets"] if b.get("role") == "tp")
    overlaps = [o for p in r["plans"] for b in p["buckets"] if b.get("role") == "dp" for o in b.get("overlaps", [])]
    assert overlaps and all(o["collective"] in tp_names and o["collective_added_us"] > 0 for o in overlaps)
    assert any("issued after tensor-parallel" in b["reason"] for p in r["plans"] for b in p["buckets"])
    t = r["tensor_parallel"]
    assert t["tp"] == 2 and t["data_parallel"] == 4 and not t["async_tp_captured"]
    steps = t["predicted_step_ms"]
    assert steps["fsdp2+tp+async-tp"] is None and steps["no-comm+tp"] < steps["ce_overlap+tp"] < steps["fsdp2+tp"]
    text = cli("analyze", "llama3-1b", "--world-size", "8", "--tp", "2", "--no-async-tp").stdout
    assert "tensor parallelism over 2 ranks, FSDP over 4" in text and "share NVLink with tensor-parallel" in text


def test_analysis_across_nodes_records_them_and_predicts_the_multi_node_modes(cli):
    """The acceptance's command (Llama-3-8B, 16 ranks as 2 nodes of 8, HSDP): the JSON records "nodes": 2 (meta and
    the multi-node section), the replicas' all-reduces are NCCL buckets of their blocks (group across nodes), the
    shard dimension's buckets may use copy engines; and flat FSDP over the two nodes prices the hierarchical choice
    per bucket (always, with --ce on)."""
    proc = cli("analyze", "llama3-8b", "--world-size", "16", "--nodes", "2", "--hsdp", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)
    assert r["meta"]["nodes"] == 2 and r["meta"]["hsdp"] is True
    n = r["nodes"]
    assert (n["nodes"], n["ranks_per_node"], n["hsdp"]) == (2, 8, True)
    steps = n["predicted_step_ms"]
    assert set(steps) == {"hsdp", "hsdp-ce_overlap", "no-comm"} and steps["no-comm"] < steps["hsdp"]
    backward = next(p for p in r["plans"] if p["graph"] == "backward")
    replicas = [b for b in backward["buckets"] if b.get("role") == "replicate"]
    assert replicas and all(b["type"] == "all_reduce" and b["backend"] == "nccl" and b["group_size"] == 2
                            and "group spans 2 nodes" in b["reason"] for b in replicas)
    assert sum(len(b["members"]) > 1 for b in replicas) >= 32  # one bucket per block, not one per parameter
    assert any(b["backend"] == "ce" for b in backward["buckets"] if b.get("role") == "dp")
    text = cli("analyze", "llama3-tiny", "--world-size", "8", "--nodes", "2", "--ce", "on").stdout
    assert "2 nodes x 4 ranks, FSDP over every rank (predicted steps):" in text, text[-2000:]
    assert "FSDP, hierarchical everywhere" in text and "hierarchical (" in text
    plans = json.loads(cli("analyze", "llama3-tiny", "--world-size", "8", "--nodes", "2", "--ce", "on",
                           "--min-ce-bytes", "0", "--json").stdout)["plans"]
    spanning = [b for p in plans for b in p["buckets"] if b["type"] in ("all_gather", "reduce_scatter")]
    assert spanning and all(b["backend"] == "hier" and b["predicted"]["hier_us"] > 0 for b in spanning)


def test_async_tp_capture_holds_torchs_fused_ops_and_predicts_its_modes(cli, tmp_path):
    """The second capture, with torch's micro-pipeline TP: its fused matmul-reduce-scatter ops (and, at batch 2, its
    fused all-gather-matmul ones) are in the graphs with their GEMMs' FLOPs; ce_overlap's pass (in the capture, CE
    on) plans and rewrites the FSDP collectives beside them; the async-TP mode is predicted."""
    import ce_overlap
    from ce_overlap.analyzer.model_capture import capture_named

    ir = capture_named("llama3-tiny", world_size=4, tp=2, batch=2, async_tp=True,
                       inductor_config=ce_overlap.inductor_options(ce="on", min_ce_bytes=0))
    nodes = [n for g in ir.to_dict()["graphs"] for n in g["nodes"]]
    ops = [n for n in nodes if n["op"].startswith("symm_mem.fused_")]
    assert {n["op"] for n in ops} == {"symm_mem.fused_all_gather_matmul.default",
                                      "symm_mem.fused_matmul_reduce_scatter.default"}
    assert all(n["kind"] == "compute" and n["flops"] > 0 for n in ops) and ir.meta["async_tp"]
    assert any(n["op"].startswith("ce_overlap.") for n in nodes)  # the pass moved FSDP buckets to copy engines
    r = json.loads(cli("analyze", "llama3-tiny", "--world-size", "4", "--tp", "2", "--batch", "2", "--json").stdout)
    assert r["tensor_parallel"]["async_tp_captured"]
    assert all(v is not None for v in r["tensor_parallel"]["predicted_step_ms"].values())


def test_cycle_exits_2(cli, tmp_path, tiny_doc):
    def cycle(d):
        nodes = d["graphs"][0]["nodes"]
        user = next(n for n in nodes if n["inputs"])
        nodes[user["inputs"][0]]["inputs"].append(user["id"])
    _assert_clean_error(cli("analyze", _variant(tmp_path, tiny_doc, "cycle.json", cycle)), "cycle")


def test_bad_profile_file_exits_2(cli, tmp_path, tiny_doc):
    ir = _write(tmp_path, "ok.json", json.dumps(tiny_doc))
    from ce_overlap import profiles
    prof = json.loads(profiles.read_text("h100-sxm"))
    prof["gpu"]["hbm_gbps"] = -1
    _assert_clean_error(cli("analyze", ir, "--profile", _write(tmp_path, "p.json", json.dumps(prof))), "gpu.hbm_gbps")


def test_list(cli):
    proc = cli("list")
    assert proc.returncode == 0
    assert "llama3-8b" in proc.stdout and "h200-sxm" in proc.stdout


def test_bad_profile_is_rejected_before_capturing(cli, tmp_path):
    bad = _write(tmp_path, "p.json", '{"schema": "ce_overlap.profile/2", "name": ')
    _assert_clean_error(cli("analyze", "llama3-tiny", "--profile", bad), "malformed JSON")
    assert not (tmp_path / "cache").exists()  # nothing was captured (a capture fills the cache)


def test_capture_progress_is_a_live_line_on_a_terminal_and_plain_lines_elsewhere():
    """ce_overlap.progress: each finished stage a plain line with its time; on a terminal also a live line (a bar over
    the stages expected, the stage, its seconds); a stage that raises leaves no line; nothing unless shown."""
    import io
    import time

    from ce_overlap import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, live in ((io.StringIO(), False), (Terminal(), True)):
        with progress.shown("capture m", expected=3, stream=stream):
            with progress.stage("build"):
                time.sleep(0.7 if live else 0)  # the live line ticks every 0.5 s
            progress.next_stage("trace")
            with pytest.raises(RuntimeError), progress.stage("compile"):
                raise RuntimeError("boom")
        text = stream.getvalue()
        plain = [p for p in (line.split("\r")[-1].replace("\x1b[K", "") for line in text.split("\n")) if p.strip()]
        assert [p.rsplit(":", 1)[0] for p in plain] == ["capture m: build", "capture m: trace"], plain
        assert all(_PROGRESS.match(p) for p in plain)
        assert ("capture m [" in text and "] 1/3 build" in text and "] 2/3 trace" in text) == live
    quiet = io.StringIO()
    with progress.stage("build"):  # not shown: silent
        pass
    assert quiet.getvalue() == ""
