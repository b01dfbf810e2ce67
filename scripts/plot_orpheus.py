#!/usr/bin/env python
"""Plots `scripts/bench_orpheus.py` results: per concurrency, audio seconds per second, RTF p50, first audio p50
and the streams that played without a gap, one series per label (matplotlib, the `bench` extra). Points more
than 4x apart in concurrency are not joined: nothing was measured between them.

    python scripts/plot_orpheus.py --out docs/img/orpheus_3b.png \
        "BLS hop=docs/results/orpheus_served_h200.json" "HF generate + snac=docs/results/orpheus_baseline.json"

A label may repeat: its files' rows are merged (a later file's row wins at the same concurrency).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path


def load(series: list[str]) -> dict[str, dict[int, dict]]:
    """`label=path` arguments -> {label: {concurrency: result row}}, in argument order."""
    lines: dict[str, dict[int, dict]] = {}
    for item in series:
        label, sep, path = item.rpartition("=")
        if not sep or not label:
            raise SystemExit(f"expected LABEL=PATH, got {item!r}")
        for row in json.loads(Path(path).read_text())["results"]:
            lines.setdefault(label, {})[int(row["concurrency"])] = row
    return lines


def plot(lines: dict[str, dict[int, dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("audio_s_per_s", "audio seconds per second", None),
              ("rtf_p50", "RTF p50 (below 1: faster than real time)", 1.0),
              ("first_audio_p50_ms", "first audio p50 (ms)", None),
              ("streams_real_time", "streams without a playback gap", "diagonal")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    top = max(c for rows in lines.values() for c in rows)
    for ax, (key, label, guide) in zip(axes.flat, panels, strict=True):
        for index, (name, rows) in enumerate(lines.items()):
            xs = sorted(rows)
            color = f"C{index}"
            ax.plot(xs, [rows[c][key] for c in xs], marker="o", linestyle="none", color=color, label=name)
            for a, b in itertools.pairwise(xs):  # no line across an unmeasured stretch (more than 4x in concurrency)
                if b <= 4 * a:
                    ax.plot([a, b], [rows[a][key], rows[b][key]], color=color)
        if guide == "diagonal":
            ax.plot([1, top], [1, top], color="grey", linestyle=":", label="every stream")
        elif guide is not None:
            ax.axhline(guide, color="grey", linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("series", nargs="+", help="LABEL=PATH of a bench_orpheus.py JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--title", default="Orpheus 3B + SNAC 24 kHz, 1,200 audio tokens per stream")
    args = parser.parse_args(argv)
    plot(load(args.series), args.out, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
