"""The trainer's side of vLLM's weight-transfer API for the "shadowsync" backend.

vLLM 0.28 and later: a trainer engine, made by vLLM's WeightTransferTrainerFactory from
ShadowsyncTrainerInitInfo and driven through any client of vLLM's four-method protocol (HTTP, Ray,
or an object of your own):

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from shadowsync.vllm.trainer_engine import ShadowsyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        ShadowsyncTrainerInitInfo(rank=0), client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model))
    engine.send_weights()        # after each optimizer step; the engine keeps generating

trainer_init serves the same-host transport (the trainer and vLLM on one host: CPU processes, one
GPU or GPUs of one host) and joins vLLM's workers to it with init_weight_transfer_engine. Each
send_weights publishes the source's tensors as the next version: start_weight_update,
update_weights with the header (the workers start receiving and return), the bytes, then
finish_weight_update, which makes the version live between two steps and names it vLLM's
weight_version. No pause_generation is needed around it.

vLLM 0.25 has no trainer engines: its worker engine's static trainer_send_weights(iterator, args)
sends, with ShadowsyncSendArgs (send_weights_025).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, ClassVar

from shadowsync.errors import InvalidArgumentError

from .init_info import ShadowsyncInitInfo

__all__ = ["ShadowsyncSendArgs", "ShadowsyncTrainerEngine", "ShadowsyncTrainerInitInfo",
           "send_weights_025"]

TRAINER_BACKEND_NAME = "shadowsync"


@dataclasses.dataclass
class ShadowsyncSendArgs:
    """vLLM 0.25's trainer_send_weights arguments for the "shadowsync" backend: the trainer's
    `sender` (a shadowsync.Sender whose receivers are vLLM's workers), the `version` to publish,
    and `announce`, called with the update info for vLLM's update_weights (for example
    ``lambda info: llm.update_weights({"update_info": info})``) once the bytes can flow. Returns
    once every byte was sent, or raises after `timeout_s`."""

    sender: Any
    version: int
    announce: Callable[[dict], None]
    timeout_s: float = 300.0


def send_weights_025(iterator, trainer_args: ShadowsyncSendArgs | dict) -> None:
    """vLLM 0.25: ShadowsyncEngine.trainer_send_weights(iterator, args): publishes `iterator`'s
    (name, tensor) pairs as args.version and announces it; called between the front end's
    start_weight_update and finish_weight_update."""
    args = trainer_args if isinstance(trainer_args, ShadowsyncSendArgs) else (
        ShadowsyncSendArgs(**trainer_args))
    publish_and_announce(args.sender, args.version, dict(iterator), args.announce,
                         args.timeout_s)


def publish_and_announce(sender, version: int, tensors: dict, announce: Callable[[dict], None],
                         timeout_s: float) -> None:
    """Publishes `tensors` as `version`, hands vLLM's update_weights its update info
    (`announce`), and waits until every byte was sent. The tensors must not change until then."""
    handle = sender.publish(version, tensors)
    try:
        announce({"header": handle.header_base64})
        handle.wait(timeout_s)
    finally:
        handle.close()


try:  # vLLM 0.28 and later
    from vllm.distributed.weight_transfer.base import (TrainerInitInfo,
                                                       TrainerWeightTransferEngine)
except ImportError:  # vLLM 0.25: no trainer engines (trainer_send_weights instead)
    TrainerInitInfo = TrainerWeightTransferEngine = None

if TrainerInitInfo is not None:
    @dataclasses.dataclass
    class ShadowsyncTrainerInitInfo(TrainerInitInfo):
        """How a trainer joins vLLM's workers over shadowsync's same-host transport.

        * ``engine_workers``: how many vLLM workers receive (tensor x pipeline x data parallel
          size); each connects to the trainer.
        * ``device``: where the trainer's tensors are ("cpu", "cuda:0"; None: the current CUDA
          device if CUDA is available, else "cpu"); the staging slots live there.
        * ``socket_path``: the Unix socket the workers connect to (None: a new directory of the
          user's own, removed at shutdown).
        * ``bucket_bytes``: the transfer's bucket size (0: the library's default).
        * ``connect_timeout_s``, ``send_timeout_s``: how long init waits for the workers, and
          send_weights for the bytes to be received.
        * ``worker_init``: further ShadowsyncInitInfo fields for the workers (pacing, the
          self-check, ...), as plain data.
        """

        backend: ClassVar[str] = TRAINER_BACKEND_NAME
        engine_workers: int = 1
        device: str | None = None
        socket_path: str | None = None
        bucket_bytes: int = 0
        connect_timeout_s: float = 60.0
        send_timeout_s: float = 300.0
        worker_init: dict = dataclasses.field(default_factory=dict)

    class ShadowsyncTrainerEngine(TrainerWeightTransferEngine):
        """vLLM's trainer engine "shadowsync" (see the module's doc)."""

        init_info_cls = ShadowsyncTrainerInitInfo

        def __init__(self, *, client, source=None, is_sender: bool = True) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.sender = None
            self.version = 0
            self.send_timeout_s = 300.0
            self._socket_dir: str | None = None

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            if source is None:
                raise InvalidArgumentError(
                    "ShadowsyncTrainerEngine.trainer_init: a WeightSource is needed (vLLM's "
                    "ModuleSource(model) for a model's named_parameters())")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender)
            if engine.is_sender:
                engine.send_timeout_s = init_info.send_timeout_s
                engine._join_workers(init_info)
            return engine

        def _join_workers(self, init_info) -> None:
            """Serves the same-host transport while vLLM's workers join it (both block until
            every worker connected with the token)."""
            import shadowsync as ss

            specs = [(m.name, str(m.dtype), tuple(m.shape)) for m in self.source.metadata()]
            layout = ss.Layout(specs, init_info.bucket_bytes)
            device = init_info.device or _default_device()
            backend = (ss.HostBackend() if device == "cpu"
                       else ss.CudaBackend(int(device.partition(":")[2] or 0)))
            path = init_info.socket_path
            if path is None:
                self._socket_dir = tempfile.mkdtemp(prefix="shadowsync-")  # mode 0700
                path = os.path.join(self._socket_dir, "trainer.sock")
            token = ss.make_token()
            timeout_ms = int(init_info.connect_timeout_s * 1000)
            worker_info = ShadowsyncInitInfo.coerce(
                init_info.worker_init, specs=specs, bucket_bytes=init_info.bucket_bytes,
                same_host={"path": path, "token": token, "connect_timeout_ms": timeout_ms})
            # Both block until every worker connected with the token. The transport is served
            # on a daemon thread: a worker's refusal is raised at once, and the trainer can exit
            # while the serve still waits out its timeout.
            served: concurrent.futures.Future = concurrent.futures.Future()
            threading.Thread(target=_serve_into, daemon=True, name="shadowsync-serve", args=(
                served, ss.same_host_sender_transport, path, token, init_info.engine_workers,
                backend, layout.groups[0].bucket_bytes, timeout_ms)).start()
            self.client.init_weight_transfer_engine(worker_info.to_rpc())
            transport = served.result()
            self.sender = ss.Sender(layout, backend, transport)

        def send_weights(self, weight_version: str | None = None) -> None:
            """Publishes the source's tensors as the next version and drives vLLM's update
            round trip; `weight_version` (default: the version number) becomes vLLM's
            weight_version. Returns once it is live. On every trainer rank: the others only
            iterate the source, for its collectives."""
            if not self.is_sender:
                for _ in self.source:
                    pass
                return
            if self.sender is None:
                raise InvalidArgumentError("send_weights: the engine was shut down")
            version = self.version + 1
            tensors = dict(self.source)
            self.client.start_weight_update()
            publish_and_announce(self.sender, version, tensors, self.client.update_weights,
                                 self.send_timeout_s)
            self.client.finish_weight_update(
                weight_version=str(version) if weight_version is None else weight_version)
            self.version = version

        def shutdown(self) -> None:
            if self.sender is not None:
                self.sender.close()
                self.sender = None
            if self._socket_dir is not None:
                shutil.rmtree(self._socket_dir, ignore_errors=True)
                self._socket_dir = None


def _serve_into(future: concurrent.futures.Future, serve, path, token, receivers, backend,
             slot_bytes: int, timeout_ms: int) -> None:
    """Serves the same-host transport into `future` (its result, or the error)."""
    try:
        future.set_result(serve(path, token, receivers, backend, slot_bytes=slot_bytes,
                                connect_timeout_ms=timeout_ms))
    except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
        future.set_exception(error)


def _default_device() -> str:
    import torch

    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
