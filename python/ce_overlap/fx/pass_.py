"""The ce_overlap graph pass: Inductor post-grad FX graph -> IR -> Plan (C++) -> checked -> applied.

Entry points (docs/pass.md):
  inductor_options(**fields)              options for torch.compile(model, options=...)
  torch.compile(model, backend="ce_overlap")  Inductor with the pass; config from set_default_config / env
  CeOverlapPass(config)                   the torch._inductor.custom_graph_pass.CustomGraphPass itself
  run_pass(graph, config)                 one graph, returns a PassReport (or None when nothing ran)

A graph the pass cannot handle (IR conversion fails, the planner fails, the Plan breaks a rule) is left
exactly as it was and a warning says why; a rewritten graph that breaks a structural invariant raises
(that is a bug, never a user error).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import os
import threading
import time
import types
from typing import Any, Callable

import torch
import torch._inductor.config
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..config import PassConfig, get_default_config
from ..errors import CeOverlapError
from . import rewrite
from .to_ir import CaptureError, graph_to_ir

log = logging.getLogger("ce_overlap")

_MIB = 1 << 20
_capture_only = contextvars.ContextVar("ce_overlap_capture_only", default=False)
_logged_once: set[str] = set()
_once_lock = threading.Lock()


@contextlib.contextmanager
def capture_mode():
    """While active, graphs are only traced on fake tensors, never executed (ce_overlap.capture): CE ops
    may be emitted whenever the runtime library loads, even with no GPU."""
    token = _capture_only.set(True)
    try:
        yield
    finally:
        _capture_only.reset(token)


def _log_once(level: int, message: str) -> None:
    with _once_lock:
        if message in _logged_once:
            return
        _logged_once.add(message)
    log.log(level, message)


# --------------------------------------------------------------------------------------------------
# Profile and CE runtime state


def resolve_profile(name: str) -> str:
    """A built-in profile name or a file path; "auto" picks one from this process's GPU (ce_overlap.profiles.resolve,
    the one resolver), saying once when none fits it."""
    from .. import profiles

    profile, how = profiles.resolve(name)
    if "no built-in profile fits" in how:
        _log_once(logging.WARNING, f"ce_overlap: profile {how}")
    return profile


@functools.lru_cache(maxsize=None)
def _profile_text(name: str) -> str:
    from .. import profiles

    return profiles.read_text(name)


def ce_runtime_state(device_type: str | None) -> tuple[bool, str]:
    """(usable, reason) for emitting ce_overlap ops into a graph whose collectives run on `device_type`."""
    from .. import runtime

    lib = runtime.library_loaded()
    if not lib:
        return False, lib.reason
    if _capture_only.get():
        return True, "capture only (fake tensors): the library's Meta kernels suffice"
    if device_type != "cuda":
        return False, f"the graph's collectives run on {device_type or 'an unknown device'}; CE ops need CUDA tensors"
    avail = runtime.available()
    if not avail:
        return False, avail.reason
    ok, why = _ce_lowering_support()
    if not ok:
        return False, why
    return True, avail.reason


def _group_ready(group: str) -> tuple[bool, str]:
    if _capture_only.get():
        return True, ""
    try:
        if torch.ops.ce_overlap._has_group(group):
            return True, ""
    except (AttributeError, RuntimeError) as e:
        return False, str(e)
    return False, (f"process group '{group}' has no CE pool: call ce_overlap.runtime.rendezvous(group) on every rank "
                   "before the first compiled step")


def _runtime_fingerprint() -> str:
    """What of the CE runtime's state decides the rewrite (part of the cache key)."""
    from .. import runtime

    lib = runtime.library_loaded()
    parts = [f"lib={lib.ok}"]
    if lib.ok:
        names = [*rewrite.CE_OPS.values(), *rewrite.CE_MANY_OPS.values(), rewrite.CE_UNREDUCED_OP]
        parts.append(f"ops={[n for n in names if hasattr(torch.ops.ce_overlap, n)]}")
        parts.append(f"available={runtime.available().ok}")
        parts.append(f"groups={runtime.rendezvoused_groups()}")
    return ";".join(parts)


def _process_rank() -> int | None:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001
        return None


_lowered: set[str] = set()


def register_ce_lowerings() -> None:
    """Inductor lowerings for the CE ops, modelled exactly like the functional collectives': the
    collective is a _CollectiveKernel (its input stays alive and untouched until the wait) and
    ce_overlap.wait_tensor is a _WaitKernel that hands back its input buffer. Without this Inductor
    lowers them as plain fallbacks, and since ce_overlap::wait_tensor returns its input, Inductor would
    believe the wait's output is fresh memory and reuse the collective's buffer while it is still read
    (seen on torch 2.14: `buf3 = buf1; del buf1  # reuse` then mm(buf2=wait(buf1), out=buf3))."""
    from torch._inductor import ir
    from torch._inductor.lowering import add_layout_constraint, constrain_to_fx_strides, register_lowering
    from torch.utils import _pytree as pytree

    def register(op):
        add_layout_constraint(op, constrain_to_fx_strides)
        return register_lowering(op)

    def lower_one(op):
        def lowering(inp, *args):
            inp = ir.ExternKernel.require_contiguous(inp)
            return ir.TensorBox.create(ir._CollectiveKernel.create_out_of_place(op, inp, *args))
        return lowering

    def lower_many(op):  # a whole bucket in one op: lowered like the coalesced functional collectives
        def lowering(inputs, *args):
            inputs = [ir.ExternKernel.require_contiguous(x) for x in inputs]
            return pytree.tree_map(ir.TensorBox.create, ir._CollectiveKernel.create_out_of_place(op, inputs, *args))
        return lowering

    for names, make in ((rewrite.CE_OPS.values(), lower_one),
                        ((*rewrite.CE_MANY_OPS.values(), rewrite.CE_UNREDUCED_OP), lower_many)):
        for name in names:
            if name in _lowered or not hasattr(torch.ops.ce_overlap, name):
                continue
            packet = getattr(torch.ops.ce_overlap, name)
            register(packet)(make(packet.default))
            _lowered.add(name)

    class _CeWaitKernel(ir._WaitKernel):
        """Inductor's wait keeps the collective's input alive until it runs ("volatile reads"), but for a
        multi-output collective only input i for output i. A CE multi-tensor op reads every input for every
        output (one staged stream of bytes), so each of its waits keeps ALL of the op's inputs alive: no buffer
        of the bucket is reused while the copy engines may still read it."""

        def get_volatile_reads(self):
            inp = self.inputs[0]
            coll = inp.inputs[0] if isinstance(inp, ir.MultiOutput) and inp.inputs else inp
            if isinstance(coll, ir._CollectiveKernel) and not isinstance(coll, ir._WaitKernel):
                return [x for x in coll.inputs if isinstance(x, ir.IRNode)]
            return super().get_volatile_reads()

    if "wait_tensor" not in _lowered and hasattr(torch.ops.ce_overlap, "wait_tensor"):
        def lower_wait(inp):
            _CeWaitKernel.create_wait(torch.ops.ce_overlap.wait_tensor.default, inp)
            return inp

        register(torch.ops.ce_overlap.wait_tensor)(lower_wait)
        _lowered.add("wait_tensor")


def _ce_lowering_support() -> tuple[bool, str]:
    """Whether this torch has the Inductor pieces register_ce_lowerings needs."""
    from torch._inductor import ir

    for attr in ("_CollectiveKernel", "_WaitKernel"):
        if not hasattr(ir, attr):
            return False, f"torch {torch.__version__} has no torch._inductor.ir.{attr} to lower CE ops with"
    if not hasattr(ir._CollectiveKernel, "create_out_of_place") or not hasattr(ir._WaitKernel, "create_wait"):
        return False, f"torch {torch.__version__}'s Inductor collective kernels lack create_out_of_place/create_wait"
    return True, ""


# --------------------------------------------------------------------------------------------------
# Planning


Planner = Callable[[Any, str, PassConfig, str], dict]


def core_planner(ir, graph_name: str, config: PassConfig, profile: str) -> dict:
    """The C++ planner (_core.plan, through ce_overlap.ir.plan): IR -> Plan dict."""
    from .. import ir as ir_mod

    plan_fn = getattr(ir_mod, "plan", None)
    if plan_fn is None:
        raise CeOverlapError("the C++ planner (ce_overlap.ir.plan / _core.plan) is not available in this build")
    return plan_fn(ir, graph=graph_name, profile=profile, config=config.plan_config())


# --------------------------------------------------------------------------------------------------
# The pass on one graph


@dataclasses.dataclass
class PassReport:
    graph: str
    nodes_before: int
    nodes_after: int
    collectives: int
    buckets: list[rewrite.BucketResult]
    summary: dict
    plan_ms: float
    rewrite_ms: float
    dumped: list[str]
    changed: bool
    refused: str | None = None

    @property
    def ce_buckets(self) -> int:
        return sum(b.backend == "ce" for b in self.buckets)

    def line(self) -> str:
        if self.refused:
            return f"ce_overlap: {self.graph} graph: {self.refused}; graph unchanged"
        s = self.summary
        kept = sum(b.planned_backend == "ce" and b.backend != "ce" for b in self.buckets)
        delta = s.get("peak_memory_bytes_after", 0) - s.get("peak_memory_bytes_before", 0)
        text = (f"ce_overlap: {self.graph} graph ({self.nodes_before} -> {self.nodes_after} nodes): "
                f"{self.collectives} collectives -> {len(self.buckets)} buckets "
                f"({sum(b.members > 1 for b in self.buckets)} merged), {self.ce_buckets} moved to CE; "
                f"predicted exposed comm {s.get('exposed_comm_us_before', 0.0):.1f} us -> "
                f"{s.get('exposed_comm_us_after', 0.0):.1f} us; peak memory {delta / _MIB:+.1f} MiB "
                f"(budget {s.get('memory_budget_bytes', 0) / _MIB:.0f} MiB); "
                f"plan {self.plan_ms:.0f} ms, rewrite {self.rewrite_ms:.0f} ms")
        if kept:
            text += f"; {kept} bucket(s) planned for CE kept on NCCL (see above)"
        if self.dumped:
            text += f"; wrote {', '.join(self.dumped)}"
        return text


def graph_name_of(graph: torch.fx.Graph) -> str:
    """"backward" if the graph takes tangents (AOTAutograd's backward), else "forward"."""
    for node in graph.nodes:
        if node.op != "placeholder":
            break
        if node.name.startswith("tangents"):
            return "backward"
    return "forward"


def _ir_document(graph: torch.fx.Graph, name: str):
    from .. import _core
    from ..ir import Ir

    gm = graph.owning_module if graph.owning_module is not None else types.SimpleNamespace(graph=graph)
    doc = {"schema": "ce_overlap.ir/1",
           "meta": {"source": "ce_overlap pass", "torch": torch.__version__, "graph": name},
           "blocks": [], "graphs": [graph_to_ir(gm, name)]}
    core_doc = _core.IrDocument.from_json(json.dumps(doc))
    core_doc.detect_blocks()
    return Ir(core_doc)


def _dump(config: PassConfig, name: str, ir_text: str, plan: dict | None) -> list[str]:
    if not config.dump_dir:
        return []
    os.makedirs(config.dump_dir, exist_ok=True)
    stem = f"{name}-{hashlib.sha256(ir_text.encode()).hexdigest()[:12]}"
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            stem += f"-rank{dist.get_rank()}"
    except Exception:  # noqa: BLE001
        pass
    written = []
    path = os.path.join(config.dump_dir, stem + ".ir.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(ir_text)
    written.append(path)
    if plan is not None:
        path = os.path.join(config.dump_dir, stem + ".plan.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(plan, f, indent=1, sort_keys=False)
            f.write("\n")
        written.append(path)
    return written


# Collective types whose in-graph (functional) form on CUDA tensors crashes the process when the group's backend for
# CUDA is gloo: measured on torch 2.11 (a segfault in wait_tensor, eager and compiled alike; pytorch/pytorch#152645).
GLOO_CUDA_CRASHES = ("all_gather",)


def _cuda_backend_of(group_name: str) -> str | None:
    """The name of the backend that runs the group's CUDA tensors ("nccl", "gloo", "ce_overlap", ...); None when it
    cannot be known (capture on fake tensors, torch.distributed not initialized)."""
    if _capture_only.get():
        return None
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        return pg._get_backend(torch.device("cuda")).name()
    except Exception:  # noqa: BLE001 (a group torch cannot resolve: nothing to say about it)
        return None


def _ce_possible(config: PassConfig, cb: rewrite.CheckedBucket, device: str | None) -> tuple[bool, str]:
    """Whether this bucket can run on the copy engines (config, runtime, op, group), and why not."""
    if config.ce == "off":
        return False, "PassConfig.ce is 'off'"
    if cb.type not in config.ce_collectives:
        return False, f"PassConfig.ce_collectives excludes {cb.type}"
    ok, why = ce_runtime_state(device)
    if not ok:
        return False, f"CE runtime unavailable ({why})"
    op, why = rewrite.ce_op_for(cb.type)
    if op is None:
        return False, why
    return _group_ready(cb.members[0].group)


def _backend_chooser(config: PassConfig, graph_name: str):
    def choose(cb: rewrite.CheckedBucket) -> tuple[str, str]:
        val = cb.members[0].input.meta.get("val") if cb.members[0].input is not None else None
        device = val.device.type if isinstance(val, torch.Tensor) else None
        if device == "cuda" and cb.type in GLOO_CUDA_CRASHES and _cuda_backend_of(cb.members[0].group) == "gloo":
            # The group's own backend would be gloo on CUDA tensors, which crashes in-graph: copy engines, or an error.
            ok, why = _ce_possible(config, cb, device)
            if ok:
                return "ce", (f"ce: the group runs CUDA tensors on gloo, whose in-graph {cb.type} crashes the process "
                              "(pytorch/pytorch#152645); the copy engine is the in-graph path")
            raise CeOverlapError(
                f"ce_overlap: {graph_name} bucket {cb.id} ({cb.type} x{len(cb.members)}) would run in the graph on "
                f"group '{cb.members[0].group}', whose backend for CUDA tensors is gloo: gloo's in-graph {cb.type} on "
                "CUDA tensors crashes the process (a segfault in torch 2.11, pytorch/pytorch#152645), and the copy "
                f"engine cannot take it here ({why}). Give CUDA tensors NCCL (init_process_group('cpu:gloo,cuda:nccl'))"
                ", or let copy engines run them (ce='auto' or 'on', the CE runtime built, "
                "ce_overlap.runtime.rendezvous(group) before the first step)")
        if cb.backend != "ce":
            return "nccl", cb.reason
        if config.ce == "off":
            return "nccl", "nccl: PassConfig.ce is 'off'"
        if cb.type not in config.ce_collectives:
            return "nccl", f"nccl: PassConfig.ce_collectives excludes {cb.type}"
        ok, why = ce_runtime_state(device)  # loads the library, which registers the ops
        if not ok:
            _log_once(logging.WARNING, f"ce_overlap: CE runtime unavailable ({why}): keeping NCCL")
            return "nccl", f"nccl: CE runtime unavailable ({why})"
        op, why = rewrite.ce_op_for(cb.type)
        if op is None:
            _log_once(logging.INFO, f"ce_overlap: {cb.type} buckets stay on NCCL: {why}")
            return "nccl", f"nccl: {why}"
        ok, why = _group_ready(cb.members[0].group)
        if not ok:
            _log_once(logging.WARNING, f"ce_overlap: CE runtime unavailable ({why}): keeping NCCL")
            return "nccl", f"nccl: {why}"
        return "ce", cb.reason
    return choose


def run_pass(graph: torch.fx.Graph, config: PassConfig | None = None, *, planner: Planner | None = None,
             graph_name: str | None = None) -> PassReport | None:
    """Runs the pass on one post-grad graph in place. Returns its report (None when disabled)."""
    config = config if config is not None else get_default_config()
    if not config.enabled:
        return None
    name = graph_name or graph_name_of(graph)
    nodes_before = len(graph.nodes)
    started = time.perf_counter()

    def refuse(why: str, ir_text: str | None = None, plan: dict | None = None) -> PassReport:
        dumped = _dump(config, name, ir_text, plan) if ir_text is not None else []
        report = PassReport(graph=name, nodes_before=nodes_before, nodes_after=len(graph.nodes), collectives=0,
                            buckets=[], summary={}, plan_ms=0.0, rewrite_ms=0.0, dumped=dumped, changed=False,
                            refused=why)
        log.warning("%s", report.line())
        return report

    if not any(rewrite.is_functional_collective(n) for n in graph.nodes):
        report = PassReport(graph=name, nodes_before=nodes_before, nodes_after=nodes_before, collectives=0,
                            buckets=[], summary={}, plan_ms=0.0, rewrite_ms=0.0, dumped=[], changed=False)
        log.info("ce_overlap: %s graph (%d nodes): no collectives, unchanged", name, nodes_before)
        return report
    for node in graph.nodes:
        if rewrite.is_functional_collective(node):
            vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
            if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in vals):
                return refuse(f"collective {node.name} has symbolic (dynamic) sizes, which the IR cannot express")
    try:
        ir = _ir_document(graph, name)
    except (CaptureError, CeOverlapError) as e:
        return refuse(f"cannot express the graph as IR ({e})")
    ir_text = ir.to_json()
    profile = resolve_profile(config.profile)
    try:
        plan = (planner or core_planner)(ir, name, config, profile)
    except CeOverlapError as e:
        return refuse(f"planning failed ({e})", ir_text)
    plan_ms = (time.perf_counter() - started) * 1e3
    try:
        checked = rewrite.check_plan(graph, plan)
    except rewrite.PlanRuleError as e:
        return refuse(f"refused the plan: {e}", ir_text, plan)
    t0 = time.perf_counter()
    results = rewrite.apply_plan(graph, checked, _backend_chooser(config, name),
                                 check_where=name if config.check_numerics and not _capture_only.get() else None,
                                 pack_ce=config.pack_ce_buckets, ce_reduction=config.ce_reduction)
    if any(b.backend == "ce" for b in results) and not _capture_only.get():
        register_ce_lowerings()
    rewrite.check_invariants(graph)
    if graph.owning_module is not None:
        graph.owning_module.recompile()
    rewrite_ms = (time.perf_counter() - t0) * 1e3
    report = PassReport(graph=name, nodes_before=nodes_before, nodes_after=len(graph.nodes),
                        collectives=sum(b.members for b in results), buckets=results,
                        summary=dict(plan.get("summary", {})), plan_ms=plan_ms, rewrite_ms=rewrite_ms,
                        dumped=_dump(config, name, ir_text, plan), changed=True)
    if config.verbose:
        for b in results:
            log.info("ce_overlap: %s bucket %d: %s x%d, %.2f MiB, %s%s", name, b.id, b.type, b.members,
                     b.bytes / _MIB, b.reason, "" if b.backend == b.planned_backend else " (planned ce)")
    log.info("%s", report.line())
    return report


# --------------------------------------------------------------------------------------------------
# Inductor integration


_PASS_SOURCES = ("fx/pass_.py", "fx/rewrite.py", "fx/check.py", "fx/to_ir.py", "fx/flops.py", "config.py", "ir.py")


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
    for rel in _PASS_SOURCES:
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
            h.update(_profile_text(profile).encode())
        except CeOverlapError:
            h.update(b"profile-unreadable")
        h.update(_runtime_fingerprint().encode())
        # The rewritten graph can depend on this process's rank (a reduce-scatter summed in the consumer reads this
        # rank's own chunk), while the graph Inductor's FX cache keys on is the same on every rank: without the
        # rank in the key, ranks sharing a cache directory would load each other's graphs. Configs that cannot
        # produce such a graph keep one key for all ranks (a shared cache stays shared).
        c = self.config
        if c.ce != "off" and c.ce_reduction == "consumer" and "reduce_scatter" in c.ce_collectives:
            h.update(f"rank={_process_rank()}".encode())
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
        _log_once(logging.INFO, "ce_overlap: turning off Inductor's own collective bucketing/reordering so the plan "
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
