"""`ce-overlap calibrate`: measure this machine and write a hardware profile (schema ce_overlap.profile/2).

Run it under torchrun, one process per GPU of one node (`torchrun --standalone --nproc-per-node N -m ce_overlap.cli
calibrate -o FILE`); a plain `ce-overlap calibrate -o FILE` calibrates one GPU and skips the collectives. It measures

- bf16 GEMMs (2048^3, 4096^3, 8192^3) and a memory-bound add of 1 GiB tensors, alone;
- per size (64 KiB .. 256 MiB per rank by default): NCCL all-gather, reduce-scatter and send/recv, the ce_overlap
  copy-engine all-gather (in place on symmetric memory, what the cost model describes) and, when the runtime has it,
  the copy-engine reduce-scatter;
- the GEMM's and the memory-bound kernel's slowdown beside each collective at one size (256 MiB per rank), and the
  collective's own slowdown beside them;
- one-way peer-copy bandwidth between two GPUs (plain cudaMemcpy through torch, for the link efficiency),

then starts from the built-in profile of the detected GPU (or `--base`), replaces what it measured, fits the rest
(docs/cost_model.md, "Calibrating") and writes the file after loading it through the C++ loader. Rank 0 writes and
prints; the other ranks take part in the collectives.

The package has two halves: the measuring code (torch, imported lazily, and GPUs) and the profile writer (plain
dicts in, no GPU), so a measurements file (`--measurements` / `--from-measurements`) can be turned into a profile
anywhere, and the writer is tested without GPUs. One module per concern:

- common.py: the measurements schema, the workload constants, sizes as text, the progress bar;
- measuring: timing.py (CUDA-event timing, medians over ranks, a kernel beside another stream's work), kernels.py
  (GEMMs, attention, AdamW, memory-bound kernels, the CE reduction kernel, the peer copy), step.py (a compiled
  training step under the profiler), collectives.py (NCCL and CE collectives, the slowdowns beside them) and
  measurements.py (`measure`: all of them in order, into one measurements dict);
- fitting: check.py (`check_measurements`), model.py (what the C++ cost model predicts for a profile dict) and
  fit.py (`build_profile`, one step per profile section, and `write_profile`);
- report.py: `fit_report` and the text report; command.py: `main`, the command.

This module only re-exports the names other code imports (`from ce_overlap import calibrate;
calibrate.build_profile(...)`).
"""
from __future__ import annotations

from .check import check_measurements
from .collectives import Collectives, measure_slowdowns, pool_config
from .command import main
from .common import (ADAMW_BYTES_PER_PARAM, ATTENTION_SHAPE, COLLECTIVES, COMPUTE_KINDS, GEMM_SIZES, MAX_DECREASE,
                     MEASUREMENTS_SCHEMA, MEMBOUND_BYTES_PER_OPERAND, MIB, MIN_SLOWDOWN, OPTIMIZER_PARAMS,
                     TRANSFORMER_GEMMS, Progress, attention_executed_flops, format_bytes, parse_size)
from .fit import build_profile, nnls2, solve, write_profile
from .kernels import (MEMORY_KERNEL_MIB, make_compute, measure_attention, measure_memory_kernels, measure_optimizer,
                      measure_peer_copy, measure_reduction_kernel, measure_transformer_gemms)
from .measurements import measure
from .model import gemm_model_us, predicted_slowdown, step_gemms_model_us
from .report import fit_report
from .step import STEP_MODEL, STEP_PROFILED, STEP_SUSTAIN_MS, measure_training_step, step_gemms
from .timing import (HEAD_START_US_PER_OP, NotAvailable, all_ranks_ok, gpu_head_start, max_over_ranks,
                     measure_beside, median_us, time_each_us)

__all__ = [
    "ADAMW_BYTES_PER_PARAM", "ATTENTION_SHAPE", "COLLECTIVES", "COMPUTE_KINDS", "GEMM_SIZES", "HEAD_START_US_PER_OP",
    "MAX_DECREASE", "MEASUREMENTS_SCHEMA", "MEMBOUND_BYTES_PER_OPERAND", "MEMORY_KERNEL_MIB", "MIB", "MIN_SLOWDOWN",
    "OPTIMIZER_PARAMS", "STEP_MODEL", "STEP_PROFILED", "STEP_SUSTAIN_MS", "TRANSFORMER_GEMMS",
    "Collectives", "NotAvailable", "Progress",
    "all_ranks_ok", "attention_executed_flops", "build_profile", "check_measurements", "fit_report", "format_bytes",
    "gemm_model_us", "gpu_head_start", "main", "make_compute", "max_over_ranks", "measure", "measure_attention",
    "measure_beside", "measure_memory_kernels", "measure_optimizer", "measure_peer_copy", "measure_reduction_kernel",
    "measure_slowdowns", "measure_training_step", "measure_transformer_gemms", "median_us", "nnls2", "parse_size",
    "pool_config", "predicted_slowdown", "solve", "step_gemms", "step_gemms_model_us", "time_each_us", "write_profile",
]
