"""PassConfig: the settings of the ce_overlap graph pass (docs/pass.md).

Importing this module needs no torch. Values are checked when a PassConfig is built: a bad one raises
CeOverlapError naming the field, so a typo never becomes a silent default. The planner's fields (bucket cap, memory
budget, ce, min_ce_bytes, prefetch, bucket patterns, ce_collectives, ce_reduction, copy_pace_fill) take their defaults,
choices and range checks from the C++ core, which owns the planner's config (csrc/graph/plan.h); this module checks only that each
value has a type JSON can carry to it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from . import _core, environment
from .errors import CeOverlapError

_MIB = 1 << 20
_PLAN_DEFAULTS = json.loads(_core.plan_config_defaults())
_PLAN_CHOICES = json.loads(_core.plan_config_choices())
CE_MODES = tuple(_PLAN_CHOICES["ce"])
CE_COLLECTIVE_TYPES = tuple(_PLAN_CHOICES["ce_collectives"])
CE_REDUCTIONS = tuple(_PLAN_CHOICES["ce_reduction"])
# The planner config's key of each PassConfig field whose name or unit differs (MiB here, bytes there).
_PLAN_KEY_FIELDS = {"bucket_cap_bytes": "bucket_cap_mb", "memory_budget_bytes": "memory_budget_mb"}
_BOOL_FIELDS = ("enabled", "verbose", "check_numerics", "keep_inductor_overlap", "pack_ce_buckets")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassConfig:
    """Settings of the ce_overlap pass. Frozen; build a new one with dataclasses.replace or
    PassConfig(**fields). Every field is validated at construction."""

    enabled: bool = True
    """Run the pass at all. False leaves every graph exactly as Inductor produced it."""

    bucket_cap_mb: float = _PLAN_DEFAULTS["bucket_cap_bytes"] / _MIB
    """Largest bucket, in MiB of per-rank collective input (a single collective larger than the cap
    becomes a bucket of its own). A large cap gives one bucket per transformer block and kind."""

    memory_budget_mb: float = _PLAN_DEFAULTS["memory_budget_bytes"] / _MIB
    """How much the planner may raise the graph's peak memory (MiB) by issuing collectives early
    (prefetch) and keeping bucket buffers alive. 0 forbids any increase."""

    ce: str = _PLAN_DEFAULTS["ce"]
    """Copy-engine use: "auto" (the cost model decides per bucket), "on" (every bucket the CE runtime
    can serve, a group of one included: its self copy, which lets one GPU run the CE path), "off" (NCCL only;
    the pass still buckets and reorders)."""

    min_ce_bytes: int = _PLAN_DEFAULTS["min_ce_bytes"]
    """Buckets smaller than this (per-rank bytes) stay on NCCL: below it the CE signalling overhead
    outweighs the saved SMs."""

    prefetch_blocks: int = _PLAN_DEFAULTS["prefetch_blocks"]
    """How many transformer blocks ahead the planner may issue a bucket's collective (0: issue at the
    first use's block, no prefetch)."""

    bucket_patterns: tuple[str, ...] = tuple(_PLAN_DEFAULTS["bucket_patterns"])
    """Module-path regexes (ECMAScript syntax, found anywhere in paths like "layers.3.attention") that define
    buckets instead of the detected transformer blocks: collectives whose module path matches the same pattern
    and instance share a bucket. Empty: bucket per detected block."""

    profile: str = "auto"
    """Hardware profile for the cost model: a built-in name (h100-sxm, h200-sxm, ...), a path to a
    profile JSON file, or "auto" (picked from torch.cuda.get_device_name(), else h100-sxm)."""

    ce_collectives: tuple[str, ...] = tuple(_PLAN_DEFAULTS["ce_collectives"])
    """Collective types that may move to CE (IR type names). The planner keeps a bucket of another type on NCCL
    (its prediction and summary priced that way), e.g. ("all_gather",) keeps every reduce-scatter on NCCL."""

    ce_reduction: str = _PLAN_DEFAULTS["ce_reduction"]
    """Where a reduce-scatter moved to CE adds the ranks' chunks. "consumer" (default): the copy engines only move
    the chunks (ce_overlap.reduce_scatter_tensors_unreduced) and the graph adds them to this rank's own chunk, an
    add that Inductor fuses into the kernel reading the result, with every SM and no kernel beside the backward's
    GEMMs; the sum is taken in float32 and rounded once, as NCCL's two-rank sum and the reduction kernel do (for
    more ranks the order may differ); bfloat16 and float32 buckets (float16 ones keep the kernel). "kernel": the
    runtime's reduction kernel (ce_overlap.reduce_scatter_tensors, CE_OVERLAP_REDUCE_SMS
    CTAs on a side stream) sums them. The cost model prices the choice made here."""

    copy_pace_fill: float = _PLAN_DEFAULTS["copy_pace_fill"]
    """Pacing of the copy engines (docs/plan.md "Copy rate"), 0..1: a CE bucket whose copies the cost model puts
    under this share of its slot (its window, cut where the group's next bucket is issued) runs them at the rate that
    stretches them to it (each op's copy_rate_gbps), so the copies draw less from the HBM and the board's power at any
    moment beside the compute. 0 (default) paces nothing: on 2x H200 pacing made the step slower
    (bench/results/collectives-2026-11-28)."""

    pack_ce_buckets: bool = False
    """False (default): a CE bucket runs as ONE multi-tensor collective over its members' own tensors (the copy
    engines read and write them where they lie: no kernel packs or unpacks a bucket buffer). True: packed like an
    NCCL bucket (one copy-in kernel, one collective, copy-out kernels), for comparisons."""

    dump_dir: str | None = None
    """If set, every compiled graph's Plan JSON and IR JSON are written here (file names per graph,
    deterministic: <graph>-<ir hash>[-rank<r>].plan.json / .ir.json)."""

    verbose: bool = False
    """Log the per-bucket decisions (backend, bytes, reason) besides the one summary per graph."""

    check_numerics: bool = False
    """Check mode: on the first call of each compiled graph, every collective moved to the copy engine is also run
    through torch.distributed on the same input and compared (all-gathers bit for bit, reduce-scatters within a
    tolerance for the reduction order); a mismatch raises NumericsMismatch before the result is used. Later
    calls skip the check. Costs one extra collective and a host sync per CE bucket, once."""

    agree_timeout_s: float = 600.0
    """How long a rank waits at compile time for the other ranks of its graph's groups to publish their plans
    (inductor/agreement.py: every rank of a group must issue its collectives alike, so the ranks compare plans before
    rewriting, and leave the graph as captured where two disagree). A rank that never publishes is named after this
    many seconds."""

    keep_inductor_overlap: bool = False
    """False (default): inductor_options() turns off Inductor's own passes that would undo or fight the
    plan (FX collective bucketing, overlap scheduling, compute/comm reordering, simple overlap, peak-
    memory reordering, low-contention collectives). True keeps whatever the Inductor config says."""

    def __post_init__(self):
        def bad(field: str, expected: str, value: Any):
            raise CeOverlapError(f"PassConfig.{field}: expected {expected}, got {value!r}")

        for field in _BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                bad(field, "True or False", getattr(self, field))
        # Types only: the ranges and choices are the planner's (checked below, by the core).
        for field in ("bucket_cap_mb", "memory_budget_mb"):
            value = getattr(self, field)
            if not _is_number(value) or not math.isfinite(value):
                bad(field, "a finite number of MiB", value)
        for field in ("min_ce_bytes", "prefetch_blocks"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                bad(field, "an integer", value)
        if not _is_number(self.agree_timeout_s) or not math.isfinite(self.agree_timeout_s) or self.agree_timeout_s <= 0:
            bad("agree_timeout_s", "a positive number of seconds", self.agree_timeout_s)
        if not _is_number(self.copy_pace_fill) or not math.isfinite(self.copy_pace_fill):
            bad("copy_pace_fill", "a number in 0..1", self.copy_pace_fill)
        for field, what in (("bucket_patterns", "regular expressions"), ("ce_collectives", "collective type names")):
            value = getattr(self, field)
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                bad(field, f"a list of {what}", value)
            object.__setattr__(self, field, tuple(value))
        try:
            _core.normalize_plan_config(json.dumps(self.plan_config()))
        except CeOverlapError as e:  # "config.<key>[...]: <what>": name the PassConfig field
            key = str(e).partition(":")[0].removeprefix("config.").partition("[")[0].partition(".")[0]
            field = _PLAN_KEY_FIELDS.get(key, key)
            raise CeOverlapError(f"PassConfig.{field}: {e}") from None
        if not isinstance(self.profile, str) or not self.profile:
            bad("profile", '"auto", a built-in profile name or a profile file path', self.profile)
        if self.profile != "auto":
            from . import profiles

            if self.profile not in profiles.names() and not (os.path.sep in self.profile
                                                               or self.profile.endswith(".json")):
                raise CeOverlapError(f"PassConfig.profile: unknown profile {self.profile!r} (built-in: "
                                     f"{', '.join(profiles.names())}; \"auto\"; or a path to a .json file)")
            if self.profile not in profiles.names():
                try:
                    profiles.load(self.profile)
                except CeOverlapError as e:
                    raise CeOverlapError(f"PassConfig.profile: {e}") from None
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or not str(self.dump_dir):
                bad("dump_dir", "None or a directory path", self.dump_dir)
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
            if os.path.exists(self.dump_dir) and not os.path.isdir(self.dump_dir):
                raise CeOverlapError(f"PassConfig.dump_dir: {self.dump_dir!r} exists and is not a directory")

    # -- conversions --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["bucket_patterns"] = list(self.bucket_patterns)
        d["ce_collectives"] = list(self.ce_collectives)
        return d

    def plan_config(self) -> dict:
        """The `config` object of a Plan request (docs/plan.md)."""
        return {
            "bucket_cap_bytes": int(self.bucket_cap_mb * _MIB),
            "memory_budget_bytes": int(self.memory_budget_mb * _MIB),
            "ce": self.ce,
            "min_ce_bytes": self.min_ce_bytes,
            "prefetch_blocks": self.prefetch_blocks,
            "bucket_patterns": list(self.bucket_patterns),
            "ce_reduction": self.ce_reduction,
            "ce_collectives": list(self.ce_collectives),
            "copy_pace_fill": float(self.copy_pace_fill),
        }

    @classmethod
    def from_env(cls, environ: dict | None = None, **overrides) -> "PassConfig":
        """Defaults, then CE_OVERLAP_PASS_<FIELD> environment variables (e.g. CE_OVERLAP_PASS_CE=on,
        CE_OVERLAP_PASS_BUCKET_CAP_MB=256, CE_OVERLAP_PASS_BUCKET_PATTERNS='["layers\\\\.\\\\d+"]'), then
        `overrides`. A malformed variable raises CeOverlapError naming it."""
        fields = {}
        for f in dataclasses.fields(cls):
            var = environment.PASS_PREFIX + f.name.upper()
            text = environment.read(var, environ)
            if text is not None:
                fields[f.name] = _parse_env(var, f.name, text)
        fields.update(overrides)
        return cls(**fields)


def _parse_env(var: str, field: str, text: str) -> Any:
    text = text.strip()
    if field in _BOOL_FIELDS:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise CeOverlapError(f"{var} (PassConfig.{field}): expected 0/1/true/false, got {text!r}")
    if field in ("bucket_cap_mb", "memory_budget_mb", "copy_pace_fill", "agree_timeout_s"):
        try:
            return float(text)
        except ValueError:
            raise CeOverlapError(f"{var} (PassConfig.{field}): expected a number, got {text!r}") from None
    if field in ("min_ce_bytes", "prefetch_blocks"):
        try:
            return int(text)
        except ValueError:
            raise CeOverlapError(f"{var} (PassConfig.{field}): expected an integer, got {text!r}") from None
    if field == "bucket_patterns":
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as e:
                raise CeOverlapError(f"{var} (PassConfig.bucket_patterns): malformed JSON list: {e}") from None
            if not isinstance(value, list):
                raise CeOverlapError(f"{var} (PassConfig.bucket_patterns): expected a JSON list of strings")
            return tuple(value)
        return (text,) if text else ()
    if field == "ce_collectives":
        return tuple(k.strip() for k in text.split(",") if k.strip())
    if field == "dump_dir":
        return text or None
    return text


_default: PassConfig | None = None


def set_default_config(config: PassConfig | None = None, **fields) -> PassConfig:
    """Sets the config used by torch.compile(backend="ce_overlap") and by inductor_options() when
    given no fields. Pass a PassConfig, or fields (applied on top of the environment's config);
    set_default_config(None) goes back to the environment. Returns the new default."""
    global _default
    if config is not None and fields:
        raise CeOverlapError("set_default_config: pass a PassConfig or fields, not both")
    if config is not None and not isinstance(config, PassConfig):
        raise CeOverlapError(f"set_default_config: expected a PassConfig, got {type(config).__name__}")
    if config is None and not fields:
        _default = None
        return get_default_config()
    _default = config if config is not None else PassConfig.from_env(**fields)
    return _default


def get_default_config() -> PassConfig:
    """The config set by set_default_config, else the one the CE_OVERLAP_PASS_* variables describe."""
    return _default if _default is not None else PassConfig.from_env()
