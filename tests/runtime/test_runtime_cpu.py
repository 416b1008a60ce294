"""CE runtime tests that need no GPU: the library builds and loads, availability is reported (never raised), the
Meta kernels give the functional-collective shapes under meta tensors, FakeTensorMode, make_fx and torch.compile,
bad input is rejected with a message, and the pool's host-side allocator is correct."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

import ce_overlap.runtime as rt

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cuda_toolkit_present() -> bool:
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


@pytest.fixture(scope="module")
def ops():
    ok, reason = rt.library_loaded()
    if not ok:
        pytest.skip(f"runtime library not loadable: {reason}")
    return torch.ops.ce_overlap


@pytest.fixture(scope="module")
def testing_ops(ops):
    return torch.ops.ce_overlap_testing


def _pool_create(ops, name: str, rank: int, world: int, device: int):
    """What rendezvous does first: the config from the environment (the one place CE_OVERLAP_* is read), then the
    pool."""
    return ops._pool_create(name, rank, world, device, *rt.RuntimeConfig.from_env().pool_create_args())


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = dict(os.environ)
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_library_is_built_and_loads_when_cuda_toolkit_present():
    if not _cuda_toolkit_present():
        pytest.skip("no CUDA toolkit (nvcc) here: the runtime is not built on this machine")
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU-only build: the runtime is not built against it")
    ok, reason = rt.library_loaded()
    assert ok, reason
    for name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "wait_tensor", "_pool_create"):
        assert hasattr(torch.ops.ce_overlap, name), name


def test_available_is_false_with_reason_without_gpu(ops):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    availability = rt.available()
    ok, reason = availability
    assert ok is False and not availability
    assert "cuda" in reason.lower()


def test_missing_library_is_reported_not_raised():
    proc = _python("import ce_overlap.runtime as rt; a = rt.available(); print(a.ok); print(a.reason)",
                   CE_OVERLAP_RUNTIME_LIB="/nonexistent/_runtime.so")
    assert proc.returncode == 0, proc.stderr
    ok_line, reason = proc.stdout.splitlines()[:2]
    assert ok_line == "False"
    assert "not found" in reason and "_runtime.so" in reason


def test_package_and_cli_work_without_runtime():
    proc = _python("import ce_overlap, sys; assert 'ce_overlap.runtime' not in sys.modules; print('ok')",
                   CE_OVERLAP_RUNTIME_LIB="/nonexistent/_runtime.so")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr
    cli = subprocess.run([sys.executable, "-m", "ce_overlap.cli", "--help"], capture_output=True, text=True,
                         env={**os.environ, "CE_OVERLAP_RUNTIME_LIB": "/nonexistent/_runtime.so"}, timeout=300)
    assert cli.returncode == 0, cli.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape,group_size", [((3, 5), 4), ((7,), 2), ((0, 3), 8), ((2, 3, 4), 1)])
def test_meta_kernel_shape(ops, dtype, shape, group_size):
    x = torch.empty(shape, dtype=dtype, device="meta")
    y = ops.all_gather_into_tensor(x, group_size, "0")
    assert y.shape == (shape[0] * group_size, *shape[1:])
    assert y.dtype == dtype and y.device.type == "meta"


def test_fake_tensor_mode_cuda(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, device="cuda", dtype=torch.bfloat16)
        y = ops.all_gather_into_tensor(x, 2, "0")
        assert (y.shape, y.dtype, y.device.type) == ((8, 8), torch.bfloat16, "cuda")
        assert ops.wait_tensor(y).shape == (8, 8)
        out = torch.empty(16, 4, device="cuda", dtype=torch.bfloat16)  # any contiguous shape of the right numel
        ops.all_gather_into_tensor_out(x, 2, "0", out=out)


def test_make_fx_symbolic_shapes(ops):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return ops.wait_tensor(ops.all_gather_into_tensor(x, 4, "0")) + 1

    gm = make_fx(f, tracing_mode="symbolic")(torch.empty(3, 8))
    vals = {n.target: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    gathered = vals[torch.ops.ce_overlap.all_gather_into_tensor.default]
    assert str(gathered.shape[0]).startswith("4*") and gathered.shape[1] == 8


def test_torch_compile_traces_ops(ops):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=backend, fullgraph=True, dynamic=True)
    def f(x):
        return ops.wait_tensor(ops.all_gather_into_tensor(x, 2, "0")) * 2

    y = f(torch.empty(4, 8, device="meta"))  # meta inputs: the compiled graph runs the Meta kernels
    assert y.shape == (8, 8)
    assert "ce_overlap.all_gather_into_tensor" in graphs[0].code

    @torch.compile(backend="aot_eager", fullgraph=True)
    def g(x, out):  # the mutating variant must functionalize
        ops.all_gather_into_tensor_out(x, 2, "0", out=out)
        return out + 1

    assert g(torch.empty(4, 8, device="meta"), torch.empty(8, 8, device="meta")).shape == (8, 8)


def test_non_contiguous_input_rejected(ops):
    x = torch.empty(4, 6, device="meta").t()
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.all_gather_into_tensor(x, 2, "0")
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.all_gather_into_tensor_out(x, 2, "0", out=torch.empty(12, 4, device="meta"))


@pytest.mark.parametrize("bad,match", [
    (lambda o: o.all_gather_into_tensor(torch.empty((), device="meta"), 2, "0"), "at least one dimension"),
    (lambda o: o.all_gather_into_tensor(torch.empty(4, device="meta"), 0, "0"), "group_size must be >= 1"),
    (lambda o: o.all_gather_into_tensor_out(torch.empty(4, device="meta"), 2, "0", out=torch.empty(7, device="meta")),
     "needs group_size"),
    (lambda o: o.all_gather_into_tensor_out(torch.empty(4, device="meta"), 2, "0",
                                            out=torch.empty(8, device="meta", dtype=torch.int32)), "dtype"),
    (lambda o: o.all_gather_into_tensor_out(torch.empty(4, device="meta"), 2, "0",
                                            out=torch.empty(4, 4, device="meta").t()[:, :2]), "contiguous"),
    # the multi-tensor out= variants (ce_overlap.fsdp's direct path): one out per input, sizes, dtypes
    (lambda o: o.all_gather_into_tensors_out([torch.empty(4, device="meta")] * 2, 2, "0",
                                             outs=[torch.empty(8, device="meta")]), "2 inputs but 1 outs"),
    (lambda o: o.all_gather_into_tensors_out([torch.empty(4, device="meta")], 2, "0",
                                             outs=[torch.empty(9, device="meta")]), r"outs\[0\] has 9 elements"),
    (lambda o: o.reduce_scatter_tensors_out([torch.empty(4, device="meta", dtype=torch.float32)], "sum", 2, "0",
                                            out=torch.empty(2, device="meta", dtype=torch.bfloat16)),
     "inputs' dtype .* or, for 16-bit inputs, float32"),
    (lambda o: o.reduce_scatter_tensors_out([torch.empty(4, device="meta", dtype=torch.bfloat16)], "sum", 2, "0",
                                            out=torch.empty(3, device="meta")), "needs the sum of inputs"),
    (lambda o: o.reduce_scatter_tensors_out([torch.empty(4, device="meta", dtype=torch.bfloat16)], "max", 2, "0",
                                            out=torch.empty(2, device="meta")), "reduce_op 'max' is not supported"),
    (lambda o: o._block_acquire(0, torch.device("cuda", 0)), "nbytes must be > 0"),
    (lambda o: o._block_acquire(16, torch.device("cpu")), "needs a CUDA device"),
    (lambda o: o._storage_lease([torch.empty(4)], torch.empty(16, dtype=torch.uint8), [0]), "1-D contiguous uint8 CUDA"),
])
def test_bad_arguments_rejected_with_message(ops, bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad(ops)


def test_ops_on_unknown_group_name_the_fix(ops):
    with pytest.raises(RuntimeError, match=r"no ce_overlap symmetric pool.*rendezvous"):
        ops._synchronize("no-such-group", 1.0)
    assert ops._has_group("no-such-group") is False
    assert "no ce_overlap pool" in ops._describe("no-such-group")


def test_pool_env_validated_before_touching_the_gpu(ops, monkeypatch):
    monkeypatch.setenv("CE_OVERLAP_POOL_MB", "lots")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_POOL_MB='lots' is not a positive number"):
        _pool_create(ops, "env-check", 0, 1, 0)
    monkeypatch.setenv("CE_OVERLAP_POOL_MB", "64")
    monkeypatch.setenv("CE_OVERLAP_STAGING_MB", "128")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_STAGING_MB"):
        _pool_create(ops, "env-check", 0, 1, 0)
    assert ops._has_group("env-check") is False


def test_pool_creation_without_gpu_fails_cleanly(ops):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="ce_overlap"):
        _pool_create(ops, "no-gpu", 0, 2, 0)
    assert ops._has_group("no-gpu") is False  # nothing half-created is left behind


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pool_range_allocator_matches_first_fit_model(testing_ops, seed):
    assert testing_ops._range_allocator_self_test(seed, 3000) == 3001


def test_wait_tensor_is_identity(ops):
    x = torch.arange(6.0)
    assert ops.wait_tensor(x) is x or torch.equal(ops.wait_tensor(x), x)


# ---------------------------------------------------------------------------------------------------------------
# Reduce-scatter: Meta kernels and argument errors

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,group_size", [((8, 5), 4), ((6,), 2), ((0, 3), 8), ((2, 3, 4), 1), ((16, 2, 2), 8)])
def test_reduce_scatter_meta_shape(ops, dtype, shape, group_size):
    x = torch.empty(shape, dtype=dtype, device="meta")
    for op in ("sum", "avg", "SUM"):
        y = ops.reduce_scatter_tensor(x, op, group_size, "0")
        assert y.shape == (shape[0] // group_size, *shape[1:])
        assert y.dtype == dtype and y.device.type == "meta"
    out = torch.empty(x.numel() // group_size, dtype=dtype, device="meta")  # any contiguous shape of the right numel
    ops.reduce_scatter_tensor_out(x, "sum", group_size, "0", out=out)


def test_reduce_scatter_matches_c10d_functional_shape(ops):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(12, 7, device="cuda", dtype=torch.bfloat16)
        ours = ops.reduce_scatter_tensor(x, "sum", 4, "0")
        assert (ours.shape, ours.dtype, ours.device.type) == ((3, 7), torch.bfloat16, "cuda")
        if hasattr(torch.ops, "_c10d_functional") and hasattr(torch.ops._c10d_functional, "reduce_scatter_tensor"):
            ref = torch.ops._c10d_functional.reduce_scatter_tensor(x, "sum", 4, "0")
            assert ref.shape == ours.shape and ref.dtype == ours.dtype


def test_reduce_scatter_make_fx_and_compile(ops):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return ops.wait_tensor(ops.reduce_scatter_tensor(x, "avg", 4, "0")) + 1

    gm = make_fx(f, tracing_mode="symbolic")(torch.empty(8, 6))
    vals = {n.target: n.meta["val"] for n in gm.graph.nodes if n.op == "call_function"}
    scattered = vals[torch.ops.ce_overlap.reduce_scatter_tensor.default]
    assert str(scattered.shape[0]).replace(" ", "").endswith("//4)"), scattered.shape  # e.g. (s0//4)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def g(x, out):
        ops.reduce_scatter_tensor_out(x, "sum", 2, "0", out=out)
        return out * 2

    assert g(torch.empty(8, 4, device="meta"), torch.empty(4, 4, device="meta")).shape == (4, 4)


@pytest.mark.parametrize("bad,match", [
    (lambda o: o.reduce_scatter_tensor(torch.empty(7, device="meta"), "sum", 2, "0"), "not divisible by group_size"),
    (lambda o: o.reduce_scatter_tensor(torch.empty(8, device="meta"), "max", 2, "0"), "reduce_op 'max' is not supported"),
    (lambda o: o.reduce_scatter_tensor(torch.empty(8, device="meta", dtype=torch.int32), "sum", 2, "0"),
     "not supported .float32, float16 and bfloat16"),
    (lambda o: o.reduce_scatter_tensor(torch.empty((), device="meta"), "sum", 2, "0"), "at least one dimension"),
    (lambda o: o.reduce_scatter_tensor(torch.empty(8, device="meta"), "sum", 0, "0"), "group_size must be >= 1"),
    (lambda o: o.reduce_scatter_tensor(torch.empty(4, 6, device="meta").t(), "sum", 2, "0"), "contiguous"),
    (lambda o: o.reduce_scatter_tensor_out(torch.empty(8, device="meta"), "sum", 2, "0", out=torch.empty(3, device="meta")),
     "needs input.numel.. / group_size"),
    (lambda o: o.reduce_scatter_tensor_out(torch.empty(8, device="meta"), "sum", 2, "0",
                                           out=torch.empty(4, device="meta", dtype=torch.float16)), "dtype"),
])
def test_reduce_scatter_bad_arguments_rejected(ops, bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad(ops)


# ---------------------------------------------------------------------------------------------------------------
# Internal ops: present, and clear without a GPU / without a rendezvous

def test_internal_ops_exist(ops, testing_ops):
    for name in ("reduce_scatter_tensor", "reduce_scatter_tensor_out", "_symmetric_free_ranges", "_empty_symmetric_at",
                 "_pool_alignment", "all_to_all_single", "all_to_all_single_out", "broadcast_",
                 "_batch_p2p", "_p2p_wait"):
        assert hasattr(ops, name), name
    for name in ("_set_all_gather_mode", "_reduce_scatter_round_bytes", "_local_copy", "_tune", "_reduce_bench",
                 "_local_copy_mode", "_p2p_round_bytes"):  # test and bench hooks: not in the production op set
        assert hasattr(testing_ops, name) and not hasattr(ops, name), name
    assert ops._pool_alignment() == 512


def test_symmetric_ops_need_a_rendezvous(ops, testing_ops):
    with pytest.raises(RuntimeError, match=r"no-such-group.*rendezvous"):
        ops._symmetric_free_ranges("no-such-group", False)
    with pytest.raises(RuntimeError, match=r"no-such-group.*rendezvous"):
        ops._empty_symmetric_at([4], torch.float32, "no-such-group", 65536)
    with pytest.raises(RuntimeError, match=r"no-such-group.*rendezvous"):
        testing_ops._reduce_scatter_round_bytes("no-such-group")


def test_all_gather_mode_switch(testing_ops):
    previous = testing_ops._set_all_gather_mode("push")
    try:
        assert previous in ("pull", "push")
        assert testing_ops._set_all_gather_mode("pull") == "push"
        with pytest.raises(RuntimeError, match="must be 'pull' or 'push'"):
            testing_ops._set_all_gather_mode("sideways")
    finally:
        testing_ops._set_all_gather_mode(previous)


def test_local_copy_refuses_cpu_tensors_and_bad_modes(testing_ops):
    with pytest.raises(RuntimeError, match="one CUDA device"):
        testing_ops._local_copy(torch.empty(4), torch.empty(4), "memcpy")


def test_reduce_scatter_env_validated(ops, monkeypatch):
    monkeypatch.setenv("CE_OVERLAP_REDUCE_SMS", "2.5")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_REDUCE_SMS"):
        _pool_create(ops, "env-check-rs", 0, 1, 0)
    monkeypatch.setenv("CE_OVERLAP_REDUCE_SMS", "16")
    monkeypatch.setenv("CE_OVERLAP_RS_ROUND_MB", "zero")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_RS_ROUND_MB"):
        _pool_create(ops, "env-check-rs", 0, 1, 0)
    assert ops._has_group("env-check-rs") is False


@pytest.mark.parametrize("bad", ["0", "5", "1.5", "two"])
def test_pull_split_env_validated(ops, monkeypatch, bad):
    monkeypatch.setenv("CE_OVERLAP_PULL_SPLIT", bad)
    with pytest.raises(RuntimeError, match="CE_OVERLAP_PULL_SPLIT"):
        _pool_create(ops, "env-check-split", 0, 1, 0)
    assert ops._has_group("env-check-split") is False


def test_tune_and_reduce_bench_refuse_without_group_or_gpu(testing_ops):
    with pytest.raises(RuntimeError, match=r"no ce_overlap symmetric pool.*rendezvous"):
        testing_ops._tune("no-such-group", 2, 0, 0)
    with pytest.raises(RuntimeError, match="one CUDA device"):
        testing_ops._reduce_bench(torch.empty(4), torch.empty(4), torch.empty(4), 16)
    assert testing_ops._local_copy_mode() in ("memcpy", "ce-hint (no local copy yet)") or "batch API refused" in \
        testing_ops._local_copy_mode() or testing_ops._local_copy_mode() == "ce-hint"


# ---------------------------------------------------------------------------------------------------------------
# All-to-all, broadcast, point-to-point: Meta kernels, tracing, argument errors (the GPU side: gpu_worker.py)

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape,group_size", [((8, 5), 4), ((6,), 2), ((0, 3), 8), ((2, 3, 4), 1)])
def test_all_to_all_meta_shape_matches_c10d(ops, dtype, shape, group_size):
    x = torch.empty(shape, dtype=dtype, device="meta")
    y = ops.all_to_all_single(x, group_size, "0")
    assert (y.shape, y.dtype, y.device.type) == (x.shape, dtype, "meta")
    ops.all_to_all_single_out(x, group_size, "0", out=torch.empty(x.numel(), dtype=dtype, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        xf = torch.empty(shape, dtype=dtype, device="cuda")
        ours = ops.all_to_all_single(xf, group_size, "0")
        split = [shape[0] // group_size] * group_size
        ref = torch.ops._c10d_functional.all_to_all_single(xf, split, split, "0")
        assert (ours.shape, ours.dtype) == (ref.shape, ref.dtype)


def test_all_to_all_make_fx_and_compile(ops):
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return ops.wait_tensor(ops.all_to_all_single(x, 2, "0")) + 1

    gm = make_fx(f, tracing_mode="symbolic")(torch.empty(8, 6))
    assert any(n.target is torch.ops.ce_overlap.all_to_all_single.default for n in gm.graph.nodes)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def g(x, out, t):  # the mutating variants must functionalize
        ops.all_to_all_single_out(x, 2, "0", out=out)
        ops.broadcast_(t, 1, 2, "0")
        return out + 1, t * 2

    a, b = g(torch.empty(4, 8, device="meta"), torch.empty(32, device="meta"), torch.empty(3, device="meta"))
    assert a.shape == (32,) and b.shape == (3,)


@pytest.mark.parametrize("bad,match", [
    (lambda o: o.all_to_all_single(torch.empty(7, 2, device="meta"), 2, "0"), "not divisible by group_size"),
    (lambda o: o.all_to_all_single(torch.empty(4, 6, device="meta").t(), 2, "0"), "contiguous"),
    (lambda o: o.all_to_all_single(torch.empty((), device="meta"), 2, "0"), "at least one dimension"),
    (lambda o: o.all_to_all_single_out(torch.empty(4, device="meta"), 2, "0", out=torch.empty(5, device="meta")),
     "needs input.numel"),
    (lambda o: o.all_to_all_single_out(torch.empty(4, device="meta"), 2, "0",
                                       out=torch.empty(4, device="meta", dtype=torch.int32)), "dtype"),
    (lambda o: o.broadcast_(torch.empty(4, device="meta"), 2, 2, "0"), "root 2 is not a rank"),
    (lambda o: o.broadcast_(torch.empty(4, device="meta"), -1, 2, "0"), "root -1 is not a rank"),
    (lambda o: o.broadcast_(torch.empty(4, 6, device="meta").t(), 0, 2, "0"), "contiguous"),
    (lambda o: o._batch_p2p([torch.empty(4, device="meta")], [1, 0], [], [], "0", False), "1 send tensors but 2"),
    (lambda o: o._batch_p2p([], [], [torch.empty(4, device="meta")], [], "0", False), "1 recv tensors but 0"),
    (lambda o: o._batch_p2p([torch.empty(4, 6, device="meta").t()], [1], [], [], "0", False), "contiguous"),
])
def test_collective_and_p2p_bad_arguments_rejected(ops, bad, match):
    with pytest.raises(RuntimeError, match=match):
        bad(ops)


def test_p2p_ops_need_a_rendezvous(ops, testing_ops):
    with pytest.raises(RuntimeError, match=r"no-such-group.*rendezvous"):
        testing_ops._p2p_round_bytes("no-such-group")
    with pytest.raises(RuntimeError, match="no pending point-to-point batch #12345"):
        ops._p2p_wait(12345)


def test_p2p_env_validated(ops, monkeypatch):
    monkeypatch.setenv("CE_OVERLAP_POOL_MB", "64")
    monkeypatch.setenv("CE_OVERLAP_STAGING_MB", "16")
    for bad in ("0.5", "49"):  # below 1 MiB; staging + p2p beyond the pool
        monkeypatch.setenv("CE_OVERLAP_P2P_MB", bad)
        with pytest.raises(RuntimeError, match="CE_OVERLAP_P2P_MB"):
            _pool_create(ops, "env-check-p2p", 0, 1, 0)
    monkeypatch.setenv("CE_OVERLAP_P2P_MB", "many")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_P2P_MB='many' is not a positive number"):
        _pool_create(ops, "env-check-p2p", 0, 1, 0)
    assert ops._has_group("env-check-p2p") is False


def test_p2p_python_api_validates_before_the_runtime(ops):
    """The wrappers reject what they can name without a process group: an op that is neither send nor recv, and
    (with torch.distributed uninitialized) any use of a group."""
    with pytest.raises(RuntimeError, match="neither 'send' nor 'recv'"):
        rt.p2p._p2p_kind("scatter")
    assert rt.p2p._p2p_kind("send") == "send" and rt.p2p._p2p_kind(torch.distributed.irecv) == "recv"
    import torch.distributed as dist

    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="torch.distributed initialized"):
            rt.send(torch.empty(4), 1)
    work = rt.P2PWork(0)  # a batch with nothing to wait for
    assert work.is_completed() and work.wait()


# ---------------------------------------------------------------------------------------------------------------
# Collective symmetric allocation (_symalloc: pure Python, no runtime library needed)

from ce_overlap.runtime import _symalloc as S  # noqa: E402


def _brute_common(lists, units):
    free = [all(any(o <= u < o + s for o, s in lst) for lst in lists) for u in range(units)]
    out, u = [], 0
    while u < units:
        if not free[u]:
            u += 1
            continue
        v = u
        while v < units and free[v]:
            v += 1
        out.append((u, v - u))
        u = v
    return out


@pytest.mark.parametrize("seed", range(5))
def test_symalloc_intersection_matches_brute_force(seed):
    import random

    rng = random.Random(seed)
    for _ in range(300):
        units = rng.randint(1, 64)
        lists = []
        for _ in range(rng.randint(1, 4)):
            lst = []
            for _ in range(rng.randint(0, 6)):  # overlapping and touching ranges on purpose
                o = rng.randrange(units)
                lst.append((o, rng.randint(0, units - o)))
            lists.append(lst)
        assert S.intersect(lists) == _brute_common(lists, units)
        common = S.intersect(lists)
        need = rng.randint(1, 8)
        want = next((o for o, s in common if s >= need), None)
        assert S.first_fit(common, need, 1) == want


def test_symalloc_first_fit_respects_alignment():
    assert S.first_fit([(100, 1000)], 512, 512) == 512
    assert S.first_fit([(100, 900)], 512, 512) is None
    assert S.first_fit([(100, 900), (2048, 512)], 512, 512) == 2048
    assert S.footprint(0, 512) == 512 and S.footprint(513, 512) == 1024 and S.footprint(1024, 512) == 1024


def _req(rank, nbytes, free, pending=0):
    return S.Request(rank=rank, nbytes=nbytes, free=tuple(free), pending_bytes=pending, shape=(nbytes // 2,),
                     dtype="bfloat16")


def test_symalloc_decide_agrees_although_free_lists_differ():
    # Rank 1 has not reclaimed [0, 1024) yet (its free is deferred): the common first fit skips it.
    reqs = [_req(0, 1000, [(0, 4096)]), _req(1, 1000, [(1024, 3072)], pending=1024)]
    assert S.decide("g", 1, reqs, 512).offset == 1024
    assert S.decide("g", 1, list(reversed(reqs)), 512).offset == 1024  # order of arrival does not matter


def test_symalloc_decide_reports_mismatched_sizes():
    reqs = [_req(0, 1024, [(0, 8192)]), _req(1, 2048, [(0, 8192)])]
    with pytest.raises(S.SymmetricAllocError) as e:
        S.decide("tp", 7, reqs, 512)
    msg = str(e.value)
    for needle in ("group 'tp'", "allocation #7", "different sizes", "rank 0: 1024 bytes", "rank 1: 2048 bytes",
                   "bfloat16"):
        assert needle in msg, (needle, msg)


def test_symalloc_decide_retries_then_reports_nothing_fits():
    reqs = [_req(0, 4096, [(0, 4096)]), _req(1, 4096, [(0, 1024), (2048, 2048)], pending=1024)]
    assert S.decide("g", 3, reqs, 512, attempt=0).offset is None  # rank 1 may free more: retry after waiting
    with pytest.raises(S.SymmetricAllocError) as e:
        S.decide("g", 3, reqs, 512, attempt=1)
    msg = str(e.value)
    for needle in ("group 'g'", "allocation #3", "no range of 4096 bytes", "largest common range 2048",
                   "rank 1: 3072 bytes free", "CE_OVERLAP_POOL_MB"):
        assert needle in msg, (needle, msg)
    with pytest.raises(S.SymmetricAllocError, match="no range"):  # nothing pending: no retry
        S.decide("g", 4, [_req(0, 8192, [(0, 4096)]), _req(1, 8192, [(0, 4096)])], 512)


def _run_ranks(world, fn):
    import threading

    results, errors = {}, {}

    def run(rank):
        try:
            results[rank] = fn(rank)
        except Exception as e:  # noqa: BLE001
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results, errors


def test_symalloc_agree_over_a_store_with_frees_in_different_orders():
    """Two 'ranks' (threads) keep their own allocators (a bitmap here) and free in different orders and at
    different times; every allocation gets one offset on both, and the store keys are cleaned up."""
    import torch.distributed as dist

    store = dist.HashStore()
    units, align = 64, 512
    sizes = [3000, 512, 100, 7000, 1, 2048, 4096, 600]

    def rank_main(rank):
        used = [False] * units
        live = {}
        ex = S.StoreExchange(store, 20)
        pending = []  # freed, not yet reclaimed (rank 1 reclaims late)

        def free_ranges(block):
            if block or rank == 0:
                for off, n in pending:
                    for u in range(off // align, off // align + n):
                        used[u] = False
                pending.clear()
            runs = _brute_common([[(u, 1) for u in range(units) if not used[u]]], units)
            return sum(n * align for _, n in pending), [(o * align, n * align) for o, n in runs]

        offsets = []
        for seq, nbytes in enumerate(sizes, 1):
            off = S.agree(ex, "g", seq, rank, 2, nbytes, free_ranges, align)
            n = S.footprint(nbytes, align) // align
            assert not any(used[off // align:off // align + n]), "agreed range not free locally"
            for u in range(off // align, off // align + n):
                used[u] = True
            live[seq] = (off, n)
            offsets.append(off)
            # Free some tensors, in a rank-dependent order.
            if seq % 3 == 0:
                victims = sorted(live)[:2]
                for v in (victims if rank == 0 else reversed(victims)):
                    pending.append(live.pop(v))
        return offsets

    results, errors = _run_ranks(2, rank_main)
    assert not errors, errors
    assert results[0] == results[1], results
    assert len(set(results[0])) > 1
    # Only the last step's keys are left.
    left = [k for k in (f"ce_overlap/symm/g/{s}/{a}/{r}" for s in range(1, len(sizes) + 1) for a in (0, 1)
                        for r in (0, 1)) if store.check([k])]
    assert all(k.startswith(f"ce_overlap/symm/g/{len(sizes)}/") for k in left), left


def test_symalloc_agree_mismatch_raises_on_every_rank():
    import torch.distributed as dist

    store = dist.HashStore()
    nbytes = {0: 4096, 1: 8192}
    results, errors = _run_ranks(2, lambda r: S.agree(S.StoreExchange(store, 20), "dp", 1, r, 2, nbytes[r],
                                                      lambda block: (0, [(0, 1 << 20)]), 512))
    assert set(errors) == {0, 1}, (results, errors)
    for e in errors.values():
        assert "different sizes" in str(e) and "rank 0: 4096 bytes" in str(e) and "rank 1: 8192 bytes" in str(e)


def test_symalloc_agree_missing_rank_times_out_naming_it():
    import torch.distributed as dist

    store = dist.HashStore()
    with pytest.raises(S.SymmetricAllocError, match=r"ranks \[1\] did not reach this allocation"):
        S.agree(S.StoreExchange(store, 0.5), "pp", 1, 0, 2, 512, lambda block: (0, [(0, 4096)]), 512)


def test_multi_tensor_ops_meta_shapes(ops):
    """A bucket as one op: output i of all_gather_into_tensors is all_gather_into_tensor(inputs[i]); the output of
    reduce_scatter_tensors is the inputs' reduce-scatters flattened and concatenated."""
    xs = [torch.empty(6, 4, device="meta", dtype=torch.bfloat16), torch.empty(2, device="meta", dtype=torch.bfloat16),
          torch.empty(0, 3, device="meta", dtype=torch.bfloat16)]
    outs = ops.all_gather_into_tensors(xs, 2, "0")
    assert [tuple(o.shape) for o in outs] == [(12, 4), (4,), (0, 3)]
    assert all(o.dtype == torch.bfloat16 and o.device.type == "meta" for o in outs)
    mixed = ops.all_gather_into_tensors([xs[0], torch.empty(5, device="meta", dtype=torch.int64)], 3, "0")
    assert [(tuple(o.shape), o.dtype) for o in mixed] == [((18, 4), torch.bfloat16), ((15,), torch.int64)]
    flat = ops.reduce_scatter_tensors(xs, "avg", 2, "0")
    assert tuple(flat.shape) == (12 + 1 + 0,) and flat.dtype == torch.bfloat16
    # Unreduced: one row per other rank, each the inputs' chunks concatenated; any one dtype; no rows for one rank.
    rows = ops.reduce_scatter_tensors_unreduced(xs, 2, "0")
    assert tuple(rows.shape) == (1, 12 + 1 + 0) and rows.dtype == torch.bfloat16
    ints = [torch.empty(8, device="meta", dtype=torch.int32)]
    assert tuple(ops.reduce_scatter_tensors_unreduced(ints, 4, "0").shape) == (3, 2)
    assert tuple(ops.reduce_scatter_tensors_unreduced(ints, 1, "0").shape) == (0, 8)


@pytest.mark.parametrize("call,match", [
    (lambda ops: ops.reduce_scatter_tensors([torch.empty(4, device="meta"),
                                             torch.empty(4, device="meta", dtype=torch.bfloat16)], "sum", 2, "0"),
     r"inputs\[1\] has dtype BFloat16 but inputs\[0\] has Float"),
    (lambda ops: ops.reduce_scatter_tensors([torch.empty(3, device="meta")], "sum", 2, "0"), "not divisible"),
    (lambda ops: ops.reduce_scatter_tensors([torch.empty(4, device="meta", dtype=torch.int32)], "sum", 2, "0"),
     "not supported"),
    (lambda ops: ops.all_gather_into_tensors([torch.empty(4, 2, device="meta").t()], 2, "0"), "contiguous"),
    (lambda ops: ops.all_gather_into_tensors([torch.empty(4, device="meta")], 0, "0"), "group_size must be >= 1"),
    (lambda ops: ops.reduce_scatter_tensors_unreduced([torch.empty(4, device="meta"),
                                                       torch.empty(4, device="meta", dtype=torch.bfloat16)], 2, "0"),
     r"inputs\[1\] has dtype BFloat16 but inputs\[0\] has Float"),
    (lambda ops: ops.reduce_scatter_tensors_unreduced([torch.empty(3, device="meta")], 2, "0"),
     r"inputs\[0\]\.shape\[0\] = 3 is not divisible by group_size = 2"),
    (lambda ops: ops.reduce_scatter_tensors_unreduced([torch.empty(4, 2, device="meta").t()], 2, "0"), "contiguous"),
])
def test_multi_tensor_ops_reject_bad_inputs(ops, call, match):
    with pytest.raises(RuntimeError, match=match):
        call(ops)


def test_unreduced_op_refuses_an_empty_list(ops):
    # No tensor to dispatch on: torch's dispatcher refuses it, naming the op and the empty list (as for the other
    # multi-tensor ops, whose Python wrappers check it first).
    with pytest.raises(NotImplementedError, match=r"empty list of Tensors.*reduce_scatter_tensors_unreduced"):
        ops.reduce_scatter_tensors_unreduced([], 2, "0")


def test_multi_tensor_python_api_refuses_an_empty_list(ops):
    import ce_overlap.runtime as rt

    with pytest.raises(ValueError, match="at least one input"):
        rt.all_gather_many([], "0")
    with pytest.raises(ValueError, match="at least one input"):
        rt.reduce_scatter_many([], "sum", "0")
