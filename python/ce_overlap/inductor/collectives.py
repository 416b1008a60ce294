"""Which nodes of a post-grad FX graph are collectives and waits, and what a functional collective reads: its
input, group, reduce op, bytes and waits. Shared by the Plan's binding to the graph (inductor/plan_check.py), the rewriter
(inductor/rewrite.py) and its invariant checker."""
from __future__ import annotations

import dataclasses
import operator
from typing import Iterable

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from .to_ir import COLLECTIVE_TYPES, DTYPE_NAMES, FUNCTIONAL_NAMESPACES, REDUCE_OPS

# The CE runtime's op per collective type (torch.ops.ce_overlap.<name>), if the runtime has it.
CE_OPS = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
}
# Its multi-tensor form: a whole bucket as one collective that reads every member's input where it lies (and, for
# all-gathers, writes every member's output), so the bucket needs no copy-in / copy-out kernels.
CE_MANY_OPS = {
    "all_gather": "all_gather_into_tensors",
    "reduce_scatter": "reduce_scatter_tensors",
}
# A reduce-scatter's exchange without its reduction (PassConfig.ce_reduction="consumer"): the graph adds the peers'
# chunks to this rank's own, and Inductor fuses that add into the kernel that reads the result.
CE_UNREDUCED_OP = "reduce_scatter_tensors_unreduced"
# The runtime's pass-through (returns its input; Inductor cannot see through it, so it reads the stored bytes).
STORED_OP = "stored"
# The last argument of the ops above: the bucket's copy rate (GB/s per peer copy, the plan's copy_rate_gbps; 0: the
# group's RuntimeConfig.copy_rate_gbps). Given only for a paced bucket.
RATE_ARG = "copy_rate_gbps"


def group_of(group_name):
    """The process group a collective names, or None if it cannot be resolved (no process group, unknown name)."""
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(str(group_name))
    except Exception:  # noqa: BLE001
        return None


def _is_op(node: torch.fx.Node, namespaces: Iterable[str]) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and node.target.namespace in namespaces


def is_functional_collective(node: torch.fx.Node) -> bool:
    return _is_op(node, FUNCTIONAL_NAMESPACES) and node.target._opname != "wait_tensor" \
        and node.target._opname.rstrip("_") in COLLECTIVE_TYPES


def is_ce_collective(node: torch.fx.Node) -> bool:
    return _is_op(node, ("ce_overlap",)) and node.target._opname in set(CE_OPS.values()) | set(
        CE_MANY_OPS.values()) | {CE_UNREDUCED_OP, "all_gather_into_tensor_out"}


def is_wait(node: torch.fx.Node) -> bool:
    return _is_op(node, FUNCTIONAL_NAMESPACES | {"ce_overlap"}) and node.target._opname == "wait_tensor"


def _kwargs(node: torch.fx.Node) -> dict:
    normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return dict(normalized.kwargs) if normalized is not None else dict(node.kwargs)


@dataclasses.dataclass
class Collective:
    node: torch.fx.Node
    type: str                  # IR collective type
    opname: str                # all_gather_into_tensor, reduce_scatter_tensor, ...
    input: torch.fx.Node | None
    group: str
    group_name: object         # the argument as it appears in the graph
    group_size: int | None
    reduce_op: str | None      # normalized (IR) name
    reduce_op_arg: str | None  # as in the graph
    dtype: str | None
    bytes: int                 # per-rank input bytes (IR collective.bytes)
    waits: list[torch.fx.Node]  # wait_tensor nodes consuming it (directly or through getitem)
    other_users: list[torch.fx.Node]


def _val_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return int(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_val_bytes(v) for v in val)
    return 0


def read_collective(node: torch.fx.Node) -> Collective:
    opname = node.target._opname
    kw = _kwargs(node)
    inp = kw.get("input", kw.get("inputs"))
    inp_node = inp if isinstance(inp, torch.fx.Node) else None
    nbytes = sum(_val_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    dtype = None
    val = inp_node.meta.get("val") if inp_node is not None else None
    if isinstance(val, torch.Tensor):
        dtype = DTYPE_NAMES.get(val.dtype)
    group_name = kw.get("group_name")
    group_size = kw.get("group_size")
    if group_size is None and group_name is not None:
        pg = group_of(group_name)  # an unknown group: the size stays unknown, checked later
        group_size = pg.size() if pg is not None else None
    reduce_arg = kw.get("reduce_op")
    reduce_op = REDUCE_OPS.get(str(reduce_arg).lower(), str(reduce_arg).lower()) if reduce_arg is not None else None
    waits, others = [], []
    for user in node.users:
        if is_wait(user):
            waits.append(user)
        elif user.op == "call_function" and user.target is operator.getitem and all(is_wait(u) for u in user.users) \
                and user.users:
            waits.extend(user.users)
        else:
            others.append(user)
    ctype = COLLECTIVE_TYPES.get(opname.rstrip("_"), "all_gather" if "all_gather" in opname else opname)
    return Collective(node=node, type=ctype, opname=opname, input=inp_node, group=str(group_name),
                      group_name=group_name, group_size=int(group_size) if group_size is not None else None,
                      reduce_op=reduce_op, reduce_op_arg=reduce_arg, dtype=dtype, bytes=int(nbytes), waits=waits,
                      other_users=others)


def collectives_in(graph: torch.fx.Graph) -> dict[str, Collective]:
    return {n.name: read_collective(n) for n in graph.nodes if is_functional_collective(n)}
