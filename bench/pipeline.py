"""Pipeline parallelism over NCCL and over ce_overlap's torch.distributed backend, side by side in one run: the step
time of torch.distributed.pipelining's schedules (unchanged), where the step goes (compute, the schedule's bubble,
communication on the critical path), and a GEMM's time beside a stage's send / recv.

    torchrun --standalone --nproc-per-node 2 bench/pipeline.py --out pipeline.json
    torchrun --standalone --nproc-per-node 4 bench/pipeline.py --model llama3-8b --layers 32 --seq-len 4096

Every rank holds one stage (1f1b) or two (the interleaved schedules, loop layout: rank r holds stages r and r + n) of a
Llama-3-style model from the zoo (python/ce_overlap/models): the layers split evenly over the stages, the embedding on
the first and the norm and output projection on the last, bf16 parameters, n microbatches of one sequence each.

    schedules   1f1b (Schedule1F1B), interleaved-1f1b (ScheduleInterleaved1F1B), zero-bubble
                (ScheduleInterleavedZeroBubble, ZB1P: input and weight gradients split); one the installed torch lacks
                is skipped with the reason
    transports  nccl        backend "nccl"               (skipped, with the reason, where ranks share a GPU)
                ce_overlap  backend "cuda:ce_overlap"    (ce_overlap.distributed; its inner backend for the rest)

With --dp N the ranks form a (pp, dp) mesh (rank = pp_index * N + dp_index): N pipelines of world / N stages, every
stage FSDP2-sharded over the N ranks that hold it (each block, then the stage, as torchtitan shards; FSDP on NCCL),
the transports carrying the stage-to-stage sends only. tests/pipeline_fsdp/worker.py checks that composition's
gradients against the unsharded model.

Per schedule and transport: the median step over --steps after --warmup (CUDA events, the slowest rank), tokens/s,
and where the step goes:

    compute    the busiest rank's forward and backward of all its microbatches, each timed alone (no communication)
    ideal      the schedule's own makespan from those times, no communication: torch's action order per rank
               (its pipeline_order; 1F1B's warmup / 1B1F / cooldown), each action after its dependencies (the forward
               of the stage before, the backward of the stage after); the weight half of a zero-bubble backward is
               taken as half of the full backward (its GEMMs are half of the FLOPs)
    bubble     1 - compute / step (all idle time on the busiest rank); the schedule's share: 1 - compute / ideal
    comm path  step - ideal: communication (and host overhead) on the critical path
    p2p        one activation (seq x dim bf16) exchanged with both neighbours, alone

and per transport the GEMM test: a bf16 GEMM (--gemm) timed alone and beside batched exchanges of --message-mib
messages with both neighbours (what a 1F1B stage does in steady state), each arm ~--sustain-ms of GEMMs enqueued at
once, the exchanges' side stream given more than the window's worth, as the GEMM's slowdown, with the SM clock and
board power of each arm (NVML); --copy-rates repeats the ce_overlap arm with its sends paced to each rate. Sends and receives are always batched
(dist.batch_isend_irecv), as pipelining issues them: unbatched isend / irecv pairs in opposite directions between two
ranks are the pattern NCCL requires to be grouped; on torch 2.11 / NCCL 2.28.9 they end in an illegal memory access
(32 MiB) or a hang (256 KiB), with no ce_overlap in the process (bench/repro/nccl_unbatched_p2p.py).

On one GPU the ranks share it: the numbers say the paths work, not how fast they are (two GPUs for that). --device cpu
runs every path but the GPU's (gloo the only transport, no GEMM test) as a smoke test (tests/test_pipeline_bench.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import common as _common  # noqa: E402,F401  (sets NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before torch)
from lib.common import header, log0, write_json  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TRANSPORTS = ("nccl", "ce_overlap")
# name -> (torch.distributed.pipelining class, stages per rank)
SCHEDULES = {"1f1b": ("Schedule1F1B", 1), "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
             "zero-bubble": ("ScheduleInterleavedZeroBubble", 2)}
# "cuda" normally; "cpu" (gloo everywhere, the GEMM test left out) only for the smoke test that runs in CI
# (tests/test_pipeline_bench.py): every code path but the GPU's, before a GPU run spends device time on it.
DEVICE = "cuda"


class _HostEvent:
    """torch.cuda.Event's timing interface on the host clock (--device cpu)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end) -> float:
        return (end.t - self.t) * 1e3


def event():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else _HostEvent()


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE == "cuda" else torch.device("cpu")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-1b", help="zoo model whose widths to use (default llama3-1b)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks over all stages (default 4)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--schedules", default="1f1b",
                   help=f"comma list of {tuple(SCHEDULES)} (default 1f1b; empty: the GEMM test only)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help=f"comma list of {TRANSPORTS}")
    p.add_argument("--dp", type=int, default=1,
                   help="FSDP2 degree: world / dp pipeline stages, each stage sharded over dp ranks (default 1: none)")
    p.add_argument("--gemm", type=int, default=8192, help="the GEMM test's m = n = k (bf16)")
    p.add_argument("--sustain-ms", type=float, default=1000.0,
                   help="the GEMM test's length per arm (ms; sustained, the boards' clocks settle)")
    p.add_argument("--message-mib", type=float, default=32.0, help="the GEMM test's message size (MiB)")
    p.add_argument("--copy-rates", default="",
                   help="comma list of GB/s: the GEMM test of the ce_overlap transport once more per rate, its sends "
                        "paced to it (testing.tune(copy_rate_gbps=); 0 = unlimited; default: only unpaced)")
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke test of every path but the GPU's (gloo is the only transport, no GEMM test)")
    args = p.parse_args(argv)
    if args.device == "cpu":
        args.transports = "gloo"
    for knob, known in (("transports", TRANSPORTS + (("gloo",) if args.device == "cpu" else ())),
                        ("schedules", tuple(SCHEDULES))):
        bad = [t for t in getattr(args, knob).split(",") if t and t not in known]
        if bad:
            p.error(f"unknown {knob[:-1]}(s) {bad}; choose from {known}")
    for name in ("layers", "seq_len", "microbatches", "steps", "gemm", "dp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.message_mib <= 0 or args.sustain_ms <= 0:
        p.error("--warmup must be >= 0, --message-mib and --sustain-ms > 0")
    try:
        args.copy_rates = [float(r) for r in args.copy_rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--copy-rates must be a comma list of numbers (GB/s), got {args.copy_rates!r}")
    if any(not (r >= 0 and r < float("inf")) for r in args.copy_rates):
        p.error(f"--copy-rates must be finite and >= 0 (0: unlimited), got {args.copy_rates}")
    return args


def init() -> tuple[int, int]:
    """The default group over gloo (host-side barriers and results); each rank on its own GPU, or every rank on GPU 0
    when there are more local ranks than GPUs (then NCCL cannot run: the table says so)."""
    import datetime

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if DEVICE == "cuda":
        torch.cuda.set_device(0 if shared_gpu() else local)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    return dist.get_rank(), dist.get_world_size()


def shared_gpu() -> bool:
    return DEVICE == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()


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


def transport_group(name: str, dp: int):
    """(this rank's pipeline group over the transport, "") or (None, why it cannot run here). Pipeline d is the ranks
    with rank % dp == d (rank = pp_index * dp + dp_index, the (pp, dp) mesh's layout)."""
    if name == "gloo":  # --device cpu
        backend = "gloo"
    elif name == "nccl":
        if not dist.is_nccl_available():
            return None, "this torch has no NCCL"
        if shared_gpu():
            return None, "ranks share a GPU, which NCCL refuses"
        backend = "nccl"
    else:
        if DEVICE != "cuda":
            return None, "copy engines need CUDA"
        import ce_overlap.distributed  # noqa: F401  (registers the backend)

        backend = "cuda:ce_overlap"
    rank, world = dist.get_rank(), dist.get_world_size()
    if dp == 1:
        return dist.new_group(backend=backend), ""
    mine = None
    for d in range(dp):  # every rank creates every pipeline's group, in the same order
        g = dist.new_group([q * dp + d for q in range(world // dp)], backend=backend)
        if d == rank % dp:
            mine = g
    return mine, ""


def dp_mesh(dp: int):
    """The "dp" dimension of a (pp, dp) mesh over NCCL (the default group is gloo), or None without FSDP."""
    if dp == 1:
        return None
    if shared_gpu():
        raise SystemExit("--dp needs a GPU per rank: FSDP2 runs on NCCL here")
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    backend = "nccl" if DEVICE == "cuda" else "gloo"
    mesh = init_device_mesh(DEVICE, (world // dp, dp), mesh_dim_names=("pp", "dp"),
                            backend_override={"pp": backend, "dp": backend})
    return mesh["dp"]


def schedule_class(name: str):
    """(the torch class, stages per rank), or (None, why) when the installed torch lacks it."""
    import torch.distributed.pipelining as pp

    cls_name, chunks = SCHEDULES[name]
    cls = getattr(pp, cls_name, None)
    if cls is None:
        return None, f"torch {torch.__version__} has no torch.distributed.pipelining.{cls_name}"
    return cls, chunks


def loss_fn(out, target):
    return F.cross_entropy(out.float().flatten(0, 1), target.flatten(0, 1))


@dataclasses.dataclass
class Pipeline:
    """This rank's part of one pipeline: its stage modules (by stage index) and the schedule over them."""
    modules: dict
    sched: object
    num_stages: int
    pp: int


def build_pipeline(cls, chunks: int, group, args, cfg, mesh=None) -> Pipeline:
    from torch.distributed.pipelining import PipelineStage

    from ce_overlap.models.llama import Llama, _rope_tables

    pp, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    num_stages = pp * chunks
    if cfg.n_layers < num_stages:
        raise ValueError(f"{cfg.n_layers} layers cannot fill {num_stages} stages")
    torch.manual_seed(0)
    with torch.device("meta"):
        full = Llama(cfg)
    dev = device()
    cos, sin = (t.to(dev) for t in _rope_tables(cfg, cfg.seq_len))
    per = -(-cfg.n_layers // num_stages)
    # An activation example that requires grad: torch 2.14 takes whether a stage's output gets a gradient from it
    # (2.11 decides itself); without it the first stage's backward gets no gradient.
    hidden = torch.empty(1, cfg.seq_len, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    modules, stages = {}, []
    for idx in (pp_rank + k * pp for k in range(chunks)):  # the loop layout the interleaved schedules expect
        first, last = idx == 0, idx == num_stages - 1
        mod = Stage(full, idx * per, min(cfg.n_layers, (idx + 1) * per), first, last, cos, sin)
        mod.to_empty(device=dev)
        for p in mod.parameters():  # the values do not matter for the time; finite ones keep the kernels honest
            nn.init.normal_(p, std=0.02)
        mod.to(torch.bfloat16)
        if mesh is not None:  # FSDP2 over dp, as torchtitan shards: every block, then the stage
            from torch.distributed.fsdp import fully_shard

            for layer in mod.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(mod, mesh=mesh)
        inp = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=dev) if first else hidden
        out = torch.empty(1, cfg.seq_len, cfg.vocab_size, device=dev, dtype=torch.bfloat16) if last else hidden
        modules[idx] = mod
        stages.append(PipelineStage(mod, idx, num_stages, dev, input_args=(inp,), output_args=out, group=group))
    sched = cls(stages[0] if chunks == 1 else stages, n_microbatches=args.microbatches, loss_fn=loss_fn)
    return Pipeline(modules, sched, num_stages, pp)


def step_times(pipe: Pipeline, args, cfg) -> list[float]:
    """Every timed step's milliseconds, the slowest rank's."""
    tokens = torch.randint(0, cfg.vocab_size, (args.microbatches, cfg.seq_len), device=device())
    first, last = 0 in pipe.modules, pipe.num_stages - 1 in pipe.modules
    ends = []
    start = event()
    sync()
    start.record()
    for _ in range(args.warmup + args.steps):
        inputs = (tokens,) if first else ()
        pipe.sched.step(*inputs, **({"target": tokens} if last else {}))
        ends.append(event())
        ends[-1].record()
    sync()
    times, prev = [], start
    for e in ends:
        times.append(prev.elapsed_time(e))
        prev = e
    t = torch.tensor(times[args.warmup:], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the default (gloo) group
    return t.tolist()


def compute_profile(pipe: Pipeline, cfg, reps: int = 3) -> dict[int, tuple[float, float]]:
    """Every stage's (forward ms, full backward ms) for one microbatch, alone, median of reps; all ranks' stages."""
    dev = device()
    mine = {}
    for idx, mod in pipe.modules.items():
        if idx == 0:
            x = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device=dev)
        else:
            x = torch.randn(1, cfg.seq_len, cfg.dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device=dev)
        fwd, bwd = [], []
        for _ in range(reps + 1):
            e = [event() for _ in range(3)]
            e[0].record()
            y = mod(x)
            e[1].record()
            if idx == pipe.num_stages - 1:
                loss_fn(y, target).backward()
            else:
                y.backward(torch.ones_like(y))
            e[2].record()
            sync()
            fwd.append(e[0].elapsed_time(e[1]))
            bwd.append(e[1].elapsed_time(e[2]))
            del y
        mod.zero_grad(set_to_none=True)
        mine[idx] = (statistics.median(fwd[1:]), statistics.median(bwd[1:]))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {idx: t for d in every for idx, t in d.items()}


def action_orders(pipe: Pipeline, name: str, world: int, n_mb: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per rank, its compute actions in the order the schedule runs them: (kind F/B/I/W, stage, microbatch)."""
    if name == "1f1b":  # torch's Schedule1F1B: warmup forwards, then 1B1F, then the remaining backwards
        orders = {}
        for r in range(world):
            warm = min(n_mb, world - r)
            seq = [("F", r, i) for i in range(warm)]
            f, b = warm, 0
            while True:
                seq.append(("B", r, b))
                b += 1
                if f == n_mb:
                    break
                seq.append(("F", r, f))
                f += 1
            seq += [("B", r, i) for i in range(b, n_mb)]
            orders[r] = seq
        return orders
    return {r: [(a.computation_type.value, a.stage_index, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value in "FBIW"]
            for r, acts in pipe.sched.pipeline_order.items()}


def makespan(orders: dict[int, list[tuple[str, int, int]]], times: dict[int, tuple[float, float]],
             num_stages: int, comm_ms: float = 0.0) -> float:
    """The schedule's makespan: each rank runs its actions in order, each after its dependencies (plus comm_ms when
    the dependency ran on another rank). F(s, i) after F(s-1, i); B or I(s, i) after F(s, i) and the input gradient
    of stage s+1; W(s, i) after I(s, i). I and W are half of B each."""
    cost = {"F": lambda s: times[s][0], "B": lambda s: times[s][1], "I": lambda s: times[s][1] / 2,
            "W": lambda s: times[s][1] / 2}
    owner = {s: r for r, acts in orders.items() for _, s, _ in acts}
    present = {(k, s, i) for acts in orders.values() for k, s, i in acts}
    done: dict[tuple[str, int, int], float] = {}
    pos, free = {r: 0 for r in orders}, {r: 0.0 for r in orders}

    def input_grad(s, i):  # the action that produces stage s's input gradient: a full backward or an input backward
        return ("I", s, i) if ("I", s, i) in present else ("B", s, i)

    def ready_at(kind, s, i, r):
        deps = []
        if kind == "F" and s > 0:
            deps.append(("F", s - 1, i))
        if kind in "BI":
            deps.append(("F", s, i))
            if s < num_stages - 1:
                deps.append(input_grad(s + 1, i))
        if kind == "W":
            deps.append(("I", s, i))
        t = 0.0
        for d in deps:
            if d not in done:
                return None
            t = max(t, done[d] + (comm_ms if owner[d[1]] != r else 0.0))
        return t

    remaining = sum(len(a) for a in orders.values())
    while remaining:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                kind, s, i = acts[pos[r]]
                t = ready_at(kind, s, i, r)
                if t is None:
                    break
                done[(kind, s, i)] = max(t, free[r]) + cost[kind](s)
                free[r] = done[(kind, s, i)]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [orders[r][pos[r]] for r in orders if pos[r] < len(orders[r])]
            raise RuntimeError(f"schedule order deadlocks: every rank's next action waits: {stuck}")
    return max(free.values())


def neighbours_batch(group, send, recv):
    """One batched exchange with both neighbours in the pipeline group (one peer at two stages), as a 1F1B stage's
    fused send / recv."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    right, left = (dist.get_global_rank(group, (rank + d) % size) for d in (1, -1))
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                   dist.P2POp(dist.irecv, recv, left, group)])


def p2p_ms(group, cfg, reps: int = 20) -> float:
    """One activation exchanged with the neighbours, alone: median ms, slowest rank."""
    send = torch.randn(cfg.seq_len, cfg.dim, device=device(), dtype=torch.bfloat16)
    recv = torch.empty_like(send)
    times = []
    for _ in range(reps + 2):
        s, e = event(), event()
        dist.barrier()  # the gloo default group: both sides start together
        s.record()
        for w in neighbours_batch(group, send, recv):
            w.wait()
        e.record()
        sync()
        times.append(s.elapsed_time(e))
    t = torch.tensor([statistics.median(times[2:])], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def gemm_beside(group, args) -> dict:
    """The GEMM test, sustained: ~--sustain-ms of back-to-back bf16 GEMMs enqueued at once, alone, then again with a
    side stream given enough batched --message-mib exchanges with both neighbours to outlast them (1.2x the window at
    the exchange's speed alone; the GEMMs are enqueued first so the host issuing exchanges never starves them). The
    GEMM's mean ms per launch in each window, the exchange's ms alone and per exchange beside (the side stream's
    span / count: it covers the GEMM window when the span is at least the window), the SM clock and board power of
    each window (NVML); slowest rank."""
    import math

    from lib import common as C

    gemm = C.gemm(args.gemm)
    numel = int(args.message_mib * (1 << 20)) // 2
    send = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
    recv = torch.empty_like(send)

    def exchange():
        for w in neighbours_batch(group, send, recv):
            w.wait()

    sync = torch.cuda.synchronize
    burst = C.time_alone(gemm, 10, 3, sync, skip_first=2)
    iters = int(C.max_over_ranks(max(20, args.sustain_ms // burst)))
    dist.barrier()
    exchange_alone = C.time_alone(exchange, 20, 3, sync, skip_first=2)
    n_exchanges = int(C.max_over_ranks(math.ceil(1.2 * iters * burst / exchange_alone)))  # the same on every rank
    sampler = C.ClockSampler()

    def window(exchanges: int) -> tuple[float, float, dict]:
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        side.wait_stream(main)
        dist.barrier()
        with sampler:
            ev[0].record()
            for _ in range(iters):
                gemm()
            ev[1].record()
            with torch.cuda.stream(side):
                ev[2].record()
                for _ in range(exchanges):
                    exchange()
                ev[3].record()
            sync()
        span = ev[2].elapsed_time(ev[3]) if exchanges else 0.0
        return ev[0].elapsed_time(ev[1]), span, sampler.stats()

    alone_ms, _, alone_stats = window(0)
    beside_ms, span_ms, beside_stats = window(n_exchanges)
    alone, beside = C.max_over_ranks(alone_ms / iters), C.max_over_ranks(beside_ms / iters)
    return {"gemm_alone_us": alone * 1e3, "gemm_beside_us": beside * 1e3,
            "gemm_slowdown_pct": 100 * (beside / alone - 1), "gemm_iters": iters, "exchanges": n_exchanges,
            "window_ms": C.max_over_ranks(beside_ms), "exchange_span_ms": -C.max_over_ranks(-span_ms),
            "exchange_alone_ms": exchange_alone, "exchange_beside_ms": C.max_over_ranks(span_ms / n_exchanges),
            **{"alone_" + k: v for k, v in C.clocks_over_ranks(alone_stats).items()},
            **C.clocks_over_ranks(beside_stats)}


def measure(name: str, cls, chunks: int, group, args, cfg, mesh) -> dict:
    """One schedule over one transport: the row of the table."""
    pipe = build_pipeline(cls, chunks, group, args, cfg, mesh)
    pp = pipe.pp
    ms = step_times(pipe, args, cfg)
    times = compute_profile(pipe, cfg)
    orders = action_orders(pipe, name, pp, args.microbatches)
    busiest = max(sum(args.microbatches * sum(times[s]) for s in range(pipe.num_stages) if s % pp == r)
                  for r in range(pp))
    ideal = makespan(orders, times, pipe.num_stages)
    med = statistics.median(ms)
    del pipe
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return {"step_ms": ms, "median_ms": med,
            "tokens_per_s": args.dp * args.microbatches * cfg.seq_len / (med / 1e3),  # every pipeline's
            "stage_ms": {str(s): {"forward": f, "backward": b} for s, (f, b) in sorted(times.items())},
            "compute_ms": busiest, "ideal_ms": ideal, "bubble_pct": 100 * (1 - busiest / med),
            "schedule_bubble_pct": 100 * (1 - busiest / ideal), "comm_path_ms": med - ideal}


def main(argv=None) -> int:
    global DEVICE
    args = parse_args(argv)
    DEVICE = args.device
    from ce_overlap.models.llama import LLAMA_CONFIGS

    rank, world = init()
    if world % args.dp or world // args.dp < 2:
        raise SystemExit(f"--dp {args.dp} must divide the world size {world} and leave at least 2 stages")
    mesh = dp_mesh(args.dp)
    cfg = dataclasses.replace(LLAMA_CONFIGS[args.model], n_layers=args.layers, seq_len=args.seq_len, expand_kv=True)
    fsdp = f" x {args.dp}-way FSDP2" if args.dp > 1 else ""
    title = (f"pipeline parallelism, {world // args.dp} stages{fsdp} ({args.model} widths, {args.layers} layers, seq "
             f"{args.seq_len}, {args.microbatches} microbatches of one sequence per pipeline)")
    if DEVICE == "cuda":
        info = header(title)
    else:
        log0(f"# {title}, on the CPU: a smoke test, not a measurement")
        info = {"gpu": "cpu", "world_size": world, "torch": torch.__version__, "command": " ".join(sys.argv)}
    rows, gemm_rows, groups = [], [], {}
    for transport in args.transports.split(","):
        groups[transport] = transport_group(transport, args.dp)
        group, why = groups[transport]
        if group is None:
            rows.append({"transport": transport, "skipped": why})
            log0(f"{transport}: skipped: {why}")
            continue
        one = p2p_ms(group, cfg)
        rates = [r for r in args.copy_rates if r > 0] if transport == "ce_overlap" else []
        for rate in [None] + rates:  # None: the transport as it is; then the ce_overlap sends paced to each rate
            label = transport if rate is None else f"{transport}@{rate:g}GB/s"
            try:
                if DEVICE == "cuda":  # streams and a GEMM beside them: nothing to learn on the CPU
                    from lib import ce_variants as V

                    if rate is not None:
                        V.tune(group, copy_rate_gbps=rate)
                    try:
                        gemm_rows.append({"transport": label, "copy_rate_gbps": rate or 0, "p2p_ms": one,
                                          **gemm_beside(group, args)})
                    finally:
                        if rate is not None:
                            V.tune(group, restore=True)  # the group's own knobs again
            except Exception as e:  # noqa: BLE001 (the schedules still run; the row says why this test did not)
                import traceback

                traceback.print_exc()
                gemm_rows.append({"transport": label, "p2p_ms": one, "error": f"{type(e).__name__}: {e}"[:300]})
        for sname in [n for n in args.schedules.split(",") if n]:
            row = {"transport": transport, "schedule": sname, "p2p_ms": one}
            cls, chunks = schedule_class(sname)
            if cls is None or (sname == "zero-bubble" and args.dp > 1):
                rows.append({**row, "skipped": chunks if cls is None else "zero bubble with FSDP2 computes wrong "
                             "gradients, with no ce_overlap in the process (tests/pipeline_fsdp/worker.py)"})
                continue
            try:
                row.update(measure(sname, cls, chunks, group, args, cfg, mesh))
            except Exception as e:  # noqa: BLE001 (a schedule that fails is a row that says why; the rest run)
                import traceback

                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            rows.append(row)
            log0(f"{transport} {sname}: " + (f"{row['median_ms']:.1f} ms" if "median_ms" in row else
                                              row.get("error", "")))
        if transport == "ce_overlap" and gemm_rows:
            import ce_overlap.distributed as ced

            gemm_rows[-1]["op_counts"] = ced.op_counts(group)  # this transport's last row; every op of the group
    print_table(rows, world, args.dp)
    print_gemm_table(gemm_rows, args)
    if args.out and rank == 0:
        write_json(args.out, {"schema": "ce_overlap.bench.pipeline/2", "info": info, "args": vars(args),
                              "rows": rows, "gemm": gemm_rows})
    dist.barrier()
    failed = any("error" in r for r in rows + gemm_rows)
    dist.destroy_process_group()
    return 1 if failed else 0


def print_table(rows: list[dict], world: int, dp: int) -> None:
    log0(f"\n{'schedule':<17} {'transport':<11} {'step ms':>8} {'tokens/s':>9} {'vs nccl':>8} {'compute':>8} "
         f"{'ideal':>8} {'bubble':>7} {'sched.':>7} {'comm path':>9} {'p2p ms':>7}")
    nccl = {r["schedule"]: r["median_ms"] for r in rows if r.get("transport") == "nccl" and "median_ms" in r}
    for r in rows:
        if "skipped" in r or "error" in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"FAILED: {r['error']}"
            log0(f"{r.get('schedule', '-'):<17} {r['transport']:<11} {why}")
            continue
        vs = f"{nccl[r['schedule']] / r['median_ms']:.3f}x" if r["schedule"] in nccl else "-"
        log0(f"{r['schedule']:<17} {r['transport']:<11} {r['median_ms']:8.1f} {r['tokens_per_s']:9,.0f} {vs:>8} "
             f"{r['compute_ms']:8.1f} {r['ideal_ms']:8.1f} {r['bubble_pct']:6.1f}% {r['schedule_bubble_pct']:6.1f}% "
             f"{r['comm_path_ms']:9.1f} {r['p2p_ms']:7.3f}")
    fsdp = (f" ({dp} pipelines, each stage FSDP2-sharded over {dp} ranks: tokens/s of all, a stage's times include "
            "its FSDP all-gathers and reduce-scatters)") if dp > 1 else ""
    log0(f"# {world} ranks{fsdp}; step = median (slowest rank); compute = the busiest rank's forwards + backwards "
         "alone; ideal = the schedule's makespan from those, no communication; bubble = 1 - compute / step "
         "(sched. = 1 - compute / ideal); comm path = step - ideal; p2p = one activation with both neighbours, alone")


def print_gemm_table(rows: list[dict], args) -> None:
    if not rows:
        return
    log0(f"\nbf16 GEMM {args.gemm}^3 beside batched {args.message_mib:g} MiB exchanges with both neighbours, sustained "
         f"~{args.sustain_ms:.0f} ms per arm (slowest rank; clock: median SM MHz, slowest rank; power: median W, "
         "highest rank)")
    log0(f"{'transport':<22} {'alone us':>9} {'beside us':>10} {'slowdown':>9} {'exch. alone ms':>15} "
         f"{'exch. beside ms':>16} {'clock alone':>12} {'clock beside':>13} {'W alone':>8} {'W beside':>9}")
    for r in rows:
        if "error" in r:
            log0(f"{r['transport']:<22} FAILED: {r['error']}")
            continue
        cover = "" if r["exchange_span_ms"] >= r["window_ms"] else \
            f"  (exchanges covered {r['exchange_span_ms']:.0f} of {r['window_ms']:.0f} ms)"
        log0(f"{r['transport']:<22} {r['gemm_alone_us']:9.1f} {r['gemm_beside_us']:10.1f} "
             f"{r['gemm_slowdown_pct']:8.1f}% {r['exchange_alone_ms']:15.3f} {r['exchange_beside_ms']:16.3f} "
             f"{r.get('alone_sm_clock_mhz', float('nan')):12.0f} {r.get('sm_clock_mhz', float('nan')):13.0f} "
             f"{r.get('alone_power_w', float('nan')):8.0f} {r.get('power_w', float('nan')):9.0f}{cover}")


if __name__ == "__main__":
    sys.exit(main())
