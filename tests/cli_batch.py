"""Runs several `ce-overlap` command lines one after the other in this one process, each with its own exit code,
stdout and stderr (file descriptors 1 and 2 redirected per command, so C-level writes and log lines count as in a
process of its own): the cost of a process per command is its ~3 s of imports. Used by conftest.run_cli_batch.

    python tests/cli_batch.py CASES.json OUT.json      # CASES: [[arg, ...], ...]; OUT: [{returncode, stdout, stderr}]
"""
from __future__ import annotations

import json
import os
import sys
import tempfile


def _run_one(argv: list[str]) -> dict:
    from ce_overlap import cli, logs

    logs.forget_said()  # a say-once line is said again in the next command, as in a process of its own
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                code = cli.main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return {"returncode": code, "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main() -> int:
    cases_path, out_path = sys.argv[1:3]
    with open(cases_path) as f:
        cases = json.load(f)
    results = [_run_one(argv) for argv in cases]
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
