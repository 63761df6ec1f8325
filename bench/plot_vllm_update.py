#!/usr/bin/env python3
"""Plot runs of bench/bench_vllm_update.py from their JSON files: per measured update, how long
generation stood still (engine stop) and how much the decode slowed during the update, for each
path, against the goals.

    python3 bench/plot_vllm_update.py RUN.json [RUN2.json ...] [--label A --label B] [--out FILE.png]

Writes FILE.png (default: next to the first JSON, same stem) with two panels, one point per
update (a path's median as a bar across its points):
  1. engine stop, ms (log scale), with the 1 ms goal at 8B and vLLM's reported reference;
  2. decode slowdown during the update (baseline tokens/s over tokens/s), with the 1.10x goal;
and, where the runs record it (decode_lost_ms), a third:
  3. decode time lost per update, ms (update time x (1 - 1/slowdown)), with the median of the
     first run's copy path (the floor: --paths copy) and 1.3x it, where that run has one.
Every path of a run is drawn, the sharded trainers' (shadowsync-ranks-M) included. Each run is
named by --label (default: its commit) and stamped with its machine, date, commit (--commit, one
per file, names another where the run's stamp is wrong) and command. Needs matplotlib.
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
                   [u.get("slowdown") for u in updates],
                   [u.get("decode_lost_ms") for u in updates])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--label", action="append", default=[], help="one per results file, in order")
    p.add_argument("--commit", action="append", default=[],
                   help="one per results file, in order: the commit to stamp instead of the run's")
    p.add_argument("--out")
    args = p.parse_args()
    for flag in ("label", "commit"):
        given = getattr(args, flag)
        if given and len(given) != len(args.results):
            p.error(f"--{flag} given {len(given)} times for {len(args.results)} results files")
    runs = []
    for i, file in enumerate(args.results):
        with open(file) as f:
            data = json.load(f)
        commit = args.commit[i] if args.commit else data["meta"]["commit"]
        if commit != data["meta"]["commit"]:
            data["meta"]["commit"] = f"{commit} (the run's stamp: {data['meta']['commit']})"
        runs.append((args.label[i] if args.label else commit, data))
    out = args.out or os.path.splitext(args.results[0])[0] + ".png"
    with_lost = any(lost is not None for _, data in runs for *_, losts in series(data, "")
                    for lost in losts)
    fig, axes = plt.subplots(1, 3 if with_lost else 2, figsize=(19 if with_lost else 13, 5.5))
    stop_ax, slow_ax = axes[0], axes[1]
    lost_ax = axes[2] if with_lost else None
    x = 0
    ticks, names = [], []
    for label, data in runs:
        for name, stops, slowdowns, losts in series(data, label):
            xs = [x + 0.6 * (i / max(1, len(stops) - 1) - 0.5) for i in range(len(stops))]
            panels = [(stop_ax, stops), (slow_ax, slowdowns)]
            if lost_ax is not None:
                panels.append((lost_ax, losts))
            for ax, ys in panels:
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
    if lost_ax is not None:
        copy = next(iter(runs[0][1]["configs"].values()), {}).get("copy")
        floor = [u.get("decode_lost_ms") for u in (copy or {}).get("updates") or []]
        floor = [v for v in floor if v is not None]
        if floor:
            median = statistics.median(floor)
            lost_ax.axhline(median, color="grey", linestyle=":", linewidth=0.8,
                            label=f"copy path (the floor), median: {median:.2f} ms")
            lost_ax.axhline(1.3 * median, color="red", linewidth=0.8,
                            label=f"1.3x the floor: {1.3 * median:.2f} ms")
        lost_ax.set_ylim(bottom=0)
        lost_ax.set_ylabel("decode time lost per update, ms")
        lost_ax.set_title("update time x (1 - 1/slowdown) (bar: median)")
    for ax in axes:
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
