"""RuntimeConfig: the CE runtime's settings, with their defaults (the one place they are written) and their
environment overrides (ce_overlap.environment). Given to `rendezvous(group, config)` and, as backend options, to the
torch.distributed backend; the C++ runtime validates the values it receives and reads no environment.

Importing this module needs no torch and no GPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from .. import environment
from ..errors import CeOverlapError

AG_MODES = ("pull", "push")
LOCAL_COPIES = ("ce", "memcpy")
KEEP_ALIVES = ("stash", "record_stream")
FAULTS = ("", "p2p_refused")


class RuntimeConfigError(CeOverlapError, RuntimeError):
    """A bad RuntimeConfig field or CE_OVERLAP_* variable: bad input (CeOverlapError), raised by the runtime API
    (whose errors are RuntimeErrors)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Settings of the CE runtime. Group fields are fixed when a group is rendezvoused and must be equal on every
    rank of the group (the pool sizes are checked; a different timeout only changes who reports first). Process
    fields apply to every group of the process: the last rendezvous (or backend creation) sets them."""

    # -- per group ----------------------------------------------------------------------------------
    pool_mb: float = 1024.0
    """Symmetric pool per group and rank, MiB (user region + staging + point-to-point landing banks)."""

    staging_mb: float | None = None
    """Part of the pool that stages inputs and receives reduce-scatter chunks; None: min(256, pool_mb / 4)."""

    p2p_mb: float | None = None
    """Part of the pool that receives point-to-point messages; None: min(64, pool_mb / 8)."""

    timeout_s: float = 60.0
    """An op not complete this long after its stream reached it fails the group on every surviving rank."""

    reduce_sms: int = 32
    """CTAs of the reduce-scatter reduction kernel (may differ per rank)."""

    rs_round_mb: float = 64.0
    """Reduce-scatter bytes per rank and round (pipelines the copies and the reduction; equal on every rank), capped by
    a staging slot (staging / 2 / (n-1)). 64 rather than 32 since 2026-11-27: on 4x H200 a 256 MiB reduce-scatter ran at
    314 or 225 GB/s busbw with 32 MiB rounds (run to run), 325-336 with 64 (bench/results/collectives-2026-11-27)."""

    pull_split: int = 1
    """Streams (copy engines) one pulled peer copy is split over, 1..4 (local)."""

    copy_rate_gbps: float = 0.0
    """GB/s each of this rank's peer copies is held to, 0 = unlimited (local). Paced copies leave the board below its
    power limit, so the compute beside them keeps its clock (docs/runtime.md; the curve of busbw against the GEMM's
    slowdown: bench/results, issue 30). An op given its own rate (the pass's per-bucket rate, PassConfig.copy_pace_fill)
    paces its copies at that one instead."""

    fault_inject: str = ""
    """Tests only: "p2p_refused" makes every pair of ranks look like GPUs without peer access at rendezvous."""

    # -- per process --------------------------------------------------------------------------------
    all_gather_mode: str = "pull"
    """"pull" or "push": how all-gathers into symmetric outputs move (every rank must use the same)."""

    local_copy: str = "ce"
    """Copies within one GPU: "ce" (cudaMemcpyBatchAsync with the copy-engine hint) or "memcpy"."""

    keep_alive: str = "stash"
    """How a collective's tensors are kept from the allocator while its streams use them: "stash" (held until the
    wait) or "record_stream" (for comparison; docs/runtime.md)."""

    ENV: ClassVar[dict[str, str]] = {
        "pool_mb": "CE_OVERLAP_POOL_MB", "staging_mb": "CE_OVERLAP_STAGING_MB", "p2p_mb": "CE_OVERLAP_P2P_MB",
        "timeout_s": "CE_OVERLAP_TIMEOUT_S", "reduce_sms": "CE_OVERLAP_REDUCE_SMS",
        "rs_round_mb": "CE_OVERLAP_RS_ROUND_MB", "pull_split": "CE_OVERLAP_PULL_SPLIT",
        "copy_rate_gbps": "CE_OVERLAP_COPY_RATE_GBPS",
        "fault_inject": "CE_OVERLAP_FAULT_INJECT", "all_gather_mode": "CE_OVERLAP_AG_MODE",
        "local_copy": "CE_OVERLAP_LOCAL_COPY", "keep_alive": "CE_OVERLAP_KEEP_ALIVE",
    }

    def __post_init__(self):
        def bad(field: str, expected: str):
            raise RuntimeConfigError(f"RuntimeConfig.{field}: expected {expected}, got {getattr(self, field)!r}")

        def number(field: str, *, allow_none: bool = False, whole: bool = False, lo: float = 0.0, hi=None):
            v = getattr(self, field)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= lo or \
                    (hi is not None and v > hi) or (whole and v != int(v)):
                bad(field, f"a {'whole ' if whole else ''}number > {lo:g}" + (f" and <= {hi}" if hi else ""))

        number("pool_mb")
        number("staging_mb", allow_none=True)
        number("p2p_mb", allow_none=True)
        number("timeout_s")
        number("reduce_sms", whole=True, hi=1024)
        number("rs_round_mb")
        number("pull_split", whole=True, hi=4)
        rate = self.copy_rate_gbps
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < float("inf"):
            bad("copy_rate_gbps", "a finite number >= 0 (GB/s; 0: unlimited)")
        if self.staging_mb is not None and not 1 <= self.staging_mb <= self.pool_mb:
            bad("staging_mb", f"at least 1 and at most pool_mb={self.pool_mb}")
        if self.p2p_mb is not None and (self.p2p_mb < 1 or self.group_staging_mb() + self.p2p_mb > self.pool_mb):
            bad("p2p_mb", f"at least 1, with staging + p2p at most pool_mb={self.pool_mb}")
        for field, allowed in (("all_gather_mode", AG_MODES), ("local_copy", LOCAL_COPIES),
                               ("keep_alive", KEEP_ALIVES), ("fault_inject", FAULTS)):
            if getattr(self, field) not in allowed:
                bad(field, "one of " + ", ".join(repr(a) for a in allowed))

    def group_staging_mb(self) -> float:
        return self.staging_mb if self.staging_mb is not None else min(256.0, self.pool_mb / 4)

    def group_p2p_mb(self) -> float:
        return self.p2p_mb if self.p2p_mb is not None else min(64.0, self.pool_mb / 8)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields: Any) -> "RuntimeConfig":
        """Defaults, then the CE_OVERLAP_* variables of ENV (an empty value counts as unset), then `fields`. A
        malformed variable raises RuntimeConfigError naming it."""
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for field, var in cls.ENV.items():
            text = environment.read(var, environ)
            if text is None or not text.strip():
                continue
            text = text.strip()
            if "str" in str(types[field]):
                values[field] = text
                continue
            try:
                num = float(text)
            except ValueError:
                raise RuntimeConfigError(f"{var}={text!r} is not a positive number (RuntimeConfig.{field})") from None
            values[field] = int(num) if "int" in str(types[field]) and num == int(num) else num
        values.update(fields)
        try:
            return cls(**values)
        except RuntimeConfigError as e:
            env_fields = [f for f in values if f not in fields and f in cls.ENV]
            if env_fields:
                raise RuntimeConfigError(f"{e} (from the environment: " +
                                 ", ".join(f"{cls.ENV[f]}={values[f]!r}" for f in env_fields) + ")") from None
            raise

    def pool_create_args(self) -> tuple:
        """The group fields in the order of ce_overlap::_pool_create after (name, rank, world, device)."""
        return (float(self.pool_mb), float(self.group_staging_mb()), float(self.group_p2p_mb()), float(self.timeout_s),
                float(self.reduce_sms), float(self.rs_round_mb), float(self.pull_split), float(self.copy_rate_gbps),
                self.fault_inject)

    def process_args(self) -> tuple:
        """The process fields in the order of ce_overlap::_configure_process."""
        return (self.all_gather_mode, self.local_copy, self.keep_alive)
