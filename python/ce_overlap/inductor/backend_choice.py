"""Which backend each bucket of a checked Plan runs on: the plan's choice, unless the config, the CE runtime, the op or
the process group says otherwise (then NCCL, with the reason), and the rule for groups that run CUDA tensors on gloo."""
from __future__ import annotations

import logging

import torch

from ..config import PassConfig
from ..errors import CeOverlapError
from ..logs import log_once
from . import rewrite
from .capture_state import capturing
from .lowering import ce_lowering_support


def ce_runtime_state(device_type: str | None) -> tuple[bool, str]:
    """(usable, reason) for emitting ce_overlap ops into a graph whose collectives run on `device_type`."""
    from .. import runtime

    lib = runtime.library_loaded()
    if not lib:
        return False, lib.reason
    if capturing():
        return True, "capture only (fake tensors): the library's Meta kernels suffice"
    if device_type != "cuda":
        return False, f"the graph's collectives run on {device_type or 'an unknown device'}; CE ops need CUDA tensors"
    avail = runtime.available()
    if not avail:
        return False, avail.reason
    ok, why = ce_lowering_support()
    if not ok:
        return False, why
    return True, avail.reason


def group_ready(group: str) -> tuple[bool, str]:
    if capturing():
        return True, ""
    try:
        if torch.ops.ce_overlap._has_group(group):
            return True, ""
    except (AttributeError, RuntimeError) as e:
        return False, str(e)
    return False, (f"process group '{group}' has no CE pool: call ce_overlap.runtime.rendezvous(group) on every rank "
                   "before the first compiled step")


def runtime_fingerprint() -> str:
    """What of the CE runtime's state decides the rewrite (part of the cache key)."""
    from .. import runtime

    lib = runtime.library_loaded()
    parts = [f"lib={lib.ok}"]
    if lib.ok:
        names = [*rewrite.CE_OPS.values(), *rewrite.CE_MANY_OPS.values(), rewrite.CE_UNREDUCED_OP]
        parts.append(f"ops={[n for n in names if hasattr(torch.ops.ce_overlap, n)]}")
        parts.append(f"available={runtime.available().ok}")
        parts.append(f"groups={runtime.rendezvoused_groups()}")
    return ";".join(parts)


# Collective types whose in-graph (functional) form on CUDA tensors crashes the process when the group's backend for
# CUDA is gloo: measured on torch 2.11 (a segfault in wait_tensor, eager and compiled alike; pytorch/pytorch#152645).
GLOO_CUDA_CRASHES = ("all_gather",)


def cuda_backend_of(group_name: str) -> str | None:
    """The name of the backend that runs the group's CUDA tensors ("nccl", "gloo", "ce_overlap", ...); None when it
    cannot be known (capture on fake tensors, torch.distributed not initialized)."""
    if capturing():
        return None
    try:
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        return pg._get_backend(torch.device("cuda")).name()
    except Exception:  # noqa: BLE001 (a group torch cannot resolve: nothing to say about it)
        return None


def ce_possible(config: PassConfig, cb: rewrite.CheckedBucket, device: str | None) -> tuple[bool, str]:
    """Whether this bucket can run on the copy engines (config, runtime, op, group), and why not."""
    if config.ce == "off":
        return False, "PassConfig.ce is 'off'"
    if cb.type not in config.ce_collectives:
        return False, f"PassConfig.ce_collectives excludes {cb.type}"
    ok, why = ce_runtime_state(device)
    if not ok:
        return False, f"CE runtime unavailable ({why})"
    op, why = rewrite.ce_op_for(cb.type)
    if op is None:
        return False, why
    return group_ready(cb.members[0].group)


def hier_choice(config: PassConfig, cb: rewrite.CheckedBucket, device: str | None) -> tuple[str, str]:
    """A hierarchical bucket runs so where the config, the runtime and the group's node group allow, else on NCCL
    (flat), saying why."""
    from ..runtime import hierarchical

    if config.ce == "off":
        return "nccl", "nccl: PassConfig.ce is 'off'"
    if cb.type not in config.ce_collectives:
        return "nccl", f"nccl: PassConfig.ce_collectives excludes {cb.type}"
    h = hierarchical.lookup(cb.members[0].group)
    if h is None:
        return "nccl", (f"nccl: group '{cb.members[0].group}' has no node and rail groups (ce_overlap.fully_shard "
                        "makes them for a group across nodes)")
    ok, why = ce_runtime_state(device)
    if ok:
        op, why = rewrite.ce_op_for(cb.type)
        ok = op is not None
    if ok:
        ok, why = group_ready(h.node.group_name)
    if not ok:
        log_once(logging.WARNING, f"ce_overlap: hierarchical buckets keep flat NCCL: {why}")
        return "nccl", f"nccl: flat, the hierarchical choice cannot run ({why})"
    return "hier", cb.reason


def backend_chooser(config: PassConfig, graph_name: str):
    def choose(cb: rewrite.CheckedBucket) -> tuple[str, str]:
        val = cb.members[0].input.meta.get("val") if cb.members[0].input is not None else None
        device = val.device.type if isinstance(val, torch.Tensor) else None
        if device == "cuda" and cb.type in GLOO_CUDA_CRASHES and cuda_backend_of(cb.members[0].group) == "gloo":
            # The group's own backend would be gloo on CUDA tensors, which crashes in-graph: copy engines, or an error.
            ok, why = ce_possible(config, cb, device)
            if ok:
                return "ce", (f"ce: the group runs CUDA tensors on gloo, whose in-graph {cb.type} crashes the process "
                              "(pytorch/pytorch#152645); the copy engine is the in-graph path")
            raise CeOverlapError(
                f"ce_overlap: {graph_name} bucket {cb.id} ({cb.type} x{len(cb.members)}) would run in the graph on "
                f"group '{cb.members[0].group}', whose backend for CUDA tensors is gloo: gloo's in-graph {cb.type} on "
                "CUDA tensors crashes the process (a segfault in torch 2.11, pytorch/pytorch#152645), and the copy "
                f"engine cannot take it here ({why}). Give CUDA tensors NCCL (init_process_group('cpu:gloo,cuda:nccl'))"
                ", or let copy engines run them (ce='auto' or 'on', the CE runtime built, "
                "ce_overlap.runtime.rendezvous(group) before the first step)")
        if cb.backend == "hier":
            return hier_choice(config, cb, device)
        if cb.backend != "ce":
            return "nccl", cb.reason
        if config.ce == "off":
            return "nccl", "nccl: PassConfig.ce is 'off'"
        if cb.type not in config.ce_collectives:
            return "nccl", f"nccl: PassConfig.ce_collectives excludes {cb.type}"
        ok, why = ce_runtime_state(device)  # loads the library, which registers the ops
        if not ok:
            log_once(logging.WARNING, f"ce_overlap: CE runtime unavailable ({why}): keeping NCCL")
            return "nccl", f"nccl: CE runtime unavailable ({why})"
        op, why = rewrite.ce_op_for(cb.type)
        if op is None:
            log_once(logging.INFO, f"ce_overlap: {cb.type} buckets stay on NCCL: {why}")
            return "nccl", f"nccl: {why}"
        ok, why = group_ready(cb.members[0].group)
        if not ok:
            log_once(logging.WARNING, f"ce_overlap: CE runtime unavailable ({why}): keeping NCCL")
            return "nccl", f"nccl: {why}"
        return "ce", cb.reason
    return choose

