"""Training throughput and MFU, every mode back to back in one run on the same GPUs (on GPUs each mode in a fresh
process per rank, so none inherits an earlier one's memory or library state; --same-process to run them in this one).

A Llama-3-style model from the zoo the analyzer captures (python/ce_overlap/models), trained on synthetic
tokens with in-graph FSDP over all ranks (python/ce_overlap/in_graph/fully_shard.py: bf16 gathers, fp32 master shards,
reshard after forward), fused AdamW with the learning rate warmed up linearly over 200 steps (torchtitan's
llama3-8b schedule; --lr-warmup-steps), torch.compile on the model (the loss is computed inside it). At the end: the
largest loss difference between compiled modes and whether they agree within one bf16 spacing at every step.

Modes:
  eager                      no compile
  compile                    torch.compile, Inductor defaults
  compile+inductor-overlap   + Inductor's own overlap scheduler and FSDP bucketing (the best it offers)
  compile+low-contention     compile+inductor-overlap plus PyTorch's low-contention pass (its copy-engine symm_mem
                             all-gather / reduce-scatter for overlapped FSDP collectives), where the torch has it
  ce_overlap-nccl            + ce_overlap's pass with CE off: our bucketing and reordering on NCCL
  ce_overlap                 + ce_overlap's pass with the cost model's NCCL/CE choice
  ce_overlap-packed          ce_overlap with pack_ce_buckets=True: CE buckets packed into one buffer (copy-in /
                             copy-out kernels) instead of one multi-tensor CE op (what the in-place op saves)
  ce_overlap-rs-kernel       ce_overlap with ce_reduction="kernel": CE reduce-scatters summed by the runtime's
                             bounded reduction kernel beside the backward, not in the graph's consumer kernels
  no-comm                    each all-gather replaced by a local op of the same shape, no reduce-scatter:
                             the bound no overlap scheme can pass
  compile+inductor-overlap+ac, ce_overlap+ac, fsdp2+ac
                             the mode with activation checkpointing per block (checkpoint_wrapper on each block
                             before sharding, torchtitan's full AC): the blocks' forward recomputed in the backward.
                             compile+inductor-overlap+ac fails on torch 2.11 on GPUs, torch's own: the overlap
                             scheduler wraps the recomputed attention's graphsafe_run_with_rng_state in control_deps
                             and Inductor's lowering asserts its RNG input has no other kind of user (torch 2.14 has
                             no such assertion; bench/results/fully-shard-2026-11-27)
  fsdp2                      FSDP2 (fully_shard) instead of in-graph FSDP, every block compiled, NCCL (torchtitan's
                             default pattern; bench/lib/fsdp2.py)
  fsdp2-ce                   fsdp2 with ce_overlap's copy engines (ce_overlap.fsdp.use_copy_engines, --ce): the
                             direct path (gathered into the parameters, reduce-scattered from the gradients)
  fsdp2-ce-hooks             fsdp2-ce with direct=False: copy engines in FSDP2's extension points only
  fsdp2-symm-mem             fsdp2 with PyTorch's own symmetric-memory all-gather, where the torch has it
  fsdp2-no-comm              fsdp2 with its all-gather and reduce-scatter replaced by local copies of the same
                             shapes: the bound for the FSDP2 modes (as no-comm is for the in-graph ones)
  fsdp2+tp, fsdp2+tp+async-tp, fsdp2-ce+tp, ce_overlap+tp, no-comm+tp
                             with --tp T: tensor parallelism over T ranks inside, FSDP over the rest (bench/lib/tp.py);
                             their "vs base" and "gap recov." columns compare with fsdp2+tp and no-comm+tp

The FSDP2 modes shard as torchtitan does (--fsdp2-wrap torchtitan: embedding, each block, [norm, output], root);
their "vs base" and "gap recov." columns compare with fsdp2 and fsdp2-no-comm, the in-graph modes' with compile and
no-comm.

Step time: CUDA events between consecutive step ends; the host never waits for the GPU inside the measured loop
(losses are averaged over the ranks and read after it), so the host's launch work overlaps the previous step as in a
real training run, with Python's automatic garbage collector off as torchtitan runs (--gc, --loss-reduce;
--sync-every-step: the earlier host-timed, synchronized steps). Per step a torchtitan-style line (printed after
the mode's run); at the end a table (median tokens/s per GPU, TFLOP/s, MFU by torchtitan's
formula and peak table, peak memory, loss) and, with --predict, the cost model's step time next to the measured
one. JSON results go to --out (bench/plot_train.py draws the chart from it).

    torchrun --standalone --nproc-per-node 2 bench/train.py --layers 8 --seq-len 4096 --out train.json
    torchrun --standalone --nproc-per-node 4 bench/train.py --tp 2 --seq-len 8192 --layers 8 \
        --modes fsdp2+tp,fsdp2+tp+async-tp,ce_overlap+tp,no-comm+tp --out train_tp.json
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import common as _common  # noqa: E402  (sets NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 before torch)
from lib.common import format_exc_line, header, init, log0, write_json  # noqa: E402
from lib.titan import GC_FREQ, lr_at, peak_tflops, step_loop_gc  # noqa: E402

from lib import tp as _tp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lib.kernel_profile import export_trace, log_kernel_table, profile_kernels, rank_summary  # noqa: E402
from lib.memory import ce_pool_gib, live_at_peak_by_site, live_blocks_by_site, memory_report  # noqa: E402
from lib.predict import (IN_GRAPH_WRAP_BEFORE, KEEP_GATHERED, capture_step, fsdp2_shards_alike,  # noqa: E402,F401
                      loss_logits, model_config, predict_steps)

# "cuda" normally; "cpu" (gloo, --device cpu) only for the smoke test that runs in CI (tests/test_train_bench.py).
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


MODES = ["eager", "compile", "compile+inductor-overlap", "compile+low-contention", "ce_overlap-nccl", "ce_overlap",
         "ce_overlap-packed", "ce_overlap-rs-kernel", "no-comm", "compile+inductor-overlap+ac", "ce_overlap+ac",
         "fsdp2", "fsdp2-ce", "fsdp2-ce-hooks", "fsdp2-symm-mem", "fsdp2-no-comm", "fsdp2+ac", *_tp.MODES]
DEFAULT_MODES = [m for m in MODES if m not in _tp.MODES]  # --tp 1; with --tp > 1: _tp.MODES
CE_MODES = ("ce_overlap", "ce_overlap-packed", "ce_overlap-rs-kernel")  # modes that may run CE collectives
AC = "+ac"  # a mode's suffix: activation checkpointing per block (torchtitan's full AC), then the same mode


def without_ac(mode: str) -> str:
    return mode[: -len(AC)] if mode.endswith(AC) else mode


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="zoo model whose widths to use (default llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="number of transformer blocks (default: the model's)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    p.add_argument("--steps", type=int, default=30, help="measured steps per mode (after warm-up)")
    p.add_argument("--warmup", type=int, default=5, help="steps per mode before measuring (compile happens here)")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated subset of {MODES} (default: every mode of the --tp given: "
                        f"{','.join(_tp.MODES)} with --tp > 1)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over this many ranks inside, FSDP over the rest (the TP modes: "
                        "bench/lib/tp.py); default 1")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (torchtitan's llama3-8b: 3e-4)")
    p.add_argument("--lr-warmup-steps", type=int, default=200,
                   help="linear warm-up of the learning rate over this many steps, as torchtitan's llama3-8b config "
                        "(200); 0: the peak rate from step 1. Without it, random tokens at 3e-4 make the loss "
                        "chaotic and the modes' losses drift apart from reduction-order noise alone")
    p.add_argument("--ce", choices=["auto", "on"], default="auto",
                   help="the ce_overlap and fsdp2-ce modes' copy-engine policy: auto (the cost model decides per bucket "
                        "or FSDP group) or on "
                        "(every bucket on CE; on one GPU, the group of one's self copies: the CE path's memory and "
                        "streams without a peer)")
    p.add_argument("--gqa", choices=["expand", "native"], default="expand",
                   help="expand: repeat K/V heads before SDPA in every mode (torch 2.11's overlap scheduler "
                        "rejects enable_gqa); native: SDPA enable_gqa")
    p.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                   help="after each mode's measured steps, profile this many more steps (torch.profiler) and record "
                        "the GPU kernel time per step by class (GEMM, attention, fused, optimizer, ...)")
    p.add_argument("--kernel-profile-lead-s", type=float, default=1.5, metavar="S",
                   help="steps run back to back for about this long right before the profiled ones, unrecorded: a "
                        "board at its power limit holds a lower clock under sustained load than after a pause, and the "
                        "timed steps run sustained (0: profile right after a sync, the method before 2026-11-27-c)")
    p.add_argument("--fsdp2-wrap", choices=["torchtitan", "blocks"], default="torchtitan",
                   help="how the FSDP2 modes shard: torchtitan (its apply_fsdp: embedding, each block, [norm, output] "
                        "not resharded after forward, root) or blocks (each block, then the root holding embedding, "
                        "norm and output: the pattern of results before 2026-11-26)")
    p.add_argument("--vocab-parallel-embeddings", action="store_true",
                   help="the in-graph modes shard the token embedding by rows and look tokens up where they are stored "
                        "(ce_overlap.fully_shard's vocab_parallel_embeddings: no all-gather of the table, no "
                        "reduce-scatter of its gradient); the FSDP2 modes and no-comm are unchanged")
    p.add_argument("--in-graph-wrap", choices=sorted(KEEP_GATHERED), default=IN_GRAPH_WRAP,
                   help="how the in-graph modes shard (ce_overlap.fully_shard): torchtitan (default; as --fsdp2-wrap "
                        "torchtitan keeps them: [norm, output] by a call of their own, not resharded after forward, "
                        "gathered once per step) or blocks (each block, then the root holding embedding, norm and "
                        "output, every weight gathered again in the backward: results before 2026-11-28-b); the "
                        "prediction captures the same")
    p.add_argument("--trace-dir", default=None,
                   help="after each mode (GPU), write every rank's torch.profiler trace of 2 steps (CPU and GPU, Chrome "
                        "format, gzip) to DIR/trace-MODE.json.gz (rank 0) and DIR/trace-MODE-rankR.json.gz, for a "
                        "timeline")
    p.add_argument("--sync-every-step", action="store_true",
                   help="time each step on the host, synchronized before and after (the method of results before "
                        "2026-11-24; adds the host's launch latency to every step). Default: CUDA events between "
                        "step ends, no host wait inside the measured loop")
    p.add_argument("--gc", choices=["torchtitan", "python"], default="torchtitan",
                   help="Python's garbage collector in the step loop: torchtitan (default: off, a generation-1 "
                        f"collection before the first step and every {GC_FREQ} steps, torchtitan's GarbageCollection "
                        "at its default training.gc_freq) or python (automatic, Python's default: a full collection "
                        "over torch.compile's objects stalls the host ~0.5 s, and the GPU with it; 2026-11-28-b's "
                        "no-comm steps of 520-620 ms)")
    p.add_argument("--loss-reduce", choices=["end", "step"], default="end",
                   help="when the ranks' losses are averaged: end (default: one collective after the timed loop; "
                        "torchtitan reduces them only at its log steps) or step (an all-reduce on the side after "
                        "every step, the results before 2026-11-28-c)")
    p.add_argument("--memory-history", action="store_true",
                   help="record the allocator's history in every mode and report the live blocks grouped by the "
                        "line that allocated them (with that line of Inductor's generated code), at the mode's end and "
                        "at its peak of allocated memory (slows the host: not for step times)")
    p.add_argument("--same-process", action="store_true",
                   help="run every mode in this process (default on GPUs: each mode in a fresh process per rank, so "
                        "no mode inherits an earlier one's allocator cache, compiled code or library state; found "
                        "2026-11-24: a mode run after others reserved up to 7 GiB more at 8 layers on one H200)")
    p.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                   help="set an Inductor config field for every compiled mode (repeatable; VALUE is a Python literal),"
                        " e.g. reorder_for_peak_memory=False to compare compile with what ce_overlap's pass turns off")
    p.add_argument("--isolate", action="store_true", help="run each mode in its own process on CPU too (tests)")
    p.add_argument("--predict", action="store_true", help="print the cost model's predicted step time (captures "
                                                          "the same shape on CPU in a subprocess)")
    p.add_argument("--profile", default=None, help="cost model profile for --predict (default: from the GPU name)")
    p.add_argument("--out", default=None, help="JSON results file (rank 0)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cpu: gloo on CPU, for a smoke test of the harness only (no meaningful numbers)")
    p.add_argument("--predict-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tp < 1:
        p.error(f"--tp must be >= 1, got {args.tp}")
    if args.modes is None:
        args.modes = ",".join(_tp.MODES if args.tp > 1 else DEFAULT_MODES)
    bad = [m for m in args.modes.split(",") if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; known: {MODES}")
    wrong = [m for m in args.modes.split(",") if (m in _tp.MODES) != (args.tp > 1)]
    if wrong:
        p.error(f"mode(s) {wrong} need --tp {'> 1' if args.tp == 1 else '1'} (the TP modes {list(_tp.MODES)} run "
                "with --tp > 1 only, the others without it)")
    if args.kernel_profile < 0:
        p.error(f"--kernel-profile: steps must be >= 0 (0: off), got {args.kernel_profile}")
    if not (args.kernel_profile_lead_s >= 0 and math.isfinite(args.kernel_profile_lead_s)):
        p.error(f"--kernel-profile-lead-s: seconds must be >= 0 (0: no lead), got {args.kernel_profile_lead_s}")
    if args.lr_warmup_steps < 0:
        p.error(f"--lr-warmup-steps must be >= 0 (0: no warm-up), got {args.lr_warmup_steps}")
    try:
        inductor_config_items(args.inductor_config)
    except ValueError as e:
        p.error(str(e))
    return args


# The default: the wrap the FSDP2 modes use too; on 2x H200 the faster one for ce_overlap (125.2 -> 123.5 ms in one call,
# 0.5 GiB less allocated; bench/results/step-prediction-2026-11-28-b). A result that does not record its wrap ran
# "blocks" (IN_GRAPH_WRAP_BEFORE).
IN_GRAPH_WRAP = "torchtitan"


def build_model(cfg, mode: str, group, ce: str = "auto", wrap: str = "torchtitan", vocab_parallel: bool = False,
                in_graph_wrap: str = IN_GRAPH_WRAP, async_tp: bool = False):
    """The model of `mode` over `group` (a ("dp", "tp") DeviceMesh for the TP modes)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import ce_overlap
    from ce_overlap.models.llama import Llama, init_weights

    if without_ac(mode) in _tp.MODES:
        return _tp.build(cfg, without_ac(mode), group, DEVICE, ce, KEEP_GATHERED[in_graph_wrap], async_tp,
                         ac=mode.endswith(AC))
    if mode.startswith("fsdp2"):
        from lib import fsdp2 as _fsdp2

        return _fsdp2.build(cfg, without_ac(mode), DEVICE, ce, wrap, ac=mode.endswith(AC))
    torch.manual_seed(0)  # the same full weights on every rank and in every mode
    with torch.device(DEVICE):
        model = Llama(cfg)
    init_weights(model)
    if mode.endswith(AC):  # torchtitan's order: checkpoint_wrapper on each block, then sharding
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # the reduce-scatters in bf16 too (reduce_dtype None)
    for module in model.layers:
        ce_overlap.fully_shard(module, group, mp_policy=mp, _local_gather=mode == "no-comm")
    for path in KEEP_GATHERED[in_graph_wrap]:
        ce_overlap.fully_shard(model.get_submodule(path), group, mp_policy=mp, reshard_after_forward=False,
                               _local_gather=mode == "no-comm")
    ce_overlap.fully_shard(model, group, mp_policy=mp, vocab_parallel_embeddings=vocab_parallel,
                           _local_gather=mode == "no-comm")
    return model


def inductor_config():
    """torch._inductor.config (a function: the tests hand compile_options a torch without some option)."""
    import torch._inductor.config as ic

    return ic


def compile_options(mode: str, ce: str = "auto") -> dict | None:
    mode = without_ac(mode)
    if mode in ("eager", "compile", "no-comm"):
        return None
    if mode in ("compile+inductor-overlap", "compile+low-contention"):
        ic = inductor_config()
        # The configuration MEASURED.md found best on torch 2.11 (+5.2%). Adding Inductor's FX bucketing
        # (bucket_all_gathers_fx="only_fsdp", bucket_reduce_scatters_fx="all") gave NaN losses from step 1 with this
        # model on torch 2.11 (the first 2-GPU run, 2026-11-22: bench/results/HISTORY.md), so it is left off.
        if not hasattr(ic, "aten_distributed_optimizations"):
            raise RuntimeError(f"torch {torch.__version__} has no aten_distributed_optimizations (Inductor's overlap "
                               "scheduler)")
        opts = {"aten_distributed_optimizations.enable_overlap_scheduling": True}
        if mode == "compile+low-contention":
            # PyTorch's pass swaps overlapped FSDP all-gathers / reduce-scatters of >= 16 MiB per rank (its default)
            # for torch.ops.symm_mem's copy-engine variants; torch 2.11 lacks it, 2.14 has it.
            if not hasattr(ic.aten_distributed_optimizations, "enable_low_contention_collectives"):
                raise RuntimeError(f"torch {torch.__version__} has no aten_distributed_optimizations."
                                   "enable_low_contention_collectives (PyTorch's low-contention copy-engine pass)")
            opts["aten_distributed_optimizations.enable_low_contention_collectives"] = True
        return opts
    import ce_overlap

    if mode == "ce_overlap-packed":
        return ce_overlap.inductor_options(ce=ce, pack_ce_buckets=True)
    if mode == "ce_overlap-rs-kernel":
        return ce_overlap.inductor_options(ce=ce, ce_reduction="kernel")
    return ce_overlap.inductor_options(ce="off" if mode == "ce_overlap-nccl" else ce)


def batch_for(step: int, cfg, args, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens at `step`: its data-parallel rank's (the ranks of one TP group share them)."""
    g = torch.Generator(device="cpu").manual_seed(1000 * step + rank // args.tp)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
    tokens = tokens.to(DEVICE, non_blocking=True)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclasses.dataclass
class ModeResult:
    mode: str
    ok: bool = True
    error: str = ""
    step_ms: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    compile_s: float = 0.0
    peak_mem_gib: float = 0.0  # torch.cuda.max_memory_reserved (what torchtitan's log calls memory)
    peak_alloc_gib: float = 0.0  # max_memory_allocated: live tensors only, without the allocator's cached blocks
    ce_pool_gib: float = 0.0  # the CE runtime's symmetric pools (device memory outside torch's allocator), in peak_*
    memory: dict = dataclasses.field(default_factory=dict)  # reserved by stream and allocator counters (memory_report)
    median_ms: float = 0.0
    tps: float = 0.0
    tflops: float = 0.0
    mfu: float = 0.0
    kernels: dict = dataclasses.field(default_factory=dict)
    predicted_ms: float | None = None  # the cost model's step for this mode (--predict; ce_overlap.analyzer.step_model.MODES)
    # When (host epoch seconds) the timed steps and the kernel profile ran: bench/clocks.py reads the GPUs' clocks and
    # power sampled beside the run (bench/train_device.sh, CE_TRAIN_CLOCKS=1) in these windows.
    windows: dict = dataclasses.field(default_factory=dict)
    # Per timed step, the host's time to issue it and the part of that spent in Python's garbage collector (ms; rank
    # 0's): a host stall longer than the work queued ahead of the GPU idles the GPU. Per rank, its median step (ms).
    host_ms: list = dataclasses.field(default_factory=list)
    gc_ms: list = dataclasses.field(default_factory=list)
    step_ms_by_rank: list = dataclasses.field(default_factory=list)
    async_tp: bool = False  # a TP mode ran torch's async TP (bench/lib/tp.py)


def family_base_and_bound(mode: str) -> tuple[str, str]:
    """The baseline and the no-communication bound a mode is compared with: FSDP2 modes with fsdp2 and
    fsdp2-no-comm, the in-graph modes with compile and no-comm, the TP modes with fsdp2+tp and no-comm+tp."""
    if mode in _tp.MODES:
        return "fsdp2+tp", "no-comm+tp"
    return ("fsdp2", "fsdp2-no-comm") if mode.startswith("fsdp2") else ("compile", "no-comm")


def percentile(values: list, q: float) -> float:
    """The q-th percentile (nearest rank) of `values`; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def losses_agree(results: list, ulps: float = 1.0) -> tuple[bool, str]:
    """Whether every pair of modes' losses agree at every step within `ulps` bf16 spacings of the loss (2^-7
    relative: bf16 keeps 8 significant bits), and the worst step."""
    worst, where = 0.0, ""
    for i, a in enumerate(results):
        for b in results[i + 1:]:
            for step, (x, y) in enumerate(zip(a.losses, b.losses), 1):
                rel = abs(x - y) / (ulps * 2.0**-7 * max(abs(x), abs(y), 1e-30))
                if rel > worst:
                    worst, where = rel, f"step {step}, {a.mode} {x:.4f} vs {b.mode} {y:.4f}"
    return worst <= 1.0, f"worst {worst:.2f} of the tolerance at {where}" if where else "identical"


def forget_compiled_code() -> int:
    """torch._dynamo.reset(), and the compiled graphs Dynamo installed as globals of the compiled frames' modules
    (`__compiled_fn_*`, `__resume_at_*`), which reset() leaves in place. Each holds its graph, whose node metadata
    holds the module classes, and those of the model's modules hold the model (found with torch.nn.utils.parametrize's
    per-instance classes, whose properties closed over the instances): without this, every earlier mode's model (its
    fp32 parameters) stayed allocated in the later modes (found 2026-11-24: +10.4 GiB per earlier compiled mode at 8
    layers on one GPU). Returns the globals removed."""
    torch._dynamo.reset()
    removed = 0
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name in [k for k in namespace if isinstance(k, str) and k.startswith(("__compiled_fn", "__resume_at"))]:
            del namespace[name]
            removed += 1
    gc.collect()
    return removed


def inductor_config_items(items: list[str]) -> dict:
    """--inductor-config KEY=VALUE pairs as torch.compile options (VALUE a Python literal)."""
    import ast

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--inductor-config expects KEY=VALUE, got {item!r}")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"--inductor-config {key}: {value!r} is not a Python literal") from None
    return out


def finish_process_group() -> None:
    """Every rank reaches the end before any tears its process group down: rank 0 still prints and saves when the
    others are done, and a rank that destroyed its gloo group under a peer still using it aborted at exit once in CI
    ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def child_argv(args) -> list[str]:
    """The arguments that make a child run one mode exactly as this process would."""
    argv = ["--model", args.model, "--seq-len", str(args.seq_len), "--batch", str(args.batch), "--tp", str(args.tp),
            "--steps",
            str(args.steps), "--warmup", str(args.warmup), "--lr", repr(args.lr), "--lr-warmup-steps",
            str(args.lr_warmup_steps), "--gqa", args.gqa, "--kernel-profile", str(args.kernel_profile),
            "--kernel-profile-lead-s", str(args.kernel_profile_lead_s), "--ce", args.ce,
            "--device", args.device, "--fsdp2-wrap", args.fsdp2_wrap, "--in-graph-wrap", args.in_graph_wrap,
            "--gc", args.gc, "--loss-reduce", args.loss_reduce, "--same-process"]
    if args.layers:
        argv += ["--layers", str(args.layers)]
    for item in args.inductor_config:
        argv += ["--inductor-config", item]
    argv += ["--memory-history"] if args.memory_history else []
    argv += ["--sync-every-step"] if args.sync_every_step else []
    argv += ["--trace-dir", args.trace_dir] if args.trace_dir else []
    argv += ["--vocab-parallel-embeddings"] if args.vocab_parallel_embeddings else []
    return argv


def run_mode_in_child(mode: str, args, rank: int) -> ModeResult:
    """`mode` in a fresh process per rank, joined into a new process group on a port rank 0 picks: what the mode
    measures (memory above all) owes nothing to the modes before it. Rank 0's child writes the result, which every
    rank gets."""
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    out = os.path.join(tempfile.gettempdir(), f"ce_train_child_{os.getpid()}_{mode}.json")
    env = {**os.environ, "MASTER_PORT": str(port[0]), "CE_TRAIN_CHILD": "1"}
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID"):  # the child's rank 0 hosts its own store
        env.pop(k, None)
    cmd = [sys.executable, os.path.abspath(__file__), *child_argv(args), "--modes", mode, "--out", out]
    proc = subprocess.run(cmd, env=env)
    found = [None]
    if rank == 0:
        try:
            with open(out) as f:
                found[0] = json.load(f)["results"][0]
        except (OSError, ValueError, KeyError, IndexError):
            found[0] = dataclasses.asdict(ModeResult(mode, ok=False, error=f"the mode's process exited "
                                                                          f"{proc.returncode} without a result"))
        finally:
            if os.path.exists(out):
                os.remove(out)
    dist.broadcast_object_list(found, src=0)
    return ModeResult(**found[0])


def run_mode(mode: str, cfg, args, group, peak: float) -> ModeResult:
    res = ModeResult(mode)
    rank = dist.get_rank()
    forget_compiled_code()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    tp_mode = without_ac(mode) in _tp.MODES
    async_tp = False
    if tp_mode:
        async_tp, why_not = _tp.async_tp_for(without_ac(mode), group, DEVICE)
        if async_tp:
            _tp.enable_async_tp(group)
        log0(f"[{mode}] tensor parallelism over {args.tp} ranks, FSDP over {dist.get_world_size() // args.tp}; "
             + ("torch's async TP (micro-pipeline TP over symmetric memory)" if async_tp else
                f"TP on NCCL ({why_not})"))
        res.async_tp = async_tp
    model = build_model(cfg, mode, group, args.ce, args.fsdp2_wrap, args.vocab_parallel_embeddings,
                        args.in_graph_wrap, async_tp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=DEVICE == "cuda")
    step_fn = model
    if mode != "eager" and not mode.startswith("fsdp2"):  # FSDP2 modes compile their blocks themselves
        opts = _tp.compile_options(without_ac(mode), args.ce, async_tp) if tp_mode else compile_options(mode, args.ce)
        if args.inductor_config:
            opts = {**inductor_config_items(args.inductor_config), **(opts or {})}
        step_fn = torch.compile(model, options=opts) if opts else torch.compile(model)
    if without_ac(mode) in CE_MODES + ("ce_overlap+tp",):
        import ce_overlap.runtime as rt

        if rt.available():
            rt.rendezvous(group["dp"].get_group() if tp_mode else group)
    # Per GPU: the ranks of one TP group train on one data-parallel rank's tokens.
    tokens_per_step = args.batch * args.seq_len / args.tp
    flops_per_token = model.flops_per_token(args.seq_len)
    total_mem = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if DEVICE == "cuda" else 1
    # Every batch on the device before the timed loop: a copy from pageable host memory would synchronize the stream.
    batches = [batch_for(step, cfg, args, rank) for step in range(1, args.warmup + args.steps + 1)]
    if args.memory_history and DEVICE == "cuda":
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=1_000_000)
    # Timed on the GPU (default): an event at the end of every step; the host never waits for the GPU inside the
    # loop (losses are read afterwards, as torchtitan reads them only at its log steps), so host-side launch work
    # overlaps the previous step's kernels as in a real run. --sync-every-step: host time of a step synchronized
    # before and after (what results before 2026-11-24 used; it adds the host's launch latency to every step).
    on_gpu = DEVICE == "cuda" and not args.sync_every_step
    ends, losses_dev, host_s = [], [], []
    with step_loop_gc(args.gc) as gc_pauses:
        sync()
        start = torch.cuda.Event(enable_timing=True) if on_gpu else None
        if on_gpu:
            start.record()
        t_compile = time.perf_counter()
        timed_from = None
        for step, (tokens, labels) in enumerate(batches, 1):
            if step == args.warmup + 1:
                # The host runs ahead of the GPU by under a step: the window is the timed steps'.
                timed_from = time.time()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args)
            if not on_gpu:
                sync()
            t0 = time.perf_counter()
            gc_pauses.since = 0.0
            if args.gc == "torchtitan" and step > 1 and step % GC_FREQ == 0:
                gc.collect(1)
            loss = step_fn(tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if on_gpu:
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
            else:
                sync()
            host_s.append(time.perf_counter() - t0)
            if step > args.warmup:
                res.host_ms.append(round(1e3 * host_s[-1], 3))
                res.gc_ms.append(round(1e3 * gc_pauses.since, 3))
            if step == 1:
                sync()
                res.compile_s = time.perf_counter() - t_compile
            lv = loss.detach().float()
            if args.loss_reduce == "step":
                dist.all_reduce(lv, op=dist.ReduceOp.AVG)
            losses_dev.append(lv)
        if args.loss_reduce == "end":  # every step's loss averaged over the ranks in one collective after the loop
            stacked = torch.stack(losses_dev)
            dist.all_reduce(stacked, op=dist.ReduceOp.AVG)
            losses_dev = list(stacked)
        sync()
    res.windows["timed"] = [timed_from, time.time()]
    step_s = ([start.elapsed_time(ends[0]) / 1e3] + [a.elapsed_time(b) / 1e3 for a, b in zip(ends, ends[1:])]
              if on_gpu else host_s)
    step_s_max = torch.tensor(step_s, dtype=torch.float64, device=DEVICE)
    by_rank = [None] * dist.get_world_size()
    dist.all_gather_object(by_rank, round(1e3 * statistics.median(step_s[args.warmup:] or step_s), 3))
    res.step_ms_by_rank = by_rank
    dist.all_reduce(step_s_max, op=dist.ReduceOp.MAX)
    mem = torch.cuda.max_memory_reserved() if DEVICE == "cuda" else 0
    for step, (dt_max, lv) in enumerate(zip(step_s_max.tolist(), losses_dev), 1):
        loss_v = float(lv.item())
        res.losses.append(loss_v)
        tps = tokens_per_step / dt_max
        tflops = flops_per_token * tps / 1e12
        log0(f"[{mode}] step: {step:3d}  loss: {loss_v:8.4f}  memory: {mem / 2**30:5.2f}GiB"
             f"({100 * mem / total_mem:.2f}%)  tps: {tps:,.0f}  tflops: {tflops:.2f}  mfu: {100 * tflops / peak:.2f}%"
             + ("  (warm-up)" if step <= args.warmup else ""))
        if step > args.warmup:
            res.step_ms.append(1e3 * dt_max)
    if not all(math.isfinite(v) for v in res.losses):
        res.ok = False
        first = next(i for i, v in enumerate(res.losses, 1) if not math.isfinite(v))
        res.error = f"loss is not finite from step {first}: the mode computes garbage, its speed means nothing"
    if args.kernel_profile and DEVICE == "cuda" and res.ok:
        tokens, labels = batch_for(0, cfg, args, rank)  # made here: a pageable copy per step would sync the host

        def one_step():
            step_fn(tokens, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        t_profile = time.time()
        # After --kernel-profile-lead-s of steps back to back: the recorded steps run at the timed steps' clocks.
        lead = math.ceil(1e3 * args.kernel_profile_lead_s / statistics.median(res.step_ms)) if res.step_ms else 0
        res.kernels = profile_kernels(one_step, args.kernel_profile, lead=lead)
        res.kernels["lead_steps"] = lead
        res.windows["profiled"] = [t_profile, time.time()]
        # Every rank's kernel time: a synchronous step runs at the pace of its slowest GPU, which rank 0's profile
        # alone cannot show.
        mine = {k: res.kernels[k] for k in ("busy_ms", "wall_ms", "gpu_idle_ms", "compute_wait_ms", "by_class_ms",
                                            "clock")}
        by_rank = [None] * dist.get_world_size()
        dist.all_gather_object(by_rank, mine)
        res.kernels["by_rank"] = by_rank
        if args.trace_dir:
            path = export_trace(one_step, 2, args.trace_dir, mode, rank)
            log0(f"[{mode}] trace of 2 steps (rank 0; the other ranks' beside it): {path}")
        log0(f"[{mode}] kernels per step (ms, busy time by class): "
             + ", ".join(f"{k} {v:.1f}" for k, v in res.kernels["by_class_ms"].items())
             + f"; wall {res.kernels['wall_ms']:.1f} under the profiler, GPU idle {res.kernels['gpu_idle_ms']:.1f} "
               f"between {res.kernels['activities_per_step']:.0f} kernels and copies; longest: "
             + ", ".join(f"{g['us'] / 1e3:.2f} ms after {g['after'][:40]}" for g in res.kernels["largest_gaps"][:3]))
        log0(f"[{mode}] per rank, kernel busy / GEMM ms per step (SM MHz, W): "
             + ", ".join(rank_summary(r) for r in res.kernels["by_rank"]))
    res.median_ms = statistics.median(res.step_ms)
    if res.host_ms:
        log0(f"[{mode}] host per timed step (rank 0, gc {args.gc}): median {statistics.median(res.host_ms):.1f} ms, "
             f"max {max(res.host_ms):.1f}; in the garbage collector {sum(res.gc_ms):.1f} ms over {len(res.gc_ms)} "
             f"steps (max {max(res.gc_ms):.1f}); median step per rank "
             + ", ".join(f"{v:.1f}" for v in res.step_ms_by_rank) + " ms")
    res.tps = tokens_per_step / (res.median_ms / 1e3)
    res.tflops = flops_per_token * res.tps / 1e12
    res.mfu = 100 * res.tflops / peak
    # The CE pools are device memory torch's allocator does not see: counted into both peaks, so a CE mode's memory
    # is comparable with NCCL's (whose own buffers, a few hundred MiB, stay uncounted: in the baseline's favour).
    res.ce_pool_gib = max_over_ranks(ce_pool_gib())
    res.peak_mem_gib = max_over_ranks(torch.cuda.max_memory_reserved() / 2**30 if DEVICE == "cuda" else 0.0) \
        + res.ce_pool_gib
    res.peak_alloc_gib = max_over_ranks(torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0) \
        + res.ce_pool_gib
    if DEVICE == "cuda":
        res.memory = memory_report()
        log0(f"[{mode}] memory (rank 0): reserved {res.memory['reserved_gib']:.1f} GiB, by stream "
             + ", ".join(f"{k} {v['reserved_gib']:.1f} ({v['segments']} segments)"
                         for k, v in res.memory["by_stream"].items())
             + f"; peak allocated {res.memory['allocated_peak_gib']:.1f}, active {res.memory['active_peak_gib']:.1f}"
             + f"; cudaMalloc calls {res.memory['device_allocs']}, retries {res.memory['alloc_retries']}"
             + (f"; CE ops: {res.memory['ce_stashed_tensors']} tensors stashed, "
                f"{res.memory['ce_reaped_unwaited']} unwaited reaped" if "ce_stashed_tensors" in res.memory else ""))
        if args.memory_history:
            gc.collect()
            res.memory["live_after_mode"] = live_blocks_by_site()
            res.memory["live_at_peak"] = live_at_peak_by_site()
            lp = res.memory["live_at_peak"]
            log0(f"[{mode}] at the peak of allocated memory ({lp['peak_gib']:.2f} GiB replayed, torch says "
                 f"{lp['torch_peak_gib']:.2f}; event {lp['peak_event']} of {lp['events']}):")
            for site in lp["sites"][:12]:
                log0(f"[{mode}]   peak {site['gib']:.2f} GiB in {site['blocks']} blocks from {site['site']}: "
                     f"{site['code'][:160]}")
            torch.cuda.memory._record_memory_history(enabled=None)
            for site in res.memory["live_after_mode"][:8]:
                log0(f"[{mode}]   live {site['gib']:.2f} GiB in {site['blocks']} blocks from {site['site']}")
    del step_fn, model, opt
    return res


def predict(args, world: int, profile: str) -> dict:
    """The cost model's step time for this shape: capture on CPU (fake tensors, fake process group) in a fresh
    process, then plan (ce_overlap's pass) or, before planning existed, analyze."""
    cmd = [sys.executable, os.path.abspath(__file__), "--predict-only", "--model", args.model,
           "--layers", str(args.layers or 0), "--seq-len", str(args.seq_len), "--batch", str(args.batch),
           "--tp", str(args.tp),
           "--gqa", args.gqa, "--profile", profile, "--in-graph-wrap", args.in_graph_wrap, "--fsdp2-wrap",
           args.fsdp2_wrap, "--out", "-"] + \
        (["--vocab-parallel-embeddings"] if args.vocab_parallel_embeddings else [])
    env = {**os.environ, "CE_OVERLAP_PREDICT_WORLD": str(world), "CUDA_VISIBLE_DEVICES": ""}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["predict_s"] = round(time.perf_counter() - t0, 1)
    return out


def predict_only(args) -> None:
    world = int(os.environ["CE_OVERLAP_PREDICT_WORLD"])
    pieces, step_ms = predict_steps(args, world, args.profile)
    print(json.dumps({**pieces, "step_ms": step_ms}))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.predict_only:
        predict_only(args)
        return 0
    global DEVICE
    DEVICE = args.device
    # The pass's one-line summary per compiled graph (buckets, CE, predicted exposed comm) goes to the log.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("ce_overlap").setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    modes = args.modes.split(",")
    isolate = (DEVICE == "cuda" or args.isolate) and not args.same_process and len(modes) > 1
    if DEVICE == "cuda" and not isolate:
        rank, world, _ = init()
    else:
        # A parent that runs each mode in its own process only coordinates them: a CPU group, and no CUDA context or
        # NCCL buffers of its own on the GPUs the modes measure (on 2x H100 they held 1.43 GiB of each GPU beside
        # every mode; bench/results/step-prediction-2026-11-27-d). header() reads the device's properties without
        # making it current.
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if DEVICE == "cuda":
        info = header("ce_overlap training benchmark (bench/train.py)")
    else:
        info = {"gpu": "cpu", "world_size": world, "torch": torch.__version__, "command": " ".join(sys.argv)}
        log0("# ce_overlap training benchmark (bench/train.py) -- CPU smoke run, numbers mean nothing")
    # The TP modes' ("dp", "tp") mesh: in the process that runs them (a parent running each mode in its own process only
    # coordinates).
    group = _tp.make_mesh(DEVICE, world, args.tp) if args.tp > 1 and not isolate else dist.group.WORLD
    cfg = model_config(args)
    peak = peak_tflops(info["gpu"])
    log0(f"# model {args.model} widths, {cfg.n_layers} layers, seq {args.seq_len}, batch {args.batch}/"
         + (f"data-parallel rank, tensor parallelism over {args.tp} GPUs, " if args.tp > 1 else "GPU, ")
         + f"gqa={args.gqa}, {world} GPUs, peak {peak} TFLOP/s (torchtitan table), {args.steps} steps after "
         f"{args.warmup} warm-up; in-graph modes: {args.in_graph_wrap} wrap"
         f"{', vocabulary-parallel embeddings' if args.vocab_parallel_embeddings else ''}")
    results: list[ModeResult] = []

    def save(prediction=None):
        write_json(args.out, {"args": vars(args), "model": dataclasses.asdict(cfg), "peak_tflops": peak,
                              "results": [dataclasses.asdict(r) for r in results], "prediction": prediction,
                              "info": info})

    for mode in modes:
        log0(f"# === mode {mode}" + (" (in its own process)" if isolate else ""))
        try:
            results.append(run_mode_in_child(mode, args, rank) if isolate else run_mode(mode, cfg, args, group, peak))
        except Exception as e:  # noqa: BLE001 (a failing mode is reported; the others still run)
            _common.print_exc_rank()
            results.append(ModeResult(mode, ok=False, error=format_exc_line(e)))
            if not isolate:
                sync()
            dist.barrier()
        save()  # after every mode: a run cut short by its time limit keeps what it measured

    if os.environ.get("CE_TRAIN_CHILD") == "1":  # one mode for a parent run: it prints the table
        save()
        finish_process_group()
        return 0 if all(r.ok for r in results) else 1
    log0("")
    log0(f"{'mode':<26}{'step ms':>9}{'p90 ms':>8}{'host ms':>8}{'tok/s/GPU':>11}{'TFLOP/s':>9}{'MFU %':>7}{'vs base':>9}"
         f"{'gap recov.':>11}{'peak GiB':>9}{'alloc GiB':>10}{'loss':>9}{'compile s':>10}")
    for r in results:
        if not r.ok:
            log0(f"{r.mode:<26} FAILED: {r.error}")
            continue
        base_mode, bound_mode = family_base_and_bound(r.mode)
        base = next((b for b in results if b.mode == base_mode and b.ok), None)
        bound = next((b for b in results if b.mode == bound_mode and b.ok), None)
        vs = f"{100 * (r.tps / base.tps - 1):+.1f}%" if base else "-"
        gap = "-"
        if base and bound and bound.tps > base.tps:
            gap = f"{100 * (r.tps - base.tps) / (bound.tps - base.tps):.0f}%"
        host = f"{statistics.median(r.host_ms):8.1f}" if r.host_ms else f"{'-':>8}"
        log0(f"{r.mode:<26}{r.median_ms:9.1f}{percentile(r.step_ms, 90):8.1f}{host}{r.tps:11,.0f}{r.tflops:9.1f}"
             f"{r.mfu:7.1f}{vs:>9}{gap:>11}{r.peak_mem_gib:9.1f}{r.peak_alloc_gib:10.1f}{r.losses[-1]:9.4f}"
             f"{r.compile_s:10.1f}")
    log0("# host ms: rank 0's median time to issue a timed step (the GPU may still run the one before); "
         "vs base / gap recov.: the FSDP2 modes against fsdp2 and fsdp2-no-comm, the others against compile and "
         "no-comm; peak / alloc GiB: torch's peak reserved / allocated plus the CE pools (GiB: "
         + ", ".join(f"{r.mode} {r.ce_pool_gib:.2f}" for r in results if r.ok and r.ce_pool_gib) + ")")
    log_kernel_table(results)
    compiled = [r for r in results if r.ok and r.mode not in ("eager", "no-comm")]
    if len(compiled) > 1:
        worst = max(abs(a - b) for r in compiled for a, b in zip(r.losses, compiled[0].losses))
        log0(f"# largest per-step loss difference between compiled modes: {worst:.4g}")
        ok, why = losses_agree(compiled)
        log0(f"# compiled modes' losses within one bf16 spacing at every step: {'yes' if ok else 'NO'} ({why})")

    prediction = None
    if args.predict and rank == 0:
        from ce_overlap.profiles import DEFAULT, builtin_for_device  # noqa: PLC0415

        profile = args.profile or builtin_for_device(info["gpu"], default=DEFAULT)
        prediction = predict(args, world, profile)
        from ce_overlap.analyzer.step_model import MODES, TP_MODES  # noqa: PLC0415

        prediction.setdefault("step_ms", {})  # predict_steps' (absent where the prediction failed)
        log0(f"# the cost model's step (profile {profile}; ce_overlap.analyzer.step_model) beside the measured one:")
        for r in results:
            r.predicted_ms = prediction["step_ms"].get(r.mode)
            if r.ok and r.predicted_ms:
                log0(f"#   {r.mode:<26} predicted {r.predicted_ms:7.1f} ms, measured {r.median_ms:7.1f} ms "
                     f"({100 * (r.predicted_ms / r.median_ms - 1):+.1f}%; "
                     f"{MODES[r.mode][1] if r.mode in MODES else TP_MODES[r.mode][2]})")
            elif r.ok:
                log0(f"#   {r.mode:<26} not modelled")
        if not any(prediction["step_ms"].values()):
            log0(f"# prediction: {prediction}")
    save(prediction)
    finish_process_group()
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
