"""Child process of test_vllm_api.py: code written against vLLM's own weight-transfer API, with
``weight_transfer_config={"backend": "shadowsync"}`` and no worker extension named. Prints one
line ``RESULT <json>``; the test makes the assertions.

    python vllm_api_child.py JSON_ARGS      (models: [A, B], dtype, prompts, max_tokens, ...)

* references: fresh in-process engines of A and B (the same settings), greedy tokens. In-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0) because no engine-core process has to start then, which is
  cheaper; the two modes compute the same tokens (test_vllm_real.py's multiprocess engine
  answers as its in-process references). The engines under test keep vLLM's default
  multiprocess engine: its RPCs are what the API path crosses.
* ``offline``: a ``vllm.LLM`` of A (vLLM's default engine-core process) and a trainer process
  with the Hugging Face weights of B and A over the same-host transport (vllm_real_child.trainer).
  Update 1 (B) streams bucket by bucket: ``start_weight_update``, ``update_weights`` with the
  header, then the engine generates between buckets; ``finish_weight_update(weight_version=
  "policy-1")``. Update 2 (A) is one publish, finished as "policy-2". Then what the API refuses.
* ``async``: an ``AsyncLLM`` of B generating continuously (requests salted with the version they
  started under), and a trainer thread holding A that drives vLLM's trainer engine "shadowsync"
  through a client of vLLM's four-method protocol: ``trainer_init`` then ``send_weights
  (weight_version="policy-A")`` and a second round of the same weights ("policy-A2"). What each finished request's ``weight_versions`` say, beside
  what shadowsync counted per step (``request_versions``), comes back.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_real_child as real  # noqa: E402 - after the path (it puts shadowsync on it too)

BACKEND = {"weight_transfer_config": {"backend": "shadowsync"}}
RECEIVE_BYTES_PER_SECOND = 10_000_000  # the async case's update (1.5 MB) then lasts >= 0.15 s


def refused(call) -> str | None:
    """`call()`'s error as "<type>: <message>", None if it returned."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return None


def run_references(args: dict) -> dict:
    out = {}
    with real.engine_mode("inproc"):
        for name, model in zip("ab", args["models"]):
            with real.fresh_engine(args, model, quantization="shadowsync_unpacked") as llm:
                out[name] = real.greedy(llm, args["prompts"], args["max_tokens"])
    return out


def run_offline(args: dict) -> dict:
    from vllm import SamplingParams

    from shadowsync.vllm import ShadowsyncInitInfo

    a, b = args["models"]
    prompts, max_tokens = args["prompts"], args["max_tokens"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    process, conn, same_host, directory = real.start_trainer(args, [b, a])
    out: dict = {}
    llm = None
    try:
        _, specs, _, _ = real.expect(conn, "specs")
        llm = real.make_llm(args, a, quantization="shadowsync_unpacked", **BACKEND)
        conn.send("serve")
        info = ShadowsyncInitInfo(specs=specs, bucket_bytes=args["bucket_bytes"],
                                  same_host=same_host)
        llm.init_weight_transfer_engine({"init_info": info.to_rpc()})  # plain data, JSON-safe
        real.expect(conn, "serving")

        # Update 1: B, streamed; the engine generates while it is incomplete.
        llm.start_weight_update()
        conn.send(("stream", 1, b))
        _, header, buckets = real.expect(conn, "header")
        started = time.monotonic()
        llm.update_weights({"update_info": {"header": base64.b64encode(header).decode()}})
        out["update_weights_s"] = time.monotonic() - started
        out["during"] = []
        for i in range(buckets):
            if i < buckets - 1:  # a bucket is still missing: these run on A
                out["during"].append(real.greedy(llm, prompts, max_tokens))
            conn.send("next")
            real.expect(conn, "supplied")
        real.expect(conn, "done")
        out["stats_before_finish"] = llm.collective_rpc("weight_update_stats")[0]
        llm.finish_weight_update(weight_version="policy-1")
        llm.reset_prefix_cache()  # no request runs: KV of A's prompts must not be reused
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out["after_b"] = [list(o.outputs[0].token_ids) for o in outputs]
        out["spans_b"] = [spans(o.outputs[0].weight_versions) for o in outputs]

        # Update 2: A again, one publish.
        llm.start_weight_update()
        conn.send(("publish", 2, a))
        _, header, _ = real.expect(conn, "header")
        llm.update_weights({"update_info": {"header": list(header)}})  # a list of ints works too
        real.expect(conn, "done")
        llm.finish_weight_update(weight_version="policy-2")
        llm.reset_prefix_cache()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out["after_a"] = [list(o.outputs[0].token_ids) for o in outputs]
        out["spans_a"] = [spans(o.outputs[0].weight_versions) for o in outputs]
        out["weight_version"] = llm.get_weight_version()
        out["stats"] = llm.collective_rpc("weight_update_stats")[0]

        # What the API refuses, each changing nothing. (vLLM keeps the update open after a
        # refused finish, and closes it after a refused update_weights.)
        llm.start_weight_update()
        out["finish_without_update"] = refused(lambda: llm.finish_weight_update())
        out["no_header"] = refused(lambda: llm.update_weights({"update_info": {"version": 3}}))
        out["auto_commit"] = refused(lambda: llm.init_weight_transfer_engine(
            {"init_info": dict(info.to_rpc(), commit_mode="auto")}))
        # An update whose bytes do not come within finish_timeout_s: finish refuses it, nothing
        # goes live. (The trainer then cancels it and stops.)
        llm.start_weight_update()
        conn.send(("stream", 3, b))
        _, header, _ = real.expect(conn, "header")
        llm.update_weights({"update_info": {"header": base64.b64encode(header).decode(),
                                            "finish_timeout_s": 0.5}})
        out["late_update"] = refused(lambda: llm.finish_weight_update())
        conn.send("cancel")
        out["after_refusals"] = real.greedy(llm, prompts, max_tokens)
    finally:
        real.shut_down(llm)
        real.stop_trainer(process, conn, directory)
    return out


def spans(weight_versions) -> list | None:
    return None if weight_versions is None else [
        [s.version, s.start, s.end] for s in weight_versions]


class AsyncLLMClient:
    """vLLM's four-method weight-sync protocol over an AsyncLLM, for a trainer on another thread
    (each call runs on the engine's event loop). Records when start and finish returned."""

    def __init__(self, engine, loop):
        self.engine, self.loop = engine, loop
        self.started_s = self.finished_s = None

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(120)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())
        self.started_s = time.monotonic()

    def update_weights(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))
        self.finished_s = time.monotonic()


def trainer_thread(client, model_path: str, dtype: str, result: dict) -> None:
    """Loads A as the trainer does and sends it through vLLM's trainer engine "shadowsync"."""
    try:
        import torch
        import transformers
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from shadowsync.vllm.trainer_engine import ShadowsyncTrainerInitInfo

        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype))
        engine = WeightTransferTrainerFactory.trainer_init(
            ShadowsyncTrainerInitInfo(rank=0, worker_init=dict(
                track_request_versions=True,
                # A capped receive rate: the update spans several engine steps by construction.
                max_receive_bytes_per_second=RECEIVE_BYTES_PER_SECOND)),
            client=client, source=ModuleSource(model))
        result["joined_s"] = time.monotonic()
        with torch.no_grad():
            engine.send_weights(weight_version="policy-A")
            result["first_window"] = [client.started_s, client.finished_s]
            engine.send_weights(weight_version="policy-A2")  # a second round: the same weights
        result["engine_version"] = engine.version
        engine.shutdown()
    except BaseException:  # noqa: BLE001 - reported by the test
        result["error"] = traceback.format_exc()


def run_async(args: dict) -> dict:
    return asyncio.run(_run_async(args))


async def _run_async(args: dict) -> dict:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from shadowsync.vllm import unpacked

    a, b = args["models"]
    prompts, max_tokens = args["prompts"], args["max_tokens"]
    unpacked.register()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=b, quantization="shadowsync_unpacked", **BACKEND,
        **real.engine_kwargs(args["dtype"])))
    out: dict = {"requests": []}
    try:
        client = AsyncLLMClient(engine, asyncio.get_running_loop())
        trainer: dict = {}
        thread = threading.Thread(target=trainer_thread, args=(client, a, args["dtype"], trainer))
        thread.start()
        stop = asyncio.Event()
        count = 0

        async def one_request(prompt: str, salt: str) -> None:
            nonlocal count
            count += 1
            request_id = f"r{count}"
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            arrivals, final = [], None
            async for output in engine.generate({"prompt": prompt, "cache_salt": salt}, params,
                                                request_id):
                arrivals.append((time.monotonic(), len(output.outputs[0].token_ids)))
                final = output
            out["requests"].append(dict(
                id=request_id, prompt=prompt, tokens=list(final.outputs[0].token_ids),
                arrivals=arrivals, spans=spans(final.outputs[0].weight_versions)))

        async def client_loop(index: int) -> None:
            while not stop.is_set():
                salt = "after" if client.finished_s is not None else "before"
                await one_request(prompts[index % len(prompts)], salt)

        clients = [asyncio.create_task(client_loop(i)) for i in range(2)]
        deadline = time.monotonic() + real.DEADLINE_S
        while thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.gather(*clients)
        thread.join(real.DEADLINE_S)
        out["trainer"] = trainer
        out["start_s"], out["finish_s"] = client.started_s, client.finished_s
        out["weight_version"] = await engine.get_weight_version()
        out["request_versions"] = (await engine.collective_rpc("request_versions"))[0]
        out["stats"] = (await engine.collective_rpc("weight_update_stats"))[0]
        await engine.reset_prefix_cache()
        after = []
        for prompt in prompts:  # greedy, one at a time, on A
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            async for output in engine.generate({"prompt": prompt}, params, f"after-{prompt}"):
                final = output
            after.append(list(final.outputs[0].token_ids))
        out["after_a"] = after
    finally:
        engine.shutdown()
    return out


WHAT = {"references": run_references, "offline": run_offline, "async": run_async}


def main() -> None:
    args = json.loads(sys.argv[1])
    out = {}
    for what in args["jobs"]:
        started = time.monotonic()
        try:
            out[what] = WHAT[what](args)
        except Exception:  # noqa: BLE001 - the test reports it
            out[what] = {"error": traceback.format_exc()}
        out[what]["job_s"] = time.monotonic() - started
    print("RESULT " + json.dumps(out, default=repr), flush=True)


if __name__ == "__main__":
    main()
