"""torch.distributed.pipelining, unchanged, over the "ce_overlap" backend (and over NCCL where every rank has its own
GPU) against the same schedule over a host-staged gloo transport (for backend_worker.py's pipeline mode; also the
model of bench/pipeline.py).

The reference transport is a ProcessGroup written here: send copies the tensor to the host and sends it with gloo,
recv receives into host memory and copies it to the GPU at wait(). Both runs compute the same kernels on the same
GPU in the same order; only the bytes' path differs, so losses and gradients must be bit-identical.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import gpu_worker as gw
from pipeline_model import MB_SIZE, SEQ, VOCAB, build_stages, loss_fn, pipeline_stages

HOST_STAGED = "ce_test_host_staged"
# schedules with two stages per rank (loop layout) -> their torch.distributed.pipelining class
MULTI_STAGE = {"interleaved1f1b": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble"}


# ---------------------------------------------------------------------------------------------------------------
# The reference transport

class _CopyBack(dist.Work):
    def __init__(self, work, host, dst):
        super().__init__()
        self._work, self._host, self._dst = work, host, dst

    def wait(self, timeout=None):
        self._work.wait()
        with torch.no_grad():  # pipelining's receive buffers may be leaves that require grad
            self._dst.copy_(self._host)
        return True

    def is_completed(self):
        return self._work.is_completed()


class HostStagedGroup(dist.ProcessGroup):
    """send / recv of CUDA tensors through host memory over gloo; nothing else."""

    def __init__(self, gloo, rank: int, size: int):
        super().__init__(rank, size)
        self._gloo = gloo

    def send(self, tensors, dst, tag=0):
        host = tensors[0].detach().to("cpu")
        return self._gloo.send([host], dst, tag)

    def recv(self, tensors, src, tag=0):
        host = torch.empty(tensors[0].shape, dtype=tensors[0].dtype)
        return _CopyBack(self._gloo.recv([host], src, tag), host, tensors[0])

    def getBackendName(self):
        return HOST_STAGED


def host_staged_group():
    if HOST_STAGED.upper() not in dist.Backend._plugins:
        def create(store, rank, size, timeout):
            gloo = dist.ProcessGroupGloo(dist.PrefixStore("host_staged/", store), rank, size, timeout)
            return HostStagedGroup(gloo, rank, size)

        dist.Backend.register_backend(HOST_STAGED, create, devices=["cpu", "cuda"])
    return dist.new_group(backend=HOST_STAGED, timeout=datetime.timedelta(seconds=120))


# ---------------------------------------------------------------------------------------------------------------
# One schedule run

def run_schedule(schedule: str, n_mb: int, group) -> tuple[list[float], list[torch.Tensor]]:
    """Losses (on the last stage's rank) and every gradient of this rank's stages after one step."""
    import torch.distributed.pipelining as pp
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    virtual = 2 if schedule in MULTI_STAGE else 1
    num_stages = world * virtual
    modules = build_stages(num_stages, "cuda")
    mine = [rank + k * world for k in range(virtual)]
    device = torch.device("cuda", torch.cuda.current_device())
    stages = pipeline_stages(modules, mine, device, group)
    if virtual == 1:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        sched = cls(stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    else:
        sched = getattr(pp, MULTI_STAGE[schedule])(stages, n_microbatches=n_mb, loss_fn=loss_fn)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(77)
    tokens = torch.randint(0, VOCAB, (n_mb * MB_SIZE, SEQ), device=device, generator=gen)
    target = torch.randint(0, VOCAB, (n_mb * MB_SIZE, SEQ), device=device, generator=gen)
    losses: list = []
    if 0 in mine:
        sched.step(tokens)
    elif num_stages - 1 in mine:
        sched.step(target=target, losses=losses)
    else:
        sched.step()
    torch.cuda.synchronize()
    grads = [p.grad.detach().clone() for idx in mine for p in modules[idx].parameters()]
    return [float(x.item()) for x in losses], grads


def schedules() -> list[str]:
    """The schedules checked: GPipe, 1F1B and those of MULTI_STAGE the installed torch has."""
    import torch.distributed.pipelining as pp

    return ["gpipe", "1f1b"] + [name for name, cls in MULTI_STAGE.items() if hasattr(pp, cls)]


def run_all(ce_group, args) -> int:
    """Every schedule and microbatch count, CE (and NCCL where every rank has its own GPU) against the host-staged
    reference; returns the failures here."""
    torch.use_deterministic_algorithms(True)
    ref = host_staged_group()
    transports = [("ce_overlap", ce_group)]
    if not gw.SHARED_GPU:
        transports.append(("nccl", dist.new_group(backend="nccl")))
    failures = 0
    rank = dist.get_rank()
    for schedule in schedules():
        for n_mb in [int(m) for m in args.microbatches.split(",")]:
            for name, group in transports:
                gw.step(f"pipeline {schedule} {n_mb} microbatches over {name}")
                try:
                    got_losses, got_grads = run_schedule(schedule, n_mb, group)
                    ref_losses, ref_grads = run_schedule(schedule, n_mb, ref)
                except Exception as e:  # noqa: BLE001 (report it; every rank stops below)
                    import traceback

                    traceback.print_exc()
                    gw.log(f"pipeline {schedule} x{n_mb} over {name} FAILED: {type(e).__name__}: {e}")
                    failures += 1
                    gw.failed_on_all_ranks(failures)
                    return failures
                same = got_losses == ref_losses and len(got_grads) == len(ref_grads) and \
                    all(torch.equal(a, b) for a, b in zip(got_grads, ref_grads))
                if not same:
                    failures += 1
                if rank == dist.get_world_size() - 1 or not same:
                    gw.log(f"pipeline {schedule} x{n_mb} over {name}: losses {got_losses} vs {ref_losses}, "
                           f"{len(got_grads)} gradients, bit-identical to the host-staged transport: {same}")
                # Every rank stops at the first failure anywhere: a rank that went on would wait for peers that did not.
                if gw.failed_on_all_ranks(failures):
                    return failures
    return failures
