"""Progress of a capture (seconds to minutes: a zoo 8B takes ~20 s, a user's 8B several minutes) for the CLI: each
stage and its time on stderr as it passes. On a terminal a live line (a bar over the stages expected, the stage, its
seconds ticking) that each finished stage replaces with its plain line; elsewhere (a pipe, a log file, CI) only the
plain lines. Silent unless the CLI turns it on (`shown`): library callers get no output.

    with progress.shown("capture llama3-8b", expected=6):    # the CLI
        with progress.stage("build"): ...                    # the capture code
        progress.next_stage("backward compile")              # ends the current stage, starts another
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time

_BAR = 20  # characters
_TICK_S = 0.5


class _Shown:
    def __init__(self, title: str, expected: int, stream, live: bool):
        self.title, self.expected, self.stream, self.live = title, max(1, expected), stream, live
        self.done = 0
        self.label: str | None = None
        self.started = self.stage_started = time.perf_counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True) if live else None

    def _line(self) -> str:
        filled = min(_BAR, _BAR * self.done // self.expected)
        return (f"\r{self.title} [{'#' * filled}{' ' * (_BAR - filled)}] {min(self.done + 1, self.expected)}/"
                f"{self.expected} {self.label or ''} {time.perf_counter() - self.stage_started:.0f} s\x1b[K")

    def _tick(self) -> None:
        while not self.stop.wait(_TICK_S):
            with self.lock:
                if self.label is not None:
                    self.stream.write(self._line())
                    self.stream.flush()

    def begin(self, label: str) -> None:
        with self.lock:
            self.label, self.stage_started = label, time.perf_counter()
            if self.live:
                self.stream.write(self._line())
                self.stream.flush()

    def end(self, failed: bool = False) -> None:
        """The stage's line and time; a failed stage leaves no line (the error that follows says what failed)."""
        with self.lock:
            if self.label is None:
                return
            seconds = time.perf_counter() - self.stage_started
            if self.live:
                self.stream.write("\r\x1b[K")
            if not failed:
                self.stream.write(f"{self.title}: {self.label}: {seconds:.1f} s\n")
            self.stream.flush()
            self.label = None
            self.done += 1


_SHOWN: list[_Shown] = []


@contextlib.contextmanager
def shown(title: str, expected: int = 1, stream=None):
    """Within: stages are shown on `stream` (stderr), `expected` of them for the bar; a live line if it is a terminal."""
    stream = stream or sys.stderr
    live = bool(getattr(stream, "isatty", lambda: False)())
    s = _Shown(title, expected, stream, live)
    _SHOWN.append(s)
    if s.thread is not None:
        s.thread.start()
    failed = True
    try:
        yield s
        failed = False
    finally:
        s.stop.set()
        s.end(failed)
        if s.thread is not None:
            s.thread.join()
        _SHOWN.pop()


def next_stage(label: str) -> None:
    """Ends the current stage (its line and time) and starts `label`; nothing unless shown."""
    if _SHOWN:
        _SHOWN[-1].end()
        _SHOWN[-1].begin(label)


def end_stage(failed: bool = False) -> None:
    """Ends the current stage: its line, or (failed) none."""
    if _SHOWN:
        _SHOWN[-1].end(failed)


@contextlib.contextmanager
def stage(label: str):
    """A stage around a block: its line when the block ends, none when it raises."""
    next_stage(label)
    try:
        yield
    except BaseException:
        end_stage(failed=True)
        raise
    end_stage()


_SCOPE: list[str] = []


@contextlib.contextmanager
def scope(suffix: str):
    """Within: stage labels from `labelled` carry `suffix` (" (3 blocks)": which of several captures)."""
    _SCOPE.append(suffix)
    try:
        yield
    finally:
        _SCOPE.pop()


def labelled(label: str) -> str:
    return label + (_SCOPE[-1] if _SCOPE else "")
