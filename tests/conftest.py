"""Shared fixtures: captures are expensive, so each configuration is captured once per session."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")


@functools.cache
def _capture_zoo(name: str, world_size: int, reshard: bool = True, seq_len: int | None = None):
    import ce_overlap
    from ce_overlap import models

    built = models.build_named(name, seq_len=seq_len)
    return ce_overlap.capture(built.module, built.example_inputs, world_size=world_size,
                              reshard_after_forward=reshard, name=name)


@pytest.fixture(scope="session")
def capture_zoo():
    return _capture_zoo


@pytest.fixture(scope="session")
def tiny_ir():
    return _capture_zoo("llama3-tiny", 8)


def run_cli(*args: str, env_extra: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "ce_overlap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture
def cli(tmp_path):
    """Runs the CLI with a private capture cache."""
    def run(*args: str, **kw):
        return run_cli(*args, env_extra={"CE_OVERLAP_CACHE": str(tmp_path / "cache")}, **kw)
    return run
