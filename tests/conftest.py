"""Shared fixtures: captures are expensive, so each configuration is captured once per session."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")


def load_data_module(name: str):
    """tests/data/NAME.py as a module (registered in sys.modules: dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"ce_overlap_test_{name}", os.path.join(DATA, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _capture_zoo(name: str, world_size: int, reshard: bool = True, seq_len: int | None = None, full: bool = False,
                 vocab_parallel: bool = False):
    """A zoo model's IR as the CLI captures it: deep models extrapolated from 3 and 4 blocks unless `full`
    (tests/test_extrapolate.py holds the two to be identical)."""
    from ce_overlap.ir import capture_named

    return capture_named(name, world_size=world_size, reshard_after_forward=reshard, seq_len=seq_len, full=full,
                         vocab_parallel_embeddings=vocab_parallel)


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


@pytest.fixture
def gloo_world1():
    """A real gloo default group of one rank on CPU (torch.compile end to end, FSDP2, the backend chooser)."""
    import torch
    import torch.distributed as dist

    assert not dist.is_initialized()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch._dynamo.reset()
    try:
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
