"""The collective variants that bench/collectives.py's sweeps and its overlap subcommand compare side by side:
all-gather (NCCL, ce_overlap pull: staged / zero-copy / in place, ce_overlap push, torch symm_mem's low-contention
all-gather) and reduce-scatter (NCCL, ce_overlap, torch symm_mem's low-contention reduce-scatter). Each `make_*` returns
a _common.Variant whose run() enqueues one op on the current stream and leaves the current stream waiting for its
completion (so CUDA events around run() time the whole op). Not a benchmark itself."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from lib import common as C

AG_VARIANTS = ["nccl", "ce_staged", "ce_symmetric", "ce_symm_inplace", "ce_symm_push", "ce_push_from_input",
               "symm_mem_lc"]
AG_HELP = {
    "nccl": "dist.all_gather_into_tensor (NCCL kernels)",
    "ce_staged": "ce_overlap, input in ordinary memory (one local copy into the pool, then pulls)",
    "ce_symmetric": "ce_overlap, input from empty_symmetric (zero-copy: peers pull it in place)",
    "ce_symm_inplace": "ce_overlap pull, output from empty_symmetric and input = its own shard (no self copy)",
    "ce_symm_push": "ce_overlap push, output from empty_symmetric, input = its own shard: each rank writes its shard "
                    "into every peer's output",
    "ce_push_from_input": "ce_overlap push, output from empty_symmetric, input in ordinary memory (+ a local self "
                          "copy)",
    "symm_mem_lc": "torch symm_mem _low_contention_all_gather, symmetric input; the caller's stream waits for "
                   "symm_mem's backend stream after each op",
}
RS_VARIANTS = ["nccl", "ce", "ce_symm_in", "symm_mem_lc"]
RS_HELP = {
    "nccl": "dist.reduce_scatter_tensor (NCCL kernels)",
    "ce": "ce_overlap: chunks pushed by copy engines into the peers' staging slots, reduced by a kernel of "
          "CE_OVERLAP_REDUCE_SMS CTAs; input in ordinary memory",
    "ce_symm_in": "ce_overlap, input from empty_symmetric (same path: the input is only read locally)",
    "symm_mem_lc": "torch symm_mem _low_contention_reduce_scatter, symmetric input; the caller waits for its "
                   "backend stream after each op",
}


def _symm_mem_module(group):
    from torch.distributed import _symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
    if not hasattr(symm_mem, "_get_backend_stream"):
        raise RuntimeError("this torch's symm_mem has no _get_backend_stream: the op cannot be waited for, so it "
                           "cannot be timed correctly")
    return symm_mem


def _wait_backend(symm_mem) -> None:
    """symm_mem's low-contention ops run on its backend stream and register a dummy Work: make the caller wait."""
    torch.cuda.current_stream().wait_stream(symm_mem._get_backend_stream())


_UNTUNED: dict[str, dict] = {}


def tune(group, restore: bool = False, **knobs) -> None:
    """Sets the group's peer_lanes / peer_sync / pull_split / bcast_segments / copy_rate_gbps
    (ce_overlap.runtime.testing.tune) for the next variant; restore=True puts back what the group had before the first
    call (the runtime's defaults)."""
    import ce_overlap.runtime.testing as rtt

    if group.group_name not in _UNTUNED:
        state = dict(kv.split("=") for kv in rtt.tune(group).split())
        _UNTUNED[group.group_name] = {"peer_lanes": int(state["peer_lanes"]),
                                      "bcast_segments": int(state["bcast_segments"]),
                                      "copy_rate_gbps": float(state["copy_rate_gbps"]),
                                      "peer_sync": int(state["peer_sync"]),
                                      "pull_split": int(state["pull_split"])}
    rtt.tune(group, **(_UNTUNED[group.group_name] if restore else knobs))


def _set_mode(mode: str) -> str:
    import ce_overlap.runtime.testing as rtt

    return rtt.set_all_gather_mode(mode)  # the library is loaded by then (rendezvous)


def make_ag_variant(name: str, inp: torch.Tensor, group) -> C.Variant:
    """All-gather of `inp` (contiguous, 1-D). Never raises: failures become na_reason."""
    import ce_overlap.runtime as rt

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = inp.numel()
    try:
        if name == "nccl":
            out = torch.empty(world * count, dtype=inp.dtype, device=inp.device)
            return C.Variant(name, lambda: dist.all_gather_into_tensor(out, inp, group=group), lambda: out)
        if name.startswith("ce_"):
            why = C.ce_unavailable(group)
            if why:
                return C.Variant(name, na_reason=why)
            if name == "ce_staged":
                out = torch.empty(world * count, dtype=inp.dtype, device=inp.device)
                return C.Variant(name, lambda: rt.all_gather_into_tensor(out, inp, group), lambda: out, is_ce=True)
            if name == "ce_symmetric":
                sym = rt.empty_symmetric((count,), inp.dtype, group)
                sym.copy_(inp)
                out = torch.empty(world * count, dtype=inp.dtype, device=inp.device)
                return C.Variant(name, lambda: rt.all_gather_into_tensor(out, sym, group), lambda: out, keep=[sym],
                                 is_ce=True)
            sym_out = rt.empty_symmetric((world * count,), inp.dtype, group)
            shard = sym_out.view(world, count)[rank]
            shard.copy_(inp)
            if name == "ce_symm_inplace":
                mode, src = "pull", shard
            elif name == "ce_symm_push":
                mode, src = "push", shard
            elif name == "ce_push_from_input":
                mode, src = "push", inp
            else:
                return C.Variant(name, na_reason=f"unknown variant {name!r}")

            if mode == "pull":
                _set_mode("pull")  # process-wide; push variants restore the previous mode after every op

                def run():
                    rt.all_gather_into_tensor(sym_out, src, group)
            else:
                def run():
                    previous = _set_mode("push")
                    try:
                        rt.all_gather_into_tensor(sym_out, src, group)
                    finally:
                        _set_mode(previous)

            return C.Variant(name, run, lambda: sym_out, is_ce=True)
        if name == "symm_mem_lc":
            symm_mem = _symm_mem_module(group)
            sym = symm_mem.empty(count, dtype=inp.dtype, device=inp.device)
            symm_mem.rendezvous(sym, group)
            sym.copy_(inp)
            holder: list[torch.Tensor] = []

            def run_lc():
                out = torch.ops.symm_mem._low_contention_all_gather(sym, group.group_name)
                _wait_backend(symm_mem)
                holder[:] = [out]

            return C.Variant(name, run_lc, lambda: holder[0], keep=[sym])
        return C.Variant(name, na_reason=f"unknown variant {name!r}")
    except Exception as e:  # noqa: BLE001
        return C.Variant(name, na_reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def make_rs_variant(name: str, inp: torch.Tensor, group, op: str = "sum") -> C.Variant:
    """Reduce-scatter of `inp` (contiguous, 1-D, world * count elements) into count elements. Never raises."""
    import ce_overlap.runtime as rt

    world = dist.get_world_size(group)
    count = inp.numel() // world
    try:
        if name == "nccl":
            out = torch.empty(count, dtype=inp.dtype, device=inp.device)
            rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
            return C.Variant(name, lambda: dist.reduce_scatter_tensor(out, inp, op=rop, group=group), lambda: out)
        if name in ("ce", "ce_symm_in"):
            why = C.ce_unavailable(group)
            if why:
                return C.Variant(name, na_reason=why)
            src = inp
            keep = []
            if name == "ce_symm_in":
                src = rt.empty_symmetric(inp.shape, inp.dtype, group)
                src.copy_(inp)
                keep.append(src)
            out = torch.empty(count, dtype=inp.dtype, device=inp.device)
            return C.Variant(name, lambda: rt.reduce_scatter_tensor(out, src, op, group), lambda: out, keep=keep,
                             is_ce=True)
        if name == "symm_mem_lc":
            symm_mem = _symm_mem_module(group)
            sym = symm_mem.empty(inp.numel(), dtype=inp.dtype, device=inp.device)
            symm_mem.rendezvous(sym, group)
            sym.copy_(inp)
            holder: list[torch.Tensor] = []

            def run_lc():
                out = torch.ops.symm_mem._low_contention_reduce_scatter(sym, op, group.group_name)
                _wait_backend(symm_mem)
                holder[:] = [out]

            return C.Variant(name, run_lc, lambda: holder[0], keep=[sym])
        return C.Variant(name, na_reason=f"unknown variant {name!r}")
    except Exception as e:  # noqa: BLE001
        return C.Variant(name, na_reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


A2A_VARIANTS = ["nccl", "ce_staged", "ce_symmetric"]
A2A_HELP = {
    "nccl": "dist.all_to_all_single, equal splits (NCCL kernels)",
    "ce_staged": "ce_overlap, input in ordinary memory: chunks staged into the pool (local copies), peers pull theirs",
    "ce_symmetric": "ce_overlap, input from empty_symmetric: peers pull their chunk in place (no local copy)",
}
BC_VARIANTS = ["nccl", "ce_staged", "ce_symmetric"]
BC_HELP = {
    "nccl": "dist.broadcast from rank 0 (NCCL kernels)",
    "ce_staged": "ce_overlap, tensor in ordinary memory: the root stages it, every other rank pulls it",
    "ce_symmetric": "ce_overlap, tensor from empty_symmetric on every rank: pulled from the root in place",
}


def make_a2a_variant(name: str, inp: torch.Tensor, group) -> C.Variant:
    """All-to-all (equal splits) of `inp` (contiguous, 1-D, a multiple of world elements). Never raises."""
    import ce_overlap.runtime as rt

    try:
        out = torch.empty_like(inp)
        if name == "nccl":
            return C.Variant(name, lambda: dist.all_to_all_single(out, inp, group=group), lambda: out)
        if name in ("ce_staged", "ce_symmetric"):
            why = C.ce_unavailable(group)
            if why:
                return C.Variant(name, na_reason=why)
            src, keep = inp, []
            if name == "ce_symmetric":
                src = rt.empty_symmetric(inp.shape, inp.dtype, group)
                src.copy_(inp)
                keep.append(src)
            return C.Variant(name, lambda: rt.all_to_all_single(out, src, group), lambda: out, keep=keep, is_ce=True)
        return C.Variant(name, na_reason=f"unknown variant {name!r}")
    except Exception as e:  # noqa: BLE001
        return C.Variant(name, na_reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")


def make_bcast_variant(name: str, inp: torch.Tensor, group) -> C.Variant:
    """Broadcast from group rank 0 of `inp` (each rank's own data; the root's must arrive). Never raises. run()
    broadcasts into a buffer that holds the rank's own data again only before the first op (a broadcast overwrites
    it with the root's bytes, which later ops rewrite identically)."""
    import ce_overlap.runtime as rt

    try:
        if name == "nccl":
            buf = inp.clone()
            root = dist.get_global_rank(group, 0)
            return C.Variant(name, lambda: dist.broadcast(buf, src=root, group=group), lambda: buf)
        if name in ("ce_staged", "ce_symmetric"):
            why = C.ce_unavailable(group)
            if why:
                return C.Variant(name, na_reason=why)
            buf = rt.empty_symmetric(inp.shape, inp.dtype, group) if name == "ce_symmetric" else torch.empty_like(inp)
            buf.copy_(inp)
            return C.Variant(name, lambda: rt.broadcast(buf, 0, group), lambda: buf, keep=[buf], is_ce=True)
        return C.Variant(name, na_reason=f"unknown variant {name!r}")
    except Exception as e:  # noqa: BLE001
        return C.Variant(name, na_reason=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
