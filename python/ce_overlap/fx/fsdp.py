"""In-graph FSDP (SimpleFSDP style): parameters are shards; the forward all-gathers them.

Each parameter becomes a dim-0 shard (padded to a multiple of the group size) behind a
parametrization that casts it to the gather dtype and all-gathers it with torch's autograd-aware
functional collective. Under torch.compile the all-gathers land in the forward graph and their
backward, a reduce-scatter of the gradient, lands in the backward graph. With
reshard_after_forward the gathered weights are recomputed (re-gathered) in the backward instead of
saved, as FSDP does by default.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.utils import parametrize
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_RECOMPUTE_OPS = {
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.slice.Tensor,
}

# Module paths containing this are FSDP plumbing (the parametrization modules), not user modules.
PARAMETRIZATION_PATH_MARKER = ".parametrizations."


def _regather_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE if func in _RECOMPUTE_OPS else CheckpointPolicy.PREFER_SAVE


def _regather_context():
    return create_selective_checkpoint_contexts(_regather_policy)


class GatherParameter(nn.Module):
    """Parametrization: shard (fp32 master) -> full parameter in `param_dtype`, gathered over `group`."""

    def __init__(self, full_rows: int, group: dist.ProcessGroup, param_dtype: torch.dtype | None,
                 reshard_after_forward: bool):
        super().__init__()
        self.full_rows = full_rows
        self.group = group
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        x = shard if self.param_dtype is None else shard.to(self.param_dtype)
        full = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=self.group)
        return full if full.shape[0] == self.full_rows else full[: self.full_rows]

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        if self.reshard_after_forward:
            return checkpoint(self._gather, shard, use_reentrant=False, context_fn=_regather_context)
        return self._gather(shard)


def shard_rows(rows: int, world_size: int) -> int:
    return -(-rows // world_size)


def fully_shard_in_graph(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                         param_dtype: torch.dtype | None = torch.bfloat16,
                         reshard_after_forward: bool = True,
                         device: torch.device | str | None = None) -> nn.Module:
    """Shards every parameter of `model` in place over `group` (default: the world).

    Real parameters keep this rank's rows; meta or fake parameters get empty shards of the right
    shape (capture needs shapes only). Returns the model.
    """
    group = group if group is not None else dist.group.WORLD
    world_size, rank = group.size(), group.rank()
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                raise ValueError(f"fully_shard_in_graph: parameter {name!r} of {type(module).__name__} is a "
                                 "scalar; in-graph FSDP shards along dim 0")
            rows = shard_rows(param.shape[0], world_size)
            target = torch.device(device) if device is not None else param.device
            if param.device.type == "meta" or is_fake(param):
                shard = torch.empty((rows, *param.shape[1:]), dtype=param.dtype, device=target)
            else:
                full = param.detach().to(target)
                pad = rows * world_size - full.shape[0]
                if pad:
                    full = torch.cat([full, full.new_zeros((pad, *full.shape[1:]))])
                shard = full[rank * rows:(rank + 1) * rows].clone()
            del module._parameters[name]
            module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
            parametrize.register_parametrization(
                module, name, GatherParameter(param.shape[0], group, param_dtype, reshard_after_forward),
                unsafe=True)
    return model
