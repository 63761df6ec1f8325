"""The one-process path fed by a sharded trainer that gathers first (--gather-ranks M): what an
FSDP2 trainer does today to hand its weights to one sender. M trainer rank processes (rank r on
GPU r; on the CPU all of them, over gloo) each hold only their rows of every parameter (the
sharded variant's Shard(0) split, shard_regions). Each update, every rank all-gathers every
parameter the way FSDP2's ``full_tensor()`` does (uneven shards padded to the chunk size, one
all-gather per parameter, every rank receiving the full tensor), rank 0 keeps them all and
publishes them with one Sender over the same-host transport, as the shadowsync path's trainer;
the other ranks drop theirs. The update's time counts from the publish request, so it includes
the gather; on GPUs rank 0's peak memory includes the gathered model (torch's peak; on the CPU
the report has the rows and the staging only). The engine side, the update and its
analysis are the shadowsync path's, with the ranks' pipes read as one trainer's (RankProcesses)."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .checkpoint import model_specs
from .paths import PYTHON_DIR
from .shadowsync_transfer import timed
from .shard_regions import shard0_regions
from .sharded_transfer import RankProcesses, answer_publishes, rank_memory


def gathered(torch, specs: list, shards: dict, rank: int, count: int, all_gather, dtype,
             device) -> dict:
    """Every parameter of `specs` in full, as FSDP2's full_tensor() makes it: this rank's rows
    (`shards`, split as shard_regions splits them; a rank may hold none of a small tensor), padded
    to the chunk size when uneven, all-gathered (`all_gather(out, piece)`, one call per parameter,
    every rank taking part) into tensors of `dtype` on `device`; rank 0 keeps the full tensors
    ({name: tensor}), the other ranks get None for each. A scalar is rank 0's."""
    full = {}
    for name, _, shape in specs:
        shape = list(shape)
        if not shape:
            full[name] = shards[name] if rank == 0 else None
            continue
        chunk = -(-shape[0] // count)
        piece = shards.get(name)
        if piece is None or piece.shape[0] != chunk:  # uneven: padded, as FSDP2 pads
            padded = torch.zeros([chunk] + shape[1:], dtype=dtype, device=device)
            if piece is not None:
                padded[:piece.shape[0]].copy_(piece)
            piece = padded
        out = torch.empty([chunk * count] + shape[1:], dtype=dtype, device=device)
        all_gather(out, piece)
        full[name] = out[:shape[0]] if rank == 0 else None
    return full


def gather_rank_process(conn, rank: int, count: int, specs: list, regions: list, device: str,
                        store: str, path: str, token: bytes, bucket_bytes: int, receivers: int,
                        seed: int):
    """Trainer rank `rank` of `count`: its rows of `specs` (random, on GPU `rank` on cuda), a
    process group of the ranks (NCCL on cuda, gloo on cpu; rendezvous in the file `store`).
    Answers ("shards", held bytes); then rank 0 serves the same-host transport on `path` for
    `receivers` engine ranks and every rank answers ("ready", memory). ("publish", version):
    every rank gathers every parameter, rank 0 publishes them, and each answers ("header", bytes,
    seconds, bucket count) (the other ranks: 0, their gather's seconds, 0) and ("sent",
    seconds, peak bytes); ("stop",) -> ("stopped", memory): rank_memory's, the staging being
    rank 0's Sender's (the other ranks: 0)."""
    try:
        sys.path.insert(0, str(PYTHON_DIR))
        import torch
        import torch.distributed as dist

        import shadowsync as ss
        from shadowsync.vllm.init_info import trainer_regions

        cuda = device == "cuda"
        if cuda:
            if rank >= torch.cuda.device_count():
                raise RuntimeError(f"--gather-ranks {count}: rank {rank} runs on GPU {rank}, and "
                                   f"this machine has {torch.cuda.device_count()}; run at most "
                                   f"{torch.cuda.device_count()} ranks")
            torch.cuda.set_device(rank)
        where = f"cuda:{rank}" if cuda else "cpu"
        dtype = torch.bfloat16 if cuda else torch.float32
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}",
                                rank=rank, world_size=count)
        torch.manual_seed(seed)
        mine = {r.tensor: r for r in trainer_regions({"regions": regions})[rank]}
        shards = {name: torch.empty(mine[name].shape, dtype=dtype, device=where)
                  .uniform_(-0.02, 0.02) for name, _, _ in specs if name in mine}
        held = sum(t.numel() * t.element_size() for t in shards.values())
        # torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        conn.send(("shards", held))

        sender, staging = None, 0
        if rank == 0:
            layout = ss.Layout(specs, bucket_bytes=bucket_bytes)
            backend = ss.CudaBackend(0) if cuda else ss.HostBackend()
            transport = ss.same_host_sender_transport(
                path, token, receivers, backend, slot_bytes=layout.groups[0].bucket_bytes,
                memory="device" if cuda else "host")
            sender = ss.Sender(layout, backend, transport, ss.SenderConfig(checksums=False))
            staging = sender.staging_bytes

        def memory() -> dict:
            return rank_memory(torch, rank if cuda else None, held, staging)

        def publish(version: int):
            # Every rank takes part; rank 0 keeps the tensors and sends them.
            full = gathered(torch, specs, shards, rank, count, all_gather, dtype, where)
            return None if sender is None else sender.publish(version, full)

        answer_publishes(conn, publish, memory)
        if sender is not None:
            sender.close()
        dist.destroy_process_group()
        conn.send(("stopped", memory()))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"trainer rank {rank}: {type(e).__name__}: {e}\n"
                            f"{traceback.format_exc()[-2000:]}"))


class GatherTransfer(RankProcesses):
    """The shadowsync path fed by `count` trainer ranks that gather to rank 0 (see the module's
    doc)."""

    def api_description(self) -> str:
        import shadowsync

        memory = "device" if self.args.device == "cuda" else "host"
        return (f"shadowsync {shadowsync.__version__}: {self.count} trainer ranks (FSDP2-like "
                f"Shard(0) rows) all-gathering every parameter, rank 0 publishing them over the "
                f"same-host transport (memory={memory}), WorkerExtension, {self.live_call()}; "
                f"library {shadowsync.library_path()}")

    async def setup(self, engine, init_extra: dict | None = None, checksums: bool = True) -> dict:
        """Starts the ranks and initializes the engine's group with rank 0's transport (no
        checksums: the sharded variant's routed Sender sends none either)."""
        socket_dir = self.socket_dir = Path(tempfile.mkdtemp(prefix="ss-bench-gather-"))  # 0700
        path, self.token = str(socket_dir / "trainer.sock"), os.urandom(32)
        self.unique_id = None
        self.specs = specs = model_specs(self.args.config, self.args.device,
                                         getattr(self.args, "layers", None))
        regions = shard0_regions(specs, self.count)
        self.start_ranks(gather_rank_process, lambda rank: (
            rank, self.count, specs, regions, self.args.device, str(socket_dir / "store"), path,
            self.token, self.args.bucket_bytes, self.args.tp, 2000 * self.count + rank))
        (shards,) = await self.recv("shards")
        held = [m[1] for m in shards]
        t0 = time.monotonic()
        joined = engine.collective_rpc("init_weight_update_group",
                                       kwargs=self.init_kwargs(path, init_extra))
        init_s, (ready,) = await asyncio.gather(timed(joined), self.recv("ready"))
        self.memory = [m[1] for m in ready]
        self.bytes = sum(held)
        where = ("the cpu" if self.args.device != "cuda" else
                 ", ".join(f"rank {r} on cuda:{r}" for r in range(self.count)))
        return dict(trainer=f"{self.count} trainer rank processes ({where}), each with its rows "
                            "only, all-gathering every parameter to publish from rank 0",
                    gather_ranks=self.count, tensors=len(specs), transport="same-host",
                    tp=self.args.tp, bytes=self.bytes, bucket_bytes=self.args.bucket_bytes,
                    **await self.joined(engine), trainer_rank_held_bytes=held,
                    trainer_rank_memory=self.memory, init_s=round(time.monotonic() - t0, 2),
                    update_setup_call="collective_rpc('init_weight_update_group')",
                    update_setup_s=round(init_s, 3))
