"""What `ce-overlap calibrate` prints: `fit_report` (each measurement against the written profile's prediction) and
the text report after a profile was written (what was fitted, kept and skipped). No torch, no GPU."""
from __future__ import annotations

from .check import check_measurements
from .common import format_bytes
from .model import core_profile, gemm_model_us, predicted_slowdown, step_gemms_model_us


def fit_report(profile: dict, measurements: dict) -> list[str]:
    """Measured vs the written profile's prediction, one line each (what `calibrate` prints at the end)."""
    from .. import _core

    m, _ = check_measurements(measurements)
    prof = core_profile(profile)
    out = []
    for c in m.get("collectives", []):
        if c["collective"] in ("send", "recv"):
            continue
        b, t = c["points"][-1]
        pred = _core.estimate_collective(prof, c["collective"], b, c["group_size"], c["backend"])
        out.append(f"{c['collective']:<15} {c['backend']:<5} {format_bytes(b):>10}: measured {t:9.1f} us, "
                   f"profile {pred:9.1f} us")
    eff = profile["efficiency"]
    peak = float(profile["gpu"]["peak_bf16_tflops"])
    hbm = float(profile["gpu"]["hbm_gbps"])
    for k in m.get("memory_kernels", []):
        pred = k["bytes"] / (hbm * 1e3 * eff["memory"])  # CostModel::roofline's memory side
        out.append(f"{k['name']:<22}: measured {k['us']:9.1f} us, profile {pred:9.1f} us ({100 * (pred / k['us'] - 1):+.1f}%)")
    if m.get("optimizer"):
        o = m["optimizer"]
        pred = o["bytes"] / (hbm * 1e3 * eff.get("optimizer", eff["memory"]))
        out.append(f"fused AdamW {o['params'] / 2 ** 20:.0f}M params: measured {o['us']:9.1f} us, profile {pred:9.1f} us")
    for g in m.get("transformer_gemms", []):
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        pred = gemm_model_us(eff, peak, flops)
        out.append(f"GEMM {int(g['m'])}x{int(g['k'])} @ {int(g['k'])}x{int(g['n'])} ({g.get('kind', '')}): measured "
                   f"{g['us']:9.1f} us, profile {pred:9.1f} us ({100 * (pred / g['us'] - 1):+.1f}%)")
    ts = m.get("training_step")
    if ts:
        pred = step_gemms_model_us(eff, peak, ts["gemms"])
        out.append(f"GEMMs of a compiled training step: measured {ts['gemm_us']:9.1f} us, profile {pred:9.1f} us "
                   f"({100 * (pred / ts['gemm_us'] - 1):+.1f}%; the bursts above run at higher clocks)")
    for s in m.get("slowdowns", []):
        meas = (s["compute_beside_us"] / s["compute_alone_us"] - 1) * 100
        pred = predicted_slowdown(prof, s["collective"], s["bytes"], s["group_size"], s["backend"], s["compute"])
        out.append(f"{s['compute']:<12} beside {s['collective']}/{s['backend']} {format_bytes(s['bytes'])}: measured "
                   f"{meas:+5.1f}%, profile " + ("n/a" if pred is None else f"{pred * 100:+5.1f}%"))
    return out


def print_summary(output: str, profile: dict, base: dict, measurements: dict, notes: list[str]) -> None:
    """The text report of a written profile: where it went, what it started from, the notes of build_profile, what
    the run skipped, and fit_report's lines."""
    m = measurements
    print(f"wrote {output}: profile {profile['name']!r} ({profile.get('schema')}), loaded back through the C++ loader: ok")
    print(f"  {m['world_size']} x {m['gpu']['name']} ({m['gpu']['sms']} SMs), started from {base['name']!r}")
    for line in notes:
        print(f"  {line}")
    for what, why in m.get("skipped", {}).items():
        print(f"  skipped {what}: {why}")
    report = fit_report(profile, m)
    if report:
        print("  measured vs the written profile:")
        for line in report:
            print(f"    {line}")
    print(f"use it: ce-overlap analyze MODEL --profile {output}")
