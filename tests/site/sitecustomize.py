"""How every Python process of the test suite compiles (on PYTHONPATH: tests/conftest.py puts it there, so the pytest
workers and every rank, CLI and bench script they start import it).

On the CPU, most of a cold torch.compile is the C++ compiler building Inductor's generated kernels (llama3-tiny, forward
and backward, one process on this 2-core machine: 30-37 s with kernels, 8 s without; 5.5 s from a warm cache), and a
fresh machine starts cold. So by default Inductor lowers every op to its ATen kernel (`fallback_by_default`, its own
"lite mode" switch): Dynamo, AOTAutograd, the post-grad passes (ce_overlap's among them), the scheduler and the Python
wrapper all run as they do for users; only the generated C++ kernels are not built. Tests that hold the generated
kernels set CE_OVERLAP_TEST_INDUCTOR=codegen for the processes they start (or use the `inductor_codegen` fixture in
process): those that read the generated code or run the pass's backend end to end (tests/test_pass.py,
test_pass_compose.py), and the MoE's compiled step (compute_models' moe-2048), whose backward
torch 2.14.1 cannot run on ATen kernels (an `aten.mul` output's strides are not the ones its fake tensor promised:
assert_size_stride fails). Torch without the switch (before 2.14) compiles with kernels, only slower.
"""
from __future__ import annotations

import os
import sys

MODE = os.environ.get("CE_OVERLAP_TEST_INDUCTOR", "aten")
if MODE not in ("aten", "codegen"):
    raise SystemExit(f"CE_OVERLAP_TEST_INDUCTOR={MODE!r}: expected 'aten' (ATen kernels only) or 'codegen'")


# What the ATen mode sets on torch._inductor.config, and (CODEGEN, filled when it is set) the values it replaced: the
# `inductor_codegen` fixture (tests/conftest.py) puts those back for a test that holds the generated kernels.
ATEN = {
    "fallback_by_default": True,
    # With ATen kernels, the peak-memory reorder's choice follows the buffer sizes, which differ between ranks whose
    # shards are uneven (vocab 1001 over 2 ranks): measured, rank 0 ran the vocabulary-parallel lookup's
    # reduce-scatter before a weight's all-gather and rank 1 after it, and gloo waited for ever (torch 2.14.1,
    # tests/fully_shard/worker.py check --compile --variants compiled-vocab). The kernels' graphs did not diverge.
    "reorder_for_peak_memory": False,
}
CODEGEN: dict = {}


def _aten(config) -> None:
    if not hasattr(config, "fallback_by_default"):
        return
    CODEGEN.update({name: getattr(config, name) for name in ATEN})
    for name, value in ATEN.items():
        setattr(config, name, value)
    # Nothing to build, so no pool of compile workers; where the kernels are built changes nothing they compute, so
    # the fixture leaves it (a process started in codegen mode keeps torch's own default).
    config.compile_threads = 1


if MODE == "aten":
    class _AtenKernels:
        """Sets the switch once torch._inductor.config is imported, so a process that never compiles does not
        import torch for it."""

        def find_spec(self, name, path=None, target=None):
            if name != "torch._inductor.config":
                return None
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module

            def exec_and_set(module):
                exec_module(module)
                _aten(module)

            spec.loader.exec_module = exec_and_set
            return spec

    if "torch._inductor.config" in sys.modules:  # imported before this file ran (loaded by tests/conftest.py)
        _aten(sys.modules["torch._inductor.config"])
    else:
        sys.meta_path.insert(0, _AtenKernels())


# A process that runs a script or a module is forked from a zygote that has torch imported already (~4 s of CPU a
# process saved: tests/site/zygote.py), when tests/conftest.py set CE_TEST_ZYGOTES.
# Not when tests/conftest.py loads this file into pytest itself (for CODEGEN). As sitecustomize, this file's folder is
# on sys.path.
if os.environ.get("CE_TEST_ZYGOTES") and __name__ == "sitecustomize":
    import zygote

    zygote.proxy()
