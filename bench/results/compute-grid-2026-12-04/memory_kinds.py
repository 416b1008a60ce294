"""The compute grid's memory-bound kernels timed two ways, on one GPU: CUDA events around each op (how
`ce-overlap calibrate --compute-grid` times them) and the kernels' own durations from torch.profiler (how a training
step's kernel profile times them, bench/lib/kernel_profile.py); and the cross-entropy loss's forward and backward as
Inductor compiles them from autograd, each kernel on its own. Prints a table and writes JSON.

    python3 bench/results/compute-grid-2026-12-04/memory_kinds.py --out memory_kinds.json

Needs torch and a GPU only (no ce_overlap build).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

MIBS = (1, 4, 16, 64, 256, 1024)  # MiB per bf16 operand (calibrate/common.py GRID_MEMORY_MIB)


def events_us(fn, iters: int) -> float:
    """Median per-op time from CUDA events around each op, the stream held ahead (calibrate/timing.py's way)."""
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e6))  # ~1 ms: the host enqueues every op before the first runs
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def kernels_us(fn, iters: int) -> dict[str, float]:
    """Per kernel name, its mean duration per call of `fn` (us), from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in ("Memset (Device)",):
            if "Memcpy" in e.name or "Memset" in e.name:
                continue
            out[e.name] = out.get(e.name, 0.0) + e.device_time / iters  # device_time: us
    return out


def grid_kernels(mib: int):
    """(name, fn, HBM bytes) of the grid's memory kernels at `mib` MiB per operand (calibrate/kernels.py's)."""
    numel = (mib << 20) // 2
    a = torch.randn(numel // 1024, 1024, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    f32 = torch.randn(numel, device="cuda")
    cast_out = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    logits = a.view(-1, 32768) if numel >= 32768 else a.view(1, -1)
    labels = torch.randint(0, logits.shape[-1], (logits.shape[0],), device="cuda")
    g = torch.ones((), device="cuda")
    return [("add", lambda: torch.add(a, b, out=c), 3 * numel * 2),
            ("silu_mul", lambda: K["silu_mul"](a, b), 3 * numel * 2),
            ("rmsnorm", lambda: K["rms"](a), 2 * numel * 2),
            ("cast_f32_bf16", lambda: cast_out.copy_(f32), numel * 6),
            ("gelu_tanh", lambda: K["gelu_tanh"](a), 2 * numel * 2),
            ("layernorm", lambda: K["layernorm"](a), 2 * numel * 2),
            ("column_sum", lambda: K["column_sum"](a), numel * 2),
            ("cross_entropy", lambda: (K["ce_forward"](logits, labels), K["ce_backward"](logits, labels, g)),
             3 * numel * 2)]


K: dict = {}


def compile_kernels() -> None:
    K["silu_mul"] = torch.compile(lambda x, y: F.silu(x) * y, dynamic=False)
    K["rms"] = torch.compile(lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype),
                             dynamic=False)
    K["gelu_tanh"] = torch.compile(lambda x: F.gelu(x, approximate="tanh"), dynamic=False)
    K["layernorm"] = torch.compile(lambda x: F.layer_norm(x.float(), x.shape[-1:]).to(x.dtype), dynamic=False)
    K["column_sum"] = torch.compile(lambda x: x.float().sum(0).to(x.dtype), dynamic=False)
    K["ce_forward"] = torch.compile(lambda x, y: F.cross_entropy(x.float(), y), dynamic=False)
    K["ce_backward"] = torch.compile(lambda x, y, g: ((torch.softmax(x.float(), -1) - F.one_hot(y, x.shape[-1])) * g
                                                      / x.shape[0]).to(x.dtype), dynamic=False)
    K["ce_autograd"] = torch.compile(lambda x, y: F.cross_entropy(x.float(), y), dynamic=False)


def loss_autograd(mib: int, vocab: int, iters: int) -> dict:
    """The loss's forward and backward kernels as a compiled training step has them (AOTAutograd's forward saves the
    softmax statistics; the backward reads the logits once and writes their gradient)."""
    numel = (mib << 20) // 2
    rows = max(numel // vocab, 1)
    x = torch.randn(rows, vocab, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    y = torch.randint(0, vocab, (rows,), device="cuda")

    def step():
        K["ce_autograd"](x, y).backward()
        x.grad = None

    for _ in range(3):
        step()
    per = kernels_us(step, iters)
    fwd = sum(us for n, us in per.items() if "backward" not in n)
    bwd = sum(us for n, us in per.items() if "backward" in n)
    logit_bytes = rows * vocab * 2
    return {"mib": mib, "vocab": vocab, "rows": rows, "logit_bytes": logit_bytes, "forward_us": fwd,
            "backward_us": bwd, "kernels": per}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="memory_kinds.json")
    args = p.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 64  # one compile per shape (dynamic=False), as the grid does
    compile_kernels()
    hbm = 4800e3  # bytes per us (H200's HBM3e peak, the profile's gpu.hbm_gbps)
    rows, losses = [], []
    for mib in MIBS:
        for name, fn, nbytes in grid_kernels(mib):
            for _ in range(5):
                fn()
            ev = events_us(fn, args.iters)
            per = kernels_us(fn, args.iters)
            kern = sum(per.values())
            rows.append({"name": name, "mib": mib, "bytes": nbytes, "events_us": ev, "kernel_us": kern,
                         "kernels": len(per)})
            print(f"{name:<14} {mib:5d} MiB {nbytes / 2**20:8.0f} MiB moved  events {ev:9.1f} us ({nbytes / ev / hbm:5.3f})"
                  f"  kernels {kern:9.1f} us ({nbytes / max(kern, 1e-9) / hbm:5.3f})  x{len(per)}", flush=True)
        torch.cuda.empty_cache()
    for vocab in (32768, 128256):
        for mib in (16, 64, 256, 1024):
            r = loss_autograd(mib, vocab, args.iters)
            losses.append(r)
            lb = r["logit_bytes"]
            print(f"loss autograd vocab {vocab:6d} {lb / 2**20:7.0f} MiB logits: forward {r['forward_us']:8.1f} us "
                  f"({lb / r['forward_us'] / hbm:5.3f} at 1 pass)  backward {r['backward_us']:8.1f} us "
                  f"({2 * lb / r['backward_us'] / hbm:5.3f} at 2 passes)  "
                  f"{sorted((round(v, 1), k[:70]) for k, v in r['kernels'].items())}", flush=True)
            torch.cuda.empty_cache()
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        info.update(sm_mhz=torch.cuda.clock_rate(), power_w=torch.cuda.power_draw() / 1e3)
    except Exception:  # noqa: BLE001
        pass
    with open(args.out, "w") as f:
        json.dump({"info": info, "command": " ".join(sys.argv), "kernels": rows, "loss": losses}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
