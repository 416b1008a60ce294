"""Every bench/results train.json that measured Inductor's overlap scheduler (compile+inductor-overlap), predicted
again two ways: as step_model prices that mode (ce_overlap's order, every bucket on NCCL: the stand-in) and from a
capture with the scheduler on, its order priced as captured (step_model.SCHEDULER_CAPTURED); and whether each way
ranks the run's measured modes as measured. Run it with the torch the runs measured (2.11: the scheduler's order is
that torch's), from the repository root:
    python bench/results/step-prediction-2026-11-28-d/repredict_scheduler.py > bench/results/step-prediction-2026-11-28-d/repredict-scheduler.txt
"""
import argparse
import collections
import glob
import json
import sys
import time

sys.path.insert(0, 'bench')
import torch  # noqa: E402
import train  # noqa: E402
from ce_overlap.profiles import DEFAULT, builtin_for_device  # noqa: E402
from ce_overlap.analyzer.step_model import SCHEDULER_CAPTURED  # noqa: E402

SCHED = "compile+inductor-overlap"
runs = collections.defaultdict(list)
for f in sorted(glob.glob('bench/results/**/train.json', recursive=True)):
    r = json.load(open(f))
    a = r['args']
    meas = {x['mode']: x['median_ms'] for x in r['results'] if x.get('ok', True) and x.get('median_ms')}
    if SCHED not in meas:
        continue
    key = (r['info']['world_size'], a['layers'], bool(a.get('vocab_parallel_embeddings')),
           a.get('in_graph_wrap', train.IN_GRAPH_WRAP_BEFORE), builtin_for_device(r['info']['gpu'], default=DEFAULT),
           a.get('seq_len', 4096), a.get('gqa', 'expand'), a.get('fsdp2_wrap', 'torchtitan'))
    runs[key].append((f.replace('bench/results/', ''), meas))
print(f"# torch {torch.__version__}; {sum(len(v) for v in runs.values())} runs, {len(runs)} shapes")
errs = collections.defaultdict(list)
ranked = collections.Counter()
for key, rs in sorted(runs.items()):
    world, layers, vocab, wrap, profile, seq, gqa, fsdp2_wrap = key
    args = argparse.Namespace(model='llama3-8b', layers=layers, seq_len=seq, batch=1, gqa=gqa,
                              vocab_parallel_embeddings=vocab, in_graph_wrap=wrap, fsdp2_wrap=fsdp2_wrap, device='cpu')
    t0 = time.time()
    ir = train.capture_step(args, world)
    sched = train.capture_step(args, world, overlap_scheduler=profile)
    pieces, pred = train.predict_steps(args, world, profile, ir=ir, scheduler_ir=sched)
    kept = pieces["scheduler"]["plan"]
    exposed = sum(p["exposed_comm_us_after"] for p in kept.values()) / 1e3
    slow = sum(p["slowdown_us"] for p in kept.values()) / 1e3
    n = sum(p["collectives"] for p in kept.values())
    print(f"\n## world {world}, {layers} layers, lookup {vocab}, wrap {wrap}, {profile} (captures {time.time() - t0:.0f} s; "
          f"the scheduler's order: {n} collectives, exposed {exposed:.1f} ms, slowdown {slow:.1f} ms)", flush=True)
    for name, meas in rs:
        m = meas[SCHED]
        a, b = pred[SCHED], pred[SCHEDULER_CAPTURED]
        errs["stand-in"].append(abs(a / m - 1))
        errs["captured"].append(abs(b / m - 1))
        line = f"  {name}: measured {m:.1f}, stand-in {a:.1f} ({100 * (a / m - 1):+.1f}%), captured order {b:.1f} ({100 * (b / m - 1):+.1f}%)"
        modes = [x for x in meas if pred.get(x)]
        for way, value in (("stand-in", a), ("captured", b)):
            p = {**{x: pred[x] for x in modes}, SCHED: value}
            ok = sorted(modes, key=lambda x: meas[x]) == sorted(modes, key=lambda x: p[x])
            ranked[(way, ok)] += 1
            line += f"; ranking {way} {'OK' if ok else 'WRONG ' + str(sorted(modes, key=lambda x: p[x]))}"
        print(line, flush=True)
print()
for way, es in errs.items():
    es = sorted(es)
    print(f"{way}: {len(es)} runs, |error| median {100 * es[len(es) // 2]:.1f}%, max {100 * es[-1]:.1f}%, within 10%: "
          f"{sum(e <= 0.10 for e in es)}; ranking equal to the measured: {ranked[(way, True)]} of {len(es)}")
