"""Checks of the source tree a reader can repeat (issue 23): the import graph of python/ce_overlap has no circle (counting
imports inside functions too: a lazy import is still a dependency), no module imports another's private name, and no
source file outside tests/ is over 800 lines."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "python", "ce_overlap")
MAX_LINES = 800
# Compiled extension modules: private by name, imported by design.
EXTENSIONS = {"_core", "_c10d", "_runtime", "_symalloc"}


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the package."""
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(PKG))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = path
    return out


def _imports(name: str, path: str, modules: dict[str, str]):
    """(imported module, imported name or None, line) for every import of the package's modules in `name`."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "ce_overlap":
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "ce_overlap":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, _, _ in _imports(m, path, modules):
            if target in modules and target != m:
                edges[m].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _is_ancestor(a: str, b: str) -> bool:
    """A package imports its own submodules and a submodule its package's names: not a circle of two modules."""
    return b.startswith(a + ".") or a.startswith(b + ".")


def test_the_import_graph_has_no_circle():
    edges = _graph()
    edges = {m: {t for t in ts if not _is_ancestor(m, t)} for m, ts in edges.items()}
    assert "ce_overlap.inductor.pass_" in edges and edges["ce_overlap.inductor.capture"], "the walk found the package"
    cycle = _cycle(edges)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_imports_another_modules_private_name():
    modules = _modules()
    bad = []
    for m, path in modules.items():
        for target, name, line in _imports(m, path, modules):
            private = name is not None and name.startswith("_") and not name.startswith("__") and name not in EXTENSIONS
            private_module = name is None and target.rpartition(".")[2].startswith("_") and \
                not target.rpartition(".")[2].startswith("__") and target.rpartition(".")[2] not in EXTENSIONS
            if (private or private_module) and target != m:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {target} {name or ''}")
        # module._name on a module of the package imported by name
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        local = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ce_overlap")):
                local.update({a.asname or a.name: a.name for a in node.names})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in local and \
                    node.attr.startswith("_") and not node.attr.startswith("__") and \
                    local[node.value.id] not in EXTENSIONS:
                bad.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _source_files():
    for top in ("python", "csrc", "bench", "scripts"):
        for dirpath, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d not in ("tests", "__pycache__", "results")]
            for f in files:
                if f.endswith((".py", ".cc", ".cu", ".h", ".cuh", ".sh")):
                    yield os.path.join(dirpath, f)


def test_no_source_file_outside_tests_is_over_800_lines():
    files = list(_source_files())
    assert len(files) > 50, "the walk found the sources"
    long = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not long, f"over {MAX_LINES} lines:\n" + "\n".join(long)


@pytest.mark.parametrize("edges, circle", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
                                           ({"a": {"b"}, "b": {"c"}, "c": set()}, False)])
def test_the_circle_finder_finds_circles(edges, circle):
    assert (_cycle(edges) is not None) == circle


def test_every_public_name_the_readme_uses_imports_from_where_it_says():
    """README.md's `ce_overlap.x.y` names resolve: a module, or a name in the deepest module on the path (the ways in
    keep working across moves of the files behind them, issue 57)."""
    import importlib
    import re

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        names = sorted(set(re.findall(r"\bce_overlap(?:\.[A-Za-z_]\w*)+", f.read())))
    assert "ce_overlap.fully_shard" in names and "ce_overlap.fsdp.use_copy_engines" in names, "the walk found them"
    for name in names:
        parts = name.split(".")
        for depth in range(len(parts), 0, -1):  # the deepest importable module on the path
            try:
                obj = importlib.import_module(".".join(parts[:depth]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[depth:]:
            assert hasattr(obj, attr), f"README.md names {name}: {'.'.join(parts[:depth])} has no {attr}"
            obj = getattr(obj, attr)


def test_each_way_in_lives_in_a_module_that_names_it():
    """ce_overlap.fully_shard is defined in in_graph/fully_shard.py, FSDP2's integration is the package fsdp/, and no
    two modules of the package are named fsdp.py (issue 57)."""
    import ce_overlap

    assert ce_overlap.fully_shard.__module__ == "ce_overlap.in_graph.fully_shard"
    assert ce_overlap.inductor_options.__module__ == "ce_overlap.inductor.pass_"
    fsdp_files = [m for m, p in _modules().items() if os.path.basename(p) == "fsdp.py"]
    assert fsdp_files == [], fsdp_files
