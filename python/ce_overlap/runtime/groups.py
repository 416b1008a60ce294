"""Process groups on the copy engines: the rendezvous that creates and maps each rank's symmetric pool, the group's
config, waiting for and describing its ops."""
from __future__ import annotations

import torch

from ..store import wait_for_ranks
from .config import RuntimeConfig
from .library import load_library

_groups: dict[str, int] = {}  # rendezvoused group name -> world size
_configs: dict[str, RuntimeConfig] = {}  # rendezvoused group name -> its config
_generations: dict[str, int] = {}  # group name -> rendezvous of it so far in this process (equal on every rank)
_process_args: tuple | None = None  # the process fields last given to the library


def resolve_group(group):
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
    group = resolve_group(group)
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

    # Every rank of the group gets the same answer (their nodes): all raise, none waits for the others; a rank that
    # never arrives is named after the rendezvous's timeout.
    require_one_node(group, "ce_overlap.runtime: copy-engine collectives", config.timeout_s)
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
        missing, error = wait_for_ranks(store, keys, range(world), config.timeout_s)
        if missing:
            raise RuntimeError(
                f"ce_overlap.rendezvous of group '{name}' (rank {rank} of {world}) timed out after {config.timeout_s} "
                f"s: ranks {missing} never published their pool handle (did every rank of the group call "
                f"ce_overlap.runtime.rendezvous or its first CE collective?). Store error: {error}")
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


def synchronize(group=None, timeout_s: float | None = None) -> None:
    """Blocks the host until every CE op enqueued on `group` completed. Raises RuntimeError with the watchdog's
    message if one timed out (CE_OVERLAP_TIMEOUT_S). Polls: never hangs in a CUDA call."""
    name, _ = group_name_and_size(group)
    torch.ops.ce_overlap._synchronize(name, float(timeout_s or 0.0))


def describe(group=None) -> str:
    """One line on the group's pool and state (rank, GPU, sizes, epochs, in-flight ops, failure)."""
    name, _ = group_name_and_size(group)
    return torch.ops.ce_overlap._describe(name)
