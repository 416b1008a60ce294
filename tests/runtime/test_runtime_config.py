"""RuntimeConfig and the environment table: one default per field, variables only as overrides read in one place,
the C++ runtime validating what it receives (naming the field), and docs/configuration.md listing the same table."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
import torch

import ce_overlap.runtime as rt
from ce_overlap import environment
from ce_overlap.runtime.config import RuntimeConfig, RuntimeConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_and_derived_sizes():
    c = RuntimeConfig.from_env(environ={})
    assert c == RuntimeConfig()
    assert (c.pool_mb, c.timeout_s, c.reduce_sms, c.rs_round_mb, c.pull_split) == (1024.0, 60.0, 32, 64.0, 1)
    assert (c.group_staging_mb(), c.group_p2p_mb()) == (256.0, 64.0)
    small = RuntimeConfig(pool_mb=128)
    assert (small.group_staging_mb(), small.group_p2p_mb()) == (32.0, 16.0)
    assert small.pool_create_args() == (128.0, 32.0, 16.0, 60.0, 32.0, 64.0, 1.0, 0.0, "")
    assert RuntimeConfig(copy_rate_gbps=300).pool_create_args()[-2] == 300.0
    assert small.process_args() == ("pull", "ce", "stash")


def test_environment_overrides_defaults_and_explicit_fields_override_both():
    env = {"CE_OVERLAP_POOL_MB": "64", "CE_OVERLAP_TIMEOUT_S": "4", "CE_OVERLAP_AG_MODE": "push",
           "CE_OVERLAP_REDUCE_SMS": "16", "CE_OVERLAP_STAGING_MB": ""}  # empty: unset
    c = RuntimeConfig.from_env(environ=env, timeout_s=9.0)
    assert (c.pool_mb, c.timeout_s, c.all_gather_mode, c.reduce_sms, c.staging_mb) == (64.0, 9.0, "push", 16, None)
    assert isinstance(c.reduce_sms, int)


@pytest.mark.parametrize("env,needle", [
    ({"CE_OVERLAP_POOL_MB": "lots"}, "CE_OVERLAP_POOL_MB='lots' is not a positive number"),
    ({"CE_OVERLAP_PULL_SPLIT": "5"}, "CE_OVERLAP_PULL_SPLIT"),
    ({"CE_OVERLAP_REDUCE_SMS": "2.5"}, "CE_OVERLAP_REDUCE_SMS"),
    ({"CE_OVERLAP_POOL_MB": "64", "CE_OVERLAP_STAGING_MB": "128"}, "CE_OVERLAP_STAGING_MB"),
    ({"CE_OVERLAP_KEEP_ALIVE": "forever"}, "RuntimeConfig.keep_alive"),
    ({"CE_OVERLAP_FAULT_INJECT": "meteor"}, "RuntimeConfig.fault_inject"),
    ({"CE_OVERLAP_COPY_RATE_GBPS": "-5"}, "CE_OVERLAP_COPY_RATE_GBPS"),
    ({"CE_OVERLAP_COPY_RATE_GBPS": "fast"}, "CE_OVERLAP_COPY_RATE_GBPS"),
])
def test_bad_variables_are_named(env, needle):
    with pytest.raises(RuntimeConfigError, match=needle):
        RuntimeConfig.from_env(environ=env)


@pytest.mark.parametrize("fields,needle", [
    (dict(pool_mb=0), "pool_mb"), (dict(timeout_s=-1), "timeout_s"), (dict(pull_split=0), "pull_split"),
    (dict(reduce_sms=2000), "reduce_sms"), (dict(p2p_mb=0.5), "p2p_mb"), (dict(all_gather_mode="sideways"),
                                                                          "all_gather_mode"),
    (dict(pool_mb=True), "pool_mb"), (dict(copy_rate_gbps=float("inf")), "copy_rate_gbps"),
    (dict(copy_rate_gbps=-1), "copy_rate_gbps"),
])
def test_bad_fields_are_named(fields, needle):
    with pytest.raises(RuntimeConfigError, match=f"RuntimeConfig.{needle}"):
        RuntimeConfig(**fields)


def test_the_native_runtime_validates_what_it_receives():
    ok, reason = rt.library_loaded()
    if not ok:
        pytest.skip(f"runtime library not loadable: {reason}")
    ops = torch.ops.ce_overlap
    bad = {"staging_mb": (64.0, 128.0, 8.0, 60.0, 32.0, 32.0, 1.0, 0.0, ""),
           "reduce_sms": (64.0, 16.0, 8.0, 60.0, 2.5, 32.0, 1.0, 0.0, ""),
           "pull_split": (64.0, 16.0, 8.0, 60.0, 32.0, 32.0, 9.0, 0.0, ""),
           "copy_rate_gbps": (64.0, 16.0, 8.0, 60.0, 32.0, 32.0, 1.0, -1.0, ""),
           "fault_inject": (64.0, 16.0, 8.0, 60.0, 32.0, 32.0, 1.0, 0.0, "meteor")}
    for field, args in bad.items():
        with pytest.raises(RuntimeError, match=f"RuntimeConfig.{field}"):
            ops._pool_create("config-check", 0, 1, 0, *args)
        assert ops._has_group("config-check") is False
    with pytest.raises(RuntimeError, match="RuntimeConfig.keep_alive"):
        ops._configure_process("pull", "ce", "forever")


def test_rendezvous_refuses_a_config_of_the_wrong_type():
    with pytest.raises((TypeError, RuntimeError)):
        rt.rendezvous(None, config={"pool_mb": 64})


def _doc_table(heading: str) -> list[list[str]]:
    with open(os.path.join(REPO, "docs", "configuration.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [[c.strip().strip("`") for c in row.strip("|").split("|")] for row in rows]


def test_docs_list_every_variable_and_field_once():
    documented = [row[0] for row in _doc_table("## Environment variables")]
    assert sorted(documented) == sorted(environment.VARIABLES), "docs/configuration.md and ce_overlap.environment"
    fields = [row[0] for row in _doc_table("## RuntimeConfig")]
    assert sorted(fields) == sorted(f.name for f in dataclasses.fields(RuntimeConfig))
    for field, var in RuntimeConfig.ENV.items():
        assert environment.VARIABLES[var].startswith(f"RuntimeConfig.{field}"), var
    assert sorted(RuntimeConfig.ENV) == sorted(f.name for f in dataclasses.fields(RuntimeConfig))


def test_only_the_environment_module_reads_ce_overlap_variables():
    """No module of the package reads a CE_OVERLAP_ variable itself (nor sets one for the runtime to read)."""
    pattern = re.compile(r"(os\.environ|getenv|environ\.get|setdefault)[^\n]*CE_OVERLAP_")
    offenders = []
    root = os.path.join(REPO, "python", "ce_overlap")
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("ce_overlap", "environment.py")):
                continue
            with open(path, encoding="utf-8") as f:
                for no, line in enumerate(f, 1):
                    if pattern.search(line):
                        offenders.append(f"{os.path.relpath(path, REPO)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    with pytest.raises(KeyError, match="not one of ce_overlap's variables"):
        environment.read("CE_OVERLAP_NO_SUCH_THING")
