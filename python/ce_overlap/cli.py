"""`ce-overlap`: capture a compiled training graph and explain it, no GPU needed.

Bad input ends with exit code 2 and one line naming the problem, never a traceback.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from .errors import CeOverlapError
from .profiles import DEFAULT as DEFAULT_PROFILE_NAME

DEFAULT_MODEL = "llama3-8b"
DEFAULT_PROFILE = DEFAULT_PROFILE_NAME
DEFAULT_WORLD_SIZE = 8


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (exit 2), like every other rejection."""

    def error(self, message: str):
        self.exit(2, f"ce-overlap: error: {message} (see {self.prog} --help)\n")


def _bounded(what: str, kind: type = int, lowest: float = 0, strict: bool = False):
    """argparse type: a finite `kind` (int or float) >= lowest (> lowest if strict); the error names the flag."""
    noun = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be {noun}, got {text!r}") from None
        if not (value > lowest if strict else value >= lowest) or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{what} must be {'a finite number ' if kind is float else ''}"
                                             f"{'>' if strict else '>='} {lowest:g}, got {text}")
        return value
    return parse


def _add_capture_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_bounded("--world-size", lowest=1), default=DEFAULT_WORLD_SIZE,
                   help=f"FSDP ranks to capture for (default {DEFAULT_WORLD_SIZE})")
    p.add_argument("--seq-len", type=_bounded("--seq-len", lowest=1), default=None,
                   help="sequence length for zoo models (default: the model's)")
    p.add_argument("--batch", type=_bounded("--batch", lowest=1), default=1, help="batch per rank for zoo models")
    p.add_argument("--tp", type=_bounded("--tp", lowest=1), default=1,
                   help="tensor parallelism over T ranks inside, in-graph FSDP over world-size / T (a zoo model's "
                        "torchtitan plan, or a build file's tensor_parallel(module, tp_mesh)); default 1. analyze "
                        "then plans (--plan) and predicts the TP modes, capturing the step a second time with torch's "
                        "async TP")
    p.add_argument("--no-async-tp", action="store_true",
                   help="with --tp: skip the async-TP capture (its modes are not predicted)")
    p.add_argument("--nodes", type=_bounded("--nodes", lowest=1), default=1,
                   help="the ranks on M nodes, world-size / M each (default 1): groups across nodes are priced over "
                        "the profile's inter-node link, FSDP over every rank may go hierarchical (copy engines inside "
                        "each node, NCCL across); analyze then plans and predicts the multi-node modes")
    p.add_argument("--hsdp", action="store_true",
                   help="with --nodes M >= 2: HSDP, shards inside each node and replicas across (a ('replicate', "
                        "'shard') mesh of M x world-size / M)")
    p.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype parameters are all-gathered in (default bfloat16)")
    p.add_argument("--no-reshard", action="store_true",
                   help="keep gathered parameters for the backward instead of re-gathering them")
    p.add_argument("--no-cast-inputs", action="store_true",
                   help="keep floating-point forward inputs in their dtype (default: cast to --param-dtype, as "
                        "FSDP2's MixedPrecisionPolicy does)")
    p.add_argument("--no-fsdp", action="store_true", help="capture the model as is, without in-graph FSDP")
    p.add_argument("--vocab-parallel-embeddings", action="store_true",
                   help="embeddings look up their tokens on their row shards instead of all-gathering the table "
                        "(ce_overlap.fully_shard's vocab_parallel_embeddings)")
    p.add_argument("--keep-gathered", type=lambda v: tuple(x for x in v.split(",") if x), default=(),
                   metavar="MODULE[,MODULE]",
                   help="submodules (dotted paths, e.g. norm,output) sharded by a call of their own and kept gathered "
                        "from the forward into the backward, as torchtitan's FSDP2 wrap keeps [norm, output]")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where capture's fake tensors live. Default: cuda (fake, no GPU needed: the graphs Inductor "
                        "compiles for a GPU, its SDPA kernels, flex attention), the CPU where this torch cannot make "
                        "fake CUDA tensors or the model compiles only there, said in the output "
                        "(docs/notes/fake_cuda_capture.md)")
    p.add_argument("--no-cache", action="store_true", help="capture again even if a cached capture exists")
    p.add_argument("--full-capture", action="store_true",
                   help="zoo models: trace every block instead of tracing 3 and 4 blocks and extrapolating "
                        "(same graphs, node for node; slower)")


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    """The planner's settings: each flag sets one PassConfig field (its default is PassConfig's, docs/pass.md)."""
    from .config import CE_COLLECTIVE_TYPES, CE_MODES, CE_REDUCTIONS, PassConfig

    d = PassConfig()
    g = p.add_argument_group("planning (--plan; docs/plan.md): PassConfig's fields, its defaults")
    g.add_argument("--plan", action="store_true", help="also plan every graph: buckets, NCCL or CE, the new order")
    g.add_argument("--plan-json", metavar="FILE", help="write the plans (a JSON array, one Plan per graph); implies --plan")
    g.add_argument("--ce", choices=CE_MODES, default=d.ce, help=f"CE backend choice (default {d.ce})")
    g.add_argument("--prefetch-blocks", type=_bounded("--prefetch-blocks"), default=d.prefetch_blocks,
                   help=f"issue all-gather buckets this many blocks early (default {d.prefetch_blocks})")
    g.add_argument("--bucket-cap-mib", type=_bounded("--bucket-cap-mib", float, strict=True), default=d.bucket_cap_mb,
                   help=f"bucket size cap, per-rank input MiB (default {d.bucket_cap_mb:g})")
    g.add_argument("--memory-budget-mib", type=_bounded("--memory-budget-mib", float),
                   default=d.memory_budget_mb,
                   help=f"peak-memory increase allowed over the captured order, MiB (default {d.memory_budget_mb:g})")
    g.add_argument("--min-ce-bytes", type=_bounded("--min-ce-bytes"), default=d.min_ce_bytes,
                   help=f"smaller buckets (per-rank bytes) stay on NCCL (default {d.min_ce_bytes})")
    g.add_argument("--ce-collectives", default=",".join(d.ce_collectives), metavar="TYPES",
                   help=f"comma-separated collective types that may move to CE, of {', '.join(CE_COLLECTIVE_TYPES)} "
                        f"(default {','.join(d.ce_collectives)})")
    g.add_argument("--ce-reduction", choices=CE_REDUCTIONS, default=d.ce_reduction,
                   help=f"where a reduce-scatter on CE adds the ranks' chunks (default {d.ce_reduction})")
    g.add_argument("--copy-pace-fill", type=float, default=d.copy_pace_fill, metavar="F",
                   help="pace a CE bucket's copies to fill this share (0..1) of its slot where they would take "
                        f"less (docs/plan.md; default {d.copy_pace_fill:g}: unpaced)")
    g.add_argument("--bucket-pattern", action="append", default=[], metavar="REGEX",
                   help="module-path regex that keys buckets instead of the detected block (repeatable)")


def _pass_config(args):
    """The PassConfig the plan flags describe (it validates them: a bad value names its field)."""
    from .config import PassConfig

    return PassConfig(bucket_cap_mb=args.bucket_cap_mib, memory_budget_mb=args.memory_budget_mib, ce=args.ce,
                      min_ce_bytes=args.min_ce_bytes, prefetch_blocks=args.prefetch_blocks,
                      bucket_patterns=tuple(args.bucket_pattern), ce_reduction=args.ce_reduction,
                      ce_collectives=tuple(k.strip() for k in args.ce_collectives.split(",") if k.strip()),
                      copy_pace_fill=args.copy_pace_fill)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ce-overlap", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    cap = sub.add_parser("capture", help="capture a model's compiled forward/backward graphs as IR JSON")
    cap.add_argument("target", help="zoo model name or path/to/file.py:build")
    cap.add_argument("-o", "--output", required=True, help="IR JSON file to write")
    _add_capture_options(cap)

    ana = sub.add_parser("analyze", help="per-block collectives, compute and estimated exposed communication")
    ana.add_argument("target", nargs="?", default=DEFAULT_MODEL,
                     help=f"IR JSON file, zoo model name, or path/to/file.py:build (default {DEFAULT_MODEL})")
    ana.add_argument("--profile", default=DEFAULT_PROFILE,
                     help=f"built-in hardware profile name or profile JSON file (default {DEFAULT_PROFILE})")
    ana.add_argument("--json", action="store_true", help="print the report as JSON (docs/analysis.md)")
    ana.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the estimated timeline")
    ana.add_argument("--save-ir", metavar="FILE", help="also write the captured IR JSON")
    ana.add_argument("--all-blocks", action="store_true", help="print every block (default: first and last few)")
    _add_capture_options(ana)
    _add_plan_options(ana)

    sub.add_parser("list", help="list zoo models and built-in profiles")

    topo = sub.add_parser("topo", help="detect the local GPU topology (P2P, links, NUMA) and print it")
    topo.add_argument("--json", action="store_true", help="print it as a profile's topology (docs/profiles.md)")

    cal = sub.add_parser("calibrate", help="measure this machine (GEMM, NCCL, CE, contention) and write a profile; "
                         "run under torchrun for more than 1 GPU (docs/profiles.md)")
    cal.add_argument("-o", "--output", required=True, help="profile JSON file to write")
    cal.add_argument("--base", help="built-in profile (or file) to start from (default: the detected GPU's)")
    cal.add_argument("--name", help="the written profile's name (default: BASE-calibrated)")
    cal.add_argument("--gpus", type=_bounded("--gpus", lowest=1), default=None,
                     help="GPUs to calibrate; more than 1 needs torchrun (default: torchrun's WORLD_SIZE, else 1)")
    cal.add_argument("--min-size", default="64K", help="smallest collective size per rank (default 64K)")
    cal.add_argument("--max-size", default="256M", help="largest collective size per rank (default 256M)")
    cal.add_argument("--slowdown-size", default="256M", help="collective size per rank beside compute (default 256M)")
    cal.add_argument("--iters", type=_bounded("--iters", lowest=1), default=10, help="timed ops per point (median)")
    cal.add_argument("--warmup", type=_bounded("--warmup", lowest=1), default=3, help="untimed ops per point")
    cal.add_argument("--keep-topology", action="store_true", help="keep the base profile's topology")
    cal.add_argument("--measurements", metavar="FILE", help="also write the raw measurements as JSON")
    cal.add_argument("--compute-grid", action="store_true",
                     help="also measure compute by shape (GEMMs, attention, memory-bound kernels over a grid: "
                          "calibrate.common.GRID_*) into the measurements")
    cal.add_argument("--from-measurements", metavar="FILE",
                     help="write the profile from a --measurements file instead of measuring (no GPU needed)")
    return parser


def _source_fingerprint() -> str:
    """Hash of the capture code, so a cached capture never outlives the code that made it."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    files = [os.path.join(sub, name) for sub in ("inductor", "in_graph", "models")
             for name in sorted(os.listdir(os.path.join(root, sub))) if name.endswith(".py")]
    for name in files + ["analyzer/model_capture.py", "extrapolate.py", "ir.py"]:
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def _cache_path(args, target: str, async_tp: bool = False, built=None) -> str | None:
    """The cache file of this capture: keyed by the options, torch, the capture code and, for a build() target, what
    build() returned (ce_overlap.models.fingerprint) and the file's bytes; a zoo model by its name."""
    if args.no_cache:
        return None
    import torch

    from . import models

    key = {"target": target, "world_size": args.world_size, "tp": args.tp, "async_tp": async_tp, "seq_len": args.seq_len,
           "nodes": args.nodes, "hsdp": args.hsdp,
           "batch": args.batch,
           "param_dtype": args.param_dtype, "reshard": not args.no_reshard, "fsdp": not args.no_fsdp,
           "cast_inputs": not args.no_cast_inputs, "device": args.device,
           "vocab_parallel": args.vocab_parallel_embeddings, "keep_gathered": list(args.keep_gathered),
           "full_capture": args.full_capture, "torch": torch.__version__, "code": _source_fingerprint()}
    if models.is_build_target(target):
        path = target.rpartition(":")[0]
        with open(path, "rb") as f:
            key["file"] = hashlib.sha256(f.read()).hexdigest()
        key["model"] = models.fingerprint(built)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    from . import environment

    folder = environment.read("CE_OVERLAP_CACHE")
    if folder is None:
        folder = os.path.join(os.path.expanduser("~"), ".cache", "ce_overlap")
    return os.path.join(folder, f"ir-{digest}.json")


def _capture_target(args, target: str, async_tp: bool = False):
    """The IR of a zoo model or a build() target: from the cache, else captured (its stages shown on stderr as they
    pass: ce_overlap.progress) and cached."""
    from . import models, progress
    from .analyzer.model_capture import EXTRAPOLATE_FROM_BLOCKS

    if models.is_build_target(target):
        expected = 4  # build, trace and compile the forward, compile the backward, convert
    elif args.full_capture or models.depth(target) <= EXTRAPOLATE_FROM_BLOCKS + 1:
        expected = 4
    else:
        expected = 8  # build, two small captures of three stages each, extrapolation
    title = f"capture {target}" + (" (async TP)" if async_tp else "")
    with progress.shown(title, expected):
        return _capture_shown(args, target, async_tp)


def _capture_shown(args, target: str, async_tp: bool):
    from . import models, progress
    from .analyzer.model_capture import capture, capture_named
    from .ir import Ir

    built = None
    if models.is_build_target(target):
        if args.seq_len is not None:
            raise CeOverlapError("--seq-len applies to zoo models; a build() target sets its own inputs")
        with progress.stage("build"):
            built = models.build_from_file(target)  # the cache key is what it returns
    cache = _cache_path(args, target, async_tp, built)
    if cache and os.path.exists(cache):
        try:
            return Ir.load(cache), True
        except CeOverlapError:
            pass  # a damaged cache entry is recaptured and overwritten
    common = dict(world_size=args.world_size, fsdp=not args.no_fsdp, param_dtype=args.param_dtype,
                  reshard_after_forward=not args.no_reshard, cast_forward_inputs=not args.no_cast_inputs,
                  vocab_parallel_embeddings=args.vocab_parallel_embeddings, keep_gathered=args.keep_gathered,
                  device=args.device, tp=args.tp, async_tp=async_tp, nodes=args.nodes, hsdp=args.hsdp)
    if built is not None:
        common["tensor_parallel"] = built.tensor_parallel
        try:
            ir = capture(built.module, built.example_inputs, name=built.name, **common)
        except CeOverlapError as e:
            # A model that compiles on fake CUDA tensors but not on the CPU's is common (flex attention has no CPU
            # backward); the reverse is possible: try the CPU, and report the first error if that fails too.
            from .inductor.capture import COMPILE_FAILED
            from .analyzer.model_capture import capture_device

            if args.device is not None or capture_device(None)[0] != "cuda" or \
                    not str(e).startswith(COMPILE_FAILED):
                raise
            built = models.build_from_file(target)  # the failed capture sharded the first one
            common["tensor_parallel"] = built.tensor_parallel
            why = str(e).removeprefix(COMPILE_FAILED).split(" (in ")[0]
            try:
                ir = capture(built.module, built.example_inputs, name=built.name,
                             meta={"capture_device_reason": f"on fake CUDA tensors it does not compile ({why})"},
                             **{**common, "device": "cpu"})
            except CeOverlapError:
                raise e from None
    else:
        ir = capture_named(target, seq_len=args.seq_len, batch=args.batch, full=args.full_capture, **common)
    if cache:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = f"{cache}.{os.getpid()}.tmp"
        ir.save(tmp)
        os.replace(tmp, cache)  # atomic: a concurrent reader never sees half a file
    return ir, False


def _is_ir_file(target: str) -> bool:
    return target.endswith(".json") or (os.path.isfile(target) and not target.endswith(".py"))


def _load_or_capture(args):
    from .ir import Ir

    target = args.target
    if _is_ir_file(target):
        return Ir.load(target), False
    return _capture_target(args, target)


def _tensor_parallel_report(args, ir, profile_name: str, plan_config: dict) -> dict:
    """With tensor parallelism: the predicted step of each of bench/train.py's TP modes (step_model.TP_MODES), the
    async-TP ones from a second capture with torch's micro-pipeline TP (cached as the first; none for an IR file or
    with --no-async-tp)."""
    from .analyzer import step_model as sm

    tp = int(ir.meta.get("tp", 1))
    async_ir = None
    if not _is_ir_file(args.target) and not args.no_async_tp:
        async_ir, _ = _capture_target(args, args.target, async_tp=True)
    logits = 0
    if not _is_ir_file(args.target):
        from . import models

        if not models.is_build_target(args.target):  # a zoo Llama: batch x seq x vocab logits per rank
            from .models.llama import LLAMA_CONFIGS

            meta = ir.meta
            logits = int(meta.get("batch", 1)) * int(meta.get("seq_len", 0)) * LLAMA_CONFIGS[args.target].vocab_size
    pieces = sm.step_model(ir, profile_name, plan_config=plan_config, loss_logits=logits, async_ir=async_ir)
    world = int(ir.meta.get("world_size", 1))
    return {"tp": tp, "data_parallel": world // tp, "async_tp_captured": async_ir is not None,
            "predicted_step_ms": {mode: sm.predicted_step_ms(pieces, mode) for mode in sm.TP_MODES},
            "modes": {mode: how for mode, (_, _, how) in sm.TP_MODES.items()}}


def _nodes_report(ir, profile_name: str, plan_config: dict) -> dict:
    """Across nodes: the predicted step of each multi-node mode its capture stands for (step_model.NODE_MODES: the
    flat FSDP modes, or with HSDP the HSDP ones) and the no-communication bound."""
    from .analyzer import step_model as sm

    nodes, hsdp = int(ir.meta.get("nodes", 1)), bool(ir.meta.get("hsdp", False))
    world = int(ir.meta.get("world_size", 1))
    pieces = sm.step_model(ir, profile_name, plan_config=plan_config)
    modes = [m for m, (_, capture, _) in sm.NODE_MODES.items() if capture == ("hsdp" if hsdp else "flat")]
    steps = {m: sm.predicted_step_ms(pieces, m) for m in modes}
    steps["no-comm"] = sm.predicted_step_ms(pieces, "no-comm")
    how = {m: sm.NODE_MODES[m][2] for m in modes}
    how["no-comm"] = sm.MODES["no-comm"][1]
    return {"nodes": nodes, "ranks_per_node": world // nodes, "hsdp": hsdp, "predicted_step_ms": steps, "modes": how}


def _cmd_capture(args) -> int:
    started = time.perf_counter()
    ir, cached = _load_or_capture(args)
    ir.save(args.output)
    nodes = ", ".join(f"{g} {ir.num_nodes(g)} nodes" for g in ir.graph_names)
    how = ir.meta.get("capture")
    print(f"wrote {args.output}: {nodes}, {len(ir.blocks)} blocks"
          f" ({'cached capture' if cached else f'captured in {time.perf_counter() - started:.1f} s'}"
          f"{f'; {how}' if how else ''})")
    from .analyzer import report

    for note in report.format_notes({"meta": ir.meta}):
        print(f"note: {note}")
    return 0


def _say_where_the_ir_came_from(args, ir, cached: bool, loaded_s: float) -> None:
    """Status, not report: on stderr, so stdout stays the report (or the JSON) alone."""
    how = ir.meta.get("capture")
    how = f"; {how}" if how else ""
    if cached:
        print(f"(capture from cache{how}; --no-cache to capture again)", file=sys.stderr)
    elif not _is_ir_file(args.target):
        print(f"(captured in {loaded_s:.1f} s{how}; the next analyze of this model reuses it)", file=sys.stderr)


def _cmd_analyze(args) -> int:
    from . import profiles
    from .analyzer import report
    from .ir import analyze

    profile = profiles.load(args.profile)  # a bad profile is rejected before a long capture
    started = time.perf_counter()
    ir, cached = _load_or_capture(args)
    loaded_s = time.perf_counter() - started
    if args.save_ir:
        ir.save(args.save_ir)
    result = analyze(ir, profile)
    plans = None
    tp = int(ir.meta.get("tp", 1))
    nodes = int(ir.meta.get("nodes", 1))
    # With tensor parallelism the plan is the report (what shares NVLink); across nodes, what goes hierarchical.
    if args.plan or args.plan_json or tp > 1 or nodes > 1:
        from .ir import plan

        config = _pass_config(args).plan_config()
        plans = [plan(ir, g, profile, config) for g in ir.graph_names]
        # The user's own baseline for the recommendation: Inductor's overlap scheduler, modelled as the same order
        # with every bucket on NCCL.
        baseline_plans = [plan(ir, g, profile, {**config, "ce": "off"}) for g in ir.graph_names]
        result["plans"] = plans
        result["recommendation"] = report.recommendation(result, plans, baseline_plans, args.profile)
        if tp > 1:
            result["tensor_parallel"] = _tensor_parallel_report(args, ir, args.profile, config)
        if nodes > 1:
            result["nodes"] = _nodes_report(ir, args.profile, config)
        if args.plan_json:
            with open(args.plan_json, "w", encoding="utf-8") as f:
                json.dump(plans, f, indent=1)
    if args.trace:
        report.write_trace(result, args.trace)
    if args.json:
        print(json.dumps(result, indent=1))
        _say_where_the_ir_came_from(args, ir, cached, loaded_s)
        return 0
    print(report.format_summary(result))
    print()
    print(report.table_units(result))
    print(report.format_table(result, max_rows=None if args.all_blocks else 8))
    for p in plans or []:
        print()
        print(report.format_plan(p, max_rows=None if args.all_blocks else 12))
    if plans:  # the conclusion last, where the terminal leaves it
        print()
        print(report.format_recommendation(result, plans, baseline_plans, args.profile))
        if "tensor_parallel" in result:
            print(report.format_tensor_parallel(result))
        if "nodes" in result:
            print(report.format_nodes(result))
    if args.plan_json:
        print(f"\nplans written to {args.plan_json}")
    _say_where_the_ir_came_from(args, ir, cached, loaded_s)
    if args.trace:
        print(f"trace written to {args.trace} (open in ui.perfetto.dev or chrome://tracing)")
    return 0


def _cmd_list(args) -> int:
    from . import models, profiles

    print("models:   " + ", ".join(models.names()) + "  (or path/to/file.py:build)")
    print("profiles: " + ", ".join(profiles.names()) + "  (or path/to/profile.json)")
    return 0


def _cmd_topo(args) -> int:
    from . import topo

    return topo.main(json_output=args.json)


def _cmd_calibrate(args) -> int:
    from . import calibrate

    return calibrate.main(args)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"capture": _cmd_capture, "analyze": _cmd_analyze, "list": _cmd_list, "topo": _cmd_topo,
               "calibrate": _cmd_calibrate}[args.command]
    try:
        return handler(args)
    except CeOverlapError as e:
        message = " | ".join(line.strip() for line in str(e).splitlines() if line.strip())  # always one line
        print(f"ce-overlap: error: {message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"ce-overlap: error: {e.filename or ''}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
