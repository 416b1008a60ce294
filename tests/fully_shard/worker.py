"""ce_overlap.fully_shard across ranks: training, clipping, checkpoints (DCP) and their exchange with FSDP2.

Run under torchrun; gloo on CPU (tests/test_fully_shard.py launches it at 2, 3 and 4 ranks), NCCL on GPUs
(bench/fully_shard_device.sh):

    torchrun --nproc-per-node 2 tests/fully_shard/worker.py check            # equivalence, clipping, state dicts
    torchrun --nproc-per-node 2 tests/fully_shard/worker.py train --steps 5 --save DIR --record R5.pt [--compile --ce]
    torchrun --nproc-per-node 4 tests/fully_shard/worker.py train --load DIR --steps 5 --record R10.pt
    python tests/fully_shard/worker.py compare A.pt B.pt [--rtol R]           # bit-identical (or within R)

The model: ce_overlap's Llama (llama3-tiny widths, vocab 1001 so the embedding and output rows do not divide by
2, 3 or 4: uneven shards), each block sharded, then the root; fp32 parameters, or --bf16 (MixedPrecisionPolicy
bf16 gathers and reduce-scatters). --impl fsdp2 shards it with torch's FSDP2 instead (the same state-dict
keys and DTensor layout). Every rank trains on its own tokens (seeded by rank and step); the unsharded reference
trains on all ranks' tokens at once (their mean loss: the same gradient as FSDP's average).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import ce_overlap
from ce_overlap.errors import CeOverlapError
from ce_overlap.models.llama import LLAMA_CONFIGS, Llama, init_weights

SEQ, VOCAB = 32, 1001
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("CE_TEST_DEVICE", "cuda") == "cuda" else "cpu"
FAILED: list[str] = []


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


def shard(model: Llama, impl: str, mesh, bf16: bool, vocab: bool = False) -> Llama:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = ce_overlap.fully_shard
    extra = {"vocab_parallel_embeddings": True} if vocab else {}
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp, **extra)
    return model


def tokens(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (1, SEQ + 1), generator=g).to(DEVICE)


def step(model, opt, step_no: int, world: int, reference: bool = False, clip: float | None = None):
    """One AdamW step on this rank's tokens (the reference: on every rank's, concatenated); the loss, averaged
    over the ranks (FSDP's gradient is their average)."""
    if reference:
        batch = torch.cat([tokens(r, step_no) for r in range(world)])
    else:
        batch = tokens(dist.get_rank(), step_no)
    loss = model(batch[:, :-1], batch[:, 1:])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip is not None else None
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    if not reference:
        dist.all_reduce(mean)
        mean /= world
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


def run_check(args, mesh) -> None:
    world = dist.get_world_size()
    ref = unsharded()
    ref_keys = {k: tuple(v.shape) for k, v in ref.state_dict().items()}

    model = shard(copy.deepcopy(ref), "ce", mesh, bf16=False)
    sd = model.state_dict()
    check("state_dict keys and shapes are the unsharded model's", {k: tuple(v.shape) for k, v in sd.items()} ==
          ref_keys, f"{len(sd)} keys")
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
    full = full_params(model)
    check("the full state dict is the unsharded model's, bit for bit",
          set(full) == set(ref_keys)
          and all(torch.equal(full[k], v.float().cpu()) for k, v in ref.state_dict().items()))

    variants = [("eager", False, False, False), ("eager, vocabulary-parallel embedding", False, False, True)]
    if args.compile:
        variants += [("compiled", True, False, False), ("compiled, activation checkpointing per block", True, True, False),
                     ("compiled, vocabulary-parallel embedding", True, False, True)]
    for label, compiled, ac, vocab in variants:
        model = copy.deepcopy(ref)
        if ac:  # torchtitan's order: checkpoint_wrapper on each block, then fully_shard
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            for i, block in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        model = shard(model, "ce", mesh, bf16=False, vocab=vocab)
        if vocab:
            check(f"{label}: the embedding looks up on its row shard",
                  getattr(model.tok_embeddings, "_ce_overlap_vocab_parallel", False))
        reference = copy.deepcopy(ref)
        run = torch.compile(model, fullgraph=True) if compiled else model
        opt, ref_opt = optimizer(model), optimizer(reference)
        worst_loss, worst_norm = 0.0, 0.0
        for s in range(1, 4):
            loss, norm = step(run, opt, s, world, clip=1.0)
            rloss, rnorm = step(reference, ref_opt, s, world, reference=True, clip=1.0)
            worst_loss = max(worst_loss, abs(loss - rloss) / abs(rloss))
            norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
            worst_norm = max(worst_norm, abs(norm.item() - rnorm.item()) / rnorm.item())
        got = full_params(model)
        err = max(((got[k] - v.float().cpu()).norm() / v.float().norm().clamp_min(1e-12)).item()
                  for k, v in reference.state_dict().items())
        check(f"{label}: 3 clipped AdamW steps match the unsharded model on all ranks' tokens",
              worst_loss < 1e-5 and err < 1e-4, f"loss rel err {worst_loss:.1e}, param rel err {err:.1e}")
        check(f"{label}: clip_grad_norm_ returns the global norm (the unsharded model's)",
              worst_norm < 1e-5, f"rel err {worst_norm:.1e}")

    model = shard(copy.deepcopy(ref), "ce", mesh, bf16=False)
    for bad, what in ((lambda: ce_overlap.fully_shard(model, mesh=mesh), "a module sharded twice"),
                      (lambda: ce_overlap.fully_shard(unsharded(), mesh="dp"), "a mesh that is not a mesh")):
        try:
            bad()
            check(f"{what} is refused", False, "no error")
        except CeOverlapError as e:
            check(f"{what} is refused", True, str(e)[:120])


def run_train(args, mesh) -> None:
    world = dist.get_world_size()
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
        log0(f"loaded {args.load} (written at step {start}) into {args.impl} at {world} ranks")
    losses = [step(run, opt, s, world)[0] for s in range(start + 1, start + args.steps + 1)]
    log0(f"{args.impl} {world} ranks steps {start + 1}-{start + args.steps}: losses "
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["check", "train", "compare"])
    p.add_argument("files", nargs="*")
    p.add_argument("--impl", choices=["ce", "fsdp2"], default="ce")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--record")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ce", action="store_true", help="with --compile: ce_overlap's pass (inductor_options())")
    p.add_argument("--rtol", type=float, default=0.0, help="compare: the tolerance (0: bit-identical)")
    args = p.parse_args()
    if args.what == "compare":
        return run_compare(*args.files, rtol=args.rtol)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    try:
        run_check(args, mesh) if args.what == "check" else run_train(args, mesh)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if FAILED:
        log0(f"{len(FAILED)} check(s) failed: {', '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's teardown: under a loaded CPU, gloo's threads occasionally abort the exiting process
    # ("terminate called without an active exception", SIGABRT) after the run has finished and its group is
    # destroyed (seen twice in ~30 CPU launches, never with the checks' outcome at stake).
    os._exit(code)
