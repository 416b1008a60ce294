"""The cost model's side of bench/train.py: its training step captured (as the in-graph modes shard it, as the FSDP2
modes do, with Inductor's overlap scheduler on) and every mode's step predicted from it (ce_overlap.analyzer.step_model). No
GPU: the captures run on fake tensors over a fake process group. Also the frame of the prediction-table scripts
(bench/tp_predictions.py, bench/node_predictions.py): their common options, --from-json, the table and the JSON.
Not a script."""
from __future__ import annotations

import argparse
import dataclasses
import json


def model_config(args):
    from ce_overlap.models.llama import LLAMA_CONFIGS

    cfg = LLAMA_CONFIGS[args.model]
    return dataclasses.replace(cfg, n_layers=args.layers or cfg.n_layers, seq_len=args.seq_len,
                               expand_kv=args.gqa == "expand")


# --in-graph-wrap torchtitan: the submodules sharded by a call of their own, not resharded after forward (torchtitan's
# FSDP2 wrap does this for [norm, output], bench/lib/fsdp2.py): the backward starts with them.
KEEP_GATHERED = {"blocks": (), "torchtitan": ("norm", "output")}
# The in-graph wrap of a result that does not record one (train.py's --in-graph-wrap before it existed).
IN_GRAPH_WRAP_BEFORE = "blocks"


def capture_step(args, world: int, fsdp2: bool = False, overlap_scheduler: str | None = None,
                 inductor_config: dict | None = None, async_tp: bool = False):
    """The IR of this benchmark's training step for args' shape at `world` ranks: the model on the meta device,
    captured on fake tensors over the fake process group (CPU, no memory). Sharded as the in-graph modes shard it, or
    with `fsdp2` as the FSDP2 modes do (_fsdp2.build): the embedding table gathered (they have no vocabulary-parallel
    lookup), [norm, output] kept gathered as --fsdp2-wrap says. `overlap_scheduler` (a profile): compiled with
    Inductor's overlap scheduler on (the compile+inductor-overlap mode's graphs); `inductor_config`: more patches.
    With --tp > 1: tensor parallelism inside (torchtitan's plan), FSDP over the rest (bench/lib/tp.py), and with
    `async_tp` torch's micro-pipeline TP."""
    import torch

    import ce_overlap
    from ce_overlap.models.llama import Llama, tensor_parallel

    with torch.device("meta"):
        model = Llama(model_config(args))
    tokens = torch.zeros((args.batch, args.seq_len), dtype=torch.long, device="meta")
    return ce_overlap.capture(model, (tokens, tokens), world_size=world, overlap_scheduler=overlap_scheduler,
                              vocab_parallel_embeddings=args.vocab_parallel_embeddings and not fsdp2,
                              keep_gathered=KEEP_GATHERED[args.fsdp2_wrap if fsdp2 else args.in_graph_wrap],
                              inductor_config=inductor_config, tp=getattr(args, "tp", 1),
                              tensor_parallel=tensor_parallel, async_tp=async_tp)


def recorded_step_args(a: dict) -> argparse.Namespace:
    """capture_step's arguments of a recorded bench/train.py run (its JSON's "args"), with train.py's defaults where an
    older run did not record one (its in-graph wrap: "blocks" before the wrap was recorded)."""
    return argparse.Namespace(model=a.get("model", "llama3-8b"), layers=a["layers"], seq_len=a.get("seq_len", 4096),
                              batch=a.get("batch", 1), gqa=a.get("gqa", "expand"),
                              vocab_parallel_embeddings=bool(a.get("vocab_parallel_embeddings")),
                              in_graph_wrap=a.get("in_graph_wrap", IN_GRAPH_WRAP_BEFORE),
                              fsdp2_wrap=a.get("fsdp2_wrap", "torchtitan"), device="cpu")


def fsdp2_shards_alike(args) -> bool:
    """Whether the FSDP2 modes shard the model as the in-graph modes do (then one capture predicts both)."""
    return not args.vocab_parallel_embeddings and KEEP_GATHERED[args.fsdp2_wrap] == KEEP_GATHERED[args.in_graph_wrap]


def predict_steps(args, world: int, profile: str, ce_reduction: str = "consumer", ir=None,
                  scheduler_ir=None) -> tuple[dict, dict]:
    """(ce_overlap.analyzer.step_model's pieces of the in-graph capture (`ir` where the caller has it), the predicted step in ms
    of every mode of step_model.MODES): the FSDP2 modes from a capture sharded as they shard (capture_step's fsdp2)
    where that differs; with `scheduler_ir` (capture_step's overlap_scheduler) also step_model.SCHEDULER_CAPTURED."""
    from ce_overlap.analyzer.step_model import MODES, SCHEDULER_CAPTURED, TP_MODES, predicted_step_ms, step_model

    if getattr(args, "tp", 1) > 1:  # the TP modes, from the step as captured and with torch's async TP
        ir = ir if ir is not None else capture_step(args, world)
        pieces = step_model(ir, profile, world, ce_reduction, loss_logits=loss_logits(args),
                            async_ir=capture_step(args, world, async_tp=True))
        return pieces, {m: predicted_step_ms(pieces, m) for m in TP_MODES}
    ir = ir if ir is not None else capture_step(args, world)
    pieces = step_model(ir, profile, world, ce_reduction, loss_logits=loss_logits(args), scheduler_ir=scheduler_ir)
    step_ms = {m: predicted_step_ms(pieces, m) for m in MODES}
    if scheduler_ir is not None:
        step_ms[SCHEDULER_CAPTURED] = predicted_step_ms(pieces, SCHEDULER_CAPTURED)
    if not fsdp2_shards_alike(args):
        fsdp2 = step_model(capture_step(args, world, fsdp2=True), profile, world, ce_reduction,
                           loss_logits=loss_logits(args))
        step_ms.update({m: predicted_step_ms(fsdp2, m) for m in MODES if m.startswith("fsdp2")})
    return pieces, step_ms


def loss_logits(args) -> int:
    """The logits the loss reads per step (step_model's FSDP2 modes run that loss eagerly)."""
    return args.batch * args.seq_len * model_config(args).vocab_size


def table_script_parser(description: str, model: str, batch_help: str) -> argparse.ArgumentParser:
    """The options every prediction-table script has; the script adds the axis it sweeps."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=model, help="a zoo Llama (ce-overlap list)")
    p.add_argument("--profile", default="h200-sxm")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's")
    p.add_argument("--batch", type=int, default=1, help=batch_help)
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--from-json", metavar="FILE", help="print the table of rows a --json run wrote (no capture)")
    return p


def int_list(p: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """A comma list of integers from option `flag`, or the parser's error naming it."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        p.error(f"{flag}: expected a comma list of integers, got {text!r}")


def run_table_script(p: argparse.ArgumentParser, argv, table, schema: str, rows_of) -> int:
    """--from-json: the table of a written run; else the rows `rows_of(args)` captures and predicts, their table, and
    with --json the rows under `schema`."""
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as f:
            print(table(json.load(f)["rows"]))
        return 0
    rows = rows_of(args)
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"schema": schema, "rows": rows}, f, indent=1)
    return 0
