"""The hierarchical all-gather and reduce-scatter's layout and groups on CPUs (gloo for both halves: the node half is
the copy engines' on a GPU, tests/runtime/hierarchical_check.py --device cuda), ranks on simulated nodes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("hierarchical_check.py")


@pytest.mark.parametrize("ranks,per_node", [(4, 2), (6, 2), (6, 3)])
def test_hierarchical_collectives_equal_the_flat_ones_on_simulated_nodes(ranks, per_node):
    env = {**os.environ, "CE_OVERLAP_RANKS_PER_NODE": str(per_node)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={ranks}", str(CHECK), "--cases", "40"],
                          capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout
    assert proc.returncode == 0, (out + proc.stderr)[-4000:]
    assert f"{ranks} ranks as {ranks // per_node} nodes x {per_node}" in out, out
    assert out.count("PASS") == 3 and "FAIL" not in out, out


def test_a_group_on_one_node_or_with_uneven_nodes_is_refused_by_name():
    from ce_overlap.errors import CeOverlapError
    from ce_overlap.runtime.hierarchical import layout

    assert layout(["a", "a", "b", "b", "c", "c"]) == (3, 2)
    with pytest.raises(CeOverlapError, match="spans nodes; this one is on one node"):
        layout(["a", "a"])
    with pytest.raises(CeOverlapError, match=r"as many ranks on every node; the group has 2 on a, 1 on b"):
        layout(["a", "a", "b"])
    with pytest.raises(CeOverlapError, match=r"consecutive in the group, but a holds group ranks \[0, 2\]"):
        layout(["a", "b", "a", "b"])


def test_the_nodes_of_ranks_come_through_the_store_and_a_rank_that_never_answers_is_named(gloo_world1, monkeypatch):
    """ce_overlap.nodes finds hostnames through the job's store, not a collective: a rank that never publishes its host
    (dead, or in another call) is named after the timeout instead of breaking the group's transport."""
    import socket

    import torch.distributed as dist
    from ce_overlap import nodes

    monkeypatch.delenv("CE_OVERLAP_RANKS_PER_NODE", raising=False)
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 s: ranks \[1\] never published their host"):
        nodes._hosts((0, 1), timeout_s=0.5)
    dist.distributed_c10d._get_default_store().set("ce_overlap/host/1", "another-host")
    assert nodes._hosts((0, 1), timeout_s=0.5) == (socket.gethostname(), "another-host")
    assert nodes.nodes_of(gloo_world1) == [socket.gethostname()] and nodes.count(gloo_world1) == 1
