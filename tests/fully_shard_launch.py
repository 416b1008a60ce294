"""Launching tests/fully_shard/worker.py on real gloo groups (one process per rank, torchrun) and comparing what its
runs recorded: shared by tests/test_fully_shard.py (1-D meshes) and tests/test_fully_shard_2d.py (2x2 meshes)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fully_shard", "worker.py")


def torchrun(n: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    env = {**os.environ, "CE_TEST_DEVICE": "cpu", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                           WORKER, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return proc.stdout


def compare(a, b, rtol: float = 0.0) -> str:
    """The worker's `compare` of two records, in this process (torch is loaded here already)."""
    import contextlib
    import io

    from conftest import load_module

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = load_module(WORKER).run_compare(str(a), str(b), rtol=rtol)
    assert code == 0, out.getvalue()
    return out.getvalue()


def phases(n: int, *phases: str, env: dict | None = None) -> str:
    """Train runs one after the other in one launch of `n` ranks (the worker's `phases`: a fresh model each, as
    separate launches would train it); each phase a string of `worker.py train` options."""
    return torchrun(n, "phases", *phases, env=env)
