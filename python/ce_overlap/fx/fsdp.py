"""In-graph FSDP (SimpleFSDP style): parameters are shards; the forward all-gathers them.

Each parameter becomes a dim-0 shard (padded to a multiple of the group size) behind a
parametrization that casts it to the gather dtype and all-gathers it with torch's autograd-aware
functional collective. Under torch.compile the all-gathers land in the forward graph and their
backward, a reduce-scatter of the gradient, lands in the backward graph. With
reshard_after_forward the gathered weights are recomputed (re-gathered) in the backward instead of
saved, as FSDP does by default.

As in FSDP2, while the root module's forward runs each parameter is gathered once, however often the forward
reads it: a tied weight (GPT-2's output projection `F.linear(x, self.wte.weight)`, or one Parameter registered
in two modules) is one all-gather in the forward and one reduce-scatter of its summed gradient in the backward.
And as FSDP2's MixedPrecisionPolicy does by default, the root module's floating-point forward inputs are cast to
`param_dtype` (cast_forward_inputs=False keeps them).
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
    torch.ops.aten.repeat.default,  # _LocalGather (the no-communication bound) recomputes like a re-gather
}

# torch's autograd-aware all-gather (its backward is a reduce-scatter). Newer torch names it all_gather_single_autograd
# and warns on the old name, which older torch (2.11) still needs.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd

# Module paths containing this are FSDP plumbing (the parametrization modules), not user modules.
PARAMETRIZATION_PATH_MARKER = ".parametrizations."


def _regather_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_RECOMPUTE if func in _RECOMPUTE_OPS else CheckpointPolicy.PREFER_SAVE


def _regather_context():
    return create_selective_checkpoint_contexts(_regather_policy)


class _LocalGather(torch.autograd.Function):
    """The no-communication stand-in for the all-gather: the same output shape (the shard repeated), and a
    backward that keeps this rank's rows of the gradient (no reduce-scatter). Only for measuring the bound
    that no overlap scheme can pass; the model it trains is not the sharded model."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        ctx.rows, ctx.rank = shard.shape[0], rank
        return shard.repeat(world_size, *([1] * (shard.dim() - 1)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(0, ctx.rank * ctx.rows, ctx.rows).contiguous(), None, None


class _ForwardState:
    """Shared by the GatherParameters of one sharded model: set while its root module's forward runs, when each
    parameter's gathered value is kept (by index) and handed to every later read in that forward."""

    def __init__(self):
        self.active = False
        self.gathered: dict[int, torch.Tensor] = {}


class GatherParameter(nn.Module):
    """Parametrization: shard (fp32 master) -> full parameter in `param_dtype`, gathered over `group`
    (or, with local=True, the no-communication stand-in _LocalGather). With a `state` whose forward is active,
    a parameter read twice is gathered once."""

    def __init__(self, full_rows: int, group: dist.ProcessGroup, param_dtype: torch.dtype | None,
                 reshard_after_forward: bool, local: bool = False, state: _ForwardState | None = None,
                 index: int = 0):
        super().__init__()
        self.full_rows = full_rows
        self.group = group
        self.param_dtype = param_dtype
        self.reshard_after_forward = reshard_after_forward
        self.local = local
        self.state = state
        self.index = index

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        x = shard if self.param_dtype is None else shard.to(self.param_dtype)
        if self.local:
            full = _LocalGather.apply(x, self.group.size(), self.group.rank())
        else:
            full = _all_gather_autograd(x, gather_dim=0, group=self.group)
        return full if full.shape[0] == self.full_rows else full[: self.full_rows]

    def _gather_now(self, shard: torch.Tensor) -> torch.Tensor:
        if self.reshard_after_forward:
            return checkpoint(self._gather, shard, use_reentrant=False, context_fn=_regather_context)
        return self._gather(shard)

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state is None or not state.active:
            return self._gather_now(shard)
        full = state.gathered.get(self.index)
        if full is None:
            full = self._gather_now(shard)
            state.gathered[self.index] = full
        return full


def _cast_floats(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floats(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


class _RootForward:
    """Mixed into the root module's class (as FSDP2's fully_shard does with FSDPModule): its forward opens the
    gather-once window and casts the floating inputs (FSDP2's MixedPrecisionPolicy.cast_forward_inputs) when
    _ce_overlap_cast_dtype is set. A forward method and not module hooks: torch.compile runs a compiled module's
    hooks outside its graph, where the window would make every gathered weight a graph output (saved for the
    backward instead of re-gathered)."""

    _ce_overlap_state: _ForwardState
    _ce_overlap_cast_dtype: torch.dtype | None

    def forward(self, *args, **kwargs):
        state, dtype = self._ce_overlap_state, self._ce_overlap_cast_dtype
        if dtype is not None:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        state.gathered = {}
        state.active = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            state.active = False
            state.gathered = {}


def _wrap_root(model: nn.Module, state: _ForwardState, cast_dtype: torch.dtype | None) -> None:
    cls = type(model)
    if not issubclass(cls, _RootForward):
        model.__class__ = type(f"InGraphFSDP{cls.__name__}", (_RootForward, cls), {})
    model._ce_overlap_state = state
    model._ce_overlap_cast_dtype = cast_dtype


def shard_rows(rows: int, world_size: int) -> int:
    return -(-rows // world_size)


def fully_shard_in_graph(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                         param_dtype: torch.dtype | None = torch.bfloat16,
                         reshard_after_forward: bool = True,
                         device: torch.device | str | None = None,
                         local_gather: bool = False,
                         cast_forward_inputs: bool = True) -> nn.Module:
    """Shards every parameter of `model` in place over `group` (default: the world).

    Real parameters keep this rank's rows; meta or fake parameters get empty shards of the right
    shape (capture needs shapes only). local_gather=True replaces every all-gather by a local op of the
    same shape and drops the reduce-scatter (the no-communication bound of bench/train.py).
    cast_forward_inputs (FSDP2's MixedPrecisionPolicy default): the floating-point tensors among the root
    module's forward inputs are cast to `param_dtype` (a float32 image meets bf16 conv weights as bf16).
    A Parameter registered in several modules (tied) stays one shard. Returns the model.
    """
    group = group if group is not None else dist.group.WORLD
    world_size, rank = group.size(), group.rank()
    state = _ForwardState()
    # id of an original Parameter -> (that Parameter, kept alive so its id stays unique; index; shard). A Parameter
    # registered in several modules (tied) is sharded once and gathered once per forward.
    shards: dict[int, tuple[nn.Parameter, int, nn.Parameter]] = {}
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                raise ValueError(f"fully_shard_in_graph: parameter {name!r} of {type(module).__name__} is a "
                                 "scalar; in-graph FSDP shards along dim 0")
            if id(param) not in shards:
                rows = shard_rows(param.shape[0], world_size)
                target = torch.device(device) if device is not None else param.device
                if param.device.type == "meta" or is_fake(param):
                    data = torch.empty((rows, *param.shape[1:]), dtype=param.dtype, device=target)
                else:
                    full = param.detach().to(target)
                    pad = rows * world_size - full.shape[0]
                    if pad:
                        full = torch.cat([full, full.new_zeros((pad, *full.shape[1:]))])
                    data = full[rank * rows:(rank + 1) * rows].clone()
                shards[id(param)] = (param, len(shards), nn.Parameter(data, requires_grad=param.requires_grad))
            _, index, shard = shards[id(param)]
            del module._parameters[name]
            module.register_parameter(name, shard)
            parametrize.register_parametrization(
                module, name, GatherParameter(param.shape[0], group, param_dtype, reshard_after_forward, local_gather,
                                              state, index), unsafe=True)
    _wrap_root(model, state, param_dtype if cast_forward_inputs else None)
    return model
