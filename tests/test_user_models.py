"""Models a new user brings (tests/data): a GPT-2 with tied embeddings that returns (loss, logits), and a ViT
with a conv patch embedding on float32 images. Both analyze with the default options; per-block bytes are the
blocks' own parameters, and what the capture assumed (the loss, FSDP's padding, the input cast) is reported."""
from __future__ import annotations

import collections
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

import ce_overlap
from ce_overlap.analyzer import report as render
from ce_overlap.in_graph import fully_shard as in_graph
from ce_overlap.inductor.capture import fake_process_group

from conftest import load_data_module

WORLD = 8


gpt2 = load_data_module("gpt2_tied")
vit = load_data_module("vit")
titan = load_data_module("titan_llama")


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _padded_bytes(model: torch.nn.Module, world: int) -> int:
    """bf16 bytes FSDP's dim-0 padding adds to one gather of every parameter (by hand, from the model)."""
    total = 0
    for p in model.parameters():
        rows = p.shape[0]
        total += (-(-rows // world) * world - rows) * (p.numel() // rows) * 2
    return total


def _capture(module, **kw):
    model, inputs = module.build()
    expected = {"blocks": [_numel(b) for b in (model.h if hasattr(model, "h") else model.blocks)],
                "total": _numel(model), "padding": _padded_bytes(model, kw.get("world_size", WORLD))}
    ir = ce_overlap.capture(model, inputs, world_size=kw.pop("world_size", WORLD), name=module.__name__, **kw)
    return ir, expected


@pytest.fixture(scope="module")
def gpt2_ir():
    return _capture(gpt2)


@pytest.fixture(scope="module")
def vit_ir():
    return _capture(vit)


def _nodes(ir, graph):
    return next(g for g in ir.to_dict()["graphs"] if g["name"] == graph)["nodes"]


def _collectives(ir, graph) -> collections.Counter:
    return collections.Counter(n["collective"]["type"] for n in _nodes(ir, graph) if n["kind"] == "collective")


def _check_bytes(ir, expected, block_paths):
    """Per block: all-gathered and reduce-scattered bytes are the block's own parameters in bf16; outside blocks
    and in total, plus FSDP's padding, which the meta reports."""
    assert [b["path"] for b in ir.blocks] == block_paths
    report = ce_overlap.analyze(ir, "h100-sxm")
    for row, numel in zip(report["blocks"], expected["blocks"], strict=True):
        assert row["forward_all_gather_bytes"] == 2 * numel, row["path"]
        assert row["reduce_scatter_bytes"] == 2 * numel, row["path"]
    assert ir.meta["num_params"] == expected["total"]
    assert ir.meta["fsdp_padding_bytes"] == expected["padding"] > 0
    t = report["totals"]
    assert t["forward_all_gather_bytes"] == t["reduce_scatter_bytes"] == 2 * expected["total"] + expected["padding"]
    assert report["meta"]["fsdp_padding_bytes"] == expected["padding"]  # the JSON report carries the meta
    return report


def test_gpt2_tied_embeddings_analyze_with_the_defaults(gpt2_ir):
    ir, expected = gpt2_ir
    cfg = gpt2.Gpt2Config()
    assert expected["blocks"] == [12 * cfg.dim * cfg.dim + 13 * cfg.dim] * cfg.n_layers  # the model's own count
    report = _check_bytes(ir, expected, [f"h.{i}" for i in range(cfg.n_layers)])
    assert {b["type"] for b in ir.blocks} == {"Block"}
    # 12 parameters per block + wte, wpe, ln_f (2): the tied weight is ONE parameter, gathered once in the
    # forward and reduce-scattered once (its two uses' gradients summed first), as FSDP2 does.
    n_params = 12 * cfg.n_layers + 4
    assert _collectives(ir, "forward") == {"all_gather": n_params}
    # The backward re-gathers the block weights that their backward reads (6 per block: no bias), ln_f's weight
    # and the tied weight (the output projection's input gradient reads it).
    assert _collectives(ir, "backward") == {"all_gather": 6 * cfg.n_layers + 2, "reduce_scatter": n_params}
    wte_rows = [n for n in _nodes(ir, "forward") if n["kind"] == "collective"
                and n["outputs"][0]["shape"] == [-(-cfg.vocab_size // WORLD) * WORLD, cfg.dim]]
    assert len(wte_rows) == 1
    assert report["outside_blocks"]["forward_all_gather_count"] == 4


def test_gpt2_tuple_output_and_padding_are_reported(gpt2_ir):
    ir, expected = gpt2_ir
    meta = ir.meta
    assert meta["loss"] == "output[0] (the first of 2 tensors in a tuple), a scalar"
    assert meta["loss_unused_outputs"] == 1
    assert (meta["fsdp_padded_params"], meta["fsdp_padding_largest"]) == (1, "wte.weight: 1001 -> 1008 rows")
    assert meta["fsdp_padding_bytes"] == 7 * 128 * 2
    assert meta["forward_inputs_cast"] == 0 and meta["cast_forward_inputs"] is True  # integer tokens
    report = ce_overlap.analyze(ir, "h100-sxm")
    notes = render.format_notes(report)
    assert notes[0] == ("the loss is output[0] (the first of 2 tensors in a tuple), a scalar; the other 1 tensor "
                        "output is not differentiated")
    share = 100 * 1792 / report["totals"]["forward_all_gather_bytes"]
    assert notes[1] == ("world size 8 does not divide dim 0 of 1 parameter (largest: wte.weight: 1001 -> 1008 rows): "
                        "FSDP pads their shards, and the all-gather and reduce-scatter bytes include the padding, "
                        f"1.75 KiB per pass over them, {share:.2f}% of the forward all-gather bytes")
    assert len(notes) == 2
    summary = render.format_summary(report)
    assert all(f"note: {n}" in summary.splitlines() for n in notes)


def test_a_parameter_registered_in_two_modules_stays_one_shard_gathered_once():
    """Hugging Face ties by assignment (lm_head.weight = wte.weight): one Parameter in two modules."""
    class HfTied(gpt2.Gpt2):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.lm_head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))

    cfg = gpt2.Gpt2Config(vocab_size=1008)
    with torch.device("meta"):
        model = HfTied(cfg)
    tokens = torch.zeros((1, 16), dtype=torch.long, device="meta")
    numel = _numel(model)
    ir = ce_overlap.capture(model, (tokens, tokens), world_size=WORLD)
    # one shard per distinct parameter: DTensors of the full shapes, 1 / WORLD of the rows held here
    assert _numel(model) == numel and sum(p.to_local().numel() for p in model.parameters()) * WORLD == numel
    assert model.lm_head._parameters["weight"] is model.wte._parameters["weight"]
    n_params = 12 * cfg.n_layers + 4
    assert _collectives(ir, "forward")["all_gather"] == n_params
    assert _collectives(ir, "backward")["reduce_scatter"] == n_params
    report = ce_overlap.analyze(ir, "h100-sxm")
    assert report["totals"]["forward_all_gather_bytes"] == report["totals"]["reduce_scatter_bytes"] == 2 * numel
    assert ir.meta["loss"] == "the output, a scalar" and ir.meta["fsdp_padding_bytes"] == 0
    assert render.format_notes(report) == []


def test_vit_analyzes_with_the_defaults_its_images_cast_to_bf16(vit_ir):
    ir, expected = vit_ir
    cfg = vit.VitConfig()
    assert expected["blocks"] == [12 * cfg.dim * cfg.dim + 13 * cfg.dim] * cfg.n_layers
    _check_bytes(ir, expected, [f"blocks.{i}" for i in range(cfg.n_layers)])
    # cls_token and pos_embed (1 row each) and the 10-class head pad to multiples of 8 rows
    d, t = cfg.dim, cfg.tokens
    assert expected["padding"] == (7 * d + 7 * t * d + 6 * d + 6) * 2
    assert (ir.meta["fsdp_padded_params"], ir.meta["fsdp_padding_largest"]) == (4, "pos_embed: 1 -> 8 rows")
    assert ir.meta["forward_inputs_cast"] == 1
    fwd = _nodes(ir, "forward")
    conv = next(n for n in fwd if n["op"] == "aten.convolution.default")
    assert fwd[conv["inputs"][0]]["outputs"][0]["dtype"] == "bfloat16"  # the image, cast in the graph
    assert conv["flops"] == 2 * cfg.batch * (cfg.tokens - 1) * d * cfg.channels * cfg.patch ** 2
    notes = render.format_notes(ce_overlap.analyze(ir, "h100-sxm"))
    assert notes[-1] == ("1 floating-point forward input cast to bfloat16 (FSDP2's MixedPrecisionPolicy default; "
                         "--no-cast-inputs keeps the input dtype)")
    assert len(notes) == 2 and notes[0].startswith("world size 8 does not divide dim 0 of 4 parameters")


def test_vit_without_the_input_cast_names_the_real_error():
    model, inputs = vit.build()
    with pytest.raises(ce_overlap.CeOverlapError) as err:
        ce_overlap.capture(model, inputs, world_size=WORLD, cast_forward_inputs=False)
    text = str(err.value)
    assert text.startswith("torch.compile of the model failed: RuntimeError: Input type (float) and bias type "
                           "(c10::BFloat16) should be the same (in forward, "), text
    assert os.path.join("tests", "data", "vit.py:") in text  # the user's line, not torch's
    # with float32 gathers nothing needs casting, and the model captures
    model, inputs = vit.build()
    ir = ce_overlap.capture(model, inputs, world_size=WORLD, param_dtype="float32", cast_forward_inputs=False)
    assert ir.meta["cast_forward_inputs"] is False and ir.meta["forward_inputs_cast"] == 0


def test_a_non_scalar_output_is_summed_and_says_so():
    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 8)

        def forward(self, x):
            return {"logits": self.lin(x), "aux": self.lin(x).mean()}

    ir = ce_overlap.capture(Logits(), (torch.randn(4, 16),), world_size=2)
    assert ir.meta["loss"] == "the sum of output['logits'] (the first of 2 tensors in a dict), shape [4, 8] (not a scalar)"
    assert ir.meta["loss_unused_outputs"] == 1
    assert render.format_notes(ce_overlap.analyze(ir, "h100-sxm"))[0].startswith("the loss is the sum of output['logits']")


def test_gather_once_and_the_input_cast_in_eager_training_match_the_unsharded_model():
    """Real tensors, one rank: the sharded tied GPT-2 computes the unsharded model's loss and gradients (the tied
    weight's two uses summed), and the ViT's float32 images reach the bf16 weights as bf16."""
    torch.manual_seed(0)
    cfg = gpt2.Gpt2Config(vocab_size=64, n_ctx=16, dim=32, n_layers=1, seq_len=16, batch=1)
    ref = gpt2.Gpt2(cfg)
    model = gpt2.Gpt2(cfg)
    model.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with fake_process_group(1, 0):
        in_graph.fully_shard(model, dist.group.WORLD, _local_gather=True)
        loss, _ = model(tokens, tokens)
        loss.backward()
        assert not model._ce_overlap_state.active and model._ce_overlap_state.gathered == {}
    ref_loss, _ = ref(tokens, tokens)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    assert set(grads) == {n for n, _ in ref.named_parameters()}
    for name, q in ref.named_parameters():
        torch.testing.assert_close(grads[name], q.grad, msg=name)

    vcfg = vit.VitConfig(n_layers=1, batch=2)
    small = vit.Vit(vcfg)
    images = torch.randn(2, 3, vcfg.image, vcfg.image)
    seen = []
    small.patch_embed.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    with fake_process_group(1, 0):
        in_graph.fully_shard(small, dist.group.WORLD, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                        _local_gather=True)
        small(images, torch.tensor([1, 2])).backward()
    assert seen == [torch.bfloat16] and images.dtype == torch.float32


def test_a_compiled_forward_with_flex_attention_closes_its_gather_once_window():
    """torch 2.14's Dynamo dropped the store that closed the gather-once window after flex attention
    (in_graph._ForwardState): the compiled forward left it open, its gathered weights in it. One rank, real tensors, the
    torchtitan-shaped Llama compiled with its forward only (flex attention has no backward on the CPU): after each
    compiled call the window is closed and empty, the loss is the unsharded model's, and a changed weight reaches the
    next call. In a process of its own: Dynamo would trace a device mesh an earlier test made, whose process group
    that test destroyed."""
    proc = subprocess.run([sys.executable, "-c", "import test_user_models as t; t.compiled_flex_window_check()"],
                          cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def compiled_flex_window_check():
    torch.manual_seed(0)
    cfg = titan.TitanConfig(n_layers=1, seq_len=128)
    model, ref = titan.WithLoss(cfg), titan.WithLoss(cfg)
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with fake_process_group(1, 0), torch.no_grad():
        for layer in model.model.layers.values():
            in_graph.fully_shard(layer, dist.group.WORLD, _local_gather=True)
        in_graph.fully_shard(model, dist.group.WORLD, _local_gather=True)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        state = model._ce_overlap_state
        for step in range(2):
            loss = compiled(tokens, tokens)
            assert not state.active and state.gathered == {}, f"call {step}: the window stayed open"
            torch.testing.assert_close(loss, ref(tokens, tokens))
            model.model.output._parameters["weight"].to_local().mul_(2.0)
            ref.model.output.weight.mul_(2.0)
