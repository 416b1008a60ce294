"""bench/train.py's FSDP2 modes: the model sharded with torch.distributed.fsdp.fully_shard (torchtitan's pattern:
every block torch.compile'd, then fully_shard per block and on the root; bf16 parameters, fp32 gradient reduction,
reshard after forward), with the default NCCL collectives, with ce_overlap's copy engines (ce_overlap.fsdp), or with
PyTorch's own symmetric-memory all-gather where the installed torch has it (FSDPModule.set_symm_mem_for_comm)."""
from __future__ import annotations

import torch

MODES = ("fsdp2", "fsdp2-ce", "fsdp2-symm-mem")


def build(cfg, mode: str, device: str, ce: str = "auto"):
    """The model of an FSDP2 mode, on `device`. Raises RuntimeError naming what this torch lacks for the mode."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from ce_overlap.models.llama import Llama, init_weights

    if mode == "fsdp2-symm-mem" and not hasattr(FSDPModule, "set_symm_mem_for_comm"):
        raise RuntimeError(f"torch {torch.__version__} has no FSDPModule.set_symm_mem_for_comm (PyTorch's own "
                           "copy-engine all-gather for FSDP2)")
    torch.manual_seed(0)  # the same full weights on every rank and in every mode
    with torch.device(device):
        model = Llama(cfg)
    init_weights(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        if device == "cuda":
            block.compile()
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    if mode == "fsdp2-ce":
        import ce_overlap.fsdp

        ce_overlap.fsdp.use_copy_engines(model, ce=ce)
    elif mode == "fsdp2-symm-mem":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_symm_mem_for_comm()
    return model
