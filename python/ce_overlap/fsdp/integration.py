"""Copy engines for FSDP2 (`torch.distributed.fsdp.fully_shard`): one call after fully_shard.

    fully_shard(block) for each block; fully_shard(model)
    ce_overlap.fsdp.use_copy_engines(model)          # ce="auto": the cost model decides per FSDP group

Per FSDP group, two ways (docs/fsdp2.md):
- the direct path (ce_overlap.fsdp.direct, the default where it applies): the copy engines gather straight into the
  unsharded parameters and reduce-scatter straight from the unsharded gradients (a widening bf16 -> fp32 reduction
  for reduce_dtype=float32), so none of FSDP2's copy-in / copy-out / chunk_cat kernels run (measured: 17 ms of a 151 ms
  step on the compute stream, 2x H200, Llama-3-8B widths, 8 layers);
- FSDP2's own path (direct=False, or a group the direct path does not cover: reshard_after_forward=int, HSDP, CPU
  offload, padded shards, ...): a custom all-gather and reduce-scatter in FSDP2's extension points
  (`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`), the all-gather output allocated in the CE
  runtime's symmetric pool and gathered in place, the reduce-scatter on copy engines plus the runtime's reduction.
Both are stream-ordered on the streams FSDP2 runs them on, so FSDP2's prefetching, resharding, mixed precision and
gradient accumulation work unchanged, eager or with blocks compiled.

Per FSDP group (one FSDPModule's parameters), ce="auto" asks the cost model (the pass's, on the same hardware
profile) whether the copy engine or NCCL costs the step less, assuming the collective runs beside compute-bound work
as long as itself (what FSDP2's prefetching arranges); "on" takes the copy engine wherever the runtime can; "off"
installs nothing. A group that is not one NVLink domain, a reduce op other than sum / avg (FSDP2's premul-sum for a
custom gradient divide factor), a dtype the reduction kernel lacks, or a torch without the hooks keeps NCCL, and one
log line per FSDP group says which backend and which path run and why.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from ..errors import CeOverlapError

log = logging.getLogger("ce_overlap")

CE_MODES = ("auto", "on", "off")
_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Decision:
    """What use_copy_engines decided for one FSDP group and collective."""

    module: str        # the FSDPModule's path in the model ("" for the root)
    collective: str    # "all_gather" or "reduce_scatter"
    backend: str       # "ce" or "nccl"
    bytes: int         # all-gather: the shard per rank; reduce-scatter: the full input (as in the IR)
    reason: str


def _fsdp_types():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as e:
        return None, None, None, f"torch has no FSDP2 ({e})"
    if not (hasattr(FSDPModule, "set_custom_all_gather") and hasattr(FSDPModule, "set_custom_reduce_scatter")):
        import torch

        return None, None, None, (f"torch {torch.__version__} has no FSDPModule.set_custom_all_gather / "
                                  "set_custom_reduce_scatter")
    return FSDPModule, AllGather, ReduceScatter, ""


def _group_bytes(param_group) -> tuple[int, int, str, str]:
    """(all-gather shard bytes per rank, reduce-scatter input bytes, gather dtype, reduce dtype) of an FSDP group."""
    import torch

    ag = rs = 0
    gather_dtype = reduce_dtype = None
    world = param_group.mesh_info.shard_process_group.size()
    mp = param_group.mp_policy  # FSDPParam's own dtype attributes exist only after FSDP's lazy init
    for p in param_group.fsdp_params:
        numel = math.prod(p.padded_sharded_param_size)
        gather_dtype = mp.param_dtype or p.sharded_param.dtype
        reduce_dtype = mp.reduce_dtype or gather_dtype
        ag += numel * torch.empty((), dtype=gather_dtype).element_size()
        rs += numel * world * torch.empty((), dtype=reduce_dtype).element_size()
    return ag, rs, str(gather_dtype).replace("torch.", ""), str(reduce_dtype).replace("torch.", "")


def _decide(profile, kind: str, nbytes: int, world: int, ce: str) -> tuple[str, str]:
    """("ce" | "nccl", why) for one collective of one FSDP group by the cost model (ce="auto") or the mode."""
    from .. import _core

    if ce == "on":
        return "ce", "ce: ce='on'"
    if nbytes == 0:
        return "nccl", "nccl: nothing to move"
    nccl_alone = _core.estimate_collective(profile, kind, nbytes, world, "nccl")
    d = _core.decide(profile, kind, nbytes, world, window_compute_bound_us=nccl_alone)
    if d["ce_us"] is None:  # across nodes (hierarchical collectives are the pass's: FSDP2's hooks run flat)
        return "nccl", d["reason"] if d["reason"].startswith("nccl: ") else \
            f"nccl: the group spans nodes; the pass could run it hierarchically ({d['reason']})"
    return d["choice"], (f"{d['choice']}: adds {d['nccl_us']:.0f} us on NCCL vs {d['ce_us']:.0f} us on copy engines "
                         f"beside {nccl_alone:.0f} us of compute ({d['reason']})")


def fsdp_groups(model, group=None) -> list:
    """(path, FSDPModule, its FSDP param group) for every FSDP group of `model` that owns parameters (modules sharded
    together by one fully_shard([a, b]) call share a group: listed once, their paths joined by "+"). Raises
    CeOverlapError when there is none, or a module is sharded over another group than `group` (when given)."""
    FSDPModule, _, _, missing = _fsdp_types()
    if missing:
        raise CeOverlapError(f"ce_overlap.fsdp: {missing}")
    modules = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise CeOverlapError("ce_overlap.fsdp.use_copy_engines: the model has no FSDPModule: call "
                             "torch.distributed.fsdp.fully_shard on its blocks and on the model first")
    out, names = [], {}
    for name, m in modules:
        pg = m._get_fsdp_state()._fsdp_param_group
        if pg is None:  # a module whose parameters all belong to sharded children
            continue
        shard = pg.mesh_info.shard_process_group
        if group is not None and shard is not group:
            raise CeOverlapError(f"ce_overlap.fsdp.use_copy_engines: module {name or '<root>'!r} is sharded over "
                                 f"group {shard.group_name!r}, not the given group {group.group_name!r}")
        if id(pg) in names:  # fully_shard([a, b]): the modules share one FSDP state and group, listed once
            names[id(pg)].append(name)
            continue
        names[id(pg)] = [name]
        out.append([name, m, pg])
    return [("+".join(names[id(pg)]), m, pg) for _, m, pg in out]


def decide(groups, *, ce: str = "auto", profile: str = "auto", unavailable: dict | None = None) -> list[Decision]:
    """The backend of each FSDP group's all-gather and reduce-scatter (two Decisions per group, in order), by the
    cost model on `profile` (ce="auto") or the mode; a group named in `unavailable` (name -> why) keeps NCCL."""
    from .. import profiles

    if ce not in CE_MODES:
        raise CeOverlapError(f"ce_overlap.fsdp: ce must be one of {CE_MODES}, got {ce!r}")
    unavailable = unavailable or {}
    prof = profiles.load(profiles.resolve(profile)[0])
    decisions = []
    for name, _, pg in groups:
        ag_bytes, rs_bytes, _, _ = _group_bytes(pg)
        shard = pg.mesh_info.shard_process_group
        why_not = "ce='off'" if ce == "off" else unavailable.get(shard.group_name, "")
        if why_not:
            ag = rs = ("nccl", f"nccl: {why_not}")
        else:
            ag = _decide(prof, "all_gather", ag_bytes, shard.size(), ce)
            rs = _decide(prof, "reduce_scatter", rs_bytes, shard.size(), ce)
        decisions.append(Decision(name, "all_gather", ag[0], ag_bytes, ag[1]))
        decisions.append(Decision(name, "reduce_scatter", rs[0], rs_bytes, rs[1]))
    return decisions


def direct_path(param_groups, direct: bool = True) -> dict[int, str]:
    """id(FSDP param group) -> why it stays on FSDP2's own path ("" when it takes the direct path of
    ce_overlap.fsdp.direct: gathered into its parameters, reduce-scattered from its gradients, without FSDP2's copy
    kernels)."""
    from . import direct as direct_mod

    for_all = "direct=False" if not direct else direct_mod.missing()  # a reason that holds for every group
    return {id(pg): for_all or direct_mod.unsupported(pg) for pg in param_groups}


def use_copy_engines(model, *, ce: str = "auto", profile: str = "auto", runtime=None, group=None,
                     direct: bool = True) -> list[Decision]:
    """Installs copy-engine collectives on every FSDPModule of `model` (call after fully_shard, on every rank: it
    rendezvouses the FSDP groups). Returns what was decided per FSDP group and collective, also logged (one line per
    group). `runtime`: the RuntimeConfig for the groups' pools (default: RuntimeConfig.from_env() with each process
    group's pool large enough for what its FSDP groups need, pool_mb_by_group). `group`: the process group the model
    must be sharded over (an error otherwise). `direct` (default True): FSDP groups the direct path covers
    (ce_overlap.fsdp.direct) gather into their parameters and reduce-scatter from their gradients with none of
    FSDP2's copy kernels; False (or a group it does not cover) keeps FSDP2's own path with the copy-engine
    collectives in its extension points. Raises CeOverlapError, leaving the model unchanged, when the model has no
    FSDPModule, a module is sharded over another group than `group`, or its parameters are not on a CUDA device.
    Where torch lacks FSDP2's hooks or the CE runtime is unavailable, FSDP keeps NCCL (said once; nothing
    installed)."""
    if ce not in CE_MODES:
        raise CeOverlapError(f"ce_overlap.fsdp.use_copy_engines: ce must be one of {CE_MODES}, got {ce!r}")
    _, AllGather, ReduceScatter, missing = _fsdp_types()
    if missing:
        log.warning("ce_overlap.fsdp: %s: FSDP keeps NCCL", missing)
        return []
    groups = fsdp_groups(model, group)
    for name, _, pg in groups:
        if pg.device.type != "cuda":
            raise CeOverlapError(f"ce_overlap.fsdp.use_copy_engines: module {name or '<root>'!r} has its parameters "
                                 f"on {pg.device}; copy engines move CUDA tensors")
    if ce == "off":
        return []
    from . import direct as direct_mod
    from .. import profiles, runtime as rt

    avail = rt.available()
    if not avail:
        log.warning("ce_overlap.fsdp: CE runtime unavailable (%s): FSDP keeps NCCL", avail.reason)
        return []
    param_groups = [pg for _, _, pg in groups]
    paths = direct_path(param_groups, direct)
    ready = _rendezvous_groups(param_groups, runtime, paths)
    decisions = decide(groups, ce=ce, profile=profile, unavailable={k: v for k, v in ready.items() if v})
    rings = _slot_rings(groups, decisions, paths, ready)
    if any(not paths[id(pg)] for pg in param_groups):
        direct_mod.install()
    prof_name, how = profiles.resolve(profile)
    for (name, module, pg), ag, rs in zip(groups, decisions[0::2], decisions[1::2]):
        _, _, gather_dtype, reduce_dtype = _group_bytes(pg)
        why_not = paths[id(pg)]
        if not why_not and "ce" in (ag.backend, rs.backend):
            ring = rings.get(pg.mesh_info.shard_process_group.group_name) if ag.backend == "ce" else None
            d_ag, d_rs = direct_mod.make_comms(pg, ring, rs.backend == "ce")
            module.set_custom_all_gather(d_ag or _make_all_gather(AllGather, pg, False, ready))
            module.set_custom_reduce_scatter(d_rs or _make_reduce_scatter(ReduceScatter, pg, False))
            path = "direct path"
        else:
            module.set_custom_all_gather(_make_all_gather(AllGather, pg, ag.backend == "ce", ready))
            module.set_custom_reduce_scatter(_make_reduce_scatter(ReduceScatter, pg, rs.backend == "ce"))
            path = f"FSDP2's own path ({why_not})" if why_not else "FSDP2's own path"
        log.info("ce_overlap.fsdp: %s (%d ranks, %s): all-gather %.2f MiB/rank %s -> %s; reduce-scatter %.2f MiB %s "
                 "-> %s [profile %s, %s]", name or "<root>", pg.mesh_info.shard_process_group.size(), path,
                 ag.bytes / _MIB, gather_dtype, ag.reason, rs.bytes / _MIB, reduce_dtype, rs.reason, prof_name, how)
    return decisions


def _slot_rings(groups, decisions, paths: dict, ready: dict) -> dict:
    """Process group name -> the direct path's slot ring (ce_overlap.fsdp.direct), sized for the largest shard of the
    FSDP groups that gather over it on the direct path (collective: every rank creates them in the same order)."""
    from . import direct as direct_mod

    need: dict[str, tuple] = {}
    for (_, _, pg), ag in zip(groups, decisions[0::2]):
        shard = pg.mesh_info.shard_process_group
        if paths[id(pg)] or ag.backend != "ce" or ready.get(shard.group_name, "missing"):
            continue
        nbytes = _group_bytes(pg)[0]  # one rank's shards in the all-gather dtype: what a slot holds
        if nbytes > need.get(shard.group_name, (None, 0))[1]:
            need[shard.group_name] = (shard, nbytes)
    return {name: direct_mod.slot_ring(shard, nbytes) for name, (shard, nbytes) in need.items()}


def _groups_of(param_group) -> list:
    """The process groups an FSDP group gathers or reduces over: its shard group, and the post-forward group when it
    reshards to a smaller one after forward (reshard_after_forward=int)."""
    post = getattr(getattr(param_group, "post_forward_mesh_info", None), "shard_process_group", None)
    shard = param_group.mesh_info.shard_process_group
    return [shard] + ([post] if post is not None and post is not shard else [])


# All-gather outputs of one process group that FSDP2 holds at once: the current module's, the prefetched next one's,
# and the one still being freed (implicit or explicit prefetching of one module ahead).
POOL_OUTPUTS_IN_FLIGHT = 3


def pool_mb_by_group(param_groups, runtime, paths: dict | None = None) -> dict[str, float]:
    """Group name -> the symmetric pool (MiB) its rendezvous needs, at least runtime.pool_mb: the runtime's staging
    and p2p parts, plus per process group either (FSDP groups on the direct path, `paths[id(pg)] == ""`) the
    direct path's slots (direct.SLOTS x the largest shard gathered over it), or (FSDP2's own path) room for the
    POOL_OUTPUTS_IN_FLIGHT largest all-gather outputs gathered over it. Per group: where every module has its own group
    (fully_shard without a mesh under a gloo default group makes one per call), each pool holds that module's needs
    only, not the whole model's largest."""
    from . import direct as direct_mod

    paths = paths or {}
    outputs: dict[str, list[int]] = {}
    slots: dict[str, int] = {}
    for pg in param_groups:
        if paths.get(id(pg), "fsdp2") == "":
            name = pg.mesh_info.shard_process_group.group_name
            slots[name] = max(slots.get(name, 0), direct_mod.SLOTS * _group_bytes(pg)[0])
            continue
        # The output is the whole (padded) parameter set over either group: the post-forward group gathers larger
        # shards (reshard_after_forward=int keeps 1/int of it per rank), into the same full size.
        full = _group_bytes(pg)[0] * pg.mesh_info.shard_process_group.size()
        for g in _groups_of(pg):
            outputs.setdefault(g.group_name, []).append(full)
    extra = runtime.group_staging_mb() + runtime.group_p2p_mb()
    return {name: max(runtime.pool_mb, float(math.ceil(
                (sum(sorted(outputs.get(name, []), reverse=True)[:POOL_OUTPUTS_IN_FLIGHT]) + slots.get(name, 0))
                / _MIB + extra)))
            for name in sorted(set(outputs) | set(slots))}


def _rendezvous_groups(param_groups, runtime, paths: dict | None = None) -> dict[str, str]:
    """Rendezvouses every process group the FSDP groups gather or reduce over (collective: every rank runs this in
    the same order). `runtime`: the RuntimeConfig of every group, or None: RuntimeConfig.from_env() with each group's
    pool grown to what its FSDP groups need (pool_mb_by_group, with `paths` from direct_path). Returns group name ->
    why copy engines cannot serve it ("" when they can)."""
    from .. import runtime as rt

    sized = {}
    if runtime is None:
        base = rt.RuntimeConfig.from_env()
        sized = {name: dataclasses.replace(base, pool_mb=mb)
                 for name, mb in pool_mb_by_group(param_groups, base, paths).items()}
    seen: dict[str, str] = {}
    for pg in param_groups:
        for g in _groups_of(pg):
            if g.group_name in seen:
                continue
            try:
                rt.rendezvous(g, sized.get(g.group_name, runtime))
                seen[g.group_name] = ""
            except Exception as e:  # noqa: BLE001 (that group keeps NCCL, and says why)
                seen[g.group_name] = f"CE rendezvous of group {g.group_name!r} failed: {e}"
                log.warning("ce_overlap.fsdp: %s", seen[g.group_name])
    return seen


def _make_all_gather(base, param_group, use_ce: bool, ready: dict):
    import torch
    import torch.distributed as dist

    from .. import runtime as rt

    class CeAllGather(base):
        """FSDP2's all-gather on copy engines, in place in the symmetric pool (ce_overlap.fsdp)."""

        def _ce_group(self):
            g = param_group._all_gather_process_group  # the post-forward group when resharded to one
            return g if use_ce and not ready.get(g.group_name, "missing") else None

        def allocate(self, size, *, dtype, device):
            g = self._ce_group()
            if g is None:
                return torch.empty(*size, dtype=dtype, device=device)
            return rt.empty_symmetric([int(s) for s in size], dtype, g)  # collective: every rank allocates alike

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            g = self._ce_group()
            if g is not None and group is g and rt.is_symmetric(output_tensor, g):
                rt.all_gather_into_tensor(output_tensor, input_tensor, g)  # stream-ordered: FSDP2 waits its event
                return None
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    return CeAllGather()


_CE_REDUCE_DTYPES = ("float32", "bfloat16", "float16")


def _make_reduce_scatter(base, param_group, use_ce: bool):
    import torch
    import torch.distributed as dist

    from .. import runtime as rt

    said: set = set()

    class CeReduceScatter(base):
        """FSDP2's reduce-scatter on copy engines plus the runtime's reduction kernel (ce_overlap.fsdp)."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            why = ""
            if not use_ce:
                why = "nccl by decision"
            elif op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                name = str(getattr(op, "op", op)).replace("RedOpType.", "").lower()
                why = (f"reduce op {name} (the copy-engine reduce-scatter does sum and avg; FSDP2 uses premul_sum for "
                       "a gradient divide factor other than the world size)")
            elif str(input_tensor.dtype).replace("torch.", "") not in _CE_REDUCE_DTYPES:
                why = f"dtype {input_tensor.dtype} (the reduction kernel takes {', '.join(_CE_REDUCE_DTYPES)})"
            elif group is not param_group._reduce_scatter_process_group:
                why = "a group other than the module's shard group"
            if not why:
                rt.reduce_scatter_tensor(output_tensor, input_tensor, "avg" if op == dist.ReduceOp.AVG else "sum",
                                         group)
                return None
            if use_ce and why not in said:
                said.add(why)
                log.info("ce_overlap.fsdp: a reduce-scatter stays on NCCL: %s", why)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return CeReduceScatter()
