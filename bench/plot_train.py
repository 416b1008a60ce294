"""Bar chart (PNG) of bench/train.py results: median tokens/s per GPU per mode, with MFU and the gain over
`compile` on each bar. Runs anywhere matplotlib is installed (the GPU box may not have it).

    python bench/plot_train.py bench/results/train-8l.json [more.json ...] -o bench/results/train.png
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="JSON files written by bench/train.py --out")
    p.add_argument("-o", "--output", required=True, help="PNG to write")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in args.results:
        with open(path) as f:
            runs.append(json.load(f))
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.6), squeeze=False)
    for ax, run in zip(axes[0], runs):
        ok = [r for r in run["results"] if r["ok"]]
        base = next((r for r in ok if r["mode"] == "compile"), None)
        names = [r["mode"] for r in ok]
        tps = [r["tps"] for r in ok]
        colors = ["#888888" if m == "no-comm" else "#2b7bba" if m.startswith("ce_overlap") else "#bbbbbb"
                  for m in names]
        bars = ax.bar(range(len(ok)), tps, color=colors)
        for bar, r in zip(bars, ok):
            label = f"{r['mfu']:.1f}% MFU"
            if base and r is not base:
                label += f"\n{100 * (r['tps'] / base['tps'] - 1):+.1f}%"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(ok)), names, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s per GPU (median)")
        m, info = run["model"], run["info"]
        ax.set_title(f"{m['n_layers']} layers, dim {m['dim']}, seq {m['seq_len']}\n"
                     f"{info['world_size']}x {info['gpu']}, torch {info['torch']}", fontsize=9)
        ax.set_ylim(0, max(tps) * 1.18)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
