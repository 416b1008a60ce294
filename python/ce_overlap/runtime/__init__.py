"""ce_overlap.runtime: copy-engine collectives from Python (the native library ce_overlap/_runtime.so).

Importing this module never raises and never touches the GPU: `available()` says whether the runtime can
run here, and why not. Everything else loads the library on first use and raises RuntimeError with the
reason when it cannot.

Ops (no host wait). The `_out` ops are stream-ordered: the result is ready on the caller's current stream. The
functional ops are asynchronous like _c10d_functional's: the result is ready once `wait_tensor(result)` was called
on the stream that uses it, so the work between the two overlaps the collective:
    torch.ops.ce_overlap.all_gather_into_tensor(input, group_size, group_name) -> Tensor          (then wait_tensor)
    torch.ops.ce_overlap.all_gather_into_tensor_out(input, group_size, group_name, out=out) -> ()
    torch.ops.ce_overlap.reduce_scatter_tensor(input, reduce_op, group_size, group_name) -> Tensor (then wait_tensor)
    torch.ops.ce_overlap.reduce_scatter_tensor_out(input, reduce_op, group_size, group_name, out=out) -> ()
    torch.ops.ce_overlap.all_to_all_single(input, group_size, group_name) -> Tensor                (then wait_tensor)
    torch.ops.ce_overlap.all_to_all_single_out(input, group_size, group_name, out=out) -> ()
    torch.ops.ce_overlap.broadcast_(tensor, root, group_size, group_name) -> ()
    torch.ops.ce_overlap.wait_tensor(tensor) -> tensor   (joins the op's stream; raises if a CE collective timed out)
Point-to-point (pipeline parallelism): send / recv / isend / irecv / batch_isend_irecv below.

Settings: a RuntimeConfig (ce_overlap.runtime.config; pool sizes, timeout, reduction CTAs, ...) given to
rendezvous(group, config); without one, RuntimeConfig.from_env() (defaults, then the CE_OVERLAP_* overrides listed
in docs/configuration.md). Test and benchmark hooks (tuning between ops, probes): ce_overlap.runtime.testing.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import threading
from datetime import timedelta
from typing import NamedTuple

import torch

from .. import environment
from .config import RuntimeConfig, RuntimeConfigError

__all__ = [
    "Availability", "RuntimeConfig", "RuntimeConfigError", "available", "library_loaded", "load_library", "rendezvous",
    "group_name_and_size",
    "all_gather_into_tensor", "all_gather", "all_gather_many", "reduce_scatter_tensor", "reduce_scatter",
    "reduce_scatter_many", "empty_symmetric", "is_symmetric", "synchronize", "wait_tensor", "describe",
    "all_to_all_single", "broadcast", "P2POp", "P2PWork", "batch_isend_irecv", "send", "recv", "isend", "irecv",
]


class Availability(NamedTuple):
    """`ok, reason = available()`; also usable as a bool (`if available(): ...`)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:  # a plain tuple would always be truthy
        return self.ok


_lock = threading.Lock()
_loaded_from: str | None = None
_load_error: str | None = None
_groups: dict[str, int] = {}  # rendezvoused group name -> world size
_configs: dict[str, RuntimeConfig] = {}  # rendezvoused group name -> its config
_generations: dict[str, int] = {}  # group name -> rendezvous of it so far in this process (equal on every rank)
_process_args: tuple | None = None  # the process fields last given to the library
_alloc_lock = threading.Lock()
_alloc_seq: dict[str, int] = {}  # group name -> number of empty_symmetric calls so far (SPMD: equal on every rank)
_exchange = None  # _symalloc.StoreExchange over the default store, made on first use


def library_candidates() -> list[str]:
    """Where the library is looked for, first match wins."""
    found: list[str] = []
    explicit = environment.read("CE_OVERLAP_RUNTIME_LIB")
    if explicit:
        return [explicit]
    try:  # installed or editable (scikit-build-core's redirecting finder knows the built file)
        spec = importlib.util.find_spec("ce_overlap._runtime")
        if spec is not None and spec.origin:
            found.append(spec.origin)
    except (ImportError, ValueError):
        pass
    import ce_overlap

    for pkg_dir in list(getattr(ce_overlap, "__path__", [])):
        found += sorted(glob.glob(os.path.join(pkg_dir, "_runtime*.so")))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    found += sorted(glob.glob(os.path.join(repo, "build", "*", "csrc", "runtime", "_runtime.so")))
    return list(dict.fromkeys(found))


def _ops_registered() -> bool:
    try:
        torch.ops.ce_overlap._pool_blob_bytes  # noqa: B018 (attribute lookup raises when absent)
        return True
    except (AttributeError, RuntimeError):
        return False


def load_library() -> str:
    """Loads _runtime.so once (registering torch.ops.ce_overlap.*); returns its path. RuntimeError if it cannot."""
    global _loaded_from, _load_error
    with _lock:
        if _loaded_from is not None:
            return _loaded_from
        if _load_error is not None:
            raise RuntimeError(_load_error)
        if _ops_registered():  # loaded by someone else (e.g. torch.ops.load_library by hand)
            _loaded_from = "(already registered)"
            return _loaded_from
        candidates = [p for p in library_candidates() if os.path.exists(p)]
        if not candidates:
            _load_error = ("ce_overlap runtime library (_runtime.so) not found: it is built only when a CUDA "
                           "toolkit and a CUDA build of torch are present at install time (CE_OVERLAP_BUILD_RUNTIME); "
                           f"looked at {library_candidates() or ['<package dir>']}")
            raise RuntimeError(_load_error)
        errors = []
        for path in candidates:
            try:
                torch.ops.load_library(path)
                _loaded_from = path
                break
            except Exception as e:  # noqa: BLE001 (any loader failure is reported, never raised raw)
                errors.append(f"{path}: {type(e).__name__}: {e}")
        if _loaded_from is None:
            _load_error = "ce_overlap runtime library failed to load: " + "; ".join(errors)
            raise RuntimeError(_load_error)
        return _loaded_from


def library_loaded() -> Availability:
    """Whether the library loads (true on CPU-only machines too, where only the Meta kernels can run)."""
    try:
        return Availability(True, f"loaded from {load_library()}")
    except RuntimeError as e:
        return Availability(False, str(e))


def available() -> Availability:
    """Whether CE collectives can run in this process: library loaded and a CUDA device present."""
    lib = library_loaded()
    if not lib:
        return lib
    try:
        if not torch.cuda.is_available():
            return Availability(False, "torch.cuda.is_available() is False: no GPU or no CUDA driver on this machine")
    except Exception as e:  # noqa: BLE001
        return Availability(False, f"CUDA initialization failed: {e}")
    return Availability(True, f"{lib.reason}; {torch.cuda.device_count()} CUDA device(s)")


def _resolve_group(group):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ce_overlap.runtime needs torch.distributed initialized (init_process_group) first")
    if group is None:
        return dist.group.WORLD
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def _configure_process(config: RuntimeConfig) -> None:
    """Gives the library the config's process-wide fields (when they differ from what it has)."""
    global _process_args
    args = config.process_args()
    if args != _process_args:
        torch.ops.ce_overlap._configure_process(*args)
        _process_args = args


def config_of(group=None) -> RuntimeConfig:
    """The RuntimeConfig `group` was rendezvoused with."""
    name, _ = group_name_and_size(group)
    return _configs.get(name) or RuntimeConfig.from_env()


def rendezvous(group=None, config: RuntimeConfig | None = None) -> str:
    """Creates this rank's symmetric pool for `group` (default: WORLD) and maps every peer's. Collective: every
    rank of the group must call it (the first CE collective on a group calls it implicitly, with the default
    config). `config`: the group's RuntimeConfig (default RuntimeConfig.from_env()); its process-wide fields apply
    to the whole process from now on. Outside CUDA graph capture. Returns the group name. Refuses groups that are
    not fully P2P-connected or span nodes (CeOverlapError naming the ranks and their nodes: ce_overlap.nodes, so
    simulated nodes too)."""
    import torch.distributed as dist

    load_library()
    group = _resolve_group(group)
    name = group.group_name
    if name in _groups and torch.ops.ce_overlap._has_group(name):
        return name
    config = RuntimeConfig.from_env() if config is None else config
    if not isinstance(config, RuntimeConfig):
        raise TypeError(f"ce_overlap.runtime.rendezvous: config must be a RuntimeConfig, got {type(config).__name__}")
    if torch.ops.ce_overlap._has_group(name):
        _groups[name] = dist.get_world_size(group)
        _configs.setdefault(name, config)
        return name
    from ..nodes import require_one_node

    # Every rank of the group gets the same answer (their nodes): all raise, none waits for the others.
    require_one_node(group, "ce_overlap.runtime: copy-engine collectives")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"ce_overlap.rendezvous of group '{name}' must happen outside CUDA graph capture")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    open_pool(name, rank, world, torch.cuda.current_device(), dist.distributed_c10d._get_default_store(),
              f"ce_overlap/pool/{name}/", config)
    return name


def open_pool(name: str, rank: int, world: int, device: int, store, prefix: str, config: RuntimeConfig,
              node: str | None = None) -> None:
    """Rendezvous of group `name` through `store` (what rendezvous and the torch.distributed backend run): creates
    this rank's pool on `device`, publishes its handle under prefix + generation + "/" + rank (the generation counts
    this process's rendezvous of the name, the same on every rank), waits for every rank's
    (RuntimeConfig.timeout_s) and maps them; applies the config's process fields. Ranks on different nodes are
    refused: `node` names this rank's (default ce_overlap.nodes.this_node(): simulated nodes count; "" for the
    hostname alone). On failure nothing of the group remains."""
    load_library()
    _configure_process(config)
    _groups.pop(name, None)  # a group of this name that was closed (e.g. a destroyed process group's backend)
    _configs.pop(name, None)
    # The n-th rendezvous of a name publishes under its own keys: a store keeps the handles of a pool that was closed
    # (close_pool; FSDP2 models built one after another over the default group reuse its name), and a peer reading
    # those would map memory its owner has freed (seen on 2x H200: the first op after a re-rendezvous timed out).
    generation = _generations[name] = _generations.get(name, 0) + 1
    keys = [f"{prefix}{generation}/{r}" for r in range(world)]
    from ..nodes import this_node  # the C++ side refuses ranks whose nodes differ, naming them

    node = this_node() if node is None else node
    blob = torch.ops.ce_overlap._pool_create(name, rank, world, device, *config.pool_create_args(), node)
    try:
        store.set(keys[rank], blob.numpy().tobytes())
        try:
            store.wait(keys, timedelta(seconds=config.timeout_s))
        except Exception as e:  # noqa: BLE001 (store timeouts have backend-specific types)
            missing = [r for r in range(world) if not store.check([keys[r]])]
            raise RuntimeError(
                f"ce_overlap.rendezvous of group '{name}' (rank {rank} of {world}) timed out after {config.timeout_s} "
                f"s: ranks {missing} never published their pool handle (did every rank of the group call "
                f"ce_overlap.runtime.rendezvous or its first CE collective?). Store error: {e}") from None
        raw = b"".join(store.get(k) for k in keys)
        handles = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(world, -1)
        torch.ops.ce_overlap._pool_open(name, handles)
    except BaseException:
        torch.ops.ce_overlap._pool_abort(name)
        raise
    _groups[name] = world
    _configs[name] = config


def close_pool(name: str) -> None:
    """Drops this rank's pool of group `name`: after a rendezvous that the other ranks did not all complete, or when
    the group is done (every rank, after its last op on the group has finished: e.g. behind a barrier). Symmetric
    tensors still alive keep the pool's memory until they are freed; a later op on the group rendezvouses anew."""
    torch.ops.ce_overlap._pool_abort(name)
    _groups.pop(name, None)
    _configs.pop(name, None)


def rendezvoused_groups() -> list[str]:
    """Names of the groups this process has a pool for (rendezvous or the torch.distributed backend)."""
    return sorted(_groups)


def group_name_and_size(group) -> tuple[str, int]:
    """(name, size) of a process group (a ProcessGroup, its name, or None for the default group), rendezvousing it
    first if this process has not yet."""
    if isinstance(group, str) and group in _groups:
        return group, _groups[group]
    if group is not None and not isinstance(group, str):
        name = group.group_name
        if name in _groups:
            return name, _groups[name]
    name = rendezvous(group)
    return name, _groups[name]


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like torch.distributed.all_gather_into_tensor, over copy engines. `output` holds world_size * input.numel()
    elements (any contiguous shape); shard r lands at output.flatten()[r * n:(r + 1) * n]. Stream-ordered on the
    current stream. Zero-copy when `input` comes from empty_symmetric (on every rank, at the same offsets)."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.all_gather_into_tensor_out(input, world, name, out=output)


def all_gather(input: torch.Tensor, group=None) -> torch.Tensor:
    """Functional form: returns a new tensor of shape [world_size * input.shape[0], *input.shape[1:]], ready on the
    current stream (the op plus its wait_tensor)."""
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(torch.ops.ce_overlap.all_gather_into_tensor(input, world, name))


def all_gather_many(inputs: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Several tensors gathered as ONE collective (a bucket without a bucket buffer): output i is what
    all_gather(inputs[i]) returns; every byte goes from its input to its output on copy engines, with no kernel to
    pack or unpack a bucket. Ready on the current stream."""
    if not inputs:
        raise ValueError("all_gather_many: needs at least one input tensor")
    name, world = group_name_and_size(group)
    outs = torch.ops.ce_overlap.all_gather_into_tensors(list(inputs), world, name)
    return [torch.ops.ce_overlap.wait_tensor(t) for t in outs]


def reduce_scatter_many(inputs: list[torch.Tensor], op: str = "sum", group=None) -> torch.Tensor:
    """Several tensors of one dtype reduce-scattered as ONE collective: returns a 1-D tensor, the concatenation in
    input order of reduce_scatter(inputs[i]).flatten(). The copies read each input's chunks where they lie (no
    bucket buffer). Ready on the current stream."""
    if not inputs:
        raise ValueError("reduce_scatter_many: needs at least one input tensor")
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(
        torch.ops.ce_overlap.reduce_scatter_tensors(list(inputs), _reduce_op_name(op), world, name))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: str = "sum", group=None) -> None:
    """Like torch.distributed.reduce_scatter_tensor, on copy engines plus one small reduction kernel (at most
    CE_OVERLAP_REDUCE_SMS CTAs). `input` holds world_size chunks along dim 0 (any contiguous tensor whose numel is
    world_size * output.numel()); rank r gets the sum (op="sum") or mean (op="avg") of every rank's chunk r, summed in
    fp32. float32, float16, bfloat16. Stream-ordered on the current stream. `output` may be input's own chunk."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.reduce_scatter_tensor_out(input, _reduce_op_name(op), world, name, out=output)


def reduce_scatter(input: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """Functional form: returns a new tensor of shape [input.shape[0] // world_size, *input.shape[1:]], ready on the
    current stream (the op plus its wait_tensor)."""
    name, world = group_name_and_size(group)
    return torch.ops.ce_overlap.wait_tensor(
        torch.ops.ce_overlap.reduce_scatter_tensor(input, _reduce_op_name(op), world, name))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """Like torch.distributed.all_to_all_single with equal splits, over copy engines: `input` holds world_size chunks
    along dim 0, chunk p goes to rank p; `output` (as many elements, not overlapping `input`) receives rank p's chunk r
    as its chunk p. Stream-ordered on the current stream. Zero-copy when `input` comes from empty_symmetric (on every
    rank, at the same offset); otherwise staged through the pool."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.all_to_all_single_out(input, world, name, out=output)


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Like torch.distributed.broadcast, over copy engines: every rank's `tensor` gets the bytes of rank `src`'s (the
    rank in `group`). Stream-ordered on the current stream. Zero-copy when `tensor` comes from empty_symmetric on every
    rank (one allocation, the same offset); otherwise staged through the root's pool."""
    name, world = group_name_and_size(group)
    torch.ops.ce_overlap.broadcast_(tensor, int(src), world, name)


class P2POp(NamedTuple):
    """One point-to-point op of a batch: op is "send" or "recv" (or torch.distributed.isend / irecv), peer the other
    rank IN `group` (torch.distributed.P2POp objects are accepted too, with their global peer)."""

    op: object
    tensor: torch.Tensor
    peer: int
    group: object = None


class P2PWork:
    """What isend / irecv / batch_isend_irecv(..., async_op=True) return: wait() makes the current stream wait for the
    ops (no host wait) and raises if a CE op of the process failed (a peer that never arrived: the timeout error).
    is_completed() is True once wait() ran."""

    def __init__(self, ticket: int):
        self._ticket = ticket
        self._waited = ticket == 0

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (torch's Work.wait signature; the watchdog bounds the wait)
        if not self._waited:
            self._waited = True
            torch.ops.ce_overlap._p2p_wait(self._ticket)
        return True

    def is_completed(self) -> bool:
        return self._waited


def _p2p_kind(op) -> str:
    if op in ("send", "recv"):
        return op
    import torch.distributed as dist

    if op in (dist.isend, dist.send):
        return "send"
    if op in (dist.irecv, dist.recv):
        return "recv"
    raise RuntimeError(f"ce_overlap.runtime.batch_isend_irecv: op {op!r} is neither 'send' nor 'recv'")


def _p2p_batch(ops, group, async_op: bool) -> P2PWork:
    import torch.distributed as dist

    sends, send_peers, recvs, recv_peers = [], [], [], []
    for o in ops:
        if isinstance(o, dist.P2POp):  # torch's: peer is a global rank
            kind, tensor, grp = _p2p_kind(o.op), o.tensor, o.group if o.group is not None else group
            peer = dist.get_group_rank(_resolve_group(grp), o.peer)
        else:
            kind, tensor, peer = _p2p_kind(o.op), o.tensor, int(o.peer)
            grp = o.group if o.group is not None else group
        if grp is not group and _resolve_group(grp) is not _resolve_group(group):
            raise RuntimeError("ce_overlap.runtime.batch_isend_irecv: every op of a batch must use the same group")
        (sends if kind == "send" else recvs).append(tensor)
        (send_peers if kind == "send" else recv_peers).append(peer)
    name, _ = group_name_and_size(group)
    if not sends and not recvs:  # this rank takes no part in the batch: nothing to enqueue, nothing to wait for
        return P2PWork(0)
    return P2PWork(int(torch.ops.ce_overlap._batch_p2p(sends, send_peers, recvs, recv_peers, name, async_op)))


def batch_isend_irecv(ops, group=None, async_op: bool = False) -> P2PWork:
    """Sends and receives over copy engines, as one batch (pipeline-parallel activations and gradients). Ops are
    P2POp("send" | "recv", tensor, peer) with `peer` a rank in `group`, or torch.distributed.P2POp objects. Every op of
    the batch starts after the current stream's work so far; sends and receives of one pair are matched in order, per
    direction (as NCCL's). Each direction between two ranks has its own stream, so a batch never deadlocks, whatever
    the order of its ops on either side. async_op=False (default): the current stream waits for the whole batch;
    True: it does not, and the returned work's wait() joins it later. Both tensors of a pair must have the same number
    of bytes. Zero-copy when both sides use one empty_symmetric buffer (the same offset); otherwise the sender pushes
    into the receiver's landing banks (CE_OVERLAP_P2P_MB) and the receiver copies out, pipelined. An empty batch (a
    rank with nothing to send or receive this time) is a no-op and returns a completed work."""
    return _p2p_batch(list(ops), group, async_op)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Sends `tensor` to rank `dst` of `group`, stream-ordered (the current stream waits until it is sent). A send that
    its peer answers only after its own send to us would deadlock on the streams: batch them (batch_isend_irecv) or
    use isend / irecv."""
    batch_isend_irecv([P2POp("send", tensor, dst)], group)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Receives into `tensor` from rank `src` of `group`, stream-ordered (see send)."""
    batch_isend_irecv([P2POp("recv", tensor, src)], group)


def isend(tensor: torch.Tensor, dst: int, group=None) -> P2PWork:
    """Asynchronous send: the current stream does not wait; wait() on the returned work joins it."""
    return batch_isend_irecv([P2POp("send", tensor, dst)], group, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group=None) -> P2PWork:
    """Asynchronous receive: `tensor` holds the message once wait() on the returned work was called."""
    return batch_isend_irecv([P2POp("recv", tensor, src)], group, async_op=True)


def _reduce_op_name(op) -> str:
    if isinstance(op, str):
        return op
    import torch.distributed as dist

    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}
    if op in names:
        return names[op]
    raise RuntimeError(f"ce_overlap reduce_scatter: reduce op {op!r} is not supported (sum and avg are)")


def empty_symmetric(shape, dtype: torch.dtype, group=None) -> torch.Tensor:
    """An uninitialized CUDA tensor inside the group's symmetric pool, so collectives read (and, push mode, write)
    it in place, at the same pool offset on every rank. COLLECTIVE: every rank of the group must call it, the same
    number of times and with the same sizes (else it raises, on every rank, naming the ranks and sizes). The ranks
    agree on the offset through the default c10d store: each publishes the free ranges of its pool, all intersect
    them and take the same first fit (_symalloc.py). One store round trip per call (two when nothing fits until a
    rank waits for the GPU to release freed symmetric tensors)."""
    import torch.distributed as dist

    from . import _symalloc

    global _exchange
    name, world = group_name_and_size(group)
    if isinstance(shape, int):
        shape = (shape,)
    shape = [int(s) for s in shape]
    numel = 1
    for s in shape:
        if s < 0:
            raise RuntimeError(f"ce_overlap.empty_symmetric: negative size {s} in {shape}")
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    rank = dist.get_rank(_resolve_group(group))

    def free_ranges(block: bool):
        flat = [int(v) for v in torch.ops.ce_overlap._symmetric_free_ranges(name, block)]
        return flat[0], list(zip(flat[1::2], flat[2::2]))

    with _alloc_lock:
        if _exchange is None and world > 1:
            _exchange = _symalloc.StoreExchange(dist.distributed_c10d._get_default_store(), config_of(group).timeout_s)
        seq = _alloc_seq.get(name, 0) + 1
        _alloc_seq[name] = seq
        offset = _symalloc.agree(_exchange, name, seq, rank, world, nbytes, free_ranges,
                                 int(torch.ops.ce_overlap._pool_alignment()), shape, str(dtype).replace("torch.", ""))
        return torch.ops.ce_overlap._empty_symmetric_at(shape, dtype, name, offset)


def is_symmetric(tensor: torch.Tensor, group=None) -> bool:
    """Whether `tensor`'s bytes lie in the group's symmetric pool (the zero-copy path)."""
    name, _ = group_name_and_size(group)
    return torch.ops.ce_overlap._symmetric_offset(tensor, name) >= 0


def synchronize(group=None, timeout_s: float | None = None) -> None:
    """Blocks the host until every CE op enqueued on `group` completed. Raises RuntimeError with the watchdog's
    message if one timed out (CE_OVERLAP_TIMEOUT_S). Polls: never hangs in a CUDA call."""
    name, _ = group_name_and_size(group)
    torch.ops.ce_overlap._synchronize(name, float(timeout_s or 0.0))


def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Identity on the stream (ops are stream-ordered); raises if any CE group has failed."""
    load_library()
    return torch.ops.ce_overlap.wait_tensor(tensor)


def describe(group=None) -> str:
    """One line on the group's pool and state (rank, GPU, sizes, epochs, in-flight ops, failure)."""
    name, _ = group_name_and_size(group)
    return torch.ops.ce_overlap._describe(name)
