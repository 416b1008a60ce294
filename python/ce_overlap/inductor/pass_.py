"""The ce_overlap graph pass in Inductor: the post-grad pass object, its cache key, the Inductor options that install it
and the "ce_overlap" torch.compile backend. What it does to one graph is inductor/graph_pass.py.

Entry points (docs/pass.md):
  inductor_options(**fields)              options for torch.compile(model, options=...)
  torch.compile(model, backend="ce_overlap")  Inductor with the pass; config from set_default_config / env
  CeOverlapPass(config)                   the torch._inductor.custom_graph_pass.CustomGraphPass itself
  run_pass(graph, config)                 one graph, returns a PassReport (or None when nothing ran)

"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os

import torch
import torch._inductor.config
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import PassConfig, get_default_config
from ..errors import CeOverlapError
from ..logs import log_once
from .backend_choice import runtime_fingerprint
from .capture_state import capture_mode
from .graph_pass import PassReport, Planner, core_planner, graph_name_of, profile_text, resolve_profile, run_pass

__all__ = [  # with the one-graph API of inductor/graph_pass.py, so `pass_` is the one module a user of the pass imports
    "CONFLICTING_INDUCTOR_OPTIONS", "CeOverlapPass", "PassReport", "Planner", "capture_mode", "ce_overlap_backend",
    "conflicting_options", "core_planner", "graph_name_of", "inductor_options", "register_backend", "resolve_profile",
    "run_pass", "source_fingerprint", "user_post_grad_passes",
]


def process_rank() -> int | None:
    """This process's rank in the default group; None without torch.distributed."""
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


# --------------------------------------------------------------------------------------------------
# Inductor integration


# The Python sources whose change may change a rewritten graph (beside the C++ planner library): every module of
# inductor/ (the pass, the rewriter, the IR conversion, the backend choice, the lowerings) and of in_graph/ (the
# graph fully_shard traces), the config and the IR wrapper.
_PASS_SOURCE_DIRS = ("inductor", "in_graph")
_PASS_SOURCE_FILES = ("config.py", "ir.py", "logs.py")


def _pass_sources(pkg: str) -> list[str]:
    modules = sorted(os.path.join(d, f) for d in _PASS_SOURCE_DIRS for f in os.listdir(os.path.join(pkg, d))
                     if f.endswith(".py"))
    return modules + list(_PASS_SOURCE_FILES)


@functools.lru_cache(maxsize=None)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "missing"
    return _file_digest(path, st.st_mtime_ns, st.st_size)


def source_fingerprint() -> str:
    """Hash of the pass's Python sources and the C++ planner library."""
    from .. import _core

    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for rel in _pass_sources(pkg):
        h.update(rel.encode())
        h.update(_digest(os.path.join(pkg, rel)).encode())
    h.update(_digest(os.path.abspath(_core.__file__)).encode())
    return h.hexdigest()


class CeOverlapPass(CustomGraphPass):
    """torch._inductor post_grad_custom_post_pass: buckets, reorders and moves collectives to CE. `run_before`: post-grad
    passes that were configured already (a user's own), run first on each graph, in their order, so the plan is made
    on the graph they leave; the uuid covers them (None, i.e. no caching, when one of them has no uuid)."""

    def __init__(self, config: PassConfig | None = None, planner: Planner | None = None, run_before: tuple = ()):
        self.config = config if config is not None else get_default_config()
        self.planner = planner
        self.run_before = tuple(run_before)
        self.reports: list[PassReport] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        for user_pass in self.run_before:
            user_pass(graph)
        report = run_pass(graph, self.config, planner=self.planner)
        if report is not None:
            self.reports.append(report)

    def uuid(self) -> str | None:
        before = []
        for user_pass in self.run_before:
            uid = user_pass.uuid() if hasattr(user_pass, "uuid") else None
            if uid is None:
                return None  # a pass Inductor cannot key: no caching for the composition either
            before.append(repr(uid))
        h = hashlib.sha256()
        h.update(json.dumps(before).encode())
        h.update(json.dumps(self.config.to_dict(), sort_keys=True).encode())
        h.update(source_fingerprint().encode())
        profile = resolve_profile(self.config.profile)
        try:
            h.update(profile_text(profile).encode())
        except CeOverlapError:
            h.update(b"profile-unreadable")
        h.update(runtime_fingerprint().encode())
        # The rank is in the key: the pass agrees with the other ranks of a graph's groups before it rewrites
        # (inductor/agreement.py), so a rank must not load a graph another rank compiled while it waits for that
        # rank's plan (ranks whose graphs are alike would race for one cache entry, and the loser never publish);
        # and the rewritten graph can depend on the rank (a reduce-scatter summed in the consumer reads this rank's
        # own chunk) where the graph Inductor keys on does not. A rerun finds every rank's own entry.
        h.update(f"rank={process_rank()}".encode())
        h.update(torch.__version__.encode())
        if self.planner is not None:
            h.update(repr(self.planner).encode())
        return "ce_overlap-" + h.hexdigest()

    def __repr__(self) -> str:
        return f"CeOverlapPass({self.config!r})"


# Inductor settings that reorder or bucket collectives themselves: with the pass they would undo or
# fight the plan. (key, value that turns it off). Keys missing in the installed torch are skipped.
CONFLICTING_INDUCTOR_OPTIONS = (
    ("reorder_for_compute_comm_overlap", False),
    ("reorder_for_peak_memory", False),
    ("aten_distributed_optimizations.enable_overlap_scheduling", False),
    ("aten_distributed_optimizations.enable_simple_overlap", False),
    ("aten_distributed_optimizations.enable_low_contention_collectives", False),
    ("bucket_all_gathers_fx", "none"),
    ("bucket_reduce_scatters_fx", "none"),
    ("bucket_all_reduces_fx", "none"),
)


def conflicting_options(current: dict | None = None) -> tuple[dict, list[str]]:
    """(options turning Inductor's own overlap/bucketing passes off, notes on what changed)."""
    if current is None:
        current = torch._inductor.config.get_config_copy()
    options, changed = {}, []
    for key, off in CONFLICTING_INDUCTOR_OPTIONS:
        if key not in current:
            continue
        options[key] = off
        if current[key] != off:
            changed.append(f"{key} (was {current[key]!r})")
    return options, changed


def user_post_grad_passes(configured) -> tuple:
    """The post-grad passes configured besides ours (Inductor's post_grad_custom_post_pass: one pass, or a list in
    newer torch), an earlier ce_overlap pass dropped (it is replaced) and one it already composed kept."""
    passes = list(configured) if isinstance(configured, (list, tuple)) else ([configured] if configured else [])
    out = []
    for p in passes:
        if isinstance(p, CeOverlapPass):
            out.extend(p.run_before)
        else:
            out.append(p)
    return tuple(out)


def inductor_options(config: PassConfig | None = None, **fields) -> dict:
    """Options for torch.compile(model, options=...): installs the pass as Inductor's
    post_grad_custom_post_pass and (unless keep_inductor_overlap) turns off Inductor's conflicting
    collective passes. Give a PassConfig or its fields; neither: the default config. A post-grad pass already
    configured (torch._inductor.config.post_grad_custom_post_pass, e.g. a user's own) is kept: it runs first on each
    graph, then ce_overlap's, and the cache key covers both (vLLM's PostGradPassManager composes the same way)."""
    if config is not None and fields:
        raise CeOverlapError("inductor_options: pass a PassConfig or fields, not both")
    if config is None:
        config = PassConfig.from_env(**fields) if fields else get_default_config()
    elif not isinstance(config, PassConfig):
        raise CeOverlapError(f"inductor_options: config must be a PassConfig, got {type(config).__name__}")
    current = torch._inductor.config.get_config_copy()
    # The live value: get_config_copy() deep-copies it, and the user's pass object is the one they hold.
    configured = torch._inductor.config.post_grad_custom_post_pass
    options: dict = {"post_grad_custom_post_pass": CeOverlapPass(config, run_before=user_post_grad_passes(configured))}
    if config.enabled and not config.keep_inductor_overlap:
        off, changed = conflicting_options(current)
        options.update(off)
        log_once(logging.INFO, "ce_overlap: turning off Inductor's own collective bucketing/reordering so the plan "
                                f"holds: {', '.join(k for k in off)}"
                                + (f"; changed: {', '.join(changed)}" if changed else ""))
    return options


def ce_overlap_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """torch.compile(model, backend="ce_overlap"): Inductor with the pass (config: get_default_config())."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_options(get_default_config()))


def register_backend() -> None:
    """Registers "ce_overlap" with torch._dynamo (idempotent). Only needed where the package's
    `torch_dynamo_backends` entry point is not installed (e.g. the sources on PYTHONPATH): an installed
    ce_overlap is found by torch.compile(backend="ce_overlap") through that entry point."""
    from torch._dynamo.backends import registry

    if "ce_overlap" in registry._COMPILER_FNS:
        return
    registry.register_backend(ce_overlap_backend, name="ce_overlap")
