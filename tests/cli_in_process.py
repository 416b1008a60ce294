"""Runs a `ce-overlap` command line in this process as `python -m ce_overlap.cli` would in one of its own: its exit
code, its stdout and its stderr (file descriptors 1 and 2 redirected too, so C-level writes count; the "ce_overlap"
logger's warnings on stderr, as Python's last-resort handler writes them in a fresh process; an uncaught exception
exits 1 with its traceback). A process per command costs its imports of torch and Inductor (~7 s of CPU on the
2-core CI machine, 2026-12-02); conftest.run_cli runs here every command whose environment a running process can
take (the CE_OVERLAP_ variables are read when used: ce_overlap.environment)."""
from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import traceback


@contextlib.contextmanager
def _environ(extra: dict):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update({k: str(v) for k, v in extra.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _fds_to(out, err):
    """fds 1 and 2 into the files `out` and `err`, and sys.stdout / sys.stderr text streams over them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    py_out = py_err = None
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        py_out = open(1, "w", closefd=False, encoding="utf-8", errors="replace")
        py_err = open(2, "w", buffering=1, closefd=False, encoding="utf-8", errors="replace")
        with contextlib.redirect_stdout(py_out), contextlib.redirect_stderr(py_err):
            yield py_err
    finally:
        for stream in (py_out, py_err):
            if stream is not None:
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def run(argv: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    from ce_overlap import cli, logs

    argv = [str(a) for a in argv]
    logs.forget_said()  # a say-once line is said again, as in a process of its own
    logger = logging.getLogger("ce_overlap")
    with _environ(env_extra or {}), tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _fds_to(out, err) as py_err:
            handler = logging.StreamHandler(py_err)
            handler.setLevel(logging.WARNING)
            logger.addHandler(handler)
            propagate, logger.propagate = logger.propagate, False
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except Exception:  # noqa: BLE001 - what the interpreter does with it: the traceback, exit 1
                traceback.print_exc()
                code = 1
            finally:
                logger.removeHandler(handler)
                logger.propagate = propagate
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["ce-overlap", *argv], code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))
