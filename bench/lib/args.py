"""Command-line pieces of bench/collectives.py and bench/fault_repeats.py: a parser whose usage errors are one line
naming the bad input (exit 2), and the option types (sizes, counts, comma lists). Imports neither torch nor CUDA, so
--help and usage errors are fast and work on any machine. Not a script."""
from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error: '<prog>: error: <what was wrong> (<prog> --help for usage)', exit 2.
    Subcommand parsers made through add_subparsers() are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help for usage)\n")


def size(text: str) -> str:
    """A size in bytes with an optional K/M/G suffix ('64K', '1G'): checked here, kept as written (the JSON records
    the arguments as given)."""
    from ce_overlap.calibrate import parse_size  # the one parser of size strings (no torch)
    from ce_overlap.errors import CeOverlapError

    try:
        parse_size(text)
    except CeOverlapError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def at_least(lowest: int):
    """argparse type: an integer >= lowest."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {text!r}") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lowest}, got {text!r}")
        return value
    return parse


def non_negative(kind):
    """argparse type: a number of `kind` (int, float) that is >= 0, else a clear usage error."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= 0, got {text!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__} >= 0, got {text!r}")
        return v
    return parse


def items(text: str) -> list[str]:
    """The non-empty items of a comma list."""
    return [t for t in text.split(",") if t]


def choices_list(allowed: list[str]):
    """argparse type: a comma list drawn from `allowed`, kept as the string given (the JSON records it so)."""
    def parse(text: str) -> str:
        bad = [t for t in items(text) if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))} in {text!r}: expected a comma list "
                                              f"of {', '.join(allowed)}")
        return text
    return parse


def int_list(lowest: int = 1):
    """argparse type: a comma list of integers >= lowest ('64,256' -> [64, 256])."""
    def parse(text: str) -> list[int]:
        values = []
        for t in items(text):
            try:
                values.append(int(t))
            except ValueError:
                values.append(None)
            if values[-1] is None or values[-1] < lowest:
                raise argparse.ArgumentTypeError(f"{t!r} in {text!r}: expected a comma list of integers >= {lowest}")
        return values
    return parse


def sweep_options(p: argparse.ArgumentParser, *, iters: int, warmup: int) -> None:
    """nccl-tests' size sweep and timing options: -b / -e / -f (sizes per rank), -n / -w. The destinations keep the
    names the JSON has recorded since the first runs (min, max, factor, iters, warmup)."""
    p.add_argument("-b", "--min-bytes", dest="min", type=size, default="64K", metavar="SIZE",
                   help="smallest size per rank: bytes with an optional K/M/G suffix (default %(default)s)")
    p.add_argument("-e", "--max-bytes", dest="max", type=size, default="1G", metavar="SIZE",
                   help="largest size per rank (default %(default)s)")
    p.add_argument("-f", "--step-factor", dest="factor", type=at_least(2), default=4, metavar="N",
                   help="size multiplier between rows (default %(default)s)")
    timing_options(p, iters=iters, warmup=warmup)


def timing_options(p: argparse.ArgumentParser, *, iters: int, warmup: int | None, min_iters: int = 1) -> None:
    """-n / --iters (timed ops per measurement) and, where the subcommand has one, -w / --warmup."""
    p.add_argument("-n", "--iters", type=at_least(min_iters), default=iters, metavar="N",
                   help="timed ops per measurement (default %(default)s)")
    if warmup is not None:
        p.add_argument("-w", "--warmup", type=at_least(0), default=warmup, metavar="N",
                       help="untimed ops first (default %(default)s)")


def out_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="JSON", help="JSON result path (written by rank 0)")


def recorded(args: argparse.Namespace) -> dict:
    """The arguments as the JSON records them (the subcommand's function left out)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}
