"""The training-step measurement of `ce-overlap calibrate`: a compiled forward + backward + fused AdamW of two
Llama-3-8B-width blocks under torch.profiler, for the GPU's idle time between kernels and the GEMM, attention and
optimizer time a step spends at steady clocks. torch is imported when it runs, not when this loads."""
from __future__ import annotations

import time

from .common import ADAMW_BYTES_PER_PARAM
from .timing import NotAvailable, sm_clock_and_power, torch_module


# A training step in miniature: forward + backward of two Llama-3-8B-width blocks (with the embedding and the
# 128256-vocabulary output layer) at 4096 tokens, fp32 parameters under bf16 autocast, compiled as a training step
# compiles them, then a fused AdamW step, so the kernels are
# Inductor's fused kernels, cuBLAS GEMMs and cuDNN attention at the sizes a step runs, launched back to back with
# the host ahead of the GPU, for long enough that the board runs at its steady (power-limited) clocks. It sets
# efficiency.kernel_gap_us (the GPU's idle time between kernels), and it corrects the GEMM and attention efficiencies
# fitted from short bursts to what the same kernels reach inside a step: on one H200 a bf16 8192^3 GEMM took 1387 us
# in a burst and 1621 us sustained (bench/results/compute-2026-11-24).
STEP_MODEL = dict(dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, seq_len=4096)
STEP_PROFILED = 3   # steps under the profiler
STEP_SUSTAIN_MS = 1500.0  # steps run before the profiled ones, so the clocks have settled


def step_gemms(cfg) -> list[list[int]]:
    """[m, n, k, count] of every GEMM of forward + backward of `STEP_MODEL`-like configs, one batch of seq_len tokens:
    each linear layer's forward (tokens x in -> out), input gradient and weight gradient (the same FLOPs each)."""
    t, d, kv = cfg.seq_len, cfg.dim, cfg.n_kv_heads * cfg.head_dim
    per_block = [(d, d), (d, kv), (d, kv), (d, d), (d, cfg.ffn_dim), (d, cfg.ffn_dim), (cfg.ffn_dim, d)]
    out: dict[tuple[int, int, int], int] = {}
    for n_in, n_out in per_block * cfg.n_layers + [(d, cfg.vocab_size)]:
        for shape in ((t, n_out, n_in), (t, n_in, n_out), (n_out, n_in, t)):  # forward, input grad, weight grad
            out[shape] = out.get(shape, 0) + 1
    return [[m, n, k, c] for (m, n, k), c in sorted(out.items())]


def measure_training_step(warmup: int, steps: int = STEP_PROFILED) -> tuple[dict, dict]:
    """(kernel_gap, training_step) measurements of the workload above, from torch.profiler: the GPU's idle time
    between consecutive kernels and copies ({workload, steps, kernels and idle_us per step, largest_gaps}), and the
    time per step of its GEMM and attention kernels with the work they did ({gemms, gemm_us, attention, attention_us})."""
    torch = torch_module()
    from torch.profiler import ProfilerActivity, profile

    from ..gpu_trace import gpu_activities, idle_between, largest_gaps, time_by_class
    from ..kernel_kinds import time_by_kind
    from ..models.llama import Llama, LlamaConfig, init_weights

    cfg = LlamaConfig(**STEP_MODEL)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg)
    init_weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    params = sum(p.numel() for p in model.parameters())

    def loss_fn(x, y):  # fp32 parameters, bf16 compute: what a mixed-precision step runs
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x, y)

    step_fn = torch.compile(loss_fn)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def one_step():
        step_fn(inputs, labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(max(2, warmup)):  # the first compiles
        one_step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    one_step()
    torch.cuda.synchronize()
    for _ in range(int(STEP_SUSTAIN_MS / 1e3 / max(time.perf_counter() - t0, 1e-3))):
        one_step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        # Every profiled step is queued: the GPU runs them while the host asks (nvidia-smi takes ~0.1 s; asked
        # before them, the GPU would idle and its clock rise).
        clock = sm_clock_and_power()
        torch.cuda.synchronize()
    activities = gpu_activities(prof)
    del model, step_fn, opt
    torch.cuda.empty_cache()
    if not activities:
        raise NotAvailable("torch.profiler recorded no GPU activity (CUPTI unavailable?)")
    by_class = time_by_class(activities, steps)
    workload = (f"forward + backward + fused AdamW, {cfg.n_layers} blocks dim {cfg.dim} ffn {cfg.ffn_dim} vocab "
                f"{cfg.vocab_size}, {cfg.seq_len} tokens, fp32 parameters, bf16 autocast, torch.compile")
    gap = {"workload": workload, "steps": steps, "kernels": round(len(activities) / steps, 1),
           "idle_us": round(idle_between([a[:2] for a in activities]) / steps, 1),
           "largest_gaps": largest_gaps([a[:3] for a in activities], 3)}
    step = {"workload": workload, "gemms": step_gemms(cfg), "gemm_us": round(by_class.get("gemm", 0.0), 1),
            "attention": {"batch": 1, "heads": cfg.n_heads, "seq": cfg.seq_len, "head_dim": cfg.head_dim,
                          "causal": True, "layers": cfg.n_layers},
            "attention_us": round(by_class.get("attention", 0.0), 1),
            "optimizer": {"params": params, "bytes": ADAMW_BYTES_PER_PARAM * params,
                          "us": round(by_class.get("optimizer", 0.0), 1)},
            "by_class_us": {k: round(v, 1) for k, v in sorted(by_class.items())},
            # Per kind of kernel (casts, RMSNorm, SiLU, RoPE, loss, ...): what each reaches inside a compiled step,
            # against the model's bytes of the same kernels (bench/step_prediction.py --trace does it for a run).
            "by_kind_us": {k: round(v, 1) for k, v in sorted(time_by_kind(activities, steps).items())}}
    if clock:
        step["clock"] = clock  # the SM clock and power the step ran at (what the fitted efficiencies hold for)
    return gap, step
