"""The cost model's training step, per mode, from a captured step (an Ir): the analysis (compute per graph),
ce_overlap's plans (exposed communication, the slowdown the chosen backends cause to the kernels beside them, bucket
copies) and what neither holds (the optimizer, the no-comm mode's local stand-ins of the collectives).
bench/train.py's --predict, bench/step_prediction.py and `ce-overlap analyze --plan`'s recommendation read their
numbers from here. No torch.

The modes (bench/train.py's names) and how each is modelled, MODES; a mode not there is not predicted:

    ce_overlap                 ce_overlap's plan: its order, NCCL or the copy engines per bucket
    ce_overlap-nccl            the same plan with every bucket on NCCL (PassConfig.ce = "off")
    compile+inductor-overlap   as ce_overlap-nccl: a reordering that hides the collectives, each on NCCL
    compile                    the captured order, every collective on NCCL and exposed
    no-comm                    compute, the optimizer and the local stand-ins the no-comm mode runs
    fsdp2, fsdp2-ce            FSDP2 (torchtitan's wrap, bf16 parameters, fp32 reduce-scatters) on NCCL / on the copy
                               engines (ce_overlap's direct path), from the same step's plans: FSDP2 below

With tensor parallelism (a capture with tp > 1; the TP collectives on NCCL where captured, on each block's critical
path), the modes bench/train.py runs with --tp:

    ce_overlap+tp              ce_overlap's plan over the step with torch's async TP where that step is given
                               (step_model's async_ir: a capture with micro-pipeline TP), else over the step as captured
    fsdp2+tp                   fsdp2's formula over the step as captured (TP on NCCL)
    fsdp2+tp+async-tp          fsdp2's formula over the async-TP capture (its fused all-gather-matmul and
                               matmul-reduce-scatter ops, priced as their GEMMs: the copy engines' chunks hide under them)
    fsdp2-ce+tp                fsdp2-ce's formula over the step as captured (ce_overlap's copy engines on FSDP2's "dp"
                               groups, TP on NCCL)
    no-comm+tp                 no-comm, plus each TP collective's whole time (TP stays on the critical path), over the
                               same capture as ce_overlap+tp

compile: Inductor without its overlap scheduler leaves no collective beside compute. The trace of the 8-layer step on
2x H200 (bench/results/step-prediction-2026-11-27-b) has the compute stream idle 39.1 ms beside 36.9 ms of NCCL
kernels: every collective's whole time is on the step, each alone (no contention either way), as the capture orders
them (one per parameter, not bucketed). The ce_overlap variants (-packed, -rs-kernel) are not modelled.

The overlap scheduler's own order can be priced too (SCHEDULER_CAPTURED, not a mode of MODES): a capture with it on
(ce_overlap.capture's overlap_scheduler: at 8 layers ~220 collectives, unbucketed on torch 2.11, where it put them),
planned with the planner's keep_order and every collective on NCCL. The captured order is the one the GPU runs:
within 2.6 GEMMs per collective in the forward and 0.2 in the backward of the code Inductor generated on 2x H200,
now that the scheduler's collective estimates in a capture are the model's NCCL time
(bench/results/step-prediction-2026-11-28-f). Its NCCL kernels run 61.7 ms per 8-layer step on 2x H200 against the
model's 30.1 ms for them alone (small collectives 5-21x their time alone beside compute), a fixed cost per
collective the profile's contention.nccl_beside_compute.residency_us prices: 223 collectives pay it in the
scheduler's order, ~30 buckets in ce_overlap's. With it, over 26 recorded runs, the captured order is within 9.3%
of every measured step (median 5.8%) and ranks the modes as measured in 21; the stand-in, within 8.9% (median 2.5%)
and 22, stays the mode's prediction: closer, and one capture fewer.

FSDP2 runs the same kernels per block (its per-block compile: the analysis's compute) and overlaps its collectives
the way the planner's order does (one block's all-gather ahead, reduce-scatters behind: the head and tail waits of its
traces are the plan's exposure), with three differences, each a term (FSDP2 below; bench/results/memory-2026-11-27,
"FSDP2"): its reduce-scatters move fp32 gradients, so its collectives run 4/3 as long beside the kernels they slow
(the plan's slowdown, scaled); it copies on the compute stream (all-gather copy-out, reduce-scatter chunk_cat) at
about half the HBM peak; there are no pass bucket copies. Its loss runs eagerly outside the compiled blocks (the
eager kernels' extra bytes over Inductor's fused loss, when the caller gives the logits' count).
"""
from __future__ import annotations

import json

# Fused AdamW over fp32 master shards, per parameter: reads param, grad, exp_avg, exp_avg_sq and writes param,
# exp_avg, exp_avg_sq, 4 bytes each (ce-overlap calibrate measures the optimizer's bandwidth on the same traffic).
from ..calibrate.common import ADAMW_BYTES_PER_PARAM

# mode -> (the plan it is read from, or None for the no-communication bound; how it is modelled)
MODES = {
    "ce_overlap": ("plan", "ce_overlap's plan"),
    "ce_overlap-nccl": ("plan_nccl", "ce_overlap's plan, every bucket on NCCL"),
    "ce_overlap-on": ("plan_on", "ce_overlap's plan with ce='on': every bucket copy engines can serve on them (across "
                                 "nodes: hierarchical, NCCL over the rails)"),
    "compile+inductor-overlap": ("plan_nccl", "modelled as ce_overlap's order with every bucket on NCCL"),
    "compile": ("captured", "the captured order, every collective on NCCL, alone and exposed"),
    "no-comm": (None, "compute, optimizer and the no-comm mode's local copies"),
    "fsdp2": ("fsdp2", "compute, the NCCL plan's exposure and slowdown x 4/3, FSDP2's copies, eager loss, optimizer"),
    "fsdp2-ce": ("fsdp2-ce", "compute, the CE plan's exposure and slowdown x 4/3, the direct path's copies, eager loss, "
                             "optimizer"),
}
# Tensor parallelism's modes: mode -> (the mode whose formula it takes, over which capture: "async" for the async-TP one,
# "async_if_given" for it where step_model was given one).
TP_MODES = {
    "fsdp2+tp": ("fsdp2", "captured", "fsdp2's formula, TP on NCCL"),
    "fsdp2+tp+async-tp": ("fsdp2", "async", "fsdp2's formula over the async-TP capture"),
    "fsdp2-ce+tp": ("fsdp2-ce", "captured", "fsdp2-ce's formula, TP on NCCL"),
    "ce_overlap+tp": ("ce_overlap", "async_if_given", "ce_overlap's plan, with torch's async TP where its capture is "
                                                      "given"),
    "no-comm+tp": ("no-comm", "async_if_given", "compute, optimizer, the local stand-ins and TP's collectives (over the "
                                                "async-TP capture where given, as ce_overlap+tp)"),
}
_PLAN_CE = {"plan": "auto", "plan_nccl": "off"}
# Planned only for a capture across nodes (meta "nodes" > 1): the hierarchical choice everywhere it serves.
_PLAN_CE_NODES = {"plan_on": "on"}
# Across nodes (a capture's meta "nodes" > 1): mode -> (the mode whose formula it takes, the capture it needs: "flat"
# for FSDP over every rank, "hsdp" for HSDP, replicas across nodes; what it is).
NODE_MODES = {
    "fsdp": ("ce_overlap-nccl", "flat", "FSDP over every rank, every collective on NCCL (ce_overlap's order)"),
    "fsdp-hierarchical": ("ce_overlap-on", "flat", "FSDP over every rank, each all-gather and reduce-scatter "
                                                   "hierarchical: copy engines inside each node, NCCL over the rails"),
    "fsdp-ce_overlap": ("ce_overlap", "flat", "FSDP over every rank, hierarchical or flat NCCL per bucket, as the cost "
                                              "model chooses"),
    "hsdp": ("ce_overlap-nccl", "hsdp", "HSDP: shards inside each node, replicas across, every collective on NCCL"),
    "hsdp-ce_overlap": ("ce_overlap", "hsdp", "HSDP with ce_overlap's plan: the shard dimension on copy engines "
                                              "inside each node, the replicas' all-reduce on NCCL"),
}
# The overlap scheduler's step from its own captured order (step_model's scheduler_ir; the module docstring).
SCHEDULER_CAPTURED = "compile+inductor-overlap:captured"

# FSDP2's terms (the module docstring says why each exists).
FSDP2 = {
    # The plan each FSDP2 mode's exposure and slowdown come from.
    "plan": {"fsdp2": "plan_nccl", "fsdp2-ce": "plan"},
    # Bytes its collectives move per parameter and step against the in-graph plan's: all-gathers 2 passes of bf16
    # parameters (forward, backward) and the reduce-scatter one pass of fp32 gradients (4 B), against bf16 (2 B):
    # (2 + 2 + 4) / (2 + 2 + 2).
    "comm_factor": 8 / 6,
    # Copy kernels on the compute stream, as multiples of the step's all-gather output bytes (the gathered bf16
    # parameters, both passes) and reduce-scatter input bytes (the bf16 gradients), per mode. fsdp2: the all-gathers'
    # copy-out (split_with_sizes_copy) reads and writes the gathered bytes; the reduce-scatters' chunk_cat reads the
    # bf16 gradients and writes them as fp32 (1 + 2). fsdp2-ce: what the direct path leaves there, measured: 2.6 ms
    # per step at 8 layers on 2x H200 (bench/results/fsdp2-2026-11-26), the reduce-scatter input's bytes at this rate.
    "copies": {"fsdp2": {"all_gather": 2, "reduce_scatter": 3}, "fsdp2-ce": {"all_gather": 0, "reduce_scatter": 1}},
    # Those copies' rate as a fraction of the HBM peak: 17.1 ms of copy kernels on the compute stream for 37.0 GB
    # (the rule above) in the 8-layer 2x H200 trace (bench/results/step-prediction-2026-11-27-b, run A): 2.17 TB/s,
    # 0.45 of 4.8 TB/s.
    "copy_hbm_fraction": 0.45,
    # The loss runs eagerly (torchtitan's wrap compiles the blocks only): F.cross_entropy(logits.float()) over
    # batch x seq x vocab logits, where the captured step has Inductor's fused loss. Per logit, eager: the upcast
    # (reads 2 B, writes 4), log_softmax forward (reads 4, writes 4), its backward (reads 4 + 4, writes 4), the
    # nll_loss backward's zero fill (4) and the bf16 one (2), the gradient's downcast (reads 4, writes 2): 38 B;
    # Inductor's two fused kernels read the bf16 logits twice and write the bf16 gradient: 6 B. The difference runs at
    # the rate those eager kernels reach: 20 GB in 7.6 ms, 0.55 of the HBM peak (fsdp2's kernel profile at 8 layers on
    # 4x H200, bench/results/step-prediction-2026-11-27-c; the fused loss took 1.3 ms in compile's).
    "eager_loss_bytes_per_logit": 38 - 6,
    "eager_loss_hbm_fraction": 0.55,
}


def _spec(profile: str) -> dict:
    """The profile's JSON (a built-in name or a file)."""
    from .. import profiles

    return json.loads(profiles.read_text(profile))


def bandwidths_us_per_byte(spec: dict) -> tuple[float, float, float]:
    """(HBM us per byte at the profile's memory efficiency, the fused optimizer's us per byte: its own calibrated
    efficiency where the profile has one, else the memory efficiency, and a compiled step's fused kernels' us per
    byte: with shape tables a large pointwise kernel's (the stand-ins this prices are weight-sized casts), else
    efficiency.fused_memory, else the memory efficiency, as the C++ model charges fusion groups); `spec`: the
    profile's JSON."""
    hbm = spec["gpu"]["hbm_gbps"] * 1e3
    eff = spec["efficiency"]
    fused = eff.get("fused_memory", eff["memory"])
    if "shapes" in spec:
        fused = spec["shapes"]["memory"]["pointwise"][-1] * spec["shapes"]["in_step"]["memory"]
    return (1.0 / (hbm * eff["memory"]), 1.0 / (hbm * eff.get("optimizer", eff["memory"])), 1.0 / (hbm * fused))


def plan_costs(plan: dict, hbm_us_per_byte: float) -> dict:
    """A plan's summary plus what the step pays beside its exposed communication: `slowdown_us`, each bucket's cost on
    its backend beyond its exposed part (the kernels it slows), and `bucket_copy_us`, the copies the pass adds to a
    merged NCCL bucket (an all-gather's copy-out materializes every member: world x bucket bytes read and written; a
    reduce-scatter's copy-in reads the gradients and writes the bucket; a CE bucket runs as one multi-tensor op on
    the members in place: none)."""
    summary = dict(plan.get("summary", {}))
    slowdown = copies = 0.0
    for b in plan.get("buckets", []):
        pred = b["predicted"]
        cost = {"ce": pred["ce_cost_us"], "hier": pred.get("hier_cost_us")}.get(b["backend"], pred["nccl_cost_us"])
        slowdown += max(0.0, (cost or 0.0) - (pred["exposed_us"] or 0.0))
        if len(b["members"]) > 1 and b["backend"] != "ce":
            moved = b["group_size"] * b["bytes"] if b["type"] == "all_gather" else b["bytes"]
            copies += 2 * moved * hbm_us_per_byte
    summary["slowdown_us"] = slowdown
    summary["bucket_copy_us"] = copies
    summary["buckets"] = len(plan.get("buckets", []))
    summary["ce_buckets"] = sum(b["backend"] in ("ce", "hier") for b in plan.get("buckets", []))
    return summary


def optimizer_us(num_params: int, world: int, optimizer_us_per_byte: float) -> float:
    """The fused AdamW step over this rank's shards (the capture does not hold it)."""
    return ADAMW_BYTES_PER_PARAM * -(-int(num_params) // max(1, world)) * optimizer_us_per_byte


_ANALYZE_KEYS = ("compute_us", "comm_us", "exposed_comm_us", "makespan_us", "kernels", "kernel_gap_us",
                 "compute_by_class_us", "tp_comm_us", "tp_exposed_comm_us", "inputs", "collectives")

# The modes whose host time the profile's host section prices: one compiled step (the in-graph modes). FSDP2's host
# (eager hooks around per-block graphs, its optimizer over DTensors) is other work, not modelled: its step is its GPU
# time here (bench/results/host-time-2026-12-01-b measured it 2.3-2.7x plain compile's, host-bound).
HOST_MODES = ("ce_overlap", "ce_overlap-nccl", "ce_overlap-on", "compile+inductor-overlap", "compile", "no-comm")


# The host section's terms (a profile's "host", docs/profiles.md), each priced per one of host_counts' counts.
HOST_TERMS = ("step_us", "launch_us", "graph_input_us", "collective_us")


def host_counts(pred: dict, mode: str = "ce_overlap") -> dict | None:
    """What each of HOST_TERMS is paid for in one step of `mode`, from step_model's pieces: one step; the kernels
    and the inputs of every graph; the copy-engine buckets of the mode's plan (collective_us, fitted to those:
    bench/results/host-time-2026-12-02). An NCCL collective (compile's captured ones, a plan's NCCL buckets) is one
    more launch: Inductor's wrapper enqueues a kernel of NCCL's, and the recorded NCCL steps were GPU-bound where
    the copy-engine buckets' term made them host-bound (bench/results/compute-grid-2026-12-04). None for a mode
    HOST_MODES does not hold, or where the pieces lack the mode's plan."""
    graphs = pred.get("analyze") or {}
    if not graphs or mode not in HOST_MODES:
        return None
    key = MODES[mode][0]
    counts = {"step_us": 1, "launch_us": 0, "graph_input_us": 0, "collective_us": 0}
    for name, g in graphs.items():
        ce = nccl = 0
        if key == "captured":
            nccl = g.get("collectives") or 0
        elif key is not None:
            plan = (pred.get(key) or {}).get(name)
            if plan is None:
                return None
            ce = plan.get("ce_buckets", 0)
            nccl = plan.get("buckets", 0) - ce
        counts["launch_us"] += (g.get("kernels") or 0) + nccl
        counts["graph_input_us"] += g.get("inputs") or 0
        counts["collective_us"] += ce
    return counts


def host_step_us(pred: dict, mode: str = "ce_overlap") -> float | None:
    """The host's time to issue one step of `mode`: each term of the profile's host section (kept in the pieces as
    "host") times its count (host_counts). None without a host section, or where host_counts is None."""
    host, counts = pred.get("host"), host_counts(pred, mode)
    if not host or counts is None:
        return None
    return sum(host[term] * n for term, n in counts.items())


def _graph_analyses(ir, profile: str) -> dict:
    """Per graph of `ir`, the analysis's numbers step_model keeps (_ANALYZE_KEYS)."""
    from ..ir import analyze

    return {g["name"]: {k: g.get(k) for k in _ANALYZE_KEYS} for g in analyze(ir, profile).get("graphs", [])}


def step_model(ir, profile: str, world: int | None = None, ce_reduction: str = "consumer",
               plan_config: dict | None = None, loss_logits: int = 0, scheduler_ir=None, async_ir=None) -> dict:
    """The step's pieces (microseconds): per graph the analysis's compute ("analyze"), ce_overlap's plan ("plan") and
    the same with every bucket on NCCL ("plan_nccl"), each with plan_costs' slowdown and copies; the optimizer; the
    no-comm mode's local stand-ins. `plan_config`: the plan request's other fields (PassConfig.plan_config());
    `ce_reduction` is the plan's (PassConfig.ce_reduction: with "consumer", the pass's default, a CE reduce-scatter's
    cost includes its consumer's extra read). `loss_logits`: the logits the loss reads per step (batch x seq x
    vocab), for the FSDP2 modes' eager loss (0: not counted). `scheduler_ir`: the same step captured with Inductor's
    overlap scheduler on (ce_overlap.capture's overlap_scheduler): "scheduler" holds its analysis and its order priced
    as captured, every collective on NCCL (SCHEDULER_CAPTURED). `async_ir`: the same tensor-parallel step captured with
    torch's micro-pipeline TP (capture's async_tp): "async" holds its analysis and plans (TP_MODES)."""
    from ..ir import plan

    world = world or int(ir.meta.get("world_size", 1))
    spec = _spec(profile)
    hbm_us_per_byte, optimizer_us_per_byte, fused_us_per_byte = bandwidths_us_per_byte(spec)
    out = {"profile": profile, "analyze": _graph_analyses(ir, profile)}
    plans = {**_PLAN_CE, **(_PLAN_CE_NODES if int(ir.meta.get("nodes", 1)) > 1 else {})}
    for key, ce in plans.items():
        config = {**(plan_config or {}), "ce_reduction": ce_reduction, "ce": ce}
        out[key] = {name: plan_costs(plan(ir, name, profile, config), hbm_us_per_byte)
                    for name in ir.graph_names}
    if scheduler_ir is not None:
        config = {**(plan_config or {}), "ce_reduction": ce_reduction, "ce": "off", "keep_order": True}
        out["scheduler"] = {
            "analyze": _graph_analyses(scheduler_ir, profile),
            "plan": {name: plan_costs(plan(scheduler_ir, name, profile, config), hbm_us_per_byte)
                     for name in scheduler_ir.graph_names},
        }
    if async_ir is not None:
        out["async"] = {"analyze": _graph_analyses(async_ir, profile)}
        for key, ce in _PLAN_CE.items():
            config = {**(plan_config or {}), "ce_reduction": ce_reduction, "ce": ce}
            out["async"][key] = {name: plan_costs(plan(async_ir, name, profile, config), hbm_us_per_byte)
                                 for name in async_ir.graph_names}
    out["optimizer_us"] = optimizer_us(ir.meta.get("num_params", 0), world, optimizer_us_per_byte)
    out["host"] = spec.get("host")
    out["kernel_gap_us"] = spec["efficiency"].get("kernel_gap_us", 0.0)
    graphs = ir.to_dict()["graphs"]  # the IR serialized once for both
    colls = collectives_by_graph(graphs)
    out["local_gather_us"], out["local_gather_kernels"] = local_gather_us(graphs, fused_us_per_byte,
                                                                          out["kernel_gap_us"])
    out["fsdp2_copy_us"] = fsdp2_copy_us(collective_bytes(colls), spec["gpu"]["hbm_gbps"])
    out["fsdp2_loss_us"] = fsdp2_eager_loss_us(loss_logits, spec["gpu"]["hbm_gbps"])
    return out


def collectives_by_graph(graphs: list[dict]) -> dict:
    """Per graph (`graphs`: the IR's JSON graphs, ir.to_dict()["graphs"]), in document order: its FSDP collectives' IR
    records (type, bytes, group_size, ...); tensor parallelism's (role "tp") are not FSDP's."""
    return {g["name"]: [n["collective"] for n in g["nodes"] if n.get("kind") == "collective" and n.get("collective")
                        and n["collective"].get("role") != "tp"] for g in graphs}


def collective_bytes(colls_by_graph: dict) -> dict:
    """Per step: the all-gathers' output bytes and the reduce-scatters' input bytes, every graph together
    (`colls_by_graph`: collectives_by_graph's)."""
    total = {"all_gather": 0, "reduce_scatter": 0}
    for colls in colls_by_graph.values():
        for c in colls:
            if c["type"] == "all_gather":
                total["all_gather"] += c["bytes"] * c["group_size"]
            elif c["type"] == "reduce_scatter":
                total["reduce_scatter"] += c["bytes"]
    return total


def fsdp2_copy_us(moved: dict, hbm_gbps: float) -> dict:
    """Per FSDP2 mode, its copy kernels on the compute stream per step: FSDP2's copies (multiples of `moved`,
    collective_bytes) at copy_hbm_fraction of the HBM peak."""
    rate = hbm_gbps * 1e3 * FSDP2["copy_hbm_fraction"]  # bytes per us
    return {mode: sum(k * moved.get(t, 0) for t, k in per.items()) / rate for mode, per in FSDP2["copies"].items()}


def fsdp2_eager_loss_us(logits: int, hbm_gbps: float) -> float:
    """What FSDP2's eager loss adds to the captured step's fused one, per step, over `logits` logits."""
    return logits * FSDP2["eager_loss_bytes_per_logit"] / (hbm_gbps * 1e3 * FSDP2["eager_loss_hbm_fraction"])


def _fusible(node: dict) -> bool:
    """A node Inductor generates a pointwise / reduction kernel for, which it fuses with its neighbours: a FLOP-free
    compute node (the rule of fusion_groups in csrc/graph/analysis.h, which the analysis prices)."""
    return node.get("kind") == "compute" and not node.get("flops")


def local_gather_us(graphs: list[dict], us_per_byte: float, kernel_gap_us: float = 0.0) -> tuple[dict, int]:
    """What the no-comm mode runs instead of the collectives, per graph (in_graph/fully_shard.py _LocalGather), beyond what the
    analysis already prices (`graphs`: the IR's JSON graphs). Each all-gather becomes `shard.repeat(world)` and each
    reduce-scatter a `narrow(...).contiguous()` of the gradient. Inductor fuses both into their neighbours where
    those are pointwise kernels: the repeat into the kernel that produces the shard (the bf16 cast), which then
    writes world x shard instead of the shard: (world - 1) x shard bytes more, no kernel; the narrow into the
    kernels that read the result (the fp32 cast of the gradient), which read this rank's rows as they read the
    reduce-scatter's output: nothing more. The no-comm traces show it: `triton_poi_fused__to_copy_repeat` and
    `..._to_copy_slice` kernels where the other modes run `..._to_copy`, and no kernel of the stand-ins' own; 8 layers
    on 2x H100 and 2x H200, the no-comm mode's memory-bound kernels take 21.3 / 15.4 ms per step against ce_overlap's
    21.4 / 15.7. A stand-in with no pointwise neighbour is a kernel of its own (repeat: reads the shard, writes world x
    shard; narrow: reads and writes this rank's rows) and pays the profile's gap between kernels. At world 1 the
    stand-ins are no copies (Inductor removes `repeat(1)` and the narrow of all rows). The bytes are charged at
    `us_per_byte` (the profile's fused-kernel rate: the stand-ins are Inductor's kernels). Returns the time per graph
    and the number of stand-in kernels."""
    out, total_kernels = {}, 0
    for g in graphs:
        nodes = {n["id"]: n for n in g["nodes"]}
        users: dict[int, list[int]] = {}
        for n in g["nodes"]:
            for i in n.get("inputs", []):
                users.setdefault(i, []).append(n["id"])

        def source(i: int) -> dict:  # the node behind views
            n = nodes[i]
            while n.get("kind") == "view" and n.get("inputs"):
                n = nodes[n["inputs"][0]]
            return n

        def readers(i: int) -> list[dict]:  # the nodes reading i, through views and waits
            out_, stack = [], list(users.get(i, []))
            while stack:
                n = nodes[stack.pop()]
                if n.get("kind") in ("view", "wait"):
                    stack.extend(users.get(n["id"], []))
                else:
                    out_.append(n)
            return out_

        moved = kernels = 0
        for n in g["nodes"]:
            c = n.get("collective") if n.get("kind") == "collective" else None
            if not c or c["group_size"] <= 1 or c.get("role") == "tp":  # the stand-ins replace FSDP's only
                continue
            if c["type"] == "all_gather":
                if n.get("inputs") and _fusible(source(n["inputs"][0])):
                    moved += (c["group_size"] - 1) * c["bytes"]
                else:
                    moved += c["bytes"] * (1 + c["group_size"])
                    kernels += 1
            elif c["type"] == "reduce_scatter":
                after = readers(n["id"])
                if not after or not all(_fusible(r) for r in after):
                    moved += 2 * c["bytes"] // c["group_size"]
                    kernels += 1
        out[g["name"]] = moved * us_per_byte + kernels * kernel_gap_us
        total_kernels += kernels
    return out, total_kernels


def plans_step_us(report: dict, plans: list[dict], profile: str) -> dict:
    """One step under `plans` (ce_overlap.ir.plan results, one per graph of `report`, the analysis of the same IR),
    in predicted_step_ms's terms (for `ce-overlap analyze --plan`): {"step_us", "gpu_us" and "host_us" (None: the
    profile prices no host) of which it is the larger, "exposed_us": the plans' exposed communication,
    "optimizer_us"}."""
    spec = _spec(profile)
    hbm_us_per_byte, optimizer_us_per_byte, _ = bandwidths_us_per_byte(spec)
    meta = report.get("meta", {})
    pieces = {"analyze": {g["name"]: g for g in report.get("graphs", [])},
              "plan": {p["graph"]: plan_costs(p, hbm_us_per_byte) for p in plans},
              "optimizer_us": optimizer_us(meta.get("num_params", 0), int(meta.get("world_size", 1)),
                                           optimizer_us_per_byte), "host": spec.get("host")}
    step_ms = predicted_step_ms(pieces, "ce_overlap")  # ce_overlap's formula over whichever plans these are
    gpu_ms = gpu_step_ms(pieces, "ce_overlap")
    return {"step_us": 1e3 * step_ms if step_ms is not None else 0.0,
            "gpu_us": 1e3 * gpu_ms if gpu_ms is not None else 0.0, "host_us": host_step_us(pieces, "ce_overlap"),
            "exposed_us": sum(c.get("exposed_comm_us_after") or 0.0 for c in pieces["plan"].values()),
            "optimizer_us": pieces["optimizer_us"]}


def _resolve(pred: dict, mode: str) -> tuple[dict | None, str, bool]:
    """(the pieces, the 1-D mode of MODES whose formula a mode takes over them, whether TP's collectives add to it) for
    a mode of SCHEDULER_CAPTURED, NODE_MODES or TP_MODES; a MODES mode is its own. None pieces: not given."""
    if mode == SCHEDULER_CAPTURED:  # ce_overlap-nccl's formula over the scheduler's capture and its kept order
        sched = pred.get("scheduler")
        return ({**pred, "analyze": sched["analyze"], "plan_nccl": sched["plan"]} if sched else None,
                "ce_overlap-nccl", False)
    if mode in NODE_MODES:  # across nodes: a 1-D mode's formula over the flat or the HSDP capture (the caller's)
        return pred, NODE_MODES[mode][0], False
    if mode in TP_MODES:  # a 1-D mode's formula over the captured step or its async-TP capture
        base, capture, _ = TP_MODES[mode]
        over = pred.get("async") if capture == "async" or (capture == "async_if_given" and pred.get("async")) else pred
        if over is None:
            return None, base, False
        return ({**pred, **{k: over[k] for k in ("analyze", "plan", "plan_nccl") if k in over}}, base,
                base == "no-comm")
    return pred, mode, False


def predicted_step_ms(pred: dict, mode: str = "ce_overlap") -> float | None:
    """One step of `mode` as training runs it, the host issuing steps ahead of the GPU: the larger of the GPU's step
    (gpu_step_ms) and the host's (host_step_us of the 1-D mode it takes, where the profile prices the host). None
    where gpu_step_ms is."""
    gpu = gpu_step_ms(pred, mode)
    pieces, base, _ = _resolve(pred, mode)
    host = host_step_us(pieces, base) if gpu is not None and pieces is not None else None
    return gpu if host is None else max(gpu, host / 1e3)


def gpu_step_ms(pred: dict, mode: str = "ce_overlap") -> float | None:
    """The GPU's time for one step of `mode` (MODES, or a mode _resolve maps to one) from step_model's pieces: per
    graph compute + the plan's exposed communication + slowdown + bucket copies, plus the optimizer
    (SCHEDULER_CAPTURED: over the scheduler's capture, its analysis and its kept order); compile: compute + every
    collective's time + optimizer; no-comm: compute + optimizer + local stand-ins (no-comm+tp: + TP's collectives);
    the FSDP2 modes: compute + their plan's exposed communication + its slowdown x FSDP2's comm_factor, + their
    copies + their eager loss + optimizer. None where the pieces lack what the mode needs, or for a mode not
    modelled."""
    if mode not in MODES:
        pieces, base, tp_comm = _resolve(pred, mode)
        if pieces is None or base == mode:
            return None
        step = gpu_step_ms(pieces, base)
        if step is None or not tp_comm:
            return step
        return step + sum(g.get("tp_comm_us") or 0.0 for g in (pieces.get("analyze") or {}).values()) / 1e3
    graphs = pred.get("analyze") or {}
    if not graphs or mode not in MODES:
        return None
    key = MODES[mode][0]
    total = pred.get("optimizer_us") or 0.0
    if key in FSDP2["plan"]:
        copies = (pred.get("fsdp2_copy_us") or {}).get(key)
        plans = pred.get(FSDP2["plan"][key]) or {}
        if copies is None or any(name not in plans for name in graphs):
            return None
        for name, g in graphs.items():
            plan = plans[name]
            total += (g.get("compute_us") or 0.0) + (plan.get("exposed_comm_us_after") or 0.0) \
                + FSDP2["comm_factor"] * (plan.get("slowdown_us") or 0.0)
        return (total + copies + (pred.get("fsdp2_loss_us") or 0.0)) / 1e3
    for name, g in graphs.items():
        total += g.get("compute_us") or 0.0
        if key is None:
            total += (pred.get("local_gather_us") or {}).get(name, 0.0)
            continue
        if key == "captured":
            total += g.get("comm_us") or 0.0
            continue
        plan = (pred.get(key) or {}).get(name)
        if plan is None:
            return None
        exposed = plan.get("exposed_comm_us_after", g.get("exposed_comm_us") or 0.0)
        total += (exposed or 0.0) + (plan.get("slowdown_us") or 0.0) + (plan.get("bucket_copy_us") or 0.0)
    return total / 1e3
