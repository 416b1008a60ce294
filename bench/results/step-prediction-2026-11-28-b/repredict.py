"""Every bench/results train.json predicted again by ce_overlap.analyzer.step_model (one capture per shape), beside the no-comm
prediction of the stand-ins before 2026-11-28-b (each one a kernel of its own), and whether the predicted order of the
measured modes is the measured one. From the repository root:
    python bench/results/step-prediction-2026-11-28-b/repredict.py '[EXTRA RUNS as JSON]' > repredict-every-run.txt
EXTRA RUNS: [{"key": [world, layers, vocab_parallel, in_graph_wrap, profile, seq_len, gqa], "name": ..., "meas":
{mode: ms}}] for runs whose train.json was not kept."""
import sys, os, json, glob, argparse, collections
sys.path.insert(0, 'bench')
import train
from ce_overlap.profiles import DEFAULT, builtin_for_device
from ce_overlap.analyzer.step_model import MODES, predicted_step_ms, step_model, collectives_by_graph

def old_local(graphs, hbm, gap):
    out = {}
    for g in graphs:
        moved = k = 0
        for n in g['nodes']:
            c = n.get('collective') if n.get('kind') == 'collective' else None
            if not c or c['group_size'] <= 1: continue
            if c['type'] == 'all_gather': moved += c['bytes'] * (1 + c['group_size']); k += 1
            elif c['type'] == 'reduce_scatter': moved += 2 * c['bytes'] // c['group_size']; k += 1
        out[g['name']] = moved * hbm + k * gap
    return out

runs = collections.defaultdict(list)
extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else []
for f in sorted(glob.glob('bench/results/**/train.json', recursive=True)):
    r = json.load(open(f)); a = r['args']
    meas = {x['mode']: x['median_ms'] for x in r['results'] if x.get('ok', True) and x.get('median_ms')}
    key = (r['info']['world_size'], a['layers'], bool(a.get('vocab_parallel_embeddings')), a.get('in_graph_wrap', train.IN_GRAPH_WRAP_BEFORE),
           builtin_for_device(r['info']['gpu'], default=DEFAULT), a.get('seq_len', 4096), a.get('gqa', 'expand'))
    runs[key].append((f.replace('bench/results/', ''), meas))
for e in extra:
    runs[tuple(e['key'])].append((e['name'], e['meas']))
out = []
for key, rs in sorted(runs.items()):
    world, layers, vocab, wrap, profile, seq, gqa = key
    args = argparse.Namespace(model='llama3-8b', layers=layers, seq_len=seq, batch=1, gqa=gqa,
                              vocab_parallel_embeddings=vocab, in_graph_wrap=wrap, device='cpu')
    ir = train.capture_step(args, world)
    p = step_model(ir, profile, world, 'consumer', loss_logits=train.loss_logits(args))
    pred = {m: predicted_step_ms(p, m) for m in MODES}
    spec = json.load(open(f'python/ce_overlap/profiles/{profile}.json'))
    hbm = 1 / (spec['gpu']['hbm_gbps'] * 1e3 * spec['efficiency']['memory'])
    oldp = dict(p); oldp['local_gather_us'] = old_local(ir.to_dict()['graphs'], hbm, p['kernel_gap_us'])
    pred_old_nc = predicted_step_ms(oldp, 'no-comm')
    for name, meas in rs:
        row = {'run': name, 'key': key, 'pred': pred, 'pred_old_no_comm': pred_old_nc, 'meas': meas}
        out.append(row)
        print(name, key, flush=True)
        for m, v in meas.items():
            pv = pred.get(m)
            s = f'  {m:26s} meas {v:7.1f}'
            if pv: s += f'  pred {pv:7.1f} {100*(pv/v-1):+6.1f}%'
            if m == 'no-comm': s += f'  (old {pred_old_nc:7.1f} {100*(pred_old_nc/v-1):+6.1f}%)'
            print(s, flush=True)
        mm = [m for m in meas if pred.get(m)]
        mo = sorted(mm, key=lambda m: meas[m]); po = sorted(mm, key=lambda m: pred[m])
        oldpred = dict(pred); oldpred['no-comm'] = pred_old_nc
        oo = sorted(mm, key=lambda m: oldpred[m])
        print('  ranking', 'OK' if mo == po else f'WRONG pred {po} meas {mo}', '| old', 'OK' if mo == oo else 'WRONG', flush=True)
