"""Capture of real torch.compile graphs (fake process group, fake tensors) into IR."""
from __future__ import annotations

import collections
import os

import pytest
import torch

import ce_overlap
from ce_overlap import models
from ce_overlap.models.llama import LLAMA_CONFIGS

from conftest import DATA


def _nodes(ir, graph):
    return next(g for g in ir.to_dict()["graphs"] if g["name"] == graph)["nodes"]


def _block_param_numel(cfg) -> int:
    kv = cfg.n_kv_heads * cfg.head_dim
    return 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim + 2 * cfg.dim


def _collective_bytes_by_block(nodes, ctype):
    """all-gather: gathered (output) bytes; reduce-scatter: reduced (input) bytes."""
    out = collections.Counter()
    for n in nodes:
        if n["kind"] == "collective" and n["collective"]["type"] == ctype:
            out[n["block"]] += n["outputs"][0]["bytes"] if ctype == "all_gather" else n["collective"]["bytes"]
    return out


def test_zoo_parameter_counts_match_the_built_modules():
    assert LLAMA_CONFIGS["llama3-8b"].num_params() == 8_030_261_248
    for name in models.names():
        built = models.build_named(name)
        assert sum(p.numel() for p in built.module.parameters()) == LLAMA_CONFIGS[name].num_params(), name


def test_tiny_capture_has_forward_and_backward_with_fsdp_collectives(tiny_ir):
    assert tiny_ir.graph_names == ["forward", "backward"]
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    assert [b["path"] for b in tiny_ir.blocks] == [f"layers.{i}" for i in range(cfg.n_layers)]
    assert {b["type"] for b in tiny_ir.blocks} == {"TransformerBlock"}
    fwd, bwd = _nodes(tiny_ir, "forward"), _nodes(tiny_ir, "backward")
    kinds = lambda nodes: collections.Counter(  # noqa: E731
        n["collective"]["type"] for n in nodes if n["kind"] == "collective")
    # 9 parameters per block + embedding + final norm + output projection.
    n_params = 9 * cfg.n_layers + 3
    assert kinds(fwd) == {"all_gather": n_params}
    # The backward re-gathers every parameter but the embedding (its backward needs no weight)
    # and reduce-scatters every gradient.
    assert kinds(bwd) == {"all_gather": n_params - 1, "reduce_scatter": n_params}
    for n in fwd + bwd:
        if n["kind"] == "collective":
            assert n["collective"]["group_size"] == 8
            # FSDP2's gradient average (Partial("avg")): the reduce-scatter averages
            assert (n["collective"]["reduce_op"] == "avg") == (n["collective"]["type"] == "reduce_scatter")
        if n["kind"] == "wait":
            assert len(n["inputs"]) == 1


def test_tiny_block_bytes_equal_parameter_bytes(tiny_ir):
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    per_block = _block_param_numel(cfg) * 2  # bf16
    ag = _collective_bytes_by_block(_nodes(tiny_ir, "forward"), "all_gather")
    rs = _collective_bytes_by_block(_nodes(tiny_ir, "backward"), "reduce_scatter")
    for i in range(cfg.n_layers):
        assert ag[i] == per_block
        assert rs[i] == per_block
    assert sum(ag.values()) == sum(rs.values()) == cfg.num_params() * 2


def test_tiny_flops_match_the_closed_form(tiny_ir):
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    tokens, heads, hd, seq = cfg.seq_len, cfg.n_heads, cfg.head_dim, cfg.seq_len
    kv = cfg.n_kv_heads * hd
    linear = cfg.n_layers * (2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.ffn_dim) \
        + cfg.vocab_size * cfg.dim
    # GQA: K/V heads broadcast to query heads; causal: the s (s + 1) / 2 pairs at or below the diagonal
    attention_fwd = cfg.n_layers * 4 * heads * (seq * (seq + 1) // 2) * hd
    fwd = sum(n["flops"] for n in _nodes(tiny_ir, "forward"))
    bwd = sum(n["flops"] for n in _nodes(tiny_ir, "backward"))
    assert fwd == 2 * tokens * linear + attention_fwd
    assert bwd == 4 * tokens * linear + attention_fwd * 5 // 2


def test_shapes_dtypes_and_bytes_come_from_fake_tensors(tiny_ir):
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    fwd = _nodes(tiny_ir, "forward")
    mms = [n for n in fwd if n["op"] == "aten.mm.default"]
    assert mms and all(n["outputs"][0]["dtype"] == "bfloat16" for n in mms)
    first_ag = next(n for n in fwd if n["kind"] == "collective")
    shard = fwd[first_ag["inputs"][0]]
    assert shard["outputs"][0]["bytes"] * 8 == first_ag["outputs"][0]["bytes"] == first_ag["collective"]["bytes"] * 8
    # the embedding is gathered first: (vocab, dim) in bf16
    assert first_ag["outputs"][0]["shape"] == [cfg.vocab_size, cfg.dim]
    for n in fwd:
        for o in n["outputs"]:
            numel = 1
            for d in o["shape"]:
                numel *= d
            assert o["bytes"] == numel * {"bfloat16": 2, "float32": 4, "int64": 8, "bool": 1}[o["dtype"]]


def test_without_reshard_the_backward_does_not_regather(capture_zoo):
    ir = capture_zoo("llama3-tiny", 2, reshard=False)
    bwd = _nodes(ir, "backward")
    assert not [n for n in bwd if n["kind"] == "collective" and n["collective"]["type"] == "all_gather"]


def test_vocab_parallel_embedding_moves_tokens_and_activations_not_the_table(capture_zoo):
    """fully_shard's vocab_parallel_embeddings in the captured step: the forward starts with the token ids' all-gather
    and reduce-scatters the partial embeddings (world x tokens x dim), the backward gathers their gradient, and the
    table is neither gathered nor its gradient reduce-scattered."""
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    plain, vocab = capture_zoo("llama3-tiny", 2), capture_zoo("llama3-tiny", 2, vocab_parallel=True)
    assert vocab.meta["vocab_parallel_embeddings"] is True and "vocab_parallel_embeddings" not in plain.meta

    def colls(ir, graph):
        return [n for n in _nodes(ir, graph) if n["kind"] == "collective"]

    table = cfg.vocab_size * cfg.dim * 2  # the gathered bf16 table
    tokens = 1 * models.build_named("llama3-tiny").example_inputs[0].shape[1]
    fwd, bwd = colls(vocab, "forward"), colls(plain, "backward")
    assert fwd[0]["collective"]["type"] == "all_gather" and fwd[0]["outputs"][0]["dtype"] == "int64"
    rs = [n for n in fwd if n["collective"]["type"] == "reduce_scatter"]
    assert len(rs) == 1 and rs[0]["collective"]["bytes"] == 2 * tokens * cfg.dim * 2
    def tables(nodes):  # the embedding's and the output projection's (the same shape here)
        return sum(n["collective"]["type"] == "all_gather" and n["outputs"][0]["bytes"] == table for n in nodes)

    assert (tables(colls(plain, "forward")), tables(fwd)) == (2, 1)
    vb = colls(vocab, "backward")
    assert sum(n["collective"]["type"] == "reduce_scatter" for n in vb) == \
        sum(n["collective"]["type"] == "reduce_scatter" for n in bwd) - 1
    assert [n for n in vb if n["collective"]["type"] == "all_gather"
            and n["outputs"][0]["bytes"] == 2 * tokens * cfg.dim * 2]


def test_keep_gathered_gathers_norm_and_output_once_per_step():
    """keep_gathered=("norm", "output") (train.py --in-graph-wrap torchtitan): the output projection is gathered in the
    forward and not again in the backward, where the default wrap gathers it twice; bad paths are refused by name."""
    from ce_overlap.models.llama import Llama

    cfg = LLAMA_CONFIGS["llama3-tiny"]

    def capture(**kw):
        with torch.device("meta"):
            model = Llama(cfg)
        tokens = torch.zeros((1, cfg.seq_len), dtype=torch.long, device="meta")
        return ce_overlap.capture(model, (tokens, tokens), world_size=2, **kw)

    table = cfg.vocab_size * cfg.dim * 2  # a gathered bf16 [vocab, dim] weight: the embedding's or the output's

    def gathers(ir, graph):
        return sum(n["kind"] == "collective" and n["collective"]["type"] == "all_gather"
                   and n["outputs"][0]["bytes"] == table for n in _nodes(ir, graph))

    plain, kept = capture(), capture(keep_gathered=("norm", "output"))
    assert kept.meta["keep_gathered"] == "norm,output" and "keep_gathered" not in plain.meta
    assert (gathers(plain, "forward"), gathers(plain, "backward")) == (2, 1)  # the output's again in the backward
    assert (gathers(kept, "forward"), gathers(kept, "backward")) == (2, 0)
    # Every parameter's gradient is still reduce-scattered once.
    def rs_bytes(ir):
        return sum(n["collective"]["bytes"] for n in _nodes(ir, "backward")
                   if n["kind"] == "collective" and n["collective"]["type"] == "reduce_scatter")

    assert rs_bytes(kept) == rs_bytes(plain)
    with pytest.raises(ce_overlap.CeOverlapError, match="no submodule 'head'"):
        capture(keep_gathered=("head",))
    with pytest.raises(ce_overlap.CeOverlapError, match="sequence of submodule paths"):
        capture(keep_gathered="output")
    with pytest.raises(ce_overlap.CeOverlapError, match="keep_gathered .* needs fsdp"):
        capture(keep_gathered=("output",), fsdp=False)


def test_vocab_parallel_embedding_without_fsdp_is_refused():
    with pytest.raises(ce_overlap.CeOverlapError, match="vocab_parallel_embeddings .* needs fsdp"):
        ce_overlap.capture(torch.nn.Embedding(4, 2), (torch.zeros(2, dtype=torch.long),), world_size=2, fsdp=False,
                           vocab_parallel_embeddings=True)


def test_world_size_one_and_uneven_sharding(capture_zoo):
    # world size 3 does not divide the tiny model's dims: shards are padded, gathered then trimmed.
    ir = capture_zoo("llama3-tiny", 3)
    cfg = LLAMA_CONFIGS["llama3-tiny"]
    fwd = _nodes(ir, "forward")
    first_ag = next(n for n in fwd if n["kind"] == "collective")
    assert first_ag["outputs"][0]["shape"] == [3 * -(-cfg.vocab_size // 3), cfg.dim]
    single = capture_zoo("llama3-tiny", 1)
    assert all(n["collective"]["group_size"] == 1 for n in _nodes(single, "forward") if n["kind"] == "collective")


def test_user_model_without_layers_list_gets_its_blocks():
    built = models.build_from_file(os.path.join(DATA, "resnetish.py") + ":build")
    ir = ce_overlap.capture(built.module, built.example_inputs, world_size=4, name="resnetish")
    assert [(b["path"], b["type"]) for b in ir.blocks] == [("stage_a", "Stage"), ("stage_b", "Stage"),
                                                           ("stage_c", "Stage")]
    fwd = _nodes(ir, "forward")
    ag = _collective_bytes_by_block(fwd, "all_gather")
    stage_params = 64 * 256 + 256 + 256 * 64 + 64 + 2 * 64
    assert [ag[i] for i in range(3)] == [stage_params * 2] * 3
    # stem and head sit outside blocks; the head's 10 rows are padded to 12 to shard over 4 ranks
    assert ag[-1] == (64 * 32 + 64 + 12 * 64 + 12) * 2


def test_capture_without_fsdp_has_no_collectives():
    built = models.build_from_file(os.path.join(DATA, "resnetish.py") + ":build")
    ir = ce_overlap.capture(built.module, built.example_inputs, world_size=2, fsdp=False)
    assert all(n["kind"] != "collective" for g in ir.graph_names for n in _nodes(ir, g))
    mms = [n for n in _nodes(ir, "forward") if n["op"] == "aten.addmm.default"]
    assert mms and mms[0]["outputs"][0]["dtype"] == "float32"


def test_capture_rejects_bad_arguments():
    built = models.build_named("llama3-tiny")
    with pytest.raises(ce_overlap.CeOverlapError, match="world_size"):
        ce_overlap.capture(built.module, built.example_inputs, world_size=0)
    with pytest.raises(ce_overlap.CeOverlapError, match="param_dtype"):
        ce_overlap.capture(built.module, built.example_inputs, world_size=2, param_dtype="int8")


def test_a_model_that_does_not_compile_is_a_clear_error():
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x).sum()

    with pytest.raises(ce_overlap.CeOverlapError, match="torch.compile of the model failed"):
        ce_overlap.capture(Breaks(), (torch.randn(2, 4),), world_size=2)


def test_llama3_8b_world_size_8_blocks_and_bytes(capture_zoo):
    """The acceptance check, on the IR the CLI captures (blocks 3 and 4 traced, extrapolated: test_extrapolate.py holds
    that equal to tracing them all): 32 blocks; per-block all-gather/reduce-scatter bytes are the block's parameter
    bytes in bf16; totals are 8,030,261,248 x 2."""
    ir = capture_zoo("llama3-8b", 8)
    assert ir.meta["capture"] == "blocks traced at depths 3 and 4, extrapolated to 32"
    assert ir.meta["num_params"] == 8_030_261_248 and ir.meta["world_size"] == 8
    cfg = LLAMA_CONFIGS["llama3-8b"]
    assert len(ir.blocks) == 32
    assert [b["path"] for b in ir.blocks] == [f"layers.{i}" for i in range(32)]
    per_block = _block_param_numel(cfg) * 2
    ag = _collective_bytes_by_block(_nodes(ir, "forward"), "all_gather")
    rs = _collective_bytes_by_block(_nodes(ir, "backward"), "reduce_scatter")
    assert [ag[i] for i in range(32)] == [per_block] * 32
    assert [rs[i] for i in range(32)] == [per_block] * 32
    assert sum(ag.values()) == sum(rs.values()) == 8_030_261_248 * 2
    report = ce_overlap.analyze(ir, "h100-sxm")
    assert [b["forward_all_gather_bytes"] for b in report["blocks"]] == [per_block] * 32
    assert [b["reduce_scatter_bytes"] for b in report["blocks"]] == [per_block] * 32
    assert report["totals"]["forward_all_gather_bytes"] == 8_030_261_248 * 2
    assert report["totals"]["reduce_scatter_bytes"] == 8_030_261_248 * 2


def test_skipping_inductors_fake_value_refresh_leaves_the_ir_byte_identical(monkeypatch):
    """Capture skips Inductor's second FakeTensorProp (fx/capture.py); it must not change anything recorded."""
    import json

    from ce_overlap.inductor import capture as capture_mod

    def ir_text(refresh: bool) -> str:
        monkeypatch.setattr(capture_mod, "_REFRESH_FAKE_VALUES", refresh)
        built = models.build_named("llama3-tiny")
        doc = json.loads(ce_overlap.capture(built.module, built.example_inputs, world_size=4).to_json())
        doc["meta"].pop("capture_seconds", None)
        return json.dumps(doc, sort_keys=True)

    assert ir_text(False) == ir_text(True)


def test_a_backend_failure_names_the_error_the_backend_raised():
    """torch 2.11 raises BackendCompilerFailed with no chained cause, the backend's error on the line after
    "raised:" (e.g. its overlap scheduler's flop counter on grouped-query flash attention): the message leads with
    it."""
    from ce_overlap.inductor.capture import _failure_message

    class BackendCompilerFailed(Exception):
        pass

    e = BackendCompilerFailed("backend='compile_fx' raised:\nAssertionError: sdpa_flop_count: query/key/value shapes "
                              "are incompatible\n\nSet TORCHDYNAMO_VERBOSE=1 for the internal stack trace")
    msg = _failure_message(e)
    assert msg.startswith("AssertionError: sdpa_flop_count: query/key/value shapes are incompatible")
    assert "raised as BackendCompilerFailed: backend='compile_fx' raised" in msg
