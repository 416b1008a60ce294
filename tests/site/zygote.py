"""Python processes of the test suite forked from a process that has torch imported already (a zygote), instead of
each importing it anew: measured on the 2-core machine, importing torch, Dynamo, Inductor, DCP, DTensor and
ce_overlap costs a process ~4 s of CPU (a 4-rank compiled tensor-parallel launch spent 34% of its main threads' CPU
importing, 2026-12-03), and every rank, torchrun agent and bench script the suite starts paid it.

How: tests/conftest.py sets CE_TEST_ZYGOTES to a folder; every Python process the tests start runs
tests/site/sitecustomize.py, which calls `proxy()`. For a plain `python [-u] script.py ...` or `python [-u] -m module
...` (anything else starts as usual: `-c` snippets among them, which check what an import loads), the process becomes
a proxy: it hands its command line, environment, working directory and stdin/stdout/stderr (the descriptors
themselves) to the zygote of its environment, which forks a child that runs the command as `python` would; the proxy
forwards the signals it gets to the child and exits as the child did (its code, or the signal that ended it). The
child is a real process with the real torch: its own process group ranks, compiles and files.

One zygote per environment (its variables less the per-launch ones torchrun sets, LAUNCH_VARIABLES): torch and
Inductor read some variables at import, so a zygote only serves processes whose environment it was started with. The
first proxy of an environment starts its zygote (under a lock in the folder) and waits for it to listen (on an
abstract socket); a zygote exits after IDLE_S without a request, or once the folder is gone (conftest's `stop_all` at
the end of the session). Without CE_TEST_ZYGOTES nothing changes; a zygote that cannot start leaves each process to
run its command itself.
"""
from __future__ import annotations

import array
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import struct
import sys
import time

DIR_VARIABLE = "CE_TEST_ZYGOTES"
SERVE_VARIABLE = "CE_TEST_ZYGOTE_SERVE"  # set in a zygote's own environment: it is never a proxy itself
IDLE_S = 120.0
START_TIMEOUT_S = 120.0
# What torchrun (and pytest-xdist) set per process: not part of a zygote's key, the child gets the proxy's values.
LAUNCH_VARIABLES = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PWD", "OLDPWD", "_"}
LAUNCH_PREFIXES = ("TORCHELASTIC_", "PYTEST_")
# What a zygote imports before it serves: what the suite's processes import first (torch.distributed.run itself is
# left out: runpy warns when it runs a module that is imported already).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.elastic.agent.server.local_elastic_agent", "torch.distributed.pipelining", "ce_overlap",
           "ce_overlap.in_graph.fully_shard", "ce_overlap.inductor.pass_")
_MAX_REQUEST = 1 << 22


def _key(env: dict[str, str]) -> str:
    kept = sorted((k, v) for k, v in env.items() if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES))
    return hashlib.sha256(json.dumps([sys.executable, kept]).encode()).hexdigest()[:20]


def _command() -> tuple[str, str, list[str], bool] | None:
    """(kind "path" or "module", target, argv, unbuffered) of this process's command line, or None when it is not
    `python [-u] script ...` / `python [-u] -m module ...`."""
    with open("/proc/self/cmdline", "rb") as f:
        words = [w.decode("utf-8", "surrogateescape") for w in f.read().split(b"\0")[:-1]]
    args, unbuffered = words[1:], False
    while args and args[0] == "-u":
        unbuffered, args = True, args[1:]
    if not args:
        return None
    if args[0] == "-m" and len(args) > 1:
        return "module", args[1], [args[1], *args[2:]], unbuffered
    if args[0].startswith("-") or not os.path.isfile(args[0]):
        return None
    return "path", args[0], args, unbuffered


def proxy() -> None:
    """Called by sitecustomize at every start: returns at once unless CE_TEST_ZYGOTES is set and this process's
    command can be served; then never returns (the process exits as its child did)."""
    folder = os.environ.get(DIR_VARIABLE)
    if not folder or os.environ.get(SERVE_VARIABLE):
        return
    command = _command()
    if command is None:
        return
    kind, target, argv, unbuffered = command
    if not _only_stdio():
        return  # descriptors beyond stdin/stdout/stderr (a worker's pipes): they would not reach the child
    env = dict(os.environ)
    base = os.path.join(folder, _key(env))  # its lock, log and pid files
    address = _address(base)
    conn = _connect(address)
    if conn is None:
        conn = _start_zygote(base, address, env)
    if conn is None:
        return  # no zygote: this process runs the command itself
    request = json.dumps({"kind": kind, "target": target, "argv": argv, "unbuffered": unbuffered,
                          "cwd": os.getcwd(), "env": env}).encode()
    fds = array.array("i", [0, 1, 2])
    conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    _wait_and_exit(conn)


def _only_stdio() -> bool:
    """Whether this process holds stdin, stdout and stderr and no other descriptor it inherited."""
    try:
        for fd in (0, 1, 2):
            os.fstat(fd)
        names = os.listdir("/proc/self/fd")  # holds the descriptor that reads the folder itself
    except OSError:
        return False
    others = []
    for name in names:
        if int(name) > 2:
            try:
                others.append(os.readlink(f"/proc/self/fd/{name}"))
            except OSError:
                pass  # closed since the listing: the listing's own
    return not others


def _address(base: str) -> str:
    """The zygote's socket, in Linux's abstract namespace: no file (a socket's path has at most 107 bytes, and pytest's
    tmp_path folders are longer), gone with its process."""
    return "\0ce_overlap_zygote_" + hashlib.sha256(os.path.abspath(base).encode()).hexdigest()[:32]


def _connect(address: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(address)
        return conn
    except OSError:
        conn.close()
        return None


def _start_zygote(base: str, address: str, env: dict[str, str]) -> socket.socket | None:
    os.makedirs(os.path.dirname(base), exist_ok=True)
    with open(base + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one proxy starts it; the others wait here, then connect
        conn = _connect(address)
        if conn is not None:
            return conn
        log = open(base + ".log", "ab")
        import subprocess

        zygote = subprocess.Popen([sys.executable, os.path.abspath(__file__), base],
                                  env={**env, SERVE_VARIABLE: "1"}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                  start_new_session=True, close_fds=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and zygote.poll() is None:
            conn = _connect(address)
            if conn is not None:
                return conn
            time.sleep(0.05)
    return None


def _wait_and_exit(conn: socket.socket) -> None:
    """The proxy's part after the hand-over: the child's pid, then its end; signals go to the child."""
    reader = conn.makefile("rb")
    line = reader.readline()
    if not line.startswith(b"pid "):
        sys.stderr.write(f"tests/site/zygote.py: the zygote did not start the command ({line!r})\n")
        os._exit(1)
    child = int(line.split()[1])

    def forward(signum, _frame):
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, forward)
    line = reader.readline()
    status = int(line.split()[1]) if line.startswith(b"status ") else 1
    if status < 0:  # the child was killed by a signal: so is the proxy
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        time.sleep(1)
        os._exit(128 - status)
    os._exit(status)


def stop_all(folder: str) -> None:
    """Ends every zygote serving from `folder` and removes it (conftest, at the end of the session)."""
    import glob
    import shutil

    for pid_file in glob.glob(os.path.join(folder, "*.pid")):
        try:
            with open(pid_file) as f:
                os.kill(int(f.read()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
    shutil.rmtree(folder, ignore_errors=True)


# The zygote


def serve(base: str) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError as e:  # another torch: its children import what it lacks themselves
            print(f"zygote: not preloaded: {name}: {e}", flush=True)
    with open(base + ".pid", "w") as f:
        f.write(str(os.getpid()))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_address(base))  # proxies connect only once the imports are done
    listener.listen(64)
    folder = os.path.dirname(base)
    children: dict[int, socket.socket] = {}  # child pid -> its proxy's connection
    idle_since = time.monotonic()
    while True:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                try:
                    children.pop(pid).sendall(f"status {code}\n".encode())
                except OSError:
                    pass
        if children:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_S or not os.path.isdir(folder):
            return
        readable, _, _ = select.select([listener, *children.values()], [], [], 0.05)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                pid = _fork_child(conn, listener, children)
                if pid:
                    children[pid] = conn
                idle_since = time.monotonic()
            elif _closed(sock):  # its proxy died: so does the child
                pid = next(p for p, c in children.items() if c is sock)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _fork_child(conn: socket.socket, listener: socket.socket, children: dict) -> int:
    # The descriptors come with the first bytes (SCM_RIGHTS): every read is a recvmsg, so that none is dropped.
    fds = array.array("i")
    data = b""
    size = None
    while size is None or len(data) < 4 + size:
        want = 4 - len(data) if size is None else 4 + size - len(data)
        msg, ancdata, _, _ = conn.recvmsg(want, socket.CMSG_LEN(3 * fds.itemsize))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        if not msg:
            break
        data += msg
        if size is None and len(data) >= 4:
            size = struct.unpack("!I", data[:4])[0]
            if size > _MAX_REQUEST:
                break
    if size is None or len(data) < 4 + size or len(fds) != 3:
        conn.close()
        for fd in fds:
            os.close(fd)
        return 0
    data = data[4:]
    request = json.loads(data)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(f"pid {pid}\n".encode())
        return pid
    # The child: becomes the command.
    try:
        listener.close()
        for c in children.values():
            c.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _become(request)
    except BaseException:  # noqa: BLE001 (the child must never return into the zygote's loop)
        import traceback

        traceback.print_exc()
        os._exit(1)
    raise AssertionError("unreachable")


def _become(request: dict) -> None:
    import io
    import random
    import runpy
    import tempfile

    signal.signal(signal.SIGINT, signal.default_int_handler)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(s, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    encoding = sys.stdout.encoding
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        tty = raw.isatty()
        buffered = raw if unbuffered else io.BufferedWriter(raw)
        stream = io.TextIOWrapper(buffered, encoding=encoding, errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=tty or fd == 2, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    random.seed()  # a fresh process's own random state, not the zygote's
    tempfile._name_sequence = None
    sys.argv = list(request["argv"])
    first = os.path.dirname(os.path.abspath(request["target"])) if request["kind"] == "path" else os.getcwd()
    sys.path[:] = [first, *sys.path[1:]]  # as python sets sys.path[0] for a script, or for -m
    code = 0
    try:
        if request["kind"] == "path":
            runpy.run_path(request["target"], run_name="__main__")
        else:
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 (as the interpreter: the traceback, exit code 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    import atexit
    import threading

    try:
        threading._shutdown()  # non-daemon threads, as at interpreter exit
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__":
    serve(sys.argv[1])
