"""bench_vllm_update.py's report: the one-line summary of a path's result, and the JSON and the
Markdown tables of the whole run."""

from __future__ import annotations

import json
from pathlib import Path

from run_report import fmt_ms, stamp_lines, write_report

from .configs import ENGINE_EVENTS, GOALS, VLLM_REFERENCE_STOP_MS


def one_line(result: dict) -> str:
    s = result.get("summary", {})
    get = lambda k, q="median": (s.get(k) or {}).get(q)  # noqa: E731
    return (f"engine stop median {fmt_ms(get('engine_stop_ms'))} "
            f"max {fmt_ms(get('engine_stop_ms', 'max'))}; "
            f"slowdown median {get('slowdown')}; update median {fmt_ms(get('update_ms'))}; "
            f"baseline {result.get('baseline', {}).get('tokens_per_s')} tok/s")


def write_outputs(out: Path, results: dict) -> None:
    """bench_vllm_update.json and .md in `out`."""
    write_report(out, "bench_vllm_update", results, markdown)


def model_name(results: dict, config: str) -> str:
    """`config` as the report names it: with --layers "qwen3-30b-a3b (24 of 48 layers)", with
    --quantization ", FP8" after it."""
    name = results.get("models", {}).get(config, {}).get("model", config)
    quantization = results.get("quantization")
    return f"{name}, {quantization.upper()}" if quantization else name


def markdown(results: dict) -> str:
    meta = results["meta"]
    quantization = results.get("quantization")
    title = "# Weight updates into a generating vLLM: vLLM's weight transfer vs shadowsync"
    if quantization:
        title += (f" ({quantization.upper()} engines: quantization=\"{quantization}\", the bf16 "
                  f"weights quantized by vLLM while loading and by shadowsync's receiver per "
                  f"update)")
    lines = [title, "",
             *stamp_lines(meta), f"* settings: {json.dumps(meta['settings'])}", "",
             "Per update (median / max over the measured updates). Engine stop: how much longer "
             "than the baseline step generation stood still to change weights (vLLM: the longest "
             "gap between two tokens of one request overlapping the update; shadowsync: the gap "
             "its swap began in and the next one). Max token gap: the longest gap overlapping the "
             "update (baseline: median and longest step without one). "
             "Slowdown: baseline tokens/s over tokens/s during the update (∞: generation paused). "
             "Transfer GB/s: the model's bytes over the transfer's time (vLLM: its send, from "
             "start_weight_update's return to the last chunk received; shadowsync: the trainer's publish "
             "to the last bucket acknowledged, packing included). Decode time lost: the whole "
             "update's time x (1 - 1/slowdown), the decode time the update cost the engine. "
             "shadowsync-ranks-M: the shadowsync path fed by M trainer ranks (--trainer-ranks), "
             "on the same engine after the shadowsync path's own run; shadowsync-gather-M: by M "
             "trainer ranks that gather every tensor to rank 0 first (--gather-ranks).",
             "",
             "| model | path | updates | engine stop ms | max token gap ms | baseline step ms, "
             "median / max | "
             "baseline tok/s | tok/s during update | slowdown | whole update ms | "
             "decode time lost ms | transfer GB/s | vLLM start→finish ms | goal / reference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pair(summary, key, digits=1, none="∞"):
        """Median / max; `none` stands for a figure some update lacks (the slowdown: generation
        paused; the engine stop: a swap outside every gap)."""
        entry = summary.get(key)
        if not entry:
            return "-"
        f = lambda v: none if v is None else f"{v:.{digits}f}"  # noqa: E731
        return f"{f(entry['median'])} / {f(entry['max'])}"

    for config, entry in results["configs"].items():
        name = model_name(results, config)
        if "error" in entry:
            lines.append(f"| {name} | - | - | FAILED: {entry['error'][:300]} | | | | | | | | | | |")
            continue
        for path, r in entry.items():
            if "error" in r:
                why = r["error"].replace("|", "/").replace("\n", " ")[:400]
                lines.append(f"| {name} | {path} | - | FAILED: {why} | | | | | | | | | | |")
                continue
            s, b = r.get("summary", {}), r.get("baseline", {})
            if path.startswith("shadowsync"):
                goal = (f"stop ≤ {GOALS['engine_stop_ms']:g} ms (8B), slowdown ≤ "
                        f"{GOALS['slowdown']:.2f}x")
            elif path == "copy":
                goal = "reference: bytes copied in another process, no update"
            else:
                # vLLM's figure is for the whole bf16 model: none for fewer layers or FP8.
                ref = None if name != config else VLLM_REFERENCE_STOP_MS.get(config)
                goal = f"vLLM reported {ref:g} ms stop (one GPU, IPC)" if ref else "-"
                if r.get("api", "").find("control sequence only") >= 0:
                    goal += " (control sequence only: no weights sent)"
            tps = s.get("tokens_per_s", {})
            lines.append(
                f"| {name} | {path} | {len(r.get('updates', []))} | {pair(s, 'engine_stop_ms', 2, 'n/a')} | "
                f"{pair(s, 'max_token_gap_ms', 2)} | {b.get('step_ms_median', '-')} / "
                f"{b.get('step_ms_max', '-')} | "
                f"{b.get('tokens_per_s', '-')} | "
                f"{tps.get('median', '-')} (min {tps.get('min', '-')}) | "
                f"{pair(s, 'slowdown', 3)} | {pair(s, 'update_ms')} | "
                f"{pair(s, 'decode_lost_ms', 2)} | {pair(s, 'transfer_gbps', 2)} | "
                f"{pair(s, 'start_to_finish_ms') if path == 'vllm' else '-'} | {goal} |")
    lines += sharded_lines(results, pair)
    # A path that failed later still says how far its set-up got.
    setups = [(config, path, r) for config, entry in results["configs"].items()
              for path, r in entry.items() if isinstance(r, dict)]
    if setups:
        lines += ["", "Set-up per path (failed paths too, as far as they got): the engine's start "
                  "(AsyncLLM.from_engine_args), the weight-update set-up's own call (the "
                  "trainer's start and build not counted), and the engine's KV-cache capacity as "
                  "vLLM logged it.", "",
                  "| model | path | engine start s | weight-update set-up s | the call | "
                  "KV cache tokens |", "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {model_name(results, config)} | {path} | {r.get('engine_start_s', '-')} | "
                  f"{r.get('update_setup_s', '-')} | {r.get('update_setup_call', '-')} | "
                  f"{r.get('kv_cache_tokens') or '-'} |" for config, path, r in setups]
    floors = [(config, path, r["baseline"]) for config, entry in results["configs"].items()
              for path, r in entry.items()
              if isinstance(r, dict) and "stop_floor_ms_median" in r.get("baseline", {})]
    if floors:
        lines += ["", "The engine stop's floor: the same measure (the longer of a gap and the same "
                  "request's next one, over the median step) at every gap of the baseline window, "
                  "where nothing swaps: " + "; ".join(
                      f"{config} {path}: median {b['stop_floor_ms_median']} ms, p90 "
                      f"{b['stop_floor_ms_p90']} ms" for config, path, b in floors) + "."]
    admissions = [(config, path, r) for config, entry in results["configs"].items()
                  for path, r in entry.items()
                  if isinstance(r, dict) and "swap_step_admitted_count" in r.get("summary", {})]

    def over(r, key):
        """A diagnostic's median / max and over how many of the updates it is defined for."""
        entry = r["summary"].get(key)
        if not entry:
            return "n/a"
        return (f"median {entry['median']} / max {entry['max']} ms over {entry['count']} of "
                f"{len(r['updates'])} updates")

    if admissions:
        lines += ["", "Swaps that shared a step with a request's prefill (the baseline has steps "
                  "that long without any update), the engine stop over the other updates, the "
                  "floor over the baseline's pairs of steps that admitted none, and the stop like "
                  "for like (each of the swap's gaps over the baseline's median step of its kind): "
                  + "; ".join(
                      f"{config} {path}: {r['summary']['swap_step_admitted_count']} of "
                      f"{len(r['updates'])}; stop over the others "
                      f"{over(r, 'engine_stop_ms_not_admitting')}; floor median "
                      f"{r['baseline'].get('stop_floor_not_admitting_ms_median', 'n/a')} / p90 "
                      f"{r['baseline'].get('stop_floor_not_admitting_ms_p90', 'n/a')} ms; "
                      f"admitting steps {r['baseline'].get('admitting_step_ms_median', 'n/a')} ms "
                      f"median; like for like {over(r, 'engine_stop_like_for_like_ms')}"
                      for config, path, r in admissions) + "."]
    where = [(config, entry["shadowsync"]["summary"]) for config, entry in results["configs"].items()
             if isinstance(entry.get("shadowsync"), dict) and "summary" in entry["shadowsync"]]
    if where:
        lines += ["", "Where the longest gap was (shadowsync; median / max): the engine thread's "
                  "time in the swap (swap callback and, for remap, the engine-stream "
                  "synchronization included), in begin_update, in wait_applied and, under "
                  "tensor parallelism, in commit_update (the ranks' agreement and the swap) "
                  "(all run between two steps); the inter-token gap each fell into; the largest "
                  "gap overlapping the update that none fell into.", "",
                  "| model | swap ms | gap at the swap ms | begin_update ms | gap at it ms | "
                  "wait_applied ms | gap at it ms | commit_update ms | gap at it ms | "
                  "largest other gap ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {model_name(results, config)} | "
                  + "".join(f"{pair(s, f'{e}_ms', 3)} | {pair(s, f'gap_at_{e}_ms', 2)} | "
                            for e in ENGINE_EVENTS)
                  + f"{pair(s, 'largest_other_gap_ms', 2)} |" for config, s in where]
    lines += ["", "Paths: " + "; ".join(
        f"{config} {path}: {r.get('api', '-')}; weights changed by the update: "
        f"{r.get('output_changed_by_update', '-')}; stand-ins: {r.get('stand_ins', [])}"
        for config, entry in results["configs"].items() if "error" not in entry
        for path, r in entry.items() if isinstance(r, dict) and "error" not in r), ""]
    return "\n".join(lines)


def sharded_lines(results: dict, pair) -> list[str]:
    """The sharded trainers' table (--trainer-ranks, --gather-ranks): per run, the shadowsync path's figures that
    the issue's goals name, the decode time lost against the copy reference's (when the run has
    one), the bytes into each engine rank and each trainer rank's peak memory."""
    rows = [(config, name, r) for config, entry in results["configs"].items()
            if "error" not in entry for name, r in entry.items()
            if ("trainer_ranks" in r or "gather_ranks" in r) and "error" not in r]
    if not rows:
        return []
    def size(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    lines = ["", "Sharded trainers (--trainer-ranks M, and --gather-ranks M: \"M, gathering\"; "
             "median / max over the measured updates). A gathering trainer all-gathers every "
             "tensor each update and publishes from rank 0: its update time includes the gather "
             "and rank 0's peak the gathered model. Bytes into each engine rank: the routed bytes the transport counted per update "
             "(weight_update_stats' routed_bytes; every update's must equal the routing plan's "
             "bytes_to_engine, or the run fails); \"in place\": of those, the bytes the engine read where "
             "the trainer ranks' shards lie (routed_in_place_bytes), with nothing packed on the "
             "trainer side. Trainer rank peak: torch.cuda."
             "max_memory_allocated in the rank process (its shards) plus the transport's staging, "
             "which torch does not see (a cuMem allocation: Sender.staging_bytes, two slots of "
             "the plan's max_packed_bytes of the rank); on the CPU its shards plus the staging. "
             "Lost vs copy: the decode time lost over the copy reference's of the same run "
             "(--copy-passes).", "",
             "| model | trainer ranks | engine stop ms | slowdown | whole update ms | decode time "
             "lost ms | lost vs copy (median) | bytes into each engine rank | each trainer "
             "rank's peak (torch + staging) |", "| --- | --- | --- | --- | --- | --- | --- | "
             "--- | --- |"]
    for config, name, r in rows:
        s = r.get("summary", {})
        copy = results["configs"][config].get("copy", {}).get("summary", {})
        lost, floor = (s.get("decode_lost_ms") or {}).get("median"), \
            (copy.get("decode_lost_ms") or {}).get("median")
        ratio = f"{lost / floor:.2f}x" if lost is not None and floor else "-"
        routed = sorted({tuple(u.get("engine_rank_bytes", ())) for u in r.get("updates", [])})
        in_place = sorted({tuple(u.get("engine_rank_in_place_bytes", ()))
                           for u in r.get("updates", [])})
        memory = r.get("trainer_rank_memory") or r.get("setup", {}).get("trainer_rank_memory", [])
        peaks = ", ".join(
            f"{size(m['peak_bytes'])} ({size(m['peak_bytes'] - m['staging_bytes'])} + "
            f"{size(m['staging_bytes'])})" for m in memory)
        packed = sorted({m["routes_in_place"][1] for m in memory
                         if m.get("routes_in_place") and m["routes_in_place"][0] is False})
        if packed:
            peaks += f" (packed: {'; '.join(packed)})"
        ranks = r.get("trainer_ranks") or f"{r['gather_ranks']}, gathering"
        lines.append(f"| {model_name(results, config)} | {ranks} | "
                     f"{pair(s, 'engine_stop_ms', 2, 'n/a')} | {pair(s, 'slowdown', 3)} | "
                     f"{pair(s, 'update_ms')} | {pair(s, 'decode_lost_ms', 2)} | {ratio} | "
                     f"{' / '.join(str(list(b)) for b in routed) or '-'} (plan: "
                     f"{r.get('setup', {}).get('bytes_to_engine_rank', '-')}; in place: "
                     f"{' / '.join(str(list(b)) for b in in_place) or '-'}) | {peaks or '-'} |")
    return lines
