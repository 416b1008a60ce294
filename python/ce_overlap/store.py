"""Waiting on the job's store for keys that other ranks publish (their hosts, pool handles, allocations, plans):
the one place that turns a store's timeout, whose type and text depend on the store, into the ranks that never
published. Not a collective: a rank that died or never reached the same call is named, not waited on forever."""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence


def wait_for_ranks(store, keys: Sequence[str], ranks: Sequence[int], timeout_s: float | None) -> tuple[list[int], str]:
    """Waits until every key exists (`keys[i]` is published by `ranks[i]`), at most `timeout_s` seconds (None: the
    store's own timeout). Returns ([], "") when all arrived, else (the ranks whose key is missing, the store's
    error)."""
    try:
        if timeout_s is None:
            store.wait(list(keys))
        else:
            store.wait(list(keys), timedelta(seconds=timeout_s))
        return [], ""
    except Exception as e:  # noqa: BLE001 (store timeouts have backend-specific types)
        return [r for r, k in zip(ranks, keys) if not store.check([k])], str(e)
