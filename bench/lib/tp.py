"""bench/train.py's tensor-parallel modes (--tp T): a ("dp", "tp") mesh of world / T x T ranks, the zoo Llama
parallelized over "tp" with torchtitan's Llama-3 plan (ce_overlap.models.llama.tensor_parallel), then sharded over
"dp" (torchtitan's order). Not a script.

    fsdp2+tp            FSDP2 (torchtitan's wrap, blocks compiled) over "dp", TP on NCCL
    fsdp2+tp+async-tp   fsdp2+tp with torch's async TP: Inductor's micro-pipeline TP over symmetric memory on the TP
                        group (its fused all-gather-matmul / matmul-reduce-scatter ops)
    fsdp2-ce+tp         fsdp2+tp with ce_overlap.fsdp.use_copy_engines on the "dp" groups (the direct path)
    ce_overlap+tp       ce_overlap.fully_shard over "dp" and the pass (the cost model's NCCL / copy-engine choice per
                        FSDP bucket, TP kept on NCCL where captured), with torch's async TP where it runs
                        (async_tp_refusal)
    no-comm+tp          ce_overlap+tp's setup with the data-parallel all-gathers replaced by local ops of the same
                        shapes and no reduce-scatter: the bound for FSDP's communication (TP's stays)

Every rank of one TP group trains on the same tokens (its data-parallel rank's).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

MODES = ("fsdp2+tp", "fsdp2+tp+async-tp", "fsdp2-ce+tp", "ce_overlap+tp", "no-comm+tp")
# The modes that run torch's async TP where it can (ce_overlap+tp, no-comm+tp: "auto") or must (fsdp2+tp+async-tp).
ASYNC_TP = {"fsdp2+tp+async-tp": "on", "ce_overlap+tp": "auto", "no-comm+tp": "auto"}


def make_mesh(device: str, world: int, tp: int):
    """The ("dp", "tp") mesh; tp must divide the world."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must divide the {world} ranks")
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def async_tp_refusal(mesh, device: str) -> str:
    """Why torch's async TP cannot run on this mesh here ("" when it can): it needs CUDA, Inductor's
    _micro_pipeline_tp, symmetric memory on the TP group, and one GPU per rank (symmetric memory maps each peer's
    memory: ranks sharing a GPU have none to map)."""
    if device != "cuda":
        return "not on CUDA"
    import torch._inductor.config as ic

    if not hasattr(ic, "_micro_pipeline_tp"):
        return f"torch {torch.__version__} has no Inductor _micro_pipeline_tp"
    try:
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    if torch.cuda.device_count() < dist.get_world_size():
        return "the ranks share GPUs (symmetric memory maps a peer GPU's memory)"
    return ""


def enable_async_tp(mesh) -> None:
    """Symmetric memory on the TP group (what micro-pipeline TP's fused ops run over; every rank of the group)."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    enable_symm_mem_for_group(mesh["tp"].get_group().group_name)


def async_tp_for(mode: str, mesh, device: str) -> tuple[bool, str]:
    """(whether `mode` runs torch's async TP here, why not where it does not). Raises RuntimeError for
    fsdp2+tp+async-tp where it cannot run (the mode would measure fsdp2+tp under another name)."""
    want = ASYNC_TP.get(mode)
    if want is None:
        return False, "the mode runs TP on NCCL"
    refusal = async_tp_refusal(mesh, device)
    if refusal and want == "on":
        raise RuntimeError(f"{mode}: torch's async TP cannot run here: {refusal}")
    return not refusal, refusal


def compile_options(mode: str, ce: str, async_tp: bool) -> dict | None:
    """torch.compile options of an in-graph TP mode (ce_overlap's pass; micro-pipeline TP with async TP)."""
    opts = {"_micro_pipeline_tp": True} if async_tp else {}
    if mode == "ce_overlap+tp":
        import ce_overlap

        opts = {**ce_overlap.inductor_options(ce=ce), **opts}
    return opts or None


def build(cfg, mode: str, mesh, device: str, ce: str = "auto", in_graph_keep: tuple = (), async_tp: bool = False,
          ac: bool = False):
    """The model of a TP mode on `device` over `mesh`."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import ce_overlap
    from ce_overlap.models.llama import Llama, init_weights, tensor_parallel

    if mode not in MODES:
        raise ValueError(f"unknown TP mode {mode!r}; known: {MODES}")
    if mode.startswith("fsdp2"):
        from lib import fsdp2 as _fsdp2

        return _fsdp2.build(cfg, "fsdp2-ce" if mode == "fsdp2-ce+tp" else "fsdp2", device, ce, ac=ac, mesh=mesh,
                            compile_options={"_micro_pipeline_tp": True} if async_tp else None)
    torch.manual_seed(0)  # the same full weights on every rank and in every mode
    with torch.device(device):
        model = Llama(cfg)
    init_weights(model)
    tensor_parallel(model, mesh["tp"])
    if ac:  # torchtitan's order: tensor parallelism, activation checkpointing, sharding
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    dp, local = mesh["dp"], mode == "no-comm+tp"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # the reduce-scatters in bf16 too, as the 1-D modes
    for block in model.layers:
        ce_overlap.fully_shard(block, dp, mp_policy=mp, _local_gather=local)
    for path in in_graph_keep:
        ce_overlap.fully_shard(model.get_submodule(path), dp, mp_policy=mp, reshard_after_forward=False,
                               _local_gather=local)
    ce_overlap.fully_shard(model, dp, mp_policy=mp, _local_gather=local)
    return model
