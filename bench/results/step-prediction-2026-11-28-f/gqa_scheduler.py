"""Does torch's overlap scheduler compile a grouped-query-attention model? The zoo's llama3-tiny (4 K/V heads for 8
query heads, SDPA with enable_gqa) captured at 2 ranks with the scheduler on: with the device's own estimates
(Inductor's config alone: on a GPU, the scheduler as a user runs it but for the fake group's collective estimates) and
with the cost model's (ce_overlap's overlap_scheduler). Prints each outcome and the SDPA kernel the graphs hold.

    python bench/results/step-prediction-2026-11-28-f/gqa_scheduler.py
"""
import torch

import ce_overlap
from ce_overlap.fx.overlap_scheduler import INDUCTOR_CONFIG

print("torch", torch.__version__, "GPU", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for label, kw in (("the device's estimates", {"inductor_config": INDUCTOR_CONFIG}),
                  ("the cost model's estimates", {"overlap_scheduler": "h200-sxm"})):
    try:
        ir = ce_overlap.ir.capture_named("llama3-tiny", world_size=2, **kw)
        ops = sorted({n["op"] for g in ir.to_dict()["graphs"] for n in g["nodes"] if "attention" in n["op"]})
        print(f"{label}: captured; attention ops {ops}")
    except ce_overlap.CeOverlapError as e:
        print(f"{label}: {e}")
