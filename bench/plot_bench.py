#!/usr/bin/env python3
"""Plot one run of the update benchmark (bench_gpu / bench_updates) from its JSON file.

    python3 bench/plot_bench.py RESULTS.json [--out FILE.png]

Writes FILE.png (default: next to the JSON, same stem) with six panels in two rows:
  1. engine stall per update vs model size (log scale): shadowsync's swap (host median and p99),
     copy-at-boundary's copy, the per-parameter baseline's whole update;
  2. transfer bandwidth vs model size: shadowsync (median, min-max), raw broadcast (link limit),
     the per-parameter baseline;
  3. the knob sweep, if it ran: decode slowdown during a transfer vs the bandwidth of each setting;
  4. swap strategies vs model size (log scale): rebind (host), copy_in (engine stream) next to the
     raw device copy of the same bytes, remap (host), with the 1 ms remap goal;
  5. integrity cost: transfer time with checksums and with the non-finite guard, in % over the
     plain transfer, per model, with the 5 % line;
  6. sender fault to engine report, per variant (median, min-max), with the bucket deadline.
A panel with nothing to show says so. Every figure is stamped with the run's label, machine, date,
commit and command. Needs matplotlib.
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
    fig, grid = plt.subplots(2, 3, figsize=(18, 11))
    axes = list(grid[0]) + list(grid[1])

    def nothing(ax, title, why):
        ax.set_title(title)
        ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="0.4")
        ax.set_xticks([])
        ax.set_yticks([])

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
    else:
        nothing(axes[2], "Knob sweep", "not run")

    # 4. Swap strategies (log scale), milliseconds.
    ax = axes[3]
    drawn = False
    for path, scale, style, text in [
        (("stall", "host_us", "median"), 1e-3, "o-", "rebind: host (median)"),
        (("stall", "copy_in", "engine_stream_us", "median"), 1e-3, "s-", "copy_in: engine stream (median)"),
        (("stall", "raw_device_copy_ms", "median"), 1.0, "k:", "raw device copy, same bytes (median)"),
        (("stall", "copy_in", "host_us", "median"), 1e-3, "s:", "copy_in: host (median)"),
        (("stall", "remap", "host_us", "median"), 1e-3, "D-", "remap: host (median)"),
    ]:
        xs, ys = series(path, scale)
        pts = [(x, y) for x, y in zip(xs, ys) if y > 0]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=text)
            drawn = True
    if drawn:
        ax.axhline(1.0, color="r", linestyle="--", linewidth=0.8, label="remap goal: 1 ms at 14 GiB")
        ax.set_yscale("log")
        ax.set_xlabel("weights per update (GB)")
        ax.set_ylabel("stall per swap (ms, log)")
        unavailable = next((get(m, "stall", "remap_unavailable") for m in models
                            if get(m, "stall", "remap_unavailable")), None)
        ax.set_title("Swap strategies" + (" (remap not available)" if unavailable else ""))
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, which="both", alpha=0.3)
    else:
        nothing(ax, "Swap strategies", "not measured")

    # 5. Integrity cost, % over the plain transfer.
    ax = axes[4]
    pairs = [(m["name"], get(m, "integrity", "checksums", "overhead_fraction"),
              get(m, "integrity", "nonfinite_guard", "overhead_fraction")) for m in models]
    pairs = [p for p in pairs if p[1] is not None or p[2] is not None]
    if pairs:
        xs = range(len(pairs))
        width = 0.38
        ax.bar([x - width / 2 for x in xs], [100 * (p[1] or 0) for p in pairs], width, label="checksums")
        ax.bar([x + width / 2 for x in xs], [100 * (p[2] or 0) for p in pairs], width, label="non-finite guard")
        ax.axhline(5, color="r", linestyle="--", linewidth=0.8, label="5 %: default on below")
        ax.axhline(0, color="0.3", linewidth=0.6)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([p[0] for p in pairs], fontsize=8)
        ax.set_ylabel("transfer time over plain (%, median)")
        ax.set_title("Integrity cost")
        ax.legend(fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
    else:
        nothing(ax, "Integrity cost", "not measured")

    # 6. Sender fault to engine report.
    ax = axes[5]
    fault = run.get("sender_fault") or {}
    variants = [v for v in fault.get("variants", []) if get(v, "report_ms", "n")]
    if variants:
        xs = range(len(variants))
        med = [v["report_ms"]["median"] for v in variants]
        lo = [v["report_ms"]["min"] for v in variants]
        hi = [v["report_ms"]["max"] for v in variants]
        ax.bar(list(xs), med, 0.5, yerr=[[m - l for m, l in zip(med, lo)], [h - m for m, h in zip(med, hi)]],
               capsize=4, color="tab:purple")
        for x, m in zip(xs, med):  # a report within a poll interval would be an invisible bar
            ax.annotate(f"{m:.1f} ms", (x, m), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
        ax.axhline(fault["bucket_deadline_ms"], color="r", linestyle="--", linewidth=0.8,
                   label=f"bucket deadline {fault['bucket_deadline_ms']:.0f} ms "
                         f"(poll {fault['poll_interval_us']:.0f} us)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{v['variant']} (n={v['report_ms']['n']}, recovered {v['recovered']}/{v['reps']})"
                            for v in variants], fontsize=8)
        ax.set_ylabel("sender stops -> receiver's failure report (ms)")
        ax.set_title(f"Sender fault to engine report ({fault.get('model')})")
        ax.legend(fontsize=7, loc="center right")
        ax.grid(True, axis="y", alpha=0.3)
    else:
        nothing(ax, "Sender fault to engine report", "not measured")

    title = f"shadowsync update benchmark: {label}"
    if cpu:
        title += " (HostBackend + loopback; miniature models)"
    fig.suptitle(title, fontsize=12, fontweight="bold", color="darkred" if cpu else "black")
    stamp = (f"machine: {run.get('machine')}   date: {run.get('date')}   commit: {run.get('commit')}   "
             f"elapsed: {run.get('elapsed_s', 0):.0f} s   complete: {run.get('complete')}\n"
             + "\n".join(textwrap.wrap("command: " + str(run.get("command")), 200)))
    fig.text(0.01, 0.01, stamp, fontsize=7, family="monospace", va="bottom")
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(out, dpi=130)
    print(f"plot_bench: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
