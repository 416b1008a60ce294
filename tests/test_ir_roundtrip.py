"""IR JSON from Python: canonical round trip and validation errors surfacing as CeOverlapError."""
from __future__ import annotations

import json

import pytest

import ce_overlap
from ce_overlap import Ir


def test_load_save_is_byte_identical(tiny_ir):
    text = tiny_ir.to_json()
    again = Ir.from_json(text).to_json()
    assert again == text
    assert Ir.from_json(again).to_json() == text


def test_file_round_trip(tiny_ir, tmp_path):
    path = tmp_path / "tiny.json"
    tiny_ir.save(str(path))
    assert Ir.load(str(path)).to_json() == path.read_text()


def _mutated(tiny_ir, mutate):
    doc = tiny_ir.to_dict()
    mutate(doc)
    return json.dumps(doc)


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d.update(schema="ce_overlap.ir/2"), "schema"),
    (lambda d: d["graphs"][0]["nodes"][5].update(kind="kernel"), "kind"),
    (lambda d: d["graphs"][0]["nodes"][0]["outputs"][0].update(bytes=-4), "bytes"),
    (lambda d: d["graphs"][0]["nodes"][0]["outputs"][0]["shape"].__setitem__(0, 2**62), "graphs[0].nodes[0].outputs[0]"),
    (lambda d: d["graphs"][0]["nodes"][3].update(inputs=[3]), "graphs[0].nodes[3]"),
    (lambda d: d["graphs"][0]["nodes"][2].update(flopz=1), "flopz"),
    (lambda d: d["graphs"][0]["nodes"][2].pop("op"), "op"),
])
def test_invalid_documents_are_rejected_with_the_field_named(tiny_ir, mutate, expected):
    with pytest.raises(ce_overlap.CeOverlapError) as err:
        Ir.from_json(_mutated(tiny_ir, mutate))
    assert expected in str(err.value)


def test_a_cycle_is_rejected(tiny_ir):
    def make_cycle(d):
        nodes = d["graphs"][0]["nodes"]
        user = next(n for n in nodes if n["inputs"])
        src = nodes[user["inputs"][0]]
        src["inputs"] = src["inputs"] + [user["id"]]
    with pytest.raises(ce_overlap.CeOverlapError, match="cycle"):
        Ir.from_json(_mutated(tiny_ir, make_cycle))


def test_malformed_json_is_rejected():
    with pytest.raises(ce_overlap.CeOverlapError, match="malformed JSON"):
        Ir.from_json('{"schema": "ce_overlap.ir/1", "graphs": [')


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ce_overlap.CeOverlapError, match="cannot read IR file"):
        Ir.load(str(tmp_path / "absent.json"))
