"""`ce_overlap.fully_shard`: in-graph FSDP whose collectives torch.compile sees, with FSDP2's parameters.

Called as FSDP2's fully_shard is (each block, then the root), then `torch.compile(model,
options=ce_overlap.inductor_options())`. Every parameter becomes an `nn.Parameter` holding a DTensor sharded
`Shard(0)` over a 1-D DeviceMesh (torch's chunk layout: uneven dims allowed, as FSDP2's), under its own name,
so `state_dict()`, optimizers, `torch.distributed.checkpoint` and `clip_grad_norm_` see what FSDP2 gives them,
and checkpoints move between the two, across world sizes. Inside a sharded module's forward, reading the
parameter as a module attribute (a class property, as torchtitan's SimpleFSDP does) gathers it; outside, the
attribute is the sharded DTensor parameter, as FSDP2's. The gather is an all-gather of the local shard cast to
`param_dtype` (an uneven shard padded to the chunk, as DTensor pads it), its backward a reduce-scatter in
`reduce_dtype` that averages, as FSDP2's (under tensor parallelism DTensor's `redistribute` does it). Under
torch.compile the all-gathers land in the forward graph and the reduce-scatters in the backward graph, where
ce_overlap's pass buckets, places and reorders them. With reshard_after_forward the gathered weights are recomputed
(re-gathered) in the backward instead of saved, as FSDP does by default.

As in FSDP2, while a sharded module's forward runs each parameter is gathered once, however often the forward
reads it: a tied weight (GPT-2's output projection `F.linear(x, self.wte.weight)`, or one Parameter registered
in two modules) is one all-gather in the forward and one reduce-scatter of its summed gradient in the backward.
And as FSDP2's MixedPrecisionPolicy does, a sharded module's floating-point forward inputs are cast to
`param_dtype` (cast_forward_inputs=False keeps them) and its outputs to `output_dtype` where set.

With vocab_parallel_embeddings, an nn.Embedding whose weight no other module reads is not gathered: its table stays
sharded by rows (the vocabulary), every rank gathers the token ids (a few KiB), looks up those that fall in its own
rows, and the partial embeddings are reduce-scattered back to the ranks that own the tokens (exact: each sum has one
nonzero term). Its backward all-gathers the output gradient and accumulates the rank's own rows, so the table's
gradient needs no reduce-scatter. Per step that moves 2 x world x tokens x dim elements instead of the table's
all-gather and its gradient's reduce-scatter (Llama-3-8B at 2 ranks, 4096 tokens: 64 + 64 MiB against 501 + 1002 MiB).
Every rank must then look up as many tokens per step as the others (the token ids are all-gathered), as the inputs of
any collective must match.
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import hashlib
import inspect
import itertools
import logging
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import nodes
from . import fused_optim
from .plans import GatherConfig, GatherPlan, ShardSpec, TensorParallel, intern_plan
from ..errors import CeOverlapError
from ..logs import log_once


def _recompute_everything(ctx, func, *args, **kwargs):
    # The checkpointed region is the gather alone (cast, pad, all-gather, wait, unpad): all of it is recomputed in
    # the backward, so the gathered weight is never saved for it (reshard after forward).
    return CheckpointPolicy.MUST_RECOMPUTE


def _regather_context():
    return create_selective_checkpoint_contexts(_recompute_everything)


# What AOTAutograd's cache keys a selective-checkpoint region by: the policy's source, so a changed policy is a new
# key. Torch 2.14 bypasses its AOTAutograd cache for a context_fn without one ("SAC context_fn does not have a
# cache_hash attribute"), so every compile of a sharded model was never cached. (Measured on CPU, torch 2.14.1, a
# 2-rank fully_shard compile: with it the cache is consulted, but the forward's key still differs from one process to
# the next with a DeviceMesh among the graph's inputs, so a fresh process misses yet; the backward's hits.)
_regather_context.cache_hash = hashlib.sha256(
    (inspect.getsource(_recompute_everything) + inspect.getsource(_regather_context)).encode()).hexdigest()


class _LocalGather(torch.autograd.Function):
    """The no-communication stand-in for the all-gather: the same output shape (the padded shard repeated), and a
    backward that keeps this rank's rows of the gradient (no reduce-scatter). Only for measuring the bound
    that no overlap scheme can pass; the model it trains is not the sharded model."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
        ctx.rows, ctx.rank = shard.shape[0], rank
        return shard.repeat(world_size, *([1] * (shard.dim() - 1)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(0, ctx.rank * ctx.rows, ctx.rows).contiguous(), None, None


_C10D = torch.ops._c10d_functional  # the ops DTensor's redistribute issues (funcol's wrappers are deprecated in 2.14)
# funcol's *_tensor names warn in 2.14 (FutureWarning, eager only), their *_single successors are not in every torch:
_all_gather = getattr(funcol, "all_gather_single", funcol.all_gather_tensor)
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", funcol.reduce_scatter_tensor_autograd)


class _Gather(torch.autograd.Function):
    """The gathered weight from this rank's Shard(0) rows over a 1-D group, as DTensor's `redistribute` to Replicate
    (forward_dtype=param_dtype, backward_dtype=reduce_dtype, grad_placements=[Partial("avg")]) computes it: the shard
    cast, padded to the chunk, all-gathered, the pad cut; the gradient cast, padded, reduce-scattered with "avg", this
    rank's rows kept. Not through DTensor: a DeviceMesh the compiled region touches becomes an input of the graph,
    whose FX graph cache key changes in every process (torch 2.14), so the forward never hit Inductor's cache on a warm
    start (measured: every process's forward a miss, the backward a hit)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, group_name: str, world: int, chunk: int, rows: int,
                param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.group_name, ctx.world, ctx.chunk, ctx.local, ctx.reduce_dtype = group_name, world, chunk, shard.shape[0], \
            reduce_dtype
        x = shard if param_dtype is None else shard.to(param_dtype)
        if world == 1:  # nothing to gather (DTensor issues no collective either); the backward only casts
            return x.view_as(x)
        full = _C10D.wait_tensor(_C10D.all_gather_into_tensor(_pad_rows(x, chunk), world, group_name))
        return full if full.shape[0] == rows else full.narrow(0, 0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype)
        if ctx.world > 1:
            out = _C10D.wait_tensor(_C10D.reduce_scatter_tensor(_pad_rows(out, ctx.world * ctx.chunk), "avg",
                                                                ctx.world, ctx.group_name))
        return (out if out.shape[0] == ctx.local else out.narrow(0, 0, ctx.local)), None, None, None, None, None, None


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` with zero rows appended up to `rows` (as DTensor pads an uneven shard), contiguous for the collective."""
    return (F.pad(x, [0, 0] * (x.dim() - 1) + [0, rows - x.shape[0]]) if x.shape[0] < rows else x).contiguous()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the vocabulary-parallel lookup's average over ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _ReplicaAverage(torch.autograd.Function):
    """Identity forward; the gradient averaged over HSDP's replicas in `reduce_dtype` (an all-reduce over the
    "replicate" group: a functional collective, so the pass sees it and issues it once its reduce-scatter is done).
    As FSDP2: the reduce-scatter's result in the reduce dtype, all-reduced in it, then cast to the parameter's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.group_name, ctx.reduce_dtype = group_name, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x = grad.contiguous() if ctx.reduce_dtype is None else grad.to(ctx.reduce_dtype).contiguous()
        out = funcol.all_reduce(x, "avg", ctx.group_name)  # traced: already waited; eager: async
        out = out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
        return out.to(grad.dtype), None, None


def _vocab_parallel_lookup(module: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """nn.Embedding's forward on its row shard (fully_shard's vocab_parallel_embeddings; the module docstring): the
    tokens of every rank gathered, this rank's rows looked up (the others' zero), the partial embeddings
    reduce-scattered back to the tokens' ranks. The gradient reaches the shard averaged over ranks (scaled by 1 /
    world), as the gathered weight's Partial("avg") reduce-scatter averages it."""
    spec: ShardSpec = module._ce_overlap_specs["weight"]
    plan = spec.plan
    cfg = plan.config
    n, rank = cfg.world, cfg.rank
    w = spec.leaf
    if cfg.param_dtype is not None:
        w = w.to(cfg.param_dtype)
    w = _ScaleGrad.apply(w, 1.0 / n)
    everyone = _all_gather(tokens.reshape(-1), 0, cfg.group_name)  # rank order: rank r's tokens at r * T
    local = everyone - rank * plan.chunk
    mine = (local >= 0) & (local < w.shape[0])
    rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), w)
    rows = rows * mine.unsqueeze(-1).to(rows.dtype)
    out = _reduce_scatter(rows, "sum", 0, cfg.group_name)
    return out.view(*tokens.shape, w.shape[-1])


def _vocab_parallel_ok(sub: nn.Module, plan: GatherPlan, registrations: int, n: int) -> str | None:
    """Why `sub` cannot look up on its row shard (None: it can)."""
    if n == 1:
        return "a world of one rank has no table to gather"
    if plan.config.reduce_dtype != plan.config.param_dtype:
        # The table's gradient is summed over ranks inside the lookup's backward, in the gathered weight's dtype.
        return f"its gradient reduces in {plan.config.reduce_dtype}, not in the gathered {plan.config.param_dtype}"
    if user_class(type(sub)).forward is not nn.Embedding.forward:
        return "its forward is not nn.Embedding's"
    if registrations > 1:
        return "its weight is tied (another module reads it whole)"
    if plan.tp is not None:
        return "tensor parallelism already shards its table"
    if plan.config.replicate_group is not None:
        return "HSDP would all-reduce its gradient across replicas too"
    if sub.padding_idx is not None or sub.max_norm is not None or sub.scale_grad_by_freq or sub.sparse:
        return "it uses padding_idx, max_norm, scale_grad_by_freq or sparse"
    if plan.rows - (n - 1) * plan.chunk <= 0:
        return f"{plan.rows} rows leave a rank of {n} without rows"
    return None


class _ForwardState:
    """Shared by the parameters under one outermost sharded module: the gather-once window, open while its forward
    runs, when each parameter's gathered value is kept (by its index) and handed to every later read in that forward
    (gather_once; False only in tests that capture the graphs without the window).

    The window lives in one dict, written item by item, not in attributes: torch 2.14's Dynamo drops an attribute
    store that sets an attribute of an object from outside the compiled frame back to its value at the frame's entry
    once a higher-order op (flex attention) was traced before it. The window's close was such a store, so a compiled
    forward with flex attention left the window open and its gathered weights in it: every gathered weight became a
    graph output (alive until the next forward, a gradient input to the backward), and a later forward outside the
    compiled code read the kept weights. torch 2.11 keeps the store; both keep item stores on a dict."""

    gather_once = True

    def __init__(self):
        self._window: dict = {"active": False, "gathered": {}}

    @property
    def active(self) -> bool:
        return self._window["active"]

    @property
    def gathered(self) -> dict[int, torch.Tensor]:
        return self._window["gathered"]

    def open(self) -> None:
        self._window["gathered"] = {}
        self._window["active"] = True

    def close(self) -> None:
        self._window["active"] = False
        self._window["gathered"] = {}


def _grad_to_param(spec: ShardSpec, leaf: torch.Tensor) -> None:
    """The leaf's gradient, just accumulated, handed to the sharded Parameter as a DTensor of the Parameter's own spec
    (summed into a gradient already there, as autograd accumulates). A frozen Parameter's is dropped."""
    grad, leaf.grad = leaf.grad, None
    param = spec.param
    if grad is None or leaf is not spec.leaf or not param.requires_grad:
        return
    for module, name in spec.owners:  # a Parameter swapped in under a compiled forward (which does not look)
        if module._parameters.get(name) is not param:
            raise _replaced(module, name)
    if param.grad is None:
        param.grad = DTensor.__new__(DTensor, grad, param._spec, requires_grad=False)  # no __init__: nothing in it
    else:
        param.grad._local_tensor.add_(grad)


def _attach_leaf(spec: ShardSpec) -> None:
    """Makes the sharded Parameter's local tensor the autograd leaf that the gather reads (again after nn.Module._apply
    swapped the Parameter's contents: .to(), .to_empty(), .double()), with the Parameter's requires_grad."""
    local, wanted = spec.param._local_tensor, spec.param.requires_grad
    leaf = spec.leaf
    if leaf is None or spec.local is not local:
        leaf = nn.Parameter(local, requires_grad=wanted)
        spec.leaf, spec.local = leaf, local
    elif leaf.requires_grad != wanted:
        leaf.requires_grad_(wanted)
    if wanted and spec.hooked is not leaf:  # a hook needs a tensor that requires grad
        leaf.register_post_accumulate_grad_hook(functools.partial(_grad_to_param, spec))
        spec.hooked = leaf


def _replaced(module: nn.Module, name: str) -> CeOverlapError:
    return CeOverlapError(f"ce_overlap.fully_shard: parameter {name!r} of {user_class(type(module)).__name__} was "
                          "replaced after it was sharded (tensor parallelism applied after fully_shard? "
                          "load_state_dict(assign=True)?): apply parallelize_module first, then fully_shard, as with "
                          "FSDP2, and load state dicts in place (torch.distributed.checkpoint, or assign=False)")


def _replicate(shard: torch.Tensor, plan: GatherPlan) -> torch.Tensor:
    """The gathered weight (a plain tensor) from this rank's shard (`shard`: the Parameter's local tensor; under tensor
    parallelism this rank's rows of its TP rank's shard): _Gather over the data-parallel group, or under tensor
    parallelism through a Shard(0) DTensor over the data-parallel mesh (the TP mesh is the graph's input anyway)."""
    cfg = plan.config
    if cfg.local:
        x = shard if cfg.param_dtype is None else shard.to(cfg.param_dtype)
        full = _LocalGather.apply(_pad_rows(x, plan.chunk), cfg.world, cfg.rank)
        return full if full.shape[0] == plan.rows else full[: plan.rows]
    if cfg.replicate_group is not None:
        # HSDP, in FSDP2's order: gathered over "shard"; the gradient reduce-scattered (averaged) over "shard", then
        # this rank's rows all-reduced (averaged) over "replicate": the replicas exchange a shard, not the weight.
        shard = _ReplicaAverage.apply(shard, cfg.replicate_group, cfg.reduce_dtype)
    if plan.tp is None:
        return _Gather.apply(shard, cfg.group_name, cfg.world, plan.chunk, plan.rows, cfg.param_dtype,
                             cfg.reduce_dtype)
    shape, stride = (None, None) if plan.simple else (plan.shape, plan.stride)
    shard = DTensor.from_local(shard, cfg.mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)
    return shard.redistribute(placements=[Replicate()], forward_dtype=cfg.param_dtype,
                              backward_dtype=cfg.reduce_dtype).to_local(grad_placements=[Partial("avg")])


def _gather(module: nn.Module, name: str) -> torch.Tensor:
    """The property behind a sharded parameter's name: in a sharded module's forward the gathered weight, else
    (state dicts, initialization, the optimizer's view) the sharded DTensor parameter, as FSDP2's.

    The gather starts from the parameter's local tensor (`spec.leaf`, the autograd leaf) and not from the DTensor
    Parameter: the compiled graph then takes plain tensors and returns plain gradients, which the leaf's hook hands
    to the Parameter (_grad_to_param). With the DTensor as the graph's input, AOTAutograd rebuilt every gradient as
    a DTensor and Dynamo checked every parameter's DTensor spec in Python on every call (issue 56: 4-6 ms of host
    time per step at 100 parameters)."""
    spec: ShardSpec = module._ce_overlap_specs[name]
    state = module._ce_overlap_state  # spec.state: one window per root; read per module, not per parameter
    if not state.active:
        return module._parameters[name]
    index = spec.index
    if state.gather_once:
        full = state.gathered.get(index)
        if full is not None:
            return full
    if not torch.compiler.is_compiling():  # eager: the Parameter still the sharded one, its leaf current
        if module._parameters.get(name) is not spec.param:
            raise _replaced(module, name)
        _attach_leaf(spec)
    # Under tensor parallelism the gather works on plain local tensors (the selective-checkpoint region in and out)
    # and hands the module its TP DTensor, as parallelize_module left it.
    shard, plan = spec.leaf, spec.plan
    if plan.config.reshard_after_forward:
        full = checkpoint(_replicate, shard, plan, use_reentrant=False, context_fn=_regather_context)
    else:
        full = _replicate(shard, plan)
    if plan.simple:
        state.gathered[index] = full
        return full
    if plan.tp is not None:
        full = DTensor.from_local(full, plan.tp.mesh, plan.tp.placements, run_check=False, shape=plan.tp.shape,
                                  stride=plan.tp.stride)
    if plan.keep:
        state.gathered[index] = full
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


class ShardedModule:
    """Mixed into the class of every module under a `fully_shard` call (as FSDP2 does with FSDPModule on the
    modules it is called on). Its forward opens the gather-once window unless one is open, so a parameter read
    in any sharded module's forward is gathered, also when activation checkpointing recomputes a block in the
    backward (outside the root's forward); and on the modules fully_shard was called on it casts the floating
    inputs (MixedPrecisionPolicy.cast_forward_inputs) and outputs (output_dtype). A forward method and not module
    hooks: torch.compile runs a compiled module's hooks outside its graph, where the window would make every
    gathered weight a graph output (saved for the backward instead of re-gathered)."""

    _ce_overlap_state: _ForwardState
    _ce_overlap_input_dtype: torch.dtype | None = None
    _ce_overlap_output_dtype: torch.dtype | None = None
    _ce_overlap_vocab_parallel = False  # a class default, not getattr's: a guard on a missing attribute raises

    def register_parameter(self, name: str, param) -> None:
        spec = self.__dict__.get("_ce_overlap_specs", {}).get(name)
        if spec is not None and param is not spec.param:
            raise _replaced(self, name)
        super().register_parameter(name, param)

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        for spec in self.__dict__.get("_ce_overlap_specs", {}).values():
            _attach_leaf(spec)
        return out

    def requires_grad_(self, requires_grad: bool = True):
        out = super().requires_grad_(requires_grad)
        for sub in self.modules():
            for spec in sub.__dict__.get("_ce_overlap_specs", {}).values():
                _attach_leaf(spec)
        return out

    def forward(self, *args, **kwargs):
        state, dtype = self._ce_overlap_state, self._ce_overlap_input_dtype
        if dtype is not None:
            args, kwargs = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        forward = super().forward
        if self._ce_overlap_vocab_parallel:
            forward = functools.partial(_vocab_parallel_lookup, self)
        if state.active:
            out = forward(*args, **kwargs)
        else:
            state.open()
            try:
                out = forward(*args, **kwargs)
            finally:
                state.close()
        if self._ce_overlap_output_dtype is not None:
            out = _cast_floats(out, self._ce_overlap_output_dtype)
        return out


def user_class(cls: type) -> type:
    """The class a user wrote, under the subclasses fully_shard swaps in."""
    return cls.__dict__.get("_ce_overlap_user_class", cls)


@functools.cache
def _sharded_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` with ShardedModule's forward and a property per sharded parameter name (in a forward, reads gather;
    `_parameters` keeps the shard, so state_dict and named_parameters see it under its own name)."""
    base = user_class(cls)
    attrs = {name: property(functools.partial(_gather, name=name)) for name in names}
    attrs["_ce_overlap_user_class"] = base
    bases = (cls,) if issubclass(cls, ShardedModule) else (ShardedModule, cls)
    return type(base.__name__, bases, attrs)


def _importable(cls: type) -> None:
    """torch 2.11's Dynamo imports, by name, the module of each function it inlines, and ShardedModule.forward makes
    it inline the user's forward: a model class loaded with importlib.util.spec_from_file_location and never put in
    sys.modules then fails to compile ("InternalTorchDynamoError: ModuleNotFoundError: No module named ...", torch's
    own: any wrapper module whose forward calls the user's fails the same way; torch 2.14 compiles it). The class's
    module is found again through its forward's globals and registered under its name."""
    name = cls.__module__
    globals_ = getattr(getattr(cls, "forward", None), "__globals__", None)
    if name in sys.modules or globals_ is None or globals_.get("__name__") != name:
        return
    for ref in gc.get_referrers(globals_):
        if isinstance(ref, types.ModuleType) and ref.__dict__ is globals_:
            sys.modules[name] = ref
            log_once(logging.INFO, f"ce_overlap.fully_shard: module {name!r} (of {cls.__name__}) was not in "
                                   "sys.modules; registered it so that torch.compile can inline its forward")
            return


def _swap_class(module: nn.Module, names: tuple[str, ...]) -> None:
    if names or not isinstance(module, ShardedModule):
        module.__class__ = _sharded_class(type(module), names)


HSDP_NAMES = ("replicate", "shard")  # FSDP2's HSDP mesh: replicas across (nodes), shards within


def _mesh_of(mesh, params: list[nn.Parameter]) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the data-parallel mesh to shard over, the HSDP mesh or None): a 1-D mesh; the "dp" dimension of a ("dp", "tp")
    mesh; the "shard" dimension of a ("replicate", "shard") mesh (HSDP: then the mesh itself too); or the mesh a process
    group spans."""
    if mesh is None:
        mesh = dist.group.WORLD
        if mesh is None:
            raise CeOverlapError("ce_overlap.fully_shard: no mesh given and torch.distributed is not initialized "
                                 "(dist.init_process_group first, or pass a DeviceMesh)")
    if isinstance(mesh, dist.ProcessGroup):
        devices = {p.device.type for p in params if p.device.type != "meta"}
        device_type = devices.pop() if len(devices) == 1 else ("cuda" if torch.cuda.is_available() else "cpu")
        mesh = DeviceMesh.from_group(mesh, device_type)
    if not isinstance(mesh, DeviceMesh):
        raise CeOverlapError(f"ce_overlap.fully_shard: mesh must be a DeviceMesh or a ProcessGroup, got "
                             f"{type(mesh).__name__}")
    if mesh.ndim == 2:
        names = mesh.mesh_dim_names or ()
        if tuple(names) == HSDP_NAMES:
            return mesh["shard"], mesh
        if set(names) != {"dp", "tp"}:
            raise CeOverlapError(f"ce_overlap.fully_shard: a 2-D mesh {tuple(mesh.shape)} with dimension names "
                                 f"{mesh.mesh_dim_names}; in-graph FSDP shards over the dimension named 'dp' of a "
                                 "('dp', 'tp') mesh (tensor parallelism over 'tp'), or HSDP over a ('replicate', "
                                 "'shard') mesh: name them so, or pass the data-parallel dimension itself (mesh['dp'])")
        return mesh["dp"], None
    if mesh.ndim != 1:
        raise CeOverlapError(f"ce_overlap.fully_shard: a {mesh.ndim}-D mesh {tuple(mesh.shape)}; in-graph FSDP "
                             "shards over one dimension (a 1-D mesh, the 'dp' dimension of a ('dp', 'tp') mesh) or "
                             "HSDP over a ('replicate', 'shard') mesh")
    return mesh, None


def _tensor_parallel(param: DTensor, dp_mesh: DeviceMesh, where: str) -> tuple[TensorParallel, DeviceMesh, tuple]:
    """For a parameter tensor parallelism made a DTensor: how it is gathered, and the 2-D mesh and placements of its
    shard, FSDP2's (data-parallel first: Shard(0), or _StridedShard(0) where TP shards dim 0 too), so that state
    dicts and DCP checkpoints are those of FSDP2 + TP."""
    tp_mesh = param.device_mesh
    if tp_mesh.ndim != 1:
        raise CeOverlapError(f"ce_overlap.fully_shard: {where} is a DTensor on a {tp_mesh.ndim}-D mesh "
                             f"{tuple(tp_mesh.shape)}; ce_overlap shards parameters that tensor parallelism placed on "
                             "one mesh dimension (parallelize_module over mesh['tp'])")
    placement = param.placements[0]
    if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, _StridedShard):
        raise CeOverlapError(f"ce_overlap.fully_shard: {where} is a DTensor placed {placement} on its mesh; tensor "
                             "parallelism's parameters are Shard(dim) or Replicate()")
    if tp_mesh == dp_mesh or (tp_mesh.mesh_dim_names is not None and
                              tp_mesh.mesh_dim_names == dp_mesh.mesh_dim_names):
        raise CeOverlapError(f"ce_overlap.fully_shard: {where} is already a DTensor on the data-parallel mesh "
                             f"{dp_mesh.mesh_dim_names or tuple(dp_mesh.shape)} (sharded by another API?); "
                             "in-graph FSDP shards plain parameters or those tensor parallelism placed on "
                             "another mesh dimension")
    for m, what in ((dp_mesh, "data-parallel"), (tp_mesh, "tensor-parallel")):
        if m.mesh_dim_names is None:
            raise CeOverlapError(f"ce_overlap.fully_shard: the {what} mesh of {where} has no dimension name; make "
                                 "the mesh with init_device_mesh(..., mesh_dim_names=('dp', 'tp')) and pass "
                                 "mesh['dp'] (tensor parallelism over mesh['tp'])")
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily():  # the meshes' rank tensors are real (a capture shards under a fake mode)
            spmd_mesh = DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except (RuntimeError, AttributeError) as e:
        raise CeOverlapError(f"ce_overlap.fully_shard: {where} is placed on the tensor-parallel mesh "
                             f"{tp_mesh.mesh_dim_names} and sharded over {dp_mesh.mesh_dim_names}, which are not two "
                             f"dimensions of one device mesh ({e}); slice both from one init_device_mesh") from None
    local = param.to_local()
    tp = TensorParallel(mesh=tp_mesh, placements=tuple(param.placements), shape=param.shape, stride=param.stride(),
                         local_shape=local.shape, local_stride=_contiguous_stride(local.shape))
    split = tp_mesh.size() if isinstance(placement, Shard) and placement.dim == 0 else 1
    dp_placement = _StridedShard(0, split_factor=split) if split > 1 else Shard(0)
    return tp, spmd_mesh, (dp_placement, placement)


def _check_hsdp(hsdp_mesh: DeviceMesh) -> None:
    """HSDP's "shard" dimension is the one the copy engines can serve: inside a node. One that spans nodes is allowed
    (its collectives stay on NCCL; the pass and the runtime decide so) and said once."""

    nodes.record(hsdp_mesh["replicate"].get_group())
    group = hsdp_mesh["shard"].get_group()
    if nodes.record(group) > 1:
        log_once(logging.WARNING, f"ce_overlap.fully_shard: HSDP's 'shard' dimension spans nodes ({nodes.describe(group)}"
                                  "): its all-gathers and reduce-scatters stay on NCCL (copy engines reach one node)")


def _split_for_hierarchical(group: dist.ProcessGroup) -> None:
    """A data-parallel group across nodes gets its node and rail groups now (every rank calls fully_shard), so the
    pass can run a bucket hierarchically (ce_overlap.runtime.hierarchical); a layout that cannot is said once and
    keeps flat NCCL."""
    from ..runtime import hierarchical

    try:
        hierarchical.hierarchy(group)
    except CeOverlapError as e:
        log_once(logging.INFO, f"ce_overlap.fully_shard: group '{group.group_name}' spans nodes; no hierarchical "
                               f"collectives for it ({e}): flat NCCL")


def _check_tensor_parallel_group(tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism's collectives sit on the critical path of every block: its group belongs inside one node."""

    group = tp_mesh.get_group()
    if nodes.record(group) > 1:
        raise CeOverlapError(f"ce_overlap.fully_shard: the tensor-parallel mesh {tp_mesh.mesh_dim_names} spans nodes "
                             f"({nodes.describe(group)}); keep tensor parallelism inside a node (the last dimension "
                             "of init_device_mesh, at most the GPUs of one node) and shard across nodes with 'dp'")


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


def shard_rows(rows: int, world_size: int) -> int:
    """Rows per rank in torch's chunk layout (the last ranks' shards shorter)."""
    return -(-rows // world_size)


def _local_shard(param: torch.Tensor, mesh: DeviceMesh, device: torch.device) -> torch.Tensor:
    """This rank's rows in torch's chunk layout (what DTensor's Shard(0) holds): ceil(rows / n) per rank, the last
    ranks' shorter or empty. Meta or fake parameters get empty shards of the right shape (capture needs shapes).
    A TP DTensor's rows are those of this rank's TP shard (FSDP2's layout under tensor parallelism)."""
    if isinstance(param, DTensor):
        param = param.to_local()
    rows, n, rank = param.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = shard_rows(rows, n)
    start, stop = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
    if param.device.type == "meta" or is_fake(param):
        return torch.empty((stop - start, *param.shape[1:]), dtype=param.dtype, device=device)
    return param.detach()[start:stop].to(device).clone()


def _under_activation_checkpointing(module: nn.Module) -> set[int]:
    """The ids of the modules inside an activation-checkpoint wrapper (torch's checkpoint_wrapper, as torchtitan
    applies per block before sharding)."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    except ImportError:  # pragma: no cover (torch >= 2.11 has it)
        return set()
    return {id(m) for wrapper in module.modules() if isinstance(wrapper, ActivationWrapper)
            for m in wrapper.modules()}


_indices = itertools.count()  # the gather-once window's keys, unique in the process

# Process group name -> what its collectives are to the step ("dp": fully_shard's data-parallel gathers and
# reduce-scatters; "tp": the tensor-parallel mesh of the parameters it sharded; "replicate": HSDP's replicas). The IR's
# collective role (inductor/to_ir.py, docs/ir.md): the planner prefetches and may move "dp" collectives, keeps "tp" ones where
# they are, and issues a "replicate" all-reduce once its reduce-scatter is done.
_GROUP_ROLES: dict[str, str] = {}


def group_role(group_name: str) -> str | None:
    """"dp", "tp" or "replicate" for a process group a fully_shard call named (the latest call wins), else None."""
    return _GROUP_ROLES.get(str(group_name))


def groups_with_role(role: str) -> list[str]:
    """The names of the process groups fully_shard named `role` ("dp" or "tp")."""
    return [name for name, r in _GROUP_ROLES.items() if r == role]


def fully_shard(module: nn.Module, mesh: DeviceMesh | dist.ProcessGroup | None = None, *,
                reshard_after_forward: bool = True, mp_policy=None, device: torch.device | str | None = None,
                vocab_parallel_embeddings: bool = False, _local_gather: bool = False) -> nn.Module:
    """Shards the parameters of `module` not yet sharded, in place, over a 1-D `mesh` (a DeviceMesh, or a
    ProcessGroup; default: the world), as FSDP2's `fully_shard` does: call it on each block, then on the root.

    mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy (param_dtype: the gathered weights' dtype;
    reduce_dtype: the gradient reduce-scatter's, default param_dtype; output_dtype; cast_forward_inputs).
    Default: no casting, as FSDP2's. reshard_after_forward: gather the weights again in the backward instead of
    keeping them from the forward. device: where the shards live (default: the parameters' device).
    A Parameter registered in several modules (tied) stays one shard, gathered once per forward.
    vocab_parallel_embeddings: the nn.Embedding modules this call shards look up their tokens on their row shards
    instead of gathering the table (the module docstring); one that cannot (a tied weight, padding_idx, max_norm,
    scale_grad_by_freq, sparse, a subclass's forward, a rank without rows, a reduce_dtype other than param_dtype) is
    gathered as any weight, said once in the log. _local_gather:
    bench/train.py's no-communication bound (local ops of the gathers' shapes), not a sharded model.
    Returns the module; its modules' classes are swapped for subclasses of the same names that gather (state-dict
    keys unchanged).
    """
    if not isinstance(module, nn.Module):
        raise CeOverlapError(f"ce_overlap.fully_shard: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, ShardedModule):
        raise CeOverlapError(f"ce_overlap.fully_shard: {type(module).__name__} is already sharded by "
                             "ce_overlap.fully_shard (itself or inside a module it was called on: call it once per "
                             "module, bottom-up: each block, then the root)")
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise CeOverlapError("ce_overlap.fully_shard: the module is already sharded by FSDP2's fully_shard; use one "
                             "or the other (ce_overlap.fsdp.use_copy_engines speeds up FSDP2's)")
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy()
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise CeOverlapError(f"ce_overlap.fully_shard: mp_policy must be a MixedPrecisionPolicy, got "
                             f"{type(mp_policy).__name__}")
    param_dtype, output_dtype = mp_policy.param_dtype, mp_policy.output_dtype
    fused_optim.install()
    reduce_dtype = mp_policy.reduce_dtype or param_dtype

    specs = {id(p): spec for sub in module.modules() for name, p in sub._parameters.items()
             if (spec := getattr(sub, "_ce_overlap_specs", {}).get(name)) is not None}   # sharded by earlier calls
    todo = [(sub, name, p) for sub in module.modules() for name, p in sub._parameters.items()
            if p is not None and id(p) not in specs]
    mesh, hsdp_mesh = _mesh_of(mesh, [p for _, _, p in todo])
    _GROUP_ROLES[mesh.get_group().group_name] = "dp"
    if nodes.record(mesh.get_group()) > 1 and hsdp_mesh is None:  # the IR's "nodes": priced across nodes
        _split_for_hierarchical(mesh.get_group())
    replicate_group = None
    if hsdp_mesh is not None:
        _check_hsdp(hsdp_mesh)
        replicate_group = hsdp_mesh["replicate"].get_group().group_name
        _GROUP_ROLES[replicate_group] = "replicate"
    state = _ForwardState()
    config = GatherConfig(param_dtype, reduce_dtype, reshard_after_forward, _local_gather, mesh,
                           mesh.get_group().group_name, mesh.size(), mesh.get_local_rank(), replicate_group)
    under_ac = _under_activation_checkpointing(module)
    sharded: dict[int, nn.Parameter] = {}   # id of an original Parameter -> its shard (tied Parameters: one shard)
    for sub, name, param in todo:
        if id(param) in sharded:
            continue
        where = f"parameter {name!r} of {type(sub).__name__}"
        if param.dim() == 0:
            raise CeOverlapError(f"ce_overlap.fully_shard: {where} is a scalar; in-graph FSDP shards along dim 0")
        target = torch.device(device) if device is not None else \
            (param.device if param.device.type != "meta" else torch.device(mesh.device_type))
        local = _local_shard(param, mesh, target)
        if isinstance(param, DTensor) and hsdp_mesh is not None:
            raise CeOverlapError(f"ce_overlap.fully_shard: {where} is a DTensor (tensor parallelism?); HSDP over a "
                                 "('replicate', 'shard') mesh shards plain parameters (HSDP x TP is not supported)")
        if isinstance(param, DTensor):
            tp, spmd_mesh, placements = _tensor_parallel(param, mesh, where)
            _check_tensor_parallel_group(tp.mesh)
            _GROUP_ROLES[tp.mesh.get_group().group_name] = "tp"
            rows = tp.local_shape[0]
        elif hsdp_mesh is not None:  # FSDP2's HSDP layout: replicated over "replicate", sharded over "shard"
            tp, spmd_mesh, placements, rows = None, hsdp_mesh, (Replicate(), Shard(0)), param.shape[0]
        else:
            tp, spmd_mesh, placements, rows = None, mesh, (Shard(0),), param.shape[0]
        dt = DTensor.from_local(local, spmd_mesh, placements, run_check=False, shape=param.shape,
                                stride=param.stride())
        shard = nn.Parameter(dt, requires_grad=param.requires_grad)
        gathered_shape, gathered_stride = (tp.local_shape, tp.local_stride) if tp is not None else \
            (param.shape, tuple(param.stride()))
        if gathered_shape[0] % mesh.size() == 0 and tuple(gathered_stride) == _contiguous_stride(gathered_shape):
            gathered_shape = gathered_stride = None  # even rows: from_local infers both (and Dynamo guards one None)
        plan = GatherPlan(rows, shard_rows(rows, mesh.size()), config, gathered_shape, gathered_stride, tp)
        spec = ShardSpec(intern_plan(plan), index=next(_indices), param=shard)
        _attach_leaf(spec)
        specs[id(shard)] = spec
        sharded[id(param)] = shard
    for sub, name, param in todo:
        shard = sharded[id(param)]
        sub._parameters[name] = shard
        if id(sub) in under_ac:  # a tied shard registered under a checkpoint wrapper anywhere
            specs[id(shard)].plan = intern_plan(dataclasses.replace(specs[id(shard)].plan, keep=False))
    # Every module reading a sharded parameter (a tied one: also modules outside this call's earlier blocks)
    # gets the property that gathers it.
    for sub in module.modules():
        own = {name: specs[id(p)] for name, p in sub._parameters.items() if p is not None and id(p) in specs}
        new = tuple(sorted(name for name in own if not isinstance(getattr(type(sub), name, None), property)))
        if own:
            sub._ce_overlap_specs = {**getattr(sub, "_ce_overlap_specs", {}), **own}
        for name, spec in own.items():
            if not any(m is sub and n == name for m, n in spec.owners):
                spec.owners.append((sub, name))
        _swap_class(sub, new)
        _importable(user_class(type(sub)))
        sub._ce_overlap_state = state
    if vocab_parallel_embeddings and not _local_gather:
        registrations: dict[int, int] = {}
        for sub in module.modules():
            for p in sub._parameters.values():
                if p is not None:
                    registrations[id(p)] = registrations.get(id(p), 0) + 1
        for sub, name, param in todo:
            if not isinstance(sub, nn.Embedding) or name != "weight":
                continue
            shard = sharded[id(param)]
            why = _vocab_parallel_ok(sub, specs[id(shard)].plan, registrations[id(shard)], mesh.size())
            if why is None:
                sub._ce_overlap_vocab_parallel = True
            else:
                log_once(logging.WARNING, f"ce_overlap.fully_shard: {type(sub).__name__} with {param.shape[0]} rows "
                                          f"gathers its table ({why}): vocab_parallel_embeddings skips it")
    module._ce_overlap_input_dtype = param_dtype if mp_policy.cast_forward_inputs else None
    module._ce_overlap_output_dtype = output_dtype
    return module
