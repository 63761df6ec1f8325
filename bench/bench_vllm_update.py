#!/usr/bin/env python3
"""Weight updates into a generating vLLM, two ways, in one run: vLLM's own weight-transfer API
(CUDA IPC, packed) and shadowsync (same-host transport, worker extension). Per update: how long
generation stops, decode tokens/s during the update against tokens/s without one, and the whole
update's time.

    python3 bench/bench_vllm_update.py --config qwen2.5-0.5b,llama-3-8b          # one GPU
    python3 bench/bench_vllm_update.py --config olmoe-1b-7b --quantization fp8   # MoE, FP8
    python3 bench/bench_vllm_update.py --config qwen3-30b-a3b --layers 24        # one H200
    python3 bench/bench_vllm_update.py --device cpu --config tiny --requests 4 --max-tokens 64
    python3 bench/bench_vllm_update.py --config llama-3-8b --paths shadowsync --graph-pairs \
        --trainer-ranks 1,2,4                                                    # sharded trainers

Outputs ``bench_vllm_update.json`` and ``bench_vllm_update.md`` in --out (default ``$OUT``, else
./bench-vllm-update), each figure with the command, the machine (nvidia-smi's GPU name), the
commit and vLLM's version; plus one log per engine run.

**Models.** Random weights at the real shapes of Qwen2.5-0.5B (tied embeddings), Llama-3-8B and
two mixtures of experts, Qwen3-30B-A3B (48 layers of 128 experts, 8 per token; 57 GiB in bf16)
and OLMoE-1B-7B (16 layers of 64 experts, 8 per token; 12.9 GiB) (hidden sizes, layers, heads,
experts, vocab from their public configs; ``CONFIGS``), or a tiny Llama, or a tiny Qwen3-MoE
(``tiny-moe``: 16 experts, 2 per token) for CPU checks. ``--layers N`` builds each config with
its first N decoder layers (the same shapes; refused above the config's own count): whole,
Qwen3-30B-A3B does not fit one 141 GB GPU (the trainer, the engine and the receiver's two slots
are four copies of 57 GiB); with ``--layers 24`` (29 GiB a copy) it does, and the report names it
"qwen3-30b-a3b (24 of 48 layers)".
transformers builds the model from the config directly on the device in the benchmark's dtype
(bf16 on cuda, fp32 on cpu) and saves it (save_pretrained) for vLLM to load; no tokenizer
(vLLM runs with skip_tokenizer_init and token-id prompts). The trainer of either path builds a
model of the same config with another seed: every update changes every weight once (later
updates send the same values again; the timing does not depend on them).

**FP8** (``--quantization fp8``, cuda only). Every engine the run starts gets
``quantization="fp8"``: vLLM quantizes the bf16 checkpoint while loading (a scale per weight; in
a MoE layer, per expert). The trainers stay bf16: shadowsync's receiver quantizes each update the
same way before it is offered. It is swapped in by copy_in (into vLLM's storage) or, with
--graph-pairs or --backend shadowsync, by rebind between the two slots of graph pairs, which hold
the float8 bytes and scales; --live-arena and another --swap-strategy are refused with it, as is
--device cpu (vLLM's CPU build runs no FP8). The vllm path runs its documented sequence
unchanged: what vLLM does with bf16 weights sent into an FP8 engine is measured, not assumed.
The JSON's ``quantization`` and the table's title and model column say so; vLLM's reference stop
is shown for whole bf16 models only.

**Process layout.** This process orchestrates and never touches the GPU: the checkpoint is made
in a subprocess, and each path runs in a subprocess of its own (``--child``) with one vLLM
``AsyncLLM`` (multiprocess: its EngineCore in another process; CUDA graphs on by default), shut
down before the next path starts, so two engines never coexist. A path that fails records why
(its log's tail) and the other still runs.

* ``vllm``: vLLM's weight-transfer engine, backend "ipc". The trainer lives in the path's driver
  process (the one holding the AsyncLLM): per update, vLLM's documented sequence
  ``pause_generation(mode="keep", clear_cache=False)``, ``start_weight_update()``,
  ``IPCWeightTransferEngine.trainer_send_weights(named_parameters, IPCTrainerSendWeightsArgs(
  send_mode=<callable>, packed=True))`` whose callable hands each chunk's IPC handles to
  ``AsyncLLM.update_weights``, ``finish_weight_update()``, ``resume_generation()``. vLLM's
  start_weight_update moves every layer's parameters to the meta device until finish (layerwise
  reload), so the scheduler is paused meanwhile; ``--vllm-no-pause`` leaves it running (not
  vLLM's documented flow; it may fail). VLLM_ALLOW_INSECURE_SERIALIZATION=1 is set for this path:
  the IPC handles hold torch types, which collective_rpc's encoder only carries pickled.
  This is vLLM 0.25.0's API (``trainer_send_weights`` with a callable ``send_mode``). vLLM 0.32
  replaced it with ``IPCTrainerWeightTransferEngine`` and a ``VLLMWeightSyncClient``; the script
  names the API it found and refuses an API it does not drive, saying so.
  **Stand-in for ray:** vLLM 0.25.0's ipc_engine module imports ``ray`` (and ``requests``) at
  load time, in the driver and in the worker that creates the transfer engine, but the code path
  used here (a callable send_mode, one GPU) never calls either: they serve only send_mode "ray"
  and "http". Only where importing that module fails for want of one of them, the vllm path
  puts a stand-in module of that name first on sys.path and PYTHONPATH (so vLLM's spawned
  processes see it too): its ``is_initialized()`` answers False (vLLM asks that to decide
  whether it runs inside Ray) and any other attribute raises AttributeError naming the
  stand-in, so a code path that does need the package fails loudly. The result lists the
  stand-ins used (``stand_ins``).
  On a CPU build CUDA IPC cannot run: the path then drives only the control sequence (pause,
  start_weight_update, finish_weight_update, resume; no weights sent) to exercise it, and says so.
* ``copy`` (only with ``--paths``): a reference, not an update. Another process on the same
  device copies the model's bytes ``--copy-passes`` times (2: shadowsync's pack and receive)
  bucket by bucket with torch's ``copy_`` while vLLM decodes; nothing reaches the engine. Its
  slowdown, next to shadowsync's, says how much of a decode's slowdown the bytes moving through
  the GPU's memory in another context cause by themselves.
* ``shadowsync``: the trainer in a process of its own (transformers model on the same GPU, a
  Sender over ``same_host_sender_transport(memory="device")``); the engine with
  ``worker_extension_cls="shadowsync.vllm.WorkerExtension"`` joins it through
  ``collective_rpc("init_weight_update_group", specs=<trainer's named_parameters>, same_host=...)``
  (a receive plan from vLLM's load_weights); per update: the trainer publishes,
  ``collective_rpc("begin_update", header)`` queues it, the engine keeps generating while it
  streams, ``apply_update_async`` returns when it is live (the step hook flips it between two
  steps; under CUDA graphs the swap is copy_in: one batched device copy into vLLM's own
  storage; ``--swap-strategy remap`` is the VMM strategy, accepted only with
  ``--enforce-eager``: the extension refuses it under vLLM's graphs). The prefix cache is not reset
  (apply_update_async(reset_prefix_cache=False)): vLLM's path here keeps its caches too.

**Sharded trainers** (``--trainer-ranks M[,M...]``, with the shadowsync path). After the
shadowsync path's own run (one trainer process publishing full tensors, as rank 0 holds them
after a gather), its group is closed keeping the weights and a sharded trainer of each M in turn
takes the same engine over (one engine start serves them all; reported as
``shadowsync-ranks-M``): M rank processes on --trainer-gpu, each making only its rows of every
parameter (FSDP2-like ``Shard(0)``, split as torch.chunk splits: ceil(rows / M) a rank, the last
fewer; random values, no full tensor anywhere), building the routing plan from every rank's
regions and the engine ranks' needs (``shadowsync.vllm.weight_update_needs_async``), serving the
same-host pull transport (device memory on cuda, a CudaBackend; host memory on cpu, a
HostBackend) and publishing with a routed Sender (``publish_shards``); the engine joins them
with ``init_weight_update_group_async(trainer_ranks=dict(..., engine_needs, fingerprint))`` and
pulls each route into its slot straight from where the rank's shards lie (GPU memory CUDA IPC
can share: nothing packed on the trainer side; ``engine_rank_in_place_bytes`` counts those
bytes), else from the rank's staging. With ``--transport nccl`` rank r
runs on GPU --trainer-gpu + r (a GPU of its own: NCCL refuses two ranks of one communicator on
one GPU) and sends its routes over NCCL point-to-point (``trainer_ranks["nccl"]``). The update, its window and its
analysis are the shadowsync path's. Per update also: the bytes the routes carried into each
engine rank (``engine_rank_bytes``, weight_update_stats' ``routed_bytes``, counted by the
transport over that update; every update's must equal the plan's ``bytes_to_engine``, or the
run fails) and each trainer rank's peak memory (``trainer_rank_peak_bytes``): torch's
``max_memory_allocated`` in the rank process (its shards) plus the transport's staging, which
torch does not see (a cuMem allocation): ``Sender.staging_bytes``, two slots of the plan's
``max_packed_bytes`` of the rank (on cpu: its shards plus the staging); the run's
``trainer_rank_memory`` has the parts.

**A sharded trainer that gathers first** (``--gather-ranks M[,M...]``, with the shadowsync path;
after the --trainer-ranks runs, on the same engine; reported as ``shadowsync-gather-M``): what an
FSDP2 trainer does to hand its weights to one sender. M rank processes, rank r on GPU r (the CPU:
gloo), each make only their rows as above; each update every rank all-gathers every parameter as
FSDP2's ``full_tensor()`` does (one all-gather per parameter over a process group of the
ranks, NCCL on GPUs and gloo on the CPU; uneven rows padded to the chunk size), rank 0 keeps
them all and publishes them with one Sender over the same-host transport, the others drop theirs.
The update's time counts from the publish request, so it includes the gather; on GPUs rank 0's
peak memory (``trainer_rank_memory``, ``trainer_rank_peak_bytes``) includes the gathered model
(torch's peak; on the CPU the rows and the staging only).

**Placement and transport** (``--tp``, ``--transport``, ``--trainer-gpu``). vLLM's ranks run
on GPUs 0..tp-1. ``--transport same-host`` (default): vLLM's "ipc" backend and shadowsync's
same-host transport; ``nccl``: vLLM's "nccl" backend (``NCCLWeightTransferEngine.trainer_init``
beside ``init_weight_transfer_engine``, then per update ``trainer_send_weights(packed=True)``
beside ``update_weights``, between start and finish as above) and shadowsync's NCCL transport
(the trainer makes the unique id; the workers join from it), the trainer being rank 0 of
1 + tp in both. ``--trainer-gpu`` puts either path's trainer on that GPU (default 0, the
engine's; NCCL needs one of its own, since it refuses two ranks of one communicator on one GPU).
vLLM's IPC backend runs with one worker on the trainer's GPU only (each worker looks for its own
GPU's handles): with ``--tp`` > 1 or another trainer GPU the vllm path needs ``--transport nccl``
(refused otherwise, on cuda).
With ``--tp`` > 1 shadowsync's updates go live through ``commit_update_async`` (coordinated: every
rank between the same two steps), and after the run the ranks' per-step versions
(``step_versions``) are compared: a difference fails the path. Each update also records its
transfer's GB/s (the model's bytes over the trainer's publish to last ack; vLLM: over its send).

**Load and figures.** A steady decode load: ``--requests`` request slots (32), each generating
``--max-tokens`` (512) tokens from a random prompt and starting the next request as one finishes
(the first requests' lengths are staggered so that the slots do not all end and prefill at
once); every output token's arrival is time-stamped in the driver (RequestOutputKind.DELTA).
After a ramp, a baseline window (``--baseline-s``) without updates, then one warm-up update
(unmeasured) and ``--updates`` measured updates ``--gap-s`` apart. Per update, its window is from
the update's first call to the return of its last call:

* *whole update*: the window's length (vLLM: pause to resume returned; shadowsync: publish to
  apply_update returned);
* *max token gap*: the longest interval between two consecutive output tokens of one request that
  overlaps the window (and began at most two p99 baseline steps before it); compare it with the
  baseline's longest (``step_ms_max``: steps that admit new requests are longer without any update);
* *engine stop*: how much longer than a normal step (the baseline's median inter-token interval)
  generation stood still to change weights. vLLM's path pauses: its stop is the max token gap
  minus the step. The shadowsync path's engine thread stamps its swap (below): its stop is the
  longest of the gap the swap began in and that request's next gap, minus the step. The other
  gaps of its window are steps that ran, slowed by the bytes streaming beside them: they are the
  slowdown's, and the max token gap shows the longest;
* *tokens/s during the update*: each request's token rate (its tokens over the interval
  between two of its tokens) integrated over the window, summed over requests (``rate``; the
  plain count of tokens arriving inside the window is ``tokens_in_window``); the baseline's
  tokens/s the same way over its window; *slowdown* = baseline tokens/s over it (none at all:
  written null, shown as ∞);
* *decode time lost*: the whole update's time x (1 - 1/slowdown) (``decode_lost_ms``): the
  decode time the update cost, to hold against the copy reference's (``--copy-passes 1``: the
  one-pass floor);
* vLLM: the wall time from start_weight_update to finish_weight_update returned, and pause/resume.

For the shadowsync path, after each window (outside it) the worker's weight_update_stats say
what the engine thread spent on the update and when (the worker stamps each start): its swap
(``swap_ms``), ``begin_update_ms`` and ``wait_applied_ms``; ``gap_at_<event>_ms`` is the longest
inter-token gap the event's start fell into, ``largest_other_gap_ms`` the longest one overlapping
the window that none fell into: which of them sets the engine stop says where generation stood
still. ``swap_step_admitted``: whether one of the swap's two gaps ended with a step that admitted
a request (its first token arrived within half a median step of the gap's end); such steps are
long without any update (``admitting_step_ms_median``), so the summary also gives the engine stop
over the other updates (``engine_stop_ms_not_admitting``) and the baseline the floor over pairs
of steps that admitted none (``stop_floor_not_admitting_ms_*``);
``engine_stop_like_for_like_ms`` compares each of the swap's gaps with the baseline's median
step of its kind (admitting or not). Diagnostics: ``engine_stop_ms`` and the goals count every
update against the median step.

**Set-up.** Each path's result also holds ``engine_start_s`` (AsyncLLM.from_engine_args),
``setup_s`` (the path's whole set-up: its trainer started and built too), ``update_setup_s`` with
``update_setup_call``, the weight-update set-up's call alone (shadowsync:
``collective_rpc("init_weight_update_group")``, the receive plan, the receiver's memory and the
transport joined; shadowsync-api and vllm: ``init_weight_transfer_engine``, with NCCL beside the
trainer's ``trainer_init``), and ``kv_cache_tokens``, the engine's KV-cache capacity as vLLM logs
it ("GPU KV cache size: N tokens", read from the path's log); the report has a table of them.

Median and max over the measured updates. Goals printed next to shadowsync's figures: engine stop
at most 1 ms per update at 8B, decode slowdown during the update at most 1.10x. vLLM's reported
reference for its path: 119 ms stop at Qwen2.5-0.5B, 239 ms at Llama-3-8B.

The pieces, one concept each, are in bench/vllm_update/ (the command line, the decode load and its
analysis, each path, the child process, the report); what the benchmarks' reports share is in
bench/support/ (run_report.py, run_children.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from vllm_update import options
from vllm_update.checkpoint import make_checkpoint
from vllm_update.child import child_main
from vllm_update.configs import CONFIGS, GOALS, PATHS, VLLM_REFERENCE_STOP_MS, model_label
from vllm_update.decode_load import DecodeLoad  # noqa: F401  (bench_vllm_pacing.py, the tests)
from vllm_update.options import child_passthrough
from vllm_update.report import one_line, write_outputs

from run_children import run_logged, tail  # on sys.path through vllm_update
from run_report import log, run_stamp

DESCRIPTION = __doc__.split("\n\n")[0]


def build_parser():
    """The command line's parser (its --help begins with this file's first paragraph)."""
    return options.build_parser(DESCRIPTION)


def parse_args():
    """sys.argv, checked (exit 2 with the reason for what cannot run)."""
    return options.parse_args(DESCRIPTION)


# --- the orchestrator ---------------------------------------------------------------------------

def main() -> int:
    args = parse_args()
    if args.child:
        return child_main(args)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.config, args.device, args.dummy_load,
                        args.layers)
        return 0
    configs = [c.strip() for c in args.config.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        print(f"--config: unknown {unknown}; known: {sorted(CONFIGS)}", file=sys.stderr)
        return 2
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if any(p not in PATHS for p in paths):
        print(f"--paths: {paths}; known: {list(PATHS)}", file=sys.stderr)
        return 2
    out = Path(args.out or os.environ.get("OUT") or "bench-vllm-update")
    out.mkdir(parents=True, exist_ok=True)
    meta = run_stamp(args.device, args.commit)
    meta["settings"] = dict(requests=args.requests, max_tokens=args.max_tokens,
                            updates=args.updates, baseline_s=args.baseline_s, gap_s=args.gap_s,
                            swap_strategy=args.swap_strategy, bucket_bytes=args.bucket_bytes,
                            vllm_packed_bytes=args.vllm_packed_bytes,
                            vllm_pause=not args.vllm_no_pause,
                            enforce_eager=args.enforce_eager or args.device == "cpu",
                            tp=args.tp, transport=args.transport, trainer_gpu=args.trainer_gpu,
                            live_arena=args.live_arena, graph_pairs=args.graph_pairs,
                            gated_swaps="off" if args.no_gated_swaps else "auto",
                            decode_slowdown_budget=args.decode_slowdown_budget,
                            layers=args.layers, quantization=args.quantization,
                            trainer_ranks=args.trainer_ranks, gather_ranks=args.gather_ranks,
                            commit_mode=args.commit_mode if args.tp > 1 else None)
    log(f"machine {meta['machine']}, commit {meta['commit']}, vLLM {meta['vllm_version']}")
    # Each config as built: its name in the report (with --layers, "qwen3-30b-a3b (24 of 48
    # layers)"), its decoder layers and the engines' quantization.
    models = {c: dict(model=model_label(c, args.layers),
                      layers=args.layers or CONFIGS[c]["num_hidden_layers"],
                      config_layers=CONFIGS[c]["num_hidden_layers"],
                      quantization=args.quantization) for c in configs}
    results: dict = {"meta": meta, "goals": GOALS, "vllm_reference_stop_ms": VLLM_REFERENCE_STOP_MS,
                     "quantization": args.quantization, "models": models, "configs": {}}
    started = time.monotonic()

    def timeout_left() -> float:
        """A subprocess's deadline: its own, cut to what is left of the run's budget (so the
        run ends, with its outputs written, within --budget-s however its parts fare)."""
        return min(args.path_timeout_s, args.budget_s - (time.monotonic() - started) - 5)

    for config in configs:
        work = Path(tempfile.mkdtemp(prefix=f"bench-vllm-{config}-", dir=args.work_dir))
        entry: dict = {}
        results["configs"][config] = entry
        try:
            model_dir = work / "model"
            t0 = time.monotonic()
            if timeout_left() < 60:
                entry["error"] = f"skipped: less than 60 s left of --budget-s {args.budget_s:g}"
                log(f"{config}: {entry['error']}")
                continue
            made = run_logged([sys.executable, __file__, "--make-checkpoint", str(model_dir),
                               "--config", config, "--device", args.device]
                              + (["--dummy-load"] if args.dummy_load else [])
                              + (["--layers", str(args.layers)] if args.layers else []),
                              out / f"{config}-checkpoint.log", timeout_left())
            if made != 0:
                entry["error"] = (f"making the checkpoint failed (exit {made}): "
                                  f"{tail(out / f'{config}-checkpoint.log')}")
                log(f"{config}: {entry['error']}")
                continue
            log(f"{models[config]['model']}: checkpoint in {time.monotonic() - t0:.1f} s")
            for path in paths:
                if timeout_left() < 60:
                    entry[path] = {"error": "skipped: less than 60 s left of --budget-s "
                                            f"{args.budget_s:g}"}
                    log(f"{config} {path}: {entry[path]['error']}")
                    continue
                entry.update(run_path(args, config, path, model_dir, out, timeout_left()))
                write_outputs(out, results)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, results)
    log(f"done in {time.monotonic() - started:.0f} s; {out / 'bench_vllm_update.md'}")
    print((out / "bench_vllm_update.md").read_text())
    # A path that failed, or whose trainer did not end when stopped, fails the run.
    return 0 if all("error" not in r and "trainer_stop_error" not in r
                    for e in results["configs"].values() for r in
                    ([e] if "error" in e else e.values())) else 1


def run_path(args, config: str, path: str, model_dir: Path, out: Path, timeout_s: float) -> dict:
    """One path in a subprocess: {path: its result, or {"error": why} with its log's tail}, and
    with --trainer-ranks each sharded trainer's run on the same engine as an entry of its own
    (shadowsync-ranks-M: the engine's start and KV cache are the path's)."""
    result_file = out / f"{config}-{path}.result.json"
    result_file.unlink(missing_ok=True)
    log_file = out / f"{config}-{path}.log"
    command = [sys.executable, __file__, "--child", path, "--config", config,
               "--model-dir", str(model_dir), "--result-file", str(result_file)]
    command += child_passthrough(args)
    t0 = time.monotonic()
    code = run_logged(command, log_file, timeout_s)
    seconds = time.monotonic() - t0
    result = None
    if result_file.exists():
        try:
            result = json.loads(result_file.read_text())
        except ValueError as e:
            result = {"error": f"result file unreadable: {e}"}
    if result is None:
        why = "timed out" if code == 124 else f"exit {code}"
        result = {"error": f"{path} path {why} with no result: {tail(log_file)}"}
    elif code != 0 and "error" not in result:
        result["error"] = f"exit {code} after writing its result: {tail(log_file)}"
    result["seconds"] = round(seconds, 1)
    result["log"] = str(log_file)
    # The engine's KV-cache capacity as vLLM counts it (its EngineCore logs "GPU KV cache size:
    # N tokens" into this log; "CPU ..." on its CPU build).
    found = re.findall(r"KV cache size: ([0-9,]+) tokens", log_file.read_text(errors="replace")
                       if log_file.exists() else "")
    result["kv_cache_tokens"] = int(found[-1].replace(",", "")) if found else None
    entries = {path: result}
    for name, run in result.pop("runs", {}).items():
        entries[name] = dict(run, engine_start_s=result.get("engine_start_s"),
                             kv_cache_tokens=result["kv_cache_tokens"], log=str(log_file))
    for name, entry in entries.items():
        if "error" in entry:
            log(f"{config} {name}: FAILED in {seconds:.0f} s: {entry['error'][:2000]}")
        else:
            log(f"{config} {name}: {seconds:.0f} s; {one_line(entry)}")
    return entries


if __name__ == "__main__":
    sys.exit(main())
