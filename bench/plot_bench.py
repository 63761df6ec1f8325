#!/usr/bin/env python3
"""Plot one run of the update benchmark (bench_gpu / bench_updates) from its JSON file.

    python3 bench/plot_bench.py RESULTS.json [--out FILE.png]

Writes FILE.png (default: next to the JSON, same stem) with three panels:
  1. engine stall per update vs model size (log scale): shadowsync's swap (host median and p99),
     copy-at-boundary's copy, the per-parameter baseline's whole update;
  2. transfer bandwidth vs model size: shadowsync (median, min-max), raw broadcast (link limit),
     the per-parameter baseline;
  3. the knob sweep, if it ran: decode slowdown during a transfer vs the bandwidth of each setting.
Every panel is stamped with the run's label, machine, date, commit and command. Needs matplotlib.
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="a bench-*.json file")
    parser.add_argument("--out", help="PNG path (default: the JSON's path with .png)")
    args = parser.parse_args()

    with open(args.results) as f:
        run = json.load(f)
    out = args.out or os.path.splitext(args.results)[0] + ".png"

    models = [m for m in run.get("models", []) if m.get("bytes")]
    models.sort(key=lambda m: m["bytes"])
    gb = [m["bytes"] / 1e9 for m in models]
    names = [m["name"] for m in models]
    label = run.get("label", "")
    cpu = run.get("mode") == "cpu"

    has_sweep = bool(get(run, "sweep", "rows"))
    fig, axes = plt.subplots(1, 3 if has_sweep else 2, figsize=(18 if has_sweep else 12, 5.8))

    # 1. Stall (log scale), milliseconds.
    ax = axes[0]

    def series(path, scale):
        xs, ys = [], []
        for x, m in zip(gb, models):
            v = get(m, *path)
            if v is not None:
                xs.append(x)
                ys.append(v * scale)
        return xs, ys

    for path, scale, style, text in [
        (("stall", "host_us", "median"), 1e-3, "o-", "shadowsync swap, host (median)"),
        (("stall", "host_us", "p99"), 1e-3, "o:", "shadowsync swap, host (p99)"),
        (("stall", "engine_stream_us", "median"), 1e-3, "x--", "shadowsync swap, engine stream (median)"),
        (("copy_at_boundary", "stall_ms", "median"), 1.0, "s-", "copy-at-boundary: copy (median)"),
        (("baseline", "stall_ms", "median"), 1.0, "^-", "per-parameter baseline: whole update (median)"),
    ]:
        xs, ys = series(path, scale)
        ys_pos = [(x, y) for x, y in zip(xs, ys) if y > 0]
        if ys_pos:
            ax.plot([p[0] for p in ys_pos], [p[1] for p in ys_pos], style, label=text)
    ax.set_yscale("log")
    ax.set_xlabel("weights per update (GB)")
    ax.set_ylabel("engine stall per update (ms, log)")
    ax.set_title("Engine stall per update")
    for x, name in zip(gb, names):
        ax.axvline(x, color="0.9", zorder=0)
        ax.annotate(name, (x, 1), xycoords=("data", "axes fraction"), rotation=90, va="top", ha="right", fontsize=7, color="0.5")
    ax.legend(fontsize=7, loc="center right")
    ax.grid(True, which="both", alpha=0.3)

    # 2. Bandwidth.
    ax = axes[1]
    xs, med = series(("transfer", "gbps", "median"), 1.0)
    _, lo = series(("transfer", "gbps", "min"), 1.0)
    _, hi = series(("transfer", "gbps", "max"), 1.0)
    if xs:
        ax.errorbar(xs, med, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]], fmt="o-",
                    capsize=3, label="shadowsync (bytes / UpdateReport.transfer; median, min-max)")
    for path, style, text in [
        (("transfer", "raw", "stream_gbps", "median"), "s--", "raw broadcast, stream-timed (link limit)"),
        (("transfer", "raw", "host_gbps", "median"), "s:", "raw broadcast, host-observed"),
        (("baseline", "gbps"), "^-", "per-parameter baseline"),
        (("copy_at_boundary", "background_receive_gbps"), "d-", "copy-at-boundary: background receive"),
    ]:
        bx, by = series(path, 1.0)
        if bx:
            ax.plot(bx, by, style, label=text)
    ax.set_xlabel("weights per update (GB)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Transfer bandwidth")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, alpha=0.3)

    # 3. Sweep: slowdown vs bandwidth.
    if has_sweep:
        ax = axes[2]
        markers = {"default": "*", "bucket": "o", "max_ctas": "s", "engine_priority": "D"}
        for row in run["sweep"]["rows"]:
            ratio = get(row, "decode", "ratio_median")
            bw = get(row, "idle_gbps", "median") or get(row, "decode", "transfer_gbps_while_decoding", "median")
            if ratio is None or bw is None:
                continue
            b = row["bucket_bytes"]
            size = f"{b >> 20} MiB" if b >= 1 << 20 else f"{b >> 10} KiB"
            tag = {
                "default": f"default ({size}, NCCL CTAs)",
                "bucket": size,
                "max_ctas": f"{row['max_ctas']} CTAs",
                "engine_priority": "engine priority raised",
            }.get(row["knob"], row["knob"])
            ax.plot([bw], [ratio], markers.get(row["knob"], "o"), markersize=9 if row["knob"] == "default" else 6)
            ax.annotate(tag, (bw, ratio), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.axhline(1.10, color="r", linestyle="--", linewidth=0.8, label="goal: 1.10x")
        ax.set_xlabel("transfer GB/s (engine idle; priority row: while decoding)")
        ax.set_ylabel("decode step during transfer / alone (median)")
        ax.set_title(f"Knob sweep ({get(run, 'sweep', 'model')})")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)

    title = f"shadowsync update benchmark: {label}"
    if cpu:
        title += " (HostBackend + loopback; miniature models)"
    fig.suptitle(title, fontsize=12, fontweight="bold", color="darkred" if cpu else "black")
    stamp = (f"machine: {run.get('machine')}   date: {run.get('date')}   commit: {run.get('commit')}   "
             f"elapsed: {run.get('elapsed_s', 0):.0f} s   complete: {run.get('complete')}\n"
             + "\n".join(textwrap.wrap("command: " + str(run.get("command")), 200)))
    fig.text(0.01, 0.01, stamp, fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(out, dpi=130)
    print(f"plot_bench: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
