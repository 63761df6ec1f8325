#!/usr/bin/env python3
"""Plot runs of bench/bench_vllm_update.py from their JSON files: per measured update, how long
generation stood still (engine stop) and how much the decode slowed during the update, for each
path, against the goals.

    python3 bench/plot_vllm_update.py RUN.json [RUN2.json ...] [--label A --label B] [--out FILE.png]

Writes FILE.png (default: next to the first JSON, same stem) with two panels, one point per
update (a path's median as a bar across its points):
  1. engine stop, ms (log scale), with the 1 ms goal at 8B and vLLM's reported reference;
  2. decode slowdown during the update (baseline tokens/s over tokens/s), with the 1.10x goal.
Each run is named by --label (default: its commit) and stamped with its machine, date, commit and
command. Needs matplotlib.
"""
import argparse
import json
import os
import statistics
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(data: dict, label: str):
    """(name, engine stops, slowdowns) per path and config of one run."""
    for config, paths in data["configs"].items():
        for path, result in paths.items():
            updates = result.get("updates") if isinstance(result, dict) else None
            if not updates:
                continue
            name = f"{label}: {path}" + (f" ({config})" if len(data["configs"]) > 1 else "")
            yield (name, [u.get("engine_stop_ms") for u in updates],
                   [u.get("slowdown") for u in updates])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--label", action="append", default=[], help="one per results file, in order")
    p.add_argument("--out")
    args = p.parse_args()
    if args.label and len(args.label) != len(args.results):
        p.error(f"--label given {len(args.label)} times for {len(args.results)} results files")
    runs = []
    for i, file in enumerate(args.results):
        with open(file) as f:
            data = json.load(f)
        runs.append((args.label[i] if args.label else data["meta"]["commit"], data))
    out = args.out or os.path.splitext(args.results[0])[0] + ".png"
    fig, (stop_ax, slow_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    x = 0
    ticks, names = [], []
    for label, data in runs:
        for name, stops, slowdowns in series(data, label):
            xs = [x + 0.6 * (i / max(1, len(stops) - 1) - 0.5) for i in range(len(stops))]
            for ax, ys in ((stop_ax, stops), (slow_ax, slowdowns)):
                shown = [(a, b) for a, b in zip(xs, ys) if b is not None]
                ax.plot([a for a, _ in shown], [max(b, 1e-3) for _, b in shown], "o", alpha=0.7)
                if shown:
                    median = statistics.median(b for _, b in shown)
                    ax.hlines(max(median, 1e-3), x - 0.35, x + 0.35, color="black", linewidth=2)
            ticks.append(x)
            names.append(name)
            x += 1
    goals = runs[0][1]["goals"]
    stop_ax.axhline(goals["engine_stop_ms"], color="red", linewidth=0.8,
                    label=f"goal at 8B: ≤ {goals['engine_stop_ms']:g} ms")
    reference = runs[0][1].get("vllm_reference_stop_ms", {})
    for config, ms in reference.items():
        if any(config in data["configs"] for _, data in runs):
            stop_ax.axhline(ms, color="grey", linestyle=":", linewidth=0.8,
                            label=f"vLLM's reported stop, {config}: {ms:g} ms")
    stop_ax.set_yscale("log")
    stop_ax.set_ylabel("engine stop per update, ms (log; 0 drawn at 0.001)")
    stop_ax.set_title("how long generation stood still (bar: median)")
    slow_ax.axhline(goals["slowdown"], color="red", linewidth=0.8,
                    label=f"goal: ≤ {goals['slowdown']:g}x")
    slow_ax.set_yscale("log")
    slow_ax.set_ylabel("decode slowdown during the update (log)")
    slow_ax.set_title("baseline tok/s over tok/s during the update (bar: median)")
    for ax in (stop_ax, slow_ax):
        ax.set_xticks(ticks, names, rotation=12, fontsize=8)
        ax.legend(fontsize=8)
    lines = []
    for label, d in runs:
        lines.append(f"{label}: {d['meta']['machine']} · {d['meta']['date']} · commit "
                     f"{d['meta']['commit']} · vLLM {d['meta']['vllm_version']}")
        lines += textwrap.wrap(d["meta"]["command"], 220, initial_indent="    ",
                               subsequent_indent="    ")
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.03 + 0.022 * len(lines), 1, 1))
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
