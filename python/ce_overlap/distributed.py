"""The torch.distributed backend "ce_overlap": process groups whose collectives and send / recv run on copy engines.

    import ce_overlap                       # registers the backend (now if torch is imported, else when it is)
    dist.init_process_group("cpu:gloo,cuda:ce_overlap")            # every CUDA op of the default group
    pp = dist.new_group(ranks, backend="cuda:ce_overlap")          # or one group, e.g. for pipeline stages

On such a group, send / recv (isend, irecv, batch_isend_irecv: torch.distributed.pipelining unchanged),
all_gather_into_tensor (and its coalesced form), reduce_scatter_tensor (sum / avg of float32, float16, bfloat16),
all_to_all_single with equal splits and broadcast run on the CE runtime; every other op, and every call the runtime
cannot serve, runs on an inner backend the group owns (NCCL, or gloo where NCCL cannot run, e.g. ranks sharing a
GPU), with the reason logged once. A send needs no matching receive posted first, and no batching: each direction
between two ranks has its own stream. Works are real: wait() orders the caller's stream, is_completed() polls, and a
peer that never arrives fails every survivor's works within RuntimeConfig.timeout_s.

Options: `pg_options=ce_overlap.distributed.BackendOptions(runtime=RuntimeConfig(...), inner="auto")` given to
init_process_group / new_group; without them RuntimeConfig.from_env() and inner="auto". The group's CE rendezvous
happens when the backend is created (the CUDA device must be set first, as for NCCL): if it fails on any rank, every
rank keeps the inner backend for all ops and says why.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import threading

from .runtime.config import RuntimeConfig
from .store import wait_for_ranks

BACKEND_NAME = "ce_overlap"
INNER_CHOICES = ("auto", "nccl", "gloo")

log = logging.getLogger("ce_overlap")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackendOptions:
    """Options of a "ce_overlap" process group (give as pg_options)."""

    runtime: RuntimeConfig | None = None
    """The group's runtime settings (pool size, timeout, ...); None: RuntimeConfig.from_env()."""

    inner: str = "auto"
    """The backend for every op the copy engines do not run: "nccl", "gloo", or "auto" (NCCL when every rank has a
    GPU of its own and NCCL is available, else gloo)."""

    def __post_init__(self):
        from .errors import CeOverlapError

        if self.runtime is not None and not isinstance(self.runtime, RuntimeConfig):
            raise CeOverlapError(f"BackendOptions.runtime: expected a RuntimeConfig or None, got {self.runtime!r}")
        if self.inner not in INNER_CHOICES:
            raise CeOverlapError(f"BackendOptions.inner: expected one of {INNER_CHOICES}, got {self.inner!r}")


# --------------------------------------------------------------------------------------------------
# Creation (called by torch.distributed for every group with this backend, on every member rank)


def _device_ids(store, rank: int, size: int, device: int, timeout) -> list[str]:
    """Every rank's GPU (its UUID), through the store."""
    import torch

    props = torch.cuda.get_device_properties(device)
    mine = str(getattr(props, "uuid", "")) or f"{props.pci_domain_id}:{props.pci_bus_id}:{props.pci_device_id}"
    store.set(f"device/{rank}", mine)
    keys = [f"device/{r}" for r in range(size)]
    missing, error = wait_for_ranks(store, keys, range(size), timeout.total_seconds())
    if missing:
        raise RuntimeError(f"ce_overlap backend: creating a group of {size} (rank {rank}) timed out after {timeout}: "
                           f"group ranks {missing} never published their GPU (did every rank of the group create it?). "
                           f"Store error: {error}")
    return [store.get(k).decode() for k in keys]


def _inner_backend(choice: str, store, rank: int, size: int, timeout, group_name: str, global_ranks, shared_gpu: bool):
    import torch.distributed as dist

    if choice == "auto":
        choice = "nccl" if dist.is_nccl_available() and not shared_gpu else "gloo"
    prefix = dist.PrefixStore("inner/", store)
    if choice == "nccl":
        if not dist.is_nccl_available():
            raise RuntimeError("ce_overlap backend: BackendOptions.inner='nccl' but this torch has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.group_name = f"{group_name}:inner"
        opts.global_ranks_in_group = list(global_ranks)
        inner = dist.ProcessGroupNCCL(prefix, rank, size, opts)
    else:
        inner = dist.ProcessGroupGloo(prefix, rank, size, timeout)
    try:
        inner._set_sequence_number_for_group()
    except (AttributeError, RuntimeError):
        pass
    return inner


def _ce_rendezvous(store, rank: int, size: int, device: int, name: str, config: RuntimeConfig) -> str:
    """The CE rendezvous of the group and the ranks' agreement on it: "" when every rank has the pool, else why not
    (then no rank keeps one)."""
    from . import runtime

    why = ""
    avail = runtime.available()
    if not avail:
        why = avail.reason
    else:
        try:
            # The backend stands in for the group's own (NCCL): hosts bind it, simulated nodes do not (on one machine
            # its ranks share an NVLink domain; tests run a group across simulated nodes on it, as NCCL would).
            runtime.open_pool(name, rank, size, device, store, "pool/", config, node="")
        except Exception as e:  # noqa: BLE001 (any failure means: keep the inner backend, and say why)
            why = f"{type(e).__name__}: {e}"
    store.set(f"ok/{rank}", why or "ok")
    keys = [f"ok/{r}" for r in range(size)]
    store.wait(keys, datetime.timedelta(seconds=config.timeout_s + 30))
    answers = [store.get(k).decode() for k in keys]
    failed = [(r, a) for r, a in enumerate(answers) if a != "ok"]
    if failed:
        if not why:
            runtime.close_pool(name)
        r, reason = failed[0]
        return f"rank {r}: {reason}"
    return ""


def _create_backend(dist_opts, backend_options):
    """torch.distributed's creator (extended API): the inner backend, the CE rendezvous, the C++ backend."""
    import torch
    import torch.distributed as dist

    from . import runtime

    options = backend_options if isinstance(backend_options, BackendOptions) else BackendOptions()
    if backend_options is not None and not isinstance(backend_options, BackendOptions):
        log.warning("ce_overlap backend: pg_options of type %s are not BackendOptions; using the defaults",
                    type(backend_options).__name__)
    config = options.runtime if options.runtime is not None else RuntimeConfig.from_env()
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    name, timeout = str(dist_opts.group_id), dist_opts.timeout
    if not torch.cuda.is_available():
        raise RuntimeError("ce_overlap backend: no CUDA device in this process (torch.cuda.is_available() is False); "
                           "the backend serves CUDA tensors: use gloo for CPU-only groups")
    device = torch.cuda.current_device()
    devices = _device_ids(dist.PrefixStore("ce_overlap/", store), rank, size, device, timeout)
    shared_gpu = len(set(devices)) < size
    inner = _inner_backend(options.inner, store, rank, size, timeout, name,
                           getattr(dist_opts, "global_ranks_in_group", range(size)), shared_gpu)
    try:
        from . import _c10d
    except ImportError as e:  # no native backend in this build: the inner backend is all there is
        log.warning("ce_overlap backend: group '%s' runs on %s: the native backend (ce_overlap._c10d) does not load "
                    "(%s)", name, inner.name(), e)
        return inner
    why = _ce_rendezvous(dist.PrefixStore("ce_overlap/", store), rank, size, device, name, config)
    if why:
        log.warning("ce_overlap backend: group '%s' keeps %s for every op: %s", name, inner.name(), why)
    else:
        log.info("ce_overlap backend: group '%s' (%d ranks%s): copy engines, inner backend %s", name, size,
                 ", sharing GPUs" if shared_gpu else "", inner.name())
    return _c10d.make_backend(rank, size, name, device, inner, why)


# --------------------------------------------------------------------------------------------------
# Registration and introspection


_registered = False
_lock = threading.Lock()


def register() -> None:
    """Registers the backend with torch.distributed (idempotent); `import ce_overlap` has it called once torch is
    imported (ce_overlap/_torch_hook.py)."""
    global _registered
    with _lock:
        if _registered:
            return
        import torch.distributed as dist

        if BACKEND_NAME.upper() not in dist.Backend._plugins:
            dist.Backend.register_backend(BACKEND_NAME, _create_backend, extended_api=True, devices=["cuda"])
        _registered = True


def backend_of(group=None):
    """The "ce_overlap" backend object of `group` (default: WORLD) for CUDA tensors."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    return group._get_backend(torch.device("cuda"))


def op_counts(group=None) -> dict[str, int]:
    """Per op, the calls of `group` that ran on copy engines ("<op>:ce") and on the inner backend ("<op>:inner")."""
    from . import _c10d

    return dict(_c10d.counts(backend_of(group)))


def inner_backend(group=None):
    """The inner backend of a "ce_overlap" group (what its delegated ops run on)."""
    from . import _c10d

    return _c10d.inner(backend_of(group))
