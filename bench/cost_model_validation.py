"""Cost model vs measurement, 2 GPUs, one run: all-gather and reduce-scatter over NCCL and over copy engines (CE) at
1, 4, 16, 64, 256 MiB per rank (plus 0.25, 0.5, 2 MiB for the crossover), and the slowdown of a bf16 8192^3 GEMM
and of a memory-bound add beside each at 256 MiB per rank; then the cost model's predictions of the same quantities
from a profile (default: the built-in profile of the detected GPU, uncalibrated), through ce_overlap._core.

    torchrun --standalone --nproc-per-node 2 bench/cost_model_validation.py --out $OUT/validation
    ... --also-profile $OUT/calibrated.json     # score more profiles against the same measurements

Prints a table (size, op, backend, predicted us, measured us, error %), the median absolute error per op/backend,
the predicted and measured NCCL/CE crossover size, the slowdowns predicted vs measured (percentage points), and
PASS/FAIL for the targets: median |error| <= 15% per op/backend, crossover within a factor of 2, each slowdown within
5 points. Writes validation.json (device, versions, command, every number) and validation.png (predicted vs
measured; matplotlib when importable, else a small built-in PNG writer) into --out (default $OUT, else
bench/results).

Sizes are per rank: all-gather shard = size (IR bytes = size); reduce-scatter output = size (input and IR bytes =
world x size). The CE all-gather is ce_overlap's in-place one on symmetric memory (what the model describes); the CE
reduce-scatter is torch.ops.ce_overlap.reduce_scatter_tensor when the runtime has it, else n/a. Time = median of
--iters ops (CUDA events, after a GPU head start so that host enqueue time is not counted), max over ranks.
The pure functions (error stats, crossover, PNG) need no GPU and are tested in tests/test_calibrate.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import zlib

MIB = 1 << 20
OPS = ("all_gather", "reduce_scatter")
BACKENDS = ("nccl", "ce")
COMPUTES = ("gemm", "memory_bound")
TARGET_ERROR_PCT = 15.0
TARGET_CROSSOVER_FACTOR = 2.0
TARGET_SLOWDOWN_POINTS = 5.0


# ------------------------------------------------------------------------------------------------------------------
# Pure functions (no torch, no GPU)

def error_pct(predicted: float, measured: float) -> float:
    """Signed relative error of the prediction, percent of the measurement."""
    if measured <= 0:
        raise ValueError(f"measured time must be > 0, got {measured}")
    return (predicted - measured) / measured * 100.0


def median_abs_errors(rows: list[dict]) -> dict[str, float]:
    """Median |error %| per 'op/backend' over rows with both times (and `main` not False)."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r.get("main", True) is False or r.get("measured_us") is None or r.get("predicted_us") is None:
            continue
        groups.setdefault(f"{r['op']}/{r['backend']}", []).append(abs(error_pct(r["predicted_us"], r["measured_us"])))
    return {k: statistics.median(v) for k, v in sorted(groups.items())}


def crossover(sizes: list[float], nccl_us: list[float], ce_us: list[float]) -> dict:
    """The size at which CE becomes faster than NCCL, scanning up: {"bytes": x} (log-log interpolated between the
    two samples around the first sign change), {"below": smallest} when CE is already faster at the smallest size,
    {"above": largest} when it never is. Ties count as NCCL (the cost model keeps ties on NCCL)."""
    pts = sorted(zip(sizes, nccl_us, ce_us))
    if not pts:
        raise ValueError("no sizes")
    r = [math.log(n / c) for _, n, c in pts]  # > 0: CE faster
    if r[0] > 0:
        return {"below": pts[0][0]}
    for i in range(1, len(pts)):
        if r[i] > 0:
            x0, x1 = math.log(pts[i - 1][0]), math.log(pts[i][0])
            f = (0 - r[i - 1]) / (r[i] - r[i - 1])
            return {"bytes": math.exp(x0 + f * (x1 - x0))}
    return {"above": pts[-1][0]}


def format_crossover(c: dict) -> str:
    if "bytes" in c:
        return f"{c['bytes'] / MIB:.3g} MiB"
    if "below" in c:
        return f"< {c['below'] / MIB:.3g} MiB"
    return f"> {c['above'] / MIB:.3g} MiB"


def crossover_ok(predicted: dict, measured: dict, factor: float = TARGET_CROSSOVER_FACTOR) -> tuple[bool, str]:
    """Whether two crossovers agree within `factor`; a bound (below/above the sampled range) agrees with a value on
    its side of the bound, or within `factor` of it."""
    def lo_hi(c):  # the interval the crossover lies in
        if "bytes" in c:
            return c["bytes"], c["bytes"]
        if "below" in c:
            return 0.0, c["below"]
        return c["above"], math.inf

    (plo, phi), (mlo, mhi) = lo_hi(predicted), lo_hi(measured)
    # Distance between the intervals as a ratio (1 when they touch or overlap).
    if phi < mlo:
        ratio = mlo / phi if phi > 0 else math.inf
    elif mhi < plo:
        ratio = plo / mhi if mhi > 0 else math.inf
    else:
        ratio = 1.0
    ok = ratio <= factor
    return ok, (f"predicted {format_crossover(predicted)}, measured {format_crossover(measured)}: "
                + ("agree" if ratio == 1.0 else f"{ratio:.2f}x apart"))


def dense_sizes(lo: float, hi: float, per_octave: int = 8) -> list[float]:
    out, s = [], float(lo)
    while s <= hi * (1 + 1e-9):
        out.append(s)
        s *= 2 ** (1 / per_octave)
    return out


def checks(stats: dict[str, float], crossovers: dict[str, dict], slowdowns: list[dict],
           expected: list[str] | None = None, expected_ops: list[str] | None = None) -> list[dict]:
    """PASS/FAIL rows for the targets. crossovers: op -> {"predicted", "measured"}; slowdowns: rows with
    predicted_pct / measured_pct (None when not available). `expected` op/backend keys and `expected_ops` (crossover)
    without numbers get a row with pass None (n/a: not measured), so a missing target is visible."""
    out = []
    for key in sorted(set(stats) | set(expected or [])):
        if key not in stats:
            out.append({"check": f"median |error| {key}", "value": "not measured", "target": f"<= {TARGET_ERROR_PCT:g}%",
                        "pass": None})
            continue
        err = stats[key]
        out.append({"check": f"median |error| {key}", "value": f"{err:.1f}%", "target": f"<= {TARGET_ERROR_PCT:g}%",
                    "pass": err <= TARGET_ERROR_PCT})
    for op in sorted(set(crossovers) | set(expected_ops or [])):
        if op not in crossovers:
            out.append({"check": f"NCCL/CE crossover {op}", "value": "not measured",
                        "target": f"within {TARGET_CROSSOVER_FACTOR:g}x", "pass": None})
            continue
        c = crossovers[op]
        ok, text = crossover_ok(c["predicted"], c["measured"])
        out.append({"check": f"NCCL/CE crossover {op}", "value": text, "target": f"within {TARGET_CROSSOVER_FACTOR:g}x",
                    "pass": ok})
    for s in slowdowns:
        if s.get("predicted_pct") is None or s.get("measured_pct") is None:
            out.append({"check": f"{s['compute']} slowdown beside {s['op']}/{s['backend']}", "value": "not measured",
                        "target": f"within {TARGET_SLOWDOWN_POINTS:g} points", "pass": None})
            continue
        d = s["predicted_pct"] - s["measured_pct"]
        out.append({"check": f"{s['compute']} slowdown beside {s['op']}/{s['backend']}",
                    "value": f"predicted {s['predicted_pct']:+.1f}%, measured {s['measured_pct']:+.1f}% ({d:+.1f} points)",
                    "target": f"within {TARGET_SLOWDOWN_POINTS:g} points", "pass": abs(d) <= TARGET_SLOWDOWN_POINTS})
    return out


def predict(profile, world: int, sizes: list[int], slowdown_rows: list[dict]) -> dict:
    """The cost model's numbers for one profile (_core.Profile): times per (op, backend, size), the dense curves
    and crossovers, and the slowdowns."""
    from ce_overlap import _core
    from ce_overlap.calibrate import predicted_slowdown

    def ir_bytes(op, size):
        return int(world * size if op == "reduce_scatter" else size)

    times = {}
    for op in OPS:
        for backend in BACKENDS:
            for s in sizes:
                try:
                    times[(op, backend, s)] = _core.estimate_collective(profile, op, ir_bytes(op, s), world, backend)
                except Exception:  # noqa: BLE001 (CE not possible for this group in this profile)
                    times[(op, backend, s)] = None
    dense = dense_sizes(min(sizes) / 16, max(sizes) * 4)
    curves = {}
    for op in OPS:
        for backend in BACKENDS:
            try:
                curves[(op, backend)] = [_core.estimate_collective(profile, op, ir_bytes(op, s), world, backend)
                                         for s in dense]
            except Exception:  # noqa: BLE001
                curves[(op, backend)] = None
    slow = []
    for r in slowdown_rows:
        pred = predicted_slowdown(profile, r["op"], ir_bytes(r["op"], r["bytes_per_rank"]), world, r["backend"],
                                  r["compute"])
        slow.append({**r, "predicted_pct": None if pred is None else pred * 100})
    return {"times": times, "dense": dense, "curves": curves, "slowdowns": slow}


def score(profile_name: str, pred: dict, measured: dict, sizes: list[int], main_sizes: list[int]) -> dict:
    """Rows, stats, crossovers, slowdowns and checks of one profile against the measurements.
    measured: {(op, backend, size): us or None}."""
    rows = []
    for op in OPS:
        for backend in BACKENDS:
            for s in sizes:
                m, p = measured.get((op, backend, s)), pred["times"].get((op, backend, s))
                rows.append({"bytes_per_rank": s, "op": op, "backend": backend, "predicted_us": p, "measured_us": m,
                             "error_pct": error_pct(p, m) if p is not None and m is not None else None,
                             "main": s in main_sizes})
    stats = median_abs_errors(rows)
    cross = {}
    for op in OPS:
        ms = [s for s in sizes if measured.get((op, "nccl", s)) and measured.get((op, "ce", s))]
        if len(ms) < 2 or pred["curves"].get((op, "ce")) is None:
            continue
        cross[op] = {"measured": crossover(ms, [measured[(op, "nccl", s)] for s in ms],
                                           [measured[(op, "ce", s)] for s in ms]),
                     "predicted": crossover(pred["dense"], pred["curves"][(op, "nccl")], pred["curves"][(op, "ce")])}
    return {"profile": profile_name, "rows": rows, "median_abs_error_pct": stats, "crossovers": cross,
            "slowdowns": pred["slowdowns"],
            "checks": checks(stats, cross, pred["slowdowns"], [f"{o}/{b}" for o in OPS for b in BACKENDS], list(OPS))}


def format_report(sc: dict) -> str:
    lines = [f"## profile {sc['profile']}",
             f"{'size/rank':>10} {'op':<15} {'backend':<8} {'predicted us':>13} {'measured us':>12} {'error %':>8}"]
    for r in sc["rows"]:
        p = f"{r['predicted_us']:13.1f}" if r["predicted_us"] is not None else f"{'n/a':>13}"
        m = f"{r['measured_us']:12.1f}" if r["measured_us"] is not None else f"{'n/a':>12}"
        e = f"{r['error_pct']:+8.1f}" if r["error_pct"] is not None else f"{'':>8}"
        lines.append(f"{r['bytes_per_rank'] / MIB:>6.3g} MiB {r['op']:<15} {r['backend']:<8} {p} {m} {e}"
                     + ("" if r["main"] else "  (crossover only)"))
    lines.append("median |error| per op/backend (main sizes): "
                 + (", ".join(f"{k} {v:.1f}%" for k, v in sc["median_abs_error_pct"].items()) or "n/a"))
    for op, c in sc["crossovers"].items():
        lines.append(f"NCCL/CE crossover {op}: predicted {format_crossover(c['predicted'])}, "
                     f"measured {format_crossover(c['measured'])}")
    lines.append(f"{'slowdown':<14} {'beside':<22} {'predicted %':>11} {'measured %':>11} {'points':>7}")
    for s in sc["slowdowns"]:
        p, m = s.get("predicted_pct"), s.get("measured_pct")
        d = f"{p - m:+7.1f}" if p is not None and m is not None else f"{'':>7}"
        lines.append(f"{s['compute']:<14} {s['op'] + '/' + s['backend']:<22} "
                     + (f"{p:+11.1f}" if p is not None else f"{'n/a':>11}") + " "
                     + (f"{m:+11.1f}" if m is not None else f"{'n/a':>11}") + f" {d}")
    for c in sc["checks"]:
        verdict = "N/A " if c["pass"] is None else "PASS" if c["pass"] else "FAIL"
        lines.append(f"{verdict}  {c['check']}: {c['value']} (target {c['target']})")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------------
# PNG output: matplotlib when importable, else a tiny raster writer (lines, markers, a 3x5 pixel font).

_FONT = {  # 3 columns x 5 rows, top to bottom, '#' = ink
    "0": "### #.# #.# #.# ###", "1": ".#. ##. .#. .#. ###", "2": "### ..# ### #.. ###", "3": "### ..# .## ..# ###",
    "4": "#.# #.# ### ..# ..#", "5": "### #.. ### ..# ###", "6": "### #.. ### #.# ###", "7": "### ..# .#. .#. .#.",
    "8": "### #.# ### #.# ###", "9": "### #.# ### ..# ###", "A": ".#. #.# ### #.# #.#", "B": "##. #.# ##. #.# ##.",
    "C": "### #.. #.. #.. ###", "D": "##. #.# #.# #.# ##.", "E": "### #.. ##. #.. ###", "F": "### #.. ##. #.. #..",
    "G": "### #.. #.# #.# ###", "H": "#.# #.# ### #.# #.#", "I": "### .#. .#. .#. ###", "J": "..# ..# ..# #.# ###",
    "K": "#.# #.# ##. #.# #.#", "L": "#.. #.. #.. #.. ###", "M": "#.# ### ### #.# #.#", "N": "##. #.# #.# #.# #.#",
    "O": "### #.# #.# #.# ###", "P": "### #.# ### #.. #..", "Q": "### #.# #.# ### ..#", "R": "### #.# ##. #.# #.#",
    "S": "### #.. ### ..# ###", "T": "### .#. .#. .#. .#.", "U": "#.# #.# #.# #.# ###", "V": "#.# #.# #.# #.# .#.",
    "W": "#.# #.# ### ### #.#", "X": "#.# #.# .#. #.# #.#", "Y": "#.# #.# .#. .#. .#.", "Z": "### ..# .#. #.. ###",
    " ": "... ... ... ... ...", ".": "... ... ... ... .#.", "-": "... ... ### ... ...", "+": "... .#. ### .#. ...",
    "%": "#.# ..# .#. #.. #.#", "/": "..# ..# .#. #.. #..", ":": "... .#. ... .#. ...", "(": ".#. #.. #.. #.. .#.",
    ")": ".#. ..# ..# ..# .#.", "<": "..# .#. #.. .#. ..#", ">": "#.. .#. ..# .#. #..", "=": "... ### ... ### ...",
    "^": ".#. #.# ... ... ...", "_": "... ... ... ... ###",
}


class Canvas:
    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(b"\xff" * (w * h * 3))

    def set(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.px[i:i + 3] = bytes(c)

    def rect(self, x0, y0, x1, y1, c) -> None:
        for y in range(int(min(y0, y1)), int(max(y0, y1)) + 1):
            for x in range(int(min(x0, x1)), int(max(x0, x1)) + 1):
                self.set(x, y, c)

    def line(self, x0, y0, x1, y1, c, width: int = 1) -> None:
        x0, y0, x1, y1 = int(round(x0)), int(round(y0)), int(round(x1)), int(round(y1))
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for ox in range(-(width // 2), width - width // 2):
                for oy in range(-(width // 2), width - width // 2):
                    self.set(x0 + ox, y0 + oy, c)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, c=(0, 0, 0), scale: int = 2) -> None:
        for ch in s.upper():
            glyph = _FONT.get(ch, _FONT[" "]).replace(" ", "")
            for k, v in enumerate(glyph):
                if v == "#":
                    self.rect(x + (k % 3) * scale, y + (k // 3) * scale, x + (k % 3) * scale + scale - 1,
                              y + (k // 3) * scale + scale - 1, c)
            x += 4 * scale

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


COLORS = {"nccl": (31, 119, 180), "ce": (255, 127, 14)}


def _size_label(b: float) -> str:
    return f"{b / MIB:g}M" if b >= MIB else f"{b / 1024:g}K"


def plot_fallback(path: str, sc: dict, pred: dict) -> None:
    """predicted (lines) vs measured (squares), time vs size per op, log-log, and slowdowns as bars."""
    W, H = 1320, 480
    cv = Canvas(W, H)
    cv.text(12, 8, f"COST MODEL {sc['profile']} VS MEASURED: LINES PREDICTED, SQUARES MEASURED, BLUE NCCL, ORANGE CE")
    pw, ph, top = 340, 340, 60
    for k, op in enumerate(OPS):
        x0 = 70 + k * (pw + 110)
        rows = [r for r in sc["rows"] if r["op"] == op]
        ts = [r[f] for r in rows for f in ("measured_us", "predicted_us") if r[f]]
        if not ts:
            continue
        sizes = sorted({r["bytes_per_rank"] for r in rows})
        lx0, lx1 = math.log10(sizes[0] / 2), math.log10(sizes[-1] * 2)
        ly0, ly1 = math.floor(math.log10(min(ts))), math.ceil(math.log10(max(ts)))
        ly1 = max(ly1, ly0 + 1)

        def X(b):
            return x0 + (math.log10(b) - lx0) / (lx1 - lx0) * pw

        def Y(t):
            return top + ph - (math.log10(t) - ly0) / (ly1 - ly0) * ph

        cv.rect(x0, top + ph, x0 + pw, top + ph, (0, 0, 0))
        cv.rect(x0, top, x0, top + ph, (0, 0, 0))
        for d in range(ly0, ly1 + 1):
            cv.line(x0, Y(10 ** d), x0 + pw, Y(10 ** d), (225, 225, 225))
            cv.text(x0 - 8 * (len(str(10 ** d)) + 1), int(Y(10 ** d)) - 5, str(10 ** d))
        last_label = -1e9
        for s in sizes:
            cv.line(X(s), top + ph, X(s), top + ph + 5, (0, 0, 0))
            if X(s) - last_label >= 44:  # no overlapping labels
                cv.text(int(X(s)) - 8, top + ph + 10, _size_label(s))
                last_label = X(s)
        cv.text(x0, top - 22, f"{op.replace('_', '-')} (US VS SIZE PER RANK)")
        for backend in BACKENDS:
            c = COLORS[backend]
            ys = pred["curves"].get((op, backend))
            if ys:
                pts = [(X(s), Y(t)) for s, t in zip(pred["dense"], ys) if sizes[0] / 2 <= s <= sizes[-1] * 2 and t > 0]
                for a, b in zip(pts, pts[1:]):
                    cv.line(*a, *b, c, width=2)
            for r in rows:
                if r["backend"] == backend and r["measured_us"]:
                    x, y = X(r["bytes_per_rank"]), Y(r["measured_us"])
                    cv.rect(x - 4, y - 4, x + 4, y + 4, c)
    # Slowdowns: predicted (light) and measured (dark) bars per (compute, op/backend).
    x0 = 70 + 2 * (pw + 110)
    cv.text(x0, top - 22, "SLOWDOWN % (LIGHT PRED, DARK MEAS)")
    sl = [s for s in sc["slowdowns"] if s.get("measured_pct") is not None or s.get("predicted_pct") is not None]
    vmax = max([abs(v) for s in sl for v in (s.get("measured_pct"), s.get("predicted_pct")) if v is not None] + [10.0])
    cv.rect(x0, top + ph, x0 + pw, top + ph, (0, 0, 0))
    bw = max(4, pw // max(1, 2 * len(sl) + len(sl)))
    for i, s in enumerate(sl):
        c = COLORS[s["backend"]]
        light = tuple(min(255, v + (255 - v) // 2) for v in c)
        bx = x0 + 6 + i * 3 * bw
        for j, (v, col) in enumerate(((s.get("predicted_pct"), light), (s.get("measured_pct"), c))):
            if v is not None:
                cv.rect(bx + j * bw, top + ph - max(0.0, v) / vmax * ph, bx + (j + 1) * bw - 2, top + ph, col)
        cv.text(bx, top + ph + 10 + (i % 2) * 14, ("G" if s["compute"] == "gemm" else "M") + s["op"][0].upper()
                + ("N" if s["backend"] == "nccl" else "C"), scale=2)
    cv.text(x0, top + ph + 44, "G GEMM M MEMBOUND, A AG R RS, N NCCL C CE")
    with open(path, "wb") as f:
        f.write(cv.png())


def plot(path: str, sc: dict, pred: dict) -> str:
    """Writes the PNG; returns how ('matplotlib' or 'built-in writer')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 (absent or broken: the fallback writer)
        plot_fallback(path, sc, pred)
        return "built-in PNG writer (matplotlib not importable)"
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    for ax, op in zip(axes, OPS):
        for backend in BACKENDS:
            c = [v / 255 for v in COLORS[backend]]
            ys = pred["curves"].get((op, backend))
            if ys:
                ax.plot([s / MIB for s in pred["dense"]], ys, "-", color=c, label=f"{backend} predicted")
            pts = [(r["bytes_per_rank"] / MIB, r["measured_us"]) for r in sc["rows"]
                   if r["op"] == op and r["backend"] == backend and r["measured_us"]]
            if pts:
                ax.plot(*zip(*pts), "s", color=c, label=f"{backend} measured")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("MiB per rank")
        ax.set_ylabel("us")
        ax.set_title(f"{op} ({sc['profile']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax = axes[2]
    sl = sc["slowdowns"]
    labels = [f"{'GEMM' if s['compute'] == 'gemm' else 'mem-bound'}\n{'AG' if s['op'] == 'all_gather' else 'RS'} "
              f"{s['backend']}" for s in sl]
    xs = range(len(sl))
    ax.bar([x - 0.2 for x in xs], [s.get("predicted_pct") or 0 for s in sl], 0.4, label="predicted", color="#9ecae1")
    ax.bar([x + 0.2 for x in xs], [s.get("measured_pct") or 0 for s in sl], 0.4, label="measured", color="#3182bd")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("slowdown %")
    ax.set_title("compute slowdown beside the collective")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "matplotlib"


# ------------------------------------------------------------------------------------------------------------------
# Measuring (torchrun, 2 GPUs)

SCHEMA = "ce_overlap.bench.cost_model_validation/1"


def sizes_from_args(sizes_mib: str, crossover_mib: str) -> tuple[list[int], list[int]]:
    """(the scored sizes, every measured size) in bytes per rank, from the --sizes-mib / --crossover-mib lists."""
    main_sizes = [int(float(x) * MIB) for x in sizes_mib.split(",") if x]
    extra = [int(float(x) * MIB) for x in crossover_mib.split(",") if x]
    return main_sizes, sorted(set(main_sizes + extra))


def slowdown_rows(raw_slow: list[dict], slow_bytes: int) -> list[dict]:
    """One row per (collective, backend, compute kind) from calibrate.measure_slowdowns' records (None: not measured)."""
    from ce_overlap import calibrate as cal  # noqa: PLC0415

    rows = []
    for op in OPS:
        for backend in BACKENDS:
            for compute in cal.COMPUTE_KINDS:
                r = next((x for x in raw_slow if x["collective"] == op and x["backend"] == backend
                          and x["compute"] == compute), None)
                rows.append({"op": op, "backend": backend, "compute": compute, "bytes_per_rank": slow_bytes,
                             "measured_pct": None if r is None else (r["compute_beside_us"] / r["compute_alone_us"] - 1) * 100,
                             "compute_alone_us": r and r["compute_alone_us"], "compute_beside_us": r and r["compute_beside_us"],
                             "collective_alone_us": r and r["collective_alone_us"],
                             "collective_beside_us": r and r["collective_beside_us"]})
    return rows


def report(payload: dict, profile_names: list[str], sizes: list[int], main_sizes: list[int], slow_bytes: int,
           out_dir: str, strict: bool, stem: str) -> int:
    """Scores every profile against the measurements in `payload`, prints the reports, writes <stem>.png (the first
    profile) and <stem>.json (the payload plus the scores). Returns 1 when strict and a target of the first fails."""
    from ce_overlap import profiles  # noqa: PLC0415

    measured = {(m["op"], m["backend"], m["bytes_per_rank"]): m["us"] for m in payload["measured"]}
    slow_rows = slowdown_rows(payload["slowdowns_measured"], slow_bytes)
    os.makedirs(out_dir, exist_ok=True)
    scores, first_pred = [], None
    for name in profile_names:
        pred = predict(profiles.load(name), payload["device"]["world_size"], sizes, slow_rows)
        scores.append(score(name, pred, measured, sizes, main_sizes))
        first_pred = first_pred or pred
        print()
        print(format_report(scores[-1]))
    primary = scores[0]
    png = os.path.join(out_dir, f"{stem}.png")
    try:
        how = plot(png, primary, first_pred)
        print(f"# wrote {png} ({how})")
    except Exception as e:  # noqa: BLE001 (the numbers matter more than the picture)
        how = f"not written: {type(e).__name__}: {e}"
        print(f"# {stem}.png {how}")
    failed = [c for c in primary["checks"] if c["pass"] is False]
    n_na = sum(c["pass"] is None for c in primary["checks"])
    print(f"# {profile_names[0]}: {len(primary['checks']) - len(failed) - n_na} targets pass, {len(failed)} fail, "
          f"{n_na} not measured (n/a)")
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump({**payload, "scores": scores, "png": {"path": png, "how": how}}, f, indent=1)
    print(f"# wrote {path}")
    return 1 if failed and strict else 0


def rescore(path: str, profile_names: list[str], out_dir: str, strict: bool) -> int:
    """No GPU: scores profiles against the measurements of an earlier run's validation.json (a model change is seen
    on measured numbers at once; only a new device run validates it independently)."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"cost_model_validation: --rescore {path}: {e}", file=sys.stderr)
        return 2
    if old.get("schema") != SCHEMA or "measured" not in old or "slowdowns_measured" not in old:
        print(f"cost_model_validation: --rescore {path}: not a {SCHEMA} file with measurements", file=sys.stderr)
        return 2
    a = old["args"]
    main_sizes, sizes = sizes_from_args(a["sizes_mib"], a["crossover_mib"])
    names = profile_names or [old["scores"][0]["profile"]]
    print(f"# cost model re-scored on the measurements of {path} ({old['device']['gpu']}, "
          f"{old['device']['world_size']} ranks); profiles: {', '.join(names)}")
    payload = {**{k: v for k, v in old.items() if k not in ("scores", "png")}, "rescored_from": path,
               "rescore_command": " ".join([os.path.basename(sys.executable)] + sys.argv)}
    return report(payload, names, sizes, main_sizes, int(a["slowdown_mib"] * MIB), out_dir, strict, "rescore")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,4,16,64,256", help="sizes per rank scored for the error targets")
    p.add_argument("--crossover-mib", default="0.25,0.5,2", help="extra sizes measured for the crossover only")
    p.add_argument("--slowdown-mib", type=float, default=256, help="collective size per rank beside compute")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--profile", default=None, help="profile to validate (default: the detected GPU's built-in)")
    p.add_argument("--also-profile", action="append", default=[], help="more profiles scored on the same numbers")
    p.add_argument("--out", default=None, help="output folder (default $OUT, else bench/results)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    p.add_argument("--rescore", metavar="VALIDATION_JSON", default=None,
                   help="no GPU: score --profile / --also-profile against that earlier run's measurements "
                        "(writes rescore.json / rescore.png into --out)")
    args = p.parse_args()
    if args.rescore:
        names = ([args.profile] if args.profile else []) + args.also_profile
        return rescore(args.rescore, names, args.out or os.path.dirname(os.path.abspath(args.rescore)), args.strict)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lib import common as C  # noqa: E402  (multicast off before torch loads NCCL)

    import torch
    import torch.distributed as dist

    from ce_overlap import calibrate as cal
    from ce_overlap import profiles

    main_sizes, sizes = sizes_from_args(args.sizes_mib, args.crossover_mib)
    slow_bytes = int(args.slowdown_mib * MIB)
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if world_env < 2:
        print("cost_model_validation: needs 2 or more GPUs under torchrun "
              "(torchrun --standalone --nproc-per-node 2 bench/cost_model_validation.py)", file=sys.stderr)
        return 2
    rank, world, _ = C.init()
    group = dist.group.WORLD
    info = C.header(f"cost model validation, {world} ranks, median of {args.iters} ops after {args.warmup} warmup "
                    "(device time: CUDA events, the stream given a head start so host enqueue time is not counted)")
    gpu = torch.cuda.get_device_name()
    prof_name = args.profile or profiles.builtin_for_device(gpu) or "h200-sxm"
    out_dir = args.out or os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

    cols = cal.Collectives(group, max(max(sizes), slow_bytes))
    na = cols.verify()
    for k, v in na.items():
        C.log0(f"# {k}: n/a -- {v}")

    measured: dict = {}
    for op in OPS:
        for backend, reason in cols.backends(op).items():
            for s in sizes:
                if reason:
                    measured[(op, backend, s)] = None
                    continue
                fn, settle = cols.runner(op, backend, s)
                dist.barrier()
                measured[(op, backend, s)] = cal.median_us(fn, args.iters, args.warmup, settle)
                del fn
            C.log0(f"# measured {op}/{backend}" if not reason else f"# {op}/{backend}: n/a -- {reason}")
    torch.cuda.empty_cache()
    raw_slow = cal.measure_slowdowns(cols, slow_bytes, args.iters, args.warmup)

    rc = 0
    if rank == 0:
        payload = {"schema": SCHEMA, "args": vars(args), "info": info, "na": na,
                   "device": {"gpu": gpu, "world_size": world},
                   "measured": [{"op": k[0], "backend": k[1], "bytes_per_rank": k[2], "us": v} for k, v in measured.items()],
                   "slowdowns_measured": raw_slow}
        rc = report(payload, [prof_name] + args.also_profile, sizes, main_sizes, slow_bytes, out_dir, args.strict,
                    "validation")
    dist.barrier()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
