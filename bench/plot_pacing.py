#!/usr/bin/env python3
"""Plot one run of bench/bench_vllm_pacing.py from its JSON file: the trade-off between decode
slowdown and update time at each pacing budget.

    python3 bench/plot_pacing.py bench_vllm_pacing.json [--out FILE.png]

Writes FILE.png (default: next to the JSON, same stem) with two panels:
  1. decode slowdown during the transfer (median, whiskers min-max over the measured updates)
     against the transfer time, one point per budget ("none": unpaced), with each budget's line
     and the goals (1.10x unpaced; 1.03x at budget 1.03 within 2x the unpaced time);
  2. the receiver's own view per budget: the step ratio it measured (UpdateReport.pacing) and the
     share of the window it had a bucket in flight (duty).
Stamped with the machine, date, commit, model and command. Needs matplotlib.
"""
import argparse
import json
import os
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def name(budget):
    return "none" if budget is None else f"{budget:.2f}"


def label(run, runs):
    """The budget, and the checksum setting where the file holds runs of both."""
    both = len({r.get("checksums", True) for r in runs}) > 1
    checksums = "" if not both else (" (checksums on)" if run.get("checksums", True)
                                     else " (checksums off)")
    return name(run["budget"]) + checksums


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("--out")
    args = p.parse_args()
    with open(args.results) as f:
        data = json.load(f)
    meta, runs = data["meta"], data["result"].get("runs", [])
    out = args.out or os.path.splitext(args.results)[0] + ".png"
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.5))

    unpaced_ms = next((r["median"]["transfer_ms"] for r in runs
                       if r["budget"] is None and r.get("checksums", True)), None)
    for r in runs:
        xs = [u["transfer_ms"] for u in r["updates"]]
        ys = [u["slowdown_transfer"] for u in r["updates"] if u["slowdown_transfer"] is not None]
        m = r["median"]
        if not ys or m["slowdown_transfer"] is None:
            continue
        ax1.errorbar([m["transfer_ms"]], [m["slowdown_transfer"]],
                     yerr=[[m["slowdown_transfer"] - min(ys)], [max(ys) - m["slowdown_transfer"]]],
                     xerr=[[m["transfer_ms"] - min(xs)], [max(xs) - m["transfer_ms"]]],
                     fmt="o" if r.get("checksums", True) else "s", capsize=3,
                     label=f"budget {label(r, runs)}")
        if r["budget"] is not None:
            ax1.axhline(r["budget"], linestyle=":", linewidth=0.8, color="grey")
    ax1.axhline(data["goals"]["unpaced_slowdown"], color="red", linewidth=0.8,
                label="goal unpaced: 1.10x")
    if unpaced_ms:
        ax1.axvline(2 * unpaced_ms, color="orange", linewidth=0.8,
                    label="2x unpaced time (goal at budget 1.03)")
    ax1.set_xscale("log")
    ax1.set_xlabel("transfer time, ms (publish → every byte acked; log)")
    ax1.set_ylabel("decode slowdown during the transfer (baseline tok/s / tok/s)")
    ax1.set_title("slowdown against update time, per budget")
    ax1.legend(fontsize=8)

    labels = [label(r, runs) for r in runs]
    ratios = [r["median"]["step_ratio"] or 0 for r in runs]
    duties = [r["median"]["duty"] or 0 for r in runs]
    xs = range(len(runs))
    ax2.bar([x - 0.2 for x in xs], ratios, width=0.4, label="receiver's step ratio (median)")
    ax2.bar([x + 0.2 for x in xs], duties, width=0.4, label="duty: share of time in flight")
    ax2.set_xticks(list(xs), labels, rotation=15, fontsize=8)
    ax2.set_xlabel("budget")
    ax2.set_title("what the receiver saw and did (UpdateReport.pacing)")
    ax2.legend(fontsize=8)

    stamp = (f"{meta['machine']} · {meta['date']} · commit {meta['commit']} · vLLM "
             f"{meta['vllm_version']} · {meta['config']}\n" + "\n".join(
                 textwrap.wrap(meta["command"], 160)))
    fig.text(0.01, 0.01, stamp, fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(out, dpi=110)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
