"""`ce-overlap calibrate` itself (cli.py parses the arguments, `main` runs it): the launch checks, the GPUs and the
process group, the measurements (measurements.py) on every rank, then on rank 0 the profile built from them (fit.py),
written and reported (report.py); or, with --from-measurements, the profile from a saved measurements file alone."""
from __future__ import annotations

import json
import os
import sys

from ..errors import CeOverlapError
from .common import parse_size
from .fit import build_profile, write_profile
from .measurements import measure
from .report import print_summary
from .timing import all_ranks_ok, torch_module


def _base_profile(name: str | None, gpu_name: str) -> dict:
    from .. import profiles

    base = name or profiles.builtin_for_device(gpu_name)
    if base is None:
        raise CeOverlapError(f"no built-in profile for {gpu_name!r}: pass --base with the closest one "
                             f"({', '.join(profiles.names())}) or a profile file")
    return json.loads(profiles.read_text(base))


def _detect_topology(world: int) -> tuple[dict | None, str]:
    from .. import _core, topo

    try:
        d = topo.detect()
        if d is None:
            return None, "no GPUs visible"
        t = json.loads(_core.check_topology(json.dumps(topo.topology_json(d))))
        return t, ""
    except CeOverlapError as e:
        return None, str(e)


def _finish_profile(args, m: dict) -> int:
    base = _base_profile(args.base, m["gpu"]["name"])
    prof, notes = build_profile(base, m, name=args.name, keep_topology=args.keep_topology)
    write_profile(args.output, prof)
    print_summary(args.output, prof, base, m, notes)
    return 0


def main(args) -> int:
    """`ce-overlap calibrate` (cli.py parses the arguments). Exit 0 on success, 2 with one line on bad input,
    no GPU, or inconsistent measurements."""
    if args.from_measurements:
        try:
            with open(args.from_measurements, encoding="utf-8") as f:
                m = json.load(f)
        except json.JSONDecodeError as e:
            raise CeOverlapError(f"{args.from_measurements}: malformed JSON: {e}") from None
        return _finish_profile(args, m)
    under_torchrun, env_world = _check_launch(args)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: calibrate what the runtime uses
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    dist = _init_gpus(args, under_torchrun, env_world)
    try:
        return _measure_and_write(args, dist, under_torchrun, env_world)
    finally:
        if dist and dist.is_initialized():
            dist.destroy_process_group()


def _check_launch(args) -> tuple[bool, int]:
    """The sizes and the launch (plain, or torchrun on one node with --gpus processes) checked before any GPU work.
    Returns (under torchrun, its world size or 1)."""
    for text in (args.min_size, args.max_size, args.slowdown_size):
        parse_size(text)
    if parse_size(args.min_size) > parse_size(args.max_size):
        raise CeOverlapError(f"--min-size {args.min_size} is larger than --max-size {args.max_size}")
    under_torchrun = "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ
    env_world = int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun else 1
    if args.gpus and args.gpus > 1 and not under_torchrun:
        raise CeOverlapError(f"--gpus {args.gpus} needs one process per GPU: run `torchrun --standalone "
                             f"--nproc-per-node {args.gpus} -m ce_overlap.cli calibrate -o {args.output}` "
                             f"(a plain `ce-overlap calibrate` calibrates 1 GPU and skips the collectives)")
    if under_torchrun and int(os.environ.get("LOCAL_WORLD_SIZE", env_world)) != env_world:
        raise CeOverlapError("calibrate measures one node (CE lives inside one NVLink domain): run torchrun with "
                             "--nnodes 1")
    if args.gpus and under_torchrun and args.gpus != env_world:
        raise CeOverlapError(f"--gpus {args.gpus} but torchrun started {env_world} processes")
    return under_torchrun, env_world


def _init_gpus(args, under_torchrun: bool, env_world: int):
    """This process's GPU selected, and under torchrun with more than one process the NCCL process group started
    (torch.distributed, else None)."""
    torch = torch_module()
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise CeOverlapError("calibrate needs a CUDA GPU and none is visible (torch.cuda.is_available() is False); "
                             "`--from-measurements FILE` builds a profile from saved measurements without one")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank >= torch.cuda.device_count():
        raise CeOverlapError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible")
    torch.cuda.set_device(local_rank)
    dist = None
    if under_torchrun and env_world > 1:
        import torch.distributed as dist
        from datetime import timedelta

        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=180))
    return dist


def _measure_and_write(args, dist, under_torchrun: bool, env_world: int) -> int:
    """Every rank measures; rank 0 adds the topology, saves the measurements (--measurements) and writes the
    profile, and the other ranks wait for its verdict."""
    torch = torch_module()
    rank = dist.get_rank() if dist else 0
    if rank == 0 and not under_torchrun and torch.cuda.device_count() > 1:
        print(f"calibrate: 1 process, so 1 GPU of {torch.cuda.device_count()}: collectives skipped (run under "
              f"`torchrun --standalone --nproc-per-node {torch.cuda.device_count()} -m ce_overlap.cli calibrate` "
              f"for NCCL/CE curves and contention)", file=sys.stderr)
    elif rank == 0 and env_world == 1:
        print("calibrate: 1 GPU: collectives and contention skipped", file=sys.stderr)
    m = measure(args)
    prog = m.pop("progress")
    if rank != 0:
        return 0 if dist is None or all_ranks_ok(True) else 2  # rank 0 says why
    ok = False
    try:
        topo_json, why = _detect_topology(env_world)
        m["topology"] = topo_json
        if topo_json is None:
            m["skipped"]["topology"] = why
        if args.measurements:
            with open(args.measurements, "w", encoding="utf-8") as f:
                json.dump(m, f, indent=1)
        prog.step("profile")
        prog.close()
        rc = _finish_profile(args, m)
        ok = True
        return rc
    finally:
        if dist:
            all_ranks_ok(ok)  # the other ranks wait here for rank 0's verdict
