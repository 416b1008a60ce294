"""Every bench/results train.json predicted again by ce_overlap.analyzer.step_model (one capture per shape) with the built-in
profile as it is and with efficiency.fused_memory removed (fused kernels at efficiency.memory, the model before
2026-11-28-c), the FSDP2 modes from a capture sharded as they shard (train.predict_steps), and whether the predicted order of the measured modes is the measured one. From the repository root:
    python bench/results/step-prediction-2026-11-28-c/repredict.py > bench/results/step-prediction-2026-11-28-c/repredict-every-run.txt
Runs measured with train.py's --loss-reduce end and --gc torchtitan (2026-11-28-c on) are marked "new harness"."""
import argparse
import collections
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, 'bench')
import train  # noqa: E402
from ce_overlap.profiles import DEFAULT, builtin_for_device, read_text  # noqa: E402


def without_fused(profile: str, tmp: str) -> str:
    spec = json.loads(read_text(profile))
    spec["efficiency"].pop("fused_memory", None)
    path = os.path.join(tmp, f"{profile}-no-fused.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


runs = collections.defaultdict(list)
for f in sorted(glob.glob('bench/results/**/train.json', recursive=True)):
    r = json.load(open(f))
    a = r['args']
    meas = {x['mode']: x['median_ms'] for x in r['results'] if x.get('ok', True) and x.get('median_ms')}
    key = (r['info']['world_size'], a['layers'], bool(a.get('vocab_parallel_embeddings')),
           a.get('in_graph_wrap', train.IN_GRAPH_WRAP_BEFORE), builtin_for_device(r['info']['gpu'], default=DEFAULT),
           a.get('seq_len', 4096), a.get('gqa', 'expand'), a.get('fsdp2_wrap', 'torchtitan'))
    new = a.get('loss_reduce') == 'end'
    runs[key].append((f.replace('bench/results/', ''), meas, new))
errors = collections.defaultdict(list)
with tempfile.TemporaryDirectory() as tmp:
    for key, rs in sorted(runs.items()):
        world, layers, vocab, wrap, profile, seq, gqa, fsdp2_wrap = key
        args = argparse.Namespace(model='llama3-8b', layers=layers, seq_len=seq, batch=1, gqa=gqa,
                                  vocab_parallel_embeddings=vocab, in_graph_wrap=wrap, fsdp2_wrap=fsdp2_wrap,
                                  device='cpu')
        ir = train.capture_step(args, world)
        _, pred = train.predict_steps(args, world, profile, ir=ir)
        _, before = train.predict_steps(args, world, without_fused(profile, tmp), ir=ir)
        for name, meas, new in rs:
            print(f"{name} (world {world}, {layers} layers, lookup {vocab}, wrap {wrap}, {profile})"
                  + ("  [new harness]" if new else ""), flush=True)
            for m, v in meas.items():
                if not pred.get(m):
                    print(f"  {m:26s} meas {v:7.1f}")
                    continue
                e, eb = 100 * (pred[m] / v - 1), 100 * (before[m] / v - 1)
                errors[(profile, new)].append(abs(e))
                print(f"  {m:26s} meas {v:7.1f}  pred {pred[m]:7.1f} {e:+6.1f}%   (fused at memory: {before[m]:7.1f} "
                      f"{eb:+6.1f}%)")
            mm = [m for m in meas if pred.get(m)]
            ok = sorted(mm, key=lambda m: meas[m]) == sorted(mm, key=lambda m: pred[m])
            print("  ranking " + ("OK" if ok else f"WRONG pred {sorted(mm, key=lambda m: pred[m])}"), flush=True)
print()
for (profile, new), es in sorted(errors.items()):
    es = sorted(es)
    print(f"{profile} {'new harness' if new else 'older runs '}: {len(es)} mode rows, |error| median {es[len(es) // 2]:.1f}%, "
          f"max {es[-1]:.1f}%, within 10%: {sum(e <= 10 for e in es)}")
