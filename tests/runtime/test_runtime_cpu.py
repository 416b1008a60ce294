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
        ops._pool_create("env-check", 0, 1, 0)
    monkeypatch.setenv("CE_OVERLAP_POOL_MB", "64")
    monkeypatch.setenv("CE_OVERLAP_STAGING_MB", "128")
    with pytest.raises(RuntimeError, match="CE_OVERLAP_STAGING_MB"):
        ops._pool_create("env-check", 0, 1, 0)
    assert ops._has_group("env-check") is False


def test_pool_creation_without_gpu_fails_cleanly(ops):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="ce_overlap"):
        ops._pool_create("no-gpu", 0, 2, 0)
    assert ops._has_group("no-gpu") is False  # nothing half-created is left behind


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pool_range_allocator_matches_first_fit_model(ops, seed):
    assert ops._range_allocator_self_test(seed, 3000) == 3001


def test_wait_tensor_is_identity(ops):
    x = torch.arange(6.0)
    assert ops.wait_tensor(x) is x or torch.equal(ops.wait_tensor(x), x)
