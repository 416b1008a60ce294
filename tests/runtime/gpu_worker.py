"""Multi-GPU checks of the CE runtime, one mode per torchrun launch (tests/runtime/test_runtime_gpu.py runs them):

    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py correctness --cases 1000
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py timeout
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py mismatch
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py nokernels

Every mode prints what it checked and exits 0 on success, 1 on a failed check (with the details printed).
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ce_overlap.runtime as rt

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.float64,
          torch.int8]
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD_BYTES = 4096


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def setup() -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=120))


def random_bits(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and denormals included): the compare is bitwise, so any pattern must survive."""
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=gen)
    return raw.view(dtype).reshape(shape)


def count_wrong(got: torch.Tensor, want: torch.Tensor) -> int:
    if got.numel() == 0:
        return 0
    itype = INT_OF_SIZE[got.element_size()]
    return int((got.reshape(-1).view(itype) != want.reshape(-1).view(itype)).sum().item())


def draw_case(rng: random.Random) -> dict:
    dtype = rng.choice(DTYPES)
    bucket = rng.random()
    if bucket < 0.03:
        numel = 0
    elif bucket < 0.35:
        numel = rng.randint(1, 64)
    elif bucket < 0.65:
        numel = rng.randint(65, 8192)
    elif bucket < 0.93:
        numel = rng.randint(8193, 1 << 20)
    else:
        numel = rng.randint(1 << 20, 3 << 20)  # multi-round when staged (CE_OVERLAP_STAGING_MB=1)
    # Factor numel into a shape of 1-3 dims (dim 0 is what gets gathered along).
    ndim = rng.choice([1, 2, 3])
    shape = [numel]
    for _ in range(ndim - 1):
        divisors = [d for d in (2, 3, 4, 5, 7, 8) if shape[-1] % d == 0 and shape[-1] > 0]
        if not divisors:
            break
        d = rng.choice(divisors)
        shape[-1] //= d
        shape.append(d)
    mode = rng.choice(["staged", "staged", "functional", "symmetric", "symmetric_inplace", "inplace", "offset_view"])
    return {
        "dtype": dtype, "shape": shape, "mode": mode,
        "side_stream": rng.random() < 0.25,
        "clobber_input_after": rng.random() < 0.3,
        "offset_elems": rng.randint(1, 17),
        "seed": rng.randrange(1 << 30),
    }


def run_case(case: dict, group, world: int, rank: int, side: torch.cuda.Stream) -> tuple[int, str]:
    """Returns (#wrong elements, problem description or '')."""
    dtype, shape, mode = case["dtype"], case["shape"], case["mode"]
    numel = int(torch.Size(shape).numel())
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(case["seed"] * 131 + rank)
    inp_data = random_bits(shape, dtype, gen)
    out_shape = [shape[0] * world, *shape[1:]]

    # Reference through NCCL (bitwise for every dtype).
    ref = torch.empty(out_shape, dtype=dtype, device="cuda")
    if numel > 0:
        dist.all_gather_into_tensor(ref, inp_data.contiguous(), group=group)

    stream_ctx = torch.cuda.stream(side) if case["side_stream"] else torch.cuda.stream(torch.cuda.current_stream())
    problems = []
    with stream_ctx:
        if case["side_stream"]:
            side.wait_stream(torch.cuda.default_stream())
        cur = torch.cuda.current_stream()
        # Output with a guard band behind it: the op must write exactly world * nbytes.
        out_bytes = numel * elem * world
        backing = torch.full((out_bytes + GUARD_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
        out = backing[:out_bytes].view(dtype).reshape(out_shape) if out_bytes else torch.empty(out_shape, dtype=dtype,
                                                                                                device="cuda")
        keep = []
        if mode in ("staged", "functional"):
            inp = inp_data.clone()
        elif mode == "offset_view":
            big = torch.empty(numel + case["offset_elems"], dtype=dtype, device="cuda")
            inp = big[case["offset_elems"]:].view(shape)  # unaligned start address
            inp.copy_(inp_data)
            keep.append(big)
        elif mode == "symmetric":
            inp = rt.empty_symmetric(shape, dtype, group)
            inp.copy_(inp_data)
            if numel > 0 and not rt.is_symmetric(inp, group):
                problems.append("empty_symmetric returned a tensor outside the pool")
        elif mode == "symmetric_inplace":
            sym_out = rt.empty_symmetric(out_shape, dtype, group)
            out = sym_out
            inp = sym_out.view(world, numel)[rank].view(shape) if numel else sym_out[:0]
            inp.copy_(inp_data)
        elif mode == "inplace":
            inp = out.view(world, -1)[rank].view(shape) if numel else out[:0]
            inp.copy_(inp_data)
        else:
            raise AssertionError(mode)

        if mode == "functional":
            out = rt.all_gather(inp, group)
        else:
            rt.all_gather_into_tensor(out, inp, group)
        out = rt.wait_tensor(out)
        if case["clobber_input_after"] and numel > 0 and mode not in ("inplace", "symmetric_inplace"):
            # Stream order: the op is finished with `inp` (and, zero-copy, so are the peers) before this runs.
            inp.view(torch.uint8 if elem == 1 else INT_OF_SIZE[elem]).fill_(0x5A)
        if tuple(out.shape) != tuple(out_shape) or out.dtype != dtype:
            problems.append(f"output shape/dtype {tuple(out.shape)} {out.dtype}, want {tuple(out_shape)} {dtype}")
        if cur is not torch.cuda.default_stream():
            torch.cuda.default_stream().wait_stream(cur)
    rt.synchronize(group)
    torch.cuda.synchronize()
    wrong = count_wrong(out, ref) if not problems else numel * world
    if mode not in ("symmetric_inplace", "functional") and out_bytes:
        guard = backing[out_bytes:]
        if not bool((guard == 0xA5).all().item()):
            problems.append("bytes behind the output were overwritten")
    del keep
    return wrong, "; ".join(problems)


def mode_correctness(args) -> int:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rt.rendezvous(group)
    log(rt.describe(group))
    side = torch.cuda.Stream()
    rng = random.Random(args.seed)  # identical on every rank: the cases are SPMD
    stats = collections.Counter()
    failures = []
    t0 = time.time()
    for i in range(args.cases):
        case = draw_case(rng)
        try:
            wrong, problem = run_case(case, group, world, rank, side)
        except Exception as e:  # noqa: BLE001 (report every failure with its case)
            wrong, problem = -1, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        key = (case["mode"], str(case["dtype"]).replace("torch.", ""))
        stats[key] += 1
        if wrong != 0 or problem:
            failures.append((i, case, wrong, problem))
            log(f"case {i} FAILED: {case} wrong={wrong} {problem}")
            if wrong == -1:
                break  # an exception may leave the group unusable; stop with the report
        if (i + 1) % 200 == 0:
            log(f"{i + 1}/{args.cases} cases, {len(failures)} failed, {time.time() - t0:.1f} s")
    # Every rank must agree: a failure on one rank fails the run on all.
    nfail = torch.tensor([len(failures)], device="cuda")
    dist.all_reduce(nfail)
    if rank == 0:
        print(f"{'mode':<20} {'dtype':<10} cases")
        for (mode, dtype), n in sorted(stats.items()):
            print(f"{mode:<20} {dtype:<10} {n}")
    log(f"correctness: {args.cases} cases, {len(failures)} failed here, {int(nfail.item())} failed on all ranks, "
        f"{time.time() - t0:.1f} s; {rt.describe(group)}")
    return 0 if int(nfail.item()) == 0 else 1


def mode_timeout(args) -> int:
    """Rank 1 rendezvouses but never calls the collective: rank 0 must raise within the timeout plus a margin."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    timeout_s = float(os.environ["CE_OVERLAP_TIMEOUT_S"])
    rt.rendezvous(group)
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank != 0:
        log("not calling the collective; waiting for rank 0 to report")
        store.wait(["ce_test/timeout_done"], timedelta(seconds=timeout_s + 120))
        return 0
    ok = True
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty(2 << 20, device="cuda")
    t0 = time.time()
    rt.all_gather_into_tensor(out, x, group)
    try:
        rt.synchronize(group)
        log("FAILED: synchronize returned although rank 1 never called the collective")
        ok = False
    except RuntimeError as e:
        elapsed = time.time() - t0
        msg = str(e)
        log(f"raised after {elapsed:.1f} s (timeout {timeout_s} s): {msg}")
        for needle in ("timeout", "all_gather_into_tensor", f"group '{group.group_name}'", "rank 0", "[1]"):
            if needle not in msg:
                log(f"FAILED: the message does not name {needle!r}")
                ok = False
        if not (0.9 * timeout_s <= elapsed <= timeout_s + 10):
            log(f"FAILED: raised after {elapsed:.1f} s, expected within [{0.9 * timeout_s}, {timeout_s + 10}] s")
            ok = False
    # The GPU stream must have been released: a device-wide sync returns.
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    if not done.wait(15):
        log("FAILED: torch.cuda.synchronize() still blocks 15 s after the timeout: the stream was not released")
        ok = False
    # The failed group refuses new work at once, and wait_tensor surfaces the failure.
    for what, fn in (("a new all-gather", lambda: rt.all_gather_into_tensor(out, x, group)),
                     ("wait_tensor", lambda: rt.wait_tensor(out))):
        try:
            fn()
            log(f"FAILED: {what} on the failed group did not raise")
            ok = False
        except RuntimeError as e:
            log(f"{what} raised as expected: {str(e)[:160]}...")
    store.set("ce_test/timeout_done", "1")
    return 0 if ok else 1


def mode_mismatch(args) -> int:
    """The ranks call the all-gather with different sizes: both must raise a timeout naming the mismatch."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    rt.rendezvous(group)
    dist.barrier()
    n = 1024 if rank == 0 else 2048
    x = torch.randn(n, device="cuda")
    out = torch.empty(2 * n, device="cuda")
    rt.all_gather_into_tensor(out, x, group)
    try:
        rt.synchronize(group)
        log("FAILED: mismatched sizes were not detected (or the signatures collided, probability 1/961)")
        return 1
    except RuntimeError as e:
        msg = str(e)
        log(f"raised: {msg}")
        if "different collective" not in msg:
            log("FAILED: the message does not say the peer posted a different collective")
            return 1
    return 0


def mode_nokernels(args) -> int:
    """The CE all-gather must launch no GPU kernel (copies and stream memory ops only); NCCL's does (sanity)."""
    from torch.profiler import ProfilerActivity, profile

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rt.rendezvous(group)
    x = torch.randn(4 << 20, device="cuda")
    sym = rt.empty_symmetric(x.shape, x.dtype, group)
    sym.copy_(x)
    out = torch.empty(world * x.numel(), device="cuda")
    sym_out = rt.empty_symmetric((world * x.numel(),), x.dtype, group)
    inplace_in = sym_out.view(world, -1)[rank]
    inplace_in.copy_(x)
    torch.cuda.synchronize()

    def gpu_activities(fn) -> collections.Counter:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        names = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                names[ev.name] += 1
        return names

    def is_kernel(name: str) -> bool:
        low = name.lower()
        return not (low.startswith("memcpy") or low.startswith("memset") or "sync" in low)

    ok = True
    for label, fn in (("nccl", lambda: dist.all_gather_into_tensor(out, x, group=group)),
                      ("ce_staged", lambda: rt.all_gather_into_tensor(out, x, group)),
                      ("ce_symmetric", lambda: rt.all_gather_into_tensor(out, sym, group)),
                      ("ce_symmetric_inplace", lambda: rt.all_gather_into_tensor(sym_out, inplace_in, group))):
        names = gpu_activities(fn)
        kernels = {n: c for n, c in names.items() if is_kernel(n)}
        log(f"{label}: GPU activities {dict(names)}")
        if label == "nccl":
            if not kernels:
                log("note: the profiler saw no NCCL kernel, so it may not see kernels at all; the CE check is weak")
        elif kernels:
            log(f"FAILED: {label} launched kernels: {kernels}")
            ok = False
    rt.synchronize(group)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["correctness", "timeout", "mismatch", "nokernels"])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    ok, reason = rt.available()
    if not ok:
        print(f"ce_overlap runtime not available: {reason}", flush=True)
        return 1
    setup()
    try:
        rc = {"correctness": mode_correctness, "timeout": mode_timeout, "mismatch": mode_mismatch,
              "nokernels": mode_nokernels}[args.mode](args)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    if args.mode in ("timeout", "mismatch"):
        # The CE group is failed and NCCL may hold state of a peer that left: exit without collective teardown.
        os._exit(rc)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return rc


if __name__ == "__main__":
    sys.exit(main())
