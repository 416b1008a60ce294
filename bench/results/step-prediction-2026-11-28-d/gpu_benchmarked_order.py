"""Does the scheduler order the step differently when it benchmarks its compute nodes on a real GPU (as in training)
than when the cost model answers its benchmarks (a capture without a GPU)? Captures the 8-layer step (2 ranks, the
lookup, the torchtitan wrap) both ways on a GPU machine and prices each order alike (step_model.SCHEDULER_CAPTURED).
    python bench/results/step-prediction-2026-11-28-d/gpu_benchmarked_order.py
"""
import argparse
import contextlib
import sys

sys.path.insert(0, 'bench')
import torch  # noqa: E402
import train  # noqa: E402
from ce_overlap.fx import capture as cap  # noqa: E402
from ce_overlap.step_model import SCHEDULER_CAPTURED  # noqa: E402

args = argparse.Namespace(model='llama3-8b', layers=8, seq_len=4096, batch=1, gqa='expand',
                          vocab_parallel_embeddings=True, in_graph_wrap='torchtitan', fsdp2_wrap='torchtitan')
ir = train.capture_step(args, 2)
model_answers = train.capture_step(args, 2, overlap_scheduler="h200-sxm")
with torch.cuda.device(0):
    real = cap._scheduler_running
    cap._scheduler_running = lambda profile: contextlib.nullcontext()  # the scheduler benchmarks on the GPU itself
    try:
        gpu_benchmarked = train.capture_step(args, 2, overlap_scheduler="h200-sxm")
    finally:
        cap._scheduler_running = real
for label, sched in (("cost model answers the benchmarks", model_answers), ("benchmarked on the GPU", gpu_benchmarked)):
    pieces, ms = train.predict_steps(args, 2, "h200-sxm", ir=ir, scheduler_ir=sched)
    kept = pieces["scheduler"]["plan"]
    print(f"{label}: {SCHEDULER_CAPTURED} {ms[SCHEDULER_CAPTURED]:.1f} ms; exposed "
          + ", ".join(f"{g} {p['exposed_comm_us_after'] / 1e3:.2f}" for g, p in kept.items())
          + " ms; slowdown " + ", ".join(f"{g} {p['slowdown_us'] / 1e3:.2f}" for g, p in kept.items()) + " ms", flush=True)
    order = [n["name"] for g in sched.to_dict()["graphs"] for n in g["nodes"] if n["kind"] in ("collective", "wait")]
    print(f"  collectives and waits in order ({len(order)}): {' '.join(order[:40])} ...", flush=True)
