"""The cost model's kernels (ce_overlap.ir.kernels) and a GPU trace's, told apart by kind, for bench/step_prediction.py
--trace: per kind the time, the kernel count, the bytes the model counts and the rate the measured kernels reached on
those bytes as a fraction of the HBM peak. Where the model's memory-bound time goes missing (a kind far below the
profile's efficiency.memory), without reading a trace by hand.

The kinds are told apart by name, for Llama-style steps: Inductor's kernel names in the trace (its fused kernels are
named after the ops they fuse), the IR's op names in the model. A kind neither side names goes to "other fused" (a
Triton kernel) or "other" (anything else on the GPU but copies, collectives and the optimizer, which this table
leaves out: the step model prices those apart).
"""
from __future__ import annotations

import re

# (kind, how a trace kernel's name shows it, how a model fusion group's op names show it), first match wins. A cast is
# a pointwise kernel of casts only (with the no-comm stand-ins fused into it: "_to_copy_repeat", "_to_copy_slice").
KINDS = (
    ("loss", lambda n: "log_softmax" in n or "nll_loss" in n,
     lambda ops: bool(ops & {"prepare_softmax_online", "log", "_log_softmax", "nll_loss_forward", "iota"})),
    ("RMSNorm + residual", lambda n: "rms_norm" in n,  # its backward: the gradient's sum over the row, / rms
     lambda ops: bool(ops & {"mean", "rsqrt", "pow"}) or {"sum", "div", "mul", "sub"} <= ops),
    ("SiLU", lambda n: "silu" in n, lambda ops: "sigmoid" in ops or {"exp", "neg", "div"} <= ops),
    ("RoPE", lambda n: "cat" in n and "neg" in n, lambda ops: {"cat", "neg"} <= ops),
    ("embedding", lambda n: "embedding" in n,
     lambda ops: bool(ops & {"embedding", "embedding_dense_backward", "_unsafe_masked_index_put_accumulate"})),
    ("cast", lambda n: re.fullmatch(r"triton_poi_fused__to_copy(_repeat|_slice)?_\d+", n) is not None,
     lambda ops: ops <= {"convert_element_type", "_to_copy"}),
)
GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul"}


def _op_name(op: str) -> str:
    """aten.mm.default -> mm; prims.convert_element_type.default -> convert_element_type."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else parts[-1]


def model_kind(kernel: dict) -> str:
    """The kind of one of the model's kernels (ce_overlap.ir.kernels' entries)."""
    ops = {_op_name(o) for o in kernel["ops"]}
    if not kernel["fused"]:
        if any("attention" in o for o in ops):
            return "attention"
        return "GEMM" if ops & GEMM_OPS else "other"
    for kind, _, by_ops in KINDS:
        if by_ops(ops):
            return kind
    return "other fused"


def trace_kind(name: str) -> str | None:
    """The kind of a trace kernel by its name; None for what the table leaves out (copies, collectives, optimizer)."""
    from ce_overlap.gpu_trace import kernel_class

    cls = kernel_class(name)
    if cls in ("copy", "collective", "optimizer", "copy_kernel"):
        return None
    if cls == "gemm":
        return "GEMM"
    if cls == "attention":
        return "attention"
    if cls != "fused":
        return "other"
    for kind, by_name, _ in KINDS:
        if by_name(name):
            return kind
    return "other fused"


def table(model_kernels: list[dict], trace_kernels: list[dict], steps: int, hbm_gbps: float) -> list[dict]:
    """Per kind, in order of measured time: {kind, model_ms, model_kernels, gb, measured_ms, measured_kernels,
    rate} per step; `model_kernels`: ce_overlap.ir.kernels' entries of every graph of one step; `trace_kernels`: the
    trace's kernel events (name, dur in us) over `steps` steps; rate: the model's bytes over the measured time, as a
    fraction of `hbm_gbps` (None where either side has none)."""
    rows: dict[str, dict] = {}

    def row(kind):
        return rows.setdefault(kind, {"kind": kind, "model_ms": 0.0, "model_kernels": 0, "gb": 0.0,
                                      "measured_ms": 0.0, "measured_kernels": 0.0})
    for k in model_kernels:
        r = row(model_kind(k))
        r["model_ms"] += k["us"] / 1e3
        r["model_kernels"] += 1
        r["gb"] += k["bytes"] / 1e9
    for e in trace_kernels:
        kind = trace_kind(e["name"])
        if kind is not None:
            r = row(kind)
            r["measured_ms"] += float(e.get("dur", 0.0)) / 1e3 / steps
            r["measured_kernels"] += 1 / steps
    for r in rows.values():
        memory_bound = r["kind"] not in ("GEMM", "attention")
        r["rate"] = (r["gb"] / r["measured_ms"] / hbm_gbps * 1e3
                     if memory_bound and r["gb"] and r["measured_ms"] else None)
    return sorted(rows.values(), key=lambda r: -max(r["measured_ms"], r["model_ms"]))
