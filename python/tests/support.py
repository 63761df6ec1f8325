"""The Python tests' oracle and rig: a small layout, the weight pattern and a loopback
sender/receiver pair on the host backend (conftest.py puts this checkout's package first)."""

from __future__ import annotations

import numpy as np

import shadowsync as ss

DEADLINE_S = 20.0  # generous: a loaded 2-core CI machine; every wait fails loudly at it
BUCKET_BYTES = 1024  # small buckets: every tensor below spans or shares several

# Several buckets per group, several dtypes, a LoRA adapter.
SPECS = [
    ("embed", "fp32", (300, 4)),
    ("w", "int32", (257,)),
    ("norm", "float16", (7,)),
    ("lora.A", "fp32", (16, 8), "lora"),
    ("lora.B", "fp32", (8, 16), "lora"),
]
NUMPY_DTYPES = {"fp32": np.float32, "int32": np.int32, "float16": np.float16}
BASE = ["embed", "w", "norm"]
LORA = ["lora.A", "lora.B"]


def spec(name):
    return next(s for s in SPECS if s[0] == name)


def pattern(name: str, version: int) -> np.ndarray:
    """Tensor `name` at `version`: every element tells the version (and the tensor), so a view
    that mixes two versions, or bytes of another tensor, does not match any single pattern."""
    s = spec(name)
    index = [x[0] for x in SPECS].index(name)
    n = int(np.prod(s[2]))
    if s[1] == "float16":  # integers stay exact in fp16 below 2048
        values = version * 64 + index * 8 + np.arange(n) % 8
    else:
        values = version * 4096 + index * 256 + np.arange(n) % 256
    return values.astype(NUMPY_DTYPES[s[1]]).reshape(s[2])


def version_of(name: str, array: np.ndarray) -> int:
    """The single version `array` holds, or -1 if it is not exactly one version's pattern (torn
    or foreign bytes). All zeros (a never-written slot) is version 0 only where it matches."""
    s = spec(name)
    index = [x[0] for x in SPECS].index(name)
    first = int(array.flat[0])
    scale, step = (64, 8) if s[1] == "float16" else (4096, 256)
    version = (first - index * step) // scale
    if version >= 0 and np.array_equal(array, pattern(name, version)):
        return version
    return -1


def tensors(names, version: int) -> dict[str, np.ndarray]:
    return {n: pattern(n, version) for n in names}


class Pair:
    """A sender (rank 0) and a receiver (rank 1) on a loopback world, host backend."""

    def __init__(self):
        self.layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
        self.backend = ss.HostBackend()
        self.loopback = ss.Loopback(2)
        self.receiver = ss.Receiver(
            self.layout,
            self.backend,
            self.loopback.transport(1),
            ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
        )
        self.sender = ss.Sender(
            self.layout,
            self.backend,
            self.loopback.transport(0),
            ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
        )

    def update(self, version: int, names) -> ss.PublishHandle:
        """Publishes, announces and waits until the engine made `version` live."""
        handle = self.sender.publish(version, tensors(names, version))
        self.receiver.begin_update(handle.header_bytes)
        self.receiver.wait_applied(version, DEADLINE_S)
        handle.wait(DEADLINE_S)
        return handle

    def live_versions(self) -> dict[str, int]:
        """What one engine step reads: the version of every tensor in the live slots."""
        return {s[0]: version_of(s[0], self.receiver.live_array(s[0])) for s in SPECS}

    def close(self):
        self.receiver.close()
        self.sender.close()
