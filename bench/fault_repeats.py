"""Fault injection, repeated: every fault of RELIABILITY.md's "never hangs" table, N times each, on --ranks ranks (2 by
default; a GPU each, or all sharing GPU 0 where the box has fewer; tests/runtime/gpu_worker.py says how that
differs). Each
repeat is one torchrun launch of tests/runtime/gpu_worker.py with the fault's modes; the worker checks that every
surviving rank raised within the timeout naming the problem, that the streams drained and (where the ranks survive)
that a fresh group works. A launch that outlives its hard limit is a hang: its process tree is killed and counted.

    python bench/fault_repeats.py --repeats 20 --parallel 4 --out bench/results/.../faults.json

Prints a line per finished launch, then a table (fault, repeats, passed, failed, hangs, slowest launch), and writes
every launch's result as JSON after each launch; a SIGTERM (a time limit) prints the table of what finished and
keeps the JSON ("complete": false).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
from lib import args as A  # noqa: E402  (bench's option types and one-line usage errors)

WORKER = os.path.join(REPO, "tests", "runtime", "gpu_worker.py")
sys.path.insert(0, os.path.join(REPO, "tests", "runtime"))

# fault -> the worker modes that inject and check it
FAULTS = {
    "stall (a peer never calls the collective)": "timeout",
    "mismatched sizes / dtypes / variants": "mismatch",
    "send / recv faults (no receive, sizes differ)": "p2p_faults",
    "rank dies before rendezvous": "die_before_rendezvous",
    "rank dies mid-collective": "die_mid_collective",
    "pool allocation fails on one rank": "pool_alloc_failure",
    "P2P refused (simulated)": "p2p_refused",
}


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")]) if out.returncode == 0 else 0


def launch(modes: str, timeout_s: float, env: dict, ranks: int = 2) -> dict:
    from test_runtime_gpu import _kill_tree  # noqa: PLC0415 (the GPU tests' process-tree killer)

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), WORKER, modes]
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="ce_fault_") as progress:
        proc = subprocess.Popen(cmd, env={**env, "CE_TEST_PROGRESS_DIR": progress}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            hang = False
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            out, _ = proc.communicate()
            hang = True
    wall = time.time() - t0
    failed_lines = [line for line in out.splitlines() if "FAILED" in line and "[rank" in line]
    return {"modes": modes, "rc": proc.returncode, "hang": hang, "wall_s": round(wall, 1),
            "ok": proc.returncode == 0 and not hang, "failed_lines": failed_lines[:6],
            "raised": [line[:300] for line in out.splitlines() if "raised" in line][:6],
            "tail": "" if proc.returncode == 0 and not hang else out[-3000:]}


def main(argv=None) -> int:
    p = A.Parser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=A.at_least(1), default=20)
    p.add_argument("--parallel", type=A.at_least(1), default=2,
                   help="launches at once (each is --ranks processes)")
    p.add_argument("--ranks", type=A.at_least(2), default=2,
                   help="ranks per launch, each on its own GPU (all on GPU 0 when the box has fewer GPUs)")
    p.add_argument("--timeout-s", type=float, default=2.0, help="CE_OVERLAP_TIMEOUT_S of the launches")
    p.add_argument("--faults", default=",".join(FAULTS.values()), help="comma list of worker modes to repeat")
    p.add_argument("--out", default=None, help="JSON results")
    args = p.parse_args(argv)
    if not args.timeout_s > 0:
        p.error(f"--timeout-s must be > 0, got {args.timeout_s}")
    unknown = [m for m in args.faults.split(",") if m and m not in FAULTS.values()]
    if unknown or not args.faults.strip(","):
        p.error(f"--faults: unknown or no worker modes {unknown}; choose from {list(FAULTS.values())}")
    n_gpus = gpu_count()
    if n_gpus < 1:
        print("no GPU: nothing to inject faults into")
        return 1
    env = dict(os.environ)
    env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1",
                "CE_OVERLAP_POOL_MB": "128", "CE_OVERLAP_STAGING_MB": "1", "CE_OVERLAP_P2P_MB": "1",
                "CE_OVERLAP_TIMEOUT_S": str(args.timeout_s), "CE_TEST_STEP_DEADLINE_S": str(args.timeout_s + 25)})
    shared = n_gpus < args.ranks
    if shared:
        env["CE_TEST_SHARED_GPU"] = "1"
    modes = [m for m in args.faults.split(",") if m]
    # A launch's hard limit: start-up, every timeout its modes wait for (mismatch: 4), and a margin. Beyond it: a hang.
    limit = 90 + 8 * args.timeout_s
    jobs = [(m, i) for i in range(args.repeats) for m in modes]
    results: dict[str, list] = {m: [] for m in modes}
    t0 = time.time()

    def report(final: bool) -> bool:
        """The table and the JSON of the launches finished so far (also when cut short: SIGTERM from a time limit)."""
        names = {v: k for k, v in FAULTS.items()}
        print(f"\n{'fault':<48}{'worker mode':<24}{'repeats':>8}{'passed':>8}{'failed':>8}{'hangs':>7}{'slowest s':>10}")
        for m in modes:
            rs = results[m]
            print(f"{names.get(m, m):<48}{m:<24}{len(rs):>8}{sum(r['ok'] for r in rs):>8}"
                  f"{sum(not r['ok'] and not r['hang'] for r in rs):>8}{sum(r['hang'] for r in rs):>7}"
                  f"{max((r['wall_s'] for r in rs), default=0.0):>10.1f}")
        done = sum(len(v) for v in results.values())
        all_ok = done == len(jobs) and all(r["ok"] for rs in results.values() for r in rs)
        verdict = "all passed" if all_ok else ("FAILURES" if any(not r["ok"] for rs in results.values() for r in rs)
                                               else f"CUT SHORT: {len(jobs) - done} launches not run")
        print(f"# {done} of {len(jobs)} launches of {args.ranks} ranks in {time.time() - t0:.0f} s, {n_gpus} GPU(s)"
              f"{' (every rank on GPU 0)' if shared else ''}, CE_OVERLAP_TIMEOUT_S={args.timeout_s}: {verdict}",
              flush=True)
        write_json(final and done == len(jobs))
        return all_ok

    def write_json(complete: bool) -> None:
        if not args.out:
            return
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "gpus": n_gpus,
                       "ranks": args.ranks, "shared_gpu": shared, "timeout_s": args.timeout_s, "repeats": args.repeats,
                       "complete": complete, "launches_planned": len(jobs), "results": results}, f, indent=1)
        os.replace(tmp, args.out)

    def on_term(signum, _frame):
        print(f"# signal {signum}: stopping; what finished so far:", flush=True)
        report(final=False)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = {pool.submit(launch, m, limit, env, args.ranks): m for m, _ in jobs}
        for n, f in enumerate(concurrent.futures.as_completed(futures), 1):
            r = f.result()
            results[futures[f]].append(r)
            print(f"[{n}/{len(jobs)} {time.time() - t0:5.0f} s] {r['modes']}: "
                  f"{'ok' if r['ok'] else 'HANG' if r['hang'] else 'FAILED'} in {r['wall_s']} s", flush=True)
            if not r["ok"]:
                print(f"FAILED launch of {r['modes']}: rc={r['rc']} hang={r['hang']}\n{r['tail'][-1500:]}", flush=True)
            write_json(False)  # after every launch: a run cut short keeps what finished
    all_ok = report(final=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
