"""Inductor's overlap scheduler run inside a capture, so the cost model can price the order it gives
(ce_overlap.analyzer.step_model.SCHEDULER_CAPTURED, the `compile+inductor-overlap` mode of bench/train.py).

On a GPU the scheduler (torch._inductor.fx_passes.overlap_scheduling, on with
`aten_distributed_optimizations.enable_overlap_scheduling`) benchmarks every GEMM and attention node on the device
and estimates each collective with torch's analytical NCCL model; it then moves collectives earlier and waits later
as far as those estimates and its memory limits allow, and fixes the order with `control_deps` nodes. A capture has
fake tensors and often no GPU, so inside `running()`:

- its benchmark of a compute node (`benchmark_node_with_cache_key`, a module function in torch 2.11 and 2.14) is
  answered by the cost model: the node's kernel time under `profile` (ce_overlap.ir.kernels' rule, over the graph
  being scheduled), in ms. Nothing is allocated or run.
- its estimate of a collective (`comm_analysis.estimate_nccl_collective_runtime_from_fx_node`): on a GPU the NCCL
  group answers it with NCCL's own time estimate; the fake group of a capture cannot, and torch then falls back to
  a bandwidth formula (torch 2.11's takes 3.5-5x the cost model's time for the step's all-gathers and
  reduce-scatters on H200: 0.94 ms for a 112 MiB all-gather at 2 ranks). With that fallback the scheduler chose an
  order unlike the one the GPU ran (bench/results/step-prediction-2026-11-28-f), so the cost model's NCCL time for
  the collective answers instead.
  Calls that ask for the formula itself (`use_nccl_estimator=False`, torch's logging) still get it.
- so is its analytical estimate of a compute node, which it logs beside the benchmark (torch 2.11's asks a device);
  the GPU's peak FLOP/s and HBM bandwidth, which torch otherwise asks a driver for (its fusion regions), are the
  profile's.

`inline_control_deps` then puts each `control_deps` node's one operation back in its place, so the recorded graph
holds the scheduler's order as ordinary nodes (the IR has no higher-order ops)."""
from __future__ import annotations

import contextlib
import functools
import json
import weakref
from unittest import mock

import torch
import torch.fx

from .. import _core, profiles
from .to_ir import CaptureError, core_document

# The Inductor config that turns the scheduler on (torch >= 2.11; the options it reads keep torch's defaults).
INDUCTOR_CONFIG = {"aten_distributed_optimizations.enable_overlap_scheduling": True}


def unavailable_reason() -> str | None:
    """Why this torch cannot run its overlap scheduler in a capture, or None."""
    try:
        from torch._inductor.fx_passes import overlap_scheduling
    except ImportError as e:
        return f"torch {torch.__version__} has no overlap scheduler ({e})"
    if not hasattr(torch._inductor.config, "aten_distributed_optimizations"):
        return f"torch {torch.__version__} has no aten_distributed_optimizations config"
    if not hasattr(overlap_scheduling, "benchmark_node_with_cache_key"):
        return (f"torch {torch.__version__}'s overlap scheduler has no benchmark_node_with_cache_key: its compute "
                "estimates cannot come from the cost model")
    return None


class _ModelEstimates:
    """The cost model's kernel time (ms) per compute node of the graphs the scheduler schedules."""

    def __init__(self, profile: str):
        text = profiles.read_text(profile)
        self.spec = json.loads(text)
        self.profile = _core.Profile.from_json(text)
        # per graph being scheduled (weak: a freed graph's id may come back for the next one)
        self._by_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _graph_ms(self, graph: torch.fx.Graph) -> dict[str, float]:
        if graph not in self._by_graph:
            doc = core_document(graph, "scheduled")
            names = [n.name for n in graph.nodes]
            ms: dict[str, float] = {}
            for kernel in json.loads(_core.graph_kernels(doc, "scheduled", self.profile)):
                for i in kernel["nodes"]:  # a GEMM or attention node is a kernel of its own
                    ms[names[i]] = kernel["us"] / 1e3 / max(1, len(kernel["nodes"]))
            self._by_graph[graph] = ms
        return self._by_graph[graph]

    def benchmark(self, n: torch.fx.Node, custom_runtime_estimation=None) -> tuple[float, str | None]:
        """benchmark_node_with_cache_key's contract: (runtime in ms, a cache key or None)."""
        if custom_runtime_estimation is not None:
            est = custom_runtime_estimation(n, None)
            if est is not None:
                return est, None
        return self._graph_ms(n.graph).get(n.name, 0.0), None

    def collective_ms(self, fx_node: torch.fx.Node, override_size: int | None = None,
                      use_nccl_estimator: bool = True, *, formula=None) -> float:
        """estimate_nccl_collective_runtime_from_fx_node's contract (ms). `override_size` (torch's bytes, the
        collective's inputs and outputs together) scales the node's own bytes; `formula`: torch's function, for the
        calls that ask for it."""
        from .collectives import read_collective

        if not use_nccl_estimator and formula is not None:
            return formula(fx_node, override_size, use_nccl_estimator=False)
        c = read_collective(fx_node)
        if c.group_size is None:
            raise CaptureError(f"node {fx_node.name}: the overlap scheduler asked for the time of a collective whose "
                               f"group {c.group!r} is not known")
        nbytes = c.bytes
        if override_size is not None:  # torch's bytes (estimate_fx_collective_size) to ours, in proportion
            from torch._inductor.comm_analysis import estimate_fx_collective_size

            total = estimate_fx_collective_size(fx_node)
            nbytes = int(nbytes * override_size / total) if total else 0
        return _core.estimate_collective(self.profile, c.type, nbytes, c.group_size, "nccl") / 1e3

    def runtime_ms(self, n: torch.fx.Node) -> float:
        return self.benchmark(n)[0]

    def tflops(self, dtype=None) -> float:
        gpu = self.spec["gpu"]
        return gpu["peak_fp32_tflops"] if dtype == torch.float32 else gpu["peak_bf16_tflops"]

    def dram_gbps(self) -> float:
        return self.spec["gpu"]["hbm_gbps"]


@contextlib.contextmanager
def running(profile: str):
    """Inside: the scheduler's compute estimates and device numbers come from `profile` (a built-in name or a file).
    Raises CaptureError where this torch cannot run the scheduler in a capture."""
    reason = unavailable_reason()
    if reason is not None:
        raise CaptureError(f"Inductor's overlap scheduler cannot run in a capture: {reason}")
    est = _ModelEstimates(profile)
    sched = "torch._inductor.fx_passes.overlap_scheduling"
    targets = {f"{sched}.benchmark_node_with_cache_key": est.benchmark,
               # its analytical estimates, logged beside the benchmarks (2.11's asserts a real device)
               f"{sched}.estimate_runtime_analytical": est.runtime_ms,
               f"{sched}.estimate_roofline_runtime_ms": est.runtime_ms}
    from torch._inductor import comm_analysis

    formula = comm_analysis.estimate_nccl_collective_runtime_from_fx_node
    targets["torch._inductor.comm_analysis.estimate_nccl_collective_runtime_from_fx_node"] = \
        functools.partial(est.collective_ms, formula=formula)
    for module in ("torch._inductor.utils", "torch.utils._runtime_estimation"):
        targets[f"{module}.get_device_tflops"] = est.tflops
        targets[f"{module}.get_gpu_dram_gbps"] = est.dram_gbps
    with contextlib.ExitStack() as stack:
        for target, fn in targets.items():
            module, _, name = target.rpartition(".")
            try:
                mod = __import__(module, fromlist=[name])
            except ImportError:
                continue
            if hasattr(mod, name):
                stack.enter_context(mock.patch.object(mod, name, fn))
        yield


def _is_control_deps(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator) \
        and node.target.name() == "control_deps"


def inline_control_deps(gm: torch.fx.GraphModule) -> int:
    """Replaces every `control_deps(deps, subgraph, *args)` node of gm by the subgraph's operations, in its place
    (the node order is the scheduler's; the ordering-only `deps` are dropped), the result keeping the node's value
    (its name is the subgraph's, made unique). Returns how many were inlined; raises CaptureError for a subgraph it
    cannot read."""
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if not _is_control_deps(node):
            continue
        sub_attr = node.args[1]
        sub = getattr(gm, sub_attr.target, None) if isinstance(sub_attr, torch.fx.Node) else None
        if not isinstance(sub, torch.fx.GraphModule):
            raise CaptureError(f"node {node.name}: control_deps without a subgraph module")
        placeholders = [p for p in sub.graph.nodes if p.op == "placeholder"]
        args = list(node.args[2:])
        if len(placeholders) != len(args) or node.kwargs:
            raise CaptureError(f"node {node.name}: control_deps passes {len(args)} arguments to a subgraph of "
                               f"{len(placeholders)} inputs")
        env: dict[torch.fx.Node, object] = dict(zip(placeholders, args))
        result = None
        with graph.inserting_before(node):
            for inner in sub.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = torch.fx.node.map_arg(inner.args[0], lambda x: env[x])
                    break
                if inner.op != "call_function":
                    raise CaptureError(f"node {node.name}: control_deps subgraph holds a {inner.op} node")
                env[inner] = graph.node_copy(inner, lambda x: env[x])
        if not isinstance(result, torch.fx.Node):
            raise CaptureError(f"node {node.name}: control_deps subgraph does not return one node")
        if result.op == "call_function" and result.graph is graph and result not in args:
            result.meta = dict(node.meta)
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        count += 1
    if count:
        for attr in [n for n in graph.nodes if n.op == "get_attr" and not n.users]:
            graph.erase_node(attr)
        graph.lint()
        gm.recompile()  # the module runs the inlined graph (torch 2.11's control_deps has no autograd kernel)
    return count
