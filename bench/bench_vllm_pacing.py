#!/usr/bin/env python3
"""Decode speed of a real vLLM while weights stream in, unpaced and at pacing budgets
(ReceiverConfig.decode_slowdown_budget), and what each budget costs in update time.

    python3 bench/bench_vllm_pacing.py --config llama-3-8b                      # one GPU
    python3 bench/bench_vllm_pacing.py --device cpu --config tiny --requests 4 --max-tokens 64

Outputs ``bench_vllm_pacing.json`` and ``bench_vllm_pacing.md`` in --out (default ``$OUT``, else
./bench-vllm-pacing), every figure with the command, the machine, the commit and vLLM's version;
``bench/plot_pacing.py`` draws the trade-off (slowdown against update time) from the JSON.

**Set-up** (shared with bench/bench_vllm_update.py, whose pieces in bench/vllm_update/ this
imports): random weights at the real shapes of the config, one vLLM ``AsyncLLM`` with the worker
extension (CUDA graphs on: copy_in into vLLM's own storage), the trainer in its own process on the
same GPU sending over the same-host transport, a steady decode load of ``--requests`` requests. For
each budget in ``--budgets`` (``none`` = no pacing) the engine's update group is re-initialized
with that budget (close_weight_update_group, then
init_weight_update_group(decode_slowdown_budget=...); vLLM keeps its weights and graphs), one
warm-up update lets the receiver learn its pacing, then a baseline window without updates and
``--updates`` measured updates ``--gap-s`` apart.

**Figures per update.** *Transfer window*: from the trainer being asked to publish to its last byte
acked (every bucket received); *tokens/s during the transfer*: the decode rate integrated over that
window (vllm_update/decode_load.py: DecodeLoad.rate); *slowdown* = the baseline's tokens/s over it;
the receiver's own view: UpdateReport.pacing (idle step, step during, step ratio, held back, duty)
from weight_update_stats()["pacing"]; *update time*: the transfer window, and the whole update up
to the swap. Median over the measured updates.

``--checksums on|off|both``: every budget with the trainer's per-bucket checksums on (the
default), off, or both in turn. ``--trace-steps``: every engine step traced
(bench/vllm_step_trace.py), and per update the mean step of the baseline window, of the gap
before it, of the 32 steps before it and before begin_update, and during it, beside the
receiver's own idle and during means.

Goals: slowdown ≤ 1.10x with no budget; ≤ 1.03x at budget 1.03, for at most 2x the unpaced
update time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_update.child import engine_args  # noqa: E402
from vllm_update.configs import CONFIGS  # noqa: E402
from vllm_update.decode_load import DecodeLoad  # noqa: E402
from vllm_update.paths import BENCH_DIR, PYTHON_DIR, prepend_pythonpath  # noqa: E402
from vllm_update.shadowsync_transfer import ShadowsyncTransfer  # noqa: E402

from run_children import run_logged, tail  # noqa: E402  (on sys.path through vllm_update)
from run_report import fmt_ms, log, run_stamp, stamp_lines, write_report  # noqa: E402

# bench_vllm_update.py --make-checkpoint makes the model this benchmark's engine loads.
CHECKPOINT_MAKER = BENCH_DIR / "bench_vllm_update.py"

# --trace-steps: the most steps the receiver's step ring gives the Pacer for its baseline
# (StepTimes::kMaxIntervals).
RING_STEPS = 32

# --checksums: which SenderConfig.checksums settings to run every budget with, in order.
CHECKSUM_SERIES = {"on": (True,), "off": (False,), "both": (True, False)}

GOALS = {"unpaced_slowdown": 1.10, "budget_1.03_slowdown": 1.03, "budget_1.03_time_factor": 2.0}


def parse_budgets(text: str) -> list[float | None]:
    budgets: list[float | None] = []
    for item in text.split(","):
        item = item.strip().lower()
        if not item:
            continue
        budgets.append(None if item == "none" else float(item))
    return budgets


def budget_name(budget: float | None) -> str:
    return "none" if budget is None else f"{budget:.2f}"


async def run_child(args, result: dict) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    t0 = time.monotonic()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(args, extension=True)))
    result["engine_start_s"] = round(time.monotonic() - t0, 1)
    log(f"engine up in {result['engine_start_s']} s")
    transfer = ShadowsyncTransfer(args)
    version = 0
    try:
        load = DecodeLoad(engine, args)
        runs = result["runs"] = []
        series = [(checksums, budget) for checksums in CHECKSUM_SERIES[args.checksums]
                  for budget in parse_budgets(args.budgets)]
        for index, (checksums, budget) in enumerate(series):
            extra = {} if budget is None else {"decode_slowdown_budget": budget}
            if index == 0:
                result["setup"] = await transfer.setup(engine, init_extra=extra,
                                                       checksums=checksums)
            else:
                seconds = await transfer.reinitialize(engine, init_extra=extra,
                                                      checksums=checksums)
                log(f"budget {budget_name(budget)}, checksums {checksums}: group "
                        f"re-initialized in {seconds:.1f} s")

            async def update(v: int) -> dict:
                info = await transfer.update(engine, v)
                stats = (await engine.collective_rpc("weight_update_stats"))[0]
                info["pacing"] = stats.get("pacing")
                info["receiver_transfer_s"] = stats.get("last_transfer_s")
                # time.monotonic, the tracer's clock (--trace-steps)
                info["begin_update_started_s"] = stats.get("last_begin_update_started_s")
                return info

            version += 1
            warm = await update(version)
            log(f"budget {budget_name(budget)}: warm-up update {fmt_ms(warm['update_ms'])}")
            measured = await load.measure(update, first_version=version + 1)
            version += args.updates
            runs.append(summarize(load, budget, measured, checksums))
            if args.trace_steps:
                runs[-1]["steps"] = await traced_steps(engine, measured)
                log(f"budget {budget_name(budget)}: traced steps {one_trace_line(runs[-1])}")
            log(f"budget {budget_name(budget)}: {one_line(runs[-1])}")
        await transfer.close(engine)
    finally:
        engine.shutdown()
        transfer.shutdown()


async def traced_steps(engine, measured: dict) -> dict:
    """--trace-steps: the engine's steps (bench/vllm_step_trace.py) from the baseline window to
    the last update, and per window the mean step as the step hook's clock sees it, next to what
    the receiver's pacing reported and the clients' tokens/s say."""
    import vllm_step_trace

    # perf_counter (the bench's stamps) and time.monotonic (the tracer's) differ by an offset.
    offset = time.perf_counter() - time.monotonic()
    base = measured["baseline"]
    since, until = base["started_at"] - offset, measured["updates"][-1]["sent_at"] - offset + 0.2
    rows = (await engine.collective_rpc(vllm_step_trace.collect, args=(since, until)))[0]
    starts = [r[0] for r in rows]
    # A step's length on the host: from its start to the next step's start (what the step hook
    # measures), with its GPU time (start -> end of its forward) beside it.
    steps = [(starts[i], starts[i + 1] - starts[i], rows[i][2]) for i in range(len(rows) - 1)]

    def window(t0: float, t1: float) -> dict:
        inside = [(length, gpu) for start, length, gpu in steps if t0 <= start and start + length <= t1]
        if not inside:
            return dict(steps=0)
        return dict(steps=len(inside),
                    mean_ms=round(1e3 * statistics.fmean(x[0] for x in inside), 3),
                    median_ms=round(1e3 * statistics.median(x[0] for x in inside), 3),
                    gpu_mean_ms=(round(statistics.fmean(x[1] for x in inside), 3)
                                 if all(x[1] is not None for x in inside) else None))

    def last_32(until: float | None) -> dict:
        """The newest RING_STEPS steps that ended by `until`: what the receiver's ring holds."""
        if until is None:
            return dict(steps=0, mean_ms=None)
        before = [st for st in steps if st[0] + st[1] <= until][-RING_STEPS:]
        return dict(steps=len(before), mean_ms=round(
            1e3 * statistics.fmean(x[1] for x in before), 3) if before else None)

    result = dict(baseline=window(since, base["ended_at"] - offset), updates=[])
    previous_end = base["ended_at"] - offset
    for u in measured["updates"]:
        published, sent = u["published_at"] - offset, u["sent_at"] - offset
        result["updates"].append(dict(
            version=u["version"],
            gap=window(previous_end, published),
            # Before the trainer was asked to publish, and before the engine's begin_update
            # (the trainer's first packs and the header's trip fall between the two).
            last_32_before=last_32(published),
            last_32_before_begin=last_32(u.get("begin_update_started_s")),
            during=window(published, sent)))
        previous_end = sent
    result["rows"] = [[round(r[0] - since, 6)] + r[1:] for r in rows]
    return result


def one_trace_line(run: dict) -> str:
    steps = run["steps"]
    med = lambda key, sub: statistics.median(  # noqa: E731
        [u[key][sub] for u in steps["updates"] if u[key].get(sub) is not None] or [float("nan")])
    return (f"baseline mean step {steps['baseline'].get('mean_ms')} ms; per update (median): gap "
            f"{med('gap', 'mean_ms'):.3f} ms, last 32 before {med('last_32_before', 'mean_ms'):.3f}"
            f" ms, during {med('during', 'mean_ms'):.3f} ms")


def summarize(load, budget: float | None, measured: dict, checksums: bool) -> dict:
    base_tps = measured["baseline"]["tokens_per_s"]
    updates = []
    for u in measured["updates"]:
        tps = load.rate(u["published_at"], u["sent_at"])
        pacing = u.get("pacing") or {}
        updates.append(dict(
            version=u["version"], transfer_ms=u["transfer_ms"], update_ms=u["update_ms"],
            tokens_per_s_transfer=round(tps, 1),
            slowdown_transfer=round(base_tps / tps, 3) if tps > 0 else None,
            slowdown_whole_update=u.get("slowdown"), engine_stop_ms=u.get("engine_stop_ms"),
            header_buckets=u.get("header_buckets"),
            receiver_transfer_ms=(round(u["receiver_transfer_s"] * 1e3, 3)
                                  if u.get("receiver_transfer_s") is not None else None),
            pacing=pacing))

    def median(key, source=updates):
        values = [x[key] for x in source if x.get(key) is not None]
        return round(statistics.median(values), 3) if len(values) == len(source) and values else None

    pacings = [u["pacing"] for u in updates if u["pacing"] and u["pacing"].get("paced")]
    return dict(budget=budget, checksums=checksums, baseline=measured["baseline"], updates=updates,
                median=dict(transfer_ms=median("transfer_ms"), update_ms=median("update_ms"),
                            slowdown_transfer=median("slowdown_transfer"),
                            slowdown_whole_update=median("slowdown_whole_update"),
                            engine_stop_ms=median("engine_stop_ms"),
                            step_ratio=median("step_ratio", pacings) if pacings else None,
                            duty=median("duty", pacings) if pacings else None))


def one_line(run: dict) -> str:
    m = run["median"]
    return (f"transfer {fmt_ms(m['transfer_ms'])}, slowdown during it {m['slowdown_transfer']}x "
            f"(receiver's step ratio {m['step_ratio']}, duty {m['duty']}); whole update "
            f"{fmt_ms(m['update_ms'])}, slowdown {m['slowdown_whole_update']}x; baseline "
            f"{run['baseline']['tokens_per_s']} tok/s, step {run['baseline']['step_ms_median']} ms")


def child_main(args) -> int:
    result: dict = {"config": args.config, "budgets": args.budgets}
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    sys.path.insert(0, str(PYTHON_DIR))
    prepend_pythonpath(PYTHON_DIR)
    if args.trace_steps:  # the tracer travels to vLLM's engine process as a callable
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        sys.path.insert(0, str(BENCH_DIR))
        prepend_pythonpath(BENCH_DIR)
    try:
        import torch  # noqa: F401  (before vLLM: one CUDA/NCCL runtime in the process)

        asyncio.run(run_child(args, result))
    except BaseException as e:  # noqa: BLE001  (recorded; the orchestrator writes what ran)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], file=sys.stderr, flush=True)
    Path(args.result_file).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    os._exit(1 if "error" in result else 0)


def write_outputs(out: Path, meta: dict, result: dict) -> None:
    """bench_vllm_pacing.json and .md in `out`."""
    write_report(out, "bench_vllm_pacing", {"meta": meta, "goals": GOALS, "result": result},
                 markdown)


def markdown(results: dict) -> str:
    meta, result = results["meta"], results["result"]
    lines = ["# Decode while weights stream in: unpaced and at pacing budgets (real vLLM)", "",
             *stamp_lines(meta), f"* model: {meta['config']} (random weights, real shapes)",
             f"* settings: {json.dumps(meta['settings'])}", "",
             "Median over the measured updates. Transfer: publish asked → every byte acked. "
             "Slowdown: the baseline's decode tokens/s over tokens/s during the transfer. "
             "Step ratio and duty: the receiver's own UpdateReport.pacing. Whole update: up to "
             "the swap (under CUDA graphs a copy_in of every weight on the engine stream).", "",
             "Checksums: SenderConfig.checksums (on: the trainer checksums every bucket, the "
             "receiver verifies it; × unpaced compares runs of the same setting).", "",
             "| budget | checksums | transfer ms | × unpaced | slowdown during transfer | "
             "receiver step ratio | duty | whole update ms | slowdown whole update | "
             "engine stop ms | baseline tok/s | baseline step ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    runs = result.get("runs", [])

    def unpaced_of(run):
        return next((r for r in runs if r["budget"] is None
                     and r.get("checksums", True) == run.get("checksums", True)), None)

    for r in runs:
        m, b, unpaced = r["median"], r["baseline"], unpaced_of(r)
        factor = (round(m["transfer_ms"] / unpaced["median"]["transfer_ms"], 2)
                  if unpaced and m["transfer_ms"] and unpaced["median"]["transfer_ms"] else "-")
        lines.append(f"| {budget_name(r['budget'])} | {'on' if r.get('checksums', True) else 'off'} | "
                     f"{m['transfer_ms']} | {factor} | "
                     f"{m['slowdown_transfer']} | {m['step_ratio'] if m['step_ratio'] is not None else '-'} | "
                     f"{m['duty'] if m['duty'] is not None else '-'} | {m['update_ms']} | "
                     f"{m['slowdown_whole_update']} | {m['engine_stop_ms']} | "
                     f"{b['tokens_per_s']} | {b['step_ms_median']} |")
    traced = [r for r in runs if r.get("steps")]
    if traced:
        lines += ["", "Steps as traced (--trace-steps; host time from one step's start to the "
                  "next, as the step hook sees it; medians over the updates): the baseline "
                  "window's mean step, the mean step between the previous update and this one, "
                  "over the 32 steps before it (the most the receiver's step ring holds) and "
                  "before the engine's begin_update, and "
                  "during the transfer; the receiver's own idle and during means beside them.", "",
                  "| budget | checksums | baseline mean ms | gap mean ms | last 32 mean ms | "
                  "last 32 before begin_update mean ms | during mean ms | receiver idle ms | "
                  "receiver during ms | during / baseline | slowdown (tokens/s) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in traced:
            st, ups = r["steps"], r["steps"]["updates"]

            def med(values):
                values = [v for v in values if v is not None]
                return round(statistics.median(values), 3) if values else None

            during = med([u["during"].get("mean_ms") for u in ups])
            base = st["baseline"].get("mean_ms")
            idle = med([1e3 * u["pacing"]["idle_step_s"] for u in r["updates"]
                        if u["pacing"] and u["pacing"].get("paced")])
            busy = med([1e3 * u["pacing"]["step_during_s"] for u in r["updates"]
                        if u["pacing"] and u["pacing"].get("paced")])
            lines.append(f"| {budget_name(r['budget'])} | {'on' if r.get('checksums', True) else 'off'} | "
                         f"{base} | {med([u['gap'].get('mean_ms') for u in ups])} | "
                         f"{med([u['last_32_before'].get('mean_ms') for u in ups])} | "
                         f"{med([u['last_32_before_begin'].get('mean_ms') for u in ups])} | {during} | "
                         f"{idle if idle is not None else '-'} | {busy if busy is not None else '-'} | "
                         f"{round(during / base, 3) if during and base else '-'} | "
                         f"{r['median']['slowdown_transfer']} |")
    if "error" in result:
        lines += ["", f"FAILED: {result['error']}"]
    lines += ["", "Goals:", ""]
    for checksums in (True, False):
        unpaced = next((r for r in runs if r["budget"] is None
                        and r.get("checksums", True) == checksums), None)
        setting = f"checksums {'on' if checksums else 'off'}"
        if unpaced:
            s = unpaced["median"]["slowdown_transfer"]
            lines.append(f"* {setting}, no budget: slowdown ≤ {GOALS['unpaced_slowdown']:.2f}x: "
                         f"{s}x: {'met' if s is not None and s <= GOALS['unpaced_slowdown'] else 'MISSED'}")
        tight = next((r for r in runs if r["budget"] == 1.03
                      and r.get("checksums", True) == checksums), None)
        if tight and unpaced:
            s, t = tight["median"]["slowdown_transfer"], tight["median"]["transfer_ms"]
            factor = (t / unpaced["median"]["transfer_ms"]
                      if t and unpaced["median"]["transfer_ms"] else None)
            ok = s is not None and s <= 1.03 and factor is not None and factor <= 2.0
            lines.append(f"* {setting}, budget 1.03: slowdown ≤ 1.03x for ≤ 2x the unpaced "
                         f"transfer time: {s}x at {factor:.2f}x the time: "
                         f"{'met' if ok else 'MISSED'}" if factor else
                         f"* {setting}, budget 1.03: {s}x (no unpaced time to compare)")
    return "\n".join(lines) + "\n"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama-3-8b", choices=sorted(CONFIGS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budgets", default="none,1.10,1.05,1.03",
                   help="comma-separated decode_slowdown_budget values; none: no pacing")
    p.add_argument("--checksums", choices=sorted(CHECKSUM_SERIES), default="on",
                   help="SenderConfig.checksums for every budget: on (the default), off, or "
                        "both (every budget with checksums on, then off)")
    p.add_argument("--out", help="output folder (default $OUT, else ./bench-vllm-pacing)")
    p.add_argument("--commit", help="the commit to name (default: git rev-parse of this checkout)")
    p.add_argument("--requests", type=int, default=32, help="concurrent decode requests")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--updates", type=int, default=4, help="measured updates per budget")
    p.add_argument("--baseline-s", type=float, default=2.0, help="the no-update window")
    p.add_argument("--gap-s", type=float, default=1.0, help="decode time between updates")
    p.add_argument("--bucket-bytes", type=int, default=0, help="0: the layout's default")
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--trace-steps", action="store_true",
                   help="trace every engine step (bench/vllm_step_trace.py) and report the mean "
                        "step in the baseline, between updates and during each, as the step "
                        "hook's clock sees them")
    p.add_argument("--timeout-s", type=float, default=560, help="deadline of the engine run")
    p.add_argument("--work-dir", help="where the checkpoint goes (default: the system's temp)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    args = p.parse_args()
    # What the shared pieces (bench/vllm_update/) read.
    args.swap_strategy, args.dummy_load, args.live_arena, args.graph_pairs = None, False, False, False
    args.vllm_no_pause, args.decode_slowdown_budget = False, None
    args.tp, args.transport, args.trainer_gpu = 1, "same-host", 0  # one GPU, trainer beside
    parse_budgets(args.budgets)  # a bad value fails here, before anything starts
    return args


def main() -> int:
    args = parse_args()
    if args.child:
        return child_main(args)
    out = Path(args.out or os.environ.get("OUT") or "bench-vllm-pacing")
    out.mkdir(parents=True, exist_ok=True)
    meta = run_stamp(args.device, args.commit, config=args.config)
    meta["settings"] = dict(budgets=args.budgets, checksums=args.checksums,
                            requests=args.requests,
                            max_tokens=args.max_tokens, updates=args.updates,
                            baseline_s=args.baseline_s, gap_s=args.gap_s,
                            bucket_bytes=args.bucket_bytes, trace_steps=args.trace_steps,
                            enforce_eager=args.enforce_eager or args.device == "cpu")
    log(f"machine {meta['machine']}, commit {meta['commit']}, vLLM {meta['vllm_version']}")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-pacing-", dir=args.work_dir))
    result: dict = {}
    try:
        model_dir = work / "model"
        made = run_logged([sys.executable, str(CHECKPOINT_MAKER), "--make-checkpoint",
                           str(model_dir), "--config", args.config, "--device", args.device],
                          out / "pacing-checkpoint.log", 300)
        if made != 0:
            result["error"] = f"making the checkpoint failed (exit {made}): " \
                              f"{tail(out / 'pacing-checkpoint.log')}"
        else:
            result_file = out / "pacing.result.json"
            result_file.unlink(missing_ok=True)
            command = [sys.executable, __file__, "--child", "--config", args.config,
                       "--device", args.device, "--budgets", args.budgets,
                       "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                       "--updates", str(args.updates), "--baseline-s", str(args.baseline_s),
                       "--gap-s", str(args.gap_s), "--bucket-bytes", str(args.bucket_bytes),
                       "--checksums", args.checksums,
                       "--model-dir", str(model_dir), "--result-file", str(result_file)]
            if args.gpu_memory_utilization:
                command += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
            if args.enforce_eager:
                command.append("--enforce-eager")
            if args.trace_steps:
                command.append("--trace-steps")
            remaining = args.timeout_s - (time.monotonic() - started)
            code = run_logged(command, out / "pacing-engine.log", remaining)
            if result_file.exists():
                result = json.loads(result_file.read_text())
            if code != 0 and "error" not in result:
                why = "timed out" if code == 124 else f"exit {code}"
                result["error"] = f"engine run {why}: {tail(out / 'pacing-engine.log')}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, meta, result)
    log(f"done in {time.monotonic() - started:.0f} s; {out / 'bench_vllm_pacing.md'}")
    print((out / "bench_vllm_pacing.md").read_text())
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
