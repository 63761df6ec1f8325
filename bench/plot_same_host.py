#!/usr/bin/env python3
"""Plot one run of the same-host benchmark (bench_same_host_one_gpu) from its JSON file.

    python3 bench/plot_same_host.py RESULTS.json [--out FILE.png]

Writes FILE.png (default: next to the JSON, same stem) with four panels:
  1. transfer GB/s against model size: the raw device copy, the transport alone and the update
     end to end (median, whiskers min-max), with the goals' lines (0.90 x raw for the transport,
     0.90 x half of raw for end to end: it copies every byte twice on one GPU);
  2. engine stall per swap (rebind): host median and p99, engine-stream median (log scale);
  3. decode step per model: alone, during real updates, during a copy-engine copy and during an
     SM-kernel copy of the same bytes (median bars, p99 ticks, x over alone written on top);
  4. extra device memory per side: the trainer's (connection + Sender) against two staging slots,
     the engine's beyond the live weights against the shadow.
A panel with nothing to show says so. The figure is stamped with the label, machine, date, commit
and command, and names the models whose trainer tensors were shared (one buffer). Needs
matplotlib.
"""
import argparse
import json
import os
import sys
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def get(d, *path):
    for key in path:
        if d is None:
            return None
        d = d.get(key) if isinstance(d, dict) else None
    return d


def nothing(ax, title, why):
    ax.set_title(title)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a bench-same-host-*.json file")
    parser.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    args = parser.parse_args()

    with open(args.results) as f:
        run = json.load(f)
    if run.get("schema") != "shadowsync-bench-same-host/1":
        print(f"plot_same_host: {args.results}: schema {run.get('schema')!r}, expected "
              "'shadowsync-bench-same-host/1'", file=sys.stderr)
        return 2
    out = args.out or os.path.splitext(args.results)[0] + ".png"

    models = sorted((m for m in run.get("models", []) if m.get("bytes")), key=lambda m: m["bytes"])
    fig, grid = plt.subplots(2, 2, figsize=(15, 11))
    axes = [grid[0][0], grid[0][1], grid[1][0], grid[1][1]]

    # 1. Transfer GB/s.
    ax = axes[0]
    measured = [m for m in models if get(m, "raw_copy", "gbps", "median")]
    if measured:
        xs = [m["bytes"] / 1e9 for m in measured]
        for path, style, text in [
            (("raw_copy", "gbps"), "s--", "raw device copy (cudaMemcpyAsync, same bytes)"),
            (("transport", "gbps"), "o-", "transport alone (staging slots -> buffer)"),
            (("end_to_end", "gbps"), "^-", "end to end (trainer tensors -> staging -> shadow)"),
        ]:
            pts = [(x, get(m, *path)) for x, m in zip(xs, measured) if get(m, *path, "median")]
            if not pts:
                continue
            med = [p[1]["median"] for p in pts]
            lo = [p[1]["min"] for p in pts]
            hi = [p[1]["max"] for p in pts]
            ax.errorbar([p[0] for p in pts], med, yerr=[[a - b for a, b in zip(med, lo)], [c - a for a, c in zip(med, hi)]],
                        fmt=style, capsize=3, label=text)
        raw = [m["raw_copy"]["gbps"]["median"] for m in measured]
        ax.plot(xs, [0.9 * r for r in raw], ":", color="tab:red", linewidth=1, label="goal: transport >= 0.90 x raw")
        ax.plot(xs, [0.45 * r for r in raw], ":", color="tab:purple", linewidth=1,
                label="goal: end to end >= 0.90 x raw / 2 (two copies)")
        for x, m in zip(xs, measured):
            if get(m, "sources", "mode") == "shared":
                ax.annotate("shared sources", (x, 1), xycoords=("data", "axes fraction"), xytext=(0, -10),
                            textcoords="offset points", ha="center", fontsize=7, color="0.4")
        ax.set_xlabel("weights per update (GB)")
        ax.set_ylabel("GB/s (median; min-max)")
        ax.set_ylim(bottom=0)
        ax.set_title("Transfer over the same-host transport (device memory)")
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(True, alpha=0.3)
    else:
        nothing(ax, "Transfer", "not measured")

    # 2. Stall per swap.
    ax = axes[1]
    stalled = [m for m in models if get(m, "stall", "host_us", "n")]
    if stalled:
        xs = range(len(stalled))
        width = 0.27
        series = [
            ("host_us", "median", "host, median"),
            ("host_us", "p99", "host, p99"),
            ("engine_stream_us", "median", "engine stream, median"),
        ]
        for i, (key, stat, text) in enumerate(series):
            ys = [max(get(m, "stall", key, stat) or 0, 1e-3) for m in stalled]
            bars = ax.bar([x + (i - 1) * width for x in xs], ys, width, label=text)
            for b, y in zip(bars, ys):
                ax.annotate(f"{y:.1f}", (b.get_x() + b.get_width() / 2, y), textcoords="offset points",
                            xytext=(0, 2), ha="center", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{m['name']}\n(n={m['stall']['host_us']['n']})" for m in stalled], fontsize=8)
        ax.set_ylabel("us per swap (log)")
        ax.set_title("Engine stall per swap (rebind, StepHook::before_step)")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    else:
        nothing(ax, "Engine stall per swap", "not measured")

    # 3. Decode step.
    ax = axes[2]
    decoded = [m for m in models if get(m, "decode", "rows")]
    if decoded:
        variants = []
        for m in decoded:
            for row in m["decode"]["rows"]:
                if row["variant"] not in variants:
                    variants.append(row["variant"])
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            xs, med, p99, ratio = [], [], [], []
            for j, m in enumerate(decoded):
                row = next((r for r in m["decode"]["rows"] if r["variant"] == variant), None)
                if row is None or not get(row, "ms", "n"):
                    continue
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                med.append(row["ms"]["median"])
                p99.append(row["ms"]["p99"])
                ratio.append(row.get("ratio_median"))
            bars = ax.bar(xs, med, width, label=variant)
            ax.plot(xs, p99, "_", color="k", markersize=10)
            for b, y, r in zip(bars, med, ratio):
                if r is not None:
                    ax.annotate(f"{r:.2f}x", (b.get_x() + b.get_width() / 2, y), textcoords="offset points",
                                xytext=(0, 2), ha="center", fontsize=7)
        ax.plot([], [], "_", color="k", markersize=10, label="p99")
        ax.set_xticks(list(range(len(decoded))))
        ax.set_xticklabels([f"{m['name']}\n(reads {m['decode']['bytes'] / 1e9:.2f} GB)" for m in decoded], fontsize=8)
        ax.set_ylabel("decode step (ms, median; x = over alone)")
        ax.set_title("Decode step while an update is received")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    else:
        nothing(ax, "Decode step", "not measured")

    # 4. Extra memory.
    ax = axes[3]
    measured = [m for m in models if get(m, "memory", "slot_bytes")]
    if measured:
        xs = range(len(measured))
        width = 0.2
        groups = [
            ([m["memory"]["trainer_extra_bytes"] / 1e9 for m in measured], "trainer: connection + Sender"),
            ([2 * m["memory"]["slot_bytes"] / 1e9 for m in measured], "goal: two staging slots"),
            ([m["memory"]["engine_beyond_live_bytes"] / 1e9 for m in measured], "engine: beyond the live weights"),
            ([m["bytes"] / 1e9 for m in measured], "goal: the shadow (model bytes)"),
        ]
        for i, (ys, text) in enumerate(groups):
            hatch = "//" if text.startswith("goal") else None
            bars = ax.bar([x + (i - 1.5) * width for x in xs], ys, width, label=text, hatch=hatch,
                          alpha=0.6 if hatch else 1.0)
            for b, y in zip(bars, ys):
                ax.annotate(f"{y:.2f}", (b.get_x() + b.get_width() / 2, y), textcoords="offset points",
                            xytext=(0, 2), ha="center", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([m["name"] for m in measured], fontsize=8)
        ax.set_ylabel("GB (cudaMemGetInfo deltas)")
        ax.set_title("Extra device memory per side")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    else:
        nothing(ax, "Extra device memory", "not measured")

    fig.suptitle(f"shadowsync same-host transport, device memory: {run.get('label', '')}", fontsize=12,
                 fontweight="bold")
    notes = [f"{m['name']}: {get(m, 'sources', 'note')}" for m in models if get(m, "sources", "note")]
    notes += [f"{m['name']}: FAILED: {m['error']}" for m in run.get("models", []) if m.get("error")]
    notes += [f"skipped: {s}" for s in run.get("skipped", [])]
    stamp = (f"machine: {run.get('machine')} ({run.get('device')})   date: {run.get('date')}   "
             f"commit: {run.get('commit')}   elapsed: {run.get('elapsed_s', 0):.0f} s   "
             f"complete: {run.get('complete')}\n"
             + "\n".join(textwrap.wrap("command: " + str(run.get("command")), 200))
             + "".join("\n" + line for note in notes for line in textwrap.wrap(note, 200)))
    fig.text(0.01, 0.01, stamp, fontsize=7, family="monospace", va="bottom")
    lines = stamp.count("\n") + 1
    fig.tight_layout(rect=(0, 0.02 + 0.012 * lines, 1, 0.96))
    fig.savefig(out, dpi=130)
    print(f"plot_same_host: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
