"""An FSDP2 trainer streaming every optimizer step into an inference engine, with no gather.

    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py [--steps 3] [--device cpu|cuda]
                                                          [--engine-ranks 2] [--bucket-bytes N]

Every rank trains a tiny MLP sharded with FSDP2 (``fully_shard`` per layer and at the root; gloo
on CPU, NCCL on GPUs) and, after each ``optimizer.step()``, publishes what it holds with a
``shadowsync.ShardedPublisher``: each rank's own shards go straight to the engine ranks that need
them over the same-host pull transport. Nothing gathers a full tensor: publishing runs inside
``shadowsync.sharding.forbid_gathers()``, where every gather raises.

The engine here is a STAND-IN: ``StandInEngine`` starts this file again as a subprocess with
``--engine`` (no torch there), which holds one shadowsync Receiver per engine rank on host memory,
each needing its part of a tensor-parallel layout (column-parallel and row-parallel layers, a
bias every rank needs whole), and reports, per update, the bytes each rank received, the
transfer time and the swap (ReceiverStats). A real engine (vLLM) replaces it by offering the
same four calls: ``needs(specs)``, ``connect(setup, token)``, ``update(version, header)``,
``close()``.

Rank 0 alone talks to the engine (its needs are handed to the other ranks at set-up; each
update's header is rank 0's). Printed per update by rank 0: version, bytes each engine rank
received, transfer time; by the engine: each rank's bytes, transfer and swap; by every rank at
set-up: the parameter bytes it holds and its packing memory (the publisher's staging).

CUDA: the pull transport shares host memory only for now, so the publisher copies each CUDA shard
to the host at publish (device memory is a follow-up); GPU memory is not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run from a source checkout without installing: use the checkout's `shadowsync` package.
_CHECKOUT_PYTHON = Path(__file__).resolve().parent.parent / "python"
if (_CHECKOUT_PYTHON / "shadowsync").is_dir():
    sys.path.insert(0, str(_CHECKOUT_PYTHON))

import shadowsync as ss  # noqa: E402

REPLY_TIMEOUT_S = 120  # an engine that stops answering fails the run instead of hanging it


# --- the stand-in engine (a subprocess; no torch) ---------------------------------------------


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    rows = -(-size // parts)  # torch.chunk's split: the last parts short or empty
    return min(size, index * rows), min(size, (index + 1) * rows)


def engine_needs(specs, engine_ranks: int) -> list[list[ss.WireRange]]:
    """What each engine rank needs of the wire layout, as a Megatron-style tensor-parallel engine
    holds the MLP: layers 0, 2, 4 column-parallel (its rows of weight and bias), layers 1, 3
    row-parallel (its columns of the weight; the bias whole on every rank)."""
    layout = ss.Layout(specs)
    needs = [[] for _ in range(engine_ranks)]
    for i, (name, _, shape) in enumerate(specs):
        row_parallel = (i // 2) % 2 == 1  # (weight, bias) per Linear
        dim = 1 if row_parallel and len(shape) == 2 else 0
        for e in range(engine_ranks):
            begin, end = [0] * len(shape), list(shape)
            if not (row_parallel and len(shape) == 1):  # a row-parallel bias: every rank
                begin[dim], end[dim] = _chunk(shape[dim], engine_ranks, e)
            if begin[dim] < end[dim]:
                needs[e] += layout.region_ranges(ss.TensorRegion.box(name, begin, end))
    return needs


def engine_main(engine_ranks: int) -> None:
    """The stand-in engine: JSON lines in on stdin, one JSON reply line per request on stdout;
    its own report on stderr."""
    from shadowsync.sharded_publisher import sharded_receiver

    receivers: list[ss.Receiver] = []

    def reply(message) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        request = json.loads(line)
        if request["call"] == "needs":
            needs = engine_needs([tuple(s) for s in request["specs"]], engine_ranks)
            reply([[[r.group, r.begin, r.end] for r in need] for need in needs])
        elif request["call"] == "connect":
            # Engine rank after engine rank: each connects to every trainer rank's path.
            receivers = [sharded_receiver(request["setup"], request["token"], e)
                         for e in range(engine_ranks)]
            reply({"engine_ranks": engine_ranks})
        elif request["call"] == "update":
            version, header = request["version"], bytes.fromhex(request["header"])
            for receiver in receivers:
                receiver.begin_update(header)
            ranks = []
            for e, receiver in enumerate(receivers):
                # An idle engine: apply at once (a generating one swaps between two steps).
                receiver.wait_applied(version, REPLY_TIMEOUT_S)
                stats = receiver.stats()
                ranks.append({"bytes": stats.routed_bytes, "transfer_s": stats.last_transfer_s,
                              "swap_s": stats.last_swap_s})
                print(f"[engine] rank {e}: update {version} live: {stats.routed_bytes} bytes "
                      f"received, transfer {stats.last_transfer_s * 1e3:.3f} ms, swap "
                      f"{stats.last_swap_s * 1e3:.3f} ms", file=sys.stderr, flush=True)
            reply({"version": version, "ranks": ranks})
        elif request["call"] == "close":
            break
    for receiver in receivers:
        receiver.close()
    reply({"closed": True})


class StandInEngine:
    """Rank 0's handle on the stand-in engine process (the four calls a real engine offers)."""

    def __init__(self, engine_ranks: int):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--engine", "--engine-ranks", str(engine_ranks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _call(self, **request):
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process exited ({self.process.wait()}) during "
                               f"'{request['call']}'; its error is above")
        return json.loads(line)

    def needs(self, specs) -> list[list[ss.WireRange]]:
        return [[ss.WireRange(*r) for r in need] for need in self._call(call="needs", specs=specs)]

    def connect(self, setup: dict, token: str) -> None:
        self._call(call="connect", setup=setup, token=token)

    def update(self, version: int, header: bytes) -> dict:
        return self._call(call="update", version=version, header=header.hex())

    def close(self) -> None:
        self._call(call="close")
        self.process.wait(REPLY_TIMEOUT_S)


# --- the trainer (every torchrun rank) --------------------------------------------------------


def build_model(torch):
    """A tiny MLP of three Linears: 13 hidden rows (uneven over 2 ranks) and a 10-way head."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(16, 13), nn.ReLU(), nn.Linear(13, 32), nn.ReLU(),
                         nn.Linear(32, 10))


def trainer_main(args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shadowsync.sharding import forbid_gathers

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world,))
    model = build_model(torch).to(args.device)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # Set-up metadata, before any forbid_gathers: rank 0 asks the engine what it needs and
    # hands the needs and a fresh token to the other ranks.
    engine = StandInEngine(args.engine_ranks) if rank == 0 else None
    specs = [(n, str(p.dtype), tuple(p.shape)) for n, p in model.named_parameters()]
    shared = [engine.needs(specs), ss.make_token()] if rank == 0 else [None, None]
    dist.broadcast_object_list(shared, src=0)
    needs, token = shared
    directory = tempfile.mkdtemp(prefix=f"ss_fsdp2_r{rank}_")  # this rank's socket, mode 0700
    publisher = ss.ShardedPublisher.set_up(model.named_parameters(), path=f"{directory}/sock",
                                           token=token, engine_needs=needs,
                                           bucket_bytes=args.bucket_bytes)
    print(f"[trainer rank {rank}] holds {publisher.held_bytes} parameter bytes, sends "
          f"{publisher.sent_bytes} per update; packing memory {publisher.staging_bytes} bytes "
          f"(two slots of its largest bucket slice)", flush=True)
    if rank == 0:
        plan = publisher.routing_plan
        print(f"[trainer] plan: {plan.trainer_count} trainer ranks -> {plan.engine_count} engine "
              f"ranks, bytes per engine rank "
              f"{[plan.bytes_to_engine(e) for e in range(plan.engine_count)]}", flush=True)
        engine.connect(publisher.engine_setup, token)

    for step in range(1, args.steps + 1):
        x = torch.randn(32, 16, device=args.device)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with forbid_gathers():
            started = time.perf_counter()
            handle = publisher.publish(step, model.named_parameters())
            if rank == 0:
                report = engine.update(step, handle.header_bytes)
            handle.wait(REPLY_TIMEOUT_S)  # before the next step changes the parameters
            elapsed = time.perf_counter() - started
        if rank == 0:
            received = [r["bytes"] for r in report["ranks"]]
            transfer = max(r["transfer_s"] for r in report["ranks"])
            print(f"[trainer] update {step}: loss {loss.item():.4f}, bytes per engine rank "
                  f"{received}, transfer {transfer * 1e3:.3f} ms (publish to live "
                  f"{elapsed * 1e3:.1f} ms)", flush=True)

    publisher.close()
    if rank == 0:
        engine.close()
    shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    # torch keeps gloo's threads alive past destroy_process_group once DTensors exist, and the
    # interpreter's exit can abort on them (SIGABRT, about 1 run in 20): leave without it.
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--engine-ranks", type=int, default=2,
                        help="engine ranks of the stand-in engine (each needs its rows)")
    parser.add_argument("--bucket-bytes", type=int, default=1024,
                        help="wire bucket size (a multiple of 256; 0: the library's 512 MiB): "
                             "each rank's packing memory is two of its bucket slices")
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine_main(args.engine_ranks)
    else:
        trainer_main(args)


if __name__ == "__main__":
    main()
