"""ce_overlap.fully_shard on CPU: the API and its errors in one process (a fake process group of 8 ranks for shapes),
then real gloo groups of 2, 3 and 4 processes (tests/fully_shard/worker.py): equivalence with the unsharded model
(eager and compiled), clipping, the full state dict, DCP checkpoints resumed bit-identically, and exchanged with
FSDP2 and across world sizes."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import ce_overlap
from ce_overlap.errors import CeOverlapError
from ce_overlap.inductor.capture import fake_process_group
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def world8():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8, 3) as g:
        yield g, init_device_mesh("cpu", (8,))


def _meta_llama():
    with torch.device("meta"):
        return Llama(LLAMA_CONFIGS["llama3-tiny"])


def test_shards_are_dtensors_under_the_unsharded_names(world8):
    _, mesh = world8
    model = _meta_llama()
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for block in model.layers:
        ce_overlap.fully_shard(block, mesh)
    ce_overlap.fully_shard(model, mesh)
    sd = model.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    assert all(isinstance(v, DTensor) and v.placements[0].is_shard(0) for v in sd.values())
    assert sd["tok_embeddings.weight"].to_local().shape == (1024 // 8, 256)
    # Outside a forward the attribute is the sharded parameter (as FSDP2's); the class keeps the user's name.
    wq = model.layers[0].attention.wq
    assert wq.weight is wq._parameters["weight"] and type(wq).__name__ == "Linear" and isinstance(wq, nn.Linear)
    assert [n for n, _ in model.named_parameters()] == list(want)


def test_uneven_rows_follow_torchs_chunk_layout(world8):
    _, mesh = world8  # rank 3 of 8
    layer = nn.Linear(4, 29, device="meta")  # 29 rows: 4 per rank, ranks 0-6 full, rank 7 one row
    ce_overlap.fully_shard(layer, mesh)
    assert layer.weight.to_local().shape == (4, 4) and layer.bias.to_local().shape == (4,)
    assert layer.weight.shape == (29, 4)


def test_tied_parameters_stay_one_shard(world8):
    _, mesh = world8

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(64, 8)
            self.out = nn.Linear(8, 64, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x):
            return self.out(self.emb(x))

    with torch.device("meta"):
        model = Tied()
    ce_overlap.fully_shard(model, mesh)
    assert model.out._parameters["weight"] is model.emb._parameters["weight"]
    assert len(list(model.parameters())) == 1


def test_vocab_parallel_lookup_takes_only_the_embeddings_it_can_and_says_why_not(world8, caplog):
    """vocab_parallel_embeddings marks a plain embedding; a tied one, one with padding_idx, a subclass with its own
    forward, a table that leaves a rank without rows and a reduce_dtype other than param_dtype are gathered as
    before, each named in the log (the lookup itself: tests/fully_shard/worker.py against the unsharded model)."""
    import logging

    from torch.distributed.fsdp import MixedPrecisionPolicy

    _, mesh = world8

    class Scaled(nn.Embedding):
        def forward(self, x):
            return super().forward(x) * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.plain = nn.Embedding(64, 8)
            self.tied = nn.Embedding(64, 8)
            self.out = nn.Linear(8, 64, bias=False)
            self.out.weight = self.tied.weight
            self.padded = nn.Embedding(64, 8, padding_idx=0)
            self.scaled = Scaled(64, 8)
            self.few = nn.Embedding(7, 8)  # 1 row per rank of 8: rank 7 has none

    def marked(model):
        return {name for name, m in model.named_children() if getattr(m, "_ce_overlap_vocab_parallel", False)}

    with torch.device("meta"), caplog.at_level(logging.WARNING, logger="ce_overlap"):
        model = ce_overlap.fully_shard(Model(), mesh, vocab_parallel_embeddings=True)
    assert marked(model) == {"plain"}
    for why in ("tied", "padding_idx", "its forward is not nn.Embedding's", "7 rows leave a rank of 8 without rows"):
        assert why in caplog.text, why
    with torch.device("meta"):
        fp32 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        assert marked(ce_overlap.fully_shard(Model(), mesh, mp_policy=fp32, vocab_parallel_embeddings=True)) == set()
        assert marked(ce_overlap.fully_shard(Model(), mesh)) == set()  # off by default


def test_bad_input_is_refused_by_name(world8):
    group, mesh = world8
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    model = _meta_llama()
    ce_overlap.fully_shard(model, mesh)
    with pytest.raises(CeOverlapError, match="already sharded by ce_overlap.fully_shard"):
        ce_overlap.fully_shard(model, mesh)
    with pytest.raises(CeOverlapError, match="2-D mesh"):
        ce_overlap.fully_shard(_meta_llama(), init_device_mesh("cpu", (2, 4)))
    with pytest.raises(CeOverlapError, match="mesh must be a DeviceMesh or a ProcessGroup, got str"):
        ce_overlap.fully_shard(_meta_llama(), "dp")
    with pytest.raises(CeOverlapError, match="expected an nn.Module"):
        ce_overlap.fully_shard(torch.zeros(3), mesh)
    with pytest.raises(CeOverlapError, match="mp_policy must be a MixedPrecisionPolicy"):
        ce_overlap.fully_shard(_meta_llama(), mesh, mp_policy=torch.bfloat16)

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones((), device="meta"))

    with pytest.raises(CeOverlapError, match="'scale' of Scalar is a scalar"):
        ce_overlap.fully_shard(Scalar(), mesh)
    by_fsdp2 = nn.Linear(8, 8, device="meta")
    fsdp2_fully_shard(by_fsdp2, mesh=mesh)
    with pytest.raises(CeOverlapError, match="already sharded by FSDP2"):
        ce_overlap.fully_shard(by_fsdp2, mesh)
    # A ProcessGroup is taken as the mesh it spans.
    layer = ce_overlap.fully_shard(nn.Linear(8, 16, device="meta"), group)
    assert layer.weight.device_mesh.size() == 8


def test_a_tensor_parallel_model_gets_fsdp2s_2d_layout_and_its_meshes_are_checked(world8, monkeypatch):
    """The ("dp", "tp") mesh of 4 x 2 fake ranks (rank 3: dp 1, tp 1): shards are FSDP2's 2-D DTensors, given the mesh
    or its "dp" dimension; a 2-D mesh not named so, and a "tp" dimension that spans nodes, are refused by name."""
    from torch.distributed.device_mesh import init_device_mesh

    from ce_overlap.models.llama import tensor_parallel

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    for shard_over in (mesh, mesh["dp"]):
        model = tensor_parallel(_meta_llama(), mesh["tp"])
        ce_overlap.fully_shard(model, shard_over)
        wq, wo = model.layers[0].attention.wq.weight, model.layers[0].attention.wo.weight
        assert wq.device_mesh.mesh_dim_names == ("dp", "tp") and wq.shape == (256, 256)
        assert repr(wq.placements) == "(_StridedShard(dim=0, sf=2), Shard(dim=0))" and wq.to_local().shape == (32, 256)
        assert wo.placements == (Shard(0), Shard(1)) and wo.to_local().shape == (64, 128)
        norm = model.layers[0].attention_norm.weight
        assert norm.placements == (Shard(0), Replicate()) and norm.to_local().shape == (64,)
    with pytest.raises(CeOverlapError, match=r"2-D mesh \(4, 2\) with dimension names \('a', 'b'\).*named 'dp'"):
        ce_overlap.fully_shard(_meta_llama(), init_device_mesh("cpu", (4, 2), mesh_dim_names=("a", "b")))
    monkeypatch.setenv("CE_OVERLAP_RANKS_PER_NODE", "1")
    with pytest.raises(CeOverlapError, match=r"tensor-parallel mesh \('tp',\) spans nodes \(rank 2 on simulated node "
                                             r"2; rank 3 on simulated node 3\)"):
        ce_overlap.fully_shard(tensor_parallel(_meta_llama(), mesh["tp"]), mesh["dp"])
    monkeypatch.setenv("CE_OVERLAP_RANKS_PER_NODE", "2")  # ranks 2 and 3 on one node: accepted
    ce_overlap.fully_shard(tensor_parallel(_meta_llama(), mesh["tp"]), mesh["dp"])
    monkeypatch.setenv("CE_OVERLAP_RANKS_PER_NODE", "two")
    with pytest.raises(CeOverlapError, match="CE_OVERLAP_RANKS_PER_NODE='two': expected a positive integer"):
        ce_overlap.fully_shard(tensor_parallel(_meta_llama(), mesh["tp"]), mesh["dp"])


def test_hsdp_gets_fsdp2s_layout_and_its_groups_roles_and_nodes_are_recorded(world8, monkeypatch, caplog):
    """The ("replicate", "shard") mesh of 2 x 4 fake ranks as 2 simulated nodes of 4: shards are FSDP2's HSDP DTensors
    (Replicate(), Shard(0)); the shard group is data-parallel on one node, the replicate group spans 2 (the IR's role
    and nodes); a "shard" dimension across nodes is said (its collectives stay on NCCL); HSDP x TP is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    from ce_overlap import nodes
    from ce_overlap.in_graph.fully_shard import group_role
    from ce_overlap.models.llama import tensor_parallel

    monkeypatch.setenv("CE_OVERLAP_RANKS_PER_NODE", "4")
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = ce_overlap.fully_shard(_meta_llama(), mesh)
    wq = model.layers[0].attention.wq.weight
    assert wq.device_mesh.mesh_dim_names == ("replicate", "shard") and wq.placements == (Replicate(), Shard(0))
    assert wq.to_local().shape == (64, 256)
    shard, replicate = mesh["shard"].get_group().group_name, mesh["replicate"].get_group().group_name
    assert (group_role(shard), group_role(replicate)) == ("dp", "replicate")
    assert (nodes.recorded(shard), nodes.recorded(replicate)) == (1, 2)
    monkeypatch.setenv("CE_OVERLAP_RANKS_PER_NODE", "2")  # the "shard" dimension (ranks 0-3) now spans 2 nodes
    with caplog.at_level("WARNING", logger="ce_overlap"):
        ce_overlap.fully_shard(_meta_llama(), mesh)
    assert "HSDP's 'shard' dimension spans nodes" in caplog.text and nodes.recorded(shard) == 2
    tp_mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(CeOverlapError, match=r"HSDP x TP is not supported"):
        ce_overlap.fully_shard(tensor_parallel(_meta_llama(), tp_mesh["tp"]), mesh)


def test_without_a_process_group_the_error_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(CeOverlapError, match="torch.distributed is not initialized"):
        ce_overlap.fully_shard(nn.Linear(2, 2))


# --------------------------------------------------------------------------------------------------
# Real gloo groups (one process per rank)


from fully_shard_launch import compare as _compare, phases as _phases, torchrun as _torchrun  # noqa: E402


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_training_clipping_and_state_dicts_match_the_unsharded_model(ranks):
    # At 2 ranks compiled too: plainly, with activation checkpointing and the pass together, and with the
    # vocabulary-parallel embedding (each compile ~30 s per rank on the CPU).
    compiled = ["--compile", "--variants", "eager,eager-vocab,compiled,compiled-ac-pass,compiled-vocab"]
    out = _torchrun(ranks, "check", *(compiled if ranks == 2 else []))
    assert "FAIL" not in out and out.count("PASS") == (19 if ranks == 2 else 11), out


def test_a_checkpoint_resumes_bit_identically_and_moves_between_fsdp2_and_world_sizes(tmp_path):
    t = tmp_path
    _phases(2, f"--steps 10 --record {t}/ref10.pt",
            f"--steps 5 --save {t}/ce2 --record {t}/ce5.pt",
            f"--load {t}/ce2 --steps 5 --record {t}/ce10.pt",
            # ce_overlap -> FSDP2 (2 ranks): the same parameters, and the optimizer state carries on identically.
            f"--impl fsdp2 --load {t}/ce2 --steps 5 --record {t}/fsdp2_10.pt")
    assert "bit-identical" in _compare(t / "ref10.pt", t / "ce10.pt")
    _compare(t / "ce10.pt", t / "fsdp2_10.pt")
    # ce_overlap 2 ranks -> 4 ranks, FSDP2 4 ranks -> ce_overlap 3 ranks: the parameters as written.
    _phases(4, f"--load {t}/ce2 --steps 0 --record {t}/ce4_loaded.pt",
            f"--impl fsdp2 --steps 5 --save {t}/fsdp2_4 --record {t}/f5.pt")
    _compare(t / "ce5.pt", t / "ce4_loaded.pt")
    _torchrun(3, "train", "--load", f"{t}/fsdp2_4", "--steps", "0", "--record", f"{t}/ce3_loaded.pt")
    _compare(t / "f5.pt", t / "ce3_loaded.pt")


def test_a_model_loaded_from_a_file_outside_sys_modules_compiles(gloo_world1, tmp_path, monkeypatch):
    """torch 2.11's Dynamo imports the module of each inlined function by name (torch's own failure, with any
    wrapper module); fully_shard registers such a model's module so that torch.compile finds it."""
    import importlib.util

    (tmp_path / "loose_model.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a = torch.nn.Linear(16, 8)\n\n    def forward(self, x):\n"
        "        return torch.relu(self.a(x)).sum()\n")
    spec = importlib.util.spec_from_file_location("ce_test_loose_model", tmp_path / "loose_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delitem(sys.modules, "ce_test_loose_model", raising=False)
    model = ce_overlap.fully_shard(module.Net())
    assert sys.modules["ce_test_loose_model"] is module
    out = torch.compile(model)(torch.randn(4, 16))
    out.backward()
    assert model.a.weight.grad is not None


def test_uneven_shards_give_every_rank_the_same_plan():
    """The short ranks' graphs hold a pad the others lack (DTensor pads an uneven shard before its all-gather), and the
    pass plans each rank's graph on its own: the tied GPT-2 (vocab 1001 over 4 ranks: 251, 251, 251, 248 rows) gets the
    same buckets, backends and order of collectives on the first and the last rank."""
    from ce_overlap import models

    plans = {}
    for rank in (0, 3):
        built = models.build_from_file(os.path.join(ROOT, "tests", "data", "gpt2_tied.py") + ":build")
        ir = ce_overlap.capture(built.module, built.example_inputs, world_size=4, rank=rank)
        for graph in ("forward", "backward"):
            plans[rank, graph] = ce_overlap.ir.plan(ir, graph, "h100-sxm")
    for graph in ("forward", "backward"):
        first, last = plans[0, graph], plans[3, graph]
        assert first["buckets"] == last["buckets"]
        names = {m[k] for b in first["buckets"] for m in b["members"] for k in ("collective", "wait")}
        assert [n for n in first["order"] if n in names] == [n for n in last["order"] if n in names]
        assert len(first["order"]) < len(last["order"])  # the pad: rank 3 holds fewer rows


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().sum()


def test_the_compiled_step_takes_plain_tensors_and_gradients_land_on_the_dtensor_parameters(gloo_world1):
    """Host time (issue 56): the compiled graph's inputs are the shards' local tensors, not DTensors (AOTAutograd
    would rebuild every gradient as a DTensor, Dynamo check every spec in Python); each gradient still reaches its
    DTensor Parameter with the Parameter's own spec, accumulates over backward passes, and equals the eager one. No
    DeviceMesh among the inputs either: with one there, torch 2.14's FX cache key of the forward changed in every
    process (bench/results/gather-no-mesh-2026-12-04-h200)."""
    inputs = []

    def backend(gm, example_inputs):
        inputs.extend(example_inputs)
        return gm.forward

    torch.manual_seed(0)
    eager, compiled = _Net(), _Net()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        ce_overlap.fully_shard(m)
    x = torch.randn(4, 16)
    step = torch.compile(compiled, backend=backend)
    for _ in range(2):  # the second backward accumulates into the first's gradients
        step(x).backward()
        eager(x).backward()
    assert inputs and not any(isinstance(t, DTensor) for t in inputs)
    assert not any("DeviceMesh" in type(t).__name__ for t in inputs), [type(t).__name__ for t in inputs]
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert isinstance(p.grad, DTensor) and p.grad._spec == p._spec, name
        assert torch.equal(p.grad.to_local(), q.grad.to_local()), name
        assert p._local_tensor.grad is None, name  # handed over, not kept twice


def test_frozen_moved_and_replaced_parameters_after_sharding(gloo_world1):
    """What nn.Module does to a sharded model keeps the gather's leaves current: requires_grad_ freezes (no
    gradient), .to() moves the shards (the moved ones train), and a Parameter replaced by name is refused at once."""
    model = ce_overlap.fully_shard(_Net())
    x = torch.randn(4, 16)
    model.a.requires_grad_(False)
    model(x).backward()
    assert model.a.weight.grad is None and model.b.weight.grad is not None
    model.a.requires_grad_(True)
    model.to(torch.float64)
    model.zero_grad(set_to_none=True)
    model(x.double()).backward()
    assert model.a.weight.dtype == torch.float64 and model.a.weight.grad.dtype == torch.float64
    with pytest.raises(CeOverlapError, match="'weight' of Linear was replaced after it was sharded"):
        model.a.weight = nn.Parameter(torch.zeros(8, 16))
    with pytest.raises(RuntimeError, match="replaced after it was sharded"):  # torch's load_state_dict wraps it
        model.load_state_dict(model.state_dict(), assign=True)


def test_fused_optimizers_step_dtensors_on_their_local_shards_bit_identically(gloo_world1):
    """fully_shard routes torch's fused optimizers over DTensors to the local shards (in_graph/fused_optim.py): the same
    parameters and states, bit for bit, as DTensor's own dispatch; a Partial gradient still takes DTensor's way."""
    from torch.distributed.device_mesh import DeviceMesh

    from ce_overlap.in_graph import fused_optim

    mesh = DeviceMesh.from_group(gloo_world1, "cpu")
    torch.manual_seed(0)
    values = [torch.randn(6, 3), torch.randn(5)]
    grads = [[torch.randn_like(v) for v in values] for _ in range(3)]

    def run(kind: str, fast: bool):
        handlers = DTensor._op_dispatcher._custom_op_handlers
        saved = {op: handlers.pop(op) for op in fused_optim._ops() if op in handlers}
        if fast:
            fused_optim.install()
        try:
            params = [nn.Parameter(DTensor.from_local(v.clone(), mesh, [Shard(0)])) for v in values]
            opt = (torch.optim.AdamW(params, lr=0.1, fused=True) if kind == "adamw" else
                   torch.optim.Adam(params, lr=0.1, amsgrad=True, fused=True))
            for step in grads:
                for p, g in zip(params, step):
                    p.grad = DTensor.from_local(g.clone(), mesh, [Shard(0)])
                opt.step()
            return [p.to_local() for p in params], [t.to_local() for s in opt.state.values() for t in s.values()
                                                    if isinstance(t, DTensor)]
        finally:
            for op in fused_optim._ops():
                handlers.pop(op, None)
            handlers.update(saved)

    for kind in ("adamw", "adam-amsgrad"):
        fast, slow = run(kind, True), run(kind, False)
        assert all(torch.equal(a, b) for a, b in zip(fast[0] + fast[1], slow[0] + slow[1])), kind
        assert len(fast[1]) == len(slow[1]) > 0
    local = fused_optim._local_lists(([DTensor.from_local(values[0], mesh, [Shard(0)])],
                                      [DTensor.from_local(values[0], mesh, [Partial()])]), {})
    assert local is None  # a Partial gradient: DTensor's own rule (it reduces first)
