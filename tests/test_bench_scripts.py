"""The GPU benchmarks in bench/ run only on the device, so CPU CI at least imports each one and parses its arguments
(an import error or a broken option list would otherwise surface first on the lent machine, costing device time); the
pieces that need no GPU are checked for real: the size sweep and the step model's arithmetic."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "bench")
sys.path.insert(0, BENCH)


@pytest.mark.parametrize("script", ["collectives.py", "p2p.py", "overlap.py", "ce_probe.py", "train.py",
                                    "step_prediction.py", "cost_model_validation.py"])
def test_bench_script_imports_and_parses_help(script):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script), "--help"], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage" in proc.stdout.lower()


def test_size_sweep_is_nccl_tests_style():
    import _common as C

    assert C.size_sweep("64K", "1M", 4) == [65536, 262144, 1048576]
    assert C.size_sweep("1G", "1G", 4) == [1 << 30]
    from ce_overlap.errors import CeOverlapError

    with pytest.raises(CeOverlapError, match="bad size"):
        C.size_sweep("lots", "1G", 4)


def test_step_model_pieces_add_up():
    import train

    pieces = {"optimizer_us": 1000.0,
              "analyze": {"forward": {"compute_us": 3000.0, "exposed_comm_us": 900.0},
                          "backward": {"compute_us": 6000.0, "exposed_comm_us": 700.0}},
              "plan": {"forward": {"exposed_comm_us_after": 100.0, "slowdown_us": 50.0, "bucket_copy_us": 20.0},
                       "backward": {"exposed_comm_us_after": 200.0, "slowdown_us": 70.0, "bucket_copy_us": 30.0}}}
    assert train.predicted_step_ms(pieces) == pytest.approx((1000 + 3000 + 170 + 6000 + 300) / 1e3)
    assert train.predicted_step_ms(pieces, no_comm=True) == pytest.approx((1000 + 3000 + 6000) / 1e3)
    assert train.predicted_step_ms({}) is None
    # AdamW over fp32 master shards moves 28 bytes per local parameter.
    assert train.ADAMW_BYTES_PER_PARAM == 7 * 4
