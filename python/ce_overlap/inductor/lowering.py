"""Inductor lowerings for the copy-engine ops the rewriter emits (torch.ops.ce_overlap.*), and whether this torch
has the Inductor pieces they need."""
from __future__ import annotations

import torch

from . import rewrite

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


def ce_lowering_support() -> tuple[bool, str]:
    """Whether this torch has the Inductor pieces register_ce_lowerings needs."""
    from torch._inductor import ir

    for attr in ("_CollectiveKernel", "_WaitKernel"):
        if not hasattr(ir, attr):
            return False, f"torch {torch.__version__} has no torch._inductor.ir.{attr} to lower CE ops with"
    if not hasattr(ir._CollectiveKernel, "create_out_of_place") or not hasattr(ir._WaitKernel, "create_wait"):
        return False, f"torch {torch.__version__}'s Inductor collective kernels lack create_out_of_place/create_wait"
    return True, ""
