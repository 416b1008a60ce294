"""Where a sampled step spends its time inside Inductor's compiled wrappers: py-spy's raw output (`py-spy record
--format raw`, with `--idle` for wall-clock time) read back, the samples whose stack holds a compiled wrapper's `call`
(Inductor's generated module: `c` and 51 letters or digits, `.py`; py-spy names the frame `call` or `Runner.call`
and prints the module's base name) tallied by wrapper file, by wrapper line (with its source, where the generated
module is found), by the function that line called and by the innermost frame. Samples of a compile (the wrapper not
on the stack) do not count. No GPU; on the device, run it there (a raw file of a whole run is hundreds of MB).

    py-spy record --idle --subprocesses --rate 1000 --format raw -o w2.spy -- \\
        python3 bench/compute_models.py --models gpt2-1536-host --host-bound --world 2 ...
    python3 bench/wrapper_profile.py w2.spy [--sources '/tmp/torchinductor_*/*/*.py'] [--top 45]
"""
from __future__ import annotations

import argparse
import collections
import glob
import linecache
import re
import sys

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")
WRAPPER = re.compile(r"^c[a-z0-9]{51}\.py$")
TABLES = ("by wrapper file", "by wrapper line", "by callee", "by innermost frame")


def tally(lines) -> tuple[int, int, dict[str, collections.Counter]]:
    """(samples, samples inside a wrapper's call, the four tables) from py-spy raw lines ("f1;f2;... count")."""
    total = inside = 0
    tables = {t: collections.Counter() for t in TABLES}
    for raw in lines:
        stack, _, count = raw.rstrip("\n").rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        at = None
        for i, frame in enumerate(frames):  # the innermost wrapper frame
            m = FRAME.match(frame)
            if m and m["func"].split(".")[-1] == "call" and WRAPPER.match(m["file"].rsplit("/", 1)[-1]):
                at, where = i, m
        if at is None:
            continue
        inside += n
        name = where["file"].rsplit("/", 1)[-1]
        tables["by wrapper file"][name] += n
        tables["by wrapper line"][f"{name}:{where['line']}"] += n
        tables["by callee"][frames[at + 1] if at + 1 < len(frames) else "(the line itself)"] += n
        tables["by innermost frame"][frames[-1]] += n
    return total, inside, tables


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw", help="py-spy's raw output (--format raw)")
    p.add_argument("--sources", default="/tmp/torchinductor_*/*/*.py",
                   help="where the generated modules are, a glob (default: Inductor's cache under /tmp)")
    p.add_argument("--top", type=int, default=45, help="rows per table (default 45)")
    args = p.parse_args(argv)
    with open(args.raw, errors="replace") as f:
        total, inside, tables = tally(f)
    sources = {path.rsplit("/", 1)[-1]: path for path in glob.glob(args.sources)}
    print(f"{args.raw}: {total} samples, {inside} inside a compiled wrapper's call()")
    for title in TABLES:
        print(f"== {title}")
        for key, n in tables[title].most_common(args.top):
            text = ""
            if title == "by wrapper line":
                name, _, line = key.rpartition(":")
                text = f"   | {linecache.getline(sources[name], int(line)).strip()[:110]}" if name in sources else ""
            print(f"{n:9d} {100.0 * n / max(inside, 1):6.2f}%  {key}{text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
