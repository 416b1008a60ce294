"""Capture on fake CUDA tensors, no GPU (ce_overlap.inductor.fake_cuda, issue 31): a torchtitan-shaped Llama-3 with flex
attention analyzes with the defaults (its CPU capture fails, and the CLI says it captured on fake CUDA); the zoo's
Llama captured both ways moves the same bytes and FLOPs, with the GPU's attention kernels in the fake-CUDA graphs;
flex attention's FLOPs count the tiles its block mask computes; nothing stays patched after a capture."""
from __future__ import annotations

import collections
import json
import os

import pytest
import torch

import ce_overlap
from ce_overlap.inductor import fake_cuda
from ce_overlap.inductor.flops import attention_backward_flops, attention_flops

from conftest import DATA, load_data_module

pytestmark = pytest.mark.skipif(fake_cuda.unavailable_reason() is not None,
                                reason=f"fake CUDA capture unavailable: {fake_cuda.unavailable_reason()}")

TITAN = os.path.join(DATA, "titan_llama.py")
WORLD = 8


titan = load_data_module("titan_llama")


def _graph(doc: dict, name: str) -> list[dict]:
    return next(g for g in doc["graphs"] if g["name"] == name)["nodes"]


def _ops(nodes) -> collections.Counter:
    return collections.Counter(n["op"] for n in nodes)


@pytest.fixture(scope="module")
def titan_ir():
    model, inputs = titan.build()
    return ce_overlap.capture(model, inputs, world_size=WORLD, name="titan_llama").to_dict()


def test_torchtitan_shaped_llama_analyzes_with_the_defaults(cli):
    proc = cli("analyze", f"{TITAN}:build", "--world-size", str(WORLD), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    cfg = titan.TitanConfig()
    assert [b["path"] for b in report["blocks"]] == [f"model.layers.{i}" for i in range(cfg.n_layers)]
    block = titan.TransformerBlock  # each block's gathers and reduce-scatters are its own parameters in bf16
    with torch.device("meta"):
        numel = sum(p.numel() for p in block(cfg).parameters())
    for row in report["blocks"]:
        assert row["forward_all_gather_bytes"] == row["reduce_scatter_bytes"] == 2 * numel
    assert report["meta"]["capture_device"] == "cuda" and "capture_device_reason" not in report["meta"]
    assert "note: captured on" not in cli("analyze", f"{TITAN}:build", "--world-size", str(WORLD)).stdout


def test_the_flex_model_on_the_cpu_names_the_problem(cli):
    proc = cli("analyze", f"{TITAN}:build", "--world-size", str(WORLD), "--device", "cpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "torch.compile of the model failed" in proc.stderr and "titan_llama.py" in proc.stderr


def test_a_model_that_compiles_only_on_the_cpu_is_captured_there_and_says_why(cli):
    proc = cli("analyze", f"{os.path.join(DATA, 'cpu_only.py')}:build", "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert "note: captured on the CPU" in proc.stdout and "on fake CUDA tensors it does not compile" in proc.stdout
    explicit = cli("analyze", "llama3-tiny", "--world-size", "2", "--device", "cpu")
    assert explicit.returncode == 0 and "note: captured on the CPU" in explicit.stdout and \
        "(--device cpu)" in explicit.stdout


def test_flex_attention_nodes_and_their_flops(titan_ir):
    cfg = titan.TitanConfig()
    fwd, bwd = _graph(titan_ir, "forward"), _graph(titan_ir, "backward")
    assert _ops(fwd)["higher_order.flex_attention"] == cfg.n_layers
    assert _ops(bwd)["higher_order.flex_attention_backward"] == cfg.n_layers
    head = cfg.dim // cfg.n_heads
    q = (cfg.batch, cfg.n_heads, cfg.seq_len, head)
    kv = (cfg.batch, cfg.n_kv_heads, cfg.seq_len, head)
    tiles = cfg.seq_len // 128  # flex's default 128 x 128 tiles; causal computes the diagonal and below
    density = tiles * (tiles + 1) // 2 / tiles ** 2
    for n in fwd:
        if n["op"] == "higher_order.flex_attention":
            assert n["flops"] == int(attention_flops(q, kv, kv) * density)
    for n in bwd:
        if n["op"] == "higher_order.flex_attention_backward":
            assert n["flops"] == int(attention_backward_flops(q, kv, kv) * density)


def test_the_gathered_weights_stay_inside_and_their_gradients_in_their_blocks(titan_ir):
    """The gather-once window closes inside the compiled forward (in_graph.fully_shard._ForwardState; torch 2.14 once dropped its
    close after flex attention): no gathered weight is a forward output, the backward takes only the loss's gradient,
    and each block's weight gradients are its own GEMMs (2 per forward GEMM, its FLOPs twice the forward's), not
    nodes outside the blocks (they were gradient-accumulating addmms with no module)."""
    fwd, bwd = _graph(titan_ir, "forward"), _graph(titan_ir, "backward")
    by_id = {n["id"]: n for n in fwd}
    out = next(n for n in fwd if n["name"] == "output")
    assert [by_id[i]["name"] for i in out["inputs"] if by_id[i]["kind"] == "wait"] == []
    assert [n["name"] for n in bwd if n["name"].startswith("tangents")] == ["tangents_1"]

    def gemm_flops(nodes) -> collections.Counter:
        flops = collections.Counter()
        for n in nodes:
            if n["op"] in ("aten.mm.default", "aten.addmm.default"):
                flops[n["block"]] += n["flops"]
        return flops

    forward, backward = gemm_flops(fwd), gemm_flops(bwd)
    assert set(forward) == set(backward) == {-1, *range(titan.TitanConfig().n_layers)}
    assert all(backward[b] == 2 * forward[b] for b in forward), (forward, backward)


def test_flex_attention_is_priced_at_its_own_efficiency(titan_ir, tmp_path):
    """The cost model prices flex attention's nodes as attention, at efficiency.flex_attention / _backward (its Triton
    kernels run at about half of cuDNN's SDPA rate: bench/results/flex-attention-2026-11-29), not as GEMMs. The scalar
    model (the profile's shape tables removed; with them flex takes SDPA's causal table at this ratio: test_shapes.cc)."""
    from ce_overlap import profiles
    from ce_overlap.ir import Ir, analyze

    spec = json.loads(profiles.read_text("h200-sxm"))
    spec.pop("shapes")
    spec["efficiency"]["kernel_launch_us"] = 1e-3  # this small model's attention nodes sit under the 3 us floor
    path = tmp_path / "h200-no-floor.json"
    path.write_text(json.dumps(spec))
    peak, eff = spec["gpu"]["peak_bf16_tflops"], spec["efficiency"]
    report = analyze(Ir.from_json(json.dumps(titan_ir)), str(path))
    for graph, op, key in (("forward", "higher_order.flex_attention", "flex_attention"),
                           ("backward", "higher_order.flex_attention_backward", "flex_attention_backward")):
        nodes = [n for n in _graph(titan_ir, graph) if n["op"] == op]
        want = sum(n["flops"] / (peak * 1e6 * eff[key]) for n in nodes)
        priced = next(g for g in report["graphs"] if g["name"] == graph)["compute_by_class_us"]["attention"]
        assert nodes and priced == pytest.approx(want, rel=1e-9), (graph, priced, want)


def test_the_zoo_llama_on_fake_cuda_moves_what_the_cpu_capture_moves(capture_zoo):
    cuda = capture_zoo("llama3-tiny", WORLD).to_dict()  # the default
    from ce_overlap.analyzer.model_capture import capture_named

    cpu = capture_named("llama3-tiny", world_size=WORLD, device="cpu").to_dict()
    assert cuda["meta"]["capture_device"] == "cuda" and cpu["meta"]["capture_device"] == "cpu"
    for name in ("forward", "backward"):
        def collectives(doc):
            return sorted((n["collective"]["type"], n["outputs"][0]["bytes"]) for n in _graph(doc, name)
                          if n["kind"] == "collective")

        assert collectives(cuda) == collectives(cpu), name
        assert sum(n["flops"] for n in _graph(cuda, name)) == sum(n["flops"] for n in _graph(cpu, name)), name
        gpu_attention = [op for op in _ops(_graph(cuda, name)) if "scaled_dot_product" in op]
        cpu_attention = [op for op in _ops(_graph(cpu, name)) if "scaled_dot_product" in op]
        assert cpu_attention and all("for_cpu" in op for op in cpu_attention), cpu_attention
        assert gpu_attention and not any("for_cpu" in op for op in gpu_attention), gpu_attention
        assert any(k in gpu_attention[0] for k in ("cudnn", "flash", "efficient")), gpu_attention


def test_nothing_stays_patched_after_a_capture(titan_ir):
    assert fake_cuda._active == 0
    if fake_cuda._hooks is not None:  # on a machine without a GPU: the hooks' vtable pointer is torch's again
        import ctypes

        assert ctypes.c_void_p.from_address(fake_cuda._hooks.hooks).value == fake_cuda._hooks.original
    q = torch.randn(1, 2, 16, 8)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)  # CPU SDPA as before
    ref = torch.softmax((q @ q.transpose(-1, -2) / 8 ** 0.5).masked_fill(
        torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf")), -1) @ q
    torch.testing.assert_close(out, ref)
    model, inputs = titan.build()
    with pytest.raises(ce_overlap.CeOverlapError, match="device must be 'cpu' or 'cuda'"):
        ce_overlap.capture(model, inputs, world_size=WORLD, device="xla")


def test_torchtitans_own_llama3_analyzes_where_torchtitan_installs(cli):
    pytest.importorskip("torchtitan.models.llama3", reason="torchtitan is not installed (pip install torchtitan)")
    proc = cli("analyze", f"{os.path.join(DATA, 'torchtitan_llama3.py')}:build", "--world-size", str(WORLD), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [b["path"] for b in report["blocks"]] == [f"model.layers.{i}" for i in range(6)]  # debugmodel: 6 layers
    assert report["meta"]["capture_device"] == "cuda"
    # Each block's weight gradients are its own (the gather-once window closes inside the compiled forward): a block's
    # backward at least twice its forward (GEMMs 2x, attention 2.5x), the output projection's at most 2.5x.
    assert all(b["backward_flops"] >= 2 * b["forward_flops"] for b in report["blocks"]), report["blocks"][0]
    outside = report["outside_blocks"]
    assert outside["backward_flops"] <= 2.5 * outside["forward_flops"], outside


def test_a_mask_that_reads_model_tensors_is_counted_dense():
    """A document mask (the mask_mod indexes a tensor of the model's: capture has no values for it) cannot be
    evaluated: every tile is counted, never fewer than the kernel may compute."""
    import torch.nn as nn
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    class DocAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 3 * 64, bias=False)

        def forward(self, x, doc):
            def same_doc(b, h, q_idx, kv_idx):
                return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)

            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, 32).permute(2, 0, 3, 1, 4)
            mask = create_block_mask(same_doc, b, None, t, t, device=x.device)
            return flex_attention(q, k, v, block_mask=mask).float().pow(2).mean()

    with torch.device("meta"):
        model = DocAttention()
    x, doc = torch.zeros(1, 256, 64), torch.zeros(1, 256, dtype=torch.long)
    nodes = _graph(ce_overlap.capture(model, (x, doc), world_size=2, name="doc").to_dict(), "forward")
    flex = [n for n in nodes if n["op"] == "higher_order.flex_attention"]
    assert len(flex) == 1 and flex[0]["flops"] == attention_flops((1, 2, 256, 32), (1, 2, 256, 32), (1, 2, 256, 32))
