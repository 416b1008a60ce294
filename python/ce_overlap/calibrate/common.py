"""What every part of `ce-overlap calibrate` shares: the measurements schema and workload constants, sizes as text,
the progress bar, and the attention FLOP count both the measuring and the fitting side use. No torch, no GPU."""
from __future__ import annotations

import sys
import time

from ..errors import CeOverlapError

MEASUREMENTS_SCHEMA = "ce_overlap.calibration/1"
MIB = 1 << 20

GEMM_SIZES = (2048, 4096, 8192)
# Causal attention at Llama-3-8B's shape and sequence 4096 (batch, heads, sequence, head dim): the efficiency of
# the attention kernels on the FLOPs they execute (python/ce_overlap/inductor/flops.py counts them the same way).
ATTENTION_SHAPE = (1, 32, 4096, 128)
# Fused AdamW over fp32 master weights, per parameter: reads param, grad, exp_avg, exp_avg_sq and writes param,
# exp_avg, exp_avg_sq, 4 bytes each (bench/train.py's step model charges the same).
ADAMW_BYTES_PER_PARAM = 28
OPTIMIZER_PARAMS = 256 << 20
# The GEMMs of a Llama-3-8B block and its output layer at 4096 tokens, (tokens, out features, in features): each
# measured as its forward (x @ w.T), input-gradient (dy @ w) and weight-gradient (dy.T @ x) product. They check the
# GEMM efficiency curve that the square GEMMs fit at the shapes a training step runs (fit_report prints them).
TRANSFORMER_GEMMS = ((4096, 4096, 4096), (4096, 1024, 4096), (4096, 14336, 4096), (4096, 4096, 14336),
                     (4096, 128256, 4096))
# The compute grid (`ce-overlap calibrate --compute-grid`): what compute priced by shape is to be fitted to (issue 55).
# bf16 GEMMs (m x k) @ (k x n) over every m, n, k below, in the three layouts a training step runs (forward x @ w.T,
# input gradient dy @ w, weight gradient dy.T @ x); SDPA over (batch, heads, seq, head_dim, causal) with batch x seq
# 8192 tokens, causal (language models) from seq 256 and non-causal (vision: a ViT's 197 or 257 tokens) up to seq
# 4096; memory-bound kernels (an add, SwiGLU's silu(a) * b, an RMSNorm-like row reduction) per operand size; and the
# GPU's time per kernel in a run of many tiny ones (the launch floor).
GRID_GEMM_DIMS = (512, 1024, 2048, 4096, 8192, 16384)
GRID_ATTENTION_HEADS = (8, 16, 32)
GRID_ATTENTION_HEAD_DIMS = (64, 128)
GRID_ATTENTION_SEQS = {True: (256, 512, 1024, 2048, 4096, 8192), False: (128, 256, 512, 1024, 2048, 4096)}
GRID_ATTENTION_TOKENS = 8192
GRID_ATTENTION = tuple((GRID_ATTENTION_TOKENS // s, h, s, d, causal) for causal in (True, False)
                       for s in GRID_ATTENTION_SEQS[causal] for h in GRID_ATTENTION_HEADS
                       for d in GRID_ATTENTION_HEAD_DIMS)
GRID_MEMORY_MIB = (1, 4, 16, 64, 256, 1024)
GRID_TINY_KERNELS = 2000
MEMBOUND_BYTES_PER_OPERAND = 1 << 30  # add of two 1 GiB bf16 tensors into a third: 3 GiB through HBM
COMPUTE_KINDS = {"gemm": "compute_bound", "memory_bound": "memory_bound"}  # measurement -> kernel class
COLLECTIVES = ("all_gather", "reduce_scatter", "send", "recv")
MAX_DECREASE = 0.10  # a curve's time may dip this much below a smaller size's (noise), then it is raised to it,
MAX_DECREASE_US = 10.0  # or this many us, whichever is more: the latency floor's jitter (2x H100's CE all-gather
# read 38.0 us at 256 KiB and 29.8 at 1 MiB, medians of 10, bench/results/step-prediction-2026-11-27-d)
REMEASURES = 2  # times calibrate measures a size again whose time is inconsistent with a larger size's (a stall)


def inconsistent_drop(smaller_us: float, larger_us: float) -> bool:
    """A larger size's time this far below a smaller size's is not noise: more than MAX_DECREASE and MAX_DECREASE_US
    below it (the rule the measurements' check applies; calibrate measures such a smaller size again first)."""
    return larger_us < (1 - MAX_DECREASE) * smaller_us and smaller_us - larger_us > MAX_DECREASE_US


MIN_SLOWDOWN = -0.10  # compute beside a collective faster than alone by more than this: a broken measurement


def parse_size(text: str) -> int:
    """'64K', '256M', '1G', '4096' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        value = float(t[:-1]) * mult[t[-1]] if t and t[-1] in mult else float(t)
    except ValueError:
        raise CeOverlapError(f"bad size {text!r}: expected bytes with an optional K/M/G suffix (64K, 256M)") from None
    if value < 1 or value != int(value):
        raise CeOverlapError(f"bad size {text!r}: expected a whole number of bytes >= 1")
    return int(value)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:g}"


class Progress:
    """A plain-text progress bar on stderr (rank 0 only): one line rewritten in place on a terminal, one line per
    step otherwise (logs)."""

    def __init__(self, total: int, enabled: bool = True, stream=None, width: int = 28):
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self._last_len = 0

    def line(self, label: str) -> str:
        filled = min(self.width, self.width * self.done // self.total)
        return (f"calibrate [{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{time.monotonic() - self.started:5.1f}s {label}")

    def step(self, label: str) -> None:
        self.done = min(self.total, self.done + 1)
        self.show(label)

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        text = self.line(label)
        if self.tty:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._last_len:
            self.stream.write("\n")
            self.stream.flush()


def one_line(e: BaseException) -> str:
    """An exception as one short line (type and the first line of its message), for the run's `skipped` reasons."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def attention_executed_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> tuple[int, int]:
    """(forward, backward) FLOPs of self-attention as the analyzer counts them (python/ce_overlap/inductor/flops.py:
    executed work, causal masking discounted)."""
    from ..inductor.flops import attention_backward_flops, attention_flops

    q = (batch, heads, seq, head_dim)
    return attention_flops(q, q, q, causal), attention_backward_flops(q, q, q, causal)
