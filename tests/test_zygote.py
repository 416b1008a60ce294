"""tests/site/zygote.py, the suite's forked process starts: a script or module run through a zygote behaves as the
process it replaces (argv, environment, working directory, stdin/stdout/stderr, exit code, death by a signal, signals
forwarded), and what it cannot serve starts as usual."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import SITE

SCRIPT = textwrap.dedent("""
    import os, sys, time
    mode = sys.argv[1]
    if mode == "echo":
        print("argv", sys.argv[1:], "cwd", os.getcwd(), "var", os.environ.get("CE_TEST_ZYGOTE_PROBE"))
        print("in", sys.stdin.read().strip())
        print("to stderr", file=sys.stderr)
        print("torch preloaded", "torch" in sys.modules, "main", __name__, "path0", sys.path[0])
        sys.exit(int(sys.argv[2]))
    if mode == "raise":
        raise ValueError("raised in the child")
    if mode == "kill":
        os.kill(os.getpid(), 9)
    if mode == "wait":
        import signal
        signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
        print("waiting", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def zygote_env(tmp_path):
    folder = tmp_path / "zygotes"
    env = {**os.environ, "CE_TEST_ZYGOTES": str(folder), "PYTHONPATH": SITE, "CE_TEST_ZYGOTE_PROBE": "seen"}
    yield env, folder
    from conftest import _site_zygote

    _site_zygote().stop_all(str(folder))


def test_a_script_run_through_a_zygote_behaves_as_its_own_process(tmp_path, zygote_env):
    env, folder = zygote_env
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, "-u", str(script), "echo", "3", "and more"], input="hello\n",
                          capture_output=True, text=True, env=env, cwd=work, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert f"argv ['echo', '3', 'and more'] cwd {work} var seen" in proc.stdout
    assert "in hello" in proc.stdout and "to stderr" in proc.stderr
    # Forked from the zygote (torch already imported), run as __main__ with the script's folder first on the path.
    assert f"torch preloaded True main __main__ path0 {tmp_path}" in proc.stdout, proc.stdout
    assert list(folder.glob("*.pid")), "no zygote served it"

    proc = subprocess.run([sys.executable, str(script), "raise"], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 1 and "ValueError: raised in the child" in proc.stderr
    proc = subprocess.run([sys.executable, str(script), "kill"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL

    # A signal to the process is the child's: SIGTERM reaches the script's handler.
    waiting = subprocess.Popen([sys.executable, str(script), "wait"], stdout=subprocess.PIPE, text=True, env=env)
    assert waiting.stdout.readline().strip() == "waiting"
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=30) == 7 and "got SIGTERM" in waiting.stdout.read()


def test_a_module_runs_through_a_zygote_and_a_snippet_starts_as_usual(zygote_env):
    env, folder = zygote_env
    proc = subprocess.run([sys.executable, "-m", "json.tool", "--compact"], input='{"a": [1, 2]}',
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == '{"a":[1,2]}', proc.stderr
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.stdout.strip() == "False"  # `-c` snippets check what an import loads: never a zygote's child
    assert time.monotonic() - started < 30
