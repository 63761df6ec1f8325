"""The shadowsync path: the trainer in a process of its own (a Sender over the same-host or NCCL
transport), the worker extension in vLLM's workers (bench_vllm_update.py's docstring says the
sequence)."""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from run_report import log

from .checkpoint import make_model
from .configs import ENGINE_EVENTS
from .helper_pipe import pipe_recv
from .paths import PYTHON_DIR


def trainer_process(conn, config: str, device: str, path: str, token: bytes, bucket_bytes: int,
                    checksums: bool = True, receivers: int = 1, nccl: bool = False, gpu: int = 0,
                    layers: int | None = None):
    """The shadowsync trainer, on GPU `gpu`: a transformers model of `config` (`layers` decoder
    layers, when given) and one Sender to `receivers` engine ranks over the same-host transport
    (GPU memory on cuda, a shared memory file on cpu) or, with `nccl`, NCCL (rank 0 of 1 +
    receivers; the unique id goes to the engine with the specs), sending per-bucket checksums
    when `checksums` (SenderConfig.checksums). Answers ("publish", version) with ("header",
    bytes, seconds, the header's bucket count: one more with checksums) then ("sent", seconds);
    ("serve", path[, checksums]) closes the Sender and serves a new same-host transport on `path`
    (a re-initialized engine group), answering ("ready", ...) again; ("stop",) ends it."""
    try:
        sys.path.insert(0, str(PYTHON_DIR))
        import shadowsync as ss

        if device == "cuda":
            import torch

            torch.cuda.set_device(gpu)
        model = make_model(config, device, seed=2, gpu=gpu, layers=layers)
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


async def timed(awaitable) -> float:
    """Seconds until `awaitable` completed (its result dropped)."""
    t0 = time.monotonic()
    await awaitable
    return time.monotonic() - t0


class ShadowsyncTransfer:
    """shadowsync's path: the trainer in its own process, the extension in vLLM's worker.
    `api` (path "shadowsync-api"): the same trainer and backend, driven through vLLM's own
    weight-transfer calls (init_weight_transfer_engine, start_weight_update, update_weights,
    finish_weight_update) instead of the extension's."""

    def __init__(self, args, api: bool = False):
        self.args = args
        self.api = api
        self.process = None
        self.conn = None
        self.socket_dir = None

    def api_description(self) -> str:
        import shadowsync

        transport = ("NCCL transport" if self.args.transport == "nccl" else
                     f"same-host transport (memory="
                     f"{'device' if self.args.device == 'cuda' else 'host'})")
        calls = ("vLLM's weight-transfer API (init_weight_transfer_engine; start_weight_update, "
                 "update_weights, finish_weight_update)" if self.api
                 else f"WorkerExtension, {self.live_call()}")
        return (f"shadowsync {shadowsync.__version__}: {transport}, {calls}; "
                f"library {shadowsync.library_path()}")

    def step_agreed(self) -> bool:
        """--commit-mode auto under --tp > 1: the ranks' step hooks make each update live."""
        return self.args.tp > 1 and getattr(self.args, "commit_mode", None) == "auto"

    def live_call(self) -> str:
        """How an update goes live: the front-end call that returns once it is."""
        if self.args.tp > 1 and not self.step_agreed():
            return "commit_update_async"
        return "apply_update_async" + (" (commit_mode auto: the step hooks agree on the step)"
                                       if self.step_agreed() else "")

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
            checksums, self.args.tp, self.args.transport == "nccl", self.args.trainer_gpu),
            # bench_vllm_pacing.py has no --layers: getattr
            kwargs=dict(layers=getattr(self.args, "layers", None)))
        self.process.start()
        specs, self.unique_id = await self.recv("specs")
        t0 = time.monotonic()
        self.specs = specs
        kwargs = self.init_kwargs(path, init_extra)
        # At once: the workers' init blocks until the trainer's transport is up (NCCL: both
        # join one communicator), and a trainer that fails says so here instead of leaving the
        # workers waiting unheard.
        if self.api:
            from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

            from shadowsync.vllm import ShadowsyncInitInfo

            call = "init_weight_transfer_engine (backend shadowsync)"
            joined = engine.init_weight_transfer_engine(WeightTransferInitRequest(
                init_info=ShadowsyncInitInfo(**kwargs).to_rpc()))
        else:
            call = "collective_rpc('init_weight_update_group')"
            joined = engine.collective_rpc("init_weight_update_group", kwargs=kwargs)
        # The set-up call alone (the receive plan, the receiver's memory, joining the trainer's
        # transport): the trainer's model is built before the specs come.
        init_s, (arena_bytes, bucket_bytes) = await asyncio.gather(timed(joined),
                                                                   self.recv("ready"))
        self.bytes = arena_bytes
        return dict(trainer=f"transformers model in its own process on cuda:"
                            f"{self.args.trainer_gpu}" if self.args.device == "cuda" else
                            "transformers model in its own process", tensors=len(specs),
                    transport=self.args.transport, tp=self.args.tp,
                    bytes=arena_bytes, bucket_bytes=bucket_bytes, **await self.joined(engine),
                    init_s=round(time.monotonic() - t0, 2),
                    update_setup_call=call, update_setup_s=round(init_s, 3))

    async def joined(self, engine) -> dict:
        """What the engine's workers set up for the group just initialized (their receive plan,
        swap strategy and placement, the wire fingerprint); installs --trace-steps' tracer once
        per engine (a later group's driver finds it there: it outlives a group)."""
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        swap = (await engine.collective_rpc("memory_report"))[0]["swap"]
        if self.args.trace_steps and not getattr(self.args, "trace_installed", False):
            import vllm_step_trace

            try:
                await engine.collective_rpc(vllm_step_trace.install)
                self.args.trace_installed = True
            except Exception as e:  # noqa: BLE001  (a diagnostic: the measurement goes on)
                log(f"--trace-steps: the tracer could not be installed ({type(e).__name__}: {e})")
                self.args.trace_steps = False
        return dict(plan_copies=stats["plan_copies"],
                    swap_strategy=stats["swap_strategy"], live_arena=stats["live_arena"],
                    graph_pairs=stats.get("graph_pairs", False),
                    step_hook_at=stats.get("step_hook_at"),
                    gated_swaps="off" if getattr(self.args, "no_gated_swaps", False) else "auto",
                    placement=None if swap is None else f"{swap['placement']}: {swap['why']}",
                    fingerprint=f"{stats['wire_fingerprint']:#018x}")

    def init_kwargs(self, path: str, init_extra: dict | None) -> dict:
        kwargs = self.group_settings(init_extra)
        if self.unique_id is not None:  # NCCL: this worker is rank 1 + its TP rank
            kwargs.update(unique_id=self.unique_id, rank_offset=1, world_size=1 + self.args.tp)
        else:
            kwargs["same_host"] = dict(path=path, token=self.token)
        return kwargs

    def group_settings(self, init_extra: dict | None) -> dict:
        """init_weight_update_group's keyword arguments but the transport's: the trainer's specs,
        the buckets and the options of the command line (`init_extra` on top)."""
        kwargs = dict(specs=self.specs, bucket_bytes=self.args.bucket_bytes, **(init_extra or {}))
        if self.args.swap_strategy:
            kwargs["swap_strategy"] = self.args.swap_strategy
        if self.args.decode_slowdown_budget:
            kwargs["decode_slowdown_budget"] = self.args.decode_slowdown_budget
        if getattr(self.args, "no_gated_swaps", False):
            kwargs["gated_swaps"] = False
        if self.step_agreed():
            kwargs["commit_mode"] = "auto"
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
        if self.api:
            from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(
                update_info={"header": base64.b64encode(header).decode()}))
        else:
            await engine.collective_rpc("begin_update", args=(header,))
        t2 = time.perf_counter()
        (sent_s,) = await self.recv("sent")
        t3 = time.perf_counter()
        if self.api:  # committed on every rank: the next step runs on it
            await engine.finish_weight_update()
            applied = version
        elif self.args.tp > 1 and not self.step_agreed():  # coordinated: every rank makes it
            # live between the same two steps
            applied = await commit_update_async(engine, version, timeout=60,
                                                reset_prefix_cache=False, **poll)
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
        # Every worker's (a sharded trainer's driver reads each engine rank's routed bytes).
        self.last_stats = await engine.collective_rpc("weight_update_stats")
        stats = self.last_stats[0]
        # The worker stamps time.monotonic(); the gaps are on perf_counter (one clock from
        # Python 3.13 on, the same CLOCK_MONOTONIC on Linux before; the offset covers both).
        offset = time.perf_counter() - time.monotonic()
        times = {}
        for event in ENGINE_EVENTS:
            times[f"{event}_ms"] = round(stats[f"last_{event}_s"] * 1e3, 3)
            times[f"{event}_started_at"] = stats[f"last_{event}_started_s"] + offset
        # Of the swap: what the worker's Python swap callback took (rebinding, graph sets).
        times["swap_callback_ms"] = round(stats.get("last_swap_callback_s", 0.0) * 1e3, 3)
        # Of commit_update (coordinated): the ranks' agreement that every one holds it ready.
        times["commit_check_ms"] = round(stats.get("last_commit_check_s", 0.0) * 1e3, 3)
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

    async def close(self, engine, keep_weights: bool = False) -> dict:
        """Ends the group (`keep_weights`: the engine runs on after it, close_weight_update_group's
        argument); with --tp > 1 first compares the ranks' per-step versions (every rank must
        have made each version live at the same step): a difference is an error."""
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
        # The trainer's close and the engine's run side by side: over NCCL each end's
        # ncclCommFinalize waits for the other's (up to finalize_timeout_ms).
        self.conn.send(("stop",))
        await engine.collective_rpc("close_weight_update_group",
                                    kwargs=dict(keep_weights=keep_weights))
        try:
            checked.update(await self.trainer_stopped())
        except TimeoutError as e:  # kept with the measured updates; the run's exit status fails
            checked["trainer_stop_error"] = str(e)
            log(f"trainer_stop_error: {e}")
        if not checked.get("step_versions_agree", True):
            raise RuntimeError(f"the ranks made versions live at different steps: "
                               f"{checked['rank_transitions']}")
        return checked

    async def trainer_stopped(self) -> dict:
        """After ("stop",): waits for the trainer process to end; returns what it reported at its
        end (nothing here). One that does not end within 60 s is an error."""
        await asyncio.to_thread(self.process.join, 60)
        if self.process.is_alive():
            raise TimeoutError("trainer: still running 60 s after ('stop',)")
        return {}

    def shutdown(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
