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
from .collectives import (all_gather, all_gather_into_tensor, all_gather_many, all_to_all_single, broadcast,
                          reduce_scatter, reduce_scatter_many, reduce_scatter_tensor, wait_tensor)
from .config import RuntimeConfig, RuntimeConfigError
from .groups import (close_pool, config_of, describe, group_name_and_size, open_pool, rendezvous, rendezvoused_groups,
                     synchronize)
from .library import Availability, available, library_candidates, library_loaded, load_library
from .p2p import P2POp, P2PWork, batch_isend_irecv, irecv, isend, recv, send
from .symmetric import empty_symmetric, is_symmetric

__all__ = [
    "Availability", "RuntimeConfig", "RuntimeConfigError", "available", "library_loaded", "load_library", "rendezvous",
    "group_name_and_size",
    "all_gather_into_tensor", "all_gather", "all_gather_many", "reduce_scatter_tensor", "reduce_scatter",
    "reduce_scatter_many", "empty_symmetric", "is_symmetric", "synchronize", "wait_tensor", "describe",
    "all_to_all_single", "broadcast", "P2POp", "P2PWork", "batch_isend_irecv", "send", "recv", "isend", "irecv",
]
