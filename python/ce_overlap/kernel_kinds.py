"""Kinds of the kernels a Llama-style training step runs (casts, RMSNorm, SiLU, RoPE, loss, embedding, GEMM,
attention), told apart by name on both sides: Inductor's kernel names in a GPU trace (its fused kernels are named after
the ops they fuse) and the IR's op names in the cost model's kernels (ce_overlap.ir.kernels). bench/step_prediction.py
--trace holds the two against each other by kind; `ce-overlap calibrate` records its compiled step's time by kind. A
kind neither side names goes to "other fused" (a Triton kernel) or "other"; copies, collectives and the optimizer
have no kind (the step model prices them apart). No torch.
"""
from __future__ import annotations

import re

from .gpu_trace import kernel_class, time_by_class

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
# The kinds whose time is their FLOPs', not their bytes'.
COMPUTE_BOUND = ("GEMM", "attention")


def _op_name(op: str) -> str:
    """aten.mm.default -> mm; prims.convert_element_type.default -> convert_element_type."""
    parts = op.split(".")
    return parts[-2] if len(parts) >= 3 else parts[-1]


def model_kind(kernel: dict) -> str:
    """The kind of one of the model's kernels (ce_overlap.ir.kernels' entries: ops, fused)."""
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
    """The kind of a trace kernel by its name; None for copies, collectives and the optimizer."""
    cls = kernel_class(name)
    if cls in ("copy", "collective", "optimizer", "copy_kernel"):
        return None
    if cls in ("gemm", "attention"):
        return "GEMM" if cls == "gemm" else "attention"
    if cls != "fused":
        return "other"
    for kind, by_name, _ in KINDS:
        if by_name(name):
            return kind
    return "other fused"


def time_by_kind(activities, steps: int = 1) -> dict[str, float]:
    """Kernel time per kind (trace_kind), per step, in the activities' unit; `activities`: (start, end, name, ...)
    as gpu_trace.gpu_activities gives them. Copies, collectives and the optimizer are left out."""
    return time_by_class(activities, steps, trace_kind)
