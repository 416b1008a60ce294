"""The compute and memory measurements of `ce-overlap calibrate`, one GPU each: square and transformer-shaped bf16
GEMMs, causal attention, fused AdamW, activation-sized memory-bound kernels, the CE reduction kernel alone and
beside compute, and the one-way peer copy. torch is imported when a measurement runs, not when this loads."""
from __future__ import annotations

import statistics

from .common import (ADAMW_BYTES_PER_PARAM, ATTENTION_SHAPE, COMPUTE_KINDS, GRID_ATTENTION, GRID_GEMM_DIMS,
                     GRID_MEMORY_MIB, GRID_TINY_KERNELS, MEMBOUND_BYTES_PER_OPERAND, MIB, OPTIMIZER_PARAMS,
                     TRANSFORMER_GEMMS)
from .timing import (NotAvailable, gpu_head_start, kernel_median_us, kernel_medians_us, measure_beside, median_us,
                     time_each_us, torch_module)


def make_compute(kind: str):
    """(fn, work) for `gemm` (bf16 8192^3 by default) or `memory_bound` (add of 1 GiB bf16 tensors)."""
    torch = torch_module()
    if kind == "gemm" or kind.startswith("gemm"):
        n = int(kind[4:] or 8192)
        a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        c = torch.empty(n, n, dtype=torch.bfloat16, device="cuda")
        return (lambda: torch.mm(a, b, out=c)), {"n": n, "flops": 2 * n ** 3}
    if kind == "memory_bound":
        numel = MEMBOUND_BYTES_PER_OPERAND // 2
        x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        y = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
        z = torch.empty_like(x)
        return (lambda: torch.add(x, y, out=z)), {"bytes": 3 * numel * 2}
    raise ValueError(kind)


# as Inductor fuses them: elementwise adds (2 reads, 1 write), SwiGLU's silu(a) * b, and a row-wise RMSNorm-like
# reduction (1 read, 1 write). Their median efficiency is efficiency.memory: a 1 GiB add streams faster than these.
MEMORY_KERNEL_MIB = (32, 112)


def measure_memory_kernels(iters: int, warmup: int) -> list[dict]:
    """[{name, bytes, us}] for the memory-bound kernels above, each at MEMORY_KERNEL_MIB per operand."""
    return [{"name": f"{name} {mib} MiB", "bytes": nbytes, "us": us}
            for name, mib, nbytes, us in _memory_kernel_times(MEMORY_KERNEL_MIB, 4096, iters, warmup)]


def _memory_kernel_times(mibs, columns: int, iters: int, warmup: int,
                         timer=median_us) -> list[tuple[str, int, int, float]]:
    """(name, MiB per operand, HBM bytes, median us) of an add, SwiGLU's silu(a) * b and an RMSNorm-like row reduction
    over bf16 operands of each size in `mibs`, rows of `columns` elements. `timer`: median_us (events) or
    kernel_median_us (the kernels' own durations)."""
    torch = torch_module()
    # dynamic=False: the same code at a second size would otherwise recompile as a dynamic-shape kernel,
    # which is not what a training step's static shapes run.
    silu_mul = torch.compile(lambda x, y: torch.nn.functional.silu(x) * y, dynamic=False)
    rms = torch.compile(lambda x: x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype),
                        dynamic=False)
    out = []
    for mib in mibs:
        numel = (mib << 20) // 2
        a = torch.randn(numel // columns, columns, dtype=torch.bfloat16, device="cuda")
        b = torch.randn_like(a)
        c = torch.empty_like(a)
        for name, fn, nbytes in (("add", lambda: torch.add(a, b, out=c), 3 * numel * 2),
                                 ("silu_mul", lambda: silu_mul(a, b), 3 * numel * 2),
                                 ("rmsnorm", lambda: rms(a), 2 * numel * 2)):
            out.append((name, mib, nbytes, timer(fn, iters, warmup)))
        del a, b, c
        torch.cuda.empty_cache()
    return out


def _fused_kind_times(mibs, iters: int, warmup: int) -> list[tuple[str, int, int, float]]:
    """(name, MiB per operand, HBM bytes, median kernel us) of the fused kernels a training step runs beyond an add,
    SwiGLU and an RMSNorm (_memory_kernel_times), as Inductor compiles them, over bf16 operands of each size in `mibs`:
    GELU with tanh and with erf (transcendental pointwise), LayerNorm (two statistics per row), a bias gradient's sum
    over rows (a column reduction), and the cross-entropy loss over vocabulary-wide rows as a compiled training step
    runs it: the forward's kernels (the softmax statistics: one read of the logits) and the backward's (the logits read
    and their gradient written), each kernel timed by its own duration, the two apart: per byte the forward runs at
    about half the backward's rate (bench/results/compute-grid-2026-12-04)."""
    torch = torch_module()
    import torch.nn.functional as F

    gelu_tanh = torch.compile(lambda x: F.gelu(x, approximate="tanh"), dynamic=False)
    gelu_erf = torch.compile(lambda x: F.gelu(x), dynamic=False)
    layernorm = torch.compile(lambda x: F.layer_norm(x.float(), x.shape[-1:]).to(x.dtype), dynamic=False)
    column_sum = torch.compile(lambda x: x.float().sum(0).to(x.dtype), dynamic=False)
    loss = torch.compile(lambda x, y: F.cross_entropy(x.float(), y), dynamic=False)
    out = []
    for mib in mibs:
        numel = (mib << 20) // 2
        a = torch.randn(numel // 1024, 1024, dtype=torch.bfloat16, device="cuda")
        rows = [("gelu_tanh", lambda: gelu_tanh(a), 2 * numel * 2),
                ("gelu_erf", lambda: gelu_erf(a), 2 * numel * 2),
                ("layernorm", lambda: layernorm(a), 2 * numel * 2),
                ("column_sum", lambda: column_sum(a), numel * 2)]
        for name, fn, nbytes in rows:
            out.append((name, mib, nbytes, kernel_median_us(fn, iters, warmup)))
        logits = (a.view(-1, 32768) if numel >= 32768 else a.view(1, -1)).detach().requires_grad_()  # vocab-wide rows
        labels = torch.randint(0, logits.shape[-1], (logits.shape[0],), device="cuda")
        forward = kernel_median_us(lambda: loss(logits, labels), iters, warmup)  # the training graph's forward

        def forward_backward():
            loss(logits, labels).backward()
            logits.grad = None

        both = kernel_median_us(forward_backward, iters, warmup)
        out.append(("loss_forward", mib, numel * 2, forward))
        out.append(("loss_backward", mib, 2 * numel * 2, max(both - forward, 1e-3)))
        del a, logits, labels
        torch.cuda.empty_cache()
    return out


def measure_optimizer(iters: int, warmup: int, numel: int = OPTIMIZER_PARAMS) -> dict:
    """One fused AdamW step (torch.optim.AdamW(fused=True)) over `numel` fp32 parameters in 64 tensors, as a training
    step runs it over fp32 master shards: ADAMW_BYTES_PER_PARAM bytes of HBM traffic per parameter."""
    torch = torch_module()
    n = numel // 64
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for _ in range(64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    us = median_us(opt.step, iters, warmup)
    del opt, params
    torch.cuda.empty_cache()
    return {"params": 64 * n, "bytes": ADAMW_BYTES_PER_PARAM * 64 * n, "us": us}


def measure_attention(iters: int, warmup: int, shape: tuple = ATTENTION_SHAPE, causal: bool = True,
                      timer=median_us) -> dict:
    """bf16 scaled-dot-product attention as the models call it (causal for language models): forward alone, and
    forward + backward (the backward is the difference), medians in us. `shape`: (batch, heads, seq, head_dim), or with
    a fifth entry that says whether it is causal (common.GRID_ATTENTION's). `timer`: median_us (events) or
    kernel_median_us."""
    torch = torch_module()
    import torch.nn.functional as F

    b, h, s, d = shape[:4]
    causal = bool(shape[4]) if len(shape) > 4 else causal
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, dtype=torch.bfloat16, device="cuda")

    def forward():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), grad)

    fwd = timer(forward, iters, warmup)
    both = timer(forward_backward, iters, warmup)
    return {"batch": b, "heads": h, "seq": s, "head_dim": d, "causal": causal, "forward_us": fwd,
            "backward_us": max(both - fwd, 1e-3)}


def measure_transformer_gemms(iters: int, warmup: int) -> list[dict]:
    """bf16 GEMMs of TRANSFORMER_GEMMS, each as forward / input gradient / weight gradient: [{m, n, k, kind, us}]
    where the product is (m x k) @ (k x n)."""
    torch = torch_module()
    out = []
    for tokens, n_out, n_in in TRANSFORMER_GEMMS:
        x = torch.randn(tokens, n_in, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(n_out, n_in, dtype=torch.bfloat16, device="cuda")
        dy = torch.randn(tokens, n_out, dtype=torch.bfloat16, device="cuda")
        for kind, fn, (m, n, k) in (("forward", lambda: x @ w.t(), (tokens, n_out, n_in)),
                                    ("input_grad", lambda: dy @ w, (tokens, n_in, n_out)),
                                    ("weight_grad", lambda: dy.t() @ x, (n_out, n_in, tokens))):
            out.append({"m": m, "n": n, "k": k, "kind": kind, "us": median_us(fn, iters, warmup)})
        del x, w, dy
    torch.cuda.empty_cache()
    return out


def measure_reduction_kernel(iters: int, warmup: int) -> dict:
    """The CE reduce-scatter's reduction kernel (out = a + b, bf16, 256 MiB operands, on the runtime's CTA count,
    CE_OVERLAP_REDUCE_SMS) alone, and the bf16 GEMM and the memory-bound add each beside it running non-stop: what
    ce.reduce_gbps_per_sm and contention.ce_reduction come from. One GPU is enough."""
    torch = torch_module()
    from .. import runtime

    lib = runtime.library_loaded()
    if not lib:
        raise NotAvailable(f"CE runtime unavailable ({lib.reason})")
    import ce_overlap.runtime.testing as rtt
    from ..runtime.config import RuntimeConfig

    ctas = int(RuntimeConfig.from_env().reduce_sms)
    numel = 256 * MIB // 2
    a = torch.randn(numel, device="cuda").to(torch.bfloat16)
    b = torch.randn(numel, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(a)

    def kernel():
        rtt.reduce_bench(out, a, b, ctas)

    k_us = median_us(kernel, iters, warmup)
    r: dict = {"ctas": ctas, "bytes": 3 * numel * 2, "us": k_us}
    for compute in COMPUTE_KINDS:
        cfn, _ = make_compute(compute)
        alone = median_us(cfn, iters, warmup)
        beside, _ = measure_beside(cfn, kernel, torch.cuda.synchronize, alone, k_us, iters)
        r[compute] = {"alone_us": alone, "beside_us": beside}
        del cfn
        torch.cuda.empty_cache()
    return r


def measure_peer_copy(nbytes: int = 256 * MIB, iters: int = 5) -> dict:
    """One-way cudaMemcpy from this process's GPU into the next visible one (torch copy between devices: peer
    access, not a ce_overlap collective). Only the link's bandwidth is taken from it."""
    torch = torch_module()
    src = torch.cuda.current_device()
    dst = (src + 1) % torch.cuda.device_count()
    if dst == src:
        raise NotAvailable("one visible GPU")
    if not torch.cuda.can_device_access_peer(src, dst):
        raise NotAvailable(f"no P2P between cuda:{src} and cuda:{dst}")
    bufs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in (src, dst)]
    us = statistics.median(time_each_us(lambda: bufs[1].copy_(bufs[0], non_blocking=True), iters, 2,
                                        lambda: (torch.cuda.synchronize(src), torch.cuda.synchronize(dst))))
    bufs.clear()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "us": us, "from": src, "to": dst}


def measure_compute_grid(iters: int, warmup: int, log=None) -> dict:
    """The compute grid (common.GRID_*): {"gemms": [{m, n, k, layout, us}], "attention": [{batch, heads, seq, head_dim,
    causal, forward_us, backward_us}], "memory": [{name, mib, bytes, us}], "tiny_kernel_us": float}. One GPU, no
    collectives; bf16 throughout; every op timed by its kernels' own durations (kernel_medians_us), as a training
    step's kernel profile times them. `log`: called with a line per part done."""
    torch = torch_module()
    grid: dict = {"gemms": [], "attention": [], "memory": []}
    dims = GRID_GEMM_DIMS
    big = max(dims)
    # Operands cut from three buffers of the largest size: no allocation per shape.
    pool = [torch.randn(big * big, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    for m in dims:
        for n in dims:
            for k in dims:
                x = pool[0][:m * k].view(m, k)            # activations (tokens x in)
                w = pool[1][:n * k].view(n, k)            # weight (out x in): x @ w.T is m x n
                out = pool[2][:m * n].view(m, n)
                a_t = pool[0][:k * m].view(k, m)          # dy.T @ x: the weight gradient's layout (k = tokens)
                b_nt = pool[1][:k * n].view(k, n)
                layouts = {"nt": lambda: torch.mm(x, w.t(), out=out), "nn": lambda: torch.mm(x, b_nt, out=out),
                           "tn": lambda: torch.mm(a_t.t(), b_nt, out=out)}
                for layout, us in zip(layouts, kernel_medians_us(list(layouts.values()), iters, warmup)):
                    grid["gemms"].append({"m": m, "n": n, "k": k, "layout": layout, "us": us})
    del pool
    torch.cuda.empty_cache()
    if log:
        log(f"compute grid: {len(grid['gemms'])} GEMMs")
    for shape in GRID_ATTENTION:
        grid["attention"].append(measure_attention(iters, warmup, shape, timer=kernel_median_us))
    torch.cuda.empty_cache()
    if log:
        log(f"compute grid: {len(grid['attention'])} attention shapes")
    grid["memory"] = [{"name": name, "mib": mib, "bytes": nbytes, "us": us}
                      for name, mib, nbytes, us in _memory_kernel_times(GRID_MEMORY_MIB, 1024, iters, warmup,
                                                                        timer=kernel_median_us)
                      + _fused_kind_times(GRID_MEMORY_MIB, iters, warmup)]
    if log:
        log(f"compute grid: {len(grid['memory'])} memory-bound kernels")
    grid["tiny_kernel_us"] = _tiny_kernel_us()
    return grid


def _tiny_kernel_us(repeats: int = 3) -> float:
    """The GPU's time per kernel in a run of GRID_TINY_KERNELS tiny adds enqueued behind a held stream (so the host's
    enqueueing is not timed): the floor a graph of many small kernels pays per kernel. Median of `repeats`."""
    torch = torch_module()
    tiny = torch.zeros(1024, device="cuda")
    tiny.add_(1.0)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        gpu_head_start(GRID_TINY_KERNELS * 20.0)  # longer than the host takes to enqueue them (~5 us each)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(GRID_TINY_KERNELS):
            tiny.add_(1.0)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / GRID_TINY_KERNELS)
    return statistics.median(times)
