"""GPU tests of the CE runtime: each launches tests/runtime/gpu_worker.py on 2 GPUs with torchrun and checks its
exit code (the worker prints what it checked). Skipped with the reason when there is no GPU or no runtime.

On a machine with one GPU the two ranks share it (CE_TEST_SHARED_GPU=1, see gpu_worker.py): the protocol, the
copies, the timeouts and the bit-exactness run on real CUDA over CUDA IPC within the GPU, with gloo references
instead of NCCL (which refuses two ranks on one GPU). What only two GPUs show (NVLink peer copies, peer access) needs
a 2-GPU machine; the tests say which way they ran."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import ce_overlap.runtime as rt

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_worker.py")


def _skip_reason() -> str | None:
    ok, reason = rt.available()
    if not ok:
        return f"CE runtime not available: {reason}"
    if torch.cuda.device_count() < 1:
        return "needs a GPU (2 for NVLink; with 1 both ranks share it), this machine has none"
    return None


_SKIP = _skip_reason()
SHARED_GPU = _SKIP is None and torch.cuda.device_count() == 1
if _SKIP and os.environ.get("CE_OVERLAP_REQUIRE_GPU_TESTS") == "1":
    # bench/run_device.sh sets this: on the GPU box a skip would hide a broken build.
    @pytest.fixture(autouse=True)
    def _required():
        pytest.fail(f"CE_OVERLAP_REQUIRE_GPU_TESTS=1 but the GPU tests cannot run: {_SKIP}")
else:
    pytestmark = pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")


def _descendants(pid: int) -> list[int]:
    """Every live descendant of pid (from /proc): torchrun starts its workers in their own sessions, so killing
    torchrun's process group would leave them running on the GPUs."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    victims = _descendants(proc.pid)
    for pid in [proc.pid, *victims]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _last_steps(progress_dir: str) -> str:
    """What each rank was doing last (gpu_worker.step writes it), one line per rank."""
    lines = []
    for name in sorted(os.listdir(progress_dir)):
        with open(os.path.join(progress_dir, name)) as f:
            lines.append(f"  {name[:-4]}: {f.read().strip()}")
    return "\n".join(lines) or "  (no rank reported a step)"


def torchrun(mode: str, *args: str, env: dict[str, str], timeout_s: float, nproc: int = 2,
             worker: str = WORKER) -> subprocess.CompletedProcess:
    """Runs `worker` (gpu_worker.py) on `nproc` ranks. The worker bounds every step itself (it dumps its stacks and exits when a step
    hangs); timeout_s is the backstop for a hang outside its reach (start-up, torchrun): the whole process tree is
    killed and the test fails with each rank's last step and the partial output."""
    full_env = dict(os.environ)
    full_env.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONUNBUFFERED": "1",
                     "CE_OVERLAP_POOL_MB": "128", "CE_OVERLAP_STAGING_MB": "1", "CE_OVERLAP_P2P_MB": "1"})
    full_env.update(env)
    if SHARED_GPU:
        full_env["CE_TEST_SHARED_GPU"] = "1"
        print("one GPU: both ranks share it (references over gloo); NVLink needs a 2-GPU machine")
    timeout_s *= 2 if SHARED_GPU else 1  # two ranks time-slice one GPU, and the references go through the host
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), worker, mode, *args]
    with tempfile.TemporaryDirectory(prefix="ce_gpu_test_") as progress:
        full_env["CE_TEST_PROGRESS_DIR"] = progress
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            out, err = proc.communicate()
            pytest.fail(f"{mode} did not finish within {timeout_s} s (a hang); last step per rank:\n"
                        f"{_last_steps(progress)}\n{out[-6000:]}\n{err[-6000:]}")
        steps = _last_steps(progress)
    print(out[-20000:])
    print(err[-20000:], file=sys.stderr)
    if proc.returncode != 0:
        print(f"last step per rank:\n{steps}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err + f"\nlast step per rank:\n{steps}\n")


def test_collectives_bit_exact_vs_nccl_and_symmetric_allocation():
    """One launch, six modes (each prints its own result line "== mode <name>: ok|FAILED"):
    correctness     1000 randomized all-gathers bit-exact vs NCCL: pull (staged, zero-copy, in place) and push,
                    dtypes, shapes, 0-size, odd byte counts, unaligned inputs, side streams, multi-round staging;
    reduce_scatter  300 randomized reduce-scatters vs NCCL (integer-valued data bit-exact, random bf16/fp16/fp32
                    within tolerance), sum and avg, multi-round, non-multiple-of-16-byte sizes, in place, groups of one;
    parts           300 multi-tensor all-gathers (1-12 parts, mixed dtypes, bit-exact per part), reduce-scatters
                    (the parts' reduced chunks concatenated) and unreduced reduce-scatters (the peers' chunks bit-exact,
                    own + their sum vs the reference), zero-size and multi-round parts, one shared join event;
    symalloc        empty_symmetric agrees offsets when ranks free in different orders and at different times;
                    mismatched sizes and a full pool raise on every rank; all-gathers on the tensors are bit-exact;
    nokernels       the CE all-gathers (pull and push), all-to-alls, broadcasts and sends / receives (staged and
                    direct) and the unreduced reduce-scatter launch no kernel; the reduce-scatter only its reduction.
    lifetimes       the functional ops hold their tensors until the first wait (no recordStream): with the host run
                    20 iterations ahead of the GPU the allocator reserves nothing new; unwaited results are reaped.
    Staging of 1 MiB makes larger cases multi-round; a 20 s timeout turns a protocol hang into an error, and a step
    that outlives it by 30 s ends the worker with its stacks. All-gather cases split their pulls (1-4 pieces, ranks
    differently); reduce-scatter cases vary the reduction CTAs (ranks differently) and end with 64 KiB rounds."""
    proc = torchrun("correctness,reduce_scatter,parts,symalloc,nokernels,lifetimes", "--cases", "1000", "--rs-cases", "300",
                    "--parts-cases", "300", "--symalloc-steps", "200", env={"CE_OVERLAP_TIMEOUT_S": "20"}, timeout_s=150)
    assert proc.returncode == 0, f"GPU checks failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"


def test_all_to_all_broadcast_and_p2p_bit_exact_vs_nccl():
    """a2a_bcast  1000 randomized all-to-alls (staged multi-round, zero-copy symmetric input, the functional op) and
                  broadcasts (staged, symmetric, every root), every dtype, 0-size, bit-exact vs NCCL, guard bands;
    p2p           1000 randomized batches of sends / receives between random pairs (both directions, several messages
                  per channel, staged multi-round through 512 KiB landing banks, direct into symmetric buffers, empty
                  messages), each rank's ops in its own order, sync / async / torch P2POp / single send-recv: received
                  bytes identical to the same batch over NCCL, nothing written behind the receive buffers."""
    proc = torchrun("a2a_bcast,p2p", "--a2a-cases", "1000", "--p2p-cases", "1000",
                    env={"CE_OVERLAP_TIMEOUT_S": "20"}, timeout_s=240)
    assert proc.returncode == 0, f"GPU checks failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"


def test_timeouts_and_mismatches_are_reported():
    """timeout: a peer that never arrives raises within the timeout, releases the stream, fails the group.
    mismatch: all-gather sizes, reduce-scatter sizes, reduce-scatter dtypes, push vs pull, multi-tensor parts,
    reduced vs unreduced reduce-scatter: each raises on both ranks naming a "different collective" (6 timeouts of
    4 s, each on its own process group), and the device drains after each. p2p_faults: a send nobody receives, and a send / recv pair of different sizes, raise naming the peer.
    Every step is bounded (4 s + 20 s), so a hang fails in seconds, naming the step."""
    proc = torchrun("timeout,mismatch,p2p_faults", env={"CE_OVERLAP_TIMEOUT_S": "4", "CE_TEST_STEP_DEADLINE_S": "24"},
                    timeout_s=100)
    assert proc.returncode == 0, f"timeout/mismatch checks failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"


def test_rank_death_pool_failure_and_p2p_refusal():
    """die_before_rendezvous  rank 1 exits before the CE rendezvous: rank 0's rendezvous raises naming rank 1;
    die_mid_collective     rank 1 exits with a 32-round all-gather queued: rank 0 raises naming the op, streams drain;
    pool_alloc_failure     rank 1's pool cannot be allocated: it raises naming CE_OVERLAP_POOL_MB, rank 0 raises
                           naming rank 1; a fresh group works afterwards;
    p2p_refused            a group without peer access (simulated): every rank's rendezvous raises at once naming
                           the pair; a fresh group works afterwards.
    Each death in its own launch (the dead rank exits 0, so torchrun lets the survivor report). A 4 s timeout; every
    step is bounded. bench/fault_repeats.py repeats all of these (and the test above) 20 times."""
    env = {"CE_OVERLAP_TIMEOUT_S": "4", "CE_TEST_STEP_DEADLINE_S": "24"}
    for modes in ("die_before_rendezvous", "die_mid_collective", "pool_alloc_failure,p2p_refused"):
        proc = torchrun(modes, env=env, timeout_s=100)
        assert proc.returncode == 0, f"{modes} failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"


@pytest.mark.parametrize("nproc", [3, 4])
def test_three_and_four_ranks(nproc):
    """Groups of 3 and 4 ranks (on a box with fewer GPUs, the ranks share GPU 0): 300 randomized cases each of
    reduce-scatter (the reduction kernel specialized for that rank count), all-gather, all-to-all / broadcast and
    send / recv batches (ranks that take no part in a batch included), against the references."""
    if not SHARED_GPU and torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs or one GPU to share, this machine has {torch.cuda.device_count()}")
    proc = torchrun("reduce_scatter,correctness,parts,a2a_bcast,p2p", "--cases", "300", "--rs-cases", "300",
                    "--parts-cases", "100", "--a2a-cases",
                    "300", "--p2p-cases", "300", env={"CE_OVERLAP_TIMEOUT_S": "20"}, timeout_s=240, nproc=nproc)
    assert proc.returncode == 0, f"{nproc}-rank checks failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-6000:]}"
