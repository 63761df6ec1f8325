"""One path in its own process (bench_vllm_update.py --child PATH): one vLLM AsyncLLM under the
decode load, the path's warm-up update and its measured updates (with --trainer-ranks and
--gather-ranks, the shadowsync path's sharded trainers' after them, on the same engine: the
result's "runs"), and the result file the orchestrator reads."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from run_report import fmt_ms, log

from .configs import (GPU_MEMORY_UTILIZATION, LIVE_ARENA_GPU_MEMORY_UTILIZATION, PROMPT_LEN,
                      VLLM_BACKENDS, model_label)
from .copy_reference import CopyReference
from .decode_load import DecodeLoad
from .paths import BENCH_DIR, PYTHON_DIR, prepend_pythonpath
from .shadowsync_transfer import ShadowsyncTransfer
from .gather_transfer import GatherTransfer
from .sharded_transfer import ShardedTransfer
from .stand_ins import STAND_IN_FOLDER, import_ipc_engine
from .vllm_transfer import VllmTransfer


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
        arena = args.live_arena or args.graph_pairs or getattr(args, "backend", None)
        table = LIVE_ARENA_GPU_MEMORY_UTILIZATION if extension and arena else \
            GPU_MEMORY_UTILIZATION
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=args.gpu_memory_utilization
                      or table[args.config])
        # --quantization: vLLM quantizes the bf16 checkpoint while loading (bench_vllm_pacing.py
        # has no such option: getattr).
        if getattr(args, "quantization", None):
            kwargs["quantization"] = args.quantization
    if extension:
        kwargs["worker_extension_cls"] = "shadowsync.vllm.WorkerExtension"
        if args.graph_pairs:
            kwargs["weight_transfer_config"] = {"backend": "shadowsync_graph_pairs"}
        elif args.live_arena:
            kwargs["weight_transfer_config"] = {"backend": "shadowsync_live_arena"}
        elif getattr(args, "backend", None):
            kwargs["weight_transfer_config"] = {"backend": args.backend}
    elif args.child == "vllm":  # its worker loads vLLM's IPC (and its stand-ins) or NCCL engine
        kwargs["weight_transfer_config"] = {"backend": VLLM_BACKENDS[args.transport]}
    return kwargs


def child_main(args) -> int:
    result: dict = {"path": args.child, "config": args.config,
                    "model": model_label(args.config, args.layers), "layers": args.layers,
                    "quantization": args.quantization}
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer may be absent
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The same-host transport's sender waits for acks on its stream: more hardware queues make
    # it less likely to share one with the engine's work (docs/reference/environment.md).
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


async def run_child(args, result: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    path = args.child
    driver = ({"vllm": VllmTransfer, "shadowsync": ShadowsyncTransfer, "copy": CopyReference,
               "shadowsync-api": lambda a: ShadowsyncTransfer(a, api=True)}[path](args))
    result["api"] = driver.api_description()
    log(f"{path}: {result['api']}")
    t0 = time.monotonic()
    if path == "shadowsync-api" and not getattr(args, "backend", None):
        args.backend = "shadowsync"  # vLLM's calls reach a weight-transfer backend only
    kwargs = engine_args(args, extension=path.startswith("shadowsync"))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    result["engine_start_s"] = round(time.monotonic() - t0, 1)
    log(f"{path}: engine up in {result['engine_start_s']} s")
    try:
        load = DecodeLoad(engine, args)
        # With --trainer-ranks and --gather-ranks, the sharded trainers follow on the same
        # engine: the group is closed keeping the weights.
        follow = follow_on_drivers(args) if path == "shadowsync" else []
        result.update(await measure(driver, engine, load, path, keep_weights=bool(follow)))
        if follow:
            result["runs"] = {}
            await follow_on_runs(args, engine, load, follow, result)
    finally:
        engine.shutdown()
        driver.shutdown()
    return result


async def measure(driver, engine, load, name: str, keep_weights: bool = False) -> dict:
    """One driver's set-up, warm-up update and measured updates on the running `engine` under
    `load`, and its close; its part of the result."""
    result: dict = {}
    before = await load.greedy_probe()
    t0 = time.monotonic()
    result["setup"] = await driver.setup(engine)
    result["setup_s"] = round(time.monotonic() - t0, 2)
    # The weight-update set-up's own call (shadowsync: init_weight_update_group; vllm:
    # init_weight_transfer_engine), without starting or building the trainer around it.
    for key in ("update_setup_call", "update_setup_s"):
        if key in result["setup"]:
            result[key] = result["setup"][key]
    log(f"{name}: set up in {result['setup_s']} s: {result['setup']}")
    warm = await driver.update(engine, version=1)
    after = await load.greedy_probe()
    result["warmup_update"] = warm
    result["output_changed_by_update"] = before != after
    log(f"{name}: warm-up update {fmt_ms(warm['update_ms'])}; greedy output "
        f"{'changed' if before != after else 'UNCHANGED'} ({before[:6]} -> {after[:6]})")
    measured = await load.measure(lambda v: driver.update(engine, v), first_version=2,
                                  engine_times=getattr(driver, "engine_times", None) and
                                  (lambda: driver.engine_times(engine)))
    result.update(measured)
    closed = await (driver.close(engine, keep_weights) if keep_weights else driver.close(engine))
    result.update(closed or {})
    return result


def follow_on_drivers(args) -> list:
    """The shadowsync path's sharded trainers, as (run name, its keys, driver): one routing its
    shards per --trainer-ranks count ("shadowsync-ranks-M"), then one gathering to rank 0 per
    --gather-ranks count ("shadowsync-gather-M")."""
    return ([(f"shadowsync-ranks-{m}", {"trainer_ranks": m}, ShardedTransfer(args, m))
             for m in getattr(args, "trainer_ranks", None) or []]
            + [(f"shadowsync-gather-{m}", {"gather_ranks": m}, GatherTransfer(args, m))
               for m in getattr(args, "gather_ranks", None) or []])


async def follow_on_runs(args, engine, load, drivers: list, result: dict) -> None:
    """After the shadowsync path's own run, each of `drivers` (follow_on_drivers) in turn takes
    over the same engine, its run in result["runs"][name]; a run that fails is recorded and the
    next one still runs, on a group closed again where the failure left it open. The result file
    is written after each run: a path cut at its deadline keeps the runs done."""
    runs = result["runs"]
    for i, (name, keys, driver) in enumerate(drivers):
        run: dict = {"path": "shadowsync", **keys}
        run["api"] = driver.api_description()
        log(f"{name}: {run['api']}")
        try:
            run.update(await measure(driver, engine, load, name,
                                     keep_weights=i + 1 < len(drivers)))
        except Exception as e:  # noqa: BLE001  (recorded, the next count runs)
            run["error"] = f"{type(e).__name__}: {e}"
            run["traceback"] = traceback.format_exc()[-4000:]
            print(run["traceback"], file=sys.stderr, flush=True)
            if any(await engine.collective_rpc("has_weight_update_group")):
                await engine.collective_rpc("close_weight_update_group",
                                            kwargs=dict(keep_weights=True))
        finally:
            driver.shutdown()
        runs[name] = run
        Path(args.result_file).write_text(json.dumps(result, indent=1))
