"""Python face of the IR: load / save it, analyze it, plan it (the C++ core); capturing a model into it is
ce_overlap.analyzer.model_capture."""
from __future__ import annotations

import json

from . import _core, profiles
from .errors import CeOverlapError


class Ir:
    """A validated IR document (docs/ir.md), held by the C++ core."""

    def __init__(self, doc: "_core.IrDocument"):
        self._doc = doc

    @classmethod
    def from_json(cls, text: str) -> "Ir":
        return cls(_core.IrDocument.from_json(text))

    @classmethod
    def load(cls, path: str) -> "Ir":
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise CeOverlapError(f"cannot read IR file {path!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise CeOverlapError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            return cls.from_json(text)
        except CeOverlapError as e:
            raise CeOverlapError(f"{path}: {e}") from None

    def to_json(self) -> str:
        return self._doc.to_json()

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())

    def to_dict(self) -> dict:
        return json.loads(self.to_json())

    @property
    def blocks(self) -> list[dict]:
        return self._doc.blocks

    @property
    def meta(self) -> dict:
        return json.loads(self._doc.meta_json)

    @property
    def graph_names(self) -> list[str]:
        return self._doc.graph_names

    def num_nodes(self, graph: str) -> int:
        return self._doc.num_nodes(graph)


def analyze(ir: Ir, profile=profiles.DEFAULT) -> dict:
    """The analysis report (docs/analysis.md) of `ir` under a built-in profile name, a profile file,
    or an already loaded `_core.Profile`."""
    return json.loads(_core.analyze(ir._doc, _profile_arg(profile)))


def kernels(ir, graph: str = "forward", profile=profiles.DEFAULT) -> list[dict]:
    """The kernels the cost model runs for one graph of `ir` (an Ir, IrDocument or IR JSON text), in order: one per
    fusion group (Inductor's generated kernels, as the analysis groups them) and one per other compute node (GEMMs,
    attention), each {nodes, ops, bytes, us, fused}: what bench/kernel_kinds.py holds against a GPU trace."""
    return json.loads(_core.graph_kernels(_ir_arg(ir), graph, _profile_arg(profile)))


def _profile_arg(profile):
    return profile if isinstance(profile, _core.Profile) else profiles.load(profile)


def _ir_arg(ir):
    if isinstance(ir, Ir):
        return ir._doc
    if isinstance(ir, (_core.IrDocument, str)):
        return ir
    raise CeOverlapError(f"ir: expected an Ir, an IrDocument or IR JSON text, got {type(ir).__name__}")


def plan(ir, graph: str = "forward", profile=profiles.DEFAULT, config: dict | None = None) -> dict:
    """The Plan (docs/plan.md, schema ce_overlap.plan/1) of graph `graph` of `ir` (an Ir, an IrDocument or
    IR JSON text): buckets, NCCL/CE per bucket, the new order and a summary. `profile`: a built-in profile
    name, a profile file or a loaded `_core.Profile`. `config`: any of bucket_cap_bytes,
    memory_budget_bytes, ce ("auto" | "on" | "off"), min_ce_bytes, prefetch_blocks, bucket_patterns, ce_reduction,
    ce_collectives (None: the defaults of docs/plan.md; PassConfig.plan_config() builds one). Bad input raises
    CeOverlapError naming the field."""
    return json.loads(_core.plan(_ir_arg(ir), graph, _profile_arg(profile), config))


def load_plan(text: str) -> dict:
    """Parse and validate Plan JSON text (every rule that needs no graph); raises CeOverlapError."""
    return json.loads(_core.load_plan(text))


def check_plan(ir, plan: dict | str) -> None:
    """Check a Plan (dict or JSON text) against its graph in `ir`: every rule of docs/plan.md, by the C++ core
    (their one owner). Raises _core.PlanRuleError, a CeOverlapError with `rule` and `node` (docs/plan.md, "Rules")
    whose message names the field."""
    _core.check_plan(_ir_arg(ir), plan if isinstance(plan, str) else json.dumps(plan))
