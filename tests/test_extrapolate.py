"""Block extrapolation (ce_overlap.extrapolate): the graphs of an N-block zoo model written from captures at 3
and 4 blocks must be the graphs torch.compile produces for all N blocks, node for node; anything the two
captures do not explain is refused, and capture then traces every block."""
from __future__ import annotations

import copy
import dataclasses
import functools
import json

import pytest

from ce_overlap.analyzer import model_capture
from ce_overlap import models
from ce_overlap.extrapolate import NotExtrapolable, extrapolate


@functools.cache
def _doc(depth: int, world_size: int = 8, reshard: bool = True, fsdp: bool = True, name: str = "llama3-tiny") -> dict:
    """A real capture at `depth` blocks, as capture_ir's document (blocks not yet detected)."""
    built = models.build_named(name, n_layers=depth)
    options = model_capture._capture_options(world_size, 0, fsdp, "bfloat16", reshard, None)
    return _CAPTURE_DOC(built.module, built.example_inputs, options, {"model": name})


_CAPTURE_DOC = model_capture._capture_doc  # the real one, also while a test replaces it


def _graphs(doc: dict) -> list:
    """The graphs without block ids (detected later, from the module paths the graphs carry)."""
    return [{"name": g["name"], "nodes": [{**n, "block": -1} for n in g["nodes"]]} for g in doc["graphs"]]


@pytest.mark.parametrize("depth", [5, 8])
def test_tiny_extrapolated_equals_the_full_capture(depth):
    got = extrapolate(_doc(3), _doc(4), 3, depth)
    assert _graphs(got) == _graphs(_doc(depth))


@pytest.mark.parametrize("variant", [dict(world_size=2), dict(reshard=False), dict(fsdp=False)],
                         ids=["world2", "no-reshard", "no-fsdp"])
def test_other_capture_options_extrapolate_exactly(variant):
    got = extrapolate(_doc(3, **variant), _doc(4, **variant), 3, 5)
    assert _graphs(got) == _graphs(_doc(5, **variant))


def test_extrapolating_from_four_and_five_blocks_gives_the_same_graphs():
    assert _graphs(extrapolate(_doc(4), _doc(5), 4, 9)) == _graphs(extrapolate(_doc(3), _doc(4), 3, 9))


def test_llama3_8b_extrapolated_equals_the_full_capture():
    """The demo's model at its own widths (4096 wide, GQA 32 / 8 heads, 128,256 vocabulary): 5 blocks from 3 and 4,
    against the capture that traces all 5 (tracing all 32 took a minute of CI; the tiny model's depths 5 and 8 above
    cover the depth)."""
    got = extrapolate(_doc(3, name="llama3-8b"), _doc(4, name="llama3-8b"), 3, 5)
    assert _graphs(got) == _graphs(_doc(5, name="llama3-8b"))


def _cached_capture_doc(seen, model, example_inputs, options, meta):
    """capture_named's capture step, served from the session's tiny captures (same options)."""
    depth = len(model.layers)
    seen.append(depth)
    doc = copy.deepcopy(_doc(depth, options.world_size, options.reshard_after_forward, options.fsdp))
    doc["meta"].update(meta)
    return doc


def test_capture_named_extrapolates_deep_zoo_models_and_detects_their_blocks(monkeypatch):
    seen = []
    monkeypatch.setattr(model_capture, "_capture_doc", functools.partial(_cached_capture_doc, seen))
    ir = model_capture.capture_named("llama3-tiny", world_size=8)  # 2 blocks: traced
    assert ir.meta["capture"] == "every block traced" and seen == [2]
    deep = dataclasses.replace(models.llama.LLAMA_CONFIGS["llama3-tiny"], n_layers=5)
    monkeypatch.setitem(models.llama.LLAMA_CONFIGS, "llama3-tiny", deep)
    seen.clear()
    fast = model_capture.capture_named("llama3-tiny", world_size=8)
    assert seen == [3, 4]
    full = model_capture.capture_named("llama3-tiny", world_size=8, full=True)
    assert seen == [3, 4, 5]
    assert fast.meta["capture"] == "blocks traced at depths 3 and 4, extrapolated to 5"
    assert fast.meta["num_params"] == deep.num_params()
    assert [b["path"] for b in fast.blocks] == [f"layers.{i}" for i in range(5)]
    assert fast.to_dict()["graphs"] == full.to_dict()["graphs"]


def test_a_refused_extrapolation_falls_back_to_tracing_every_block(monkeypatch):
    def refuse(*args, **kwargs):
        raise NotExtrapolable("graph 'forward': test refusal")

    seen = []
    monkeypatch.setattr(model_capture, "_capture_doc", functools.partial(_cached_capture_doc, seen))
    cfg = models.llama.LLAMA_CONFIGS["llama3-tiny"]
    monkeypatch.setitem(models.llama.LLAMA_CONFIGS, "llama3-tiny", dataclasses.replace(cfg, n_layers=5))
    monkeypatch.setattr("ce_overlap.extrapolate.extrapolate", refuse)
    ir = model_capture.capture_named("llama3-tiny", world_size=8)
    assert ir.meta["capture"] == "every block traced (extrapolation refused: graph 'forward': test refusal)"
    assert len(ir.blocks) == 5
    assert seen == [3, 4, 5]  # the two small captures, then all five blocks


def _needs_deeper_at_three(x, y, a, depth):
    from ce_overlap.extrapolate import NeedsDeeperCaptures

    if a == 3:
        raise NeedsDeeperCaptures("graph 'backward': the run at item 1 has 2 copies")
    return extrapolate(x, y, a, depth)


@pytest.mark.parametrize("depth", [13, 8])
def test_a_run_without_an_interior_copy_tries_one_block_deeper_while_that_is_cheaper(monkeypatch, depth):
    seen = []
    monkeypatch.setattr(model_capture, "_capture_doc", functools.partial(_cached_capture_doc, seen))
    cfg = models.llama.LLAMA_CONFIGS["llama3-tiny"]
    monkeypatch.setitem(models.llama.LLAMA_CONFIGS, "llama3-tiny", dataclasses.replace(cfg, n_layers=depth))
    monkeypatch.setattr("ce_overlap.extrapolate.extrapolate", _needs_deeper_at_three)
    ir = model_capture.capture_named("llama3-tiny", world_size=8)
    if depth == 13:  # 3 + 4 + 5 blocks traced < 13
        assert seen == [3, 4, 5]
        assert ir.meta["capture"] == "blocks traced at depths 4 and 5, extrapolated to 13"
        assert _graphs(ir.to_dict()) == _graphs(extrapolate(_doc(3), _doc(4), 3, 13))
    else:  # tracing 5 more would make 12 >= 8: trace all 8 instead
        assert seen == [3, 4, 8]
        assert ir.meta["capture"].startswith("every block traced (extrapolation refused: graph 'backward'")
        assert _graphs(ir.to_dict()) == _graphs(_doc(8))


# ---- refusals ----------------------------------------------------------------------------------------------------

def test_runs_without_an_interior_copy_are_refused():
    with pytest.raises(NotExtrapolable, match="interior"):
        extrapolate(_doc(2), _doc(3), 2, 6)


def test_captures_of_different_models_are_refused():
    other = _doc(4, world_size=2)
    with pytest.raises(NotExtrapolable):
        extrapolate(_doc(3), other, 3, 6)


def test_swapped_captures_are_refused():
    with pytest.raises(NotExtrapolable, match="not only inserted"):
        extrapolate(_doc(4), _doc(3), 3, 6)


def _deeper_mutated(mutate) -> dict:
    y = copy.deepcopy(_doc(4))
    mutate(y["graphs"][0]["nodes"])
    return y


def _interior_mm(nodes) -> dict:
    """An mm of block 1 (an interior copy of the forward block run)."""
    return next(n for n in nodes if n["op"] == "aten.mm.default"
                and any(p == "layers.1" for p, _ in n["module_stack"]))


def test_a_name_counter_that_is_not_affine_is_refused():
    def bump(nodes):
        node = _interior_mm(nodes)
        node["name"] = node["name"].rsplit("_", 1)[0] + "_9999"

    with pytest.raises(NotExtrapolable, match="name counter"):
        extrapolate(_doc(3), _deeper_mutated(bump), 3, 6)


def test_a_module_path_that_is_not_affine_is_refused():
    def move(nodes):
        node = _interior_mm(nodes)
        node["module_stack"] = [[p.replace("layers.1", "layers.7"), t] for p, t in node["module_stack"]]

    with pytest.raises(NotExtrapolable, match="module path"):
        extrapolate(_doc(3), _deeper_mutated(move), 3, 6)


def test_an_input_pattern_that_is_not_affine_is_refused():
    def rewire(nodes):
        node = _interior_mm(nodes)
        node["inputs"] = [0] + node["inputs"][1:]  # now reads the token placeholder

    with pytest.raises(NotExtrapolable):
        extrapolate(_doc(3), _deeper_mutated(rewire), 3, 6)


def test_a_node_whose_inputs_grow_with_depth_is_refused():
    def widen(nodes):
        node = _interior_mm(nodes)
        node["inputs"] = node["inputs"] + [0]

    with pytest.raises(NotExtrapolable):
        extrapolate(_doc(3), _deeper_mutated(widen), 3, 6)


def test_the_target_depth_must_be_deeper():
    with pytest.raises(ValueError, match="depth > 4"):
        extrapolate(_doc(3), _doc(4), 3, 4)


def test_extrapolated_documents_load_in_the_core():
    doc = extrapolate(_doc(3), _doc(4), 3, 8)
    ir = model_capture._from_doc(doc)
    assert len(ir.blocks) == 8
    assert json.loads(ir.to_json())["graphs"][0]["nodes"][-1]["op"] == "output"
