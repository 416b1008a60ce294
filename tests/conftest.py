"""Shared fixtures: captures are expensive, so each configuration is captured once per session."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
SITE = os.path.join(REPO, "tests", "site")

# Every process the tests start compiles as tests/site/sitecustomize.py says (ATen kernels unless a test asks for
# Inductor's generated ones: the `inductor_codegen` fixture); this process too, however pytest was started.
os.environ["PYTHONPATH"] = os.pathsep.join([SITE, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
# One intra-op thread per process: the suite runs a worker per core, and each worker starts ranks, torchrun agents and
# bench scripts beside the other worker's; with torch's default (a thread per core) their OpenMP threads outnumber the
# cores and spin-wait on each other. Measured on the 2-core machine, cold Inductor cache, 2026-12-04: the suite's
# tests summed 1597 s with the default, bench/compute_models.py's tests 415 s of it (103 s when run alone).
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:  # pytest imported it before this file (a plugin): its pool may be made already
    sys.modules["torch"].set_num_threads(1)
# ... and, on a machine without a GPU, is forked from a process that imported torch already (tests/site/zygote.py;
# CE_TEST_ZYGOTES=0 turns it off): the zygotes of this session serve from one folder, which the process that made it
# (pytest, or its xdist controller) removes at the end. A GPU machine starts every process as usual (its suites time
# the runtime's faults and deaths, where a process of its own is what they are about).
_ZYGOTES: str | None = None  # the folder this process made (and removes at the end)
if os.environ.get("CE_TEST_ZYGOTES") == "0":
    del os.environ["CE_TEST_ZYGOTES"]
elif not os.environ.get("CE_TEST_ZYGOTES") and not os.path.exists("/dev/nvidiactl"):
    import tempfile

    os.environ["CE_TEST_ZYGOTES"] = _ZYGOTES = tempfile.mkdtemp(prefix="ce_zygotes_")


# The slowest test files, slowest first (pytest --durations on a 2-core machine, cold Inductor cache, 2026-12-03,
# ATen kernels and forked process starts: tests/site/): 95-300 s each, the rest under 50 s. Handed out first, so that
# with `--dist loadfile` no worker starts one of them while the other is done.
SLOWEST_FILES = ("test_compute_models.py", "test_fully_shard_2d.py", "test_train_bench.py", "test_pass.py",
                 "test_extrapolate.py", "test_cli.py", "test_fully_shard.py", "test_capture.py", "test_fake_cuda.py")


def pytest_configure(config):
    # pytest-xdist hands out the files with the most tests first unless told not to (--loadscope-reorder, on by
    # default): keep the order below instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_unconfigure(config):
    if _ZYGOTES:
        _site_zygote().stop_all(_ZYGOTES)


def _site_zygote():
    return load_module(os.path.join(SITE, "zygote.py"), "ce_overlap_test_zygote")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def load_module(path: str, name: str | None = None):
    """The Python file at `path` as a module (registered in sys.modules: dataclasses look their module up)."""
    import importlib.util

    name = name or "ce_overlap_test_" + os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_data_module(name: str):
    """tests/data/NAME.py as a module."""
    return load_module(os.path.join(DATA, f"{name}.py"), f"ce_overlap_test_{name}")


_site = sys.modules.get("sitecustomize")
if getattr(_site, "__file__", None) != os.path.join(SITE, "sitecustomize.py"):
    _site = load_module(os.path.join(SITE, "sitecustomize.py"), "ce_overlap_test_site")


@pytest.fixture
def inductor_codegen(monkeypatch):
    """Inductor's generated C++ kernels, built, for this test's compiles and for the processes it starts (the suite's
    default lowers every op to ATen: tests/site/sitecustomize.py)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("CE_OVERLAP_TEST_INDUCTOR", "codegen")
    with inductor_config.patch(_site.CODEGEN):  # empty on torch before 2.14: kernels are always built there
        yield


@functools.cache
def _capture_zoo(name: str, world_size: int, reshard: bool = True, seq_len: int | None = None, full: bool = False,
                 vocab_parallel: bool = False):
    """A zoo model's IR as the CLI captures it: deep models extrapolated from 3 and 4 blocks unless `full`
    (tests/test_extrapolate.py holds the two to be identical)."""
    from ce_overlap.analyzer.model_capture import capture_named

    return capture_named(name, world_size=world_size, reshard_after_forward=reshard, seq_len=seq_len, full=full,
                         vocab_parallel_embeddings=vocab_parallel)


@pytest.fixture(scope="session")
def capture_zoo():
    return _capture_zoo


@pytest.fixture(scope="session")
def tiny_ir():
    return _capture_zoo("llama3-tiny", 8)


def run_cli(*args: str, env_extra: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`ce-overlap ARGS` with its exit code, stdout and stderr: in this process (tests/cli_in_process.py) unless given
    an environment variable that is not one of ce_overlap's (those, a model's build() reads as it pleases: a fresh
    process is the one that sees them). `timeout` holds for a process only."""
    from ce_overlap import environment

    env_extra = env_extra or {}
    if all(environment.known(k) for k in env_extra):
        from cli_in_process import run

        return run(list(args), env_extra)
    env = dict(os.environ)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "ce_overlap.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def cli_cache(tmp_path_factory) -> str:
    """The session's capture cache, one for every xdist worker: a cached capture is keyed by its options, torch and
    the capture code (ce_overlap/cli.py), and written atomically, so tests that capture the same model share it."""
    base = tmp_path_factory.getbasetemp()
    return str((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cli-cache")


def _cli_with_cache(cache: str):
    def run(*args: str, **kw):
        return run_cli(*args, env_extra={"CE_OVERLAP_CACHE": cache}, **kw)
    return run


@pytest.fixture
def cli(cli_cache):
    """Runs the CLI with the session's capture cache."""
    return _cli_with_cache(cli_cache)


@pytest.fixture
def cli_private(tmp_path):
    """Runs the CLI with a capture cache of the test's own (for tests of the cache itself)."""
    return _cli_with_cache(str(tmp_path / "cache"))


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
