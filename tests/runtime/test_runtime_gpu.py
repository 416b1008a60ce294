"""GPU tests of the CE runtime: each launches tests/runtime/gpu_worker.py on 2 GPUs with torchrun and checks its
exit code (the worker prints what it checked). Skipped with the reason when fewer than 2 GPUs or no runtime."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import ce_overlap.runtime as rt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")


def _skip_reason() -> str | None:
    ok, reason = rt.available()
    if not ok:
        return f"CE runtime not available: {reason}"
    if torch.cuda.device_count() < 2:
        return f"needs 2 GPUs, this machine has {torch.cuda.device_count()}"
    return None


_SKIP = _skip_reason()
if _SKIP and os.environ.get("CE_OVERLAP_REQUIRE_GPU_TESTS") == "1":
    # bench/run_device.sh sets this: on the GPU box a skip would hide a broken build.
    @pytest.fixture(autouse=True)
    def _required():
        pytest.fail(f"CE_OVERLAP_REQUIRE_GPU_TESTS=1 but the GPU tests cannot run: {_SKIP}")
else:
    pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def torchrun(mode: str, *args: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1",
                     "CE_OVERLAP_POOL_MB": "128", "CE_OVERLAP_STAGING_MB": "1"})
    full_env.update(env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER, mode, *args]
    try:
        proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"{mode} did not finish within {timeout_s} s (a hang):\n{out[-6000:]}\n{err[-6000:]}")
    print(proc.stdout[-20000:])
    print(proc.stderr[-20000:], file=sys.stderr)
    return proc


def test_all_gather_bit_exact_vs_nccl_1000_cases():
    # Staging of 1 MiB makes the larger cases multi-round; a 20 s timeout turns a protocol hang into an error.
    proc = torchrun("correctness", "--cases", "1000", env={"CE_OVERLAP_TIMEOUT_S": "20"}, timeout_s=420)
    assert proc.returncode == 0, f"correctness failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def test_peer_that_never_arrives_raises_within_timeout():
    proc = torchrun("timeout", env={"CE_OVERLAP_TIMEOUT_S": "5"}, timeout_s=150)
    assert proc.returncode == 0, f"timeout check failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def test_mismatched_sizes_are_reported():
    proc = torchrun("mismatch", env={"CE_OVERLAP_TIMEOUT_S": "5"}, timeout_s=150)
    assert proc.returncode == 0, f"mismatch check failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"


def test_no_sm_kernels_in_ce_all_gather():
    proc = torchrun("nokernels", env={"CE_OVERLAP_TIMEOUT_S": "20", "CE_OVERLAP_STAGING_MB": "64"}, timeout_s=180)
    assert proc.returncode == 0, f"kernel check failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
