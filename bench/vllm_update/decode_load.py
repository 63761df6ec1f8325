"""The decode load the benchmark generates while it updates, and what its per-token timeline says:
the baseline, each update's engine stop, token gaps and slowdown, and their summary (the method:
bench_vllm_update.py's docstring, "Load and figures")."""

from __future__ import annotations

import asyncio
import bisect
import math
import random
import statistics
import time

from run_report import fmt_ms, log

from .configs import CONFIGS, ENGINE_EVENTS, ENGINE_TIMES, PROMPT_LEN
from .swap_trace import swap_gpu_excess, trace_line


class DecodeLoad:
    """A steady decode load on an AsyncLLM and the per-token timeline it sees. Event loop only."""

    def __init__(self, engine, args):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.args = args
        self.vocab = CONFIGS[args.config]["vocab_size"]
        self.rng = random.Random(0)
        self.params = lambda n: SamplingParams(
            max_tokens=n, temperature=1.0, seed=None, ignore_eos=True, detokenize=False,
            output_kind=RequestOutputKind.DELTA)
        self.greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                     detokenize=False)
        self.tokens: list[tuple[float, int]] = []  # (arrival, new tokens)
        # One request's consecutive token arrivals, and the tokens the later one brought.
        self.gaps: list[tuple[float, float, int]] = []
        # Each request's first token: the end of the step that admitted it (its prefill).
        self.first_tokens: list[float] = []
        self.stopping = False
        self.count = 0

    def prompt(self) -> dict:
        top = min(self.vocab, 30000)
        return {"prompt_token_ids": [self.rng.randrange(10, top) for _ in range(PROMPT_LEN)]}

    async def greedy_probe(self) -> list[int]:
        """8 greedy tokens of a fixed prompt (nothing else running): shows whether an update
        changed the weights the engine computes with."""
        prompt = {"prompt_token_ids": list(range(5, 5 + PROMPT_LEN))}
        self.count += 1
        final = None
        async for out in self.engine.generate(prompt, self.greedy, f"probe-{self.count}"):
            final = out
        return list(final.outputs[0].token_ids)

    async def slot(self, index: int) -> None:
        first = True
        while not self.stopping:
            # Staggered first lengths: the slots do not all finish (and prefill) at once.
            n = max(8, (index + 1) * self.args.max_tokens // self.args.requests) if first \
                else self.args.max_tokens
            first = False
            self.count += 1
            previous = None
            async for out in self.engine.generate(self.prompt(), self.params(n), f"load-{self.count}"):
                now = time.perf_counter()
                new = len(out.outputs[0].token_ids)
                if new:
                    self.tokens.append((now, new))
                    if previous is not None:
                        self.gaps.append((previous, now, new))
                    else:
                        self.first_tokens.append(now)
                    previous = now

    async def measure(self, update, first_version: int, engine_times=None) -> dict:
        """`engine_times`: after each update's window, what the engine thread spent on it (the
        shadowsync path: its swap and RPCs), asked for outside the window."""
        args = self.args
        self.stopping = False  # a later call starts the load again
        tasks = [asyncio.create_task(self.slot(i)) for i in range(args.requests)]
        try:
            await self.ramp(tasks)
            base0 = time.perf_counter()
            await asyncio.sleep(args.baseline_s)
            base1 = time.perf_counter()
            windows = []
            for k in range(args.updates):
                await asyncio.sleep(args.gap_s)
                self.check(tasks)
                w0 = time.perf_counter()
                info = await update(first_version + k)
                w1 = time.perf_counter()
                if engine_times is not None:
                    info = dict(info, **await engine_times())
                windows.append((w0, w1, info))
                log(f"update {k + 1}/{args.updates}: {fmt_ms((w1 - w0) * 1e3)}"
                    + "".join(f"; {key} {fmt_ms(info[key])}"
                              for key in ENGINE_TIMES + ("swap_callback_ms", "commit_check_ms", "clean_step_wait_ms")
                              if key in info))
                if "trace" in info:
                    log(trace_line(info["trace"]))
            await asyncio.sleep(max(0.5, 3 * self.step_estimate(base0, base1)))
            self.check(tasks)
        finally:
            self.stopping = True
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.analyse(base0, base1, windows)

    async def ramp(self, tasks) -> None:
        """Until every slot produced tokens and the load ran a while (deadline: fails loudly)."""
        deadline = time.perf_counter() + 120
        while len(self.tokens) < 4 * self.args.requests:
            self.check(tasks)
            if time.perf_counter() > deadline:
                raise TimeoutError(f"decode load: {len(self.tokens)} token outputs in 120 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)

    @staticmethod
    def check(tasks) -> None:
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise RuntimeError(f"a load request failed: {t.exception()!r}") from t.exception()

    def step_estimate(self, t0: float, t1: float) -> float:
        inside = [b - a for a, b, _ in self.gaps if a >= t0 and b <= t1]
        return statistics.median(inside) if inside else 0.1

    def admission_steps(self, step: float):
        """A predicate on a gap's end: whether the step that ended it admitted a request (a
        request's first token arrived within half a median step of that end: one step's outputs
        reach the requests together)."""
        firsts = sorted(self.first_tokens)

        def admitted(end: float) -> bool:
            i = bisect.bisect_left(firsts, end - step / 2)
            return i < len(firsts) and firsts[i] <= end + step / 2
        return admitted

    def rate(self, w0: float, w1: float) -> float:
        """Decode tokens/s over [w0, w1]: each request's rate at a moment is its tokens over the
        length of the inter-token interval around it, integrated over the window. Unlike a count
        of arrivals in the window, it has no error of up to one step's tokens at the edges, which
        matters for windows a few steps long."""
        total = 0.0
        for a, b, n in self.gaps:
            overlap = min(b, w1) - max(a, w0)
            if overlap > 0:
                total += n * overlap / (b - a)
        return total / (w1 - w0)

    def analyse(self, base0: float, base1: float, windows) -> dict:
        base_gaps = [b - a for a, b, _ in self.gaps if a >= base0 and b <= base1]
        if not base_gaps:
            raise RuntimeError("no inter-token gaps in the baseline window: no decode load?")
        step = statistics.median(base_gaps)
        base_tps = self.rate(base0, base1)
        admitted = self.admission_steps(step)
        admitting = [b - a for a, b, _ in self.gaps if a >= base0 and b <= base1 and admitted(b)]
        admitting_step = statistics.median(admitting) if admitting else None
        updates = []
        # A gap that began well before the update (more than two slow steps) is a stall the
        # update did not cause (on a busy CPU: the process descheduled); the other requests of
        # the same batches still show whatever the update did.
        lead = 2 * percentile(base_gaps, 99)
        for w0, w1, info in windows:
            overlapping = [b - a for a, b, _ in self.gaps if b >= w0 and w0 - lead <= a <= w1]
            max_gap = max(overlapping) if overlapping else float("nan")
            entry = dict(info)
            # The gaps each engine-thread event fell into, and the largest gap none did.
            starts = {e: entry.pop(f"{e}_started_at") for e in ENGINE_EVENTS
                      if f"{e}_started_at" in entry}
            for event, at in starts.items():
                hit = [b - a for a, b, _ in self.gaps if a <= at <= b]
                entry[f"gap_at_{event}_ms"] = round(max(hit, default=float("nan")) * 1e3, 3)
            if starts:
                others = [b - a for a, b, _ in self.gaps if b >= w0 and w0 - lead <= a <= w1
                          and not any(a <= at <= b for at in starts.values())]
                entry["largest_other_gap_ms"] = round(max(others, default=float("nan")) * 1e3, 3)
            # Where the engine stood still for the update: the pause (vLLM's path: its longest
            # gap), or, when the engine thread's swap is known (shadowsync), the gap the swap began
            # in and the same request's next one (a swap that blocks the engine thread also delays
            # the step after it). The window's other gaps are steps that ran while bytes streamed:
            # slower ones count in the slowdown (and max_token_gap_ms shows the longest).
            stop_gap = max_gap
            if "swap" in starts:
                began = [(a, b) for a, b, _ in self.gaps if a <= starts["swap"] <= b]
                ends = {b for _, b in began}
                swap_gaps = began + [(a, b) for a, b, _ in self.gaps if a in ends]
                stop_gap = max([b - a for a, b in swap_gaps], default=float("nan"))
                entry["swap_gaps_ms"] = round(stop_gap * 1e3, 3)
                if swap_gaps:  # none: the swap fell where no request was between two tokens
                    # Whether the swap shared one of those steps with a request's prefill: the
                    # baseline has steps that long without any update (step_ms_max), so the stop
                    # measured there may be mostly theirs (engine_stop_ms counts every update).
                    entry["swap_step_admitted"] = any(admitted(b) for _, b in swap_gaps)
                    # Like for like: each of those gaps over the baseline's median step of its
                    # kind (one that admitted a request, or not); None if the baseline had no
                    # step of a kind it needs.
                    kinds = [(b - a, admitting_step if admitted(b) else step) for a, b in swap_gaps]
                    entry["engine_stop_like_for_like_ms"] = (
                        round(max(0.0, max(gap - usual for gap, usual in kinds)) * 1e3, 3)
                        if all(usual is not None for _, usual in kinds) else None)
            if entry.get("trace"):
                entry["swap_gpu_excess_ms"] = swap_gpu_excess(entry["trace"])
            tokens = sum(n for t, n in self.tokens if w0 <= t <= w1)
            tps = self.rate(w0, w1)
            entry.update(window_ms=round((w1 - w0) * 1e3, 3), max_token_gap_ms=round(max_gap * 1e3, 3),
                         # None (shown n/a): no gap to measure (a swap outside every gap)
                         engine_stop_ms=(round(max(0.0, stop_gap - step) * 1e3, 3)
                                         if math.isfinite(stop_gap) else None),
                         tokens_in_window=tokens, tokens_per_s=round(tps, 1),
                         slowdown=round(base_tps / tps, 3) if tps > 0 else None)
            # Decode time lost to the update: its time x (1 - 1/slowdown), the baseline's
            # tokens it did not make over the baseline's rate (all of it while paused; below 0
            # where the window ran faster than the baseline, as measured).
            update_ms = entry.get("update_ms", entry["window_ms"])
            entry["decode_lost_ms"] = round(update_ms * (1 - tps / base_tps), 3)
            updates.append(entry)
        summary = {}
        if any("clean_step_missed" in u for u in updates):
            summary["clean_step_missed_count"] = sum(bool(u.get("clean_step_missed"))
                                                     for u in updates)
        if any("swap_step_admitted" in u for u in updates):
            summary["swap_step_admitted_count"] = sum(bool(u.get("swap_step_admitted"))
                                                      for u in updates)
            # The diagnostics over the updates they are defined for, with their count (of
            # len(updates)): an update left out is said, not hidden.
            for key, values in (
                    ("engine_stop_ms_not_admitting",
                     [u["engine_stop_ms"] for u in updates
                      if u.get("swap_step_admitted") is False]),
                    ("engine_stop_like_for_like_ms",
                     [u["engine_stop_like_for_like_ms"] for u in updates
                      if u.get("engine_stop_like_for_like_ms") is not None])):
                if values:
                    summary[key] = dict(median=round(statistics.median(values), 3),
                                        max=round(max(values), 3), min=round(min(values), 3),
                                        count=len(values))
        for key in ("update_ms", "decode_lost_ms", "engine_stop_ms", "max_token_gap_ms",
                    "tokens_per_s", "slowdown",
                    "transfer_gbps", "start_to_finish_ms", "pause_ms", "resume_ms", "transfer_ms", "apply_ms",
                    "largest_other_gap_ms", "swap_gaps_ms", "swap_gpu_excess_ms",
                    "clean_step_wait_ms", "commit_check_ms") + ENGINE_TIMES:
            values = [u.get(key) for u in updates if key in u]
            if not values:
                continue
            finite = [v for v in values if v is not None]
            summary[key] = dict(
                median=round(statistics.median(finite), 3) if len(finite) == len(values) else None,
                max=round(max(finite), 3) if len(finite) == len(values) else None,
                min=round(min(finite), 3) if finite else None)
        arrivals = sum(n for t, n in self.tokens if base0 <= t <= base1) / (base1 - base0)
        # The engine stop's noise floor: the same measure (a gap and the same request's next one,
        # the longer of the two, over the median step) at every baseline gap, where nothing swaps.
        following: dict[float, list[float]] = {}
        for a, b, _ in self.gaps:
            following.setdefault(a, []).append(b - a)
        # Each pair's excess, and whether one of its steps admitted a request (the floor over the
        # pairs that admitted none is given too).
        floors = [(max([b - a] + following.get(b, [])) - step,
                   admitted(b) or any(admitted(b + d) for d in following.get(b, [])))
                  for a, b, _ in self.gaps if a >= base0 and b <= base1]
        pairs = [excess for excess, _ in floors]
        quiet = [excess for excess, admitting_pair in floors if not admitting_pair]
        return dict(baseline=dict(seconds=round(base1 - base0, 2), started_at=base0, ended_at=base1,
                                  tokens_per_s=round(base_tps, 1),
                                  tokens_per_s_by_arrivals=round(arrivals, 1),
                                  step_ms_median=round(step * 1e3, 3),
                                  step_ms_p99=round(percentile(base_gaps, 99) * 1e3, 3),
                                  step_ms_max=round(max(base_gaps) * 1e3, 3),
                                  stop_floor_ms_median=round(statistics.median(pairs) * 1e3, 3),
                                  stop_floor_ms_p90=round(percentile(pairs, 90) * 1e3, 3),
                                  **({} if not quiet else dict(
                                      stop_floor_not_admitting_ms_median=round(
                                          statistics.median(quiet) * 1e3, 3),
                                      stop_floor_not_admitting_ms_p90=round(
                                          percentile(quiet, 90) * 1e3, 3))),
                                  **({} if admitting_step is None else dict(
                                      admitting_step_ms_median=round(admitting_step * 1e3, 3)))),
                    requests_started=len(self.first_tokens), updates=updates, summary=summary)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]
