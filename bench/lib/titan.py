"""What bench/train.py's step loop takes from torchtitan (torchtitan/tools/utils.py, its trainer): the learning rate's
linear warm-up, Python's garbage collector off with a generation-1 collection every gc_freq steps, and the peak
bf16 FLOP/s table its MFU divides by."""
from __future__ import annotations

import contextlib
import gc
import time

# torchtitan's default training.gc_freq: with --gc torchtitan a generation-1 collection every GC_FREQ steps, the
# automatic collector off (torchtitan/tools/utils.py GarbageCollection). A result without a recorded "gc" ran "python".
GC_FREQ = 50

# torchtitan's peak bf16 dense TFLOP/s table (torchtitan/tools/utils.py get_peak_flops), by device name.
_PEAK_TFLOPS = [("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
                ("B200", 2250.0), ("H20", 148.0), ("L40S", 362.0)]


def peak_tflops(device_name: str) -> float:
    for key, tflops in _PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return 989.0


def lr_at(step: int, args) -> float:
    """The learning rate of 1-based `step`: linear warm-up over --lr-warmup-steps, then --lr."""
    return args.lr * min(1.0, step / args.lr_warmup_steps) if args.lr_warmup_steps > 0 else args.lr


@contextlib.contextmanager
def step_loop_gc(policy: str):
    """Python's garbage collector for the step loop (--gc): with "torchtitan" off, after a generation-1 collection;
    yields the loop's GcPauses. The collector's state and callbacks are restored however the loop ends."""
    pauses, was_enabled = GcPauses(), gc.isenabled()
    if policy == "torchtitan":
        gc.disable()
        gc.collect(1)
    try:
        yield pauses
    finally:
        pauses.close()
        if was_enabled:
            gc.enable()


class GcPauses:
    """Time Python's garbage collector holds the host, summed into `since` (seconds) from when the caller zeroes it
    (gc.callbacks: a start and a stop per collection)."""

    def __init__(self):
        self.since, self._start = 0.0, None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.since += time.perf_counter() - self._start
            self._start = None

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)
