"""GPU tests of the torch.distributed backend "ce_overlap": tests/runtime/backend_worker.py at 2, 3 and 4 ranks (on a
box with fewer GPUs the ranks share GPU 0; the references then run over gloo on host copies). Skipped with the
reason without a GPU or the runtime; CE_OVERLAP_REQUIRE_GPU_TESTS=1 (bench/run_device.sh) turns a skip into a
failure."""
from __future__ import annotations

import os

import pytest
import torch

import test_runtime_gpu as base
from test_runtime_gpu import SHARED_GPU, torchrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend_worker.py")

# The same gate as the runtime's GPU tests: skipped with the reason, or failed when the device run requires them.
if hasattr(base, "_required"):
    _required = base._required
else:
    pytestmark = base.pytestmark


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_backend_collectives_p2p_and_pipelining(nproc):
    """1000 randomized collectives through dist.* bit-exact against the reference group (integer-valued reductions),
    every one on copy engines; delegated ops return the inner backend's results; randomized send / recv programs
    (1000 at 2 ranks, 300 at 3 and 4) deliver exact bytes with sends posted before their receives; at 2 and 4 ranks
    torch.distributed.pipelining (GPipe, 1F1B, interleaved 1F1B, interleaved zero bubble; 4 and 8 microbatches)
    bit-identical to a host-staged gloo transport, over the backend and (own GPUs) over NCCL; then a receive that is never posted fails its peer's work within the 4 s timeout."""
    if not SHARED_GPU and torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs or one GPU to share, this machine has {torch.cuda.device_count()}")
    modes = "collectives,delegated,p2p" + (",pipeline" if nproc in (2, 4) else "") + ",timeout"
    proc = torchrun(modes, "--cases", "1000", "--p2p-cases", "1000" if nproc == 2 else "300",
                    env={"CE_OVERLAP_TIMEOUT_S": "20"}, timeout_s=420, nproc=nproc, worker=WORKER)
    assert proc.returncode == 0, f"{nproc}-rank backend checks failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"
