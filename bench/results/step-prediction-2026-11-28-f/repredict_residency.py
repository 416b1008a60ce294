"""Every bench/results train.json measured on H200 predicted again for every mode, with the built-in h200-sxm as it is
(contention.nccl_beside_compute.residency_us) and with that term removed (the profile before it), one capture per
shape; and whether the predicted order of the measured modes is the measured one. H100 runs are left out: h100-sxm
has no such term, so their predictions do not change; nor are the copy-rate experiments (RATE_RUNS). From the repository root, torch 2.11:

    python bench/results/step-prediction-2026-11-28-f/repredict_residency.py > .../repredict-residency.txt
"""
import argparse
import collections
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, "bench")
import train  # noqa: E402
from ce_overlap.profiles import DEFAULT, builtin_for_device, read_text  # noqa: E402

PROFILE = "h200-sxm"
# ce_overlap with its copies paced at rates set through the environment (the copy-rate experiments): the model prices
# the default, unpaced plan.
RATE_RUNS = "bench/results/collectives-2026-11-28/"


def without_residency(tmp: str) -> str:
    spec = json.loads(read_text(PROFILE))
    spec["contention"]["nccl_beside_compute"].pop("residency_us", None)
    path = os.path.join(tmp, f"{PROFILE}-no-residency.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def main() -> None:
    runs = collections.defaultdict(list)
    for f in sorted(glob.glob("bench/results/**/train.json", recursive=True)):
        r = json.load(open(f))
        a = r["args"]
        if builtin_for_device(r["info"]["gpu"], default=DEFAULT) != PROFILE or f.startswith(RATE_RUNS):
            continue
        meas = {x["mode"]: x["median_ms"] for x in r["results"] if x.get("ok", True) and x.get("median_ms")}
        key = (r["info"]["world_size"], a["layers"], bool(a.get("vocab_parallel_embeddings")),
               a.get("in_graph_wrap", train.IN_GRAPH_WRAP_BEFORE), a.get("seq_len", 4096), a.get("gqa", "expand"),
               a.get("fsdp2_wrap", "torchtitan"))
        runs[key].append((f.replace("bench/results/", ""), meas))
    errors = collections.defaultdict(list)
    ranked = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        before_profile = without_residency(tmp)
        for key, rs in sorted(runs.items()):
            world, layers, vocab, wrap, seq, gqa, fsdp2_wrap = key
            args = argparse.Namespace(model="llama3-8b", layers=layers, seq_len=seq, batch=1, gqa=gqa,
                                      vocab_parallel_embeddings=vocab, in_graph_wrap=wrap, fsdp2_wrap=fsdp2_wrap,
                                      device="cpu")
            ir = train.capture_step(args, world)
            _, pred = train.predict_steps(args, world, PROFILE, ir=ir)
            _, before = train.predict_steps(args, world, before_profile, ir=ir)
            for name, meas in rs:
                print(f"{name} (world {world}, {layers} layers, lookup {vocab}, wrap {wrap})", flush=True)
                for m, v in meas.items():
                    if not pred.get(m):
                        continue
                    e, eb = 100 * (pred[m] / v - 1), 100 * (before[m] / v - 1)
                    errors["with"].append(abs(e))
                    errors["without"].append(abs(eb))
                    print(f"  {m:26s} meas {v:7.1f}  pred {pred[m]:7.1f} {e:+6.1f}%   (without: {before[m]:7.1f} "
                          f"{eb:+6.1f}%)")
                mm = [m for m in meas if pred.get(m)]
                for way, p in (("with", pred), ("without", before)):
                    ranked[(way, sorted(mm, key=lambda m: meas[m]) == sorted(mm, key=lambda m: p[m]))] += 1
    print()
    for way in ("with", "without"):
        es = sorted(errors[way])
        print(f"{way} the residency term: {len(es)} mode rows, |error| median {es[len(es) // 2]:.1f}%, max "
              f"{es[-1]:.1f}%, within 10%: {sum(e <= 10 for e in es)}; ranking right in {ranked[(way, True)]} of "
              f"{ranked[(way, True)] + ranked[(way, False)]} runs")


if __name__ == "__main__":
    main()
