"""bench/train.py's FSDP2 modes: the model sharded with torch.distributed.fsdp.fully_shard as torchtitan's
apply_fsdp does it (torchtitan 0.3.0, torchtitan/models/llama3/infra/parallelize.py): every block torch.compile'd,
then fully_shard on the token embedding, on each block, on [final norm, output projection] together (not resharded
after forward: backward needs them first) and on the root; bf16 parameters, fp32 gradient reduction, reshard after
forward. `wrap="blocks"`: the older pattern (blocks, then the root holding embedding, norm and output), whose root
all-gather and reduce-scatter (2 GiB and 4 GiB at Llama-3-8B widths) cannot overlap anything.

Modes: NCCL (`fsdp2`), ce_overlap's copy engines (`fsdp2-ce`, ce_overlap.fsdp, its direct path: no FSDP2 copy
kernels; `fsdp2-ce-hooks`: direct=False, the copy engines in FSDP2's extension points only), PyTorch's own
symmetric-memory all-gather where the installed torch has it (`fsdp2-symm-mem`), and the bound (`fsdp2-no-comm`): the
same model, streams and schedule with FSDP2's all-gather and reduce-scatter replaced by local copies of the same
shapes (what `no-comm` is for the in-graph path), so FSDP2's own copy-in / copy-out kernels and its waits stay in it."""
from __future__ import annotations

import torch

MODES = ("fsdp2", "fsdp2-ce", "fsdp2-ce-hooks", "fsdp2-symm-mem", "fsdp2-no-comm")
WRAPS = ("torchtitan", "blocks")


def _no_comm_collectives(group):
    """FSDP2 AllGather / ReduceScatter objects that move no bytes between ranks: the all-gather writes this rank's
    shard into every rank's slot of the output (one copy kernel over the output, on FSDP2's all-gather stream), the
    reduce-scatter copies this rank's rows of the input into the output (on its reduce-scatter stream)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    world, rank = group.size(), group.rank()

    class LocalAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            output_tensor.view(world, -1).copy_(input_tensor.view(1, -1).expand(world, -1))
            return None

    class LocalReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            output_tensor.copy_(input_tensor.view(world, -1)[rank])
            return None

    return LocalAllGather(), LocalReduceScatter()


def build(cfg, mode: str, device: str, ce: str = "auto", wrap: str = "torchtitan", ac: bool = False, mesh=None,
          compile_options: dict | None = None):
    """The model of an FSDP2 mode, on `device`; with `ac` each block is checkpointed as torchtitan's full AC does
    (checkpoint_wrapper, then compile, then fully_shard). `mesh`: a ("dp", "tp") DeviceMesh: the model is first
    parallelized over "tp" (torchtitan's Llama-3 plan), then sharded over "dp" (torchtitan's order); default: every
    rank shards. `compile_options`: the blocks' torch.compile options (async TP: _micro_pipeline_tp). Raises
    RuntimeError naming what this torch lacks."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from ce_overlap.models.llama import Llama, init_weights

    if mode not in MODES:
        raise ValueError(f"unknown FSDP2 mode {mode!r}; known: {MODES}")
    if wrap not in WRAPS:
        raise ValueError(f"unknown FSDP2 wrapping {wrap!r}; known: {WRAPS}")
    if mode == "fsdp2-symm-mem" and not hasattr(FSDPModule, "set_symm_mem_for_comm"):
        raise RuntimeError(f"torch {torch.__version__} has no FSDPModule.set_symm_mem_for_comm (PyTorch's own "
                           "copy-engine all-gather for FSDP2)")
    torch.manual_seed(0)  # the same full weights on every rank and in every mode
    with torch.device(device):
        model = Llama(cfg)
    init_weights(model)
    dp = None
    if mesh is not None:
        from ce_overlap.models.llama import tensor_parallel

        tensor_parallel(model, mesh["tp"])
        dp = mesh["dp"]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if wrap == "torchtitan":
        fully_shard(model.tok_embeddings, mesh=dp, mp_policy=mp)
    if ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    for block in model.layers:
        if device == "cuda":
            block.compile(**({"options": compile_options} if compile_options else {}))
        fully_shard(block, mesh=dp, mp_policy=mp)
    if wrap == "torchtitan":
        fully_shard([model.norm, model.output], mesh=dp, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp, mp_policy=mp)
    if mode in ("fsdp2-ce", "fsdp2-ce-hooks"):
        import ce_overlap.fsdp

        ce_overlap.fsdp.use_copy_engines(model, ce=ce, direct=mode == "fsdp2-ce",
                                         group=dp.get_group() if dp is not None else None)
    elif mode == "fsdp2-symm-mem":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_symm_mem_for_comm()
    elif mode == "fsdp2-no-comm":
        ag, rs = _no_comm_collectives(dist.group.WORLD)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    return model
