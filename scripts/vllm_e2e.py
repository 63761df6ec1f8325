"""Real vLLM takes a trainer's update while it generates, and then answers exactly as a fresh vLLM
of the new checkpoint: the end-to-end check of the vLLM worker extension on one device.

    python3 scripts/vllm_e2e.py --device cuda          # one GPU: CUDA graphs on (vLLM's default)
    python3 scripts/vllm_e2e.py --device cpu           # vLLM's CPU build

Two tiny random Llama checkpoints A and B are made with transformers (no download). The
reference answers (greedy token ids of a few prompts) come from a fresh vLLM of A and of B, in a
process of their own (on cpu one process for both, one engine after the other, each shut down
before the next starts, vLLM's engine core in that process; on cuda a process each). The engine
under test starts on A with the extension; a trainer process loads
B and A with transformers and serves the same-host transport (GPU memory on cuda, a shared memory
file on cpu); the worker joins it through collective_rpc with the trainer's own
named_parameters() as the layout (HF names: the worker derives the receive plan from vLLM's
load_weights). Then: answers unchanged after set-up; update 1 (B) streams while the engine keeps
generating; after apply_update the answers equal B's fresh vLLM token for token; update 2 (A)
back again; update 3 (A once more) with the self-check (begin_update(verify_matches_live=True):
every parameter the update writes must equal the engine's own bytes, or nothing goes live). Exits non-zero on any difference; prints one line per stage. vLLM runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that collective_rpc runs between generate calls.

--lora: vLLM also serves a LoRA adapter (enable_lora; lora_int_id 1, loaded from adapter L1 by
the first request with it) and every update carries a new adapter with the base (B with adapter
L2, then A with L1), as PEFT tensors in their own group (lora_adapter=1). Every stage checks
two sets of answers, requests without an adapter (the base model alone) and requests with the
adapter, against a fresh vLLM (enable_lora) of that checkpoint that answers both ways (the
adapter loaded from its directory).
--lora-embeddings: the adapters adapt the embedding and lm_head too (PEFT's lora_embedding_A/B).

--omit NAME (repeatable): the trainer leaves tensor NAME out and the worker allows it
(allow_partial=True): the engine keeps its own NAME, so after update 1 it must answer as a fresh
vLLM of B with A's NAME, and as A after update 2. With --live-arena the unsent parameters are
the receive plan's kept tensors (the arena is swapped whole).

--graph-pairs: the engine starts with the 'shadowsync_graph_pairs' weight-transfer backend
(graph_pairs.py): vLLM captures its CUDA graphs over each of the arena's two slots, and each swap
rebinds the parameters to the other slot and switches vLLM to its graphs. Update 1 runs on slot
1's graphs and update 2 on slot 0's again, so a set that was not switched answers wrongly.

--reinit: a third update (B) leaves the engine on B after an odd number of swaps (with
--graph-pairs: on slot 1); close_weight_update_group must keep B (graph pairs settle the arena
back to slot 0); then a new trainer and a second init_weight_update_group, and update 4 (A) must
answer as A, and A again after the second close. Under --tp > 1 that second group has commit_mode
"auto" (step_agreement.py): the engine generates on after the update arrived and the ranks' step
hooks make it live, every rank at the same step, with no commit_update.

--trainer-ranks M: last, a sharded trainer takes the engine over: M rank processes, each
holding only its rows of every tensor (down_proj: its columns) and sending only those over the
same-host pull transport (ShadowsyncInitInfo.trainer_ranks, after weight_update_needs); updates
B then A, each engine rank receiving exactly the bytes its own parameters read. With CUDA, rank r
holds its rows on GPU r mod tp (colocated with engine rank r): under --tp 2 every engine rank
pulls routes from its own GPU and, by peer copies, from the other. With --transport nccl the
routes go over NCCL point-to-point from rank r on GPU --trainer-gpu + r.

--transport nccl (CUDA): the trainer sends over NCCL, rank 0 of 1 + tp, from --trainer-gpu (a
GPU none of vLLM's ranks uses: NCCL refuses two ranks of one communicator on one GPU); the
workers join it from the unique id alone (init_weight_update_group(unique_id=...)).
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "python" / "tests"))
from vllm_models import ARCHS  # noqa: E402 - plain Python, no torch

PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 84, 104, 101, 32, 113, 117], [1, 50, 43, 50, 61]]
TOKENS = 24


def log(message: str) -> None:
    print(f"[vllm-e2e] {message}", flush=True)


LORA_R, LORA_ALPHA = 8, 16


def engine_kwargs(device: str, model: str, tp: int = 1, lora: bool = False,
                  quantization: str | None = None) -> dict:
    kwargs = dict(model=model, max_model_len=256, max_num_seqs=8, seed=0, skip_tokenizer_init=True,
                  tensor_parallel_size=tp)
    if lora:
        kwargs.update(enable_lora=True, max_lora_rank=LORA_R, max_loras=1)
    if device == "cpu":
        import shadowsync.vllm.unpacked as unpacked

        unpacked.register()
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                      quantization=unpacked.NAME)
    else:
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.25, enforce_eager=False)
        if quantization:
            kwargs.update(quantization=quantization)
    return kwargs


def quantized_weights(worker) -> dict:
    """{parameter name: digest of its bytes} of every float8 parameter and every scale of the
    worker's model (collective_rpc): what vLLM computed from the weights after loading them."""
    import hashlib

    import torch

    digests = {}
    for name, p in worker.model_runner.model.named_parameters():
        if p.dtype == torch.float8_e4m3fn or name.endswith("_scale"):
            raw = p.data.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
            digests[name] = hashlib.sha256(raw).hexdigest()[:16]
    return digests


def greedy(llm, adapter: str | None = None) -> list[list[int]]:
    """Greedy answers; with `adapter`, requests with LoRA adapter lora_int_id 1 (vLLM loads it
    from that directory the first time; afterwards id 1 is whatever its slot holds)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    request = LoRARequest("policy", 1, adapter) if adapter else None
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                           lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outputs]


ANSWERS = "ANSWERS "  # what a reference process prints before each engine's answers


def references(device: str, tp: int, engines: list[tuple[str, str | None]],
               quantization: str | None = None) -> list[dict]:
    """Greedy answers of a fresh vLLM of each (model, LoRA adapter or None) of `engines`, in a
    process of their own: per engine {"base": answers without an adapter}, with an adapter (the
    engine then starts with enable_lora) also {"adapter": answers of requests with it}. On cpu
    one process makes them all (vLLM imported once, each engine shut down before the next); on
    cuda each engine gets a process of its own, which surely gives its GPU memory back when it
    ends. With `quantization` also {"weights": quantized_weights} of the fresh engine."""
    batches = [engines] if device == "cpu" else [[engine] for engine in engines]
    answers = []
    for batch in batches:
        out = subprocess.run([sys.executable, __file__, "--device", device, "--tp", str(tp),
                              "--reference", json.dumps(batch)]
                             + (["--quantization", quantization] if quantization else []),
                             capture_output=True, text=True, timeout=400 * len(batch))
        models = [model for model, _ in batch]
        if out.returncode != 0:
            raise RuntimeError(f"reference engines of {models} failed:\n{out.stderr[-3000:]}")
        printed = [json.loads(line[len(ANSWERS):]) for line in out.stdout.splitlines()
                   if line.startswith(ANSWERS)]
        if len(printed) != len(batch):
            raise RuntimeError(f"reference engines of {models} printed {len(printed)} answer "
                               f"lines, expected {len(batch)}:\n{out.stdout[-2000:]}\n"
                               f"{out.stderr[-2000:]}")
        answers += printed
    return answers


def wait_ready(llm, version: int, timeout: float = 60.0) -> None:
    """Until every worker holds `version` ready (commit_mode coordinated)."""
    deadline = time.monotonic() + timeout
    while any(int(v) != version for v in llm.collective_rpc("ready_version")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"update {version} not ready on every worker after {timeout} s")
        time.sleep(0.005)


def trainer_tensors_of(checkpoints: dict, device: str, adapters: dict, omit: list[str],
                       gpu: int = 0) -> tuple[dict, list]:
    """A trainer's tensors on GPU `gpu` (or the CPU): every version's HF model
    (vllm_models.trainer_tensors) and its LoRA adapter's PEFT tensors (group "lora", lora_B
    scaled as vLLM computes with it), by version; and their specs."""
    import torch
    from safetensors.torch import load_file
    from vllm_models import trainer_tensors

    import shadowsync.vllm as ssv

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    where = f"cuda:{gpu}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(gpu)
    named = {v: {n: t.to(where) for n, t in trainer_tensors(checkpoint, dtype).items()
                 if n not in omit}
             for v, checkpoint in checkpoints.items()}
    groups = {}
    for version, adapter in adapters.items():
        # In the engine's dtype first, then scaled: the order vLLM loads an adapter in.
        peft = {n: t.to(device=where, dtype=dtype)
                for n, t in load_file(os.path.join(adapter, "adapter_model.safetensors")).items()}
        named[version].update(ssv.scaled_lora_b(peft, LORA_ALPHA / LORA_R))
        groups.update({n: "lora" for n in peft})
    specs = [(n, str(p.dtype), tuple(p.shape), groups.get(n, "base"))
             for n, p in named[min(named)].items()]
    return named, specs


def trainer(conn, checkpoints: dict, device: str, path: str, token: bytes, bucket_bytes: int,
            receivers: int, adapters: dict, omit: list[str], nccl: bool = False, gpu: int = 0):
    """The trainer process, on GPU `gpu`: trainer_tensors_of's tensors, one Sender over the
    same-host transport, or over NCCL (rank 0 of 1 + receivers) with `nccl`."""
    import shadowsync as ss

    named, specs = trainer_tensors_of(checkpoints, device, adapters, omit, gpu)
    unique_id = ss.nccl_unique_id() if nccl else None
    conn.send(("specs", specs, unique_id))
    backend = ss.CudaBackend(gpu) if device == "cuda" else ss.HostBackend()
    layout = ss.Layout(specs, bucket_bytes=bucket_bytes)
    if nccl:  # blocks until every worker joined (its init_weight_update_group)
        transport = ss.nccl_transport(unique_id, 0, 1 + receivers, gpu)
    else:
        transport = ss.same_host_sender_transport(
            path, token, receivers, backend, slot_bytes=layout.groups[0].bucket_bytes,
            memory="device" if device == "cuda" else "host")
    sender = ss.Sender(layout, backend, transport)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        version, source = message[1], message[2]
        start = time.monotonic()
        handle = sender.publish(version, {n: t.detach() for n, t in named[source].items()})
        conn.send(("header", handle.header_bytes))
        handle.wait(120)
        conn.send(("sent", time.monotonic() - start, sum(g.arena_bytes for g in layout.groups)))
    sender.close()


def split_regions(specs: list, count: int) -> list[list]:
    """Where `count` trainer ranks' shards of `specs` lie (ShadowsyncInitInfo.trainer_ranks's
    regions): every tensor by rows (FSDP2's Shard(0)), down_proj by columns (a Megatron
    row-parallel slice: routes of part rows); uneven: rank r from row (r * dim) // count + 1
    for r > 0; a tensor too small for that whole on one rank."""
    regions: list[list] = [[] for _ in range(count)]
    for index, (name, _, shape, *_group) in enumerate(specs):
        shape = list(shape)
        d = 1 if "down_proj" in name and len(shape) == 2 else 0
        if shape[d] <= count:
            regions[index % count].append([name, "box", [0] * len(shape), shape])
            continue
        cuts = [0] + [r * shape[d] // count + 1 for r in range(1, count)] + [shape[d]]
        for r in range(count):
            begin, end = [0] * len(shape), list(shape)
            begin[d], end[d] = cuts[r], cuts[r + 1]
            regions[r].append([name, "box", begin, end])
    return regions


def trainer_rank(conn, rank: int, checkpoints: dict, device: str, bucket_bytes: int,
                 adapters: dict, omit: list[str], gpu: int, nccl_gpus: list[int] | None):
    """Trainer rank `rank` of a sharded trainer: keeps only its regions of trainer_tensors_of's
    tensors (on `device`: host memory on the CPU, GPU `gpu`'s memory with CUDA), builds the
    routing plan from every rank's regions and the engine ranks' needs, serves the same-host pull
    transport on its own path (its host or device flavour) and publishes its shards with a
    routed Sender. With `nccl_gpus` (every communicator rank's GPU, trainer ranks first) the
    routes go over NCCL point-to-point instead: rank 0 makes the unique id and the GPU names."""
    import shadowsync as ss
    from shadowsync.vllm.init_info import trainer_regions

    named, specs = trainer_tensors_of(checkpoints, device, adapters, omit, gpu)
    nccl = None
    if nccl_gpus is not None and rank == 0:
        nccl = dict(unique_id=ss.nccl_unique_id(), gpus=[ss.gpu_name(g) for g in nccl_gpus])
    conn.send(("specs", specs, nccl))
    _, ranks = conn.recv()
    regions = trainer_regions(ranks)
    shards = {v: [(r.tensor, tensors[r.tensor][tuple(slice(b, e) for b, e in
                                                     zip(r.begin, r.end))].contiguous(), r)
                  for r in regions[rank]]
              for v, tensors in named.items()}
    del named
    layout = ss.Layout(specs, bucket_bytes=bucket_bytes)
    plan = ss.RoutingPlan(layout, regions, [[ss.WireRange(*r) for r in needs]
                                            for needs in ranks["engine_needs"]])
    conn.send(("plan", plan.fingerprint, [plan.bytes_to_engine(e)
                                          for e in range(plan.engine_count)],
               plan.bytes_from_trainer(rank), sum(g.arena_bytes for g in layout.groups)))
    backend = ss.CudaBackend(gpu) if device == "cuda" else ss.HostBackend()
    if "nccl" in ranks:  # blocks until every engine rank joined (its init_weight_update_group)
        transport = ss.nccl_routed_transport(ranks["nccl"]["unique_id"], plan, rank, gpu,
                                             backend, ranks["nccl"]["gpus"])
    else:
        transport = ss.same_host_pull_trainer_transport(
            ranks["paths"][rank], ranks["token"], plan, rank, plan.engine_count, backend,
            memory="device" if device == "cuda" else "host",
            connect_timeout_ms=ranks["connect_timeout_ms"])
    sender = ss.Sender(layout, backend, transport, routing_plan=plan, trainer_rank=rank)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        version, source = message[1], message[2]
        start = time.monotonic()
        handle = sender.publish_shards(version, shards[source])
        conn.send(("header", handle.header_bytes))
        handle.wait(120)
        conn.send(("sent", time.monotonic() - start, plan.bytes_from_trainer(rank)))
    sender.close()


def sharded_trainer(args, llm, ctx, checkpoints: dict, adapters: dict, settings: dict, check,
                    update, ranks_agree) -> int:
    """--trainer-ranks M: the engine (holding A, its group closed) is taken over by a sharded
    trainer: M rank processes, weight_update_needs, each rank's routing plan, a wrong
    fingerprint refused naming both, init with trainer_ranks, updates B then A (check and
    update are main's: the answers, the coordinated commit under TP), each engine rank's routed
    bytes == its own needs. Then a trainer rank is SIGKILLed mid-update (trainer_rank_killed),
    and a restarted trainer's update applies. Returns the failures."""
    import shutil

    failures = 0
    count = args.trainer_ranks
    socket_dir = Path(tempfile.mkdtemp(prefix="ss-ranks-"))  # mode 0700
    nccl = args.transport == "nccl"
    # Same-host: colocated as a sharded trainer on the engine's GPUs, rank r beside engine rank
    # r mod tp, so routes run within a GPU and, by peer copies, across them. NCCL: rank r on GPU
    # --trainer-gpu + r, none of the engine's (NCCL refuses two ranks of one communicator on one
    # GPU).
    gpus = [args.trainer_gpu + r if nccl else r % args.tp for r in range(count)]
    processes: list = []

    def set_up(name: str, refuse_another_plan: bool):
        """M rank processes joined to the engine (its group closed): their pipes, the bytes to
        each engine rank and the wire's bytes. Logs a failure into `failures`."""
        import shadowsync.vllm as ssv

        nonlocal failures
        pipes = []
        for rank in range(count):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=trainer_rank, daemon=True, args=(
                child, rank, checkpoints, args.device, args.bucket_bytes, adapters, args.omit,
                gpus[rank], gpus + list(range(args.tp)) if nccl else None))
            process.start()
            child.close()
            pipes.append(parent)
            processes.append(process)
        _, specs, nccl_routes = [pipe.recv() for pipe in pipes][0]
        if nccl:
            ranks = dict(count=count, nccl=nccl_routes, regions=split_regions(specs, count))
        else:
            paths = [str(socket_dir / f"{name}-rank{r}.sock") for r in range(count)]
            ranks = dict(count=count, token=os.urandom(32).hex(), paths=paths,
                         regions=split_regions(specs, count), connect_timeout_ms=120_000)
        ranks["engine_needs"] = needs = ssv.weight_update_needs(
            llm, specs=specs, **settings, trainer_ranks=ranks)
        for pipe in pipes:
            pipe.send(("plan", ranks))
        plans = [pipe.recv() for pipe in pipes]
        fingerprint, to_engine, wire_bytes = plans[0][1], plans[0][2], plans[0][4]
        own = [sum(end - begin for _, begin, end in n) for n in needs]
        ok = all(p[1] == fingerprint for p in plans) and to_engine == own
        failures += not ok
        log(f"{'ok  ' if ok else 'FAIL'} {count} trainer ranks built one routing plan "
            f"({fingerprint:#018x}) from their regions and the engine ranks' needs: bytes per "
            f"engine rank {to_engine} (its needs {own}), per trainer rank "
            f"{[p[3] for p in plans]}, wire {wire_bytes}; the ranks on "
            f"{', '.join(f'cuda:{g}' for g in gpus) if args.device == 'cuda' else 'the cpu'}, "
            f"over {'NCCL point-to-point' if nccl else 'the same-host pull transport'}")
        if refuse_another_plan:
            try:
                ssv.init_weight_update_group(llm, specs=specs, **settings, trainer_ranks=dict(
                    ranks, fingerprint=fingerprint ^ 1))
                refused = "not refused"
            except Exception as error:  # noqa: BLE001 - the message is what is checked
                refused = str(error)
            ok = (f"differs from the trainers' ({fingerprint ^ 1:#018x})" in refused
                  and not any(llm.collective_rpc("has_weight_update_group")))
            failures += not ok
            log(f"{'ok  ' if ok else 'FAIL'} a routing plan of another fingerprint refused, "
                f"nothing set up: {refused[:200]}")
        ssv.init_weight_update_group(llm, specs=specs, **settings,
                                     trainer_ranks=dict(ranks, fingerprint=fingerprint))
        return TrainerRanks(pipes), to_engine, wire_bytes

    try:
        group, to_engine, wire_bytes = set_up("first", refuse_another_plan=True)
        check("after the sharded trainer's set-up", "A")
        update(group, 1, 1, "B")
        update(group, 2, 2, "A")
        stats = llm.collective_rpc("weight_update_stats")
        routed = [int(s["routed_bytes"]) for s in stats]
        ok = (routed == to_engine and all(int(s["trainer_count"]) == count for s in stats)
              and (args.tp == 1 or all(r < wire_bytes for r in routed)))
        failures += not ok
        log(f"{'ok  ' if ok else 'FAIL'} routed bytes per engine rank {routed}: its own needs "
            f"{to_engine}, of {wire_bytes} wire bytes, from {count} trainer ranks")
        # On GPUs the trainer ranks' shards (torch's cudaMalloc'd memory) are read in place;
        # host memory goes through the staging.
        in_place = [int(s.get("routed_in_place_bytes", 0)) for s in stats]
        ok = in_place == (routed if args.device == "cuda" else [0] * len(routed))
        failures += not ok
        log(f"{'ok  ' if ok else 'FAIL'} bytes read where the trainer ranks' shards lie, per "
            f"engine rank: {in_place} ({'all' if args.device == 'cuda' else 'none'} expected)")
        ranks_agree()
        if count == 1:  # the one rank's bytes could all land before it dies
            log("skip a trainer rank killed mid-update: one trainer rank")
            group.send(("stop",))
            last = "A"
        else:
            failures += trainer_rank_killed(llm, group, processes[-1], 3, check)
            for process in processes:  # the rest of the killed trainer
                process.kill()
                process.join(60)
            llm.collective_rpc("close_weight_update_group")
            check("after the killed trainer's close", "A")
            group, *_ = set_up("restarted", refuse_another_plan=False)
            update(group, 4, 1, "B")
            ranks_agree()
            group.send(("stop",))
            last = "B"
    finally:
        for process in processes:
            process.join(60)
            if process.is_alive():
                process.kill()
        shutil.rmtree(socket_dir, ignore_errors=True)
    llm.collective_rpc("close_weight_update_group")
    check("after the sharded trainer's close", last)
    return failures


def trainer_rank_killed(llm, group, victim, version: int, check) -> int:
    """A trainer rank SIGKILLed mid-update: every rank but `victim` (the last) publishes
    checkpoint 1 as `version`, the engine begins the update, `victim` is killed before it sends.
    Every engine rank must count the update failed (within 120 s, the engine generating
    meanwhile: NCCL routes wait for their bucket deadline), none may hold it ready, and the
    answers must still be A's: nothing went live. Returns the failures (0 or 1)."""
    before = [int(s["updates_failed"]) for s in llm.collective_rpc("weight_update_stats")]
    for pipe in group.pipes[:-1]:
        pipe.send(("publish", version, 1))
    header = group.pipes[0].recv()[1]
    llm.collective_rpc("begin_update", args=(header, False))
    victim.kill()
    victim.join(60)
    deadline = time.monotonic() + 120
    while True:
        stats = llm.collective_rpc("weight_update_stats")
        failed = [int(s["updates_failed"]) - b for s, b in zip(stats, before)]
        if all(f == 1 for f in failed) or time.monotonic() > deadline:
            break
        greedy(llm, None)  # the engine keeps generating while it waits
    ready = [int(v) for v in llm.collective_rpc("ready_version")]
    applied = [int(s["applied_version"]) for s in llm.collective_rpc("step_versions")]
    ok = all(f == 1 for f in failed) and version not in ready and max(applied) < version
    errors = {str(s.get("last_update_error"))[:160] for s in stats}
    log(f"{'ok  ' if ok else 'FAIL'} trainer rank {len(group.pipes) - 1} SIGKILLed mid-update "
        f"{version}: failed on every engine rank {failed}, ready {ready}, applied {applied}; "
        f"{sorted(errors)}")
    check(f"after a trainer rank was killed mid-update {version}", "A")
    return 0 if ok else 1


class TrainerRanks:
    """The pipes of a sharded trainer's rank processes, driven as one trainer's: a message goes
    to every rank; rank 0's header is the update's; an update is sent when every rank sent."""

    def __init__(self, pipes: list):
        self.pipes = pipes

    def send(self, message) -> None:
        for pipe in self.pipes:
            pipe.send(message)

    def poll(self) -> bool:
        return all(pipe.poll() for pipe in self.pipes)

    def recv(self):
        got = [pipe.recv() for pipe in self.pipes]
        if got[0][0] == "header":
            return got[0]
        if got[0][0] == "sent":
            return ("sent", max(g[1] for g in got), sum(g[2] for g in got))
        return got


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # JSON [[model, adapter], ...]
    parser.add_argument("--lora", action="store_true",
                        help="vLLM serves a LoRA adapter that every update carries too")
    parser.add_argument("--lora-embeddings", action="store_true",
                        help="with --lora: the adapters also adapt embed_tokens and lm_head")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--quantization", choices=("fp8",),
                        help="the engines start with quantization=QUANTIZATION (CUDA): vLLM "
                             "quantizes the bf16 checkpoint while loading, the receiver each "
                             "update; after each update the engine's float8 weights and scales "
                             "must equal a fresh engine's, byte for byte")
    parser.add_argument("--arch", default="llama", help=", ".join(ARCHS) + " (vllm_models.py)")
    parser.add_argument("--backend", choices=("shadowsync", "shadowsync_live_arena",
                                              "shadowsync_graph_pairs"),
                        help="the engine under test starts with weight_transfer_config "
                             "{'backend': BACKEND}; 'shadowsync' chooses the placement (logged, "
                             "and checked as --live-arena or --graph-pairs would be)")
    parser.add_argument("--live-arena", action="store_true",
                        help="the engine under test starts with weight_transfer_config "
                             "{'backend': 'shadowsync_live_arena'}: weights in a remap arena "
                             "before graph capture, swaps by remap (CUDA)")
    parser.add_argument("--graph-pairs", action="store_true",
                        help="the engine under test starts with weight_transfer_config "
                             "{'backend': 'shadowsync_graph_pairs'}: weights in the arena's two "
                             "slots, vLLM's CUDA graphs captured over each, swaps by rebind that "
                             "switch graph sets (CUDA)")
    parser.add_argument("--no-gated-swaps", action="store_true",
                        help="init_weight_update_group(gated_swaps=False): with --live-arena on "
                             "the GPU the engine thread remaps after the step in flight; by "
                             "default the remap waits behind a gate on vLLM's stream there. The "
                             "run logs how many updates went live behind a gate and fails if the "
                             "watchdog had to open one")
    parser.add_argument("--omit", action="append", default=[], metavar="NAME",
                        help="the trainer leaves this tensor out (allow_partial): the engine "
                             "keeps its own (repeatable)")
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's default engine process (collective_rpc between steps)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size (> 1: multiprocess, coordinated commit)")
    parser.add_argument("--transport", choices=("same-host", "nccl"), default="same-host",
                        help="the trainer's transport (nccl: CUDA, the trainer on --trainer-gpu)")
    parser.add_argument("--trainer-gpu", type=int, default=0,
                        help="the trainer's GPU (CUDA; with nccl none of vLLM's 0..tp-1)")
    parser.add_argument("--api", action="store_true",
                        help="drive the updates through vLLM's own weight-transfer calls "
                             "(init_weight_transfer_engine, start_weight_update, update_weights, "
                             "finish_weight_update) with the backend (default 'shadowsync') "
                             "instead of the worker extension's")
    parser.add_argument("--trainer-ranks", type=int, default=0, metavar="M",
                        help="last, a sharded trainer of M rank processes takes the engine over "
                             "(ShadowsyncInitInfo.trainer_ranks: each rank holds only its rows "
                             "of every tensor, down_proj's columns, and sends only those over "
                             "the same-host pull transport: host memory on the CPU; with "
                             "--device cuda rank r's memory on GPU r mod tp, beside engine "
                             "rank r): updates B then A")
    parser.add_argument("--reinit", action="store_true",
                        help="a third update, close, a second init with a new trainer, a fourth "
                             "update (an odd number of swaps before the close)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    from vllm_update.options import engine_options_error  # standard library only at import

    refused = engine_options_error(args)
    if refused:
        parser.error(refused)
    if args.quantization and args.device != "cuda":
        parser.error("--quantization: vLLM's FP8 kernels run on CUDA; use --device cuda")
    if args.api and args.reinit:
        parser.error("--api: --reinit re-initializes through the worker extension; leave it out")
    if args.trainer_ranks and args.api:
        parser.error("--trainer-ranks: the worker extension's calls (no --api)")
    if args.api and not args.backend:
        args.backend = "shadowsync"
    if args.live_arena:
        args.backend = "shadowsync_live_arena"
    if args.graph_pairs:
        args.backend = "shadowsync_graph_pairs"
    if args.tp > 1:
        args.multiprocess = True
        if args.device == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    # A reference process on cpu keeps vLLM's engine core in itself (under TP its workers still
    # get processes of their own): one process fewer to start per reference engine.
    core_process = args.multiprocess and not (args.reference and args.device == "cpu")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if core_process else "0"
    import torch  # noqa: F401  (before vLLM: one NCCL/CUDA runtime in the process)
    from vllm import LLM

    if args.reference:
        for model, reference_adapter in json.loads(args.reference):
            llm = LLM(**engine_kwargs(args.device, model, args.tp, lora=bool(reference_adapter),
                                      quantization=args.quantization))
            answers = {"base": greedy(llm)}
            if args.quantization:
                answers["weights"] = llm.collective_rpc(quantized_weights)[0]
            if reference_adapter:
                answers["adapter"] = greedy(llm, reference_adapter)
            print(ANSWERS + json.dumps(answers), flush=True)
            llm.llm_engine.engine_core.shutdown()  # before the next engine starts
            del llm
        return 0

    from vllm_models import (LORA_EMBEDDING_TARGETS, LORA_TARGETS, make_tiny_lora,
                             make_tiny_model, with_tensors_of)

    import shadowsync.vllm as ssv
    from shadowsync.vllm.step_agreement import LiveWatch

    work = Path(tempfile.mkdtemp(prefix="vllm-e2e-"))
    # initializer_range 0.1: with the default 0.02 two random tied models can answer alike.
    a = make_tiny_model(args.arch, str(work / "A"), seed=1, initializer_range=0.1)
    b = make_tiny_model(args.arch, str(work / "B"), seed=2, initializer_range=0.1)
    # --lora: A is served with adapter L1, B with L2 (an update carries both groups).
    adapter = {"A": None, "B": None}
    if args.lora:
        targets = LORA_TARGETS + (LORA_EMBEDDING_TARGETS if args.lora_embeddings else ())
        adapter = {name: make_tiny_lora(a, work / f"L{seed - 10}", seed=seed, r=LORA_R,
                                        lora_alpha=LORA_ALPHA, targets=targets)
                   for name, seed in (("A", 11), ("B", 12))}
    # What the engine holds after update 1: B, with A's tensors where the trainer omits them.
    b_kept = with_tensors_of(b, a, args.omit, work / "B-kept") if args.omit else b
    started = time.monotonic()
    expected = dict(zip("AB", references(args.device, args.tp,
                                         [(a, adapter["A"]), (b_kept, adapter["B"])],
                                         args.quantization)))
    # What a fresh engine computed from each checkpoint after loading it (--quantization).
    weights = {name: answers.pop("weights", None) for name, answers in expected.items()}
    log(f"{args.arch}, {'multiprocess' if args.multiprocess else 'in-process'} engine; "
        f"references of A and B from fresh engines in {time.monotonic() - started:.1f} s; "
        f"A {expected['A']['base'][0][:6]}..., B {expected['B']['base'][0][:6]}...")
    # Every pair of expected answers differs: the checks below can tell each from the others.
    distinct = [(name, kind, answers) for name in expected
                for kind, answers in expected[name].items()]
    for i, (name, kind, answers) in enumerate(distinct):
        for other, other_kind, other_answers in distinct[i + 1:]:
            if answers == other_answers:
                log(f"FAIL: {name}'s {kind} answers equal {other}'s {other_kind} answers; the "
                    f"check could not tell them apart")
                return 1

    # --api: no worker extension named; the backend mixes it into vLLM's worker itself.
    extension = {} if args.api else {"worker_extension_cls": "shadowsync.vllm.WorkerExtension"}
    llm = LLM(**engine_kwargs(args.device, a, args.tp, lora=args.lora,
                              quantization=args.quantization), **extension,
              **({"weight_transfer_config": {"backend": args.backend}} if args.backend else {}))
    if args.backend == "shadowsync":  # what it chose is checked below as if asked for by name
        swap = llm.collective_rpc("memory_report")[0]["swap"]
        log(f"backend 'shadowsync' chose: {swap['placement']}, because {swap['why']}")
        args.live_arena = swap["placement"] == "live arena"
        args.graph_pairs = swap["placement"] == "graph pairs"
    failures = 0

    def check(stage: str, want: str) -> None:
        """The engine's answers now against a fresh vLLM of `want`: requests without an
        adapter, and with --lora also requests with adapter 1 (whatever its slot holds now)."""
        nonlocal failures
        for kind in expected[want]:
            got = greedy(llm, adapter["A"] if kind == "adapter" else None)
            same = got == expected[want][kind]
            failures += not same
            if kind == "adapter":
                what = f" with adapter {Path(adapter[want]).name}"
            else:
                what = " (requests without an adapter)" if args.lora else ""
            log(f"{'ok  ' if same else 'FAIL'} {stage}: answers "
                f"{'equal' if same else 'differ from'} a fresh vLLM of {want}{what}"
                + ("" if same else f" (got {got[0][:8]}, want {expected[want][kind][0][:8]})"))
        if weights[want] is not None:
            have = llm.collective_rpc(quantized_weights)[0]
            differ = sorted(n for n in weights[want] if have.get(n) != weights[want][n])
            same = bool(weights[want]) and not differ and have.keys() == weights[want].keys()
            failures += not same
            log(f"{'ok  ' if same else 'FAIL'} {stage}: the engine's {len(have)} float8 weights "
                f"and scales {'equal' if same else 'differ from'} a fresh vLLM of {want}'s, "
                f"byte for byte" + ("" if same else f" ({len(differ)} differ: {differ[:4]})"))

    check("before set-up", "A")
    ctx = mp.get_context("spawn")
    adapters = {1: adapter["B"], 2: adapter["A"]} if args.lora else {}

    def start_trainer():
        """A trainer process serving a new transport: (process, pipe, its specs, the transport
        keyword arguments of init_weight_update_group)."""
        socket_dir = Path(tempfile.mkdtemp(prefix="ss-"))
        os.chmod(socket_dir, 0o700)
        path, token = str(socket_dir / "trainer.sock"), os.urandom(32)
        parent, child = ctx.Pipe()
        process = ctx.Process(target=trainer, args=(child, {1: b, 2: a}, args.device, path, token,
                                                    args.bucket_bytes, args.tp, adapters,
                                                    args.omit, args.transport == "nccl",
                                                    args.trainer_gpu), daemon=True)
        process.start()
        child.close()  # this end only: a trainer that dies then ends parent.recv() with EOFError
        _, specs, unique_id = parent.recv()
        transport = (dict(unique_id=unique_id, rank_offset=1, world_size=1 + args.tp)
                     if unique_id is not None else dict(same_host=dict(path=path, token=token)))
        return process, parent, specs, transport

    def stop_trainer(process, parent) -> None:
        parent.send(("stop",))
        process.join(60)

    process, parent, specs, transport = start_trainer()
    settings = dict(bucket_bytes=args.bucket_bytes, track_request_versions=True,
                    lora_adapter=1 if args.lora else None, allow_partial=bool(args.omit),
                    **({"gated_swaps": False} if args.no_gated_swaps else {}))
    # Bad input first: a trainer tensor the model's load_weights does not take. Refused with its
    # name on every worker (under TP as a returned refusal: a raise would end vLLM's engine),
    # nothing set up (no transport either: the trainer still waits for the real one), and the
    # engine goes on answering.
    extra = ("model.layers.0.mlp.not_a_weight", specs[0][1], (4,))
    def set_up(specs) -> int:
        """The worker joins the trainer: vLLM's init_weight_transfer_engine (--api, the info as
        plain data; the fingerprint from the receiver's statistics) or the front-end call."""
        if not args.api:
            return ssv.init_weight_update_group(llm, specs=specs, **settings, **transport)
        info = ssv.ShadowsyncInitInfo(specs=specs, **settings, **transport)
        llm.init_weight_transfer_engine({"init_info": info.to_rpc()})
        return llm.collective_rpc("weight_update_stats")[0]["wire_fingerprint"]

    try:
        set_up(specs + [extra])
        refused = "not refused"
    except Exception as error:  # noqa: BLE001 - through vLLM's API a plain Exception names it
        refused = str(error)
    ok = extra[0] in refused and not any(llm.collective_rpc("has_weight_update_group"))
    failures += not ok
    log(f"{'ok  ' if ok else 'FAIL'} init with a tensor load_weights does not take refused, "
        f"nothing set up: {refused[:160]}")
    check("after the refused set-up", "A")
    fingerprint = set_up(specs)
    stats = llm.collective_rpc("weight_update_stats")[0]
    log(f"set-up: {len(specs)} trainer tensors over {args.transport}, {stats['plan_copies']} plan "
        f"copies ({stats['plan_pieces']} pieces per update, staging "
        f"{stats['plan_staging_bytes']} bytes), {stats['kept_params']} kept, swap strategy "
        f"{stats['swap_strategy']}, "
        f"live arena {stats['live_arena']}, graph pairs {stats['graph_pairs']}, "
        f"fingerprint {fingerprint:#018x}")
    if args.live_arena:
        ok = stats["live_arena"] and stats["swap_strategy"] == "remap"
        failures += not ok
        log(f"{'ok  ' if ok else 'FAIL'} the receiver swaps the live arena by remap")
    if args.graph_pairs:
        ok = stats["live_arena"] and stats["graph_pairs"] and stats["swap_strategy"] == "rebind"
        failures += not ok
        log(f"{'ok  ' if ok else 'FAIL'} the receiver rebinds between the arena's slots and "
            f"switches vLLM's graph sets")
    check("after set-up, before any update", "A")

    def update(parent, version: int, source: int, name: str, verify: bool = False,
               step_agreed: bool = False) -> None:
        """The trainer publishes checkpoint `source` as `version` while the engine generates;
        it goes live (commit_update under TP) and the answers must be `name`'s. `verify`: the
        self-check (the engine holds `source` already; every parameter is compared).
        `step_agreed`: commit_mode "auto" under TP; the engine generates on until the step
        hooks made it live on every rank."""
        nonlocal failures
        parent.send(("publish", version, source))
        kind, header = parent.recv()
        if args.api:  # returns at once: the receive runs on while the engine generates
            llm.start_weight_update()
            llm.update_weights({"update_info": {"header": base64.b64encode(header).decode(),
                                                "verify_matches_live": verify}})
        else:
            llm.collective_rpc("begin_update", args=(header, verify))
        during = 0
        while not parent.poll():  # the engine keeps generating while the update streams
            during += sum(len(t) for t in greedy(llm, adapter["A"]))
        kind, seconds, nbytes = parent.recv()
        if args.api:  # live between two steps on every rank when it returns
            llm.finish_weight_update()
            llm.reset_prefix_cache()  # nothing runs here: prompts' KV of the old weights goes
            applied = min(int(s["applied_version"]) for s in llm.collective_rpc("step_versions"))
        elif step_agreed:
            deadline = time.monotonic() + 60
            while (min(int(s["applied_version"]) for s in llm.collective_rpc("step_versions"))
                   < version and time.monotonic() < deadline):
                during += sum(len(t) for t in greedy(llm, adapter["A"]))  # steps: the hooks
            applied = ssv.apply_update(llm, version, timeout=60)  # live already: returns
            # A commit_update of it too (a caller written for coordinated): answered as live.
            committed = ssv.commit_update(llm, version, timeout=10)
            stats = llm.collective_rpc("weight_update_stats")
            # What apply_update_async reads instead of asking: rank 0's page, from this process.
            watch = LiveWatch.open(next((p["live_watch"] for p in llm.collective_rpc(
                "update_progress") if p.get("live_watch")), None))
            seen = watch.read() if watch is not None else None
            ok = (all(st["step_agreement"] and st["agreed_commits"] == 1 for st in stats)
                  and committed == version and seen is not None and seen[0] == version
                  and seen[1] > 0)
            failures += not ok
            log(f"{'ok  ' if ok else 'FAIL'} update {version} went live in the step hooks of the "
                f"{args.tp} ranks (commit_mode auto, no commit_update; one afterwards "
                f"answers {committed}): agreed commits "
                f"{[st['agreed_commits'] for st in stats]}, longest wait for rank 0 "
                f"{max(st['agreement_wait_s'] for st in stats) * 1e3:.2f} ms; the front end "
                f"reads (version live, rank 0's step) {seen} on rank 0's page")
        elif args.tp > 1:  # every rank holds it ready; one collective_rpc makes it live on all
            wait_ready(llm, version)
            # A version no rank holds ready: refused on every rank, nothing flips anywhere.
            before = [int(s["applied_version"]) for s in llm.collective_rpc("step_versions")]
            results = llm.collective_rpc("commit_update", args=(version + 100,))
            still = [int(s["applied_version"]) for s in llm.collective_rpc("step_versions")]
            ok = (all("nothing was committed on any rank" in r.get("refused", "") for r in results)
                  and still == before and max(still) < version)
            failures += not ok
            log(f"{'ok  ' if ok else 'FAIL'} commit_update({version + 100}) refused on every "
                f"rank, applied versions still {still}")
            # Dropping an older update than the one held (what commit_update sends when an
            # update is ready on some ranks only) leaves the held one ready on every rank.
            dropped = llm.collective_rpc("discard_ready_update", args=(version - 1,))
            ready_after = [int(v) for v in llm.collective_rpc("ready_version")]
            ok = (all(d.get("discarded") == 0 for d in dropped)
                  and ready_after == [version] * args.tp)
            failures += not ok
            log(f"{'ok  ' if ok else 'FAIL'} discard_ready_update({version - 1}) on every rank: "
                f"{dropped}; update {version} still ready on the ranks: {ready_after}")
            applied = ssv.commit_update(llm, version, timeout=60)
        else:
            applied = ssv.apply_update(llm, version, timeout=60)
        checked = ""
        if verify:
            seconds_ready = llm.collective_rpc("weight_update_stats")[0]["last_transfer_s"]
            checked = (f" (self-check: every parameter matched the live copy; receive and check "
                       f"{seconds_ready * 1e3:.1f} ms)")
        log(f"update {version}: {nbytes} bytes sent in {seconds * 1e3:.1f} ms; {during} tokens "
            f"generated meanwhile; applied {applied}{checked}")
        check(f"after update {version}", name)

    def ranks_agree() -> None:
        """Under TP: every rank made each version live at the same step."""
        nonlocal failures
        if args.tp == 1:
            return
        logs = llm.collective_rpc("step_versions")
        same = all(log == logs[0] for log in logs)
        failures += not same
        log(f"{'ok  ' if same else 'FAIL'} step versions of the {args.tp} ranks "
            f"{'agree' if same else 'differ'}: {[log['transitions'] for log in logs]}, "
            f"steps {[log['steps'] for log in logs]}")

    update(parent, 1, 1, "B")
    update(parent, 2, 2, "A")
    if args.reinit:  # an odd number of swaps: with graph pairs the live slot is slot 1 now
        update(parent, 3, 1, "B")
    # The self-check: the checkpoint the engine holds, compared parameter by parameter.
    update(parent, 4 if args.reinit else 3, 1 if args.reinit else 2, "B" if args.reinit else "A",
           verify=True)
    ranks_agree()
    stats = llm.collective_rpc("weight_update_stats")[0]
    log(f"gated swaps {stats['gated_swaps']}, gates the watchdog opened "
        f"{stats['gates_abandoned']}, step hook at {stats['step_hook_at']}")
    if stats["gates_abandoned"]:
        failures += 1
        log("FAIL a gate was abandoned: vLLM waited for its stream between the step's forward and "
            "its post_forward")
    versions = llm.collective_rpc("request_versions")[0]
    seen = sorted({v for segments in versions.values() for v, _ in segments})
    log(f"request_versions: {len(versions)} requests, versions seen {seen}")
    stop_trainer(process, parent)
    llm.collective_rpc("close_weight_update_group")
    check("after close_weight_update_group", "B" if args.reinit else "A")
    if args.reinit:  # a second group over what the first one left live
        process, parent, specs, transport = start_trainer()
        # Under TP: commit_mode "auto", the step hooks agree on the step (step_agreement.py).
        ssv.init_weight_update_group(llm, specs=specs, **settings, **transport,
                                     **({"commit_mode": "auto"} if args.tp > 1 else {}))
        check("after the second set-up", "B")
        update(parent, 5, 2, "A", step_agreed=args.tp > 1)
        ranks_agree()
        stop_trainer(process, parent)
        llm.collective_rpc("close_weight_update_group")
        check("after the second close_weight_update_group", "A")
    if args.trainer_ranks:
        # Apart: check and update count their failures into this function's own.
        extra = sharded_trainer(args, llm, ctx, {1: b, 2: a}, adapters, settings, check, update,
                                ranks_agree)
        failures += extra
    log("PASSED" if failures == 0 else f"FAILED ({failures} stage(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
