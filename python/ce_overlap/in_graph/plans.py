"""The sharded state of `ce_overlap.fully_shard` (fully_shard.py): what one call's parameters share (GatherConfig), how
one parameter is gathered (GatherPlan, interned), and the per-Parameter record (ShardSpec). Torch-facing data only: the
gathers that read these are fully_shard.py's."""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class TensorParallel:
    """A parameter that tensor parallelism made a DTensor before fully_shard: what its gather hands the module back (the
    DTensor on the TP mesh that parallelize_module made), the data-parallel gather working on this TP rank's shard."""
    mesh: DeviceMesh               # the TP mesh (1-D)
    placements: tuple              # its placements on that mesh
    shape: torch.Size              # the parameter's global shape and stride
    stride: tuple[int, ...]
    local_shape: torch.Size        # this TP rank's shard: what the data-parallel all-gather returns
    local_stride: tuple[int, ...]


@dataclass(frozen=True)
class GatherConfig:
    """What one fully_shard call's parameters share: one object, so that torch.compile guards its fields once per call
    and not once per parameter (Dynamo checks a second path to an object it already guards by identity)."""
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    local: bool                    # the no-communication stand-in (bench/train.py's bound), not a sharded model
    mesh: DeviceMesh               # the data-parallel mesh the shards are gathered over
    group_name: str                # the mesh's group, size and this rank in it: the forward reads these (see _Gather)
    world: int
    rank: int
    # HSDP: the "replicate" mesh's group (the parameters are (Replicate(), Shard(0)) on the (replicate, shard) mesh)
    replicate_group: str | None = None


@dataclass(frozen=True)
class GatherPlan:
    """What a compiled forward reads to gather one sharded parameter, but for its index and its leaf. Interned (intern_plan:
    one object per distinct value; the blocks' parameters of one shape share one), so that torch.compile guards the
    fields of each distinct plan once and every other parameter's plan by identity: one guard per parameter where
    there were seven (issue 56: the guards are walked on every call, mostly out of the CPU's caches; a CPU stand-in
    of the GPT-2 host model, 100 parameters: with the leaf a Parameter, the guard check 220 -> 83 us measured alone,
    the compiled forward's host time over plain compile's 0.88 -> 0.44 ms per call)."""
    rows: int                      # the unsharded dim 0 (of this TP rank's shard, under tensor parallelism)
    chunk: int                     # rows per rank, the last ranks' shards shorter (torch's chunk layout)
    config: GatherConfig
    # The data-parallel DTensor's global shape and stride (the TP shard's under TP); None where the rows divide evenly
    # (DTensor.from_local infers them then).
    shape: torch.Size | None
    stride: tuple[int, ...] | None
    tp: TensorParallel | None = None  # set when tensor parallelism sharded the parameter first
    # False under an activation-checkpoint wrapper: torch.compile traces the wrapped block as a higher-order op,
    # which may read the window but not write to it (a graph break); such a block reads each weight once anyway.
    keep: bool = True
    # No tensor parallelism, kept in the window, even rows (shape and stride None): the gather reads only `simple`.
    simple: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "simple", self.tp is None and self.keep and self.shape is None and self.stride is None)


_PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def intern_plan(plan: GatherPlan) -> GatherPlan:
    """The interned plan equal to `plan`."""
    return _PLANS.setdefault(plan, plan)


@dataclass(eq=False)
class ShardSpec:
    """One sharded parameter (one per Parameter, however many modules register it)."""
    plan: GatherPlan
    index: int                     # the key of its gathered value in the gather-once window
    param: nn.Parameter = field(repr=False)  # the sharded Parameter itself
    # The autograd leaf the gather reads: an nn.Parameter over the Parameter's local tensor (`local`), so that
    # torch.compile leaves it out of its no-aliasing guard over the graph's inputs, as it does the parameters.
    leaf: torch.Tensor | None = field(default=None, repr=False)
    local: torch.Tensor | None = field(default=None, repr=False)
    hooked: torch.Tensor | None = field(default=None, repr=False)  # the leaf with _grad_to_param
    owners: list = field(default_factory=list, repr=False)   # (module, name) registering the Parameter
