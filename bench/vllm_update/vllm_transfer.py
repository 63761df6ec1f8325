"""The vllm path: vLLM's own weight-transfer API (backend "ipc" or "nccl"), the trainer in the
path's driver process (bench_vllm_update.py's docstring says the sequence)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

from .checkpoint import make_model


class VllmTransfer:
    """vLLM's own API: weight_transfer_config backend "ipc" (--transport same-host) or "nccl",
    the trainer in this process (on --trainer-gpu)."""

    def __init__(self, args):
        self.args = args
        self.model = None
        self.loop = None
        self.group = None  # --transport nccl: the trainer's PyNcclCommunicator
        self.nccl = args.transport == "nccl"
        self.api, self.api_error = self._find_nccl_api() if self.nccl else self._find_api()
        self.control_only = args.device != "cuda"

    @staticmethod
    def _find_nccl_api():
        """("0.25 nccl", None) when vLLM has NCCLWeightTransferEngine's trainer_init and
        trainer_send_weights; else (what was found, why this benchmark cannot drive it)."""
        try:
            from vllm.distributed.weight_transfer import nccl_engine
        except Exception as e:  # noqa: BLE001
            return "none", f"vllm.distributed.weight_transfer.nccl_engine does not import: {e!r}"
        engine_cls = getattr(nccl_engine, "NCCLWeightTransferEngine", None)
        if all(hasattr(engine_cls, m) for m in ("trainer_init", "trainer_send_weights")) and \
                hasattr(nccl_engine, "NCCLTrainerSendWeightsArgs"):
            return "0.25 nccl", None
        return "unknown", ("nccl_engine has no NCCLWeightTransferEngine.trainer_init / "
                           "trainer_send_weights with NCCLTrainerSendWeightsArgs (vLLM 0.25's API)")

    def _find_api(self):
        """("0.25", None) when vLLM has 0.25's trainer_send_weights with a callable send_mode;
        else (what was found, why this benchmark cannot drive it)."""
        try:
            from vllm.distributed.weight_transfer import ipc_engine
        except Exception as e:  # noqa: BLE001
            return "none", f"vllm.distributed.weight_transfer.ipc_engine does not import: {e!r}"
        engine_cls = getattr(ipc_engine, "IPCWeightTransferEngine", None)
        args_cls = getattr(ipc_engine, "IPCTrainerSendWeightsArgs", None)
        if args_cls is not None and hasattr(engine_cls, "trainer_send_weights"):
            fields = {f.name for f in dataclasses.fields(args_cls)}
            if "send_mode" in fields and "packed" in fields:
                return "0.25", None
            return "trainer_send_weights", (
                f"IPCTrainerSendWeightsArgs has fields {sorted(fields)}: no callable 'send_mode' "
                f"(vLLM 0.25.0's), so its updates could only go through Ray or HTTP")
        if hasattr(ipc_engine, "IPCTrainerWeightTransferEngine"):
            return "0.32", ("this vLLM's trainer side is IPCTrainerWeightTransferEngine with a "
                            "VLLMWeightSyncClient (vLLM 0.32's API), not 0.25's "
                            "IPCWeightTransferEngine.trainer_send_weights this benchmark drives")
        return "unknown", "ipc_engine has neither 0.25's nor 0.32's trainer API"

    def api_description(self) -> str:
        text = {"0.25": "vLLM 0.25 API: IPCWeightTransferEngine.trainer_send_weights("
                        "IPCTrainerSendWeightsArgs(send_mode=<callable>, packed=True)) between "
                        "AsyncLLM.start_weight_update and finish_weight_update",
                "0.25 nccl": "vLLM 0.25 API: NCCLWeightTransferEngine.trainer_send_weights("
                             "NCCLTrainerSendWeightsArgs(group, packed=True)) beside "
                             "AsyncLLM.update_weights, between start_weight_update and "
                             f"finish_weight_update; trainer rank 0 of {1 + self.args.tp} on "
                             f"cuda:{self.args.trainer_gpu}"}.get(self.api, self.api)
        if self.api_error:
            text += f" ({self.api_error})"
        if self.args.device != "cuda":
            text += "; CPU: control sequence only (pause, start, finish, resume; CUDA IPC needs a GPU)"
        return text

    async def setup(self, engine) -> dict:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.api_error and not self.control_only:
            raise RuntimeError(self.api_error)
        self.loop = asyncio.get_running_loop()
        timing = {}  # the weight-update set-up's call and its seconds
        if not self.nccl:
            t_init = time.monotonic()
            await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={}))
            timing = dict(update_setup_call="init_weight_transfer_engine (backend ipc)",
                          update_setup_s=round(time.monotonic() - t_init, 3))
        if self.control_only:
            return dict(trainer="none (control sequence only)", **timing)
        import torch

        gpu = self.args.trainer_gpu
        torch.cuda.set_device(gpu)
        t0 = time.monotonic()
        self.model = await asyncio.to_thread(make_model, self.args.config, "cuda", 2, gpu,
                                             self.args.layers)
        self.named = list(self.model.named_parameters())
        build_s = round(time.monotonic() - t0, 2)
        if self.nccl:  # the trainer and every worker join one group: both calls at once
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            init = dict(master_address="127.0.0.1", master_port=free_port(), rank_offset=1,
                        world_size=1 + self.args.tp)

            def trainer_init():  # on the trainer's GPU: a new thread starts on device 0
                torch.cuda.set_device(gpu)
                return NCCLWeightTransferEngine.trainer_init(init)

            t_init = time.monotonic()
            _, self.group = await asyncio.gather(
                engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init)),
                in_daemon_thread(trainer_init))
            timing = dict(update_setup_call="init_weight_transfer_engine beside "
                                            "NCCLWeightTransferEngine.trainer_init (backend nccl)",
                          update_setup_s=round(time.monotonic() - t_init, 3))
        return dict(trainer=f"transformers {type(self.model).__name__} in the driver process "
                            f"on cuda:{gpu}",
                    tensors=len(self.named),
                    bytes=sum(p.numel() * p.element_size() for _, p in self.named),
                    trainer_build_s=build_s,
                    packed_buffer_bytes=self.args.vllm_packed_bytes, **timing)

    def _send(self, engine, chunks: list) -> None:
        """trainer_send_weights on a worker thread; each chunk goes to AsyncLLM.update_weights on
        the event loop, and the next chunk waits for it (the producer reuses one IPC buffer)."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerSendWeightsArgs,
            IPCWeightTransferEngine,
        )

        def send_chunk(update_info) -> None:
            request = WeightTransferUpdateRequest(update_info=dataclasses.asdict(update_info))
            t0 = time.perf_counter()
            asyncio.run_coroutine_threadsafe(engine.update_weights(request), self.loop).result(300)
            chunks.append(round((time.perf_counter() - t0) * 1e3, 3))

        IPCWeightTransferEngine.trainer_send_weights(
            iter(self.named), IPCTrainerSendWeightsArgs(
                send_mode=send_chunk, packed=True,
                packed_buffer_size_bytes=self.args.vllm_packed_bytes))

    async def update(self, engine, version: int) -> dict:
        pause = not self.args.vllm_no_pause
        t0 = time.perf_counter()
        if pause:
            await engine.pause_generation(mode="keep", clear_cache=False)
        t1 = time.perf_counter()
        await engine.start_weight_update()
        t2 = time.perf_counter()
        chunks: list[float] = []
        if self.nccl:
            await self._broadcast(engine)
        elif not self.control_only:
            await asyncio.to_thread(self._send, engine, chunks)
        t3 = time.perf_counter()
        await engine.finish_weight_update()
        t4 = time.perf_counter()
        if pause:
            await engine.resume_generation()
        t5 = time.perf_counter()
        ms = lambda a, b: round((b - a) * 1e3, 3)  # noqa: E731
        return dict(version=version, update_ms=ms(t0, t5), pause_ms=ms(t0, t1),
                    start_ms=ms(t1, t2), transfer_ms=ms(t2, t3), finish_ms=ms(t3, t4),
                    transfer_gbps=None if self.control_only else
                    round(self.model_bytes() / (t3 - t2) / 1e9, 2),
                    resume_ms=ms(t4, t5), start_to_finish_ms=ms(t1, t4), chunks=len(chunks),
                    chunk_ms_max=max(chunks) if chunks else None)

    def model_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.named)

    async def _broadcast(self, engine) -> None:
        """--transport nccl: the workers' receive (AsyncLLM.update_weights: the tensors' names,
        dtypes and shapes, packed) and the trainer's broadcasts (on a worker thread), at once."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerSendWeightsArgs,
            NCCLWeightTransferEngine,
        )

        info = dict(names=[n for n, _ in self.named],
                    dtype_names=[str(p.dtype).removeprefix("torch.") for _, p in self.named],
                    shapes=[list(p.shape) for _, p in self.named], packed=True,
                    packed_buffer_size_bytes=self.args.vllm_packed_bytes)
        send = NCCLTrainerSendWeightsArgs(group=self.group, packed=True,
                                          packed_buffer_size_bytes=self.args.vllm_packed_bytes)

        def broadcast() -> None:
            import torch

            torch.cuda.set_device(self.args.trainer_gpu)
            NCCLWeightTransferEngine.trainer_send_weights(iter(self.named), send)
            torch.cuda.synchronize()

        await asyncio.gather(engine.update_weights(WeightTransferUpdateRequest(update_info=info)),
                             in_daemon_thread(broadcast))

    async def close(self, engine) -> dict:
        return {}

    def shutdown(self) -> None:
        self.model = None
        self.group = None


async def in_daemon_thread(call):
    """`call()` on a daemon thread, awaited. For the trainer's NCCL calls: when the engine's side
    fails, they wait for peers that never come, and asyncio.to_thread's executor would keep the
    event loop (and the path's result file) from ever finishing; a daemon thread is left behind
    and the error reaches the caller."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(outcome, value):
        if not done.done():
            (done.set_exception if outcome == "error" else done.set_result)(value)

    def run():
        try:
            outcome, value = "ok", call()
        except BaseException as e:  # noqa: BLE001  (handed to the awaiting coroutine)
            outcome, value = "error", e
        try:
            loop.call_soon_threadsafe(settle, outcome, value)
        except RuntimeError:  # the loop is gone: nobody waits for this any more
            pass

    threading.Thread(target=run, daemon=True, name="bench-trainer-nccl").start()
    return await done


def free_port() -> int:
    """A TCP port free on this host now (vLLM's NCCL rendezvous listens on it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
