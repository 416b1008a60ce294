"""The "ce_overlap" logger and say-it-once messages (a fallback or a missing runtime is worth one line per process,
not one per graph)."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("ce_overlap")

_said: set[str] = set()
_lock = threading.Lock()


def log_once(level: int, message: str) -> None:
    """Logs `message` at `level` the first time this process is asked to; later calls with the same text are silent."""
    with _lock:
        if message in _said:
            return
        _said.add(message)
    log.log(level, message)


def forget_said() -> None:
    """Lets every log_once message be said again (tests that check a message appears)."""
    with _lock:
        _said.clear()
