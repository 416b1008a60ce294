"""Every recorded bench/train.py run predicted again by ce_overlap.analyzer.step_model: each train.json under a results folder,
one capture per shape (bench/train.py's, on fake tensors; no GPU), each mode's measured step against the built-in
profile of its GPU as it is and, per --without KEY, with that profile key removed (a dotted path: "shapes",
"efficiency.fused_memory"), to show what a part of the model changes. Per run whether the predicted order of the
measured modes is the measured one; at the end per profile the |error| median, max and rows within 10%.

    python bench/repredict.py --without shapes > bench/results/RUN/repredict.txt

A run measured with an override the step model does not price (a CE_OVERLAP_* variable other than the pass's
verbosity, such as the copy pacing) or named in --not-modelled is listed and left out of the summary.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Overrides that change no kernel the step runs.
UNPRICED_ENV_OK = {"CE_OVERLAP_PASS_VERBOSE"}
# Runs whose measurement the model is not meant to match, and why (paths relative to the results folder).
NOT_MODELLED = {"fsdp2-2026-11-26/before-8L-h200/train.json": "fsdp2-ce measured before its fix (that folder's README)"}


def why_not_modelled(name: str, run: dict, extra: dict) -> str:
    """Why a run's rows are not held against the model ('' when they are)."""
    env = {k: v for k, v in (run.get("info", {}).get("env") or {}).items()
           if k.startswith("CE_OVERLAP_") and v is not None and k not in UNPRICED_ENV_OK}
    if env:
        return f"run with {env} (an override the step model does not price)"
    return extra.get(name, "")


def without_key(profile: str, key: str, tmp: str) -> str:
    """A profile file: the built-in `profile` with the dotted `key` removed (absent: unchanged)."""
    from ce_overlap.profiles import read_text

    spec = json.loads(read_text(profile))
    node = spec
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.get(p, {})
    node.pop(parts[-1], None)
    path = os.path.join(tmp, f"{profile}-without-{key}.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def run_key(run: dict) -> tuple:
    """What the capture depends on, in the order runs are listed: (model, world, layers, lookup, wrap, profile, seq,
    gqa, fsdp2 wrap, tp, batch), then capture_step's arguments themselves (bench/lib/predict.py recorded_step_args)."""
    from lib.predict import recorded_step_args
    from ce_overlap.profiles import DEFAULT, builtin_for_device

    sa = recorded_step_args(run["args"])
    return (sa.model, run["info"]["world_size"], sa.layers, sa.vocab_parallel_embeddings, sa.in_graph_wrap,
            builtin_for_device(run["info"]["gpu"], default=DEFAULT), sa.seq_len, sa.gqa, sa.fsdp2_wrap,
            run["args"].get("tp", 1), sa.batch), sa


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--without", action="append", default=[], metavar="KEY",
                   help="also predict with this profile key removed (dotted path; repeatable)")
    p.add_argument("--not-modelled", action="append", default=[], metavar="RUN=WHY",
                   help="leave a run (its path under --results) out of the summary, saying why")
    args = p.parse_args(argv)
    extra = dict(NOT_MODELLED)
    for item in args.not_modelled:
        name, sep, why = item.partition("=")
        if not sep:
            p.error(f"--not-modelled expects RUN=WHY, got {item!r}")
        extra[name] = why

    import train

    runs = collections.defaultdict(list)
    step_args = {}  # key -> capture_step's arguments
    for path in sorted(glob.glob(os.path.join(args.results, "**", "train.json"), recursive=True)):
        with open(path) as f:
            run = json.load(f)
        name = os.path.relpath(path, args.results)
        meas = {x["mode"]: x["median_ms"] for x in run["results"] if x.get("ok", True) and x.get("median_ms")}
        key, step_args[key] = run_key(run)
        runs[key].append((name, meas, why_not_modelled(name, run, extra)))
    errors = collections.defaultdict(list)  # profile -> [(|error| as shipped, [|error| without each key], ...)]
    with tempfile.TemporaryDirectory() as tmp:
        for key, rs in sorted(runs.items()):
            _, world, layers, vocab, wrap, profile, _, _, _, tp, _ = key
            if tp > 1:
                continue  # the TP modes' predictions need an async-TP capture per run: bench/tp_predictions.py
            sa = step_args[key]
            ir = train.capture_step(sa, world)
            _, pred = train.predict_steps(sa, world, profile, ir=ir)
            alt = [train.predict_steps(sa, world, without_key(profile, k, tmp), ir=ir)[1] for k in args.without]
            for name, meas, why_not in rs:
                print(f"{name} (world {world}, {layers} layers, lookup {vocab}, wrap {wrap}, {profile})"
                      + (f"  [not in the summary: {why_not}]" if why_not else ""), flush=True)
                for m, v in meas.items():
                    if not pred.get(m):
                        print(f"  {m:26s} meas {v:7.1f}")
                        continue
                    e = 100 * (pred[m] / v - 1)
                    es = [100 * (a[m] / v - 1) for a in alt]
                    if not why_not:
                        errors[profile].append((abs(e), [abs(x) for x in es], name, m))
                    cols = "".join(f"   (without {k}: {a[m]:7.1f} {x:+6.1f}%)" for k, a, x in zip(args.without, alt, es))
                    print(f"  {m:26s} meas {v:7.1f}  pred {pred[m]:7.1f} {e:+6.1f}%{cols}")
                mm = [m for m in meas if pred.get(m)]
                ok = sorted(mm, key=lambda m: meas[m]) == sorted(mm, key=lambda m: pred[m])
                print("  ranking " + ("OK" if ok else f"WRONG pred {sorted(mm, key=lambda m: pred[m])}"), flush=True)
    print()
    for profile, rows in sorted(errors.items()):
        rows = sorted(rows, key=lambda r: r[0])
        e = [r[0] for r in rows]
        worst = ", ".join(f"{n} {m} {x:.1f}%" for x, _, n, m in rows[-3:])
        line = (f"{profile}: {len(e)} mode rows, |error| median {e[len(e) // 2]:.1f}%, max {e[-1]:.1f}%, within 10%: "
                f"{sum(x <= 10 for x in e)} (largest: {worst})")
        for i, k in enumerate(args.without):
            ek = sorted(r[1][i] for r in rows)
            line += (f"; without {k}: median {ek[len(ek) // 2]:.1f}%, max {ek[-1]:.1f}%, within 10%: "
                     f"{sum(x <= 10 for x in ek)}")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
