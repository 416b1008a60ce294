"""The collectives benchmark, one entry point: NCCL vs ce_overlap's copy-engine (CE) collectives vs torch symm_mem,
on every GPU torchrun starts (2 for everything that moves data between ranks).

  all-gather, reduce-scatter,   nccl-tests-style size sweep of one collective: a table per variant (size, count,
  all-to-all, broadcast         type, time, algbw, busbw, #wrong vs NCCL) and a side-by-side busbw summary
  all                           the four sweeps in one process, one JSON (bench/run_device.sh's stage collectives)
  p2p                           send / recv, one way and exchange: NCCL vs CE staged vs CE direct, same tables
  overlap                       a GEMM and a memory-bound add, alone and beside every all-gather / reduce-scatter
                                variant: the compute's slowdown, the collective's busbw beside it
  probe                         the runtime's design questions: same-GPU copy APIs, all-gather pull split / push,
                                reduce-scatter tuning, the reduction kernel alone

    torchrun --standalone --nproc-per-node 2 bench/collectives.py all-gather -b 64K -e 1G -f 4 --out ag.json
    torchrun --standalone --nproc-per-node 2 bench/collectives.py overlap --sustain-ms 1000 --compute gemm
    python bench/collectives.py SUBCOMMAND --help      # every option; --dry-run prints the plan without a GPU

Sizes take a K/M/G suffix; every option is checked before any GPU work (a bad one: one line naming it, exit 2).
Exit 1 when a variant returned wrong bytes or failed. bench/README.md has the whole picture.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import args as A  # noqa: E402
from lib import common as _common  # noqa: E402,F401  (first to load torch: sets the multicast-off environment before NCCL reads it)
from lib import overlap as _overlap  # noqa: E402
from lib import p2p as _p2p  # noqa: E402
from lib import probe as _probe  # noqa: E402
from lib import sweep as _sweep  # noqa: E402

SUBCOMMAND_MODULES = (_sweep, _p2p, _overlap, _probe)


def build_parser() -> A.Parser:
    p = A.Parser(prog="bench/collectives.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="subcommand", required=True, metavar="SUBCOMMAND", parser_class=A.Parser)
    for module in SUBCOMMAND_MODULES:
        module.add_parsers(sub)
    for subparser in sub.choices.values():
        subparser.add_argument("--dry-run", action="store_true",
                               help="print what would run (sizes, variants, pool) as JSON and exit: no GPU needed")
    p.set_defaults(subparsers=sub.choices)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if getattr(args, "min", None) is not None:  # a size sweep
        from ce_overlap.calibrate import parse_size

        if parse_size(args.min) > parse_size(args.max):
            args.subparsers[args.subcommand].error(
                f"-b/--min-bytes {args.min} is larger than -e/--max-bytes {args.max}")
    del args.subparsers
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        print(json.dumps({"subcommand": args.subcommand, **args.plan(args)}))
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
