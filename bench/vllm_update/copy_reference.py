"""The copy path: a reference, not an update. Another process on the engine's device copies the
model's bytes while vLLM decodes; nothing reaches the engine."""

from __future__ import annotations

import asyncio
import time
import traceback

from .checkpoint import parameter_bytes
from .helper_pipe import pipe_recv


def copier_process(conn, config: str, device: str, bucket_bytes: int, passes: int,
                   layers: int | None = None):
    """The copy path's other process: two buffers of the model's bytes on the engine's device;
    ("copy",) copies one into the other `passes` times, bucket by bucket (torch's copy_, a
    cudaMemcpyAsync on cuda: what the same-host transport's receive is), and answers ("sent",
    seconds); ("stop",) ends it."""
    try:
        import torch

        model_bytes = parameter_bytes(config, device, layers)
        on = torch.device("cuda:0" if device == "cuda" else "cpu")
        buffers = [torch.ones(model_bytes, dtype=torch.uint8, device=on),
                   torch.zeros(model_bytes, dtype=torch.uint8, device=on)]
        conn.send(("ready", model_bytes, bucket_bytes))
        while conn.recv()[0] != "stop":
            start = time.perf_counter()
            for k in range(passes):
                src, dst = buffers[k % 2], buffers[(k + 1) % 2]
                for offset in range(0, model_bytes, bucket_bytes):
                    dst[offset:offset + bucket_bytes].copy_(src[offset:offset + bucket_bytes])
            if on.type == "cuda":
                torch.cuda.synchronize()
            conn.send(("sent", time.perf_counter() - start))
    except BaseException as e:  # noqa: BLE001
        conn.send(("error", f"copier: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"))


class CopyReference:
    """A reference, not a transfer: what a decode loses while another process on the same GPU
    only copies the model's bytes (--copy-passes times per "update", nothing sent to the engine,
    no weights change). Next to the shadowsync path's slowdown it says how much of that comes
    from the bytes moving through the GPU's memory and another context's work at all."""

    def __init__(self, args):
        self.args = args
        self.process = None
        self.conn = None

    def api_description(self) -> str:
        return (f"reference: the model's bytes copied {self.args.copy_passes}x per update by "
                f"torch in another process on the same device; nothing reaches the engine")

    async def recv(self, expected: str, timeout: float = 300):
        return await pipe_recv(self.conn, "copier", expected, timeout)

    async def setup(self, engine) -> dict:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        bucket = self.args.bucket_bytes or 512 << 20
        self.process = ctx.Process(target=copier_process, daemon=True, args=(
            child, self.args.config, self.args.device, bucket, self.args.copy_passes,
            self.args.layers))
        self.process.start()
        model_bytes, bucket_bytes = await self.recv("ready")
        return dict(copier="torch in its own process", bytes=model_bytes,
                    bucket_bytes=bucket_bytes, passes=self.args.copy_passes)

    async def update(self, engine, version: int) -> dict:
        t0 = time.perf_counter()
        self.conn.send(("copy",))
        (seconds,) = await self.recv("sent")
        t1 = time.perf_counter()
        return dict(version=version, update_ms=round((t1 - t0) * 1e3, 3),
                    copier_ms=round(seconds * 1e3, 3), published_at=t0, sent_at=t1)

    async def close(self, engine) -> None:
        self.conn.send(("stop",))
        await asyncio.to_thread(self.process.join, 60)

    def shutdown(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(10)
