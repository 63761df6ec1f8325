"""The shadowsync path's sharded-trainer variant (--trainer-ranks M): M trainer rank processes on
the engine's GPU (under TP, rank r on engine rank r mod tp's GPU), each holding only its rows of
every parameter (shard_regions: FSDP2-like Shard(0)), each publishing them with a routed Sender
over the same-host pull transport, the engine pulling every route into its slot straight from
the rank's shards (read in place on GPUs; from its staging otherwise)
(ShadowsyncInitInfo.trainer_ranks, after weight_update_needs). With
--transport nccl the ranks run on GPUs --trainer-gpu.. (none of the engine's: NCCL refuses two
ranks of one communicator on one GPU) and send their routes over NCCL point-to-point
(trainer_ranks["nccl"]). The engine side, the update and its analysis are the shadowsync path's
(ShadowsyncTransfer), with the ranks' pipes read as one trainer's."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from run_report import log

from .checkpoint import model_specs
from .paths import PYTHON_DIR
from .shadowsync_transfer import ShadowsyncTransfer, timed
from .shard_regions import shard0_regions

CONNECT_TIMEOUT_MS = 120_000  # the ranks serve while the workers plan and map: 8B on one GPU


def rank_memory(torch, gpu: int | None, held: int, staging: int) -> dict:
    """A trainer rank process's memory: held_bytes (its shards), staging_bytes (what its Sender
    packs into, which torch does not see), torch_peak_bytes (torch.cuda.max_memory_allocated on
    GPU `gpu`; None on the CPU) and peak_bytes, their sum (the CPU: held + staging)."""
    peak = None if gpu is None else torch.cuda.max_memory_allocated(gpu)
    return dict(held_bytes=held, staging_bytes=staging, torch_peak_bytes=peak,
                peak_bytes=(held if peak is None else peak) + staging)


def answer_publishes(conn, publish, memory) -> None:
    """A trainer rank's part of the path: answers ("ready", memory()), then each ("publish",
    version) with ("header", header bytes, seconds, bucket count) and ("sent", seconds, peak
    bytes) once `publish(version)`'s handle was sent (a rank whose `publish` returns None sends
    nothing itself: header 0 and 0 buckets); returns at ("stop",)."""
    conn.send(("ready", memory()))
    while True:
        message = conn.recv()
        if message[0] == "stop":
            return
        if message[0] != "publish":
            raise RuntimeError(f"expected ('publish', version) or ('stop',), got {message!r}")
        start = time.perf_counter()
        handle = publish(message[1])
        if handle is None:
            conn.send(("header", 0, time.perf_counter() - start, 0))
        else:
            conn.send(("header", handle.header_bytes, time.perf_counter() - start,
                       handle.header.bucket_count))
            handle.wait(120)
        handle = None  # what it holds goes before the next publish makes more
        conn.send(("sent", time.perf_counter() - start, memory()["peak_bytes"]))


def trainer_rank_process(conn, rank: int, specs: list, regions: list, device: str, gpu: int,
                         bucket_bytes: int, seed: int, nccl_gpus: list[int] | None = None):
    """Trainer rank `rank` (of len(regions)): makes its rows of `specs` (random, on GPU `gpu` on
    cuda, in host memory on cpu; no full tensor is ever made) and answers ("shards", held bytes,
    nccl): with `nccl_gpus` (every communicator rank's GPU, the trainer ranks first) rank 0's
    nccl is trainer_ranks["nccl"] (a unique id and the GPUs' names), else None. ("plan", engine
    needs, path, token, nccl) builds the routing plan from every rank's `regions` and the needs,
    answers ("plan", fingerprint, bytes to each engine rank, bytes from this rank, wire bytes),
    then serves the same-host pull transport on `path` or, given nccl, joins the NCCL
    communicator (either blocks until every engine rank connected) and answers ("ready",
    memory). Then as the shadowsync path's trainer:
    ("publish", version) -> ("header", bytes, seconds, bucket count), ("sent", seconds, torch's
    peak bytes); ("stop",) -> ("stopped", memory).

    memory: held_bytes (its shards), staging_bytes (Sender.staging_bytes: the transport's two
    staging slots, 2 x plan.max_packed_bytes(rank), a cuMem allocation torch does not see),
    torch_peak_bytes (torch.cuda.max_memory_allocated: the shards and anything torch made; None
    on cpu) and peak_bytes = torch_peak_bytes + staging_bytes (cpu: held + staging)."""
    try:
        sys.path.insert(0, str(PYTHON_DIR))
        import torch

        import shadowsync as ss
        from shadowsync.vllm.init_info import trainer_regions

        cuda = device == "cuda"
        if cuda:
            torch.cuda.set_device(gpu)
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.manual_seed(seed)
        every = trainer_regions({"regions": regions})
        # Small values: a model of random weights that stays finite (vLLM's dummy load: ±1e-3).
        shards = [(r.tensor, torch.empty(r.shape, dtype=dtype, device=f"cuda:{gpu}" if cuda
                                         else "cpu").uniform_(-0.02, 0.02), r)
                  for r in every[rank]]
        held = sum(t.numel() * t.element_size() for _, t, _ in shards)
        nccl = None
        if nccl_gpus is not None and rank == 0:
            nccl = dict(unique_id=ss.nccl_unique_id(), gpus=[ss.gpu_name(g) for g in nccl_gpus])
        conn.send(("shards", held, nccl))
        _, needs, path, token, nccl = conn.recv()
        layout = ss.Layout(specs, bucket_bytes=bucket_bytes)
        plan = ss.RoutingPlan(layout, every, [[ss.WireRange(*r) for r in n] for n in needs])
        conn.send(("plan", plan.fingerprint, [plan.bytes_to_engine(e)
                                              for e in range(plan.engine_count)],
                   plan.bytes_from_trainer(rank), sum(g.arena_bytes for g in layout.groups)))
        backend = ss.CudaBackend(gpu) if cuda else ss.HostBackend()
        if nccl is not None:
            transport = ss.nccl_routed_transport(nccl["unique_id"], plan, rank, gpu, backend,
                                                 nccl["gpus"])
        else:
            transport = ss.same_host_pull_trainer_transport(
                path, token, plan, rank, plan.engine_count, backend,
                memory="device" if cuda else "host", connect_timeout_ms=CONNECT_TIMEOUT_MS)
        sender = ss.Sender(layout, backend, transport, routing_plan=plan, trainer_rank=rank)
        staging = sender.staging_bytes

        # (True, "") when the engine read the last update where the shards lie, (False, why) when
        # it was packed into the staging first; read before the sender closes.
        in_place = [None, ""]

        def memory() -> dict:
            return dict(rank_memory(torch, gpu if cuda else None, held, staging),
                        max_packed_bytes=plan.max_packed_bytes(rank), routes_in_place=in_place)

        answer_publishes(conn, lambda version: sender.publish_shards(version, shards), memory)
        in_place[:] = list(sender.routes_in_place)
        sender.close()
        conn.send(("stopped", memory()))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"trainer rank {rank}: {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()[-2000:]}"))


class RankPipes:
    """The pipes of the trainer rank processes, read as one trainer's (pipe_recv's conn): a
    message goes to every rank; an answer is every rank's, merged: "header" is rank 0's (every
    rank's header is the update's) with the longest publish, "sent" the last rank's time; others
    come as (name, [each rank's message]). The last answer of each rank stays in `last`. A rank's
    error is answered as soon as it came, though the other ranks are still silent (one may wait
    in a collective for the failed one)."""

    def __init__(self, pipes: list):
        self.pipes = pipes
        self.last: list = []
        self.waiting: list = [None] * len(pipes)  # each rank's message read by poll, not recv

    def send(self, message) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    def poll(self, timeout: float) -> bool:
        """Whether every rank answered, or one answered with an error, within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            for i, pipe in enumerate(self.pipes):
                if self.waiting[i] is None and pipe.poll():
                    self.waiting[i] = pipe.recv()
            if all(w is not None for w in self.waiting) or any(
                    w is not None and w[0] == "error" for w in self.waiting):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(0.01, left))

    def recv(self):
        failed = [w for w in self.waiting if w is not None and w[0] == "error"]
        if failed:
            self.waiting = [None] * len(self.pipes)
            return ("error", "; ".join(g[1] for g in failed))
        got = [w if w is not None else pipe.recv() for w, pipe in zip(self.waiting, self.pipes)]
        self.waiting = [None] * len(self.pipes)
        failed = [g for g in got if g[0] == "error"]
        if failed:
            return ("error", "; ".join(g[1] for g in failed))
        self.last = got
        if got[0][0] == "header":
            return ("header", got[0][1], max(g[2] for g in got), got[0][3])
        if got[0][0] == "sent":
            return ("sent", max(g[1] for g in got))
        return (got[0][0], got)


class RankProcesses(ShadowsyncTransfer):
    """The shadowsync path fed by `count` trainer rank processes, whose pipes are read as one
    trainer's (RankPipes); each answers ("sent", seconds, peak bytes) and ("stopped", memory)."""

    def __init__(self, args, count: int):
        super().__init__(args)
        self.count = count
        self.processes: list = []

    def start_ranks(self, target, rank_args) -> None:
        """One spawned process per rank running `target(pipe, *rank_args(rank))`."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        pipes = []
        for rank in range(self.count):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=target, daemon=True, args=(child, *rank_args(rank)))
            process.start()
            child.close()  # a rank that dies ends its pipe's recv with EOFError
            pipes.append(parent)
            self.processes.append(process)
        self.conn = RankPipes(pipes)

    async def update(self, engine, version: int) -> dict:
        info = await super().update(engine, version)
        sent = self.conn.last  # every rank's ("sent", seconds, peak bytes)
        info["trainer_rank_sent_ms"] = [round(s[1] * 1e3, 3) for s in sent]
        info["trainer_rank_peak_bytes"] = [s[2] for s in sent]
        return info

    async def trainer_stopped(self) -> dict:
        deadline = time.monotonic() + 60
        (stopped,) = await self.recv("stopped", timeout=60)
        for process in self.processes:
            await asyncio.to_thread(process.join, max(0.0, deadline - time.monotonic()))
        alive = [rank for rank, process in enumerate(self.processes) if process.is_alive()]
        if alive:
            raise TimeoutError(f"trainer ranks {alive}: still running 60 s after ('stop',)")
        self.memory = [m[1] for m in stopped]
        log(f"{self.count} trainer ranks' memory: {self.memory}")
        return dict(trainer_rank_memory=self.memory)

    def shutdown(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(10)
        super().shutdown()


class ShardedTransfer(RankProcesses):
    """The shadowsync path fed by `count` trainer ranks (see the module's doc)."""

    def __init__(self, args, count: int):
        super().__init__(args, count)
        self.nccl = args.transport == "nccl"

    def api_description(self) -> str:
        import shadowsync

        memory = "device" if self.args.device == "cuda" else "host"
        transport = ("NCCL point-to-point routes" if self.nccl else
                     f"same-host pull transport (memory={memory})")
        return (f"shadowsync {shadowsync.__version__}: {self.count} trainer ranks (FSDP2-like "
                f"Shard(0) rows), {transport}, "
                f"weight_update_needs + init_weight_update_group(trainer_ranks=...), "
                f"WorkerExtension, {self.live_call()}; library {shadowsync.library_path()}")

    async def setup(self, engine, init_extra: dict | None = None, checksums: bool = True) -> dict:
        """Starts the ranks, plans the routes with the engine's needs, joins them (checksums:
        the routed Sender sends none; the argument is the shadowsync path's)."""
        from shadowsync.vllm import init_weight_update_group_async, weight_update_needs_async

        socket_dir = self.socket_dir = Path(tempfile.mkdtemp(prefix="ss-bench-ranks-"))  # 0700
        self.specs = specs = model_specs(self.args.config, self.args.device,
                                         getattr(self.args, "layers", None))
        regions = shard0_regions(specs, self.count)
        gpus = self.rank_gpus()
        nccl_gpus = gpus + list(range(self.args.tp)) if self.nccl else None
        self.start_ranks(trainer_rank_process, lambda rank: (
            rank, specs, regions, self.args.device, gpus[rank], self.args.bucket_bytes,
            1000 * self.count + rank, nccl_gpus))
        pipes = self.conn.pipes
        (shards,) = await self.recv("shards")
        held, nccl = [m[1] for m in shards], shards[0][2]
        t0 = time.monotonic()
        if self.nccl:
            ranks = dict(count=self.count, regions=regions, nccl=nccl)
        else:
            ranks = dict(count=self.count, token=os.urandom(32).hex(), regions=regions,
                         paths=[str(socket_dir / f"rank{r}.sock") for r in range(self.count)],
                         connect_timeout_ms=CONNECT_TIMEOUT_MS)
        settings = self.group_settings(init_extra)
        needs = await weight_update_needs_async(engine, **settings, trainer_ranks=ranks)
        for rank, pipe in enumerate(pipes):
            pipe.send(("plan", needs, None if self.nccl else ranks["paths"][rank],
                       ranks.get("token"), nccl))
        (plans,) = await self.recv("plan")
        fingerprint, self.to_engine, wire_bytes = plans[0][1], plans[0][2], plans[0][4]
        own = [sum(end - begin for _, begin, end in n) for n in needs]
        if any(p[1] != fingerprint for p in plans) or self.to_engine != own:
            raise RuntimeError(f"the trainer ranks' routing plans disagree: fingerprints "
                               f"{[f'{p[1]:#018x}' for p in plans]}, bytes to each engine rank "
                               f"{self.to_engine} (its needs: {own})")
        joined = init_weight_update_group_async(
            engine, **settings, trainer_ranks=dict(ranks, engine_needs=needs,
                                                   fingerprint=fingerprint))
        init_s, (ready,) = await asyncio.gather(timed(joined), self.recv("ready"))
        self.memory = [m[1] for m in ready]
        self.bytes = wire_bytes
        self.routed: list[list[int]] = []
        where = ("the cpu" if self.args.device != "cuda" else
                 ", ".join(f"rank {r} on cuda:{g}" for r, g in enumerate(gpus)))
        return dict(trainer=f"{self.count} trainer rank processes ({where}), each with its rows "
                            "only (FSDP2-like Shard(0), torch.chunk's split)",
                    trainer_ranks=self.count, tensors=len(specs),
                    transport="nccl routes" if self.nccl else "same-host pull", tp=self.args.tp,
                    bytes=wire_bytes,
                    bucket_bytes=self.args.bucket_bytes, **await self.joined(engine),
                    routing_fingerprint=f"{fingerprint:#018x}",
                    bytes_to_engine_rank=self.to_engine,
                    bytes_from_trainer_rank=[p[3] for p in plans], trainer_rank_held_bytes=held,
                    trainer_rank_memory=self.memory, init_s=round(time.monotonic() - t0, 2),
                    update_setup_call="weight_update_needs + collective_rpc("
                                      "'init_weight_update_group', trainer_ranks)",
                    update_setup_s=round(init_s, 3))

    def rank_gpus(self) -> list[int]:
        """Each trainer rank's GPU: over NCCL, GPU --trainer-gpu + r for rank r (a GPU of its
        own); else --trainer-gpu for every rank of a TP=1 engine and, under TP, rank r beside
        engine rank r mod tp (a sharded trainer colocated with the engine's GPUs: routes within a
        GPU and, by peer copies, across them)."""
        if self.nccl:
            return [self.args.trainer_gpu + rank for rank in range(self.count)]
        if self.args.tp == 1:
            return [self.args.trainer_gpu] * self.count
        return [rank % self.args.tp for rank in range(self.count)]

    async def engine_times(self, engine) -> dict:
        """The shadowsync path's, and the bytes the update's routes carried into each engine
        rank (weight_update_stats' routed_bytes: the transport's count over that update), and
        of those, the bytes read where the trainer ranks' shards lie (routed_in_place_bytes:
        nothing packed on the trainer side)."""
        times = await super().engine_times(engine)
        times["engine_rank_bytes"] = [int(s["routed_bytes"]) for s in self.last_stats]
        times["engine_rank_in_place_bytes"] = [int(s.get("routed_in_place_bytes", 0))
                                               for s in self.last_stats]
        self.routed.append(times["engine_rank_bytes"])
        return times

    async def close(self, engine, keep_weights: bool = False) -> dict:
        """The shadowsync path's close; an update whose routes carried other bytes into an
        engine rank than the plan's is an error (after the group is closed)."""
        checked = await super().close(engine, keep_weights)
        wrong = [r for r in self.routed if r != self.to_engine]
        checked["engine_rank_bytes_equal_plan"] = not wrong
        if wrong:
            raise RuntimeError(f"routed bytes per engine rank {wrong[0]} in an update, the plan's "
                               f"{self.to_engine}")
        return checked

