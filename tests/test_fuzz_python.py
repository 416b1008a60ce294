"""Property-based tests of the Python entry points that take outside input (the C++ loaders are also fuzzed
with libFuzzer: scripts/check_native.sh). Every rejection is the one documented exception type,
ce_overlap.CeOverlapError, in the API, and exit code 2 with one line in the CLI; nothing else escapes."""
from __future__ import annotations

import contextlib
import io
import json
import os

import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ce_overlap
from ce_overlap import _core, cli, profiles
from ce_overlap.errors import CeOverlapError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEED_IR = open(os.path.join(REPO, "tests", "fuzz", "ir", "small.json"), encoding="utf-8").read()
SEED_PROFILE = profiles.read_text("h200-sxm")

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=12)


def _paths(value, prefix=()):
    """Every (path, value) inside a JSON value, the root included."""
    yield prefix, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _set(doc, path, value):
    if not path:
        return value
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@st.composite
def mutated(draw, seed_text: str):
    """The seed document with one to three sub-values replaced, deleted or given an extra key."""
    doc = json.loads(seed_text)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in _paths(doc)]
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "delete", "extra"]))
        if action == "replace" or not path:
            doc = _set(doc, path, draw(json_values))
        elif action == "delete":
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
        else:
            parent = doc
            for key in path[:-1]:
                parent = parent[key]
            if isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
    text = json.dumps(doc, allow_nan=True)
    if draw(st.booleans()):  # sometimes cut it short or splice bytes in
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=4)) + text[cut:][: draw(st.integers(0, len(text)))]
    return text


def _loads_or_rejects(load, text):
    try:
        return load(text)
    except CeOverlapError as e:
        assert str(e).strip(), "a rejection must say what is wrong"
        return None


@FAST
@given(mutated(SEED_IR))
def test_ir_loader_accepts_or_raises_ce_overlap_error(text):
    ir = _loads_or_rejects(ce_overlap.Ir.from_json, text)
    if ir is not None:
        assert ce_overlap.Ir.from_json(ir.to_json()).to_json() == ir.to_json()  # canonical round trip


@FAST
@given(st.text(max_size=200))
def test_ir_loader_on_arbitrary_text(text):
    _loads_or_rejects(ce_overlap.Ir.from_json, text)


@FAST
@given(mutated(SEED_PROFILE))
def test_profile_loader_accepts_or_raises_ce_overlap_error(text):
    profile = _loads_or_rejects(_core.Profile.from_json, text)
    if profile is not None:
        _core.Profile.from_json(profile.to_json())  # what it saves, it loads


@FAST
@given(mutated(SEED_IR))
def test_analyze_of_any_accepted_ir_returns_a_report_or_rejects(text):
    ir = _loads_or_rejects(ce_overlap.Ir.from_json, text)
    if ir is not None:
        try:
            report = ce_overlap.analyze(ir, "h200-sxm")
        except CeOverlapError:
            return
        assert report["schema"].startswith("ce_overlap.analysis/")


_ARG_TOKENS = st.sampled_from([
    "analyze", "capture", "list", "topo", "--world-size", "--profile", "--json", "--seq-len", "--batch",
    "--param-dtype", "--trace", "-o", "--output", "--no-cache", "--full-capture", "--no-fsdp", "0", "-1", "3", "1e9", "nan", "",
    "h200-sxm", "no-such-profile", "no-such-model", "missing.json", "missing.py:build", "x.py", "--bogus", "-",
    "{", "bfloat16", "int7",
])


@settings(max_examples=100, deadline=None)
@given(st.lists(_ARG_TOKENS, max_size=6))
def test_cli_arguments_exit_0_or_2_with_one_line(tmp_path_factory, argv):
    # No zoo model name is in the token set, so nothing here starts a capture (those paths are in test_cli.py).
    os.environ["CE_OVERLAP_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse usage errors
            code = e.code
    assert code in (0, 2), (argv, code, err.getvalue())
    if code == 2:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        assert lines and "Traceback" not in err.getvalue(), (argv, err.getvalue())


BAD_BUILDS = {
    "returns_none.py": "def build():\n    return None\n",
    "wrong_tuple.py": "def build():\n    return (1, 2, 3)\n",
    "not_a_module.py": "def build():\n    return 'model', ()\n",
    "syntax_error.py": "def build(:\n",
    "raises_on_import.py": "raise RuntimeError('boom at import')\n",
    "build_not_callable.py": "build = 3\n",
    "build_needs_args.py": "def build(x):\n    return x\n",
    "exits.py": "import sys\ndef build():\n    sys.exit(7)\n",
}


def test_bad_build_targets_exit_2_with_one_line(tmp_path):
    for name, text in BAD_BUILDS.items():
        (tmp_path / name).write_text(text)
    names = sorted(BAD_BUILDS)
    results = [run_cli("analyze", f"{tmp_path / name}:build", "--world-size", "2",
                       env_extra={"CE_OVERLAP_CACHE": str(tmp_path / "cache")}) for name in names]
    for name, proc in zip(names, results):
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, (name, proc.stderr)
