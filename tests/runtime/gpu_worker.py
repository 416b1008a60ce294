"""Multi-GPU checks of the CE runtime, one mode per torchrun launch (tests/runtime/test_runtime_gpu.py runs them):

    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py correctness --cases 1000
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py reduce_scatter --rs-cases 300
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py parts --parts-cases 300
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py symalloc
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py nokernels
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py a2a_bcast,p2p --a2a-cases 1000 --p2p-cases 1000
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py timeout,mismatch,p2p_faults
    torchrun --standalone --nproc-per-node 2 tests/runtime/gpu_worker.py lifetimes

Modes can be chained (comma list) to share one start-up. Every mode prints what it checked; the process exits 0 when
every mode passed, 1 otherwise (with the details printed).

On a machine with one GPU (CE_TEST_SHARED_GPU=1, which tests/runtime/test_runtime_gpu.py sets there) both ranks share
GPU 0: the CE protocol (CUDA IPC, stream memory operations, copies, the reduction kernel, timeouts) runs on real CUDA,
but NCCL refuses two ranks on one GPU, so the references run over gloo on host copies of the bytes (bit-exact for
data movement; reduce-scatter's reference sums in fp32 on the host). Bandwidth means nothing there.

Hangs are bounded: every step (mode set-up, each case, each synchronize) first calls step(), which names it in this
rank's progress file ($CE_TEST_PROGRESS_DIR/rank<r>.txt, printed by the test when the run fails or hangs; echoed to
stdout by the timeout/mismatch modes) and re-arms a deadline (faulthandler.dump_traceback_later): a step that does
not finish in time dumps every thread's Python stack to stderr and exits the process with status 1.
"""
from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import random
import re
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import ce_overlap.runtime as rt
import ce_overlap.runtime.testing as rtt
from ce_overlap import _core

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8, torch.float64,
          torch.int8]
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
GUARD_BYTES = 4096


SHARED_GPU = os.environ.get("CE_TEST_SHARED_GPU") == "1"


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def ce_timeout_s() -> float:
    return float(os.environ.get("CE_OVERLAP_TIMEOUT_S", "60"))


def default_deadline_s() -> float:
    """How long one step may take before the worker gives up: the CE watchdog turns a stuck op into an error after
    CE_OVERLAP_TIMEOUT_S, so a step that outlives that by far is a hang outside the CE protocol's reach."""
    return float(os.environ.get("CE_TEST_STEP_DEADLINE_S", "0")) or ce_timeout_s() + 30


def step(what: str, deadline_s: float | None = None, echo: bool = False) -> None:
    """Names the next step (progress file, and stdout when echo) and re-arms the hang deadline for it."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    progress_dir = os.environ.get("CE_TEST_PROGRESS_DIR")
    text = f"{time.strftime('%H:%M:%S')} {what}"
    if progress_dir:
        try:
            with open(os.path.join(progress_dir, f"rank{rank}.txt"), "w") as f:
                f.write(text + "\n")
        except OSError:
            pass
    if echo:
        print(f"[rank {rank}] step: {what}", flush=True)
    faulthandler.dump_traceback_later(deadline_s or default_deadline_s(), exit=True)


def wait_device_idle(seconds: float) -> bool:
    """torch.cuda.synchronize() in a helper thread, bounded: False when the device is still busy after `seconds`."""
    done = threading.Event()
    threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
    return done.wait(seconds)


def setup() -> None:
    if SHARED_GPU:  # every rank on GPU 0; references over gloo (NCCL refuses two ranks on one GPU)
        torch.cuda.set_device(0)
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timedelta(seconds=120))


# ---------------------------------------------------------------------------------------------------------------
# References: NCCL on the tensors themselves, or (shared GPU) gloo on host copies of their bytes. Data movement
# is compared bitwise, so moving bytes is the exact reference whatever the dtype.

def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _moved(collective, out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """collective(out, inp, group=group), a data-movement collective with equal shares: on the tensors (NCCL), or
    (shared GPU) over gloo on host copies of their bytes."""
    if not SHARED_GPU:
        collective(out, inp.contiguous(), group=group)
        return
    host = torch.empty(out.numel() * out.element_size(), dtype=torch.uint8)
    collective(host, _bytes(inp.contiguous()).cpu(), group=group)
    _bytes(out).copy_(host)


def ref_all_gather(ref: torch.Tensor, inp: torch.Tensor, group) -> None:
    _moved(dist.all_gather_into_tensor, ref, inp, group)


def ref_all_to_all(ref: torch.Tensor, inp: torch.Tensor, group) -> None:
    _moved(dist.all_to_all_single, ref, inp, group)


def ref_broadcast(t: torch.Tensor, src: int, group) -> None:
    """src: the global rank."""
    if not SHARED_GPU:
        dist.broadcast(t, src=src, group=group)
        return
    host = _bytes(t).cpu()
    dist.broadcast(host, src=src, group=group)
    _bytes(t).copy_(host)


def avg_of_sum(total: torch.Tensor, world: int) -> torch.Tensor:
    """The runtime's avg of an fp32 sum: times float32(1 / world), explicitly (torch's CUDA division by a Python
    scalar multiplies by the reciprocal, its CPU division does not; at 3 ranks the two differ in the last bit)."""
    return total * (1.0 / world)


def ref_reduce_scatter(ref: torch.Tensor, inp: torch.Tensor, op: str, group) -> None:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not SHARED_GPU:
        if op == "sum" or world & (world - 1) == 0:  # avg at 2, 4, 8 ranks: NCCL's own, exact like ours for ints
            dist.reduce_scatter_tensor(ref, inp.clone(), op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG,
                                       group=group)
            return
        # NCCL's float avg scales each input before the sum; ours scales the sum: compare with NCCL's sum, scaled.
        dist.reduce_scatter_tensor(ref, inp.clone(), op=dist.ReduceOp.SUM, group=group)
        ref.copy_(avg_of_sum(ref.float(), world).to(ref.dtype))
        return
    host = torch.empty(world * inp.numel(), dtype=torch.float32)
    dist.all_gather_into_tensor(host, inp.reshape(-1).float().cpu(), group=group)
    total = host.view(world, -1).sum(0)  # one rounding to the dtype below, as NCCL's for two ranks
    if op == "avg":
        total = avg_of_sum(total, world)
    ref.copy_(total.view(world, -1)[rank].view(ref.shape).to(ref.dtype))


def ref_p2p(sends: list, recvs: list, group) -> None:
    """sends: (tensor, global dst); recvs: (tensor, global src); all complete on return."""
    if not SHARED_GPU:
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return
    host_recvs = [(t, torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)) for t, _ in recvs]
    ops = [dist.P2POp(dist.isend, _bytes(t).cpu(), peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, h, peer, group) for (_, h), (_, peer) in zip(host_recvs, recvs)]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    for t, h in host_recvs:
        _bytes(t).copy_(h)


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


def failed_on_all_ranks(failures: int) -> int:
    """Every rank's failure count summed: a failure on one rank fails the mode on all (and they agree on it)."""
    total = torch.tensor([failures], device="cpu" if SHARED_GPU else "cuda")
    dist.all_reduce(total)
    return int(total.item())


def checked_case(run, *args) -> tuple[int, str]:
    """One randomized case: run(*args) -> (wrong bytes, problem); an exception becomes (-1, its message), its
    traceback printed, so every failure is reported with its case and the mode goes on to the next."""
    try:
        return run(*args)
    except Exception as e:  # noqa: BLE001 (report every failure with its case)
        traceback.print_exc()
        return -1, f"{type(e).__name__}: {e}"


def finish_cases(label: str, cases: int, failed_here: int, table: list[str], t0: float, group) -> int:
    """The end of a randomized mode: every rank agrees on the failure count (a failure on one rank fails the mode on
    all), rank 0 prints the table of cases, every rank its closing line. Returns the mode's exit code."""
    nfail = failed_on_all_ranks(failed_here)
    if dist.get_rank() == 0:
        print("\n".join(table))
    log(f"{label}: {cases} cases, {failed_here} failed here, {nfail} failed on all ranks, {time.time() - t0:.1f} s; "
        f"{rt.describe(group)}")
    return 0 if nfail == 0 else 1


def draw_size(rng: random.Random, bands: list[tuple[float, int, int]]) -> int:
    """A size from bands [(cumulative probability, lo, hi)]: one rng.random() picks the first band whose bound it
    is below, then rng.randint(lo, hi) in it; a band (p, 0, 0) is the size 0 and draws nothing more."""
    x = rng.random()
    for bound, lo, hi in bands:
        if x < bound or bound >= 1.0:
            return 0 if hi == 0 else rng.randint(lo, hi)
    raise AssertionError(f"bands {bands} end below 1")


def draw_local_tuning(rng: random.Random) -> dict:
    """The runtime's local knobs for one case, drawn alike on every rank (the rng is seeded alike); local_tuning makes
    the ranks differ: rank r runs on (lanes + r) % 4 peer lanes (0 = one per peer) with peer signalling mode
    (sync + r) % 3 (each peer in turn, per round, per round batched), and even ranks hold their copies to `rate` GB/s
    (0 = unlimited; paced copies go in chunks behind a pacer) while odd ranks copy unlimited."""
    return {"lanes": rng.randrange(4), "rate": rng.choice([0, 0, 0, 20, 150]), "sync": rng.randrange(3)}


# What a mode that drew local_tuning leaves for the modes after it: unpaced copies (a group's copy rate runs a pacer
# kernel before each chunk, which nokernels would count). Peer lanes and signalling stay as drawn: every mode runs
# on any of them.
UNPACED = {"copy_rate_gbps": 0}


def local_tuning(case: dict, rank: int) -> dict:
    """testing.tune's keywords for this rank from a case's draw_local_tuning."""
    return {"peer_lanes": (case["lanes"] + rank) % 4, "copy_rate_gbps": case["rate"] if rank % 2 == 0 else 0,
            "peer_sync": (case["sync"] + rank) % 3}


def draw_case(rng: random.Random) -> dict:
    dtype = rng.choice(DTYPES)
    # The last band is multi-round when staged (CE_OVERLAP_STAGING_MB=1).
    numel = draw_size(rng, [(0.03, 0, 0), (0.35, 1, 64), (0.65, 65, 8192), (0.93, 8193, 1 << 20),
                            (1.0, 1 << 20, 3 << 20)])
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
    mode = rng.choice(["staged", "staged", "functional", "deferred", "symmetric", "symmetric_inplace", "inplace",
                       "offset_view", "symmetric_out_pull", "symmetric_inplace_push", "symmetric_out_push"])
    return {
        "dtype": dtype, "shape": shape, "mode": mode,
        "side_stream": rng.random() < 0.25,
        "clobber_input_after": rng.random() < 0.3,
        "offset_elems": rng.randint(1, 17),
        "seed": rng.randrange(1 << 30),
        # Pieces each pulled peer copy is split into (local: rank 1 uses split % 4 + 1, so the ranks differ).
        "split": rng.choice([1, 1, 2, 3, 4]),
        **draw_local_tuning(rng),
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

    # The reference (NCCL, or gloo when the ranks share a GPU), compared bitwise for every dtype.
    ref = torch.empty(out_shape, dtype=dtype, device="cuda")
    if numel > 0:
        ref_all_gather(ref, inp_data, group)

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
        if mode in ("staged", "functional", "deferred"):
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
        elif mode in ("symmetric_inplace", "symmetric_inplace_push"):
            sym_out = rt.empty_symmetric(out_shape, dtype, group)
            out = sym_out
            inp = sym_out.view(world, numel)[rank].view(shape) if numel else sym_out[:0]
            inp.copy_(inp_data)
        elif mode in ("symmetric_out_pull", "symmetric_out_push"):
            out = rt.empty_symmetric(out_shape, dtype, group)  # output in the pool, input ordinary memory
            if out.numel():
                out.view(torch.uint8).fill_(0xA5)
            inp = inp_data.clone()
        elif mode == "inplace":
            inp = out.view(world, -1)[rank].view(shape) if numel else out[:0]
            inp.copy_(inp_data)
        else:
            raise AssertionError(mode)

        rtt.tune(group, pull_split=case["split"] if rank == 0 else case["split"] % 4 + 1,
                 **local_tuning(case, rank))
        previous_mode = rtt.set_all_gather_mode("push" if mode.endswith("_push") else "pull")
        try:
            if mode == "functional":
                out = rt.all_gather(inp, group)
            elif mode == "deferred":  # the raw functional op: the caller's stream joins only at wait_tensor below
                out = torch.ops.ce_overlap.all_gather_into_tensor(inp, world, group.group_name)
                busy = torch.randn(512, 512, device="cuda")
                for _ in range(4):
                    busy = busy @ busy  # caller-stream work between the op and its wait (overlaps it)
            else:
                rt.all_gather_into_tensor(out, inp, group)
        finally:
            rtt.set_all_gather_mode(previous_mode)
        out = rt.wait_tensor(out)
        if case["clobber_input_after"] and numel > 0 and mode not in ("inplace", "symmetric_inplace",
                                                                        "symmetric_inplace_push"):
            # Stream order: the op is finished with `inp` (and, zero-copy, so are the peers) before this runs.
            inp.view(torch.uint8 if elem == 1 else INT_OF_SIZE[elem]).fill_(0x5A)
        if tuple(out.shape) != tuple(out_shape) or out.dtype != dtype:
            problems.append(f"output shape/dtype {tuple(out.shape)} {out.dtype}, want {tuple(out_shape)} {dtype}")
        if cur is not torch.cuda.default_stream():
            torch.cuda.default_stream().wait_stream(cur)
    rt.synchronize(group)
    torch.cuda.synchronize()
    wrong = count_wrong(out, ref) if not problems else numel * world
    if not mode.startswith("symmetric_") and mode not in ("functional", "deferred") and out_bytes:
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
        step(f"correctness case {i}: {case['mode']} {str(case['dtype']).replace('torch.', '')} {case['shape']} "
             f"split {case['split']}")
        wrong, problem = checked_case(run_case, case, group, world, rank, side)
        key = (case["mode"], str(case["dtype"]).replace("torch.", ""))
        stats[key] += 1
        if wrong != 0 or problem:
            failures.append((i, case, wrong, problem))
            log(f"case {i} FAILED: {case} wrong={wrong} {problem}")
            if wrong == -1:
                break  # an exception may leave the group unusable; stop with the report
        if (i + 1) % 200 == 0:
            log(f"{i + 1}/{args.cases} cases, {len(failures)} failed, {time.time() - t0:.1f} s")
    rtt.tune(group, pull_split=1, **UNPACED)
    step("correctness: all_reduce of the failure count")
    table = [f"{'mode':<20} {'dtype':<10} cases"] + [f"{m:<20} {d:<10} {n}" for (m, d), n in sorted(stats.items())]
    return finish_cases("correctness", args.cases, len(failures), table, t0, group)


def mode_timeout(args) -> int:
    """The last rank rendezvouses but never calls the collective: every other rank must raise within the timeout
    plus a margin, naming the op, the group, itself and the missing rank."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    staller = world - 1
    timeout_s = ce_timeout_s()
    step("timeout: rendezvous + barrier", echo=True)
    rt.rendezvous(group)
    store = dist.distributed_c10d._get_default_store()
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty(world << 20, device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    if rank == staller:
        step(f"timeout: rank {staller} does not call the collective; waiting for the others to report",
             deadline_s=timeout_s + 60, echo=True)
        store.wait([f"ce_test/timeout_done/{r}" for r in range(staller)], timedelta(seconds=timeout_s + 50))
        return 0
    ok = True
    t0 = time.time()
    step(f"timeout: enqueue the all-gather rank {staller} never joins", echo=True)
    rt.all_gather_into_tensor(out, x, group)
    try:
        step("timeout: synchronize (must raise after the timeout)", deadline_s=timeout_s + 30, echo=True)
        rt.synchronize(group)
        log(f"FAILED: synchronize returned although rank {staller} never called the collective")
        ok = False
    except RuntimeError as e:
        elapsed = time.time() - t0
        msg = str(e)
        log(f"raised after {elapsed:.1f} s (timeout {timeout_s} s): {msg}")
        for needle in ("timeout", "all_gather_into_tensor", f"group '{group.group_name}'", f"rank {rank}"):
            if needle not in msg:
                log(f"FAILED: the message does not name {needle!r}")
                ok = False
        # The peers whose flags never arrived: the staller among them (with more ranks the others it kept waiting
        # are stuck too and may be listed beside it).
        listed = re.search(r"never arrived: \[([0-9, ]*)\]", msg)
        if not listed or str(staller) not in [t.strip() for t in listed.group(1).split(",")]:
            log(f"FAILED: the message does not list rank {staller} among the peers whose flags never arrived")
            ok = False
        if not (0.9 * timeout_s <= elapsed <= timeout_s + 10):
            log(f"FAILED: raised after {elapsed:.1f} s, expected within [{0.9 * timeout_s}, {timeout_s + 10}] s")
            ok = False
    # The GPU stream must have been released: a device-wide sync returns.
    step("timeout: the stuck stream must drain (bounded torch.cuda.synchronize)", echo=True)
    if not wait_device_idle(15):
        log("FAILED: torch.cuda.synchronize() still blocks 15 s after the timeout: the stream was not released")
        ok = False
    # The failed group refuses new work at once, and wait_tensor surfaces the failure.
    for what, fn in (("a new all-gather", lambda: rt.all_gather_into_tensor(out, x, group)),
                     ("wait_tensor", lambda: rt.wait_tensor(out))):
        step(f"timeout: {what} on the failed group must raise", echo=True)
        try:
            fn()
            log(f"FAILED: {what} on the failed group did not raise")
            ok = False
        except RuntimeError as e:
            log(f"{what} raised as expected: {str(e)[:160]}...")
    store.set(f"ce_test/timeout_done/{rank}", "1")
    return 0 if ok else 1


def _expect_timeout(label: str, group, fn, needles: list[str]) -> bool:
    """Runs fn() (a collective the ranks call inconsistently), then expects synchronize to raise naming `needles`,
    and the device to drain afterwards (the watchdog poisons the stuck waits). Every step is bounded."""
    timeout_s = ce_timeout_s()
    ok = True
    try:
        step(f"[{label}] enqueue", deadline_s=timeout_s + 20, echo=True)
        fn()
        step(f"[{label}] synchronize (must raise after {timeout_s} s)", deadline_s=timeout_s + 20, echo=True)
        rt.synchronize(group)
        log(f"FAILED [{label}]: the mismatch was not detected (or the signatures collided, probability 1/961)")
        ok = False
    except RuntimeError as e:
        msg = str(e)
        log(f"[{label}] raised: {msg[:600]}")
        missing = [n for n in needles if n not in msg]
        if missing:
            log(f"FAILED [{label}]: the message does not name {missing}")
            ok = False
    step(f"[{label}] the released streams must drain (bounded torch.cuda.synchronize)", deadline_s=30, echo=True)
    if not wait_device_idle(15):
        log(f"FAILED [{label}]: the device is still busy 15 s after the timeout: a stream was not released")
        ok = False
    return ok


def mode_mismatch(args) -> int:
    """Ranks call a collective inconsistently; both must raise a timeout naming the mismatch. Each case runs on its
    own process group (its own CE pool), because a timed-out group refuses every later op. Every tensor is made (and
    every torch kernel the cases need is loaded) before the first case: nothing but the CE ops runs between them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    step("mismatch: 6 process groups + rendezvous + inputs", echo=True)
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(6)]
    for g in groups:
        rt.rendezvous(g)
    n = 1024 if rank == 0 else 2048
    ag_in, ag_out = torch.randn(n, device="cuda"), torch.empty(world * n, device="cuda")
    rs_in, rs_out = torch.randn(world * n, device="cuda"), torch.empty(n, device="cuda")
    # Same bytes, different dtype: fp32 x 1024 per rank vs bf16 x 2048 per rank.
    dt = torch.float32 if rank == 0 else torch.bfloat16
    m = 1024 if rank == 0 else 2048
    rs2_in, rs2_out = torch.randn(world * m, device="cuda").to(dt), torch.empty(m, device="cuda", dtype=dt)
    g3 = groups[3]
    sym_out = rt.empty_symmetric((world * 4096,), torch.float32, g3)
    shard = sym_out.view(world, -1)[rank]
    shard.fill_(rank)
    # The same bytes in different parts: [1000, 3000] elements on rank 0, [3000, 1000] on rank 1.
    split = [1000, 3000] if rank == 0 else [3000, 1000]
    parts_in = [torch.randn(k, device="cuda") for k in split]
    same_in = torch.randn(world * 4096, device="cuda")  # the same everywhere: reduced on rank 0, not on the others
    torch.cuda.synchronize()
    dist.barrier()
    ok = True
    g = groups[0]
    ok &= _expect_timeout("all_gather sizes", g, lambda: rt.all_gather_into_tensor(ag_out, ag_in, g),
                          ["different collective", "all_gather_into_tensor"])
    g = groups[1]
    # The first reduce-scatter of this process, so the first launch of the reduction kernel: it must not wait
    # for the device to go idle while the comm stream waits for the mismatched peer (kernels load at rendezvous).
    ok &= _expect_timeout("reduce_scatter sizes", g, lambda: rt.reduce_scatter_tensor(rs_out, rs_in, "sum", g),
                          ["different collective", "reduce_scatter_tensor"])
    g = groups[2]
    ok &= _expect_timeout("reduce_scatter dtype", g, lambda: rt.reduce_scatter_tensor(rs2_out, rs2_in, "sum", g),
                          ["different collective", "reduce_scatter_tensor"])

    def push_vs_pull():
        previous = rtt.set_all_gather_mode("push" if rank == 0 else "pull")
        try:
            rt.all_gather_into_tensor(sym_out, shard, g3)
        finally:
            rtt.set_all_gather_mode(previous)

    ok &= _expect_timeout("all_gather push vs pull", g3, push_vs_pull, ["different collective", "push"])
    g4 = groups[4]
    ok &= _expect_timeout("all_gather_into_tensors parts", g4,
                          lambda: torch.ops.ce_overlap.all_gather_into_tensors(parts_in, dist.get_world_size(), g4.group_name),
                          ["different collective", "all_gather_into_tensors"])
    g5 = groups[5]

    def reduced_vs_unreduced():
        if rank == 0:
            torch.ops.ce_overlap.reduce_scatter_tensors([same_in], "sum", world, g5.group_name)
        else:
            torch.ops.ce_overlap.reduce_scatter_tensors_unreduced([same_in], world, g5.group_name)

    ok &= _expect_timeout("reduce_scatter reduced vs unreduced", g5, reduced_vs_unreduced,
                          ["different collective", "copied out unreduced", "+ reduction"])
    return 0 if ok else 1


def mode_nokernels(args) -> int:
    """The CE all-gathers, all-to-alls, broadcasts and sends / receives must launch no GPU kernel (copies and stream
    memory ops only), the reduce-scatter only its reduction; NCCL's all-gather does (sanity)."""
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

    rs_in = torch.randn(world * x.numel(), device="cuda", dtype=torch.bfloat16)
    rs_out = torch.empty(x.numel(), device="cuda", dtype=torch.bfloat16)
    a2a_out = torch.empty_like(x)
    sym_a2a_in = rt.empty_symmetric(x.shape, x.dtype, group)
    sym_a2a_in.copy_(x)
    bc = x.clone()
    sym_bc = rt.empty_symmetric(x.shape, x.dtype, group)
    sym_bc.copy_(x)
    peer = (rank + 1) % world
    src = (rank - 1) % world
    p2p_in, p2p_out = x.clone(), torch.empty_like(x)
    # Direct: rank k sends from its bufs[k] into bufs[k] of rank k+1 (one allocation per sender, the same offsets).
    bufs = [rt.empty_symmetric(x.shape, x.dtype, group) for _ in range(world)]
    bufs[rank].copy_(x)
    torch.cuda.synchronize()

    def ring(send_t, recv_t):
        return lambda: rt.batch_isend_irecv([rt.P2POp("send", send_t, peer), rt.P2POp("recv", recv_t, src)], group)

    def push(fn):
        def run():
            previous = rtt.set_all_gather_mode("push")
            try:
                fn()
            finally:
                rtt.set_all_gather_mode(previous)
        return run

    def split3(fn):
        def run():
            rtt.tune(group, pull_split=3)
            try:
                fn()
            finally:
                rtt.tune(group, pull_split=1)
        return run

    def ag_parts():  # three parts of one bucket: staged piece by piece, pulled straight into the three outputs
        return torch.ops.ce_overlap.all_gather_into_tensors([x, x[:1000], x[:5]], world, group.group_name)

    def rs_parts():
        return torch.ops.ce_overlap.reduce_scatter_tensors([rs_in, rs_in[:world * 1000]], "sum", world, group.group_name)

    def rs_unreduced():  # the exchange alone: copy engines only, no reduction kernel
        return torch.ops.ce_overlap.reduce_scatter_tensors_unreduced([rs_in, rs_in[:world * 1000]], world,
                                                                     group.group_name)

    ok = True
    seen: dict[str, collections.Counter] = {}
    nccl = [] if SHARED_GPU else [("nccl", lambda: dist.all_gather_into_tensor(out, x, group=group))]
    for label, fn in (*nccl,
                      ("ce_staged", lambda: rt.all_gather_into_tensor(out, x, group)),
                      ("ce_symmetric", lambda: rt.all_gather_into_tensor(out, sym, group)),
                      ("ce_symmetric_inplace", lambda: rt.all_gather_into_tensor(sym_out, inplace_in, group)),
                      ("ce_push_inplace", push(lambda: rt.all_gather_into_tensor(sym_out, inplace_in, group))),
                      ("ce_push_from_ordinary_input", push(lambda: rt.all_gather_into_tensor(sym_out, x, group))),
                      ("ce_symmetric_inplace_split3", split3(lambda: rt.all_gather_into_tensor(sym_out, inplace_in,
                                                                                              group))),
                      ("ce_all_to_all_staged", lambda: rt.all_to_all_single(a2a_out, x, group)),
                      ("ce_all_to_all_symmetric", lambda: rt.all_to_all_single(a2a_out, sym_a2a_in, group)),
                      ("ce_broadcast_staged", lambda: rt.broadcast(bc, 0, group)),
                      ("ce_broadcast_symmetric", lambda: rt.broadcast(sym_bc, 0, group)),
                      ("ce_p2p_staged", ring(p2p_in, p2p_out)),
                      ("ce_p2p_direct", ring(bufs[rank], bufs[src])),
                      ("ce_reduce_scatter", lambda: rt.reduce_scatter_tensor(rs_out, rs_in, "sum", group)),
                      ("ce_all_gather_into_tensors", lambda: [rt.wait_tensor(t) for t in ag_parts()]),
                      ("ce_reduce_scatter_tensors", lambda: rt.wait_tensor(rs_parts())),
                      ("ce_rs_unreduced", lambda: rt.wait_tensor(rs_unreduced()))):
        step(f"nokernels: {label}")
        names = gpu_activities(fn)
        seen[label] = names
        kernels = {n: c for n, c in names.items() if is_kernel(n)}
        log(f"{label}: GPU activities {dict(names)}")
        if label == "nccl":
            if not kernels:
                log("note: the profiler saw no NCCL kernel, so it may not see kernels at all; the CE check is weak")
        elif label.startswith("ce_reduce_scatter"):
            # Exactly one kernel per op and round: the bounded reduction. Nothing else.
            others = {n: c for n, c in kernels.items() if "reduce_kernel" not in n}
            if others or not kernels:
                log(f"FAILED: reduce-scatter kernels {kernels}: expected only ce_overlap's reduce_kernel")
                ok = False
        elif kernels:
            log(f"FAILED: {label} launched kernels: {kernels}")
            ok = False
        elif label.endswith("_split3"):
            # 16 MiB per rank in 3 pieces: 2 more peer copies per op than unsplit (the flag copies count too), 3 ops.
            # (Two ranks sharing one GPU copy device to device, not peer to peer.)
            copy_kind = "DtoD" if SHARED_GPU else "PtoP"
            # (Not `peer`: the ring lambdas above read that name when they run.)
            copies = {k: sum(c for n, c in v.items() if copy_kind in n) for k, v in seen.items()}
            if copies[label] != copies["ce_symmetric_inplace"] + 6:
                log(f"FAILED: {label}: expected {copies['ce_symmetric_inplace'] + 6} peer copies (unsplit + 2 pieces "
                    f"x 3 ops), got {copies[label]}: {dict(names)}")
                ok = False
    rt.synchronize(group)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------------
# Reduce-scatter vs NCCL

RS_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
def rs_outside_exact(out: torch.Tensor, inp: torch.Tensor, op: str, group) -> int:
    """Elements of this rank's reduce-scatter output farther from the exact result (every rank's input, gathered, summed
    in float64) than the runtime's reduction allows: an fp32 sum of the n terms (error <= (n-1) 2^-24 sum|t|, bounded
    by 2^-23 sum|t|), rounded once to the dtype (<= eps/2 |exact|, bounded by eps |exact|, or, where the result is
    subnormal in the dtype, half its subnormal spacing: an fp16 avg of two subnormals, e.g. 2^-24 / 2, has no
    relative bound; 100M-element random fp16 cases met it a few times per run, 2026-11-27). NCCL is no reference for
    random data beyond 2 ranks: its ring rounds to the dtype at every hop (3 roundings at 4 ranks)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if inp.numel() == 0:
        return 0
    gathered = torch.empty(world * inp.numel(), dtype=inp.dtype, device="cuda")
    ref_all_gather(gathered, inp.reshape(-1), group)
    terms = gathered.view(world, world, -1)[:, rank].double()  # [source rank, element of our chunk]
    exact = terms.sum(0) / (world if op == "avg" else 1)
    fi = torch.finfo(out.dtype)
    bound = fi.eps * exact.abs() + 2.0 ** -23 * terms.abs().sum(0) + fi.tiny * fi.eps  # the last: subnormal spacing
    return int(((out.reshape(-1).double() - exact).abs() > bound).sum().item())


def rendezvous_rs_rounds(group) -> tuple[int, dict]:
    """Rendezvous on `group`; its reduce-scatter round (bytes per rank) and that round in elements per dtype."""
    name = rt.rendezvous(group)
    round_bytes = rtt.reduce_scatter_round_bytes(name)
    return round_bytes, {dt: round_bytes // torch.empty((), dtype=dt).element_size() for dt in RS_DTYPES}


def draw_rs_case(rng: random.Random, round_elems: dict) -> dict:
    dtype = rng.choice(RS_DTYPES)
    # 1..64: most of these are not multiples of 16 bytes; the last band: several rounds (and both banks).
    r = round_elems[dtype]
    numel = draw_size(rng, [(0.03, 0, 0), (0.35, 1, 64), (0.65, 65, 8192), (0.85, 8193, 1 << 18),
                            (1.0, r + 1, 5 * r + 3)])
    cols = rng.choice([1, 1, 2, 3]) if numel % 6 == 0 else 1
    return {
        "dtype": dtype, "numel": numel, "cols": cols, "op": rng.choice(["sum", "avg"]),
        "data": rng.choice(["int", "int", "random"]),
        "mode": rng.choice(["out", "out", "functional", "deferred", "inplace", "offset_view", "symmetric_in"]),
        "side_stream": rng.random() < 0.2, "clobber_input_after": rng.random() < 0.3,
        "offset_elems": rng.randint(1, 7), "seed": rng.randrange(1 << 30),
    }


def run_rs_case(case: dict, group, world: int, rank: int, side: torch.cuda.Stream) -> tuple[int, bool, str]:
    """Returns (#elements farther from the exact reduction than one rounding (-1 on error), bit-exact vs NCCL, problem
    or '')."""
    dtype, numel, op = case["dtype"], case["numel"], case["op"]
    cols = case["cols"]
    shape = [world * numel // cols, cols] if cols > 1 else [world * numel]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(case["seed"] * 977 + rank)
    if case["data"] == "int":  # integer-valued: sums and halves are exact in every dtype -> must be bit-exact
        inp_data = torch.randint(-8, 9, shape, device="cuda", generator=gen).to(dtype)
    else:
        inp_data = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    out_shape = [shape[0] // world, *shape[1:]]
    ref = torch.empty(out_shape, dtype=dtype, device="cuda")
    if numel > 0:
        ref_reduce_scatter(ref, inp_data, op, group)
    problems = []
    elem = torch.empty((), dtype=dtype).element_size()
    out_bytes = numel * elem
    backing = torch.full((out_bytes + GUARD_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
    stream_ctx = torch.cuda.stream(side) if case["side_stream"] else torch.cuda.stream(torch.cuda.current_stream())
    with stream_ctx:
        if case["side_stream"]:
            side.wait_stream(torch.cuda.default_stream())
        cur = torch.cuda.current_stream()
        out = backing[:out_bytes].view(dtype).reshape(out_shape) if out_bytes else torch.empty(out_shape, dtype=dtype,
                                                                                                device="cuda")
        keep = []
        mode = case["mode"]
        if mode == "offset_view":  # unaligned input (and so unaligned own chunk): the scalar kernel path
            big = torch.empty(world * numel + case["offset_elems"], dtype=dtype, device="cuda")
            inp = big[case["offset_elems"]:].view(shape)
            inp.copy_(inp_data)
            keep.append(big)
        elif mode == "symmetric_in":
            inp = rt.empty_symmetric(shape, dtype, group)
            inp.copy_(inp_data)
        else:
            inp = inp_data.clone()
        if mode == "inplace":
            out = inp.view(world, -1)[rank].view(out_shape) if numel else inp[:0]
        if mode == "functional":
            out = rt.reduce_scatter(inp, op, group)
        elif mode == "deferred":  # joins the caller's stream only at wait_tensor below
            out = torch.ops.ce_overlap.reduce_scatter_tensor(inp, op, world, group.group_name)
        else:
            rt.reduce_scatter_tensor(out, inp, op, group)
        out = rt.wait_tensor(out)
        if case["clobber_input_after"] and numel > 0 and mode != "inplace":
            inp.fill_(123)
        if tuple(out.shape) != tuple(out_shape) or out.dtype != dtype:
            problems.append(f"output shape/dtype {tuple(out.shape)} {out.dtype}, want {tuple(out_shape)} {dtype}")
        if cur is not torch.cuda.default_stream():
            torch.cuda.default_stream().wait_stream(cur)
    rt.synchronize(group)
    torch.cuda.synchronize()
    if problems:
        return -1, False, "; ".join(problems)
    exact = count_wrong(out, ref) == 0
    bad = rs_outside_exact(out, inp_data, op, group)
    if case["data"] == "int" and not exact:
        problems.append(f"integer-valued data is not bit-exact vs NCCL ({count_wrong(out, ref)} elements differ)")
    if mode in ("out", "offset_view", "symmetric_in") and out_bytes and not bool((backing[out_bytes:] == 0xA5).all()):
        problems.append("bytes behind the output were overwritten")
    del keep
    return bad, exact, "; ".join(problems)


def mode_reduce_scatter(args) -> int:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    round_bytes, round_elems = rendezvous_rs_rounds(group)
    log(f"{rt.describe(group)}; reduce-scatter round {round_bytes} bytes per rank")
    side = torch.cuda.Stream()
    rng = random.Random(args.seed + 1)
    stats, exact_stats = collections.Counter(), collections.Counter()
    failures, multi_round = [], 0
    t0 = time.time()
    ctas_choices = [1, 3, 16, 32, 132]
    small_round_from = args.rs_cases - args.rs_cases // 6  # the last sixth runs with 64 KiB rounds (more rounds)
    for i in range(args.rs_cases):
        case = draw_rs_case(rng, round_elems)
        ctas = rng.choice(ctas_choices)
        # Reduction CTAs are local (ranks may differ); the round size must match, so it changes on both at once.
        tuning = draw_local_tuning(rng)
        rtt.tune(group, reduce_sms=ctas if rank == 0 else ctas_choices[(ctas_choices.index(ctas) + 1) % 5],
                 rs_round_mb=(64 / 1024) if i >= small_round_from else round_bytes / (1 << 20),
                 **local_tuning(tuning, rank))
        multi_round += case["numel"] * torch.empty((), dtype=case["dtype"]).element_size() > (
            (64 << 10) if i >= small_round_from else round_bytes)
        step(f"reduce_scatter case {i}: {case['op']} {str(case['dtype']).replace('torch.', '')} numel {case['numel']} "
             f"{case['mode']} ctas {ctas}{' 64 KiB rounds' if i >= small_round_from else ''}")
        try:
            bad, exact, problem = run_rs_case(case, group, world, rank, side)
        except Exception as e:  # noqa: BLE001
            bad, exact, problem = -1, False, f"{type(e).__name__}: {e}"
            traceback.print_exc()
        key = (case["op"], str(case["dtype"]).replace("torch.", ""), case["data"])
        stats[key] += 1
        exact_stats[key] += exact
        if bad != 0 or problem:
            failures.append(i)
            log(f"rs case {i} FAILED: {case} outside-rounding={bad} {problem}")
            if bad == -1:
                break
    tuning = rtt.tune(group, reduce_sms=32, rs_round_mb=round_bytes / (1 << 20), **UNPACED)
    if rank == 0:
        print(f"reduce-scatter tuning restored: {tuning}", flush=True)
    # Groups of one rank (no peers): the reduction alone (sum and avg of one input are the input).
    step("reduce_scatter: groups of one rank")
    singles = [dist.new_group([r]) for r in range(world)]
    mine = singles[rank]
    x = torch.randn(3000, 5, device="cuda", dtype=torch.bfloat16)
    for op in ("sum", "avg"):
        y = rt.reduce_scatter(x, op, mine)
        g = rt.all_gather(x, mine)
        rt.synchronize(mine)
        if count_wrong(y, x) or count_wrong(g, x):
            log(f"FAILED: group of one rank: reduce_scatter({op}) / all_gather is not the input")
            failures.append(-1)
    nfail = failed_on_all_ranks(len(failures))
    if rank == 0:
        print(f"{'op':<5} {'dtype':<10} {'data':<7} {'cases':>6} {'bit-exact vs NCCL':>18}")
        for k in sorted(stats):
            print(f"{k[0]:<5} {k[1]:<10} {k[2]:<7} {stats[k]:>6} {exact_stats[k]:>18}")
    log(f"reduce_scatter: {args.rs_cases} cases ({multi_round} multi-round), {len(failures)} failed here, "
        f"{nfail} failed on all ranks, {time.time() - t0:.1f} s; {rt.describe(group)}")
    return 0 if nfail == 0 else 1


# ---------------------------------------------------------------------------------------------------------------
# Multi-tensor ops (a bucket without a bucket buffer): all_gather_into_tensors / reduce_scatter_tensors

def draw_parts_case(rng: random.Random, world: int, round_elems: dict) -> dict:
    """1-12 parts of mixed sizes (zero, odd, multi-round); all-gather parts of mixed dtypes, reduce-scatter parts of
    one dtype (dim 0 a multiple of the group size)."""
    kind = rng.choice(["all_gather", "all_gather", "reduce_scatter", "reduce_scatter_unreduced",
                       "all_gather_symmetric_out", "reduce_scatter_widening"])
    # widening: 16-bit inputs into an fp32 output (FSDP2's fp32 reduce_dtype over bf16 gradients)
    dtype = rng.choice(RS_DTYPES[:2] if kind == "reduce_scatter_widening" else RS_DTYPES)
    parts = []
    for _ in range(rng.choice([1, 2, 3, 5, 9, 12])):
        # symmetric_out: the inputs lie back to back in one symmetric slot, so they share its dtype
        pdt = rng.choice(DTYPES) if kind == "all_gather" else dtype  # unreduced: one dtype, any of them (moved)
        r = round_elems[torch.float32]  # the last band, with the other parts: multi-round
        n = draw_size(rng, [(0.1, 0, 0), (0.5, 1, 64), (0.85, 65, 70000), (1.0, r // 4, r)])
        cols = rng.choice([1, 2, 3]) if n % 6 == 0 else 1
        rows = n // cols if kind.startswith("all_gather") else world * (n // cols)
        parts.append({"dtype": pdt, "shape": [rows, cols] if cols > 1 else [rows]})
    return {"kind": kind, "parts": parts, "op": rng.choice(["sum", "avg"]),
            "data": rng.choice(["int", "int", "random"]), "side_stream": rng.random() < 0.2,
            "wait": rng.choice(["all", "reversed", "first_only"]), "busy": rng.random() < 0.3,
            # the op's own copy rate (its copy_rate_gbps argument, as the pass gives a paced bucket to the
            # multi-tensor ops): odd ranks pass it, even ranks 0 (the group's rate, unpaced here): ranks pace alike or not

            "op_rate": rng.choice([0, 0, 0, 30, 200]), "seed": rng.randrange(1 << 30)}


def run_parts_case(case: dict, group, world: int, rank: int, side: torch.cuda.Stream) -> tuple[int, str]:
    """Returns (#wrong elements, problem or ''): all-gather parts bit-exact vs the reference per part; reduce-scatter
    output vs the per-part references concatenated (integer-valued data bit-exact) and every part's chunk within the
    rounding of its exact reduction (rs_outside_exact);
    unreduced reduce-scatter: every row bit-exact vs the peer's chunks (from a reference all-gather of the inputs),
    and own chunks + the rows' sum vs the reference reduce-scatter like the reducing op."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(case["seed"] * 613 + rank)
    unreduced = case["kind"] == "reduce_scatter_unreduced"
    widening = case["kind"] == "reduce_scatter_widening"
    symmetric_out = case["kind"] == "all_gather_symmetric_out"
    rs = case["kind"] in ("reduce_scatter", "reduce_scatter_widening") or unreduced
    inputs = []
    for part in case["parts"]:
        if not rs:
            inputs.append(random_bits(part["shape"], part["dtype"], gen))
        elif case["data"] == "int":
            inputs.append(torch.randint(-8, 9, part["shape"], device="cuda", generator=gen).to(part["dtype"]))
        else:
            inputs.append(torch.randn(part["shape"], device="cuda", generator=gen).to(part["dtype"]))
    refs, peer_rows = [], []
    for x in inputs:
        if unreduced:  # what each peer holds for this rank: chunk `rank` of the peer's input, bit for bit
            gathered = torch.empty([x.shape[0] * world, *x.shape[1:]], dtype=x.dtype, device="cuda")
            if x.numel():
                ref_all_gather(gathered, x, group)
            chunks = gathered.view(world, world, -1)[:, rank]  # [peer, this rank's chunk]
            peer_rows.append(torch.cat([chunks[:rank], chunks[rank + 1:]]))
        if rs:  # widening: what the fp32 cast of the input reduce-scatters to (NCCL in fp32)
            xr = x.float() if widening else x
            ref = torch.empty([x.shape[0] // world, *x.shape[1:]], dtype=xr.dtype, device="cuda")
            if x.numel():
                ref_reduce_scatter(ref, xr, case["op"], group)
        else:
            ref = torch.empty([x.shape[0] * world, *x.shape[1:]], dtype=x.dtype, device="cuda")
            if x.numel():
                ref_all_gather(ref, x, group)
        refs.append(ref)
    problems = []
    stream_ctx = torch.cuda.stream(side) if case["side_stream"] else torch.cuda.stream(torch.cuda.current_stream())
    with stream_ctx:
        if case["side_stream"]:
            side.wait_stream(torch.cuda.default_stream())
        cur = torch.cuda.current_stream()
        if symmetric_out:  # every input in one symmetric slot, back to back: the peers pull them in place
            nbytes = [x.numel() * x.element_size() for x in inputs]
            slot = rt.empty_symmetric([max(1, sum(nbytes))], torch.uint8, group)
            flat = slot[: sum(nbytes)].view(inputs[0].dtype) if sum(nbytes) else slot[:0].view(inputs[0].dtype)
            ins = [v.view(x.shape) for v, x in zip(torch.split(flat, [x.numel() for x in inputs]), inputs)]
            for v, x in zip(ins, inputs):
                v.copy_(x)
        else:
            ins = [x.clone() for x in inputs]
        rate = float(case.get("op_rate", 0) if rank % 2 else 0)
        if unreduced:
            outs = [torch.ops.ce_overlap.reduce_scatter_tensors_unreduced(ins, world, group.group_name, rate)]
        elif widening:
            outs = [torch.empty(sum(x.numel() for x in ins) // world, dtype=torch.float32, device="cuda")]
            torch.ops.ce_overlap.reduce_scatter_tensors_out(ins, case["op"], world, group.group_name, out=outs[0])
        elif rs:
            outs = [torch.ops.ce_overlap.reduce_scatter_tensors(ins, case["op"], world, group.group_name, rate)]
        elif symmetric_out:
            outs = [torch.empty([x.shape[0] * world, *x.shape[1:]], dtype=x.dtype, device="cuda") for x in ins]
            torch.ops.ce_overlap.all_gather_into_tensors_out(ins, world, group.group_name, outs=outs)
        else:
            outs = list(torch.ops.ce_overlap.all_gather_into_tensors(ins, world, group.group_name, rate))
        if case["busy"]:
            busy = torch.randn(512, 512, device="cuda")
            for _ in range(4):
                busy = busy @ busy  # caller-stream work between the op and its wait (overlaps it)
        order = list(range(len(outs)))
        if case["wait"] == "reversed":
            order.reverse()
        elif case["wait"] == "first_only":  # one output's wait joins the op for all of them (one event, shared)
            order = order[:1]
        for i in order:
            outs[i] = rt.wait_tensor(outs[i])
        if unreduced:  # the reduction the pass leaves to the graph: own chunks + the rows' sum, one rounding
            rows = outs[0]
            own = torch.cat([x.view(world, -1)[rank] for x in ins]) if ins else rows.new_empty(0)
            total = own.float() + rows.float().sum(0)
            reduced = (avg_of_sum(total, world) if case["op"] == "avg" else total).to(rows.dtype)
        for x in ins:
            if x.numel():
                x.view(INT_OF_SIZE[x.element_size()]).fill_(0x5A)  # stream order: the op is done with the inputs
        if cur is not torch.cuda.default_stream():
            torch.cuda.default_stream().wait_stream(cur)
    rt.synchronize(group)
    torch.cuda.synchronize()
    if unreduced:
        want_rows = torch.cat([r.reshape(world - 1, -1) for r in peer_rows], dim=1)
        got_rows = outs[0]
        if tuple(got_rows.shape) != tuple(want_rows.shape) or got_rows.dtype != want_rows.dtype:
            return -1, (f"output {tuple(got_rows.shape)} {got_rows.dtype}, "
                        f"want {tuple(want_rows.shape)} {want_rows.dtype}")
        if count_wrong(got_rows, want_rows):
            problems.append(f"rows are not the peers' chunks ({count_wrong(got_rows, want_rows)} elements differ)")
        outs = [reduced]
    if rs:
        want = torch.cat([r.reshape(-1) for r in refs]) if refs else None
        got = outs[0]
        if got.dim() != 1 or got.numel() != want.numel() or got.dtype != want.dtype:
            return -1, f"output {tuple(got.shape)} {got.dtype}, want ({want.numel()},) {want.dtype}"
        if case["data"] == "int" and count_wrong(got, want):
            problems.append(f"integer-valued data is not bit-exact ({count_wrong(got, want)} elements differ)")
        bad, at = 0, 0
        for x in inputs:  # each part's chunk of the output against its exact reduction
            count = x.numel() // world
            bad += rs_outside_exact(got[at:at + count], x.float() if widening else x, case["op"], group)
            at += count
        return bad, "; ".join(problems)
    wrong = 0
    for i, (got, want) in enumerate(zip(outs, refs)):
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            problems.append(f"output {i}: {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
            continue
        wrong += count_wrong(got, want)
    return wrong, "; ".join(problems)


def mode_parts(args) -> int:
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    _, round_elems = rendezvous_rs_rounds(group)
    side = torch.cuda.Stream()
    rng = random.Random(args.seed + 7)
    stats = collections.Counter()
    failures = []
    t0 = time.time()
    for i in range(args.parts_cases):
        case = draw_parts_case(rng, world, round_elems)
        split = rng.choice([1, 2, 3])  # drawn on every rank (the cases are SPMD); used by rank 0 only
        rtt.tune(group, pull_split=split if rank == 0 else 1)
        total = sum(int(torch.Size(p["shape"]).numel()) * torch.empty((), dtype=p["dtype"]).element_size()
                    for p in case["parts"])
        step(f"parts case {i}: {case['kind']} {len(case['parts'])} parts, {total} bytes, wait {case['wait']}")
        wrong, problem = checked_case(run_parts_case, case, group, world, rank, side)
        stats[(case["kind"], len(case["parts"]))] += 1
        if wrong != 0 or problem:
            failures.append(i)
            log(f"parts case {i} FAILED: {case} wrong={wrong} {problem}")
            if wrong == -1:
                break
    rtt.tune(group, pull_split=1)
    table = [f"{'op':<24} {'parts':>5} cases"] + [f"{k:<24} {n:>5} {c}" for (k, n), c in sorted(stats.items())]
    return finish_cases("parts", args.parts_cases, len(failures), table, t0, group)


# ---------------------------------------------------------------------------------------------------------------
# Collective symmetric allocation

def _offset(t: torch.Tensor, group) -> int:
    return int(torch.ops.ce_overlap._symmetric_offset(t, group.group_name))


def _same_on_all_ranks(values: list) -> bool:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, values)
    return all(v == everyone[0] for v in everyone)


def _check_ag_on(sym_in: torch.Tensor, group, world: int, rank: int, push: bool) -> int:
    """Zero-copy and in-place all-gathers on symmetric tensors: #wrong bytes vs NCCL."""
    sym_in.view(torch.uint8).copy_(torch.randint(0, 256, (sym_in.numel() * sym_in.element_size(),), device="cuda",
                                                 dtype=torch.uint8))
    ref = torch.empty(world * sym_in.numel(), dtype=sym_in.dtype, device="cuda")
    ref_all_gather(ref, sym_in.reshape(-1), group)
    out = torch.empty_like(ref)
    sym_out = rt.empty_symmetric(ref.shape, ref.dtype, group)
    sym_out.view(world, -1)[rank].copy_(sym_in.reshape(-1))
    previous = rtt.set_all_gather_mode("push" if push else "pull")
    try:
        rt.all_gather_into_tensor(out, sym_in, group)                                   # zero-copy pull
        rt.all_gather_into_tensor(sym_out, sym_out.view(world, -1)[rank], group)          # in place
    finally:
        rtt.set_all_gather_mode(previous)
    rt.synchronize(group)
    return count_wrong(out, ref) + count_wrong(sym_out, ref)


def mode_symalloc(args) -> int:
    """empty_symmetric agrees offsets although the ranks free at different times and in different orders (one rank's
    frees stay pending behind a GPU sleep), retries when only pending frees would make room, and reports
    mismatched sizes and a full pool on every rank; zero-copy / in-place all-gathers on the tensors are bit-exact."""
    from ce_overlap.runtime import _symalloc

    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    name = rt.rendezvous(group)
    ok = True
    flat = [int(v) for v in torch.ops.ce_overlap._symmetric_free_ranges(name, True)]
    user = sum(flat[2::2])
    empty = len(flat) == 3  # one free range: nothing else lives in the pool (earlier modes freed everything)
    log(f"user region {user} bytes free at start: {list(zip(flat[1::2], flat[2::2]))}")

    step("symalloc: retry path")
    # 1. Retry path: A and B fill 80%; A is freed, but on rank 1 behind a 0.3 s GPU sleep; C (30%) fits only in A.
    unit = user // 10 // 4096 * 4096
    a = rt.empty_symmetric((4 * unit,), torch.uint8, group)
    b = rt.empty_symmetric((4 * unit,), torch.uint8, group)
    off_a = _offset(a, group)
    torch.cuda.synchronize()
    if rank == 1:
        torch.cuda._sleep(int(0.3 * 2e9))
    del a
    t0 = time.time()
    c = rt.empty_symmetric((3 * unit,), torch.uint8, group)
    waited = time.time() - t0
    offs = [off_a, _offset(b, group), _offset(c, group)]
    log(f"retry path: offsets A/B/C {offs}, C took {waited:.3f} s")
    if not _same_on_all_ranks(offs) or (empty and offs[2] != off_a):
        log(f"FAILED: C must get one offset on every rank (and, in an empty pool, reuse A's range), got {offs}")
        ok = False
    del b, c
    torch.cuda.synchronize()

    step("symalloc: mismatched sizes and a full pool must raise on every rank")
    # 2. Errors are raised on every rank and leave the allocator usable.
    for label, size, needle in (("mismatched sizes", 1024 * (rank + 1), "different sizes"),
                                ("nothing fits", 2 * user, "no range of")):
        try:
            rt.empty_symmetric((size,), torch.uint8, group)
            log(f"FAILED: {label} did not raise")
            ok = False
        except _symalloc.SymmetricAllocError as e:
            msg = str(e)
            log(f"{label}: raised as expected: {msg[:300]}")
            if needle not in msg or f"group '{name}'" not in msg:
                log(f"FAILED: the {label} message does not name {needle!r} and the group")
                ok = False

    # 3. Random allocations and frees, in different orders on the two ranks, some pending behind GPU work.
    rng = random.Random(args.seed + 2)  # the same on every rank: the allocations are SPMD
    live: list = []
    log_offsets = []
    wrong = 0
    dtypes = [torch.bfloat16, torch.float32, torch.uint8, torch.int32]
    for i_step in range(args.symalloc_steps):
        step(f"symalloc random step {i_step}, {len(live)} live tensors")
        if live and rng.random() < 0.4:
            victims = rng.sample(range(len(live)), k=min(len(live), rng.randint(1, 3)))
            # Draw on every rank, then branch: the rng is shared, so a draw on one rank only would desynchronize
            # every later allocation (rank 0 asked for 0 bytes while rank 1 asked for 780976).
            pending = rng.random() < 0.5
            if rank == 1 and pending:
                torch.cuda._sleep(int(0.002 * 2e9))  # frees stay pending for a while on rank 1 only
            for i in (victims if rank == 0 else list(reversed(victims))):  # frees in rank-dependent order
                live[i] = None  # the last reference: the tensor's deleter runs here
            live = [t for t in live if t is not None]
        else:
            dtype = rng.choice(dtypes)
            numel = rng.choice([0, 1, 7, 100, 4096, rng.randint(1, 1 << 20), rng.randint(1 << 20, 4 << 20)])
            live.append(rt.empty_symmetric((numel,), dtype, group))
            log_offsets.append(_offset(live[-1], group) if numel else -1)
            if numel and rng.random() < 0.15:
                wrong += _check_ag_on(live[-1], group, world, rank, push=rng.random() < 0.5)
    step("symalloc: compare offsets across ranks")
    if not _same_on_all_ranks(log_offsets):
        log("FAILED: the ranks got different offsets for the same allocations")
        ok = False
    log(f"random: {args.symalloc_steps} steps, {len(log_offsets)} allocations, {len(set(log_offsets))} distinct offsets, "
        f"{wrong} wrong bytes in the all-gathers on them")
    ok &= wrong == 0
    live.clear()
    nfail = failed_on_all_ranks(0 if ok else 1)
    log(f"symalloc: {'ok' if nfail == 0 else 'FAILED'}; {rt.describe(group)}")
    return 0 if nfail == 0 else 1


# ---------------------------------------------------------------------------------------------------------------
# All-to-all, broadcast and point-to-point vs NCCL

def _draw_numel(rng: random.Random, multiple: int) -> int:
    """0, tiny, medium or multi-round sizes (with CE_OVERLAP_STAGING_MB=1 / CE_OVERLAP_P2P_MB=1), a multiple of
    `multiple` elements."""
    return draw_size(rng, [(0.03, 0, 0), (0.35, 1, 64), (0.7, 65, 8192), (1.0, 8193, 1 << 19)]) * multiple


def _run_a2a_bcast_case(case: dict, group, world: int, rank: int) -> tuple[int, str]:
    dtype, kind, mode = case["dtype"], case["kind"], case["mode"]
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(case["seed"] * 131 + rank)
    numel = case["numel"]
    data = random_bits([numel], dtype, gen)
    problems = []
    if kind == "a2a":
        ref = torch.empty_like(data)
        if numel:
            ref_all_to_all(ref, data, group)
        backing = torch.full((numel * elem + GUARD_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
        out = backing[:numel * elem].view(dtype)
        if mode == "symmetric":
            inp = rt.empty_symmetric([numel], dtype, group)
            inp.copy_(data)
        else:
            inp = data.clone()
        if mode == "functional":
            name = group.group_name
            out = rt.wait_tensor(torch.ops.ce_overlap.all_to_all_single(inp, world, name))
        else:
            rt.all_to_all_single(out, inp, group)
        if case["clobber_input_after"] and numel:
            inp.view(torch.uint8 if elem == 1 else INT_OF_SIZE[elem]).fill_(0x5A)
        rt.synchronize(group)
        torch.cuda.synchronize()
        if mode != "functional" and not bool((backing[numel * elem:] == 0xA5).all().item()):
            problems.append("bytes behind the output were overwritten")
        return count_wrong(out, ref), "; ".join(problems)
    # broadcast
    root = case["root"]
    ref = data.clone()
    if numel:
        ref_broadcast(ref, dist.get_global_rank(group, root), group)
    if mode == "symmetric":
        t = rt.empty_symmetric([numel], dtype, group)
        t.copy_(data)
    else:
        t = data.clone()
    rt.broadcast(t, root, group)
    rt.synchronize(group)
    torch.cuda.synchronize()
    return count_wrong(t, ref), ""


def mode_a2a_bcast(args) -> int:
    """Randomized all-to-alls (staged, zero-copy symmetric input, functional op) and broadcasts (staged, symmetric,
    every root) bit-exact vs NCCL, with guard bands behind the outputs."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rt.rendezvous(group)
    rng = random.Random(args.seed + 7)
    stats = collections.Counter()
    failures = 0
    t0 = time.time()
    for i in range(args.a2a_cases):
        kind = "a2a" if i % 2 == 0 else "bcast"
        case = {"kind": kind, "dtype": rng.choice(DTYPES), "seed": rng.randrange(1 << 30),
                "mode": rng.choice(["staged", "staged", "symmetric", "functional"] if kind == "a2a"
                                   else ["staged", "symmetric"]),
                "root": rng.randrange(world), "clobber_input_after": rng.random() < 0.3}
        case["numel"] = _draw_numel(rng, world if kind == "a2a" else 1)
        if kind == "bcast" and case["mode"] == "symmetric" and rng.random() < 0.25:
            # From BROADCAST_RELAY_MIN_BYTES on, an even world size relays (ce_algorithms.h): up to 8 MiB above it.
            elem = torch.empty((), dtype=case["dtype"]).element_size()
            case["numel"] = (_core.BROADCAST_RELAY_MIN_BYTES + rng.randrange(8 << 20)) // elem
        # Lanes and copy rate are local (local_tuning); the broadcast's segments (0: chosen from the size, which with
        # these sizes mostly means "pull it whole from the root") must match on every rank.
        case.update(draw_local_tuning(rng), segments=rng.choice([0, 0, 1, 2, 3, 7]))
        rtt.tune(group, bcast_segments=case["segments"], **local_tuning(case, rank))
        step(f"a2a_bcast case {i}: {kind} {case['mode']} {case['dtype']} {case['numel']} lanes {case['lanes']} "
             f"segments {case['segments']}")
        wrong, problem = checked_case(_run_a2a_bcast_case, case, group, world, rank)
        stats[(kind, case["mode"])] += 1
        if wrong or problem:
            failures += 1
            log(f"a2a_bcast case {i} FAILED: {case} wrong={wrong} {problem}")
            if wrong == -1:
                break
    rtt.tune(group, **UNPACED)
    step("a2a_bcast: all_reduce of the failure count")
    nfail = failed_on_all_ranks(failures)
    log(f"a2a_bcast: {args.a2a_cases} cases {dict(stats)}, {nfail} failed on all ranks, "
        f"{time.time() - t0:.1f} s")
    return 0 if nfail == 0 else 1


def _p2p_messages(rng: random.Random, world: int) -> list[dict]:
    msgs = []
    direct_channels = set()
    for _ in range(rng.randint(1, 4)):
        src, dst = rng.sample(range(world), 2)
        direct = rng.random() < 0.3 and (src, dst) not in direct_channels
        if direct:
            direct_channels.add((src, dst))
        msgs.append({"src": src, "dst": dst, "dtype": rng.choice(DTYPES), "numel": _draw_numel(rng, 1),
                     "direct": direct, "seed": rng.randrange(1 << 30)})
    return msgs


def _interleave(rng: random.Random, ops: list, channel) -> list:
    """A random order of `ops` that keeps the order within each channel (how sends and receives are matched)."""
    queues: dict = {}
    for o in ops:
        queues.setdefault(channel(o), []).append(o)
    out = []
    while any(queues.values()):
        key = rng.choice([k for k, v in queues.items() if v])
        out.append(queues[key].pop(0))
    return out


def _run_p2p_case(msgs: list[dict], style: str, order_seed: int, group, rank: int) -> tuple[int, str]:
    """One batch of messages through NCCL (dist.batch_isend_irecv) and through the CE runtime; the received bytes must
    be identical. Direct messages use one empty_symmetric buffer per message (allocated by every rank, in order)."""
    sends, recvs = [], []
    sym = []
    for j, m in enumerate(msgs):
        buf = rt.empty_symmetric([m["numel"]], m["dtype"], group) if m["direct"] else None  # collective: every rank
        sym.append(buf)
        if rank == m["src"]:
            gen = torch.Generator(device="cuda")
            gen.manual_seed(m["seed"])
            data = random_bits([m["numel"]], m["dtype"], gen)
            sends.append((j, m, data))
        elif rank == m["dst"]:
            recvs.append((j, m))
    # The reference (NCCL, or gloo when the ranks share a GPU).
    ref = {j: torch.empty([m["numel"]], dtype=m["dtype"], device="cuda") for j, m in recvs}
    ref_p2p([(data, m["dst"]) for j, m, data in sends if m["numel"]],
            [(ref[j], m["src"]) for j, m in recvs if m["numel"]], group)
    torch.cuda.synchronize()
    # The CE runtime: the same messages, each rank's ops in its own random order (per channel order kept).
    got, ce_ops = {}, []
    for j, m, data in sends:
        t = data
        if m["direct"]:
            sym[j].copy_(data)
            t = sym[j]
        ce_ops.append(("send", j, m, t))
    for j, m in recvs:
        if m["direct"]:
            got[j] = sym[j]
        else:
            nbytes = m["numel"] * torch.empty((), dtype=m["dtype"]).element_size()
            backing = torch.full((nbytes + GUARD_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
            got[j] = backing[:nbytes].view(m["dtype"])
            got[(j, "guard")] = backing[nbytes:]
        ce_ops.append(("recv", j, m, got[j]))
    rng = random.Random(order_seed * 7 + rank)
    ce_ops = _interleave(rng, ce_ops, lambda o: (o[0], o[2]["dst"] if o[0] == "send" else o[2]["src"]))
    if style == "torch_p2pop":  # torch.distributed.P2POp objects (global peers)
        ops = [dist.P2POp(dist.isend if k == "send" else dist.irecv, t, m["dst"] if k == "send" else m["src"], group)
               for k, j, m, t in ce_ops]
    else:
        ops = [rt.P2POp(k, t, m["dst"] if k == "send" else m["src"]) for k, j, m, t in ce_ops]
    if style == "async":
        work = rt.batch_isend_irecv(ops, group, async_op=True)
        busy = torch.randn(512, 512, device="cuda")
        for _ in range(4):
            busy = busy @ busy  # caller-stream work that overlaps the batch
        work.wait()
    elif style == "single" and len(ops) == 1:
        (rt.send if ops[0].op == "send" else rt.recv)(ops[0].tensor, ops[0].peer, group)
    else:
        rt.batch_isend_irecv(ops, group)
    for k, j, m, t in ce_ops:  # a sender may overwrite its input right away (stream order)
        if k == "send" and m["numel"]:
            t.view(INT_OF_SIZE[t.element_size()]).fill_(0x5A)
    rt.synchronize(group)
    torch.cuda.synchronize()
    wrong, problems = 0, []
    for j, m in recvs:
        wrong += count_wrong(got[j], ref[j])
        guard = got.get((j, "guard"))
        if guard is not None and not bool((guard == 0xA5).all().item()):
            problems.append(f"message {j}: bytes behind the receive buffer were overwritten")
    return wrong, "; ".join(problems)


def mode_p2p(args) -> int:
    """Randomized batches of sends and receives between random pairs (both directions, several messages per channel,
    staged single- and multi-round, direct into symmetric buffers, empty messages, every dtype), each rank's ops in
    its own order, sync / async / torch P2POp / single send-recv, the even ranks' sends paced in some batches:
    bit-exact vs the same batch over NCCL."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    rt.rendezvous(group)
    log(f"p2p: landing bank {rtt.p2p_round_bytes(group)} bytes; {rt.describe(group)}")
    rng = random.Random(args.seed + 11)
    stats = collections.Counter()
    failures = 0
    t0 = time.time()
    for i in range(args.p2p_cases):
        msgs = _p2p_messages(rng, world)
        style = rng.choice(["sync", "sync", "async", "torch_p2pop", "single"])
        order_seed = rng.randrange(1 << 30)
        tuning = draw_local_tuning(rng)  # its copy rate paces the even ranks' sends (the other knobs: collectives)
        rtt.tune(group, **local_tuning(tuning, rank))
        stats["paced"] += tuning["rate"] > 0
        step(f"p2p case {i}: {style} rate {tuning['rate']} "
             f"{[(m['src'], m['dst'], m['numel'], m['direct']) for m in msgs]}")
        wrong, problem = checked_case(_run_p2p_case, msgs, style, order_seed, group, rank)
        stats[style] += 1
        stats["messages"] += len(msgs)
        stats["direct"] += sum(m["direct"] for m in msgs)
        if wrong or problem:
            failures += 1
            log(f"p2p case {i} FAILED: {msgs} {style} wrong={wrong} {problem}")
            if wrong == -1:
                break
    rtt.tune(group, **UNPACED)
    step("p2p: all_reduce of the failure count")
    nfail = failed_on_all_ranks(failures)
    log(f"p2p: {args.p2p_cases} batches {dict(stats)}, {nfail} failed on all ranks, {time.time() - t0:.1f} s")
    return 0 if nfail == 0 else 1


def mode_p2p_faults(args) -> int:
    """A receive that never comes, and mismatched message sizes: the waiting side raises within the timeout naming
    the op, the peer and what it posted; the streams drain. Each case on its own process group."""
    rank = dist.get_rank()
    step("p2p_faults: 2 process groups + rendezvous", echo=True)
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(2)]
    for g in groups:
        rt.rendezvous(g)
    x = torch.randn(1 << 20, device="cuda")
    y = torch.empty((1 << 20) if rank == 0 else (1 << 19), device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    ok = True
    g = groups[0]
    if rank == 0:  # rank 1 never posts the receive
        ok &= _expect_timeout("send without a receive", g, lambda: rt.send(x, 1, g),
                              ["send", "to rank 1", "has not posted the matching receive"])
    g = groups[1]

    def mismatched():  # rank 0 sends 4 MiB, rank 1 expects 2 MiB
        rt.batch_isend_irecv([rt.P2POp("send", x, 1)] if rank == 0 else [rt.P2POp("recv", y, 0)], g)

    # The sender sees the receiver's credits carry another message; the receiver only sees that nothing arrives.
    if rank in (0, 1):
        needles = ["send", "rank 1", "posted a different message"] if rank == 0 else \
            ["recv", "rank 0", "has not sent channel round 1"]
        ok &= _expect_timeout("send / recv sizes", g, mismatched, needles)
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------------
# Faults: a rank that dies, a pool that cannot be allocated, a group without P2P (RELIABILITY.md)

def _die(reason: str) -> None:
    """This rank vanishes at once, as a crashed process does: no Python teardown, no collective goodbye. Exit
    status 0, so that torchrun lets the survivors report instead of killing them."""
    log(f"dying on purpose: {reason}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _expect_error(label: str, fn, needles: list[str], within_s: float) -> bool:
    """fn() must raise RuntimeError within `within_s` seconds, naming every needle."""
    t0 = time.time()
    try:
        fn()
        log(f"FAILED [{label}]: no error")
        return False
    except RuntimeError as e:
        elapsed, msg = time.time() - t0, str(e)
        log(f"[{label}] raised after {elapsed:.1f} s: {msg[:500]}")
        missing = [n for n in needles if n not in msg]
        if missing:
            log(f"FAILED [{label}]: the message does not name {missing}")
        if elapsed > within_s:
            log(f"FAILED [{label}]: raised after {elapsed:.1f} s, expected within {within_s:.0f} s")
        return not missing and elapsed <= within_s


def mode_die_before_rendezvous(args) -> int:
    """Rank 1 dies before the CE rendezvous: rank 0's rendezvous raises within the timeout naming rank 1."""
    rank = dist.get_rank()
    dist.barrier()
    if rank == 1:
        _die("before the CE rendezvous")
    step("die_before_rendezvous: rendezvous with a dead peer", deadline_s=ce_timeout_s() + 30, echo=True)
    ok = _expect_error("rendezvous, peer dead", lambda: rt.rendezvous(dist.group.WORLD),
                       ["timed out", "ranks [1] never published"], ce_timeout_s() + 10)
    return 0 if ok else 1


def mode_die_mid_collective(args) -> int:
    """Both ranks enqueue a 32-round all-gather; rank 1 dies right after enqueueing it, its part still queued behind
    ~0.5 s of GPU work (without that, its part may finish before the process is gone, and rank 0 then rightly
    completes: seen in 3 of 20 repeats). Rank 0's synchronize raises within the timeout naming the op, and its
    streams drain."""
    group = dist.group.WORLD
    rank = dist.get_rank()
    rt.rendezvous(group)
    x = torch.randn(8 << 20, device="cuda")  # 32 MiB per rank: 32 rounds through 1 MiB of staging
    out = torch.empty(dist.get_world_size() * x.numel(), device="cuda")
    torch.cuda.synchronize()
    dist.barrier()
    step("die_mid_collective: all-gather with a peer that dies", deadline_s=ce_timeout_s() + 30, echo=True)
    if rank == 1:
        torch.cuda._sleep(int(1e9))  # the op's comm stream joins the caller's stream: its part waits behind this
    rt.all_gather_into_tensor(out, x, group)
    if rank == 1:
        _die("with an all-gather in flight")
    ok = _expect_error("all-gather, peer died", lambda: rt.synchronize(group),
                       ["timeout", "all_gather_into_tensor"], ce_timeout_s() + 10)
    step("die_mid_collective: the streams must drain", deadline_s=30, echo=True)
    if not wait_device_idle(15):
        log("FAILED: the device is still busy 15 s after the error: a stream was not released")
        ok = False
    return 0 if ok else 1


def _fresh_group_works(label: str) -> bool:
    """A new group after a failed one: rendezvous and a bit-exact all-gather (the failure left nothing behind)."""
    g = dist.new_group(list(range(dist.get_world_size())))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((4096,), float(rank + 1), device="cuda")
    out = torch.empty(world * x.numel(), device="cuda")
    rt.all_gather_into_tensor(out, x, g)
    rt.synchronize(g)
    want = torch.arange(1, world + 1, device="cuda", dtype=torch.float32).repeat_interleave(x.numel())
    if not torch.equal(out, want):
        log(f"FAILED [{label}]: the all-gather on a fresh group after the failure is wrong")
        return False
    log(f"[{label}] a fresh group works afterwards")
    return True


def mode_pool_alloc_failure(args) -> int:
    """Rank 1 asks for a pool no GPU has: its rendezvous raises naming the allocation and pool_mb, rank 0's
    raises within the timeout naming rank 1; a fresh group works afterwards."""
    rank = dist.get_rank()
    g = dist.new_group(list(range(dist.get_world_size())))
    # 100 TiB on rank 1: its config, given to rendezvous (what a CE_OVERLAP_POOL_MB override would also give).
    config = rt.RuntimeConfig.from_env(pool_mb=float(100 << 20)) if rank == 1 else None
    step("pool_alloc_failure: rendezvous", deadline_s=ce_timeout_s() + 30, echo=True)
    needles = ["CE_OVERLAP_POOL_MB"] if rank == 1 else ["timed out", "ranks [1] never published"]
    ok = _expect_error("pool allocation failure", lambda: rt.rendezvous(g, config), needles, ce_timeout_s() + 10)
    dist.barrier()
    step("pool_alloc_failure: a fresh group", echo=True)
    ok &= _fresh_group_works("pool allocation failure")
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------------------------
# Caching-allocator lifetimes of the functional (deferred) ops

def _reserved_growth(run_one, iterations: int, sleep_cycles: int) -> int:
    """Bytes the allocator reserves beyond the first iteration while the host runs `iterations` iterations ahead of
    the GPU (the caller's stream is held by a sleep kernel enqueued first). Stream-ordered reuse keeps this at 0
    whatever the run-ahead; blocks pending on other streams' events (recordStream) make it grow per iteration."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    run_one()  # warm: the first iteration's blocks
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    torch.cuda._sleep(sleep_cycles)
    for _ in range(iterations):
        run_one()
    grown = torch.cuda.memory_reserved() - base
    torch.cuda.synchronize()
    return grown


def mode_lifetimes(args) -> int:
    """The functional ops keep their tensors alive until their wait (stash), not through recordStream:
    runahead   20 deferred all-gathers / reduce-scatters / multi-tensor all-gathers / all-to-alls of 64 MiB, each
               waited and its tensors dropped, enqueued while the GPU still sleeps (the host runs ahead): the
               allocator reserves nothing beyond the first iteration (with recordStream it reserved a fresh
               input and output per iteration);
    waits      a multi-output op's stash goes at the first wait of any output; the others join the same event;
    in flight  ops issued before the earlier ones are waited for (a graph's prefetch) are never reaped;
    unwaited   results dropped without a wait do not leak: the next op reaps them (recordStream then keeps their
               blocks until the op is done), and the stash is empty after the last wait;
    results    every result bit-exact vs the reference."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    name = rt.rendezvous(group)
    ok = True
    mode = rtt.keep_alive_mode()
    log(f"lifetimes: keep-alive mode {mode}")
    if mode != "stash":
        log("lifetimes: FAILED: CE_OVERLAP_KEEP_ALIVE must be unset (or stash) for this check")
        return 1
    gen = torch.Generator(device="cpu").manual_seed(args.seed + rank)
    numel = (64 << 20) // 2  # 64 MiB of bf16 per rank
    src = torch.randint(-1000, 1000, (numel,), generator=gen).to(torch.bfloat16).cuda()
    ref = torch.empty(numel * world, dtype=torch.bfloat16, device="cuda")
    ref_all_gather(ref, src, group)
    ops = {
        "all_gather_into_tensor": lambda x: torch.ops.ce_overlap.all_gather_into_tensor(x, world, name),
        "all_gather_into_tensors": lambda x: torch.ops.ce_overlap.all_gather_into_tensors(
            list(x.chunk(3)), world, name)[0],
        "reduce_scatter_tensor": lambda x: torch.ops.ce_overlap.reduce_scatter_tensor(x, "sum", world, name),
        "all_to_all_single": lambda x: torch.ops.ce_overlap.all_to_all_single(x, world, name),
    }
    sleep_cycles = 2_000_000_000  # ~1 s at H100/H200 clocks: longer than the host needs for 20 iterations
    for op_name, op in ops.items():
        def one() -> None:
            x = src.clone()  # allocated on the caller's stream, dropped right after the op (its last host use)
            y = op(x)
            del x
            y = torch.ops.ce_overlap.wait_tensor(y)
            y.view(-1)[:1].add_(0)  # a consumer on the caller's stream
        step(f"lifetimes: runahead {op_name}")
        grown = _reserved_growth(one, 20, sleep_cycles)
        per_iteration = src.numel() * src.element_size() * (1 + world)
        good = grown < per_iteration  # stream-ordered reuse: nothing new after the first iteration
        log(f"lifetimes: runahead {op_name}: reserved +{grown / 2**20:.0f} MiB over 20 iterations run ahead "
            f"(one iteration's tensors: {per_iteration / 2**20:.0f} MiB) {'ok' if good else 'FAILED'}")
        ok &= good
        stashed = rtt.stashed_tensors()
        if stashed != 0:
            log(f"lifetimes: runahead {op_name}: FAILED: {stashed} tensors still stashed after every wait")
            ok = False

    step("lifetimes: multi-output waits")
    parts = list(src.chunk(3))
    outs = torch.ops.ce_overlap.all_gather_into_tensors(parts, world, name)
    del parts
    held = rtt.stashed_tensors()
    first = torch.ops.ce_overlap.wait_tensor(outs[1])
    after_first = rtt.stashed_tensors()
    outs = [torch.ops.ce_overlap.wait_tensor(o) for o in outs]
    good = held == 6 and after_first == 0 and first is outs[1]
    got = torch.cat([o.view(world, -1) for o in outs], dim=1).view(-1)
    wrong = count_wrong(got, ref)
    log(f"lifetimes: multi-output: stashed {held} -> {after_first} after the first wait, {wrong} wrong "
        f"{'ok' if good and wrong == 0 else 'FAILED'}")
    ok &= good and wrong == 0

    step("lifetimes: several ops in flight")
    # A graph's prefetch: ops issued before the earlier ones are waited for. Their results are referenced (here by
    # Python variables, in a graph by its buffers), so nothing may be reaped: a reaped op's wait would not join.
    reaped = rtt.reaped_unwaited()
    first = torch.ops.ce_overlap.all_gather_into_tensor(src.clone(), world, name)
    many = torch.ops.ce_overlap.all_gather_into_tensors(list(src.clone().chunk(3)), world, name)
    last = torch.ops.ce_overlap.all_gather_into_tensor(src.clone(), world, name)
    newly = rtt.reaped_unwaited() - reaped
    got = [torch.ops.ce_overlap.wait_tensor(first), torch.cat([torch.ops.ce_overlap.wait_tensor(o).view(world, -1)
                                                               for o in many], dim=1).view(-1),
           torch.ops.ce_overlap.wait_tensor(last)]
    wrong = sum(count_wrong(g, ref) for g in got)
    good = newly == 0 and wrong == 0 and rtt.stashed_tensors() == 0
    log(f"lifetimes: in flight: {newly} reaped while referenced, {wrong} wrong {'ok' if good else 'FAILED'}")
    ok &= good

    step("lifetimes: unwaited results")
    most = 0
    for _ in range(10):
        torch.ops.ce_overlap.all_gather_into_tensor(src.clone(), world, name)  # result dropped, never waited
        most = max(most, rtt.stashed_tensors())
    out = torch.ops.ce_overlap.wait_tensor(torch.ops.ce_overlap.all_gather_into_tensor(src, world, name))
    left = rtt.stashed_tensors()
    torch.cuda.synchronize()
    wrong = count_wrong(out, ref)
    good = most <= 2 and left == 0 and wrong == 0
    log(f"lifetimes: unwaited: at most {most} tensors stashed over 10 dropped results, {left} after a waited op, "
        f"{wrong} wrong {'ok' if good else 'FAILED'}")
    ok &= good
    rt.synchronize(group)
    return 0 if ok else 1


def mode_p2p_refused(args) -> int:
    """A group whose GPUs lack peer access (simulated, RuntimeConfig.fault_inject="p2p_refused"): every rank's rendezvous
    raises at once naming the pair; a fresh group without the injection works."""
    g = dist.new_group(list(range(dist.get_world_size())))
    config = rt.RuntimeConfig.from_env(fault_inject="p2p_refused")
    step("p2p_refused: rendezvous", deadline_s=ce_timeout_s() + 30, echo=True)
    ok = _expect_error("P2P refused", lambda: rt.rendezvous(g, config), ["not fully P2P-connected", "simulated"],
                       ce_timeout_s() + 10)
    dist.barrier()
    step("p2p_refused: a fresh group", echo=True)
    ok &= _fresh_group_works("P2P refused")
    return 0 if ok else 1


MODES = {"correctness": mode_correctness, "reduce_scatter": mode_reduce_scatter, "parts": mode_parts,
         "symalloc": mode_symalloc,
         "nokernels": mode_nokernels, "timeout": mode_timeout, "mismatch": mode_mismatch, "a2a_bcast": mode_a2a_bcast,
         "p2p": mode_p2p, "p2p_faults": mode_p2p_faults, "die_before_rendezvous": mode_die_before_rendezvous,
         "die_mid_collective": mode_die_mid_collective, "pool_alloc_failure": mode_pool_alloc_failure,
         "p2p_refused": mode_p2p_refused, "lifetimes": mode_lifetimes}
# Modes that leave a CE group failed on purpose (they run on their own groups, or last), or a rank dead.
BREAKING = ("timeout", "mismatch", "p2p_faults", "die_before_rendezvous", "die_mid_collective")


def run_modes(modes: list[str], run, echo=()) -> int:
    """Runs run(mode) for each mode in order (each a step, an exception a failure with its traceback), prints each
    mode's result line; returns the worst exit code."""
    rc = 0
    for mode in modes:
        t0 = time.time()
        step(f"mode {mode}: start", echo=mode in echo)
        try:
            mode_rc = run(mode)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            mode_rc = 1
        log(f"== mode {mode}: {'ok' if mode_rc == 0 else 'FAILED'} ({time.time() - t0:.1f} s)")
        rc = max(rc, mode_rc)
    return rc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("modes", help=f"comma list of {list(MODES)}, run in this order in one process (saves the "
                                      "start-up per mode); timeout uses WORLD's CE group, so it runs last but mismatch")
    parser.add_argument("--cases", type=int, default=1000, help="all-gather cases (correctness)")
    parser.add_argument("--rs-cases", type=int, default=300, help="reduce-scatter cases")
    parser.add_argument("--parts-cases", type=int, default=300, help="multi-tensor all-gathers / reduce-scatters (parts)")
    parser.add_argument("--symalloc-steps", type=int, default=200, help="random allocation steps (symalloc)")
    parser.add_argument("--a2a-cases", type=int, default=1000, help="all-to-all and broadcast cases (a2a_bcast)")
    parser.add_argument("--p2p-cases", type=int, default=1000, help="point-to-point batches (p2p)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    ok, reason = rt.available()
    if not ok:
        print(f"ce_overlap runtime not available: {reason}", flush=True)
        return 1
    step("setup: init_process_group")
    setup()
    rc = run_modes(modes, lambda mode: MODES[mode](args), echo=BREAKING)
    step("teardown")
    sys.stdout.flush()
    if any(m in BREAKING for m in modes):
        # A CE group is failed and NCCL may hold state of a peer that left: exit without collective teardown.
        os._exit(rc)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    faulthandler.cancel_dump_traceback_later()
    return rc


if __name__ == "__main__":
    sys.exit(main())
