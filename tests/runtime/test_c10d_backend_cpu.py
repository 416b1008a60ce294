"""The torch.distributed backend "ce_overlap" without a GPU: registered whichever of torch and ce_overlap is imported
first (and `import ce_overlap` stays torch-free), options validated, and a group asking for it on a machine without
CUDA fails at creation with a message naming the problem (the GPU side: backend_worker.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ce_overlap.distributed import BackendOptions
from ce_overlap.errors import CeOverlapError
from ce_overlap.runtime.config import RuntimeConfig


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("order", ["ce_overlap first", "torch first"])
def test_registered_whatever_is_imported_first(order):
    imports = "import ce_overlap, sys; t0 = 'torch' in sys.modules; import torch" if order == "ce_overlap first" \
        else "import torch, sys; t0 = False; import ce_overlap"
    proc = _python(f"{imports}; import torch.distributed as dist; "
                   "print(t0, 'CE_OVERLAP' in dist.Backend._plugins, dist.Backend.backend_capability['ce_overlap'])")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "True", "['cuda']"], proc.stdout + proc.stderr


def test_options_are_validated():
    assert BackendOptions().inner == "auto" and BackendOptions().runtime is None
    BackendOptions(runtime=RuntimeConfig(pool_mb=128), inner="gloo")
    with pytest.raises(CeOverlapError, match="BackendOptions.inner"):
        BackendOptions(inner="mpi")
    with pytest.raises(CeOverlapError, match="BackendOptions.runtime"):
        BackendOptions(runtime={"pool_mb": 64})


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_group_without_cuda_fails_at_creation_naming_the_problem():
    code = """
import os, datetime, torch, torch.distributed as dist, ce_overlap
store = dist.HashStore()
try:
    dist.init_process_group("cpu:gloo,cuda:ce_overlap", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
except Exception as e:
    print("ERROR", type(e).__name__, e)
else:
    print("created")
"""
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" in proc.stdout and "no CUDA device" in proc.stdout, proc.stdout + proc.stderr
