"""Post-grad FX graph -> IR graph dict (docs/ir.md). The only place that reads FX node internals."""
from __future__ import annotations

import json
import operator
import re
import types

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from .flops import node_flops

# Functional collectives as they appear in post-grad graphs -> IR collective type.
COLLECTIVE_TYPES = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}
FUNCTIONAL_NAMESPACES = {"_c10d_functional", "c10d_functional"}
REDUCE_OPS = {"sum": "sum", "avg": "avg", "max": "max", "min": "min", "product": "product", "prod": "product"}

DTYPE_NAMES = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int64: "int64",
    torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool",
    torch.complex64: "complex64", torch.complex128: "complex128", torch.complex32: "complex32",
    # flash attention's RNG seed/offset outputs are uint64 on GPUs
    torch.uint16: "uint16", torch.uint32: "uint32", torch.uint64: "uint64",
    torch.float8_e4m3fnuz: "float8_e4m3fnuz", torch.float8_e5m2fnuz: "float8_e5m2fnuz",
}


class CaptureError(ValueError):
    """A graph holds something the IR cannot represent (the message names the node)."""


def normalize_module_path(path: str) -> str:
    """Dynamo's "L['self'].layers[0]._modules['attention']" -> "layers.0.attention"."""
    path = re.sub(r"^L\[['\"][^'\"]+['\"]\]", "", path)
    path = re.sub(r"^L__self__", "", path)
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.lstrip(".")


# Module paths containing this are parametrization plumbing (torch.nn.utils.parametrize), not user modules.
PARAMETRIZATION_PATH_MARKER = ".parametrizations."


def _type_name(t) -> str:
    if isinstance(t, type):
        t = t.__dict__.get("_ce_overlap_user_class", t)  # ce_overlap.fully_shard's subclass: the user's class
        name = t.__name__
        # parametrize creates "Parametrized<Base>" subclasses; users know the base.
        if name.startswith("Parametrized") and t.__bases__ and t.__bases__[0].__name__ == name[len("Parametrized"):]:
            return t.__bases__[0].__name__
        return name
    return str(t).rsplit(".", 1)[-1]


def module_stack(node: torch.fx.Node) -> list[list[str]]:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, typ = value[0], value[1]
        path = normalize_module_path(str(path))
        if not path or PARAMETRIZATION_PATH_MARKER in path + ".":
            continue
        if out and out[-1][0] == path:
            continue
        out.append([path, _type_name(typ)])
    return out


def _tensor_info(value, where: str) -> dict:
    if value.dtype not in DTYPE_NAMES:
        raise CaptureError(f"{where}: dtype {value.dtype} is not representable in the IR")
    shape = [int(d) for d in value.shape]
    numel = 1
    for d in shape:
        numel *= d
    return {"shape": shape, "dtype": DTYPE_NAMES[value.dtype], "bytes": numel * value.element_size()}


def _outputs(node: torch.fx.Node) -> list[dict]:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [_tensor_info(v, f"node {node.name}") for v in vals if isinstance(v, torch.Tensor)]


def _group_size(group_name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name).size()


_GROUP_SIZE_META = "ce_overlap_group_size"
_GROUP_NODES_META = "ce_overlap_group_nodes"


def remember_group_sizes(gm: torch.fx.GraphModule) -> None:
    """Records on each collective that does not name its group's size (all_reduce) the size of its group, and on every
    collective the nodes its group is on (ce_overlap.nodes.recorded), while the group exists: a capture converts its
    graphs to IR after its fake process groups are gone (and forgets what it recorded about them)."""
    for node in gm.graph.nodes:
        if _classify(node)[0] != "collective":
            continue
        normalized = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
        kwargs = normalized.kwargs if normalized is not None else dict(node.kwargs)
        if kwargs.get("group_size") is None and kwargs.get("group_name") is not None:
            node.meta[_GROUP_SIZE_META] = _group_size(str(kwargs["group_name"]))
        if kwargs.get("group_name") is not None:  # and the nodes its group is on, as fully_shard recorded them
            from ..nodes import recorded

            node.meta[_GROUP_NODES_META] = recorded(str(kwargs["group_name"]))


def _collective(node: torch.fx.Node, ctype: str) -> dict:
    target = node.target
    normalized = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    kwargs = normalized.kwargs if normalized is not None else dict(node.kwargs)
    inputs = [a for a in node.all_input_nodes]
    nbytes = sum(_tensor_info(a.meta["val"], f"node {node.name}")["bytes"]
                 for a in inputs if isinstance(a.meta.get("val"), torch.Tensor))
    for a in inputs:  # coalesced variants take a list
        if isinstance(a.meta.get("val"), (list, tuple)):
            nbytes += sum(_tensor_info(v, f"node {node.name}")["bytes"] for v in a.meta["val"])
    group_name = kwargs.get("group_name")
    if group_name is None:
        raise CaptureError(f"node {node.name}: collective {target} has no group_name argument")
    group_size = kwargs.get("group_size")
    if group_size is None:
        group_size = node.meta.get(_GROUP_SIZE_META) or _group_size(str(group_name))
    reduce_op = kwargs.get("reduce_op")
    if reduce_op is not None:
        reduce_op = REDUCE_OPS.get(str(reduce_op).lower(), str(reduce_op).lower())
    out = {"type": ctype, "group": str(group_name), "group_size": int(group_size), "reduce_op": reduce_op,
           "bytes": int(nbytes)}
    from ..in_graph.fully_shard import group_role  # the groups ce_overlap.fully_shard named: data- or tensor-parallel

    role = group_role(str(group_name))
    if role is not None:
        out["role"] = role
    from ..nodes import recorded  # a group across nodes: the cost model prices it there

    on_nodes = node.meta[_GROUP_NODES_META] if _GROUP_NODES_META in node.meta else recorded(str(group_name))
    if on_nodes is not None and on_nodes > 1:
        out["nodes"] = on_nodes
    return out


def _classify(node: torch.fx.Node) -> tuple[str, str]:
    """(kind, op name) of a node."""
    if node.op in ("placeholder", "output", "get_attr"):
        return "other", node.op
    target = node.target
    if node.op != "call_function":
        return "other", f"{node.op}:{target}"
    if target is operator.getitem:
        return "view", "getitem"
    if isinstance(target, torch._ops.OpOverload):
        name = str(target)
        if target.namespace in FUNCTIONAL_NAMESPACES:
            if target._opname == "wait_tensor":
                return "wait", name
            if target._opname.rstrip("_") in COLLECTIVE_TYPES:
                return "collective", name
        if target.is_view:
            return "view", name
        return "compute", name
    if isinstance(target, torch._ops.HigherOrderOperator):
        return "compute", f"higher_order.{target.name()}"
    return "compute", getattr(target, "__name__", str(target))


def graph_to_ir(gm: torch.fx.GraphModule, name: str) -> dict:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    out = []
    for i, node in enumerate(nodes):
        kind, op = _classify(node)
        outputs = _outputs(node) if node.op != "output" else []
        record = {
            "id": i,
            "name": node.name,
            "kind": kind,
            "op": op,
            "inputs": [index[a] for a in node.all_input_nodes],
            "outputs": outputs,
            "flops": node_flops(node) if kind == "compute" else 0,
            "bytes_accessed": 0,
            "module_stack": module_stack(node),
            "block": -1,
        }
        if kind == "compute":
            seen = set()
            read = 0
            for a in node.all_input_nodes:
                for v in (a.meta.get("val") if isinstance(a.meta.get("val"), (list, tuple)) else [a.meta.get("val")]):
                    if isinstance(v, torch.Tensor) and id(v) not in seen:
                        seen.add(id(v))
                        read += _tensor_info(v, f"node {node.name}")["bytes"]
            record["bytes_accessed"] = read + sum(o["bytes"] for o in outputs)
        if kind == "collective":
            record["collective"] = _collective(node, COLLECTIVE_TYPES[node.target._opname.rstrip("_")])
        out.append(record)
    return {"name": name, "nodes": out}


def core_document(graph: torch.fx.Graph, name: str, meta: dict | None = None):
    """The C++ core's IR document (_core.IrDocument, blocks detected) of one FX graph, named `name`: what the
    planner plans and the Plan is checked against. Raises CaptureError for a graph the IR cannot represent."""
    from .. import _core

    gm = graph.owning_module if graph.owning_module is not None else types.SimpleNamespace(graph=graph)
    doc = {"schema": "ce_overlap.ir/1", "meta": meta or {}, "blocks": [], "graphs": [graph_to_ir(gm, name)]}
    core_doc = _core.IrDocument.from_json(json.dumps(doc))
    core_doc.detect_blocks()
    return core_doc
