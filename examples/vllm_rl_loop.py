"""An RL-style loop with real vLLM: the engine keeps generating while a trainer process streams
new weights into it, and every update becomes live between two engine steps.

    python examples/vllm_rl_loop.py --device cpu --updates 3            # vLLM's CPU build
    python examples/vllm_rl_loop.py --device cuda --model /path/to/hf-checkpoint

Two processes take part:

* this one, the FRONT END: an ``AsyncLLM`` (vLLM's asynchronous engine, in its default
  multiprocess mode: the engine core and the worker run in processes of their own) with the
  worker extension ``shadowsync.vllm.WorkerExtension`` and ``weight_transfer_config={"backend":
  "shadowsync"}`` (the weights placed for the fastest correct swap; it prints which). A fixed number of client tasks keep
  submitting sampled requests, so the engine is never idle: that is the load an RL rollout puts
  on it.
* the TRAINER process: holds the same checkpoint as a Hugging Face model, "trains" (each step
  adds a little noise to every weight: a stand-in for an optimizer step) and every
  ``--every-seconds`` publishes its weights as a new version through shadowsync's same-host
  transport (a shared memory file on CPU, GPU memory on CUDA).

The worker joins the trainer once, from plain data sent through ``collective_rpc``:

    await shadowsync.vllm.init_weight_update_group_async(engine,
        specs=<the trainer's named_parameters() specs>, same_host=dict(path=..., token=...),
        track_request_versions=True)   # collective_rpc on every worker; a refusal is raised

and then, per update:

    engine.collective_rpc("begin_update", args=(header,))   # returns at once; the receive runs
                                                            # on the library's own thread
    ... the trainer reports the update sent ...
    await shadowsync.vllm.apply_update_async(engine, version,   # live from the next step on
                                             reset_prefix_cache=False)

(Requests carry ``cache_salt`` = the policy version instead of a prefix cache reset: see
Traffic.)

The trainer sends its own tensors (HF names, q/k/v and gate/up separate); the worker derived
once, from vLLM's own weight loader, where each of them goes in vLLM's fused layout, so the
trainer needs no knowledge of vLLM's internals.

The output is one line per update: its version, the bytes received, the transfer time (the
trainer's publish until the worker had every byte), the engine's stall (the largest gap between
two tokens of a request during the update, less the median gap: what the receive and the swap
cost the requests), the engine thread's time in the swap itself (``swap_ms``, from
``weight_update_stats``) and the tokens generated while the update streamed. Then a summary, and a
check: the engine applied every version and its requests ran on all of them
(``request_versions``: the tokens each request computed under each weight version, what an RL
trainer needs to know which policy made which tokens). The exit status is 0 when it passed.

``--model tiny`` (the default) makes a tiny random Llama here, so the example needs no download;
give the path of a real Hugging Face checkpoint (a directory with config.json and safetensors)
to run on it. Prompts are random token ids (no tokenizer is needed); a real RL loop would send
its own prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Run from a source checkout without installing: use the checkout's `shadowsync` package. (vLLM
# starts its processes with `spawn`, which hands them this sys.path, so the worker finds
# shadowsync.vllm too.)
_CHECKOUT_PYTHON = Path(__file__).resolve().parent.parent / "python"
if (_CHECKOUT_PYTHON / "shadowsync").is_dir():
    sys.path.insert(0, str(_CHECKOUT_PYTHON))


def log(message: str) -> None:
    print(f"[rl-loop] {message}", flush=True)


# --- a tiny model, so that the example runs without a download ---------------------------------

def make_tiny_llama(path: Path, seed: int = 0) -> str:
    """Writes a random 2-layer Llama (hidden 128; vLLM's CPU attention needs head_dim >= 32) as a
    Hugging Face checkpoint into `path` and returns it. No tokenizer: the prompts are token ids."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return str(path)


# --- the trainer process -----------------------------------------------------------------------

def trainer_process(conn, model_path: str, device: str, dtype_name: str, socket_path: str,
                    token: bytes, bucket_bytes: int, updates: int, every_seconds: float,
                    step_seconds: float, noise: float) -> None:
    """The trainer: a Hugging Face model and a shadowsync Sender. Talks to the front end over
    `conn` (a multiprocessing pipe); any failure is sent there as ("error", traceback)."""
    try:
        _train_and_publish(conn, model_path, device, dtype_name, socket_path, token, bucket_bytes,
                           updates, every_seconds, step_seconds, noise)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def _train_and_publish(conn, model_path, device, dtype_name, socket_path, token, bucket_bytes,
                       updates, every_seconds, step_seconds, noise):
    import torch
    import transformers

    import shadowsync as ss

    if device == "cpu":
        torch.set_num_threads(1)  # the engine needs the machine's cores more than this stand-in
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, dtype_name)).to("cuda:0" if device == "cuda" else "cpu")
    params = dict(model.named_parameters())

    # The layout: every tensor the trainer sends, in its own names, dtypes and shapes. The worker
    # gets the same specs (plain tuples travel through collective_rpc) and builds the same layout;
    # both sides' fingerprints must agree.
    layout = ss.Layout.from_named_tensors(params.items(), bucket_bytes=bucket_bytes)
    specs = [(s.name, s.dtype, s.shape, s.group) for s in layout.specs]
    conn.send(("specs", specs, layout.fingerprint))

    # Serve the same-host transport once the front end is about to connect the worker: this
    # blocks until the worker joined with the token.
    assert conn.recv() == ("serve",)
    backend = ss.CudaBackend(0) if device == "cuda" else ss.HostBackend()
    transport = ss.same_host_sender_transport(
        socket_path, token, 1, backend, slot_bytes=layout.groups[0].bucket_bytes,
        memory="device" if device == "cuda" else "host")
    sender = ss.Sender(layout, backend, transport)
    conn.send(("ready",))

    assert conn.recv() == ("go",)
    generator = torch.Generator(device=model.device).manual_seed(0)
    for version in range(1, updates + 1):
        # "Train" for every_seconds: each step nudges every weight by about `noise` of its mean
        # magnitude, and lasts step_seconds (the time a real optimizer step would take).
        steps, until = 0, time.monotonic() + every_seconds
        while time.monotonic() < until:
            started = time.monotonic()
            with torch.no_grad():
                for p in params.values():
                    step = torch.randn(p.shape, generator=generator, device=p.device, dtype=p.dtype)
                    p.add_(step * (noise * p.abs().mean()))
            steps += 1
            time.sleep(max(0.0, step_seconds - (time.monotonic() - started)))

        # Publish: returns at once with the header the engine needs; the bytes stream while the
        # engine keeps generating. The weights must not change until the handle is done (a real
        # trainer would keep training on a copy, or publish between optimizer steps).
        started = time.monotonic()
        handle = sender.publish(version, {name: p.detach() for name, p in params.items()})
        conn.send(("header", version, handle.header_bytes, steps))
        handle.wait(120)  # until the worker has every byte
        conn.send(("sent", version, time.monotonic() - started))

    assert conn.recv() == ("stop",)
    sender.close()
    conn.send(("stopped",))


# --- the front end: continuous generation ------------------------------------------------------

class Traffic:
    """`clients` asyncio tasks, each submitting one sampled request after another until stop():
    the steady stream of rollouts an RL loop keeps the engine busy with. Records when each output
    arrived, to count the tokens of a time window and to see the engine's stalls (a swap between
    two steps shows as a longer gap between two tokens of a request).

    Each request carries ``cache_salt`` = the policy version live when it was submitted: vLLM
    shares prefix-cache blocks only between requests of one salt, so a request never reuses KV
    that older weights computed. (vLLM's prefix cache reset cannot do this here: it refuses while
    any request is running, and this engine always has requests running.)"""

    def __init__(self, engine, clients: int, max_tokens: int, vocab_size: int):
        from vllm import SamplingParams

        self.engine = engine
        self.clients = clients
        self.vocab_size = vocab_size
        self.params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        self.arrivals: list[tuple[float, int]] = []  # (time, new tokens) per output received
        self.gaps: list[tuple[float, float]] = []  # (start, end) between two outputs of a request
        self.requests = 0
        self.policy_version = 0  # the version new requests are salted with; set by the loop
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self._arrived = asyncio.Condition()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]

    async def stop(self) -> None:
        """Lets every client finish its current request, then returns."""
        self._stopping = True
        await asyncio.gather(*self._tasks)

    async def _client(self, index: int) -> None:
        rng = random.Random(index)
        while not self._stopping:
            prompt = {"prompt_token_ids": [rng.randrange(3, self.vocab_size)
                                           for _ in range(rng.randrange(8, 33))],
                      "cache_salt": f"policy-v{self.policy_version}"}
            request_id = f"client{index}-{self.requests}"
            self.requests += 1
            last, tokens = None, 0
            async for output in self.engine.generate(prompt, self.params, request_id):
                now = time.monotonic()
                total = len(output.outputs[0].token_ids)  # cumulative: all tokens so far
                self.arrivals.append((now, total - tokens))
                tokens = total
                if last is not None:
                    self.gaps.append((last, now))
                last = now
                async with self._arrived:
                    self._arrived.notify_all()

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.arrivals if start <= t < end)

    def max_gap(self, start: float, end: float) -> float:
        """The longest gap between two tokens of one request that overlaps [start, end]."""
        return max((b - a for a, b in self.gaps if a < end and b > start), default=0.0)

    def median_gap(self) -> float:
        return statistics.median(b - a for a, b in self.gaps) if self.gaps else 0.0

    async def wait_outputs_after(self, moment: float, count: int, timeout: float) -> None:
        """Until `count` outputs arrived after `moment` (so the gaps spanning it are recorded)."""
        async with self._arrived:
            await asyncio.wait_for(self._arrived.wait_for(
                lambda: sum(1 for t, _ in self.arrivals if t > moment) >= count), timeout)


async def receive(conn, expected: str, timeout: float = 120.0) -> tuple:
    """The trainer's next message, which must be `expected`; its failure or silence raises."""
    if not await asyncio.to_thread(conn.poll, timeout):
        raise TimeoutError(f"no '{expected}' message from the trainer in {timeout:.0f} s")
    try:
        message = conn.recv()
    except EOFError:
        raise RuntimeError(f"the trainer exited while '{expected}' was awaited") from None
    if message[0] == "error":
        raise RuntimeError(f"the trainer failed:\n{message[1]}")
    if message[0] != expected:
        raise RuntimeError(f"the trainer sent '{message[0]}', expected '{expected}'")
    return message


def engine_args(args, model_path: str):
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = dict(model=model_path, dtype=args.dtype, max_model_len=256, max_num_seqs=args.clients,
                  skip_tokenizer_init=True, disable_log_stats=True, seed=0,
                  worker_extension_cls="shadowsync.vllm.WorkerExtension",
                  # Places the weights at load for the fastest correct swap (graph pairs under
                  # CUDA graphs, in place on vLLM CPU) and says which.
                  weight_transfer_config={"backend": "shadowsync"})
    if args.device == "cpu":
        # vLLM's CPU backend computes linear layers from packed copies of their weights, which an
        # update would not reach; this registered "quantization" keeps vLLM's plain weights as
        # the parameters the model computes with. A fixed KV cache size: the CPU backend would
        # otherwise size it from the machine's free memory.
        import shadowsync.vllm.unpacked as unpacked

        unpacked.register()
        kwargs.update(quantization=unpacked.NAME, enforce_eager=True,
                      kv_cache_memory_bytes=args.kv_cache_mib << 20)
    else:
        # CUDA graphs stay on: the extension then copies each update into vLLM's own parameters
        # (copy_in), which the graphs were captured over. Leave GPU memory to the trainer.
        kwargs.update(gpu_memory_utilization=args.gpu_memory_utilization)
    return AsyncEngineArgs(**kwargs)


class VersionTally:
    """What ``request_versions`` reported: tokens computed per weight version, and how many
    requests ran on more than one (their early tokens came from an older policy)."""

    def __init__(self):
        self.tokens: dict[int, int] = {}
        self.mixed_requests = 0

    async def collect(self, engine) -> None:
        # Popped: the worker forgets what it returned. One answer per worker; one worker here.
        for segments in (await engine.collective_rpc("request_versions"))[0].values():
            self.mixed_requests += len({version for version, _ in segments}) > 1
            for version, tokens in segments:
                self.tokens[version] = self.tokens.get(version, 0) + tokens


async def run(args, model_path: str, work: Path) -> int:
    from vllm.v1.engine.async_llm import AsyncLLM

    import shadowsync.vllm as ssv

    # The trainer starts first: it loads its model while vLLM starts.
    socket_dir = work / "socket"
    socket_dir.mkdir(mode=0o700)  # the transport wants a directory only this user can enter
    socket_path, token = str(socket_dir / "trainer.sock"), os.urandom(32)
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe()
    trainer = context.Process(target=trainer_process, name="trainer", daemon=True, args=(
        child_conn, model_path, args.device, args.dtype, socket_path, token,
        args.bucket_mib << 20, args.updates, args.every_seconds, args.step_seconds, args.noise))
    trainer.start()
    child_conn.close()  # the trainer's end: closed here, so its death reads as EOF

    started = time.monotonic()
    engine = AsyncLLM.from_engine_args(engine_args(args, model_path))
    try:
        log(f"vLLM started in {time.monotonic() - started:.1f} s ({args.device}, {args.dtype})")

        # The worker joins the trainer's transport. Both calls block until the other side is
        # there: the trainer serves while the worker connects.
        _, specs, fingerprint = await receive(conn, "specs")
        conn.send(("serve",))
        worker_fingerprint = await ssv.init_weight_update_group_async(
            engine, specs=specs, bucket_bytes=args.bucket_mib << 20,
            same_host=dict(path=socket_path, token=token), track_request_versions=True)
        await receive(conn, "ready")
        if worker_fingerprint != fingerprint:
            raise RuntimeError(f"layout fingerprints differ: worker(s) {worker_fingerprint:#x}, "
                               f"trainer {fingerprint:#x}")
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        swap = (await engine.collective_rpc("memory_report"))[0]["swap"]
        if swap is not None:
            log(f"swap: {swap['placement']} ({swap['why']})")
        log(f"worker joined the trainer: {len(specs)} trainer tensors, {stats['plan_copies']} "
            f"copies into vLLM's parameters per update")

        with open(Path(model_path) / "config.json") as f:
            vocab_size = json.load(f)["vocab_size"]
        traffic = Traffic(engine, args.clients, args.max_tokens, vocab_size)
        traffic.start()
        generation_started = time.monotonic()
        conn.send(("go",))

        tally = VersionTally()
        transfers, stalls = [], []
        received_before = stats["bytes_received"]
        for _ in range(args.updates):
            _, version, header, train_steps = await receive(conn, "header")
            begun = time.monotonic()
            # The receive starts on the worker's native thread; this call returns at once.
            await engine.collective_rpc("begin_update", args=(header,))
            _, _, transfer = await receive(conn, "sent")
            sent = time.monotonic()
            # Live between two steps (the next step runs on it). No prefix cache reset: the
            # requests' cache_salt keeps versions apart (see Traffic).
            applied = await ssv.apply_update_async(engine, version, timeout=60,
                                                   reset_prefix_cache=False)
            done = time.monotonic()
            if applied != version:
                raise RuntimeError(f"update {version}: the worker applied version {applied}")
            traffic.policy_version = version
            await traffic.wait_outputs_after(done, args.clients, timeout=60)

            stats = (await engine.collective_rpc("weight_update_stats"))[0]
            nbytes = stats["bytes_received"] - received_before  # the counter is cumulative
            received_before = stats["bytes_received"]
            stall = max(0.0, traffic.max_gap(begun, done) - traffic.median_gap())
            transfers.append(transfer)
            stalls.append(stall)
            log(f"update version={version} bytes={nbytes} "
                f"transfer_ms={transfer * 1e3:.1f} stall_ms={stall * 1e3:.1f} "
                f"swap_ms={stats['last_swap_s'] * 1e3:.2f} "
                f"tokens_during_transfer={traffic.tokens_between(begun, sent)} "
                f"(trainer steps {train_steps}; largest inter-token gap "
                f"{traffic.max_gap(begun, done) * 1e3:.1f} ms vs median "
                f"{traffic.median_gap() * 1e3:.1f} ms)")

            # The RL bookkeeping: which weight version computed which tokens of each request.
            await tally.collect(engine)

        await traffic.stop()
        elapsed = time.monotonic() - generation_started
        await tally.collect(engine)
        stats = (await engine.collective_rpc("weight_update_stats"))[0]
        conn.send(("stop",))
        await receive(conn, "stopped")
        await engine.collective_rpc("close_weight_update_group")

        generated = traffic.tokens_between(0.0, float("inf"))
        log(f"summary: {args.updates} updates in {elapsed:.1f} s of generation; {generated} tokens "
            f"generated ({generated / elapsed:.0f} tokens/s) by {traffic.requests} requests; "
            f"transfer median {statistics.median(transfers) * 1e3:.1f} ms; engine stall median "
            f"{statistics.median(stalls) * 1e3:.1f} ms, max {max(stalls) * 1e3:.1f} ms")
        log(f"request_versions: tokens computed per weight version "
            f"{dict(sorted(tally.tokens.items()))}; {tally.mixed_requests} request(s) "
            f"ran on more than one version")

        # The check: every version was applied, and requests really ran on each of them.
        wanted = set(range(args.updates + 1))  # version 0: the checkpoint the engine started on
        problems = []
        if stats["applied_version"] != args.updates:
            problems.append(f"applied_version {stats['applied_version']}, expected {args.updates}")
        if stats["updates_failed"]:
            problems.append(f"{stats['updates_failed']} update(s) failed "
                            f"({stats['last_update_error']})")
        if set(tally.tokens) != wanted:
            problems.append(f"request_versions saw versions {sorted(tally.tokens)}, "
                            f"expected {sorted(wanted)}")
        if problems:
            log("FAILED: " + "; ".join(problems))
            return 1
        log(f"PASSED: versions advanced to {stats['applied_version']} and requests ran on "
            f"versions {sorted(tally.tokens)}")
        return 0
    finally:
        engine.shutdown(timeout=30)  # time for vLLM's processes to exit on their own
        conn.close()  # a trainer still waiting for a message sees EOF and exits
        trainer.join(30)
        if trainer.is_alive():
            trainer.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default="tiny",
                        help="a Hugging Face checkpoint directory, or 'tiny' (a random tiny Llama)")
    parser.add_argument("--updates", type=int, default=3, help="updates to publish (default 3)")
    parser.add_argument("--every-seconds", type=float, default=2.0,
                        help="training time between two updates (default 2)")
    parser.add_argument("--step-seconds", type=float, default=0.25,
                        help="duration of one simulated training step (default 0.25)")
    parser.add_argument("--noise", type=float, default=1e-3,
                        help="per step, each weight moves by about this much of its tensor's "
                             "mean magnitude (default 0.001)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent requests (default 8)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens per request (default 32)")
    parser.add_argument("--bucket-mib", type=int, default=64,
                        help="the transfer's bucket size in MiB (default 64)")
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="CPU only (default 256)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="CUDA only: vLLM's share of the GPU (default 0.4; the trainer "
                             "needs the rest)")
    args = parser.parse_args()
    if args.updates < 1:
        parser.error(f"--updates must be at least 1, got {args.updates}")
    # fp32 on CPU (bf16 matmuls are slow or refused on many CPUs), bf16 on GPU. The trainer uses
    # the same dtype: the receive copies bytes, it does not convert.
    args.dtype = "float32" if args.device == "cpu" else "bfloat16"

    # vLLM logs a lot at INFO; keep this example's lines readable (set it to INFO to see them).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.device == "cuda":
        # The same-host transport's device flavour has streams wait on the other process; more
        # hardware queues keep them apart from the engine's streams (before CUDA starts).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

    # vLLM is imported here, not at the top, so that the trainer process (spawned: it re-imports
    # this file) does not load it; and before run(), because vLLM keeps the traceback of an
    # optional import it tried at its first import, and with it the importing function's frame:
    # run()'s frame holds the engine, which must go when run() ends, not at interpreter exit.
    import vllm.engine.arg_utils  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="vllm-rl-loop-"))
    try:
        model_path = args.model
        if model_path == "tiny":
            model_path = make_tiny_llama(work / "tiny-llama")
        return asyncio.run(run(args, model_path, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # vLLM and the trainer start processes with spawn, which re-imports
    sys.exit(main())
