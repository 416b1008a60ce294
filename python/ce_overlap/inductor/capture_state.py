"""Whether this thread is capturing (ce_overlap.capture: graphs only traced on fake tensors, never run). A leaf
module: the capture (inductor/capture.py) sets it, the pass (inductor/graph_pass.py, inductor/backend_choice.py) reads it."""
from __future__ import annotations

import contextlib
import contextvars

_capture_only = contextvars.ContextVar("ce_overlap_capture_only", default=False)


@contextlib.contextmanager
def capture_mode():
    """While active, graphs are only traced on fake tensors, never executed (ce_overlap.capture): CE ops
    may be emitted whenever the runtime library loads, even with no GPU."""
    token = _capture_only.set(True)
    try:
        yield
    finally:
        _capture_only.reset(token)


def capturing() -> bool:
    """True inside capture_mode()."""
    return _capture_only.get()
