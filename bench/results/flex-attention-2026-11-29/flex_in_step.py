"""Flex attention's kernels inside a compiled training step on one GPU, against the cost model's price for them:
tests/data/titan_llama.py at Llama-3-8B widths (dim 4096, 32 / 8 heads, FFN 14336, vocabulary 128256), 2 blocks,
seq 4096, bf16, forward + backward under torch.compile; 1.5 s of steps first (steady clocks), then 3 steps under
torch.profiler. Prints the kernels whose names say flex attention, by direction, per step. Run on the GPU machine
from the repository root (the cost model's side: flex_in_step_model.py on the CPU):

    python bench/results/flex-attention-2026-11-29/flex_in_step.py > $OUT/flex_in_step.txt
"""
import dataclasses
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "data"))
import titan_llama  # noqa: E402

CFG = dataclasses.replace(titan_llama.TitanConfig(), vocab_size=128256, dim=4096, n_layers=2, n_heads=32,
                          n_kv_heads=8, ffn_dim=14336, seq_len=4096, batch=1)


def main() -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = titan_llama.WithLoss(CFG).to(torch.bfloat16)
    step_fn = torch.compile(model)
    tokens = torch.randint(0, CFG.vocab_size, (CFG.batch, CFG.seq_len), device="cuda")

    def step():
        step_fn(tokens, tokens).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.5:
        step()
    torch.cuda.synchronize()
    steps = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            by_name.setdefault(ev.name, []).append(ev.time_range.end - ev.time_range.start)
    total = sum(sum(v) for v in by_name.values()) / steps / 1e3
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, config {CFG}")
    print(f"GPU kernel time per step {total:.2f} ms; the 12 longest kernels by name (ms per step, calls per step):")
    for name, durs in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]:
        print(f"  {sum(durs) / steps / 1e3:8.3f}  {len(durs) / steps:5.1f}  {name[:150]}")
    tem = {n: v for n, v in by_name.items() if n.startswith("triton_tem")}  # Inductor's templates: flex, here
    print("Inductor template kernels (ms per step, calls per step):")
    for name, durs in sorted(tem.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {sum(durs) / steps / 1e3:8.3f}  {len(durs) / steps:5.1f}  {name[:150]}")
    flex = {n: v for n, v in by_name.items() if "flex" in n.lower()}
    fwd = sum(sum(v) for n, v in flex.items() if "backward" not in n.lower() and "bwd" not in n.lower())
    bwd = sum(sum(v) for n, v in flex.items() if "backward" in n.lower() or "bwd" in n.lower())
    print(f"flex attention kernels per step: forward {fwd / steps / 1e3:.3f} ms, backward {bwd / steps / 1e3:.3f} ms "
          f"({len(flex)} kernel names: {sorted(n[:80] for n in flex)})")


if __name__ == "__main__":
    main()
