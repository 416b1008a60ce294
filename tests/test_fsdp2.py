"""ce_overlap.fsdp on CPU (the GPU side: tests/fsdp2_gpu/run_fsdp2_gpu.py): which FSDP groups get which backend and
why, the comm objects' routing, every fallback and error message, with the runtime absent (no GPU here). FSDP2 is
the real fully_shard, over a fake process group of 8 ranks (shapes and sharding only)."""
from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from ce_overlap.fsdp import integration as fsdp  # the public names and the helpers tested here
from ce_overlap.errors import CeOverlapError
from ce_overlap.inductor.capture import fake_process_group

MIB = 1 << 20


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _sharded(world: int = 8, dim: int = 4096, blocks: int = 2, reduce_dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    with torch.device("meta"):
        model = nn.Sequential(*[Block(dim) for _ in range(blocks)], nn.LayerNorm(dim))
    for b in model[:blocks]:
        fully_shard(b, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


@pytest.fixture
def world8():
    with fake_process_group(8, 0) as g:
        yield g


def test_groups_and_their_sizes(world8):
    model = _sharded()
    groups = fsdp.fsdp_groups(model)
    assert [name for name, _, _ in groups] == ["", "0", "1"]  # the root owns the final norm
    ag, rs, gdt, rdt = fsdp._group_bytes(groups[1][2])
    block = 2 * 4096 + 8 * 4096 * 4096  # norm weight + bias, up, down (dim 0 divides by 8: no padding)
    assert (ag, rs, gdt, rdt) == (block // 8 * 2, block * 4, "bfloat16", "float32")


def test_each_process_group_gets_a_pool_for_its_own_largest_outputs(world8):
    """One pool per process group, sized for the 3 largest all-gather outputs gathered over it (plus staging and p2p,
    at least RuntimeConfig.pool_mb): a group every module shares holds three of them; a module with a group of its
    own (fully_shard without a mesh under a gloo default group makes one per call) holds its own output only, so the
    small blocks' groups do not each get room for the model's largest."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ce_overlap.runtime import RuntimeConfig

    cfg = RuntimeConfig()
    extra = cfg.group_staging_mb() + cfg.group_p2p_mb()
    gathered = {dim: (2 * dim + 8 * dim * dim) * 2 / MIB for dim in (8192, 4096)}  # a Block's bf16 parameters

    shared = fsdp.fsdp_groups(_sharded(dim=8192, blocks=4))
    assert fsdp.pool_mb_by_group([pg for _, _, pg in shared], cfg) == {
        world8.group_name: float(math.ceil(3 * gathered[8192] + extra))}

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = nn.Sequential(Block(8192), Block(4096), nn.LayerNorm(64))
    own = {}
    for name, module in (("0", model[0]), ("1", model[1]), ("", model)):
        g = dist.new_group(list(range(8)))
        own[name] = g.group_name
        fully_shard(module, mesh=DeviceMesh.from_group(g, "cpu"), mp_policy=mp)
    groups = fsdp.fsdp_groups(model)
    assert {name: pg.mesh_info.shard_process_group.group_name for name, _, pg in groups} == own
    assert fsdp.pool_mb_by_group([pg for _, _, pg in groups], cfg) == {
        own["0"]: float(math.ceil(gathered[8192] + extra)), own["1"]: cfg.pool_mb, own[""]: cfg.pool_mb}


def test_a_post_forward_group_pool_holds_the_full_parameters(world8):
    """reshard_after_forward=2: the backward all-gathers over a 2-rank post-forward group, from larger shards into the
    same full-size output, so that group's pool is sized for the full parameters, not 2 of 8 shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ce_overlap.runtime import RuntimeConfig

    cfg = RuntimeConfig()
    mesh = init_device_mesh("cpu", (8,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = nn.Sequential(Block(8192), nn.LayerNorm(64))
    fully_shard(model[0], mesh=mesh, mp_policy=mp, reshard_after_forward=2)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    block = dict((name, pg) for name, _, pg in fsdp.fsdp_groups(model))["0"]
    shard, post = fsdp._groups_of(block)
    assert (shard.size(), post.size()) == (8, 2)
    full = (2 * 8192 + 8 * 8192 * 8192) * 2 / MIB
    want = float(math.ceil(full + cfg.group_staging_mb() + cfg.group_p2p_mb()))
    assert fsdp.pool_mb_by_group([block], cfg) == {shard.group_name: want, post.group_name: want}


def test_the_cost_model_decides_per_group(world8):
    """A 32 MiB block shard goes to the copy engine, the 2 KiB final norm stays on NCCL (below the crossover), each
    with the cost model's reason; the same on every profile that has the copy-engine curves."""
    model = _sharded()
    decisions = fsdp.decide(fsdp.fsdp_groups(model), ce="auto", profile="h200-sxm")
    by = {(d.module, d.collective): d for d in decisions}
    assert by[("0", "all_gather")].backend == "ce" and by[("1", "reduce_scatter")].backend == "ce"
    assert by[("", "all_gather")].backend == "nccl"
    assert all(d.reason.startswith(d.backend + ":") and "us" in d.reason for d in decisions if d.bytes)
    on = fsdp.decide(fsdp.fsdp_groups(model), ce="on", profile="h200-sxm")
    assert {d.backend for d in on} == {"ce"}
    off = fsdp.decide(fsdp.fsdp_groups(model), ce="off", profile="h200-sxm")
    assert {d.backend for d in off} == {"nccl"} and all("ce='off'" in d.reason for d in off)
    gone = fsdp.decide(fsdp.fsdp_groups(model), ce="on", profile="h200-sxm",
                       unavailable={world8.group_name: "spans hosts"})
    assert {d.backend for d in gone} == {"nccl"} and all("spans hosts" in d.reason for d in gone)


def test_bad_input_is_named_and_the_model_left_unchanged(world8):
    with pytest.raises(CeOverlapError, match="no FSDPModule"):
        fsdp.use_copy_engines(nn.Linear(4, 4))
    model = _sharded(blocks=1, dim=64)
    comms = [m._get_fsdp_state()._fsdp_param_group._all_gather_comm for _, m, _ in fsdp.fsdp_groups(model)]
    with pytest.raises(CeOverlapError, match="ce must be one of"):
        fsdp.use_copy_engines(model, ce="maybe")
    other = dist.new_group([0, 1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(CeOverlapError, match="is sharded over group .* not the given group"):
        fsdp.use_copy_engines(model, group=other)
    with pytest.raises(CeOverlapError, match="parameters on (cpu|meta).*copy engines move CUDA tensors"):
        fsdp.use_copy_engines(model)
    assert comms == [m._get_fsdp_state()._fsdp_param_group._all_gather_comm for _, m, _ in fsdp.fsdp_groups(model)]


def test_without_the_hooks_fsdp_keeps_nccl_and_says_so(world8, monkeypatch, caplog):
    model = _sharded(blocks=1, dim=64)
    monkeypatch.setattr(fsdp, "_fsdp_types", lambda: (None, None, None, "torch 2.3 has no set_custom_all_gather"))
    with caplog.at_level(logging.WARNING, logger="ce_overlap"):
        assert fsdp.use_copy_engines(model) == []
    assert "has no set_custom_all_gather: FSDP keeps NCCL" in caplog.text


def test_comm_objects_route_to_nccl_where_the_runtime_cannot(world8, monkeypatch, caplog):
    """The reduce-scatter falls back per call (premul-sum, an integer dtype), saying why once; the all-gather falls
    back when its output is not symmetric or the group is not the one decided for."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    model = _sharded(blocks=1, dim=64)
    pg = fsdp.fsdp_groups(model)[0][2]
    calls = []
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda out, inp, op, group, async_op: calls.append(("nccl", op)))
    monkeypatch.setattr(fsdp_runtime(), "reduce_scatter_tensor", lambda out, inp, op, group: calls.append(("ce", op)))
    rs = fsdp._make_reduce_scatter(ReduceScatter, pg, use_ce=True)
    x, y = torch.zeros(16), torch.zeros(2)
    g = pg._reduce_scatter_process_group
    rs(y, x, g, dist.ReduceOp.AVG)
    rs(y, x, g, dist.ReduceOp.SUM)
    premul = dist._make_nccl_premul_sum(0.125)
    with caplog.at_level(logging.INFO, logger="ce_overlap"):
        rs(y, x, g, premul)
        rs(y, x, g, premul)
        rs(y.int(), x.int(), g, dist.ReduceOp.SUM)
    assert [c[0] for c in calls] == ["ce", "ce", "nccl", "nccl", "nccl"] and calls[0][1] == "avg"
    assert caplog.text.count("reduce op premul_sum") == 1 and "dtype torch.int32" in caplog.text
    ag = fsdp._make_all_gather(AllGather, pg, use_ce=True, ready={g.group_name: ""})
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, inp, group, async_op: calls.append("ag-nccl"))
    monkeypatch.setattr(fsdp_runtime(), "is_symmetric", lambda t, group: False)
    ag(torch.zeros(8), torch.zeros(1), g)  # an ordinary tensor: not the symmetric output, so NCCL
    assert calls[-1] == "ag-nccl"


def fsdp_runtime():
    import ce_overlap.runtime as rt

    return rt


def test_the_direct_path_covers_fsdp2s_common_case_and_names_what_it_does_not(world8):
    """ce_overlap.fsdp.direct takes dim-0 sharded groups with one all-gather dtype; a post-forward group
    (reshard_after_forward=int) or a parameter whose rows the group size does not divide (FSDP2 pads its shards)
    stays on FSDP2's own path, said per group; direct=False keeps every group there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _sharded(blocks=2, dim=256)
    pgs = [pg for _, _, pg in fsdp.fsdp_groups(model)]
    assert set(fsdp.direct_path(pgs).values()) == {""}
    assert set(fsdp.direct_path(pgs, direct=False).values()) == {"direct=False"}

    mesh = init_device_mesh("cpu", (8,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = nn.Sequential(Block(256), nn.Linear(256, 100, bias=False))  # 100 rows over 8 ranks: padded
    fully_shard(model[0], mesh=mesh, mp_policy=mp, reshard_after_forward=2)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    why = {name: fsdp.direct_path([pg])[id(pg)] for name, _, pg in fsdp.fsdp_groups(model)}
    assert why["0"] == "reshard_after_forward=int (a post-forward group)"
    assert why[""] == "a parameter of 100 rows over 8 ranks (padded shards)"


def test_a_group_sharded_together_is_listed_once(world8):
    """fully_shard([norm, output]) (torchtitan's last group): one FSDP group, one decision pair, both paths named."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (8,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with torch.device("meta"):
        model = nn.Sequential(Block(256), nn.LayerNorm(256), nn.Linear(256, 512, bias=False))
    fully_shard(model[0], mesh=mesh, mp_policy=mp)
    fully_shard([model[1], model[2]], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    groups = fsdp.fsdp_groups(model)
    assert [name for name, _, _ in groups] == ["0", "1+2"]
    assert len(fsdp.decide(groups, ce="on", profile="h200-sxm")) == 4


def test_direct_groups_size_their_pool_for_the_slots(world8):
    """On the direct path a process group's pool holds fsdp_direct.SLOTS slots of its largest shard (the all-gather
    outputs are the parameters themselves, outside the pool), plus staging and p2p: far less than three full outputs."""
    from ce_overlap.fsdp import direct as fsdp_direct
    from ce_overlap.runtime import RuntimeConfig

    cfg = RuntimeConfig()
    extra = cfg.group_staging_mb() + cfg.group_p2p_mb()
    model = _sharded(blocks=4, dim=8192)
    pgs = [pg for _, _, pg in fsdp.fsdp_groups(model)]
    shard = (2 * 8192 + 8 * 8192 * 8192) // 8 * 2  # a Block's bf16 parameters over 8 ranks
    assert fsdp._group_bytes(pgs[1])[0] == shard
    assert fsdp.pool_mb_by_group(pgs, cfg, fsdp.direct_path(pgs)) == {
        world8.group_name: max(cfg.pool_mb, float(math.ceil(fsdp_direct.SLOTS * shard / MIB + extra)))}
    on_fsdp2 = fsdp.pool_mb_by_group(pgs, cfg, fsdp.direct_path(pgs, direct=False))[world8.group_name]
    assert on_fsdp2 == float(math.ceil(3 * 8 * shard / MIB + extra))


def test_the_direct_path_wraps_fsdp2_once_and_leaves_other_groups_to_it(world8):
    """install() replaces FSDP2's three functions in its param-group module once; a call whose comm object is not the
    direct path's reaches FSDP2's own function with every argument as given (torch 2.14 passes one more)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as pgm

    from ce_overlap.fsdp import direct as fsdp_direct

    if fsdp_direct.missing():
        pytest.skip(fsdp_direct.missing())
    fsdp_direct.install()
    wrapped = (pgm.foreach_all_gather, pgm.foreach_all_gather_copy_out, pgm.foreach_reduce)
    fsdp_direct.install()
    assert (pgm.foreach_all_gather, pgm.foreach_all_gather_copy_out, pgm.foreach_reduce) == wrapped
    assert wrapped[0] is not fsdp_direct._originals["foreach_all_gather"]
    seen = {}
    saved = dict(fsdp_direct._originals)
    try:
        for name in saved:
            fsdp_direct._originals[name] = lambda *a, _n=name, **k: seen.setdefault(_n, (a, k))
        comm = object()
        pgm.foreach_all_gather("params", world8, False, "s1", "s2", "dev", comm)
        pgm.foreach_all_gather_copy_out(("result",), "params", world8)
        pgm.foreach_reduce(*range(14), True)
    finally:
        fsdp_direct._originals.update(saved)
    assert seen["foreach_all_gather"] == (("params", world8, False, "s1", "s2", "dev", comm), {})
    assert seen["foreach_all_gather_copy_out"] == ((("result",), "params", world8), {})
    assert seen["foreach_reduce"] == ((*range(14), True), {})
