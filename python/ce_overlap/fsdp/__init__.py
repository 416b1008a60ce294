"""ce_overlap.fsdp: copy engines for FSDP2 (`torch.distributed.fsdp.fully_shard`), one call after fully_shard.

    fully_shard(block) for each block; fully_shard(model)
    ce_overlap.fsdp.use_copy_engines(model)          # ce="auto": the cost model decides per FSDP group

integration.py: the decision per FSDP group and FSDP2's extension points (custom all-gather / reduce-scatter);
direct.py: the direct path, gathering into the parameters and reduce-scattering from the gradients (docs/fsdp2.md).
Importing this package needs no torch.
"""
from .integration import (CE_MODES, POOL_OUTPUTS_IN_FLIGHT, Decision, decide, direct_path, fsdp_groups,
                          pool_mb_by_group, use_copy_engines)

__all__ = ["CE_MODES", "POOL_OUTPUTS_IN_FLIGHT", "Decision", "decide", "direct_path", "fsdp_groups", "pool_mb_by_group",
           "use_copy_engines"]
