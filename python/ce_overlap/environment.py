"""Every environment variable ce_overlap reads, and the one function that reads them.

Settings are config objects (PassConfig, RuntimeConfig); a variable only overrides a config field's default, for
jobs launched by scripts that cannot change the code. docs/configuration.md lists the same table (a test keeps the
two equal). No other module of the package reads os.environ for a CE_OVERLAP_ variable.
"""
from __future__ import annotations

import os
from typing import Mapping

PASS_PREFIX = "CE_OVERLAP_PASS_"

# name -> what it overrides. CE_OVERLAP_PASS_<FIELD> stands for one variable per PassConfig field.
VARIABLES: dict[str, str] = {
    PASS_PREFIX + "<FIELD>": "PassConfig.<field> (e.g. CE_OVERLAP_PASS_CE=on, CE_OVERLAP_PASS_BUCKET_CAP_MB=256)",
    "CE_OVERLAP_POOL_MB": "RuntimeConfig.pool_mb",
    "CE_OVERLAP_STAGING_MB": "RuntimeConfig.staging_mb",
    "CE_OVERLAP_P2P_MB": "RuntimeConfig.p2p_mb",
    "CE_OVERLAP_TIMEOUT_S": "RuntimeConfig.timeout_s",
    "CE_OVERLAP_REDUCE_SMS": "RuntimeConfig.reduce_sms",
    "CE_OVERLAP_RS_ROUND_MB": "RuntimeConfig.rs_round_mb",
    "CE_OVERLAP_PULL_SPLIT": "RuntimeConfig.pull_split",
    "CE_OVERLAP_COPY_RATE_GBPS": "RuntimeConfig.copy_rate_gbps",
    "CE_OVERLAP_AG_MODE": "RuntimeConfig.all_gather_mode",
    "CE_OVERLAP_LOCAL_COPY": "RuntimeConfig.local_copy",
    "CE_OVERLAP_KEEP_ALIVE": "RuntimeConfig.keep_alive",
    "CE_OVERLAP_FAULT_INJECT": "RuntimeConfig.fault_inject (tests only)",
    "CE_OVERLAP_RUNTIME_LIB": "the path _runtime.so is loaded from (default: next to the package)",
    "CE_OVERLAP_CACHE": "the capture cache folder of the CLI (default ~/.cache/ce_overlap)",
    "CE_OVERLAP_RANKS_PER_NODE": "simulated nodes: global rank r runs on node r // N (default: the hostname; docs/nodes.md)",
}


def known(name: str) -> bool:
    return name in VARIABLES or (name.startswith(PASS_PREFIX) and name != PASS_PREFIX)


def read(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The variable's value as set (possibly empty), or None when unset. Only names of the table."""
    if not known(name):
        raise KeyError(f"ce_overlap.environment.read: {name} is not one of ce_overlap's variables (see VARIABLES)")
    return (os.environ if environ is None else environ).get(name)
