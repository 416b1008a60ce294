"""Where the overlap scheduler's order comes from: bench/train.py's compile+inductor-overlap step captured as
bench/_predict.py captures it (fake tensors, a fake process group), the scheduler run with the cost model's compute
estimates (`--estimates model`, what ce_overlap.fx.overlap_scheduler.running() does) or the device's own benchmarks
(`--estimates device`, a GPU; the fake group still gives torch's formula for the collectives), and Inductor's
lowering and Scheduler then run on each captured graph, the step that turns the post-grad FX order into the order of
the generated code (with `--peak-memory-reorder on|off`). On a machine
without a GPU the Scheduler is given an H200's device properties. Writes, per graph, the collectives, their waits
and the GEMMs in the post-grad FX order ("fx") and in the Scheduler's order ("inductor"), and every estimate the
overlap scheduler asked for (compute nodes in ms, collectives in ms). Run from the repository root with torch 2.11:

    python bench/results/step-prediction-2026-11-28-f/scheduler_order.py --estimates model --out OUT.json
"""
import argparse
import contextlib
import json
import sys
import time
import types
from unittest import mock

import torch

sys.path.insert(0, "bench")
import _predict  # noqa: E402
from ce_overlap.fx import capture as cap  # noqa: E402
from ce_overlap.fx import overlap_scheduler as osched  # noqa: E402

GEMMS = ("aten.mm", "aten.addmm", "aten.bmm")
H200 = types.SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                             total_memory=150_000_000_000, regs_per_multiprocessor=65536,
                             max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32,
                             L2_cache_size=50 * 2**20, shared_memory_per_block_optin=232448, gcnArchName="")


def fx_events(gm: torch.fx.GraphModule) -> list:
    out = []
    for n in gm.graph.nodes:
        target = str(n.target)
        if n.op != "call_function":
            continue
        if "_c10d_functional.wait_tensor" in target:
            out.append(("wait", n.args[0].name))
        elif "_c10d_functional." in target:
            out.append(("issue", n.name, target))
        elif target.startswith(GEMMS):
            out.append(("mm", n.name, target))
    return out


@contextlib.contextmanager
def device_properties():
    """An H200's answers where there is no GPU (Inductor's lowering and Scheduler ask for them)."""
    if torch.cuda.is_available():
        yield
        return
    props = lambda device=None: H200  # noqa: E731
    with contextlib.ExitStack() as stack:
        for target, value in {"torch.cuda.get_device_properties": props,
                              "torch.cuda.get_device_capability": lambda device=None: (9, 0),
                              "torch._dynamo.device_interface.CudaInterface.get_device_properties": props,
                              "torch._dynamo.device_interface.CudaInterface.is_available": lambda: True,
                              "torch.cuda.is_available": lambda: True,
                              "torch.cuda.current_device": lambda: 0,
                              "torch.cuda.device_count": lambda: 1,
                              "torch._inductor.scheduler.has_triton": lambda *a: True}.items():
            stack.enter_context(mock.patch(target, value))
        yield


def inductor_events(gm, example_inputs, is_backward: bool, peak: bool) -> list:
    from torch._guards import detect_fake_mode
    from torch._inductor import config as iconf
    from torch._inductor import ir
    from torch._inductor.compile_fx import record_original_output_strides
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V

    fm = detect_fake_mode(example_inputs)
    record_original_output_strides(gm)
    g = GraphLowering(gm, example_inputs=example_inputs, shape_env=fm.shape_env if fm else None,
                      is_inference=False, is_backward=is_backward)
    out = []
    with V.set_graph_handler(g), V.set_fake_mode(fm), V.set_debug_handler(DebugContext()), device_properties(), \
            iconf.patch(reorder_for_peak_memory=peak):
        g.run(*example_inputs)
        for fused in Scheduler(g.operations).nodes:
            for sn in fused.get_nodes():
                node = sn.node
                if isinstance(node, ir._WaitKernel):  # a subclass of _CollectiveKernel
                    out.append(("wait", node.inputs[0].get_name()))
                elif isinstance(node, ir._CollectiveKernel):
                    out.append(("issue", node.get_name(), str(node.python_kernel_name)))
                elif isinstance(node, ir.ExternKernel) and str(getattr(node, "python_kernel_name", "")).startswith(
                        ("extern_kernels.mm", "extern_kernels.addmm", "extern_kernels.bmm")):
                    out.append(("mm", node.get_name(), str(node.python_kernel_name)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--estimates", choices=["model", "device"], required=True)
    ap.add_argument("--peak-memory-reorder", choices=["on", "off"], default="on")
    ap.add_argument("--collectives", choices=["model", "formula"], default="model",
                    help="with --estimates model: the scheduler's collective estimates from the cost model's NCCL time "
                         "(what running() does) or from torch's fallback formula (what it did before), x --scale")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--profile", default="h200-sxm")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    from torch._inductor import comm_analysis
    from torch._inductor.fx_passes import overlap_scheduling as ovs

    formula = comm_analysis.estimate_nccl_collective_runtime_from_fx_node

    args = argparse.Namespace(model="llama3-8b", layers=a.layers, seq_len=4096, batch=1, gqa="expand",
                              vocab_parallel_embeddings=True, in_graph_wrap="torchtitan", fsdp2_wrap="torchtitan")
    result = {"torch": torch.__version__, "estimates": a.estimates, "peak_memory_reorder": a.peak_memory_reorder,
              "collectives": a.collectives if a.estimates == "model" else "formula (the fake group)", "scale": a.scale,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "none (H200 properties)",
              "layers": a.layers, "world": a.world, "graphs": {}, "compute_ms": [], "collective_ms": []}

    coll = ovs.estimate_collective_time

    def collective(n, override_size=None, custom_runtime_estimation=None):
        ms = coll(n, override_size, custom_runtime_estimation)
        if override_size is None:
            val = n.meta.get("val")
            result["collective_ms"].append([n.name, str(n.target), list(val.shape) if val is not None else None, ms])
        return ms

    orig_inner = cap._Recorder.inner_compile
    orig_inline = cap.inline_control_deps
    before_inline = {}

    def inline(gm):  # the graph as Inductor gets it on a GPU: its control_deps kept (they pin the scheduler's order)
        import copy
        before_inline["gm"] = copy.deepcopy(gm)
        return orig_inline(gm)

    def inner(self, gm, example_inputs, **kw):
        run = orig_inner(self, gm, example_inputs, **kw)
        name = self.graphs[-1][0]
        t = time.time()
        result["graphs"][name] = {"fx": fx_events(gm),
                                  "inductor": inductor_events(before_inline.pop("gm"), example_inputs,
                                                              bool(kw.get("is_backward")),
                                                              a.peak_memory_reorder == "on")}
        print(f"{name}: Inductor's Scheduler in {time.time() - t:.1f} s", flush=True)
        return run

    def bench_wrapper(current):
        def bench(n, custom_runtime_estimation=None):
            ms, key = current(n, custom_runtime_estimation)
            result["compute_ms"].append([n.name, str(n.target), ms])
            return ms, key
        return bench

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(ovs, "estimate_collective_time", collective))
        stack.enter_context(mock.patch.object(cap._Recorder, "inner_compile", inner))
        stack.enter_context(mock.patch.object(cap, "inline_control_deps", inline))
        if a.estimates == "model":
            stack.enter_context(osched.running(a.profile))
            if a.collectives == "formula" or a.scale != 1.0:
                current = formula if a.collectives == "formula" else \
                    comm_analysis.estimate_nccl_collective_runtime_from_fx_node
                stack.enter_context(mock.patch.object(
                    comm_analysis, "estimate_nccl_collective_runtime_from_fx_node",
                    lambda *args, **kw: a.scale * current(*args, **kw)))
        stack.enter_context(mock.patch.object(ovs, "benchmark_node_with_cache_key",
                                              bench_wrapper(ovs.benchmark_node_with_cache_key)))
        _predict.capture_step(args, a.world, inductor_config=dict(osched.INDUCTOR_CONFIG))
    json.dump(result, open(a.out, "w"))
    print("wrote", a.out, {g: {k: len(v) for k, v in d.items()} for g, d in result["graphs"].items()})


if __name__ == "__main__":
    main()
