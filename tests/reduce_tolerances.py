"""How far two training runs may drift apart when their gradient reduce-scatters sum in a different order, by the
reduction's dtype: (loss, gradient, parameter) relative errors after a few AdamW steps. One owner for the GPU
harnesses that compare a copy-engine run with NCCL's (tests/pass_gpu, tests/fsdp2_gpu).

Beyond 2 ranks the sums' order differs from NCCL's ring. A bf16 reduction rounds at every partial sum: NCCL's ring once
per hop, the copy engines' reduction once (an fp32 sum in rank order), so gradients differ by up to the (n - 1)
roundings of bf16's spacing (2^-8 relative), and AdamW turns a gradient element whose sign differs into parameter steps
of up to lr. Measured against NCCL on 4 H200s: FSDP2 grad 1.35e-2, param 3.8e-3, loss 7e-5
(bench/results/fsdp2-2026-11-26); the in-graph pass grad 7.7e-3, param 1.2e-3, loss 1.9e-5
(bench/results/step-prediction-2026-11-27-c). At 2 ranks both are one rounding of the same sum: bit-identical."""
import torch

TOLERANCES = {torch.float32: (1e-3, 1e-2, 1e-3), torch.bfloat16: (1e-3, 4 * 2.0 ** -8, 1e-2)}


def tolerances(reduce_dtype: torch.dtype, world: int) -> tuple[float, float, float]:
    """(loss, gradient, parameter) tolerances for runs whose reductions in `reduce_dtype` may sum in another order:
    the dtype's row beyond 2 ranks; at 1 or 2 ranks the order is the same, and fp32's bounds hold."""
    return TOLERANCES[reduce_dtype if world > 2 else torch.float32]
