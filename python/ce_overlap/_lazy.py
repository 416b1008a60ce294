"""The names the package face (ce_overlap/__init__.py) hands on only when first used, because they import torch:
the graph pass (inductor/pass_.py) and in-graph FSDP (in_graph/fully_shard.py)."""
from __future__ import annotations

_PASS = {"inductor_options", "CeOverlapPass", "register_backend"}


def __getattr__(name):
    if name in _PASS:
        from .inductor import pass_

        return getattr(pass_, name)
    if name == "fully_shard":
        from .in_graph.fully_shard import fully_shard

        return fully_shard
    raise AttributeError(f"module 'ce_overlap' has no attribute {name!r}")
