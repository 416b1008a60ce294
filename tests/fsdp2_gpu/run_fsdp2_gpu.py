"""GPU check of ce_overlap.fsdp: FSDP2 (`fully_shard`) training with copy-engine collectives against the same FSDP2
model without them.

    torchrun --standalone --nproc-per-node 2 tests/fsdp2_gpu/run_fsdp2_gpu.py
    CE_TEST_SHARED_GPU=1 torchrun --standalone --nproc-per-node 3 tests/fsdp2_gpu/run_fsdp2_gpu.py --models llama3-tiny

Per model (llama3-tiny; llama3-1b at 4 layers) and per mode (eager; every block torch.compile'd before fully_shard,
torchtitan's pattern), the same seeded run (3 AdamW steps, bf16 parameters, fp32 gradient reduction, reshard after
forward, fixed per-rank tokens) in two variants:

  reference  FSDP2 without ce_overlap: NCCL where every rank has its own GPU; with the ranks sharing one GPU (gloo,
             whose all-gather on CUDA tensors crashes: pytorch/pytorch#152645) FSDP2's own custom-comm hooks
             moving the same bytes through host memory over gloo (the reduction: an fp32 sum in rank order,
             then times 1 / n for avg, rounded once)
  ce         ce_overlap.fsdp.use_copy_engines(model, ce="on"): every FSDP group on the direct path where it covers
             the group (ce_overlap.fsdp.direct: gathered into the parameters, reduce-scattered from the gradients,
             a widening reduction for fp32 reduce_dtype), else FSDP2's own path with CE in its extension points
  ce-hooks   (--paths) use_copy_engines(model, ce="on", direct=False): FSDP2's own path for every group, the
             all-gather in place in the symmetric pool, the reduce-scatter on copy engines plus the reduction kernel

Tensor parallelism (--tp T): a ("dp", "tp") mesh of world / T x T ranks, the model parallelized over "tp" with
torchtitan's Llama-3 plan first, then FSDP2 over "dp" (torchtitan's order); ce_overlap.fsdp.use_copy_engines puts the
"dp" groups' collectives on copy engines. On one shared GPU the default group is "cpu:gloo,cuda:ce_overlap", so that
tensor parallelism's eager collectives run (gloo's all-gather on CUDA tensors does not), on ce_overlap's backend in both
variants; the reference's FSDP2 collectives go through host memory as without --tp.

HSDP (--hsdp): FSDP2's HSDP over a ("replicate", "shard") mesh of 2 x world / 2 (run it with
CE_OVERLAP_RANKS_PER_NODE=world / 2: the replicas are two simulated nodes); use_copy_engines puts the "shard" groups'
collectives on copy engines (FSDP2's own path: the direct path does not cover HSDP), FSDP2's all-reduce across the
replicas stays on the group's backend (ce_overlap's torch.distributed backend on one shared GPU, as with --tp).

Checks (PASS/FAIL table, exit 1 on a failure): every FSDP group's all-gather and reduce-scatter ran on CE in the ce
variant; losses, gradients and parameters bit-identical to the reference at 2 ranks, within the reduction order's
tolerance at more (the largest relative error is printed: the all-gathers move bytes exactly, the reduce-scatter
sums in another order).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: reduce_tolerances
from reduce_tolerances import tolerances  # noqa: E402  (beyond 2 ranks the sums' order differs from NCCL's)

import ce_overlap.fsdp as cefsdp  # noqa: E402
import ce_overlap.nodes as ce_overlap_nodes  # noqa: E402
import ce_overlap.fsdp.direct as fsdp_direct  # noqa: E402
import ce_overlap.runtime as rt  # noqa: E402
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama, init_weights, tensor_parallel  # noqa: E402

# Every rank on GPU 0 (over gloo) when asked, or when there are more local ranks than GPUs.
SHARED_GPU = os.environ.get("CE_TEST_SHARED_GPU") == "1" or \
    int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()

# The FSDP2 setups a run can ask for (--setups): what fully_shard and the training loop do differently.
SETUPS = {
    "default": "reshard after forward, implicit prefetching, fp32 gradient reduction, one microbatch per step",
    "no-reshard": "reshard_after_forward=False on the blocks (their parameters stay gathered from forward to backward)",
    "reshard-2": "reshard_after_forward=2 on the blocks (gathered again in backward over a 2-rank post-forward group)",
    "explicit-prefetch": "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch, one block ahead",
    "grad-accum": "2 microbatches per step, set_requires_gradient_sync(False) on the first (no reduce-scatter)",
    "bf16-reduce": "MixedPrecisionPolicy(reduce_dtype=bfloat16): the reduce-scatter in bf16",
    "torchtitan-wrap": "torchtitan's apply_fsdp: the embedding, each block, [norm, output] together (not resharded "
                       "after forward), the root",
}
PATHS = {"direct": "ce", "hooks": "ce-hooks"}


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def host_comms():
    """FSDP2 custom comms that move bytes through host memory over the (gloo) group: the shared-GPU reference."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class HostAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            host = torch.empty(output_tensor.numel() * output_tensor.element_size(), dtype=torch.uint8)
            dist.all_gather_into_tensor(host, input_tensor.reshape(-1).view(torch.uint8).cpu(), group=group)
            output_tensor.reshape(-1).view(torch.uint8).copy_(host)
            return None

    class HostReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            world, rank = group.size(), group.rank()
            host = torch.empty(world * input_tensor.numel(), dtype=torch.float32)
            dist.all_gather_into_tensor(host, input_tensor.reshape(-1).float().cpu(), group=group)
            total = host.view(world, -1)[0].clone()
            for r in range(1, world):
                total += host.view(world, -1)[r]
            if op == dist.ReduceOp.AVG:
                total = total * (1.0 / world)
            chunk = total.view(world, -1)[rank]
            output_tensor.reshape(-1).copy_(chunk.to(output_tensor.dtype))
            return None

    return HostAllGather(), HostReduceScatter()


def reduce_dtype(setup: str) -> torch.dtype:
    return torch.bfloat16 if setup == "bf16-reduce" else torch.float32


# --tp > 1: the ("dp", "tp") mesh; --hsdp: the ("replicate", "shard") one.
MESH = None


def _tp() -> bool:
    return MESH is not None and "tp" in MESH.mesh_dim_names


def build(model_name: str, args, compiled: bool, setup: str = "default"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = LLAMA_CONFIGS[model_name]
    cfg = dataclasses.replace(cfg, seq_len=args.seq_len, n_layers=min(cfg.n_layers, args.layers))
    torch.manual_seed(1234)
    with torch.device("cuda"):
        model = Llama(cfg)
    init_weights(model)
    dp = None
    if MESH is not None and "tp" in MESH.mesh_dim_names:  # torchtitan's order: tensor parallelism, then FSDP2 on "dp"
        tensor_parallel(model, MESH["tp"])
        dp = MESH["dp"]
    elif MESH is not None:  # HSDP: fully_shard takes the ("replicate", "shard") mesh
        dp = MESH
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype(setup))
    reshard = {"no-reshard": False, "reshard-2": 2}.get(setup, True)
    if setup == "torchtitan-wrap":
        fully_shard(model.tok_embeddings, mesh=dp, mp_policy=mp)
    for block in model.layers:
        if compiled:
            block.compile()
        fully_shard(block, mesh=dp, mp_policy=mp, reshard_after_forward=reshard)
    if setup == "torchtitan-wrap":
        fully_shard([model.norm, model.output], mesh=dp, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=dp, mp_policy=mp)
    if setup == "explicit-prefetch":
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model, cfg


class CallCounter:
    """Counts the collectives FSDP2's comm objects actually ran, by path: the CE runtime's or torch.distributed's
    (a fallback), so the check is what happened, not only what was decided."""

    # (the key counted, the module, the function FSDP2's comm objects call on it)
    NAMES = (("ce all_gather", rt, "all_gather_into_tensor"), ("ce reduce_scatter", rt, "reduce_scatter_tensor"),
             ("fallback all_gather", dist, "all_gather_into_tensor"),
             ("fallback reduce_scatter", dist, "reduce_scatter_tensor"))

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved = []
        self._direct = (0, 0)

    def __enter__(self):
        self._direct = (fsdp_direct.counters.all_gathers, fsdp_direct.counters.reduce_scatters)
        for key, module, name in self.NAMES:
            fn = getattr(module, name)

            def counted(*a, _fn=fn, _key=key, **k):
                self.counts[_key] = self.counts.get(_key, 0) + 1
                return _fn(*a, **k)

            self._saved.append((module, name, fn))
            setattr(module, name, counted)
        return self

    def __exit__(self, *exc):
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        # The direct path calls the runtime's ops itself (fsdp_direct.counters counts them).
        for key, now, before in (("direct all_gather", fsdp_direct.counters.all_gathers, self._direct[0]),
                                 ("direct reduce_scatter", fsdp_direct.counters.reduce_scatters, self._direct[1])):
            if now > before:
                self.counts[key] = now - before


def run_variant(model_name: str, variant: str, compiled: bool, args, setup: str = "default") -> dict:
    from torch.distributed.fsdp import FSDPModule

    torch._dynamo.reset()
    torch.cuda.reset_peak_memory_stats()
    pools_before = set(rt.rendezvoused_groups())
    model, cfg = build(model_name, args, compiled, setup)
    decisions = []
    if variant in ("ce", "ce-hooks"):
        decisions = cefsdp.use_copy_engines(model, ce="on", direct=variant == "ce",
                                            group=MESH["dp"].get_group() if _tp() else None)
    elif SHARED_GPU:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                ag, rs = host_comms()
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator(device="cuda")
    out = {"losses": [], "grads": [], "decisions": decisions}
    counter = CallCounter() if variant != "reference" else contextlib.nullcontext()
    t0 = time.perf_counter()
    with counter:
        micro = 2 if setup == "grad-accum" else 1
        for step in range(args.steps):
            for m in range(micro):
                gen.manual_seed(1000 * step + 10 * m + dist.get_rank() // (MESH["tp"].size() if _tp() else 1))
                tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), device="cuda", generator=gen)
                if micro > 1:
                    model.set_requires_gradient_sync(m == micro - 1)  # the last microbatch reduce-scatters the sum
                loss = model(tokens, tokens)
                loss.backward()
            out["losses"].append(loss.detach().double().item())
            out["grads"].append([p.grad.to_local().detach().cpu() for p in model.parameters()])
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    out["seconds"] = time.perf_counter() - t0
    out["calls"] = counter.counts if variant != "reference" else {}
    out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    out["pools"] = {name: rt.config_of(name).pool_mb for name in rt.rendezvoused_groups() if name not in pools_before}
    out["params"] = [p.to_local().detach().cpu() for p in model.parameters()]
    del model, opt
    torch.cuda.synchronize()
    # The groups FSDP made for this model (one per fully_shard under a gloo default group) outlive it, and so would
    # their pools: drop them once every rank is done, or a run of many setups holds a pool per group it ever made.
    dist.barrier(group=CPU_GROUP)
    fsdp_direct.forget_rings(out["pools"])
    if variant == "ce":
        torch.ops.ce_overlap._block_cache_clear()
    for name in out["pools"]:
        rt.close_pool(name)
    torch.cuda.empty_cache()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    den = b.norm().item()
    return (a - b).norm().item() / den if den > 0 else (a - b).norm().item()


def compare(x: dict, ref: dict) -> dict:
    loss_err = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(x["losses"], ref["losses"]))
    grad_err = max((_rel(a, b) for ga, gb in zip(x["grads"], ref["grads"]) for a, b in zip(ga, gb)), default=0.0)
    param_err = max((_rel(a, b) for a, b in zip(x["params"], ref["params"])), default=0.0)
    same = x["losses"] == ref["losses"] and \
        all(torch.equal(a, b) for ga, gb in zip(x["grads"], ref["grads"]) for a, b in zip(ga, gb)) and \
        all(torch.equal(a, b) for a, b in zip(x["params"], ref["params"]))
    t = torch.tensor([loss_err, grad_err, param_err, 0.0 if same else 1.0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=CPU_GROUP)
    return {"loss_err": t[0].item(), "grad_err": t[1].item(), "param_err": t[2].item(), "identical": t[3].item() == 0}


CPU_GROUP = None


def check_variant(check, label: str, ce: dict, ref: dict, world: int, reduce_dtype: torch.dtype) -> None:
    """The rows of one copy-engine variant: every collective ran on CE (counted), and its training matches the
    reference (bit-identical at 2 ranks)."""
    on_ce = [d for d in ce["decisions"] if d.backend == "ce"]
    calls = ce["calls"]
    ran_on_ce = not any(k.startswith("fallback") for k in calls) and \
        calls.get("ce all_gather", 0) + calls.get("direct all_gather", 0) > 0 and \
        calls.get("ce reduce_scatter", 0) + calls.get("direct reduce_scatter", 0) > 0
    check(f"{label}: every FSDP group's all-gather and reduce-scatter on CE",
          len(on_ce) == len(ce["decisions"]) > 0 and ran_on_ce,
          f"{len(on_ce)} of {len(ce['decisions'])} collectives decided CE; calls on rank 0 "
          + ", ".join(f"{k} {v}" for k, v in sorted(calls.items())))
    c = compare(ce, ref)
    exact = world == 2
    loss_tol, grad_tol, param_tol = tolerances(reduce_dtype, world)
    ok = c["identical"] if exact else (c["loss_err"] <= loss_tol and c["grad_err"] <= grad_tol
                                       and c["param_err"] <= param_tol)
    check(f"{label}: ce {'bit-identical to' if exact else 'matches'} the reference", ok,
          f"losses {['%.6f' % v for v in ce['losses']]}, loss err {c['loss_err']:.2e}, grad rel err "
          f"{c['grad_err']:.2e}, param rel err {c['param_err']:.2e}, bit-identical {c['identical']}; "
          f"{ref['seconds']:.1f} s / {ce['seconds']:.1f} s")
    log0(f"    memory (rank 0): torch peak reserved {ce['peak_reserved_gib']:.2f} GiB (reference "
         f"{ref['peak_reserved_gib']:.2f}); CE pools of this model {len(ce['pools'])} groups, "
         f"{sum(ce['pools'].values()) / 1024:.2f} GiB ({', '.join(f'{v:.0f}' for v in ce['pools'].values())} MiB)")


def main() -> int:
    global CPU_GROUP, MESH
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama3-tiny,llama3-1b")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--setups", default="default",
                   help="comma-separated FSDP2 setups: " + "; ".join(f"{k}: {v}" for k, v in SETUPS.items()))
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism over this many ranks (a ('dp', 'tp') mesh)")
    p.add_argument("--hsdp", action="store_true", help="FSDP2's HSDP over a ('replicate', 'shard') mesh of 2 x world / 2")
    p.add_argument("--paths", default="direct",
                   help="comma-separated: direct (use_copy_engines' default) and / or hooks (direct=False)")
    args = p.parse_args()
    paths = [x for x in args.paths.split(",") if x]
    if not paths or any(x not in PATHS for x in paths):
        p.error(f"--paths: expected a comma list of {list(PATHS)}, got {args.paths!r}")
    setups = [x for x in args.setups.split(",") if x]
    unknown = [x for x in setups if x not in SETUPS]
    if unknown:
        p.error(f"--setups: unknown {unknown}; choose from {list(SETUPS)}")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(0 if SHARED_GPU else local)
    if SHARED_GPU and (args.tp > 1 or args.hsdp):  # TP's eager all-gathers, HSDP's all-reduce: ce_overlap's backend
        dist.init_process_group("cpu:gloo,cuda:ce_overlap", timeout=datetime.timedelta(seconds=300))
    elif SHARED_GPU:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(seconds=300))
    CPU_GROUP = dist.new_group(backend="gloo")
    torch.use_deterministic_algorithms(True)
    world = dist.get_world_size()
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        if world % args.tp:
            p.error(f"--tp {args.tp} must divide the {world} ranks")
        MESH = init_device_mesh("cuda", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        log0(f"tensor parallelism over {args.tp} ranks, FSDP2 over {world // args.tp}")
        world //= args.tp  # the reduce-scatters' ranks: what bit-identity and the tolerances depend on
    elif args.hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        MESH = init_device_mesh("cuda", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        log0(f"HSDP: 2 replicas x {world // 2} shards (nodes as ce_overlap sees them: "
             f"{ce_overlap_nodes.describe(dist.group.WORLD)})")
    log0(f"torch {torch.__version__}, {world} ranks on {'one shared ' if SHARED_GPU else ''}"
         f"{torch.cuda.get_device_name()}")
    rows = []

    def check(name: str, ok: bool, detail: str) -> None:
        rows.append((name, ok))
        log0(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    runs = [(model_name, mode, setup) for model_name in args.models.split(",") if model_name
            for mode in args.modes.split(",") if mode for setup in setups]
    for model_name, mode, setup in runs:
        label = f"{model_name} {mode}" + ("" if setup == "default" else f" {setup}")
        if setup == "reshard-2" and (world <= 2 or world % 2):
            log0(f"  skipped  {label}: reshard_after_forward=2 needs an even world size above 2, not {world}")
            continue
        try:
            ref = run_variant(model_name, "reference", mode == "compiled", args, setup)
        except Exception as e:  # noqa: BLE001 (a failing run is a FAIL row)
            traceback.print_exc()
            check(f"{label}: reference runs", False, f"{type(e).__name__}: {str(e)[:300]}")
            continue
        for path in paths:
            try:
                ce = run_variant(model_name, PATHS[path], mode == "compiled", args, setup)
            except Exception as e:  # noqa: BLE001 (a failing run is a FAIL row)
                traceback.print_exc()
                check(f"{label} {path}: runs", False, f"{type(e).__name__}: {str(e)[:300]}")
                continue
            check_variant(check, f"{label} {path}", ce, ref, world, reduce_dtype(setup))
    failed = [r for r in rows if not r[1]]
    log0(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed" + (": FAIL" if failed else ": PASS"))
    dist.barrier(group=CPU_GROUP)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
