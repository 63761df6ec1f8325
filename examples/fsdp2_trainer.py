"""An FSDP2 trainer streaming every optimizer step into a generating vLLM, with no gather.

    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py [--steps 3] [--check]
    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py --engine-replicas 2 --check
    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py --device cuda [--engine-tp 2] --check
    torchrun --nproc-per-node 2 examples/fsdp2_trainer.py --engine stand-in [--device cuda]

Every rank trains a tiny model sharded with FSDP2 (``fully_shard`` per layer and at the root;
gloo on CPU, NCCL on GPUs) and, after each ``optimizer.step()``, publishes what it holds with a
``shadowsync.ShardedPublisher``: each rank's own shards go straight to the engine ranks that need
them over the same-host pull transport. Nothing gathers a full tensor: publishing runs inside
``shadowsync.sharding.forbid_gathers()``, where every gather raises.

Two engines, driven by rank 0 (its needs go to the other ranks at set-up; with
``--engine-replicas``, replica r is driven by rank r):

* ``--engine vllm`` (the default; vLLM's CPU build, or with ``--device cuda`` vLLM on the trainer
  ranks' GPUs, ``--engine-tp`` of them): the model is a tiny random Llama (2 layers, hidden 128,
  vocab 320; bfloat16 on GPUs) built from the same seed on every rank; rank 0 saves it as a Hugging
  Face checkpoint and starts a ``vllm.LLM`` of it with shadowsync's worker extension. Set-up:
  ``weight_update_needs`` (the bytes of the trainers' wire layout the engine's parameters read),
  every rank's ``ShardedPublisher.set_up(..., engine_needs=needs)``, then
  ``init_weight_update_group`` with ``trainer_ranks`` made from the publisher's ``engine_setup``
  (``shadowsync.vllm.trainer_ranks.from_engine_setup``): the worker connects to every trainer
  rank. Each step, once every rank published, rank 0 hands the header to the worker
  (``begin_update``) and keeps generating while the update streams; the worker swaps it in
  between two steps, and ``apply_update`` then resets the prefix cache. ``--check``: after the
  last step every rank saves its own shards and their regions, rank 0 assembles the full tensors
  from those files (no gather), shuts the streaming engine down and starts a fresh vLLM of the
  assembled checkpoint: its greedy tokens must equal the streamed engine's. ``--engine-replicas
  R``: R vLLM engines of the same model (data-parallel replicas), replica r started by trainer
  rank r, each taking every update; the ranks serve R x the engine ranks and still pack each
  bucket once; with ``--check`` each replica's tokens must equal the fresh vLLM's.
* ``--engine stand-in`` (no vLLM needed; ``--device cuda`` too): a tiny MLP, and a subprocess (this
  file again, no torch there) that holds one shadowsync Receiver per engine rank on host memory,
  each needing its part of a tensor-parallel layout (column-parallel and row-parallel layers, a
  bias every rank needs whole).

Printed per update by rank 0: version, the bytes each engine rank received, the transfer time
and the engine's stop (its engine thread's time in the swap), from ``weight_update_stats`` (vLLM)
or ReceiverStats (stand-in); by every rank at set-up: the parameter bytes it holds and its packing
memory (the publisher's staging).

With ``--device cuda`` and vLLM, each rank's shards stay in its GPU's memory and vLLM's ranks
pull them from there (the transport's device flavour; from the other GPU by peer copies). The
stand-in engine and vLLM's CPU build hold host memory: there the publisher copies each shard to
the host at publish.
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

# Run from a source checkout without installing: use the checkout's `shadowsync` package (vLLM
# spawns its engine process with this sys.path, so the worker finds shadowsync.vllm too).
_CHECKOUT_PYTHON = Path(__file__).resolve().parent.parent / "python"
if (_CHECKOUT_PYTHON / "shadowsync").is_dir():
    sys.path.insert(0, str(_CHECKOUT_PYTHON))

import shadowsync as ss  # noqa: E402

REPLY_TIMEOUT_S = 120  # an engine that stops answering fails the run instead of hanging it


def say(line: str) -> None:
    """One line on stdout in one write: the ranks share the pipe, and print() writes the text and
    its newline apart, so that two ranks' lines could merge into one."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# --- --engine stand-in: a subprocess holding Receivers (no torch) -----------------------------


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    rows = -(-size // parts)  # torch.chunk's split: the last parts short or empty
    return min(size, index * rows), min(size, (index + 1) * rows)


def stand_in_needs(specs, engine_ranks: int) -> list[list[ss.WireRange]]:
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
            needs = stand_in_needs([tuple(s) for s in request["specs"]], engine_ranks)
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
    """Rank 0's handle on the stand-in engine process: needs, connect, update, close."""

    def __init__(self, engine_ranks: int):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--stand-in-engine-process", "--engine-ranks",
             str(engine_ranks)],
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

    def connect(self, setup: dict, token: str, replica: int = 0) -> None:
        self._call(call="connect", setup=setup, token=token)

    def update(self, version: int, header: bytes) -> dict:
        return self._call(call="update", version=version, header=header.hex())

    def close(self) -> None:
        self._call(call="close")
        self.process.wait(REPLY_TIMEOUT_S)


# --- --engine vllm: a vllm.LLM in rank 0's process ----------------------------------------------

PROMPTS = [[5 + 7 * i + j for j in range(12)] for i in range(4)]  # token ids: no tokenizer needed
MAX_TOKENS = 8


class VllmEngine:
    """Rank 0's vLLM (CPU build), with the stand-in's four calls (needs, connect, update, close)
    and check. The ``vllm.LLM`` and its engine core run in rank 0's process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0: collective_rpc and generate run in the caller's thread);
    its worker runs in a process spawned for it (distributed_executor_backend "mp"), whose
    torch.distributed world is vLLM's own, not the trainers' (a worker in this process would
    take the trainers' default group as vLLM's world; a forked one would inherit it)."""

    def __init__(self, model_path: str, bucket_bytes: int, device: str = "cpu", tp: int = 1):
        self.bucket_bytes = bucket_bytes
        self.device, self.tp = device, tp
        self.llm = start_vllm(model_path, device, tp)
        self.before = self.greedy()  # the initial model's answers

    def greedy(self) -> list[list[int]]:
        return greedy(self.llm)

    def stats(self) -> list[dict]:
        return self.llm.collective_rpc("weight_update_stats")  # one per worker (engine rank)

    def needs(self, specs) -> list[list[ss.WireRange]]:
        from shadowsync.vllm import weight_update_needs

        # What the engine's parameters read of the wire layout: its receive plan's, whichever
        # ranks send (trainer_ranks is not known yet: the publisher is built from these needs).
        needs = weight_update_needs(self.llm, specs=ss.Layout(specs, self.bucket_bytes).specs,
                                    bucket_bytes=self.bucket_bytes)
        return [[ss.WireRange(*r) for r in need] for need in needs]

    def connect(self, setup: dict, token: str, replica: int = 0) -> None:
        from shadowsync.vllm import init_weight_update_group
        from shadowsync.vllm.trainer_ranks import from_engine_setup

        # Blocks until the worker connected to every trainer rank's path. vLLM's CPU build spins
        # while it waits for work, and on a busy host with few cores the threads of the
        # receiver and of the trainer ranks then wait long for a core: a bucket and the whole
        # update get as long as the example waits for a reply, not the receiver's 10 s and 60 s.
        deadline_ms = REPLY_TIMEOUT_S * 1000
        init_weight_update_group(
            self.llm, specs=setup["wire"], bucket_bytes=setup["bucket_bytes"],
            trainer_ranks=from_engine_setup(setup, token, connect_timeout_ms=deadline_ms,
                                            replica=replica),
            receiver_config=ss.ReceiverConfig(bucket_deadline_ms=deadline_ms,
                                              update_deadline_ms=deadline_ms))
        # How the workers take an update, as their set-up chose (tensor parallelism: coordinated).
        self.coordinated = any(p["coordinated"]
                               for p in self.llm.collective_rpc("update_progress"))

    def update(self, version: int, header: bytes) -> dict:
        from shadowsync.vllm import apply_update, commit_update

        self.llm.collective_rpc("begin_update", args=(header,))  # returns at once
        # The engine keeps generating while the routes land (polled between generate calls).
        # One engine rank swaps the update in by itself between two steps; coordinated ranks
        # (tensor parallelism) hold it ready until commit_update flips them all at one step.
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        calls = 0
        while True:
            stats = self.stats()
            if min(s["ready_version" if self.coordinated else "applied_version"]
                   for s in stats) >= version:
                break
            failed = [s["last_update_error"] for s in stats if s["last_update_error"]]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"update {version} did not go live: "
                                   f"{failed or f'not within {REPLY_TIMEOUT_S} s'}")
            self.greedy()
            calls += 1
        if self.coordinated:
            commit_update(self.llm, version, REPLY_TIMEOUT_S)  # also resets the prefix cache
        else:
            apply_update(self.llm, version, REPLY_TIMEOUT_S)  # live already: resets the cache
        return {"version": version, "generate_calls": calls,
                "ranks": [{"bytes": s["routed_bytes"], "transfer_s": s["last_transfer_s"],
                           "swap_s": s["last_swap_s"]} for s in self.stats()]}

    def check(self, trained_path: str) -> dict:
        """The streamed engine's greedy tokens, then (that engine shut down) a fresh vLLM's of the
        trained checkpoint."""
        streamed = self.greedy()
        self.close()
        return {"streamed": streamed, "fresh": fresh_greedy(trained_path, self.device, self.tp),
                "initial": self.before}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def fresh_greedy(model_path: str, device: str, tp: int) -> list[list[int]]:
    """The greedy tokens of a fresh vLLM of `model_path`, shut down after."""
    llm = start_vllm(model_path, device, tp)
    try:
        return greedy(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()


def start_vllm(model_path: str, device: str = "cpu", tp: int = 1):
    from shadowsync.vllm import outside_torchrun

    # vLLM's workers, spawned while it starts, must not take this rank's torchrun environment
    # for theirs (they would wait for a store nobody hosts).
    with outside_torchrun():
        return _start_vllm(model_path, device, tp)


def _start_vllm(model_path: str, device: str, tp: int):
    import vllm

    import shadowsync.vllm.unpacked as unpacked

    common = dict(worker_extension_cls="shadowsync.vllm.WorkerExtension",
                  skip_tokenizer_init=True, max_model_len=128, max_num_seqs=len(PROMPTS),
                  kv_cache_memory_bytes=64 << 20, seed=0, distributed_executor_backend="mp")
    if device == "cuda":
        # vLLM's ranks on GPUs 0..tp-1, beside the trainer ranks there: a small share of each
        # GPU's memory. CUDA graphs on, as vLLM serves.
        return vllm.LLM(model=model_path, dtype="bfloat16", tensor_parallel_size=tp,
                        gpu_memory_utilization=0.2, **common)
    # vLLM's CPU backend computes linear layers from packed copies of their weights, which an
    # update would not reach; this registered "quantization" keeps the plain weights in use.
    unpacked.register()
    # vLLM's CPU worker pins itself to cores (VLLM_CPU_OMP_THREADS_BIND) and spins on them while
    # it waits for work. The library's threads leave a one-core pin by themselves, but vLLM's
    # own processes pinned to one busy core still answer seconds late now and then (the vLLM
    # guide has the figures): this small engine runs unpinned.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    return vllm.LLM(model=model_path, dtype="float32", quantization=unpacked.NAME,
                    tensor_parallel_size=tp, enforce_eager=True, **common)


def build_llama(torch, dtype):
    """A tiny random Llama (the smallest vLLM's CPU attention runs: head_dim 32) in `dtype`."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def save_local_shards(torch, model, rank: int, world: int, path: str) -> None:
    """This rank's shards and where they lie in the full tensors (no collective, no gather)."""
    from shadowsync.sharding import local_shards

    shards = []
    for shard in local_shards(model.named_parameters(), rank=rank, world_size=world):
        if shard.region is None:
            continue
        if shard.region.kind != "box":
            raise NotImplementedError(f"'{shard.name}': a {shard.region.kind} region")
        shards.append((shard.name, list(shard.region.begin), list(shard.region.end),
                       shard.tensor.detach().to("cpu").clone()))
    torch.save(shards, path)


def assemble_checkpoint(torch, initial: str, shard_files: list[str], specs, dtype,
                        out: str) -> None:
    """The full tensors (of `dtype`, the model's) from every rank's shard file, as a copy of the
    initial checkpoint."""
    from safetensors.torch import save_file

    full = {name: torch.empty(shape, dtype=dtype) for name, _, shape in specs}
    filled = dict.fromkeys(full, 0)
    for path in shard_files:
        for name, begin, end, tensor in torch.load(path):
            full[name][tuple(slice(b, e) for b, e in zip(begin, end))] = tensor
            filled[name] += tensor.numel()
    missing = [n for n in full if filled[n] != full[n].numel()]
    if missing:
        raise RuntimeError(f"the shard files cover {missing} only in part")
    shutil.copytree(initial, out)
    save_file(full, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


# --- the trainer (every torchrun rank) --------------------------------------------------------


def build_mlp(torch):
    """--engine stand-in's model: three Linears, 13 hidden rows (uneven over 2 ranks) and a
    10-way head."""
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
    if args.engine_replicas > world:
        raise SystemExit(f"--engine-replicas {args.engine_replicas}: trainer rank r starts replica "
                         f"r, and there are {world} ranks; run at most {world} replicas")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    mesh = init_device_mesh(args.device, (world,))
    vllm_mode = args.engine == "vllm"
    work = tempfile.mkdtemp(prefix="ss_fsdp2_") if rank == 0 else None  # mode 0700
    if vllm_mode:
        # The same seed, so the same weights, on every rank; bfloat16 on GPUs, as vLLM serves.
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        model = build_llama(torch, dtype)
        if rank == 0:
            model.save_pretrained(os.path.join(work, "initial"))  # what the engine starts from
        layers = list(model.model.layers)
    else:
        model = build_mlp(torch)
        layers = [layer for layer in model if any(True for _ in layer.parameters())]
    model = model.to(args.device)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # Set-up metadata, before any forbid_gathers: rank 0 asks the engine what it needs and
    # hands the needs, a fresh token and its work directory to the other ranks.
    engine = None
    if rank == 0:
        engine = (VllmEngine(os.path.join(work, "initial"), args.bucket_bytes, args.device,
                             args.engine_tp) if vllm_mode
                  else StandInEngine(args.engine_ranks))
    specs = [(n, str(p.dtype), tuple(p.shape)) for n, p in model.named_parameters()]
    shared = [engine.needs(specs), ss.make_token(), work] if rank == 0 else [None] * 3
    dist.broadcast_object_list(shared, src=0)
    needs, token, work = shared
    if 0 < rank < args.engine_replicas:  # replica r of the same model, on trainer rank r
        engine = VllmEngine(os.path.join(work, "initial"), args.bucket_bytes)
    directory = tempfile.mkdtemp(prefix=f"ss_fsdp2_r{rank}_")  # this rank's socket, mode 0700
    publisher = ss.ShardedPublisher.set_up(model.named_parameters(), path=f"{directory}/sock",
                                           token=token, engine_needs=needs,
                                           bucket_bytes=args.bucket_bytes,
                                           # vLLM on GPUs pulls from the shards' GPU memory (the
                                           # default); the CPU engines hold host memory, so CUDA
                                           # shards are copied to the host at publish.
                                           backend=(None if vllm_mode and args.device == "cuda"
                                                    else ss.HostBackend()),
                                           # As long as the engine's deadlines (connect()).
                                           sender_config=ss.SenderConfig(
                                               update_deadline_ms=REPLY_TIMEOUT_S * 1000),
                                           engine_replicas=args.engine_replicas)
    say(f"[trainer rank {rank}] holds {publisher.held_bytes} parameter bytes, sends "
          f"{publisher.sent_bytes} per update; packing memory {publisher.staging_bytes} bytes "
          f"(two slots of its largest bucket slice)")
    if rank == 0:
        plan = publisher.routing_plan
        say(f"[trainer] plan: {plan.trainer_count} trainer ranks -> {plan.engine_count} engine "
              f"ranks, bytes per engine rank "
              f"{[plan.bytes_to_engine(e) for e in range(plan.engine_count)]}")
    if engine is not None:  # each replica's engine connects to every rank's path
        engine.connect(publisher.engine_setup, token, replica=rank)

    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(1, args.steps + 1):
        if vllm_mode:
            tokens = torch.randint(3, 320, (4, 32), generator=generator).to(args.device)
            loss = model(input_ids=tokens, labels=tokens).loss
        else:
            x = torch.randn(32, 16, generator=generator).to(args.device)
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with forbid_gathers():
            started = time.perf_counter()
            handle = publisher.publish(step, model.named_parameters())
            # The engine begins once every rank published: its deadlines then count the
            # transfer, not the slowest rank's training step.
            dist.barrier()
            if engine is not None:
                report = engine.update(step, handle.header_bytes)
            handle.wait(REPLY_TIMEOUT_S)  # before the next step changes the parameters
            elapsed = time.perf_counter() - started
        if engine is not None:
            received = [r["bytes"] for r in report["ranks"]]
            transfer = max(r["transfer_s"] for r in report["ranks"])
            stop = max(r["swap_s"] for r in report["ranks"])
            generated = (f"; {report['generate_calls']} generate calls while it streamed"
                         if "generate_calls" in report else "")
            who = "[trainer]" if rank == 0 else f"[replica {rank}]"
            say(f"{who} update {step}: loss {loss.item():.4f}, bytes per engine rank "
                  f"{received}, transfer {transfer * 1e3:.3f} ms, engine stop {stop * 1e3:.3f} ms "
                  f"(publish to live {elapsed * 1e3:.1f} ms{generated})")

    publisher.close()
    replicas_streamed = [None] * world  # the greedy tokens of each replica but rank 0's
    if args.check:  # every rank saves what it holds, for rank 0 to assemble
        save_local_shards(torch, model, rank, world, os.path.join(work, f"shards{rank}.pt"))
        mine = engine.greedy() if engine is not None and rank > 0 else None
        dist.all_gather_object(replicas_streamed, mine)
    # The trainers' last collective. Then rank 0 may shut vLLM down: its engine core, in this
    # process, destroys the process's default group when it ends.
    dist.barrier()
    dist.destroy_process_group()
    passed = True
    if rank > 0 and engine is not None:
        engine.close()
    if rank == 0:
        if args.check:
            trained = os.path.join(work, "trained")
            assemble_checkpoint(torch, os.path.join(work, "initial"),
                                [os.path.join(work, f"shards{r}.pt") for r in range(world)],
                                specs_of(publisher), dtype, trained)
            seen = engine.check(trained)
            others = replicas_streamed[1:args.engine_replicas]
            same = all(t == seen["fresh"] for t in [seen["streamed"]] + others)
            changed = seen["streamed"] != seen["initial"]
            passed = same and changed
            streamed = ("the streamed engine" if args.engine_replicas == 1 else
                        f"each of the {args.engine_replicas} streamed replicas")
            say(f"[trainer] check: greedy tokens of {streamed} "
                  f"{'equal' if same else 'DIFFER FROM'} a fresh vLLM of the trained checkpoint "
                  f"({len(PROMPTS)} prompts x {MAX_TOKENS} tokens; the initial model's "
                  f"{'differ' if changed else 'are the same'}): "
                  f"{'PASSED' if passed else 'FAILED'}")
            if not passed:
                print(f"[trainer] streamed {seen['streamed']}\n[trainer] fresh    "
                      f"{seen['fresh']}\n[trainer] initial  {seen['initial']}", flush=True)
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    # torch keeps gloo's threads alive past destroy_process_group once DTensors exist, and the
    # interpreter's exit can abort on them (SIGABRT, about 1 run in 20): leave without it.
    sys.stdout.flush()
    os._exit(0 if passed else 1)


def specs_of(publisher) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(s.name, s.dtype, tuple(s.shape)) for s in publisher.layout.specs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engine", choices=["vllm", "stand-in"], default="vllm",
                        help="a vllm.LLM in rank 0 (vLLM's CPU build), or the stand-in engine "
                             "process (no vLLM needed)")
    parser.add_argument("--check", action="store_true",
                        help="vllm: after the last step, compare the engine's greedy tokens with "
                             "a fresh vLLM of the trained model (assembled from every rank's "
                             "saved shards)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the trainer computes (cuda: NCCL, one GPU per rank; vLLM on "
                             "the GPUs of the first --engine-tp ranks)")
    parser.add_argument("--engine-tp", type=int, default=1,
                        help="vllm: vLLM's tensor-parallel size (with --device cuda its ranks on "
                             "GPUs 0.., beside the trainer ranks); updates then go live on every "
                             "rank at one step (commit_update)")
    parser.add_argument("--engine-ranks", type=int, default=2,
                        help="stand-in: its engine ranks (each needs its rows)")
    parser.add_argument("--engine-replicas", type=int, default=1,
                        help="vllm: data-parallel replicas of the engine, replica r started by "
                             "trainer rank r, each taking every update")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="wire bucket size (a multiple of 256; 0: the library's 512 MiB; "
                             "default 1024 for the stand-in, 262144 for vLLM): each rank's "
                             "packing memory is two of its bucket slices")
    parser.add_argument("--stand-in-engine-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stand_in_engine_process:
        engine_main(args.engine_ranks)
        return
    if args.engine_tp < 1 or (args.engine_tp > 1 and args.engine != "vllm"):
        parser.error(f"--engine-tp {args.engine_tp}: at least 1, and more than 1 with --engine "
                     f"vllm only")
    if args.engine_tp > 1 and args.engine_replicas > 1:
        parser.error(f"--engine-tp {args.engine_tp} with --engine-replicas "
                     f"{args.engine_replicas}: run one engine of {args.engine_tp} ranks, or "
                     f"replicas of one rank each")
    if args.engine == "vllm" and args.device == "cuda" and args.engine_replicas > 1:
        parser.error(f"--engine-replicas {args.engine_replicas} with --device cuda: replicas are "
                     f"shown with vLLM's CPU build; on GPUs run one engine (--engine-tp N)")
    if args.check and args.engine != "vllm":
        parser.error("--check compares with a fresh vLLM: --engine vllm")
    if args.engine_replicas < 1 or (args.engine_replicas > 1 and args.engine != "vllm"):
        parser.error(f"--engine-replicas {args.engine_replicas}: at least 1, and more than 1 "
                     f"with --engine vllm only")
    if args.bucket_bytes is None:
        args.bucket_bytes = 1024 if args.engine == "stand-in" else 256 << 10
    if args.engine == "vllm":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM is imported
        # VllmEngine: the engine core in this process, its worker in a spawned one.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    trainer_main(args)


if __name__ == "__main__":  # vLLM spawns its engine process, which imports this file again
    main()
