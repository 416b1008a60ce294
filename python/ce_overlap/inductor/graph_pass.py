"""The pass on one post-grad graph: FX graph -> IR (inductor/to_ir.py) -> Plan (the C++ planner) -> checked against the graph
(inductor/rewrite.py check_plan) -> applied (rewrite.apply_plan), each bucket on the backend inductor/backend_choice.py gives it.

A graph the pass cannot handle (IR conversion fails, the planner fails, the Plan breaks a rule) is left exactly as it
was and a warning says why; a rewritten graph that breaks a structural invariant raises (that is a bug, never a user
error)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable

import torch
import torch.fx

from ..config import PassConfig, get_default_config
from ..errors import CeOverlapError
from ..logs import log, log_once
from . import agreement, rewrite
from .backend_choice import backend_chooser
from .capture_state import capturing
from .lowering import register_ce_lowerings
from .to_ir import CaptureError, core_document

_MIB = 1 << 20


def resolve_profile(name: str) -> str:
    """A built-in profile name or a file path; "auto" picks one from this process's GPU (ce_overlap.profiles.resolve,
    the one resolver), saying once when none fits it."""
    from .. import profiles

    profile, how = profiles.resolve(name)
    if "no built-in profile fits" in how:
        log_once(logging.WARNING, f"ce_overlap: profile {how}")
    return profile


@functools.lru_cache(maxsize=None)
def profile_text(name: str) -> str:
    from .. import profiles

    return profiles.read_text(name)



Planner = Callable[[Any, str, PassConfig, str], dict]


def core_planner(ir, graph_name: str, config: PassConfig, profile: str) -> dict:
    """The C++ planner (_core.plan, through ce_overlap.ir.plan): IR -> Plan dict."""
    from .. import ir as ir_mod

    plan_fn = getattr(ir_mod, "plan", None)
    if plan_fn is None:
        raise CeOverlapError("the C++ planner (ce_overlap.ir.plan / _core.plan) is not available in this build")
    return plan_fn(ir, graph=graph_name, profile=profile, config=config.plan_config())



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
    async_tp_ops: int = 0  # torch's micro-pipeline TP fused ops (symm_mem) in the graph: its TP, beside the plan


    @property
    def ce_buckets(self) -> int:
        return sum(b.backend == "ce" for b in self.buckets)

    def line(self) -> str:
        if self.refused:
            return f"ce_overlap: {self.graph} graph: {self.refused}; graph unchanged"
        s = self.summary
        kept = sum(b.planned_backend in ("ce", "hier") and b.backend != b.planned_backend for b in self.buckets)
        hier = sum(b.backend == "hier" for b in self.buckets)
        delta = s.get("peak_memory_bytes_after", 0) - s.get("peak_memory_bytes_before", 0)
        text = (f"ce_overlap: {self.graph} graph ({self.nodes_before} -> {self.nodes_after} nodes): "
                f"{self.collectives} collectives -> {len(self.buckets)} buckets "
                f"({sum(b.members > 1 for b in self.buckets)} merged), {self.ce_buckets} moved to CE"
                f"{f', {hier} hierarchical (CE inside nodes)' if hier else ''}; "
                f"predicted exposed comm {s.get('exposed_comm_us_before', 0.0):.1f} us -> "
                f"{s.get('exposed_comm_us_after', 0.0):.1f} us; peak memory {delta / _MIB:+.1f} MiB "
                f"(budget {s.get('memory_budget_bytes', 0) / _MIB:.0f} MiB); "
                f"plan {self.plan_ms:.0f} ms, rewrite {self.rewrite_ms:.0f} ms")
        if kept:
            text += f"; {kept} bucket(s) planned for CE or hierarchical kept on NCCL (see above)"
        if self.async_tp_ops:
            text += f"; beside {self.async_tp_ops} of torch's async-TP fused ops"
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


def ir_document(graph: torch.fx.Graph, name: str):
    """The IR of one post-grad graph (ce_overlap.ir.Ir over to_ir.core_document), named `name`."""
    from ..ir import Ir

    return Ir(core_document(graph, name, {"source": "ce_overlap pass", "torch": torch.__version__, "graph": name}))


def dump_plan(config: PassConfig, name: str, ir_text: str, plan: dict | None) -> list[str]:
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



def _symbolic_sizes(graph: torch.fx.Graph) -> str | None:
    for node in graph.nodes:
        if rewrite.is_functional_collective(node):
            vals = [a.meta.get("val") for a in node.all_input_nodes] + [node.meta.get("val")]
            if any(isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape) for v in vals):
                return f"collective {node.name} has symbolic (dynamic) sizes, which the IR cannot express"
    return None


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
        dumped = dump_plan(config, name, ir_text, plan) if ir_text is not None else []
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
    ir_text = plan = checked = None
    why = _symbolic_sizes(graph)
    if why is None:
        try:
            ir = ir_document(graph, name)
        except (CaptureError, CeOverlapError) as e:
            why = f"cannot express the graph as IR ({e})"
    if why is None:
        ir_text = ir.to_json()
        try:
            plan = (planner or core_planner)(ir, name, config, resolve_profile(config.profile))
        except CeOverlapError as e:
            why = f"planning failed ({e})"
    plan_ms = (time.perf_counter() - started) * 1e3
    if why is None:
        try:
            checked = rewrite.check_plan(graph, plan, ir=ir)  # the IR the plan was made from
        except rewrite.PlanRuleError as e:
            why = f"refused the plan: {e}"
    # Every rank of each group must rewrite alike: the ranks compare what they would issue (inductor/agreement.py).
    disagreement = agreement.agree(graph, name, plan if why is None else None, config.agree_timeout_s)
    if why is None and disagreement is not None:
        why = (f"{disagreement}; the graph is left as captured on every rank its groups connect (the same collectives "
               "in the same order everywhere)")
    if why is not None:
        return refuse(why, ir_text, plan)
    t0 = time.perf_counter()
    results = rewrite.apply_plan(graph, checked, backend_chooser(config, name),
                                 check_where=name if config.check_numerics and not capturing() else None,
                                 pack_ce=config.pack_ce_buckets, ce_reduction=config.ce_reduction)
    if any(b.backend in ("ce", "hier") for b in results) and not capturing():
        register_ce_lowerings()
    rewrite.check_invariants(graph)
    if graph.owning_module is not None:
        graph.owning_module.recompile()
    rewrite_ms = (time.perf_counter() - t0) * 1e3
    report = PassReport(graph=name, nodes_before=nodes_before, nodes_after=len(graph.nodes),
                        collectives=sum(b.members for b in results), buckets=results,
                        summary=dict(plan.get("summary", {})), plan_ms=plan_ms, rewrite_ms=rewrite_ms,
                        dumped=dump_plan(config, name, ir_text, plan), changed=True,
                        async_tp_ops=sum(1 for n in graph.nodes if n.op == "call_function" and
                                         getattr(n.target, "namespace", None) == "symm_mem"))
    if config.verbose:
        for b in results:
            log.info("ce_overlap: %s bucket %d: %s x%d, %.2f MiB, %s%s", name, b.id, b.type, b.members,
                     b.bytes / _MIB, b.reason,
                     "" if b.backend == b.planned_backend else f" (planned {b.planned_backend})")
    log.info("%s", report.line())
    return report

