"""ce_overlap.fully_shard over 2-D meshes on CPU, real gloo groups of 4 processes (tests/fully_shard/worker.py):
tensor parallelism inside ("dp", "tp") and HSDP ("replicate", "shard") on two simulated nodes train as the unsharded
model (eager, compiled, checkpointed, with the pass), and their DCP checkpoints resume and move to FSDP2 and other
mesh shapes. The 1-D meshes and the API: tests/test_fully_shard.py."""
from __future__ import annotations

from fully_shard_launch import compare as _compare, phases as _phases, torchrun as _torchrun


# Tensor parallelism (a 2x2 ("dp", "tp") mesh: torchtitan's Llama-3 plan over "tp", then fully_shard over "dp")

_TP_CHECKS = {"eager": 2, "eager-lp": 2, "compiled-ac-pass": 3, "compiled-lp": 2}


def test_tensor_parallel_2x2_trains_as_the_unsharded_model():
    """Eager, with loss parallel, and compiled with activation checkpointing and ce_overlap's pass together (buckets
    and order on gloo: tensor parallelism's gradient all-reduces feed the data-parallel reduce-scatters; the uneven
    vocabulary's pads make the ranks' graphs differ, and the ranks of each group must still issue its collectives
    alike: the pass rewrote both graphs, no rank disagreeing): losses, first gradients and parameters after 3 clipped
    steps equal the unsharded model's (fp32 rounding), the global norm, FSDP2's DTensor layout, and the errors.
    Compiled loss parallel runs in a process of its own: torch 2.14's AOTAutograd fails it ("Node tangents_2 was
    invalid, but is output", pytorch/torchtitan#3013) once the process compiled another tensor-parallel model, with
    or without ce_overlap (torch 2.11 does not). Plain compilation without activation checkpointing is the 1-D test's
    (test_training_clipping_and_state_dicts_match_the_unsharded_model[2]); here every compile (~30 s per rank on the
    CPU) adds a case, so checkpointing and the pass share one."""
    first = ["eager", "eager-lp", "compiled-ac-pass"]
    out = _torchrun(4, "check", "--tp", "2", "--compile", "--variants", ",".join(first))
    # 3 layout checks, the variants', 4 errors of ce_overlap's and torch's refusal of TP after sharding
    assert "FAIL" not in out and out.count("PASS") == 3 + sum(_TP_CHECKS[k] for k in first) + 4, out
    out = _torchrun(4, "check", "--tp", "2", "--compile", "--variants", "compiled-lp")
    assert "FAIL" not in out and "PASS  compiled, loss parallel: 3 clipped" in out, out


def test_tensor_parallel_checkpoints_resume_and_move_to_fsdp2_and_other_mesh_shapes(tmp_path):
    t = tmp_path
    _phases(4, f"--tp 2 --steps 6 --record {t}/ref6.pt",
            f"--tp 2 --steps 3 --save {t}/ce --record {t}/ce3.pt",
            f"--tp 2 --load {t}/ce --steps 3 --record {t}/ce6.pt",
            # ce_overlap + TP -> FSDP2 + TP (2x2): the same parameters, and training carries on identically; and back,
            # across mesh shapes: FSDP2 + TP's checkpoint (2x2) into ce_overlap without TP (4x1), as written.
            f"--tp 2 --impl fsdp2 --load {t}/ce --steps 3 --save {t}/fsdp2 --record {t}/fsdp2_6.pt",
            f"--load {t}/fsdp2 --steps 0 --record {t}/ce4x1_from_fsdp2.pt",
            # ce_overlap 2x2 -> 4x1 (no tensor parallelism), and FSDP2 without TP (4x1) -> ce_overlap + TP (2x2).
            f"--load {t}/ce --steps 0 --record {t}/ce4x1.pt",
            f"--impl fsdp2 --steps 3 --save {t}/fsdp2_4x1 --record {t}/f3.pt",
            f"--tp 2 --load {t}/fsdp2_4x1 --steps 0 --record {t}/ce2x2.pt")
    assert "bit-identical" in _compare(t / "ref6.pt", t / "ce6.pt")
    _compare(t / "ce6.pt", t / "fsdp2_6.pt")
    _compare(t / "fsdp2_6.pt", t / "ce4x1_from_fsdp2.pt")
    _compare(t / "ce3.pt", t / "ce4x1.pt")
    _compare(t / "f3.pt", t / "ce2x2.pt")


# HSDP (a 2x2 ("replicate", "shard") mesh, FSDP2's call shape; the replicas on two simulated nodes of 2 ranks)

_TWO_NODES = {"CE_OVERLAP_RANKS_PER_NODE": "2"}


def test_hsdp_2x2_on_two_simulated_nodes_trains_as_the_unsharded_model():
    """Eager, and compiled with activation checkpointing and ce_overlap's pass together: losses, first gradients and
    parameters after 3 clipped steps equal the unsharded model's (fp32 rounding; every rank on its own tokens, the
    gradient averaged over both dimensions), the global norm, FSDP2's HSDP layout (Replicate(), Shard(0)), and the
    errors: a copy-engine collective over the group that spans the nodes is refused naming its ranks and nodes. Plain
    compilation without checkpointing is the 1-D test's, as for tensor parallelism."""
    out = _torchrun(4, "check", "--hsdp", "--compile", "--variants", "eager,compiled-ac-pass", env=_TWO_NODES)
    # 3 layout checks, 2 for eager, 3 for compiled-ac-pass (the pass rewrote both graphs), 3 errors
    assert "FAIL" not in out and out.count("PASS") == 3 + 2 + 3 + 3, out
    assert "(Replicate(), Shard(dim=0))" in out and "ranks 0, 1 on simulated node 0; ranks 2, 3 on simulated node 1" \
        in out, out


def test_hsdp_checkpoints_resume_and_move_to_fsdp2_hsdp_and_a_1x4_mesh(tmp_path):
    t = tmp_path
    one_node = "--ranks-per-node 4"  # the 1x4 runs: every rank on one node
    _phases(4, f"--hsdp --steps 6 --record {t}/ref6.pt",
            f"--hsdp --steps 3 --save {t}/ce --record {t}/ce3.pt",
            f"--hsdp --load {t}/ce --steps 3 --record {t}/ce6.pt",
            # ce_overlap HSDP -> FSDP2 HSDP: the same parameters, and training carries on identically.
            f"--hsdp --impl fsdp2 --load {t}/ce --steps 3 --save {t}/fsdp2 --record {t}/fsdp2_6.pt",
            # FSDP2 HSDP (2x2) -> ce_overlap over 4 ranks (1x4), ce_overlap HSDP (2x2) -> 1x4, and FSDP2 1x4 -> ce
            # HSDP 2x2: the parameters as written.
            f"{one_node} --load {t}/fsdp2 --steps 0 --record {t}/ce1x4_from_fsdp2.pt",
            f"{one_node} --load {t}/ce --steps 0 --record {t}/ce1x4.pt",
            f"{one_node} --impl fsdp2 --steps 3 --save {t}/fsdp2_1x4 --record {t}/f3.pt",
            f"--hsdp --load {t}/fsdp2_1x4 --steps 0 --record {t}/ce2x2.pt", env=_TWO_NODES)
    assert "bit-identical" in _compare(t / "ref6.pt", t / "ce6.pt")
    assert "bit-identical" in _compare(t / "ce6.pt", t / "fsdp2_6.pt")
    _compare(t / "fsdp2_6.pt", t / "ce1x4_from_fsdp2.pt")
    _compare(t / "ce3.pt", t / "ce1x4.pt")
    _compare(t / "f3.pt", t / "ce2x2.pt")
