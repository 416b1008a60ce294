"""torchtitan's own Llama-3 with ce_overlap's copy engines: the recipe of docs/fsdp2.md checked on torchtitan's model
code and its FSDP step (torchtitan.distributed.fsdp.apply_fsdp_to_decoder, what its parallelize_llama runs).

    torchrun --standalone --nproc-per-node 2 bench/torchtitan_fsdp2.py [--flavor debugmodel] [--steps 3]

Per rank: the model built on meta from torchtitan's flavor config (flex attention with its document mask), sharded by
torchtitan's apply_fsdp_to_decoder (bf16 parameters, fp32 reduction), moved to the GPU and initialized
(init_states), then `ce_overlap.fsdp.use_copy_engines(model, ce=...)` -- the one added line -- and a few AdamW steps
on fixed tokens. Twice from the same weights: on ce_overlap's direct path, and with direct=False (FSDP2's own path
with copy-engine collectives, checked bit-identical to NCCL by tests/fsdp2_gpu); prints both runs' losses, whether
they are bit-identical, and how many collectives each path ran. Needs torchtitan (0.3.0 asks for a nightly torch;
where its import fails on the installed torch, the script says so and exits 2). With ranks sharing one GPU the
process group is gloo.

    torchrun --standalone --nproc-per-node 2 bench/torchtitan_fsdp2.py --dry-run --flavor 8B   # CPU, no GPU

--dry-run builds the flavor on meta over gloo, shards it the same way and prints, per FSDP group, its parameters,
whether ce_overlap's direct path covers it and what the cost model decides (ce_overlap.fsdp.direct_path / decide).
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def run(flavor: str, steps: int, seq_len: int, direct: bool, ce: str) -> tuple[list[float], dict]:
    import torchtitan.models.llama3 as llama3
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    import ce_overlap.fsdp
    from ce_overlap.fsdp import direct as fsdp_direct

    cfg = llama3.llama3_configs[flavor]("flex")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cuda"))
    ce_overlap.fsdp.use_copy_engines(model, ce=ce, direct=direct)  # the recipe's line
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
    vocab = cfg.vocab_size
    tokens = torch.randint(0, vocab, (1, seq_len + 1), device="cuda", generator=gen)
    positions = torch.arange(seq_len, device="cuda").unsqueeze(0)
    masks = model.get_attention_masks(positions)
    before = (fsdp_direct.counters.all_gathers, fsdp_direct.counters.reduce_scatters)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1], positions, masks)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        lv = loss.detach()
        dist.all_reduce(lv)
        losses.append(lv.item() / dist.get_world_size())
    direct_calls = {"direct all-gathers": fsdp_direct.counters.all_gathers - before[0],
                    "direct reduce-scatters": fsdp_direct.counters.reduce_scatters - before[1]}
    return losses, direct_calls


def dry_run(flavor: str, ce: str, profile: str) -> int:
    """The FSDP groups torchtitan's sharding makes of `flavor` and what ce_overlap.fsdp would do with each (CPU)."""
    import torchtitan.models.llama3 as llama3
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    import ce_overlap.fsdp as cefsdp

    dist.init_process_group("gloo")
    with torch.device("meta"):
        model = llama3.llama3_configs[flavor]("flex").build()
    apply_fsdp_to_decoder(model, init_device_mesh("cpu", (dist.get_world_size(),)), param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32, pp_enabled=False)
    groups = cefsdp.fsdp_groups(model)
    paths = cefsdp.direct_path([pg for _, _, pg in groups])
    decisions = cefsdp.decide(groups, ce=ce, profile=profile)
    if dist.get_rank() == 0:
        print(f"torchtitan llama3 {flavor} (flex attention), {dist.get_world_size()} ranks, profile {profile}: "
              f"{len(groups)} FSDP groups")
        for (name, _, pg), ag, rs in zip(groups, decisions[0::2], decisions[1::2]):
            shapes = [tuple(p._orig_size) for p in pg.fsdp_params]
            print(f"  {name or '<root>'}: {len(shapes)} parameters {shapes[:3]}{' ...' if len(shapes) > 3 else ''}; "
                  f"direct path: {paths[id(pg)] or 'yes'}; all-gather {ag.bytes / 2**20:.2f} MiB/rank -> {ag.backend}, "
                  f"reduce-scatter -> {rs.backend}")
    covered = sum(not why for why in paths.values())
    dist.destroy_process_group()
    return 0 if covered == len(groups) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debugmodel", help="torchtitan llama3 flavor (default debugmodel)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ce", choices=["auto", "on"], default="on")
    p.add_argument("--dry-run", action="store_true", help="CPU: the FSDP groups and what ce_overlap would do (no GPU)")
    p.add_argument("--profile", default="h200-sxm", help="cost model profile for --dry-run (default h200-sxm)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.seq_len < 1:
        p.error(f"--steps and --seq-len must be >= 1, got {args.steps} and {args.seq_len}")
    try:
        import torchtitan  # noqa: F401
        import torchtitan.distributed.fsdp  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 (any import failure is the answer: said, exit 2)
        print(f"torchtitan_fsdp2: torchtitan does not import with torch {torch.__version__}: {type(e).__name__}: {e}")
        return 2
    if args.dry_run:
        return dry_run(args.flavor, "auto" if args.ce == "auto" else "on", args.profile)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count()
    torch.cuda.set_device(0 if shared else local)
    dist.init_process_group("gloo" if shared else "nccl")
    rank0 = dist.get_rank() == 0
    results = {}
    for direct in (True, False):
        try:
            results[direct] = run(args.flavor, args.steps, args.seq_len, direct, args.ce)
        except Exception as e:  # noqa: BLE001 (reported: what fails with this torch and torchtitan)
            if rank0:
                import traceback

                traceback.print_exc()
            print(f"torchtitan_fsdp2: the {'direct' if direct else 'FSDP2-path'} run failed on rank "
                  f"{dist.get_rank()}: {type(e).__name__}: {str(e)[:400]}")
            dist.destroy_process_group()
            return 1
    same = results[True][0] == results[False][0]
    if rank0:
        print(f"torchtitan {getattr(torchtitan, '__version__', '?')} llama3 {args.flavor}, torch {torch.__version__}, "
              f"{dist.get_world_size()} ranks{' sharing one GPU' if shared else ''}")
        for direct in (True, False):
            losses, calls = results[direct]
            print(f"  {'direct path' if direct else 'FSDP2 path '}: losses {[f'{v:.6f}' for v in losses]}; {calls}")
        print(f"  losses bit-identical: {same}")
    dist.destroy_process_group()
    return 0 if same and all(v == v for v in results[True][0]) else 1


if __name__ == "__main__":
    sys.exit(main())
