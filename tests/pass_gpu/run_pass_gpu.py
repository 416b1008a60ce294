"""GPU check of the ce_overlap graph pass on real NCCL: in-graph FSDP training with and without the pass.

    torchrun --standalone --nproc-per-node 2 tests/pass_gpu/run_pass_gpu.py
    torchrun --standalone --nproc-per-node 2 tests/pass_gpu/run_pass_gpu.py --models llama3-tiny --steps 3

Per model (llama3-tiny, llama3-1b; on request gpt2-tied: tests/data/gpt2_tied.py, whose output projection reuses the
token embedding, and titan-flex: tests/data/titan_llama.py, torchtitan's shape with flex attention; parameters
sharded over all ranks by ce_overlap.in_graph.fully_shard, bf16 gathers and bf16 reduce-scatters,
fp32 master shards, reshard after forward), the same seeded training run (--steps AdamW steps, fixed
synthetic tokens per rank and step) is compiled in these variants, one after another:

  inductor         torch.compile, no pass (the reference)
  pass-nccl        the pass with ce="off": our bucketing and reordering, NCCL only
  pass-on-nccl     the pass with ce="on" but ce_collectives=(): the CE plan's buckets and order, all on NCCL
  pass-ce-ag       ce="on", ce_collectives=("all_gather",): all-gathers on the CE runtime, reduce-scatters NCCL
  pass-ce-all      ce="on": all-gathers and reduce-scatters on CE (where the runtime has the op); a bucket of
                   several members is one multi-tensor CE op over the members' own tensors
  pass-ce-packed   pass-ce-all with pack_ce_buckets=True: the same buckets packed into one buffer (copy-in and
                   copy-out kernels) around the one-tensor CE ops
  pass-ce-rs-kernel  pass-ce-all with ce_reduction="kernel": CE reduce-scatters summed by the runtime's reduction
                   kernel instead of in the graph (pass-ce-all's default, ce_reduction="consumer")
  pass-auto        ce="auto" with the default 1 MiB min_ce_bytes (the planner keeps small buckets on the group's
                   backend): on NCCL it matches pass-on-nccl within tolerance; with the ranks sharing a GPU over gloo
                   it must run (every gloo all-gather moved to CE, saying why) and match pass-ce-all
  pass-no-runtime  ce="on" with the CE runtime made unavailable (ce_overlap.runtime.library_loaded patched
                   to fail, as when _runtime.so is missing): the pass must keep NCCL and say so once

Checks (PASS/FAIL table on rank 0, exit code 1 if any fails):
  * every pass variant rewrote both the forward and the backward graph (no refused plan);
  * pass-nccl and pass-on-nccl match inductor within tolerance (losses, gradients every step, parameters
    after the last step);
  * pass-ce-ag moved all-gather buckets (and no reduce-scatter bucket) to CE, and its losses, gradients
    and parameters are bit-identical to pass-on-nccl (same buckets and order; a CE all-gather copies bytes);
  * pass-ce-all moved reduce-scatter buckets to CE (or logged why not) and matches pass-on-nccl within
    tolerance (the reduction runs in a different kernel);
  * pass-ce-all sums its CE reduce-scatters in the graph (every such bucket is an unreduced CE op);
  * pass-ce-packed: the same CE buckets as pass-ce-all, and bit-identical to it (a multi-tensor CE op moves and
    reduces exactly the bytes of the packed one, and at two ranks the graph's fp32 sum rounded once is the
    reduction kernel's; with more ranks the sum's order differs: tolerance);
  * pass-ce-rs-kernel: the same CE buckets, no unreduced op, and bit-identical to pass-ce-all at two ranks
    (tolerance with more);
  * pass-no-runtime has no CE op, logged "CE runtime unavailable (...): keeping NCCL" exactly once, and
    is bit-identical to pass-on-nccl.
A check whose reference variant was not asked for is skipped (said in the log), not failed.

Tensor parallelism (--tp T, the zoo Llamas): a ("dp", "tp") mesh of world / T x T ranks, the model parallelized over
"tp" with torchtitan's plan, then sharded over "dp"; tokens per data-parallel rank. Each TP collective must stay a
bucket of its own, on the group's backend, where the plan keeps it (checked). On one shared GPU the default group is
"cpu:gloo,cuda:ce_overlap" (the torch.distributed backend of ce_overlap: every in-graph collective the pass leaves on
the group's backend runs on copy engines through it, its all-reduces on gloo), so the reference (inductor) runs
there too, and the variants are inductor, pass-on-nccl, pass-ce-all and pass-auto.

Across nodes (CE_OVERLAP_RANKS_PER_NODE=N: the ranks on simulated nodes of N): with --hsdp, FSDP's HSDP over a
("replicate", "shard") mesh of 2 x world / 2 (the shard groups inside a node may use copy engines, the replicas'
all-reduces stay on the group's backend, a bucket per block, issued after their reduce-scatters); without it, FSDP
over every rank, its group across the nodes: pass-ce-all (ce="on") runs every all-gather and reduce-scatter
hierarchically (the rail half on the group's backend, the node half on copy engines). On one shared GPU the default
group is then "cpu:gloo,cuda:ce_overlap" as with --tp (its backend binds hosts, not simulated nodes: the rail halves and
the replicas' all-reduces run on it), and the variants are inductor, pass-on-nccl, pass-ce-all and pass-auto.

One GPU (--shared-gpu, or CE_TEST_SHARED_GPU=1): every rank on GPU 0 over gloo (NCCL refuses two ranks on one GPU).
Only the variants that put every collective on CE can run there (gloo's in-graph collectives on CUDA tensors do not
work in torch 2.11), so the default variants are pass-ce-all,pass-ce-packed: real CUDA, real Inductor code, the
runtime's IPC copies and reduction kernel; no NVLink and no NCCL reference.

Tolerance: |loss - ref| <= 1e-3 * max(1, |ref|); per-tensor relative L2 error <= 1e-2 for gradients and
1e-3 for parameters, over all steps (the first step's gradient error, before AdamW amplifies anything, is printed
too). Two bf16 reduce-scatters that sum in different orders (gloo vs CE at 3 or more ranks) differ by up to half a
bf16 ulp in the first step, which AdamW can amplify past these bounds where a true gradient is zero (gpt2-tied's
attention key bias): bench/results/runtime-2026-11-25-h200. Deterministic algorithms are on
(torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG, Inductor deterministic): without them attention
backward is nondeterministic and no two runs of the same graph are bit-identical.

Results go to $OUT/pass_gpu.json (or --out) when set.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import logging
import math
import os
import sys
import time
import traceback
from datetime import timedelta

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never multicast on the lent machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: reduce_tolerances
from reduce_tolerances import tolerances  # noqa: E402

import ce_overlap  # noqa: E402
import ce_overlap.nodes as nodes  # noqa: E402
import ce_overlap.runtime as rt  # noqa: E402
from ce_overlap import logs  # noqa: E402
from ce_overlap.in_graph.fully_shard import fully_shard  # noqa: E402
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama  # noqa: E402

VARIANTS = {
    "inductor": None,
    "pass-nccl": dict(ce="off"),
    "pass-on-nccl": dict(ce="on", ce_collectives=()),
    "pass-ce-ag": dict(ce="on", ce_collectives=("all_gather",)),
    "pass-ce-all": dict(ce="on"),
    "pass-ce-packed": dict(ce="on", pack_ce_buckets=True),
    "pass-ce-rs-kernel": dict(ce="on", ce_reduction="kernel"),
    "pass-no-runtime": dict(ce="on"),
    "pass-auto": dict(ce="auto", min_ce_bytes=1 << 20),
    # With --tp: the same with torch's async TP (micro-pipeline TP over symmetric memory on the TP group). Where torch
    # or the machine refuses it, the variant says why (a "refused" line, not a failure): what async TP needs.
    "inductor+async-tp": None,
    "pass-ce-all+async-tp": dict(ce="on"),
}
ASYNC_TP = "+async-tp"
# Variants that run every collective on CE (the only ones a shared GPU can run: no NCCL there). pass-auto is one there:
# the planner keeps small buckets on the group's backend, but on gloo with CUDA tensors the pass moves them to CE
# (gloo's in-graph all-gather on CUDA tensors crashes the process) or stops the compile with an error.
ALL_CE = ("pass-ce-all", "pass-ce-packed", "pass-ce-rs-kernel", "pass-auto")
SHARED_GPU = os.environ.get("CE_TEST_SHARED_GPU") == "1"
# --tp > 1: the ("dp", "tp") mesh, and the variants one shared GPU runs with ce_overlap's backend underneath.
TP, MESH = 1, None
TP_SHARED_VARIANTS = ("inductor", "pass-on-nccl", "pass-ce-all", "pass-auto", "inductor+async-tp",
                      "pass-ce-all+async-tp")
# --hsdp, and ranks on simulated nodes (CE_OVERLAP_RANKS_PER_NODE): ce_overlap's backend underneath on a shared GPU.
HSDP = False
SIMULATED = nodes.ranks_per_node() is not None
NODES_SHARED_VARIANTS = ("inductor", "pass-on-nccl", "pass-ce-all", "pass-auto")


def backend_underneath() -> bool:
    """Whether ce_overlap's torch.distributed backend runs what the plan leaves to the groups (a shared GPU with TP,
    HSDP or simulated nodes): the inductor reference runs there too."""
    return SHARED_GPU and (TP > 1 or HSDP or SIMULATED)
# Besides the zoo's Llamas: tests/data/gpt2_tied.py, a GPT-2-style model whose output projection reuses the token
# embedding's weight (its forward all-gather is waited on again in the backward) and whose forward returns
# (loss, logits); its vocabulary (1001) does not divide by the ranks, so the tied shard is padded.
GPT2_TIED = "gpt2-tied"
# tests/data/titan_llama.py: a Llama in torchtitan's shape (flex attention with a causal block mask, complex RoPE,
# grouped-query attention), the loss computed around it; its own sequence length (TitanConfig's: 4 x 4 tiles of 128).
TITAN_FLEX = "titan-flex"
DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data")  # imported on request


def _data_module(name: str):
    """tests/data/NAME.py, imported (the models besides the zoo's live there)."""
    if DATA_DIR not in sys.path:
        sys.path.insert(0, DATA_DIR)
    return importlib.import_module(name)


def default_seq_len(model_name: str) -> int:
    """The sequence length a model runs at without --seq-len."""
    if model_name == TITAN_FLEX:
        return _data_module("titan_llama").TitanConfig().seq_len
    return 128 if model_name in ("llama3-tiny", GPT2_TIED) else 2048


def build_model(model_name: str, args):
    """(model on the GPU, vocab size, sequence length) of a zoo Llama, gpt2-tied or titan-flex, with --seq-len /
    --layers."""
    if model_name == TITAN_FLEX:
        titan_llama = _data_module("titan_llama")
        cfg = titan_llama.TitanConfig()
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len or cfg.seq_len, n_layers=args.layers or cfg.n_layers)
        with torch.device("cuda"):
            return titan_llama.WithLoss(cfg), cfg.vocab_size, cfg.seq_len
    if model_name == GPT2_TIED:
        gpt2_tied = _data_module("gpt2_tied")
        cfg = gpt2_tied.Gpt2Config()
        seq = args.seq_len or cfg.seq_len
        cfg = dataclasses.replace(cfg, seq_len=seq, n_ctx=max(cfg.n_ctx, seq), n_layers=args.layers or cfg.n_layers)
        with torch.device("cuda"):
            model = gpt2_tied.Gpt2(cfg)
        # GPT-2's initialization (normal, std 0.02; zero biases), not PyTorch's N(0, 1) embeddings: with the output
        # projection tied to them, those make logits of magnitude ~dim and a loss near 87 where Adam amplifies any
        # reduction-order difference into a different trajectory within three steps.
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)
        return model, cfg.vocab_size, cfg.seq_len
    cfg = LLAMA_CONFIGS[model_name]
    if args.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len)
    if args.layers:
        cfg = dataclasses.replace(cfg, n_layers=args.layers)
    with torch.device("cuda"):
        return Llama(cfg), cfg.vocab_size, cfg.seq_len


def log0(msg: str = "") -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def runtime_absent(active: bool):
    """ce_overlap.runtime.library_loaded() fails, as when _runtime.so is missing."""
    if not active:
        yield
        return
    saved = rt.library_loaded
    rt.library_loaded = lambda: rt.Availability(False, "simulated by run_pass_gpu.py: _runtime.so not loadable")
    logs.forget_said()
    try:
        yield
    finally:
        rt.library_loaded = saved


def compile_options(variant: str, args) -> dict | None:
    fields = VARIANTS[variant]
    extra = {"deterministic": True} if "deterministic" in torch._inductor.config.get_config_copy() else {}
    if variant.endswith(ASYNC_TP):
        extra["_micro_pipeline_tp"] = True
    if fields is None:
        return extra
    opts = ce_overlap.inductor_options(**{"bucket_cap_mb": args.bucket_cap_mb, "min_ce_bytes": 0,
                                          "verbose": args.verbose, **fields})
    return {**opts, **extra}


class AsyncTpRefused(RuntimeError):
    """torch's async TP could not be set up here (symmetric memory on the TP group)."""


def enable_async_tp() -> None:
    """Symmetric memory on the TP group, and a rendezvous of it, as micro-pipeline TP's fused ops need: raises
    AsyncTpRefused with torch's own error where it cannot."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        name = MESH["tp"].get_group().group_name
        symm_mem.enable_symm_mem_for_group(name)
        buf = symm_mem.empty(1024, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(buf, name)
    except Exception as e:  # noqa: BLE001 (whatever torch raises is the answer)
        raise AsyncTpRefused(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or gradient (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, torch.distributed.tensor.DTensor) else t


def run_variant(model_name: str, variant: str, args) -> dict:
    rank = dist.get_rank()
    torch._dynamo.reset()
    torch.manual_seed(1234)
    model, vocab_size, seq_len = build_model(model_name, args)
    over = dist.group.WORLD
    if TP > 1:
        from ce_overlap.models.llama import Llama as _Llama, tensor_parallel

        if not isinstance(model, _Llama):
            raise ValueError(f"--tp: {model_name} has no tensor-parallel plan here (the zoo Llamas do)")
        tensor_parallel(model, MESH["tp"])
        over = MESH["dp"]
    elif HSDP:
        over = MESH
    fully_shard(model, over, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                vocab_parallel_embeddings=args.vocab_parallel_embeddings)
    if rt.available():  # the groups copy engines serve: HSDP's shard group, a group across nodes' node groups
        from ce_overlap.runtime import hierarchical

        h = hierarchical.lookup(dist.group.WORLD.group_name) if not HSDP and TP == 1 else None
        for g in ([MESH["shard"].get_group()] if HSDP else []) + ([h.node] if h is not None else []):
            rt.rendezvous(g)
    if variant.endswith(ASYNC_TP):
        if TP == 1:
            raise ValueError(f"{variant} needs --tp > 1")
        enable_async_tp()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    opts = compile_options(variant, args)
    compiled = torch.compile(model, options=opts, fullgraph=True)
    handler = _Collect()
    logger = logging.getLogger("ce_overlap")
    logger.addHandler(handler)
    old_level, old_propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = args.verbose  # the summary lines are printed below; --verbose prints every log line
    gen = torch.Generator(device="cuda")
    out = {"losses": [], "grads": [], "step_s": []}
    t0 = time.perf_counter()
    try:
        with runtime_absent(variant == "pass-no-runtime"):
            for step in range(args.steps):
                gen.manual_seed(1000 * step + rank // TP)  # the ranks of one TP group share their tokens
                tokens = torch.randint(0, vocab_size, (args.batch, seq_len), device="cuda", generator=gen)
                torch.cuda.synchronize()
                s0 = time.perf_counter()
                # The Llamas predict the input tokens (as every earlier run of this harness); gpt2-tied predicts the
                # next token: with the output projection tied to the embedding, predicting its own input token is
                # trivial (loss ~0, gradients ~0) and would check nothing.
                targets = tokens.roll(-1, dims=1) if model_name == GPT2_TIED else tokens
                loss = compiled(tokens, targets)
                loss = loss[0] if isinstance(loss, tuple) else loss  # gpt2-tied returns (loss, logits)
                loss.backward()
                torch.cuda.synchronize()
                out["step_s"].append(time.perf_counter() - s0)
                out["losses"].append(loss.detach().double().item())
                out["grads"].append([_local(p.grad).detach().clone() for p in params])  # on the GPU: fast to compare
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logger.propagate = old_propagate
    torch.cuda.synchronize()
    out["seconds"] = time.perf_counter() - t0
    out["params"] = [_local(p).detach().clone() for p in params]
    out["param_names"] = [n for n, _ in named]
    out["messages"] = handler.messages
    reports = opts["post_grad_custom_post_pass"].reports if opts and "post_grad_custom_post_pass" in opts else []
    out["reports"] = [{"graph": r.graph, "refused": r.refused, "collectives": r.collectives,
                       "buckets": [{"type": b.type, "members": b.members, "bytes": b.bytes, "backend": b.backend,
                                    "tp": b.role == "tp", "role": b.role,
                                    "planned": b.planned_backend, "reason": b.reason,
                                    "unreduced": any(n.endswith("_reduce_scatter_unreduced") for n in b.nodes)}
                                   for b in r.buckets],
                       "summary": r.summary, "line": r.line(), "async_tp_ops": r.async_tp_ops} for r in reports]
    del compiled, model, opt
    torch.cuda.empty_cache()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def compare(x: dict, ref: dict) -> dict:
    """Max errors over this rank's shards, all-reduced (max) over ranks; where the largest gradient error is
    (step, parameter) and how many gradient tensors differ at all, per step (rank 0's view)."""
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(x["losses"], ref["losses"]))
    per = [[_rel(a, b) for a, b in zip(ga, gb)] for ga, gb in zip(x["grads"], ref["grads"])]
    grad_err = max(e for step in per for e in step)
    grad_err_first = max(per[0], default=0.0)  # before any optimizer step: the collectives' own difference
    i_first = max(range(len(per[0])), key=lambda i: per[0][i], default=0)
    worst = max(((e, s, i) for s, step in enumerate(per) for i, e in enumerate(step)), default=(0.0, 0, 0))
    names = x.get("param_names") or []
    where = {"step": worst[1] + 1, "param": names[worst[2]] if worst[2] < len(names) else worst[2],
             "differing_per_step": [sum(not torch.equal(a, b) for a, b in zip(ga, gb))
                                    for ga, gb in zip(x["grads"], ref["grads"])],
             "first_step_worst": {"param": names[i_first] if i_first < len(names) else i_first,
                                  "ref_norm": ref["grads"][0][i_first].float().norm().item() if per[0] else 0.0,
                                  "all_grads_norm": math.sqrt(sum(g.float().norm().item() ** 2
                                                                  for g in ref["grads"][0]))}}
    param_err = max(_rel(a, b) for a, b in zip(x["params"], ref["params"]))
    identical = float(all(a == b for a, b in zip(x["losses"], ref["losses"]))
                      and all(torch.equal(a, b) for ga, gb in zip(x["grads"], ref["grads"]) for a, b in zip(ga, gb))
                      and all(torch.equal(a, b) for a, b in zip(x["params"], ref["params"])))
    t = torch.tensor([loss_err, grad_err, param_err, 1.0 - identical, grad_err_first], dtype=torch.float64,
                     device="cpu" if SHARED_GPU else "cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"loss_err": t[0].item(), "grad_err": t[1].item(), "param_err": t[2].item(), "identical": t[3].item() == 0,
            "grad_err_first_step": t[4].item(),
            "worst_grad_rank0": where}


def ce_counts(res: dict) -> dict:
    counts = {"all_gather": 0, "reduce_scatter": 0, "multi_member": 0, "unreduced": 0, "hier": 0}
    for r in res["reports"]:
        for b in r["buckets"]:
            counts["hier"] += b["backend"] == "hier"
            if b["backend"] == "ce" and b["type"] in counts:
                counts[b["type"]] += 1
                counts["multi_member"] += b["members"] > 1
                counts["unreduced"] += b["unreduced"]
    return counts


def main(argv=None) -> int:
    global SHARED_GPU, TP, MESH, HSDP
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama3-tiny,llama3-1b", help=f"zoo Llamas, {GPT2_TIED} and {TITAN_FLEX}")
    p.add_argument("--variants", default=",".join(VARIANTS), help="subset of: " + ", ".join(VARIANTS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"default: 128 for llama3-tiny and {GPT2_TIED}, {TITAN_FLEX}'s own (512), 2048 otherwise")
    p.add_argument("--layers", type=int, default=None, help="override the number of transformer blocks")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--bucket-cap-mb", type=float, default=4096.0)
    p.add_argument("--verbose", action="store_true", help="log every bucket decision")
    p.add_argument("--vocab-parallel-embeddings", action="store_true",
                   help="every variant shards with vocab_parallel_embeddings=True (the token embedding looked up on "
                        "its row shards: a token all-gather and a forward reduce-scatter instead of the table's)")
    p.add_argument("--shared-gpu", action="store_true", default=SHARED_GPU,
                   help="every rank on GPU 0 over gloo (default: CE_TEST_SHARED_GPU=1, or more local ranks than GPUs); "
                        "all-CE variants only")
    p.add_argument("--out", default=None, help="JSON results (default: $OUT/pass_gpu.json when OUT is set)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism over this many ranks (a ('dp', 'tp') mesh)")
    p.add_argument("--hsdp", action="store_true", help="HSDP over a ('replicate', 'shard') mesh of 2 x world / 2")
    args = p.parse_args(argv)
    TP, HSDP = args.tp, args.hsdp

    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    SHARED_GPU = args.shared_gpu or ranks_here > torch.cuda.device_count()  # more ranks than GPUs: share GPU 0
    if backend_underneath():  # ce_overlap's backend under every in-graph collective the pass leaves to the group
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(TP_SHARED_VARIANTS if TP > 1 else NODES_SHARED_VARIANTS)
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:ce_overlap", timeout=timedelta(seconds=600))
    elif SHARED_GPU:
        if args.variants == ",".join(VARIANTS):
            args.variants = ",".join(ALL_CE)
        needs_nccl = [v for v in args.variants.split(",") if v and v not in ALL_CE]
        if needs_nccl:
            raise SystemExit(f"--shared-gpu runs only the all-CE variants {list(ALL_CE)}; {needs_nccl} need NCCL")
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=600))
    # Bit-exact comparisons need a deterministic step: cuDNN and flash attention backward are
    # nondeterministic unless deterministic algorithms are on without warn_only.
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch._inductor.config.fx_graph_cache = False  # every variant must run the pass (its reports are checked)
    torch._functorch.config.enable_autograd_cache = False
    if dist.get_rank() == 0:
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        if args.verbose:
            logging.getLogger("ce_overlap").setLevel(logging.INFO)

    if HSDP:
        from torch.distributed.device_mesh import init_device_mesh

        MESH = init_device_mesh("cuda", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
        log0(f"HSDP: 2 replicas x {dist.get_world_size() // 2} shards")
    if SIMULATED:
        log0(f"nodes: {nodes.describe(dist.group.WORLD)}")
    if TP > 1:
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % TP:
            raise SystemExit(f"--tp {TP} must divide the {world} ranks")
        MESH = init_device_mesh("cuda", (world // TP, TP), mesh_dim_names=("dp", "tp"))
        log0(f"tensor parallelism over {TP} ranks, FSDP over {world // TP}"
             + (" (ce_overlap's torch.distributed backend for CUDA tensors)" if SHARED_GPU else ""))
    avail = rt.available()
    log0(f"torch {torch.__version__}, {dist.get_world_size()} ranks on "
         f"{'one shared ' if SHARED_GPU else ''}{torch.cuda.get_device_name()}, CE runtime: {avail.reason}")
    if avail and nodes.count(dist.group.WORLD) == 1:
        rt.rendezvous(dist.group.WORLD)  # CE ops need the group's pool before the first compiled step
        ops = [n for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_into_tensors",
                           "reduce_scatter_tensors") if hasattr(torch.ops.ce_overlap, n)]
        log0(f"CE ops: {ops}")

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    rows: list[dict] = []
    results: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                     "world_size": dist.get_world_size(), "shared_gpu": SHARED_GPU, "runtime": avail.reason,
                     "models": {}}

    def check(model: str, name: str, ok: bool, detail: str) -> None:
        rows.append({"model": model, "check": name, "ok": bool(ok), "detail": detail})
        log0(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    for model in [m for m in args.models.split(",") if m]:
        seq = args.seq_len or default_seq_len(model)
        margs = argparse.Namespace(**{**vars(args), "seq_len": seq})
        log0(f"== {model} (seq {seq}, {args.steps} steps, variants {', '.join(variants)})")
        ran: dict[str, dict] = {}
        summary: dict = {}
        for v in variants:
            try:
                res = run_variant(model, v, margs)
            except AsyncTpRefused as e:  # what async TP needs and this machine lacks: said, not failed
                log0(f"  refused  {v}: torch's async TP cannot run here: {e}")
                results.setdefault("refused", {})[v] = str(e)
                continue
            except Exception as e:  # noqa: BLE001 (a failing variant is a FAIL row, the others still run)
                traceback.print_exc()
                check(model, f"{v} runs", False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            ran[v] = res
            counts = ce_counts(res)
            summary[v] = {"losses": res["losses"], "seconds": round(res["seconds"], 2),
                          "step_s": [round(s, 4) for s in res["step_s"]], "ce_buckets": counts,
                          "reports": res["reports"],
                          "messages": [m for m in res["messages"] if "CE runtime unavailable" in m
                                       or "stay on NCCL" in m or "refused" in m]}
            log0(f"  {v}: {res['seconds']:.1f} s (compile + {args.steps} steps), losses "
                 f"{', '.join(f'{x:.6f}' for x in res['losses'])}, CE buckets {counts}")
            # Graphs without collectives (flex attention's score and mask functions, which Inductor compiles as
            # graphs of their own) are left as they are: counted, not listed.
            quiet = [r for r in res["reports"] if not r["collectives"] and not r["refused"]]
            for r in res["reports"]:
                if r not in quiet:
                    log0(f"    {r['line']}")
            if quiet:
                log0(f"    ({len(quiet)} graphs without collectives, unchanged)")
            if VARIANTS[v] is not None and TP > 1:
                tp_buckets = [b for r in res["reports"] for b in r["buckets"] if b["tp"]]
                check(model, f"{v}: every TP collective a bucket of its own, left on the group's backend",
                      tp_buckets and all(b["members"] == 1 and b["backend"] == "nccl" for b in tp_buckets),
                      f"{len(tp_buckets)} TP buckets, backends {sorted({b['backend'] for b in tp_buckets})}")
            if VARIANTS[v] is not None:
                graphs = sorted(r["graph"] for r in res["reports"] if r not in quiet and not r["refused"])
                refused = [r["refused"] for r in res["reports"] if r["refused"]]
                check(model, f"{v}: pass rewrote forward and backward",
                      graphs == ["backward", "forward"] and not refused,
                      f"rewritten: {graphs}" + (f"; refused: {refused}" if refused else ""))

            def against(ref: str, name: str, exact: bool, order_differs: bool = False):
                # The variants reduce in bf16 (param_dtype bf16, no reduce_dtype). Where a copy-engine reduce-scatter
                # meets another backend's (order_differs), beyond 2 ranks the sums' order differs and bf16's bounds
                # hold (tests/reduce_tolerances.py); otherwise fp32's.
                if ref not in variants:
                    log0(f"  skipped  {name}: reference {ref} not asked for")
                    return
                if ref not in ran:
                    check(model, name, False, f"reference {ref} did not run")
                    return
                c = compare(res, ran[ref])
                summary[v][f"vs_{ref}"] = c
                detail = (f"loss err {c['loss_err']:.2e}, grad rel err {c['grad_err']:.2e} (first step "
                          f"{c['grad_err_first_step']:.2e}), "
                          f"param rel err {c['param_err']:.2e}, bit-identical: {c['identical']}")
                if not c["identical"]:
                    detail += f" (rank 0: {c['worst_grad_rank0']})"
                loss_tol, grad_tol, param_tol = tolerances(torch.bfloat16 if order_differs else torch.float32,
                                                           dist.get_world_size())
                ok = c["identical"] if exact else (c["loss_err"] <= loss_tol and c["grad_err"] <= grad_tol
                                                   and c["param_err"] <= param_tol)
                check(model, name, ok, detail)

            if v in ("pass-nccl", "pass-on-nccl"):
                against("inductor", f"{v} matches inductor (tolerance)", exact=False)
            elif v == "pass-ce-ag":
                check(model, "pass-ce-ag: all-gathers on CE, reduce-scatters on NCCL",
                      counts["all_gather"] > 0 and counts["reduce_scatter"] == 0, f"CE buckets {counts}")
                against("pass-on-nccl", "pass-ce-ag bit-identical to pass-on-nccl", exact=True)
            elif v == "pass-ce-all" and SIMULATED and TP == 1 and not HSDP:  # across nodes: hierarchical, not CE
                spans = [b for r in res["reports"] for b in r["buckets"]
                         if b["type"] in ("all_gather", "reduce_scatter")]
                check(model, "pass-ce-all: every all-gather and reduce-scatter across the nodes hierarchical",
                      spans and all(b["backend"] == "hier" for b in spans),
                      f"{counts['hier']} hierarchical of {len(spans)}; "
                      f"{sorted({b['reason'][:80] for b in spans if b['backend'] != 'hier'})}")
                against("pass-on-nccl", "pass-ce-all matches pass-on-nccl (tolerance)", exact=False, order_differs=True)
                if backend_underneath():
                    against("inductor", "pass-ce-all matches inductor, the reference (tolerance)", exact=False,
                            order_differs=True)
            elif v == "pass-ce-all":
                rs_op = hasattr(torch.ops.ce_overlap, "reduce_scatter_tensor") if avail else False
                why = [m for m in res["messages"] if "reduce_scatter buckets stay on NCCL" in m]
                check(model, "pass-ce-all: reduce-scatters on CE (or the reason they are not)",
                      counts["reduce_scatter"] > 0 if rs_op else bool(why), f"CE buckets {counts}; {why or ''}")
                unreduced_op = avail and hasattr(torch.ops.ce_overlap, "reduce_scatter_tensors_unreduced")
                if unreduced_op:
                    check(model, "pass-ce-all: CE reduce-scatters summed in the graph (unreduced op)",
                          counts["unreduced"] == counts["reduce_scatter"] > 0, f"CE buckets {counts}")
                against("pass-on-nccl", "pass-ce-all matches pass-on-nccl (tolerance)", exact=False, order_differs=True)
                if backend_underneath():
                    against("inductor", "pass-ce-all matches inductor, the reference (tolerance)", exact=False,
                            order_differs=True)
                if HSDP:
                    reps = [b for r in res["reports"] for b in r["buckets"] if b["role"] == "replicate"]
                    check(model, "pass-ce-all: the replicas' all-reduces on the group's backend, a bucket per block",
                          reps and all(b["backend"] == "nccl" for b in reps) and
                          sum(b["members"] > 1 for b in reps) > 0,
                          f"{len(reps)} replica buckets, {sum(b['members'] for b in reps)} all-reduces, backends "
                          f"{sorted({b['backend'] for b in reps})}")

            elif v in ("pass-ce-packed", "pass-ce-rs-kernel"):
                two = dist.get_world_size() == 2
                if "pass-ce-all" in ran:
                    theirs = summary["pass-ce-all"]["ce_buckets"]
                    same = {k: n for k, n in theirs.items() if k != "unreduced"} == \
                        {k: n for k, n in counts.items() if k != "unreduced"}
                    check(model, f"{v}: the same CE buckets as pass-ce-all, reduced by the runtime",
                          same and counts["multi_member"] > 0 and counts["unreduced"] == 0,
                          f"CE buckets {counts} vs {theirs}")
                what = "multi-tensor vs packed" if v == "pass-ce-packed" else "sum in the graph vs reduction kernel"
                against("pass-ce-all", f"{v} {'bit-identical to' if two else 'matches'} pass-ce-all ({what})",
                        exact=two, order_differs=True)
            elif v.endswith(ASYNC_TP):
                if VARIANTS[v] is not None:  # the pass saw torch's fused ops in the graphs it planned
                    fused = sum(r["async_tp_ops"] for r in res["reports"])
                    check(model, f"{v}: the pass planned beside torch's micro-pipeline TP fused ops", fused > 0,
                          f"{fused} symm_mem fused ops")
                against("inductor", f"{v} matches inductor (tolerance)", exact=False, order_differs=True)
            elif v == "pass-auto" and backend_underneath():  # ce_overlap's backend under what the plan leaves
                against("inductor", "pass-auto matches inductor (tolerance)", exact=False, order_differs=True)
            elif v == "pass-auto":
                if SHARED_GPU:  # gloo underneath: nothing may stay on it
                    forced = [b for r in res["reports"] for b in r["buckets"]
                              if b["planned"] != "ce" and b["backend"] == "ce" and "gloo" in b["reason"]]
                    left = [b for r in res["reports"] for b in r["buckets"] if b["backend"] != "ce"
                            and b["type"] == "all_gather"]
                    check(model, "pass-auto on gloo: every all-gather on CE (the planner's NCCL ones moved, saying why)",
                          not left, f"{len(forced)} bucket(s) moved off gloo; left on gloo: {left}")
                    against("pass-ce-all", "pass-auto matches pass-ce-all (tolerance)", exact=False, order_differs=True)
                else:
                    against("pass-on-nccl", "pass-auto matches pass-on-nccl (tolerance)", exact=False, order_differs=True)
            elif v == "pass-no-runtime":
                unavailable = [m for m in res["messages"] if "CE runtime unavailable" in m]
                check(model, "pass-no-runtime: NCCL only, said so once",
                      sum(counts.values()) == 0 and len(unavailable) == 1,
                      f"CE buckets {counts}; messages: {unavailable}")
                against("pass-on-nccl", "pass-no-runtime bit-identical to pass-on-nccl", exact=True)
            if v == "pass-on-nccl" and not backend_underneath():
                ran.pop("inductor", None)  # keep at most two runs' tensors in GPU memory
            if v in ("pass-nccl", "pass-ce-packed", "pass-ce-rs-kernel"):
                ran.pop(v, None)
        results["models"][model] = summary
        ran.clear()

    failed = [r for r in rows if not r["ok"]]
    log0("")
    log0(f"{'model':<12} {'result':<6} check")
    for r in rows:
        log0(f"{r['model']:<12} {'PASS' if r['ok'] else 'FAIL':<6} {r['check']}")
    log0(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed" + (": FAIL" if failed else ": PASS"))
    results["checks"] = rows
    results["passed"] = not failed
    out = args.out or (os.path.join(os.environ["OUT"], "pass_gpu.json") if os.environ.get("OUT") else None)
    if out and dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        log0(f"wrote {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
