"""Pipeline parallelism over NCCL and over ce_overlap's torch.distributed backend, side by side in one run: the step
time of torch.distributed.pipelining (Schedule1F1B, unchanged) and a GEMM's time beside a stage's send / recv.

    torchrun --standalone --nproc-per-node 2 bench/pipeline.py --out pipeline.json
    torchrun --standalone --nproc-per-node 2 bench/pipeline.py --model llama3-8b --layers 4 --seq-len 4096

Every rank is one stage of a Llama-3-style model from the zoo (python/ce_overlap/models): the layers split evenly,
the embedding on the first stage and the norm and output projection on the last, bf16 parameters, n microbatches
of one sequence. Per transport (a process group of that backend over all ranks):

    nccl        backend "nccl"                (skipped, with the reason, where NCCL cannot run: ranks sharing a GPU)
    ce_overlap  backend "cuda:ce_overlap"     (ce_overlap.distributed; NCCL or gloo inside for everything else)

it reports the median step time over --steps after --warmup (CUDA events, the slowest rank), tokens/s, and the
GEMM test: a bf16 GEMM (--gemm) timed alone and beside a stream of --message-mib messages each rank sends to and
receives from its neighbour at the same time (what a 1F1B stage does in steady state), as the slowdown of the GEMM.
On one GPU the ranks share it: the numbers say the path works, not how fast it is (two GPUs for that).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402,F401  (sets NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before torch)
from _common import header, log0, write_json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TRANSPORTS = ("nccl", "ce_overlap")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-1b", help="zoo model whose widths to use (default llama3-1b)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks over all stages (default 4)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma list of {TRANSPORTS}")
    p.add_argument("--gemm", type=int, default=8192, help="the GEMM test's m = n = k (bf16)")
    p.add_argument("--gemms", type=int, default=40, help="GEMMs per timing")
    p.add_argument("--message-mib", type=float, default=32.0, help="the GEMM test's message size (MiB)")
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    args = p.parse_args(argv)
    bad = [t for t in args.transports.split(",") if t not in TRANSPORTS]
    if bad:
        p.error(f"unknown transport(s) {bad}; choose from {TRANSPORTS}")
    for name in ("layers", "seq_len", "microbatches", "steps", "gemm", "gemms"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.message_mib <= 0:
        p.error("--warmup must be >= 0 and --message-mib > 0")
    return args


def init() -> tuple[int, int]:
    """The default group over gloo (host-side barriers and results); each rank on its own GPU, or every rank on GPU 0
    when there are more local ranks than GPUs (then NCCL cannot run: the table says so)."""
    import datetime

    local = int(os.environ.get("LOCAL_RANK", "0"))
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    torch.cuda.set_device(0 if shared else local)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size()


class Stage(nn.Module):
    """Layers [lo, hi) of a Llama, with its embedding (first stage) and norm + output projection (last stage)."""

    def __init__(self, full, lo: int, hi: int, first: bool, last: bool, cos, sin):
        super().__init__()
        self.embed = full.tok_embeddings if first else None
        self.layers = nn.ModuleList(full.layers[lo:hi])
        self.norm = full.norm if last else None
        self.output = full.output if last else None
        self.cos, self.sin = cos, sin

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        seq = x.shape[1]
        for layer in self.layers:
            x = layer(x, self.cos[:seq], self.sin[:seq])
        return self.output(self.norm(x)) if self.output is not None else x


def transport_group(name: str):
    """(group, "") or (None, why it cannot run here)."""
    if name == "nccl":
        if not dist.is_nccl_available():
            return None, "this torch has no NCCL"
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            return None, "ranks share a GPU, which NCCL refuses"
        return dist.new_group(backend="nccl"), ""
    import ce_overlap.distributed  # noqa: F401  (registers the backend)

    return dist.new_group(backend="cuda:ce_overlap"), ""


def step_times(group, args, cfg) -> list[float]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from ce_overlap.models.llama import Llama, _rope_tables

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    with torch.device("meta"):
        full = Llama(cfg)
    cos, sin = (t.cuda() for t in _rope_tables(cfg, cfg.seq_len))
    per = -(-cfg.n_layers // world)
    stage_mod = Stage(full, rank * per, min(cfg.n_layers, (rank + 1) * per), rank == 0, rank == world - 1, cos, sin)
    stage_mod.to_empty(device="cuda")
    for p in stage_mod.parameters():  # the values do not matter for the time; finite ones keep the kernels honest
        nn.init.normal_(p, std=0.02)
    stage_mod.to(torch.bfloat16)
    dev = torch.device("cuda", torch.cuda.current_device())
    hidden = torch.empty(1, cfg.seq_len, cfg.dim, device=dev, dtype=torch.bfloat16)
    inp = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=dev) if rank == 0 else hidden
    out = torch.empty(1, cfg.seq_len, cfg.vocab_size, device=dev, dtype=torch.bfloat16) if rank == world - 1 \
        else hidden
    stage = PipelineStage(stage_mod, rank, world, dev, input_args=(inp,), output_args=out, group=group)
    sched = Schedule1F1B(stage, n_microbatches=args.microbatches,
                         loss_fn=lambda o, t: F.cross_entropy(o.float().flatten(0, 1), t.flatten(0, 1)))
    tokens = torch.randint(0, cfg.vocab_size, (args.microbatches, cfg.seq_len), device=dev)
    ends, times = [], []
    start = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.warmup + args.steps):
        if rank == 0:
            sched.step(tokens)
        elif rank == world - 1:
            sched.step(target=tokens)
        else:
            sched.step()
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
    torch.cuda.synchronize()
    prev = start
    for e in ends:
        times.append(prev.elapsed_time(e))
        prev = e
    t = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default (gloo) group
    return t.tolist()


def gemm_beside(group, args) -> tuple[float, float]:
    """(GEMM us alone, GEMM us beside every rank exchanging messages with its neighbours), slowest rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = args.gemm
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    numel = int(args.message_mib * (1 << 20)) // 2
    send = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def gemms() -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(args.gemms):
            torch.mm(a, b)
        e.record()
        return s, e

    for _ in range(3):
        torch.mm(a, b)
    torch.cuda.synchronize()
    s, e = gemms()
    torch.cuda.synchronize()
    alone = s.elapsed_time(e) * 1e3 / args.gemms
    right, left = (rank + 1) % world, (rank - 1) % world
    works = []
    for _ in range(args.gemms // 4):  # enough messages to run beside the whole GEMM loop (~4 GEMMs each on NVLink)
        works.append(dist.isend(send, right, group=group))
        works.append(dist.irecv(recv, left, group=group))
    s, e = gemms()
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    beside = s.elapsed_time(e) * 1e3 / args.gemms
    t = torch.tensor([alone, beside], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def main(argv=None) -> int:
    args = parse_args(argv)
    from ce_overlap.models.llama import LLAMA_CONFIGS

    rank, world = init()
    cfg = dataclasses.replace(LLAMA_CONFIGS[args.model], n_layers=args.layers, seq_len=args.seq_len, expand_kv=True)
    info = header(f"pipeline parallelism, {world} stages ({args.model} widths, {args.layers} layers, seq "
                  f"{args.seq_len}, {args.microbatches} microbatches, Schedule1F1B)")
    rows = []
    for name in args.transports.split(","):
        group, why = transport_group(name)
        if group is None:
            rows.append({"transport": name, "skipped": why})
            log0(f"{name}: skipped: {why}")
            continue
        ms = step_times(group, args, cfg)
        alone, beside = gemm_beside(group, args)
        med = statistics.median(ms)
        rows.append({"transport": name, "step_ms": ms, "median_ms": med,
                     "tokens_per_s": args.microbatches * cfg.seq_len / (med / 1e3), "gemm_alone_us": alone,
                     "gemm_beside_us": beside, "gemm_slowdown_pct": 100 * (beside / alone - 1)})
        if name == "ce_overlap":
            import ce_overlap.distributed as ced

            rows[-1]["op_counts"] = ced.op_counts(group)
    log0(f"\n{'transport':<12} {'step ms':>9} {'tokens/s':>10} {'GEMM alone us':>14} {'beside us':>10} {'slowdown':>9}")
    for r in rows:
        if "skipped" in r:
            log0(f"{r['transport']:<12} skipped: {r['skipped']}")
        else:
            log0(f"{r['transport']:<12} {r['median_ms']:9.2f} {r['tokens_per_s']:10,.0f} {r['gemm_alone_us']:14.1f} "
                 f"{r['gemm_beside_us']:10.1f} {r['gemm_slowdown_pct']:8.1f}%")
    if args.out and rank == 0:
        write_json(args.out, {"info": info, "args": vars(args), "rows": rows})
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
