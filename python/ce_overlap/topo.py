"""`ce-overlap topo`: detect the local GPU topology and print it, or write it as a profile's topology.

P2P comes from CUDA (torch.cuda.can_device_access_peer); link kinds, NVLink counts and NUMA nodes from
`nvidia-smi topo -m`; GB/s from `nvidia-smi nvlink -s` (NVLink) and the PCIe generation and width.
The parsers take text, so they are tested without GPUs.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

from .errors import CeOverlapError

NO_GPUS = "no CUDA GPUs visible; nothing to detect"

# GB/s per NVLink link per direction when `nvidia-smi nvlink -s` cannot say (public specs; 26.56 is
# what nvidia-smi reports for NVLink 4 on H200, MEASURED.md).
_NVLINK_BY_GPU = [
    ("B200", "nvlink5", 50.0), ("B100", "nvlink5", 50.0), ("GB200", "nvlink5", 50.0),
    ("H100", "nvlink4", 26.56), ("H200", "nvlink4", 26.56), ("H800", "nvlink4", 26.56), ("GH200", "nvlink4", 26.56),
    ("A100", "nvlink3", 25.0), ("A800", "nvlink3", 25.0), ("V100", "nvlink2", 25.0),
]
# `nvidia-smi topo -m` path legend -> our link kind for PCIe paths.
_PCIE_KINDS = {"PIX": "pcie-pix", "PXB": "pcie-pxb", "PHB": "pcie-phb", "NODE": "pcie-node", "SYS": "sys"}
# PCIe GT/s per lane and line-code efficiency, by generation.
_PCIE_GEN = {1: (2.5, 0.8), 2: (5.0, 0.8), 3: (8.0, 128 / 130), 4: (16.0, 128 / 130), 5: (32.0, 128 / 130),
             6: (64.0, 242 / 256)}

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class TopoMatrix:
    """What `nvidia-smi topo -m` says about the GPUs: link legend per pair, NUMA node per GPU (None: N/A)."""
    links: list[list[str]]
    numa: list[int | None]


@dataclass
class Detected:
    names: list[str]
    p2p: list[list[bool]]
    links: list[list[str]] | None = None   # nvidia-smi legend ("NV18", "PIX", ...), None without nvidia-smi
    numa: list[int | None] | None = None
    nvlink_gbps: list[float | None] = field(default_factory=list)  # per GPU, per link (nvidia-smi nvlink -s)
    pcie_gbps: list[float | None] = field(default_factory=list)    # per GPU, its PCIe link one way


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse `nvidia-smi topo -m` output (GPU rows only; NIC rows and the legend are skipped)."""
    lines = [_ANSI.sub("", l).rstrip() for l in text.splitlines()]
    # The header names the columns (GPU0 GPU1 ... NIC0 ... CPU Affinity); a row starts with its GPU and "X".
    header = next((l for l in lines if l.split()[:1] == ["GPU0"] and l.split()[1:2] != ["X"] or
                   l[:1].isspace() and "GPU0" in l.split()), None)
    if header is None:
        raise CeOverlapError("nvidia-smi topo -m: no header line with GPU0 found")
    # Device columns are the single-token labels before "CPU Affinity".
    columns = re.split(r"\s+", header.split("CPU Affinity")[0].strip())
    gpu_cols = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    has_numa = "NUMA Affinity" in header
    links, numa = [], []
    for line in lines:
        tokens = line.split()
        if line is header or not tokens or not re.fullmatch(r"GPU\d+", tokens[0]) or len(tokens) < 1 + len(columns):
            continue
        cells = tokens[1:1 + len(columns)]
        links.append([cells[columns.index(g)] for g in gpu_cols])
        rest = tokens[1 + len(columns):]
        value = rest[1] if has_numa and len(rest) >= 2 else "N/A"
        numa.append(int(value) if value.isdigit() else None)
    if len(links) != len(gpu_cols):
        raise CeOverlapError(f"nvidia-smi topo -m: {len(gpu_cols)} GPU columns but {len(links)} GPU rows")
    return TopoMatrix(links=links, numa=numa)


def parse_nvlink_status(text: str) -> dict[int, float]:
    """Per GPU index, the GB/s of one active NVLink link from `nvidia-smi nvlink -s` (absent: no active links)."""
    out: dict[int, float] = {}
    gpu = None
    for line in text.splitlines():
        m = re.match(r"\s*GPU (\d+):", line)
        if m:
            gpu = int(m.group(1))
            continue
        m = re.match(r"\s*Link \d+: ([0-9.]+) GB/s", line)
        if m and gpu is not None:
            out[gpu] = max(out.get(gpu, 0.0), float(m.group(1)))
    return out


def pcie_gbps(gen: int, width: int) -> float:
    """One-way GB/s of a PCIe link of this generation and lane count."""
    if gen not in _PCIE_GEN:
        raise CeOverlapError(f"unknown PCIe generation {gen} (known: {', '.join(map(str, _PCIE_GEN))})")
    gts, code = _PCIE_GEN[gen]
    return round(gts * width * code / 8, 2)


def _nvlink_fallback(name: str) -> tuple[str, float] | None:
    for key, kind, gbps in _NVLINK_BY_GPU:
        if key in name:
            return kind, gbps
    return None


def topology_json(d: Detected) -> dict:
    """The detected machine as a profile's topology object (matrix form, one node)."""
    if d.links is None:
        raise CeOverlapError("cannot write a topology without nvidia-smi: link kinds and GB/s come from "
                             "`nvidia-smi topo -m` (the P2P matrix alone is known)")
    n = len(d.names)
    kinds = [["X"] * n for _ in range(n)]
    gbps = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            kinds[i][j], gbps[i][j] = _link(d, i, j)
    # Links are symmetric; two ends that disagree (different per-link speeds) get the slower figure.
    for i in range(n):
        for j in range(i + 1, n):
            if kinds[i][j] != kinds[j][i]:
                raise CeOverlapError(f"nvidia-smi topo -m: GPU{i}-GPU{j} is {d.links[i][j]} but "
                                     f"GPU{j}-GPU{i} is {d.links[j][i]}")
            gbps[i][j] = gbps[j][i] = min(gbps[i][j], gbps[j][i])
    p2p = [[True if i == j else bool(d.p2p[i][j] and d.p2p[j][i]) for j in range(n)] for i in range(n)]
    numa = [0 if v is None else v for v in (d.numa or [None] * n)]
    return {"gpus_per_node": n, "numa_node": numa,
            "matrix": {"kind": kinds, "gbps_per_direction": gbps, "p2p": p2p}}


def _link(d: Detected, i: int, j: int) -> tuple[str, float]:
    legend = d.links[i][j]
    m = re.fullmatch(r"NV(\d+)", legend)
    if m:
        per_link = d.nvlink_gbps[i] if i < len(d.nvlink_gbps) else None
        fallback = _nvlink_fallback(d.names[i])
        if per_link is None and fallback is None:
            raise CeOverlapError(f"GPU{i} ({d.names[i]}): NVLink speed unknown (no `nvidia-smi nvlink -s` figure, "
                                 f"GPU not in the built-in table)")
        kind = fallback[0] if fallback else "nvlink"
        return kind, round(int(m.group(1)) * (per_link if per_link is not None else fallback[1]), 2)
    if legend in _PCIE_KINDS:
        ends = [d.pcie_gbps[k] if k < len(d.pcie_gbps) else None for k in (i, j)]
        if None in ends:
            raise CeOverlapError(f"GPU{i}-GPU{j}: PCIe link speed unknown (nvidia-smi --query-gpu=pcie.link.gen.max)")
        return _PCIE_KINDS[legend], min(ends)
    raise CeOverlapError(f"nvidia-smi topo -m: unknown link {legend!r} between GPU{i} and GPU{j}")


def format_matrix(d: Detected) -> str:
    n = len(d.names)
    cells = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
                continue
            text = d.links[i][j] if d.links else "?"
            if d.links:
                try:
                    text = f"{d.links[i][j]} {_link(d, i, j)[1]:g} GB/s"
                except CeOverlapError:
                    pass
            row.append(text + (" p2p" if d.p2p[i][j] else " no-p2p"))
        cells.append(row)
    head = ["GPU", "name", "NUMA"] + [f"GPU{j}" for j in range(n)]
    rows = [[str(i), d.names[i], "?" if not d.numa or d.numa[i] is None else str(d.numa[i])] + cells[i]
            for i in range(n)]
    widths = [max(len(r[c]) for r in [head] + rows) for c in range(len(head))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + rows]
    if d.links is None:
        out.append("(nvidia-smi not found: P2P from CUDA only; link kinds and GB/s unknown)")
    return "\n".join(out)


def _run(args: list[str]) -> str | None:
    if shutil.which(args[0]) is None:
        return None
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def detect() -> Detected | None:
    """The local topology, or None when no CUDA GPU is visible."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    n = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    p2p = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)] for i in range(n)]
    d = Detected(names=names, p2p=p2p)
    text = _run(["nvidia-smi", "topo", "-m"])
    if text is not None:
        m = parse_topo_matrix(text)
        if len(m.links) == n:  # CUDA_VISIBLE_DEVICES subsets would need remapping; then keep P2P only
            d.links, d.numa = m.links, m.numa
    status = parse_nvlink_status(_run(["nvidia-smi", "nvlink", "-s"]) or "")
    d.nvlink_gbps = [status.get(i) for i in range(n)]
    query = _run(["nvidia-smi", "--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                  "--format=csv,noheader,nounits"]) or ""
    pcie: dict[int, float] = {}
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            pcie[int(parts[0])] = pcie_gbps(int(parts[1]), int(parts[2]))
    d.pcie_gbps = [pcie.get(i) for i in range(n)]
    return d


def main(json_output: bool = False) -> int:
    d = detect()
    if d is None:
        print(NO_GPUS, file=sys.stderr if json_output else sys.stdout)
        return 0
    if not json_output:
        print(format_matrix(d))
        return 0
    from . import _core

    text = _core.check_topology(json.dumps(topology_json(d)))  # the profile loader's own checks
    print(json.dumps({"topology": json.loads(text)}, indent=1))
    return 0
