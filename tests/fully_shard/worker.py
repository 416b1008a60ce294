"""ce_overlap.fully_shard across ranks: training, clipping, checkpoints (DCP) and their exchange with FSDP2.

Run under torchrun; gloo on CPU (tests/test_fully_shard.py launches it at 2, 3 and 4 ranks), NCCL on GPUs
(bench/fully_shard_device.sh):

    torchrun --nproc-per-node 2 tests/fully_shard/worker.py check            # equivalence, clipping, state dicts
    torchrun --nproc-per-node 4 tests/fully_shard/worker.py check --tp 2     # the same with tensor parallelism (2x2)
    torchrun --nproc-per-node 2 tests/fully_shard/worker.py train --steps 5 --save DIR --record R5.pt [--compile --ce]
    torchrun --nproc-per-node 4 tests/fully_shard/worker.py train --load DIR --steps 5 --record R10.pt
    torchrun --nproc-per-node 4 tests/fully_shard/worker.py phases "--steps 3 --save DIR" "--load DIR --impl fsdp2"
    python tests/fully_shard/worker.py compare A.pt B.pt [--rtol R]           # bit-identical (or within R)

The model: ce_overlap's Llama (llama3-tiny widths, vocab 1001 so the embedding and output rows do not divide by
2, 3 or 4: uneven shards), each block sharded, then the root; fp32 parameters, or --bf16 (MixedPrecisionPolicy
bf16 gathers and reduce-scatters). --impl fsdp2 shards it with torch's FSDP2 instead (the same state-dict
keys and DTensor layout). Every rank trains on its own tokens (seeded by rank and step); the unsharded reference
trains on all ranks' tokens at once (their mean loss: the same gradient as FSDP's average).

--hsdp: HSDP, a 2-D mesh ("replicate", "shard") of 2 x world / 2 ranks (FSDP2's call shape: fully_shard(mesh=mesh)),
every rank on its own tokens; with CE_OVERLAP_RANKS_PER_NODE=world / 2 the replicas are two simulated nodes.

--tp T: a 2-D mesh ("dp", "tp") of world / T x T ranks; the model is first parallelized over "tp" with torchtitan's
Llama-3 plan (ce_overlap.models.llama.tensor_parallel), then sharded over "dp", as torchtitan orders FSDP2 + TP. The
ranks of one "tp" group train on the same tokens (their data-parallel rank's).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import shlex
import sys

import torch
import torch._inductor.config
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import ce_overlap
import ce_overlap.nodes
import ce_overlap.runtime
from ce_overlap.errors import CeOverlapError
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama, init_weights, tensor_parallel

SEQ, VOCAB = 32, 1001
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("CE_TEST_DEVICE", "cuda") == "cuda" else "cpu"
FAILED: list[str] = []
TP_SIZE = 1  # --tp


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def check(name: str, ok: bool, detail: str = "") -> None:
    log0(f"  {'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail else ""))
    if not ok:
        FAILED.append(name)


def config():
    return dataclasses.replace(LLAMA_CONFIGS["llama3-tiny"], seq_len=SEQ, vocab_size=VOCAB)


def unsharded() -> Llama:
    torch.manual_seed(1234)
    with torch.device(DEVICE):
        model = Llama(config())
    init_weights(model)
    return model


def dp_mesh(mesh):
    """What fully_shard takes: the mesh itself (1-D, or HSDP's ("replicate", "shard")), or its "dp" dimension."""
    return mesh["dp"] if mesh.ndim == 2 and "dp" in mesh.mesh_dim_names else mesh


def is_tp(mesh) -> bool:
    return mesh.ndim == 2 and "tp" in mesh.mesh_dim_names


def shard(model: Llama, impl: str, mesh, bf16: bool, vocab: bool = False, loss_parallel: bool = False,
          parallelized: bool = False) -> Llama:
    """Shards `model` over the mesh (1-D), or (a ("dp", "tp") mesh) parallelizes it over "tp" (unless `parallelized`)
    and shards it over "dp"."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = ce_overlap.fully_shard
    if is_tp(mesh) and not parallelized:
        tensor_parallel(model, mesh["tp"], loss_parallel=loss_parallel)
    extra = {"vocab_parallel_embeddings": True} if vocab else {}
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh(mesh), mp_policy=mp)
    fully_shard(model, mesh=dp_mesh(mesh), mp_policy=mp, **extra)
    return model


def tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, SEQ + 1), generator=g).to(DEVICE)


def data_rank() -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel world): the ranks of one TP group share their tokens."""
    tp = TP_SIZE
    return dist.get_rank() // tp, dist.get_world_size() // tp


def step(model, opt, step_no: int, world: int, reference: bool = False, clip: float | None = None,
         loss_parallel: bool = False, grads: dict | None = None):
    """One AdamW step on this rank's tokens (the reference: on every rank's, concatenated); the loss, averaged
    over the ranks (FSDP's gradient is their average). `world`: the data-parallel ranks."""
    if reference:
        batch = torch.cat([tokens(r, step_no) for r in range(world)])
    else:
        batch = tokens(data_rank()[0], step_no)
    ctx = torch.distributed.tensor.parallel.loss_parallel() if loss_parallel else contextlib.nullcontext()
    with ctx:
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
    if grads is not None:  # the gradients before clipping
        grads.update(full_grads(model))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    if isinstance(mean, DTensor):  # loss parallel: a replicated DTensor
        mean = mean.full_tensor()
    if not reference:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()  # every rank of a TP group holds its data-parallel rank's loss
    return mean.item(), norm


def full_params(model) -> dict[str, torch.Tensor]:
    """The unsharded parameters under the unsharded model's names (DCP's full state dict), on the CPU of every rank
    (cpu_offload=True would keep them on rank 0 only)."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.float().cpu() for k, v in sd.items()}


def compiled(model, ce: bool):
    """torch.compile, with ce_overlap's pass (and the copy-engine runtime where it runs) when asked."""
    if not ce:
        return torch.compile(model)
    import logging

    import ce_overlap.runtime as rt

    if dist.get_rank() == 0:  # the pass's one line per graph: buckets, and how many went to the copy engines
        logging.basicConfig(format="%(message)s")
        logging.getLogger("ce_overlap").setLevel(logging.INFO)
    if rt.available():
        rt.rendezvous(dist.group.WORLD)
    return torch.compile(model, options=ce_overlap.inductor_options())


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)


# --------------------------------------------------------------------------------------------------


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, unsharded, on the CPU of every rank (a copy: clipping scales them in place), under
    the model's own names (a compiled wrapper's prefix dropped)."""
    return {name.removeprefix("_orig_mod.").replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
            .detach().float().cpu().clone() for name, p in model.named_parameters() if p.grad is not None}


def run_check(args, mesh) -> None:
    world = data_rank()[1]
    tp = is_tp(mesh)
    hsdp = mesh.ndim == 2 and not tp
    ref = unsharded()
    ref_keys = {k: tuple(v.shape) for k, v in ref.state_dict().items()}

    model = shard(copy.deepcopy(ref), "ce", mesh, bf16=False)
    sd = model.state_dict()
    check("state_dict keys and shapes are the unsharded model's", {k: tuple(v.shape) for k, v in sd.items()} ==
          ref_keys, f"{len(sd)} keys")
    if mesh.ndim == 1:
        emb = sd["tok_embeddings.weight"]
        here = torch.tensor([emb.to_local().shape[0]], device=DEVICE)
        total = here.clone()
        dist.all_reduce(total)
        chunk = -(-VOCAB // world)
        want = min((dist.get_rank() + 1) * chunk, VOCAB) - min(dist.get_rank() * chunk, VOCAB)
        check("every parameter a Shard(0) DTensor, the rows in torch's chunk layout (uneven where they do not divide)",
              all(isinstance(v, DTensor) and v.placements[0].is_shard(0) for v in sd.values())
              and int(here) == want and int(total) == VOCAB,
              f"embedding rows here {int(here)} of {VOCAB}")
    fsdp2_sd = shard(copy.deepcopy(ref), "fsdp2", mesh, bf16=False).state_dict()
    differ = [k for k, v in sd.items() if not (isinstance(v, DTensor) and v.device_mesh == fsdp2_sd[k].device_mesh
                                               and v.placements == fsdp2_sd[k].placements
                                               and torch.equal(v.to_local(), fsdp2_sd[k].to_local()))]
    check("every parameter is FSDP2's DTensor: the same mesh, placements and local rows" +
          (" (tensor parallelism's shard, then the data-parallel one)" if tp else
           " (HSDP: replicated over 'replicate', sharded over 'shard')" if hsdp else ""),
          not differ, f"differ: {differ[:3]}" if differ else sd["layers.0.attention.wq.weight"].placements.__repr__())
    full = full_params(model)
    check("the full state dict is the unsharded model's, bit for bit",
          set(full) == set(ref_keys)
          and all(torch.equal(full[k], v.float().cpu()) for k, v in ref.state_dict().items()))

    # key -> (label, compiled (True, False or "pass"), activation checkpointing, vocabulary-parallel embedding,
    # loss parallel)
    variants = {"eager": ("eager", False, False, False, False)}
    if tp:
        variants["eager-lp"] = ("eager, loss parallel", False, False, False, True)
    elif not hsdp:
        variants["eager-vocab"] = ("eager, vocabulary-parallel embedding", False, False, True, False)
    if args.compile:
        variants["compiled"] = ("compiled", True, False, False, False)
        variants["compiled-ac"] = ("compiled, activation checkpointing per block", True, True, False, False)
        variants["compiled-pass"] = ("compiled with ce_overlap's pass", "pass", False, False, False)
        # Both at once: the recomputed blocks' collectives, and (uneven vocabulary shards) graphs that differ by rank,
        # which the pass must still order alike on every rank of each group (inductor/agreement.py).
        variants["compiled-ac-pass"] = ("compiled with ce_overlap's pass, activation checkpointing per block", "pass",
                                        True, False, False)
        if tp:
            variants["compiled-lp"] = ("compiled, loss parallel", True, False, False, True)
        elif not hsdp:
            variants["compiled-vocab"] = ("compiled, vocabulary-parallel embedding", True, False, True, False)
    if args.variants:
        unknown = set(args.variants.split(",")) - set(variants)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; these run here: {sorted(variants)}")
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    for label, compiled, ac, vocab, loss_parallel in variants.values():
        model = copy.deepcopy(ref)
        if tp:  # torchtitan's order: tensor parallelism, activation checkpointing, then fully_shard
            tensor_parallel(model, mesh["tp"], loss_parallel=loss_parallel)
        if ac:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        model = shard(model, "ce", mesh, bf16=False, vocab=vocab, loss_parallel=loss_parallel, parallelized=True)
        if vocab:
            check(f"{label}: the embedding looks up on its row shard",
                  getattr(model.tok_embeddings, "_ce_overlap_vocab_parallel", False))
        reference = copy.deepcopy(ref)
        torch._dynamo.reset()  # each variant compiles its own model from scratch
        passes = None
        if compiled == "pass":  # buckets and reorders the collectives (the copy engines need GPUs: NCCL/gloo kept)
            options = ce_overlap.inductor_options()
            passes = options["post_grad_custom_post_pass"]
            run = torch.compile(model, fullgraph=True, options=options)
        else:
            run = torch.compile(model, fullgraph=True) if compiled else model
        opt, ref_opt = optimizer(model), optimizer(reference)
        worst_loss, worst_norm, grad_err = 0.0, 0.0, 0.0
        # The pass must run here to be checked: a graph Inductor loads from its cache (a warm cache, or one rank's
        # graph cached and another's not) was planned by an earlier process and reports nothing.
        no_cache = torch._inductor.config.patch(force_disable_caches=True) if passes is not None \
            else contextlib.nullcontext()
        for s in range(1, 4):
            grads, ref_grads = ({}, {}) if s == 1 else (None, None)
            with no_cache:
                loss, norm = step(run, opt, s, world, clip=1.0, loss_parallel=loss_parallel, grads=grads)
            rloss, rnorm = step(reference, ref_opt, s, world, reference=True, clip=1.0, grads=ref_grads)
            if grads is not None:
                grad_err = max(((grads[k] - g).norm() / g.norm().clamp_min(1e-12)).item()
                               for k, g in ref_grads.items()) if set(grads) == set(ref_grads) else float("inf")
            worst_loss = max(worst_loss, abs(loss - rloss) / abs(rloss))
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            worst_norm = max(worst_norm, abs(norm.item() - rnorm.item()) / rnorm.item())
        got = full_params(model)
        err = max(((got[k] - v.float().cpu()).norm() / v.float().norm().clamp_min(1e-12)).item()
                  for k, v in reference.state_dict().items())
        check(f"{label}: 3 clipped AdamW steps match the unsharded model on all ranks' tokens",
              worst_loss < 1e-5 and err < 1e-4 and grad_err < 1e-5,
              f"loss rel err {worst_loss:.1e}, first gradients {grad_err:.1e}, param rel err {err:.1e}")
        check(f"{label}: clip_grad_norm_ returns the global norm (the unsharded model's)",
              worst_norm < 1e-5, f"rel err {worst_norm:.1e}")
        if passes is not None:
            planned = {r.graph: r.refused or "rewritten" for r in passes.reports if r.collectives or r.refused}
            check(f"{label}: the pass rewrote the forward and the backward, the ranks agreeing on every group's order",
                  planned == {"forward": "rewritten", "backward": "rewritten"}, str(planned))

    model = shard(copy.deepcopy(ref), "ce", mesh, bf16=False)
    bad_cases = [(lambda: ce_overlap.fully_shard(model, mesh=dp_mesh(mesh)), "a module sharded twice"),
                 (lambda: ce_overlap.fully_shard(unsharded(), mesh="dp"), "a mesh that is not a mesh")]
    if tp:
        def replaced_after_sharding():
            # A parameter swapped for a TP DTensor after fully_shard (what a custom parallel style could do; torch's
            # own styles refuse an already sharded parameter themselves, checked below): the forward names it.
            late = ce_overlap.fully_shard(unsharded(), mesh=dp_mesh(mesh))
            wq = late.layers[0].attention.wq
            wq._parameters["weight"] = torch.nn.Parameter(DTensor.from_local(
                wq.weight.to_local(), mesh["tp"], [torch.distributed.tensor.Shard(0)], run_check=False))
            late(tokens(0, 0)[:, :-1], tokens(0, 0)[:, 1:])

        bad_cases.append((replaced_after_sharding, "a parameter replaced after fully_shard"))
    spans = len(set(ce_overlap.nodes.nodes_of(dist.group.WORLD))) > 1
    if spans:  # simulated nodes (CE_OVERLAP_RANKS_PER_NODE): the CE runtime refuses a group across them by name
        bad_cases.append((lambda: ce_overlap.runtime.all_gather(torch.ones(4), group=dist.group.WORLD),
                          "a copy-engine all-gather over a group that spans nodes"))
    for bad, what in bad_cases:
        try:
            bad()
            check(f"{what} is refused", False, "no error")
        except CeOverlapError as e:
            named = "copy-engine" not in what or (f"ranks 0, 1 on {ce_overlap.nodes.nodes_of(dist.group.WORLD)[0]}"
                                                 in str(e) and "need one node" in str(e))
            check(f"{what} is refused", named, str(e)[:220])
    if tp:
        try:
            tensor_parallel(ce_overlap.fully_shard(unsharded(), mesh=dp_mesh(mesh)), mesh["tp"])
            check("tensor parallelism after fully_shard is refused", False, "no error")
        except (ValueError, RuntimeError) as e:  # torch's own, in parallelize_module
            check("tensor parallelism after fully_shard is refused (by parallelize_module)", "DTensor" in str(e),
                  f"{type(e).__name__}: {str(e)[:120]}")


def run_train(args, mesh) -> None:
    world = data_rank()[1]
    model = shard(unsharded(), args.impl, mesh, bf16=args.bf16)
    run = compiled(model, args.ce) if args.compile else model
    opt = optimizer(model)
    start = 0
    if args.load:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.zeros((), dtype=torch.int64)}
        dcp.load(state, checkpoint_id=args.load)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(state["step"])
        log0(f"loaded {args.load} (written at step {start}) into {args.impl} at {tuple(mesh.shape)} ranks")
    losses = [step(run, opt, s, world)[0] for s in range(start + 1, start + args.steps + 1)]
    log0(f"{args.impl} {tuple(mesh.shape)} ranks steps {start + 1}-{start + args.steps}: losses "
         + " ".join(f"{v:.6f}" for v in losses))
    if args.save:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(start + args.steps)},
                 checkpoint_id=args.save)
        log0(f"saved {args.save}")
    if args.record:
        params = full_params(model)
        if dist.get_rank() == 0:
            torch.save({"losses": losses, "params": params, "first_step": start + 1}, args.record)


def run_compare(a: str, b: str, rtol: float = 0.0) -> int:
    """Two records: their common last steps' losses and their parameters, bit-identical (rtol 0) or within rtol."""
    x, y = torch.load(a), torch.load(b)
    n = min(len(x["losses"]), len(y["losses"]))
    lx, ly = x["losses"][len(x["losses"]) - n:], y["losses"][len(y["losses"]) - n:]
    loss_err = max((abs(u - v) / abs(v) for u, v in zip(lx, ly)), default=0.0)
    same_keys = set(x["params"]) == set(y["params"])
    param_err = max((((x["params"][k] - y["params"][k]).norm() / y["params"][k].norm().clamp_min(1e-12)).item()
                     for k in x["params"]), default=0.0) if same_keys else float("inf")
    if rtol == 0:
        ok = lx == ly and same_keys and all(torch.equal(x["params"][k], y["params"][k]) for k in x["params"])
        how = "bit-identical"
    else:
        ok = loss_err <= rtol and param_err <= rtol
        how = f"within rtol {rtol:g}"
    print(f"{'PASS' if ok else 'FAIL'}  {a} vs {b} {how}: {n} common last losses (rel err {loss_err:.1e}), "
          f"{len(x['params'])} parameters (rel err {param_err:.1e})")
    return 0 if ok else 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["check", "train", "phases", "compare"])
    p.add_argument("files", nargs="*", help="compare: two records; phases: each a quoted list of train options")
    p.add_argument("--impl", choices=["ce", "fsdp2"], default="ce")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--record")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ce", action="store_true", help="with --compile: ce_overlap's pass (inductor_options())")
    p.add_argument("--rtol", type=float, default=0.0, help="compare: the tolerance (0: bit-identical)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism over this many ranks (a ('dp', 'tp') mesh)")
    p.add_argument("--hsdp", action="store_true", help="HSDP over a ('replicate', 'shard') mesh of 2 x world / 2")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="simulated nodes of this many ranks (ce_overlap.nodes.simulated; over CE_OVERLAP_RANKS_PER_NODE)")
    p.add_argument("--variants", default="", help="check: only these training variants (comma-separated keys)")
    return p


def _mesh(args, world: int):
    if args.hsdp:
        return init_device_mesh(DEVICE, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if args.tp > 1:
        return init_device_mesh(DEVICE, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(DEVICE, (world,))


def _run(what: str, args, world: int) -> None:
    global TP_SIZE
    TP_SIZE = args.tp
    nodes = ce_overlap.nodes.simulated(args.ranks_per_node) if args.ranks_per_node else contextlib.nullcontext()
    with nodes:
        mesh = _mesh(args, world)
        run_check(args, mesh) if what == "check" else run_train(args, mesh)


def main() -> int:
    p = _parser()
    args = p.parse_args()
    if args.what == "compare":
        return run_compare(*args.files, rtol=args.rtol)
    # phases: train runs one after the other in this process group (a launch of 4 CPU ranks costs ~10 s; the
    # checkpoint tests chain up to 9 of them), each from a fresh model, as separate launches would run them.
    runs = [("train", p.parse_args(["train", *shlex.split(phase)])) for phase in args.files] \
        if args.what == "phases" else [(args.what, args)]
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        for what, run_args in runs:
            _run(what, run_args, dist.get_world_size())
            dist.barrier()
        if FAILED:  # while the group exists: log0 asks for the rank
            log0(f"{len(FAILED)} check(s) failed: {', '.join(FAILED)}")
    finally:
        dist.destroy_process_group()
    return 1 if FAILED else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: under a loaded CPU, gloo's threads occasionally abort the exiting process
    # ("terminate called without an active exception", SIGABRT) after the run has finished and its group is
    # destroyed (seen twice in ~30 CPU launches, never with the checks' outcome at stake).
    os._exit(code)
