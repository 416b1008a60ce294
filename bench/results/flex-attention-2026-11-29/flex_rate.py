"""Flex attention's rate on one GPU against SDPA's, at Llama-3-8B attention shapes (32 query heads, 8 K/V heads,
head dim 128, bf16, causal), forward and forward + backward, timed with CUDA events after warm-up: the rate the cost
model's attention efficiency should give flex attention's nodes. FLOPs as the IR counts them (ce_overlap.fx.flops:
flex attention's executed 128 x 128 tiles, SDPA's causal pairs), over the profile's bf16 peak. Run on the GPU machine
from the repository root:

    python bench/results/flex-attention-2026-11-29/flex_rate.py > $OUT/flex_rate.txt
"""
import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ce_overlap.fx.flops import attention_backward_flops, attention_flops
from ce_overlap.profiles import builtin_for_device, read_text

PROFILE = builtin_for_device(torch.cuda.get_device_name())
PEAK = json.loads(read_text(PROFILE))["gpu"]["peak_bf16_tflops"]
flex = torch.compile(flex_attention, fullgraph=True)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def timed(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps  # us


def main() -> None:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, profile {PROFILE} (bf16 peak {PEAK} TFLOP/s)")
    print("| seq | kernel | forward us | TFLOP/s | efficiency | backward us | TFLOP/s | efficiency |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for seq in (2048, 4096, 8192):
        shape_q, shape_kv = (1, 32, seq, 128), (1, 8, seq, 128)
        q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        mask = create_block_mask(causal, None, None, seq, seq, device="cuda")
        tiles = seq // 128
        density = tiles * (tiles + 1) / 2 / tiles ** 2
        runs = {
            "flex": (lambda: flex(q, k, v, block_mask=mask, enable_gqa=True),
                     attention_flops(shape_q, shape_kv, shape_kv) * density,
                     attention_backward_flops(shape_q, shape_kv, shape_kv) * density),
            "sdpa (cuDNN)": (lambda: _sdpa(q, k, v, SDPBackend.CUDNN_ATTENTION),
                             attention_flops(shape_q, shape_kv, shape_kv, causal=True),
                             attention_backward_flops(shape_q, shape_kv, shape_kv, causal=True)),
            "sdpa (flash)": (lambda: _sdpa(q, k, v, SDPBackend.FLASH_ATTENTION),
                             attention_flops(shape_q, shape_kv, shape_kv, causal=True),
                             attention_backward_flops(shape_q, shape_kv, shape_kv, causal=True)),
        }
        for name, (fwd, f_flops, b_flops) in runs.items():
            try:
                with torch.no_grad():
                    fwd_us = timed(fwd)
                grad = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)

                def step():
                    fwd().backward(grad)
                both_us = timed(step)
            except Exception as e:  # noqa: BLE001 (a backend this build lacks: say so, measure the others)
                print(f"| {seq} | {name} | failed: {type(e).__name__}: {str(e).splitlines()[0][:120]} |||||||")
                continue
            bwd_us = both_us - fwd_us
            f_rate, b_rate = f_flops / fwd_us / 1e6, b_flops / bwd_us / 1e6
            print(f"| {seq} | {name} | {fwd_us:.1f} | {f_rate:.0f} | {f_rate / PEAK:.3f} | {bwd_us:.1f} | {b_rate:.0f} "
                  f"| {b_rate / PEAK:.3f} |", flush=True)
            out.append({"seq": seq, "kernel": name, "forward_us": fwd_us, "backward_us": bwd_us,
                        "forward_eff": f_rate / PEAK, "backward_eff": b_rate / PEAK})
    json.dump(out, sys.stderr)


def _sdpa(q, k, v, backend):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


if __name__ == "__main__":
    main()
