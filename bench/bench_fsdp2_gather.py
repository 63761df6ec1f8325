#!/usr/bin/env python3
"""What an FSDP2 trainer pays to hand its weights over by gathering them first, against what a
sharded publisher holds instead: a real ``fully_shard`` model at a public model's shapes, one
rank per GPU (NCCL) or per process on the CPU (gloo).

    torchrun --nproc-per-node 2 bench/bench_fsdp2_gather.py --config llama-3-8b --device cuda
    torchrun --nproc-per-node 2 bench/bench_fsdp2_gather.py --config tiny            # CPU, gloo

Every rank builds the model on the meta device from the config's shapes (random weights are not
needed: only bytes move), shards it with ``fully_shard`` per decoder layer and at the root, and
materializes its shards. Then, each ``--repeats`` times (medians reported):

* ``gather_all``: ``full_tensor()`` of every parameter, rank 0 keeping each (what a trainer that
  gathers the model before sending holds: all of it on rank 0); the other ranks drop theirs.
* ``gather_bucketed``: the same gathers, rank 0 keeping a bucket of ``--bucket-mib`` at a time
  and dropping it once full (a gather streamed bucket by bucket into a sender).
* ``sharded``: ``ShardedPublisher.set_up`` (no gather; one engine rank needing every byte): its
  set-up time, the parameter bytes each rank holds and its packing memory (two slots of its
  largest bucket slice). Publishing needs an engine and is measured with one by
  ``bench/bench_vllm_update.py --trainer-ranks M``.

Per variant: seconds, and each rank's peak memory beyond the shards it holds (CUDA: torch's
peak allocated minus what was allocated before; CPU: not measured). Outputs
``bench_fsdp2_gather.json`` and ``.md`` in --out (default ``$OUT``, else ./bench-fsdp2-gather),
with the command, machine, versions and date."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from vllm_update.configs import CONFIGS, config_kwargs  # noqa: E402 - plain Python, no torch

GIB = 1 << 30


def build_sharded_model(torch, config: str, device: str, mesh):
    """The config's model on the meta device, fully_shard per decoder layer and at the root, its
    shards materialized on `device` (uninitialized: only their bytes matter here)."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    hf_config = transformers.AutoConfig.for_model(**config_kwargs(config))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=device)
    return model


class Peak:
    """This rank's peak memory beyond what was allocated when it started (CUDA only)."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.base = self.torch.cuda.memory_allocated()
            self.torch.cuda.reset_peak_memory_stats()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.started
        self.extra_bytes = (self.torch.cuda.max_memory_allocated() - self.base) if self.cuda else None


def gather(torch, dist, params, rank: int, bucket_bytes: int | None, device: str) -> Peak:
    """full_tensor() of every parameter; rank 0 keeps them all (bucket_bytes None) or a bucket
    at a time."""
    kept, kept_bytes = [], 0
    with Peak(torch, device) as peak:
        for _, p in params:
            full = p.full_tensor()
            if rank != 0:
                del full
                continue
            kept.append(full)
            kept_bytes += full.numel() * full.element_size()
            if bucket_bytes is not None and kept_bytes >= bucket_bytes:
                kept, kept_bytes = [], 0  # handed to a sender, then dropped
        dist.barrier()
    del kept
    return peak


def sharded_set_up(torch, ss, params, rank: int, bucket_bytes: int, device: str):
    directory = tempfile.mkdtemp(prefix=f"bench_fsdp2_r{rank}_")
    token = ss.make_token() if rank == 0 else None
    shared = [token]
    torch.distributed.broadcast_object_list(shared, src=0)
    with Peak(torch, device) as peak:
        publisher = ss.ShardedPublisher.set_up(params, path=f"{directory}/sock", token=shared[0],
                                               bucket_bytes=bucket_bytes)
    figures = {"seconds": peak.seconds, "torch_extra_bytes": peak.extra_bytes,
               "held_bytes": publisher.held_bytes, "staging_bytes": publisher.staging_bytes,
               "sent_bytes": publisher.sent_bytes}
    publisher.close()
    return figures


def machine(torch, device: str) -> dict:
    facts = {"host": platform.node(), "python": platform.python_version(),
             "torch": torch.__version__, "nccl": None, "gpus": None}
    if device == "cuda":
        facts["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        facts["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
    return facts


def describe_machine(facts: dict) -> str:
    gpus = facts["gpus"]
    where = f"{len(gpus)}x {gpus[0]}" if gpus else f"CPU ({facts['host']})"
    nccl = f", NCCL {facts['nccl']}" if facts["nccl"] else ""
    return f"{where}, torch {facts['torch']}{nccl}, Python {facts['python']}"


def write_outputs(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fsdp2_gather.json").write_text(json.dumps(result, indent=2) + "\n")
    gib = lambda b: "-" if b is None else f"{b / GIB:.2f}"  # noqa: E731
    lines = [f"# FSDP2: gather to rank 0 against a sharded publisher ({result['config']})", "",
             f"Command: `{result['command']}`  ",
             f"Date: {result['date']}  ",
             f"Machine: {describe_machine(result['machine'])}  ",
             f"Model: {result['parameters']} parameters, {result['model_bytes']:,} bytes "
             f"(bf16), {result['world_size']} ranks, FSDP2 `fully_shard` per layer and root", "",
             "| variant | seconds, median of repeats | rank 0 extra GiB | rank 1 extra GiB |",
             "| --- | --- | --- | --- |"]
    for name in ("gather_all", "gather_bucketed"):
        v = result[name]
        lines.append(f"| {name} | {v['seconds_median']:.4f} | {gib(v['extra_bytes'][0])} | "
                     f"{gib(v['extra_bytes'][1] if len(v['extra_bytes']) > 1 else None)} |")
    s = result["sharded"]
    lines += ["", "| sharded publisher, rank | set-up s | holds GiB | packing GiB | torch extra GiB |",
              "| --- | --- | --- | --- | --- |"]
    for r, f in enumerate(s):
        lines.append(f"| {r} | {f['seconds']:.3f} | {gib(f['held_bytes'])} | "
                     f"{gib(f['staging_bytes'])} | {gib(f['torch_extra_bytes'])} |")
    (out / "bench_fsdp2_gather.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-fsdp2-gather"))
    args = parser.parse_args()
    if args.repeats < 1 or args.bucket_mib < 1:
        parser.error(f"--repeats {args.repeats} and --bucket-mib {args.bucket_mib}: at least 1 each")

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shadowsync as ss

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world,))
    model = build_sharded_model(torch, args.config, args.device, mesh)
    params = list(model.named_parameters())
    model_bytes = sum(p.numel() * p.element_size() for _, p in params)
    bucket_bytes = args.bucket_mib << 20

    def say(line):
        if rank == 0:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    say(f"[fsdp2-gather] {args.config}: {len(params)} parameters, {model_bytes:,} bytes, "
        f"{world} ranks on {args.device}")
    result = {"config": args.config, "world_size": world, "parameters": len(params),
              "model_bytes": model_bytes, "bucket_bytes": bucket_bytes,
              "command": "torchrun --nproc-per-node " + str(world) + " bench/bench_fsdp2_gather.py "
                         + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": machine(torch, args.device)}
    gather(torch, dist, params, rank, bucket_bytes, args.device)  # warm-up: NCCL's first calls
    for name, bucket in (("gather_all", None), ("gather_bucketed", bucket_bytes)):
        runs = [gather(torch, dist, params, rank, bucket, args.device) for _ in range(args.repeats)]
        peaks = [None] * world
        dist.all_gather_object(peaks, max((r.extra_bytes or 0) for r in runs)
                               if args.device == "cuda" else None)
        seconds = statistics.median(r.seconds for r in runs)
        result[name] = {"seconds": [r.seconds for r in runs], "seconds_median": seconds,
                        "extra_bytes": peaks}
        say(f"[fsdp2-gather] {name}: {seconds * 1e3:.1f} ms (median of {args.repeats}), rank 0 "
            f"extra {(peaks[0] or 0) / GIB:.2f} GiB")
    mine = sharded_set_up(torch, ss, params, rank, bucket_bytes, args.device)
    sharded = [None] * world
    dist.all_gather_object(sharded, mine)
    result["sharded"] = sharded
    for r, f in enumerate(sharded):
        say(f"[fsdp2-gather] sharded rank {r}: set-up {f['seconds']:.3f} s, holds "
            f"{f['held_bytes'] / GIB:.2f} GiB, packing {f['staging_bytes'] / GIB:.2f} GiB, torch "
            f"extra {(f['torch_extra_bytes'] or 0) / GIB:.2f} GiB")
    if rank == 0:
        write_outputs(Path(args.out), result)
        say(f"[fsdp2-gather] wrote {args.out}/bench_fsdp2_gather.json and .md")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch's gloo threads can abort a normal exit once DTensors exist


if __name__ == "__main__":
    main()
