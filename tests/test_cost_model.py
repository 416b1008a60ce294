"""The cost model from Python: _core.estimate_collective / decide, every built-in profile on a real
capture, and `ce-overlap topo` (on a machine without GPUs, plus its parsers on canned nvidia-smi text)."""
from __future__ import annotations

import json

import pytest

import ce_overlap
from ce_overlap import CeOverlapError, _core, profiles, topo

MIB = 1 << 20
BUILTINS = ["a100-sxm", "b200", "h100-pcie", "h100-sxm", "h200-sxm"]


@pytest.fixture(scope="module")
def h200():
    return profiles.load("h200-sxm")


def test_builtin_profile_names():
    assert profiles.names() == BUILTINS
    assert _core.PROFILE_SCHEMA == "ce_overlap.profile/2"


def test_unknown_profile_lists_the_known_ones():
    with pytest.raises(CeOverlapError, match="unknown profile 'h300-sxm'") as e:
        profiles.read_text("h300-sxm")
    assert all(name in str(e.value) for name in BUILTINS)


def test_estimate_collective_matches_measured_busbw(h200):
    # MEASURED.md, 2 x H200, 256 MiB per rank: NCCL all-gather 257 GB/s, in-place CE all-gather 371 GB/s.
    shard = 256 * MIB
    nccl_us = _core.estimate_collective(h200, "all_gather", shard, 2, "nccl")
    ce_us = _core.estimate_collective(h200, "all_gather", shard, 2, "ce")
    assert shard / nccl_us / 1e3 == pytest.approx(257, rel=0.15)
    assert shard / ce_us / 1e3 == pytest.approx(371, rel=0.15)
    assert _core.estimate_collective(h200, "all_gather", shard, 2) == nccl_us  # nccl by default
    # Monotone in bytes and group size.
    times = [_core.estimate_collective(h200, "reduce_scatter", b, 8, "ce") for b in (MIB, 4 * MIB, 64 * MIB)]
    assert times == sorted(times)
    times = [_core.estimate_collective(h200, "all_gather", MIB, n, "nccl") for n in (2, 4, 8, 16, 64)]
    assert times == sorted(times)


def test_estimate_collective_rejects_bad_arguments(h200):
    with pytest.raises(CeOverlapError, match="group spans 2 nodes; CE needs one NVLink domain"):
        _core.estimate_collective(h200, "all_gather", MIB, 16, "ce")
    with pytest.raises(CeOverlapError, match=r"^type: .*all_gather"):  # lists the accepted names
        _core.estimate_collective(h200, "allgather", MIB, 2, "nccl")
    with pytest.raises(CeOverlapError, match=r"backend: unknown backend \"nvshmem\" \(accepted: nccl, ce, hier\)"):
        _core.estimate_collective(h200, "all_gather", MIB, 2, "nvshmem")
    with pytest.raises(CeOverlapError, match="bytes: expected an integer in 0..2"):
        _core.estimate_collective(h200, "all_gather", -1, 2, "nccl")
    with pytest.raises(CeOverlapError, match="group_size: expected an integer in 1..65536, got 0"):
        _core.estimate_collective(h200, "all_gather", MIB, 0, "nccl")
    with pytest.raises(CeOverlapError, match="window_memory_bound_us"):
        _core.decide(h200, "all_gather", MIB, 2, 0.0, -5.0)


def test_decide(h200):
    d = _core.decide(h200, "all_gather", 64 * 1024, 2)
    assert {"choice", "nccl_us", "ce_us", "reason", "nccl", "ce"} <= set(d)
    assert d["choice"] == "nccl"
    assert d["reason"] == "nccl: 64 KiB is latency-bound; CE per-copy latency loses"
    assert d["nccl_us"] < d["ce_us"]

    d = _core.decide(h200, "all_gather", 64 * MIB, 8, window_compute_bound_us=1900.0)
    assert d["choice"] == "ce"
    assert d["reason"].startswith("ce: saves ") and "of GEMMs by" in d["reason"]
    assert d["ce_us"] < d["nccl_us"]
    assert d["nccl"]["compute_bound_slowdown"] > 0.15 > d["ce"]["compute_bound_slowdown"]
    assert d["nccl_us"] == pytest.approx(d["nccl"]["exposed_us"] + d["nccl"]["slowdown_us"])

    d = _core.decide(h200, "reduce_scatter", 64 * MIB, 16, 1900.0, 500.0)
    assert d["choice"] == "nccl" and d["ce_us"] is None and d["ce"] is None
    assert d["reason"].startswith("nccl: group spans 2 nodes; CE needs one NVLink domain; flat NCCL saves ")
    assert d["hier_us"] > d["nccl_us"] and d["hier"]["comm_us"] > 0

    pcie = profiles.load("h100-pcie")
    d = _core.decide(pcie, "all_gather", 64 * MIB, 8, 1900.0, 0.0)
    assert d["reason"] == "nccl: no P2P between ranks 0 and 4 (sys link, NUMA nodes 0 and 1)"


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_profile_analyzes_the_tiny_model(tiny_ir, name):
    report = ce_overlap.analyze(tiny_ir, name)
    assert report["schema"] == "ce_overlap.analysis/1"
    assert report["profile"] == name
    totals = report["totals"]
    assert totals["compute_us"] > 0 and totals["comm_us"] > 0
    assert 0 <= totals["exposed_comm_us"] <= totals["comm_us"] + 1e-6


def test_profile_file_with_a_detected_topology(tiny_ir, tmp_path):
    # A profile whose topology is what `ce-overlap topo --json` writes (matrix form, one node of 8).
    prof = json.loads(profiles.read_text("h200-sxm"))
    links = [["X" if i == j else "NV18" for j in range(8)] for i in range(8)]
    detected = topo.Detected(names=["NVIDIA H200"] * 8, p2p=[[True] * 8 for _ in range(8)], links=links,
                             numa=[0, 0, 0, 0, 1, 1, 1, 1], nvlink_gbps=[26.562] * 8, pcie_gbps=[63.02] * 8)
    prof["topology"] = json.loads(_core.check_topology(json.dumps(topo.topology_json(detected))))
    path = tmp_path / "local.json"
    path.write_text(json.dumps(prof))
    report = ce_overlap.analyze(tiny_ir, str(path))
    assert report["profile"] == "h200-sxm"
    # tiny_ir was captured for 8 ranks: one node, so the matrix alone is enough.
    assert report["totals"]["comm_us"] > 0


def test_previous_profile_schema_is_rejected_with_a_pointer():
    prof = json.loads(profiles.read_text("h200-sxm"))
    prof["schema"] = "ce_overlap.profile/1"
    with pytest.raises(CeOverlapError, match=r"schema: expected \"ce_overlap.profile/2\".*docs/profiles.md"):
        _core.Profile.from_json(json.dumps(prof))


def test_topo_without_gpus_exits_0(cli):
    proc = cli("topo")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == topo.NO_GPUS == "no CUDA GPUs visible; nothing to detect"
    proc = cli("topo", "--json")  # stdout stays clean for a JSON consumer
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and topo.NO_GPUS in proc.stderr


# Canned `nvidia-smi topo -m` outputs: the 2 x H200 box of MEASURED.md (verbatim from the device), the
# same with NIC columns, and a 4-GPU PCIe box on two sockets.
H200_TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-31\t0\t\tN/A\n"
    "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n\n"
    "Legend:\n\n  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
NIC_TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tPXB\tSYS\t0-47,96-143\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tSYS\tPXB\t48-95,144-191\t1\t\tN/A\n"
    "NIC0\tPXB\tSYS\t X \tSYS\t\t\t\t\n"
    "NIC1\tSYS\tPXB\tSYS\t X \t\t\t\t\n\n"
    "Legend:\n\n  X    = Self\n\nNIC Legend:\n\n  NIC0: mlx5_0\n"
)
PCIE_TOPO = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tPIX\tSYS\tSYS\t0-31\t0\t\tN/A\n"
    "GPU1\tPIX\t X \tSYS\tSYS\t0-31\t0\t\tN/A\n"
    "GPU2\tSYS\tSYS\t X \tPIX\t32-63\t1\t\tN/A\n"
    "GPU3\tSYS\tSYS\tPIX\t X \t32-63\t1\t\tN/A\n"
)
NVLINK_STATUS = "GPU 0: NVIDIA H200 (UUID: GPU-1)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n" \
                "GPU 1: NVIDIA H200 (UUID: GPU-2)\n\t Link 0: 26.562 GB/s\n"


def test_topo_parses_nvidia_smi():
    m = topo.parse_topo_matrix(H200_TOPO)
    assert m.links == [["X", "NV18"], ["NV18", "X"]]
    assert m.numa == [0, 0]
    nic = topo.parse_topo_matrix(NIC_TOPO)
    assert nic.links == m.links and nic.numa == [0, 1]
    assert topo.parse_nvlink_status(NVLINK_STATUS) == {0: 26.562, 1: 26.562}
    assert topo.pcie_gbps(5, 16) == pytest.approx(63.02, abs=0.01)

    d = topo.Detected(names=["NVIDIA H200"] * 2, p2p=[[True, True], [True, True]], links=m.links, numa=m.numa,
                      nvlink_gbps=[26.562, 26.562], pcie_gbps=[63.02, 63.02])
    t = json.loads(_core.check_topology(json.dumps(topo.topology_json(d))))
    assert t["matrix"]["kind"][0][1] == "nvlink4"
    assert t["matrix"]["gbps_per_direction"][0][1] == pytest.approx(478.1, abs=0.1)
    assert "NV18" in topo.format_matrix(d) and "p2p" in topo.format_matrix(d)

    m = topo.parse_topo_matrix(PCIE_TOPO)
    assert m.numa == [0, 0, 1, 1]
    p2p = [[i == j or (i < 2) == (j < 2) for j in range(4)] for i in range(4)]
    d = topo.Detected(names=["NVIDIA H100 PCIe"] * 4, p2p=p2p, links=m.links, numa=m.numa,
                      nvlink_gbps=[None] * 4, pcie_gbps=[63.02, 63.02, 31.5, 63.02])
    t = json.loads(_core.check_topology(json.dumps(topo.topology_json(d))))
    assert t["matrix"]["kind"][0][1] == "pcie-pix" and t["matrix"]["kind"][0][2] == "sys"
    assert t["matrix"]["p2p"][0][2] is False and t["matrix"]["p2p"][2][3] is True
    assert t["matrix"]["gbps_per_direction"][2][3] == pytest.approx(31.5)  # the slower end of the pair
    # Without nvidia-smi only P2P is known: printing works, --json refuses with one line.
    bare = topo.Detected(names=["GPU"] * 4, p2p=p2p)
    assert "nvidia-smi not found" in topo.format_matrix(bare)
    with pytest.raises(CeOverlapError, match="without nvidia-smi"):
        topo.topology_json(bare)


def test_check_topology_names_the_bad_field():
    bad = {"gpus_per_node": 2, "numa_node": [0, 0],
           "matrix": {"kind": [["X", "nvlink4"], ["nvlink4", "X"]], "gbps_per_direction": [[0, 478], [450, 0]],
                      "p2p": [[True, True], [True, True]]}}
    with pytest.raises(CeOverlapError, match=r"topology.matrix.gbps_per_direction\[1\]\[0\]: 450(\.0)? differs"):
        _core.check_topology(json.dumps(bad))


def test_a_collective_beside_compute_holds_its_sms_a_fixed_time_per_collective():
    """contention.nccl_beside_compute.residency_us: a collective with compute beside it runs that much longer (no
    longer than the window), the kernels beside it pay the SM term for it too, with nothing beside it nothing
    changes; the profile's JSON keeps it."""
    spec = json.loads(profiles.read_text("h200-sxm"))
    spec["contention"]["nccl_beside_compute"]["residency_us"] = 0.0
    without = _core.Profile.from_json(json.dumps(spec))
    spec["contention"]["nccl_beside_compute"]["residency_us"] = 80.0
    with_it = _core.Profile.from_json(json.dumps(spec))
    assert json.loads(with_it.to_json())["contention"]["nccl_beside_compute"]["residency_us"] == 80.0
    assert "residency_us" not in json.loads(without.to_json())["contention"]["nccl_beside_compute"]

    def nccl(profile, **window):
        return _core.decide(profile, "all_gather", 1 * MIB, 2, **window)["nccl"]

    small, big = nccl(without, window_compute_bound_us=1000.0), nccl(with_it, window_compute_bound_us=1000.0)
    assert big["comm_us"] == pytest.approx(small["comm_us"] + 80.0)
    assert big["slowdown_us"] > small["slowdown_us"] + 80.0 * 0.1  # at least the SM term's share of 80 us
    short = nccl(with_it, window_compute_bound_us=30.0)  # a window shorter than the term: the window bounds it
    assert short["comm_us"] == pytest.approx(nccl(without, window_compute_bound_us=30.0)["comm_us"] + 30.0)
    assert nccl(with_it)["comm_us"] == pytest.approx(nccl(without)["comm_us"])  # nothing beside: unchanged
    spec["contention"]["nccl_beside_compute"]["residency_us"] = -1.0
    with pytest.raises(CeOverlapError, match="residency_us"):
        _core.Profile.from_json(json.dumps(spec))
