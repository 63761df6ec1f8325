"""Backends (device memory, streams, events) and their streams: host_backend.h, cuda_backend.h."""

from __future__ import annotations

from ctypes import byref, c_char_p, c_void_p

from . import _library
from ._handle import Handle
from .errors import NotSupportedError, call


def has_cuda() -> bool:
    """Whether the loaded library was built with the CUDA backend and the NCCL transport."""
    return bool(_library.load().shadowsync_has_cuda())


def require_cuda(what: str) -> None:
    """Raises NotSupportedError naming `what` and the library when it has no CUDA."""
    if not has_cuda():
        raise NotSupportedError(
            f"{what}: {_library.library_path()} was built without CUDA/NCCL "
            f"(shadowsync_has_cuda() is 0); build it on a machine with nvcc and NCCL "
            f"(-DSHADOWSYNC_WITH_CUDA=ON) and point SHADOWSYNC_LIBRARY at that build"
        )


class Backend(Handle):
    """A backend handle. Receivers, senders and streams made from it keep it alive."""

    _destroy_fn = "shadowsync_backend_destroy"
    device = "cpu"  # where tensors of this backend live, in torch's spelling

    @property
    def name(self) -> str:
        """"host" or "cuda"."""
        name = c_char_p()
        call("shadowsync_backend_name", self._handle, byref(name))
        return name.value.decode()

    def create_stream(self, low_priority: bool = False) -> "Stream":
        """A new stream of this backend (on the host backend: an executor thread)."""
        handle = c_void_p()
        call("shadowsync_stream_create", self._handle, int(low_priority), byref(handle))
        return Stream(handle.value, self)


class HostBackend(Backend):
    """Memory is host memory, streams are executor threads, with CUDA's asynchronous semantics."""

    def __init__(self):
        handle = c_void_p()
        call("shadowsync_host_backend_create", byref(handle))
        super().__init__(handle.value)


class CudaBackend(Backend):
    """The CUDA backend of one device. NotSupportedError when the library has no CUDA."""

    def __init__(self, device: int = 0):
        require_cuda(f"CudaBackend(device={device})")
        handle = c_void_p()
        call("shadowsync_cuda_backend_create", int(device), byref(handle))
        super().__init__(handle.value)
        self.device_index = int(device)
        self.device = f"cuda:{device}"

    def wrap_stream(self, cuda_stream: int | None) -> "Stream":
        """Adopts a cudaStream_t the caller owns and keeps alive (e.g. torch's
        ``torch.cuda.current_stream().cuda_stream``; None or 0 is the legacy default stream)."""
        handle = c_void_p()
        call("shadowsync_stream_wrap_cuda", self._handle, c_void_p(cuda_stream or None), byref(handle))
        return Stream(handle.value, self)


class Stream(Handle):
    """A stream of a backend: the engine's, for the step hook calls."""

    _destroy_fn = "shadowsync_stream_destroy"

    def __init__(self, value: int, backend: Backend):
        super().__init__(value)
        self.backend = backend

    def synchronize(self) -> None:
        """Waits for all work enqueued on the stream."""
        call("shadowsync_stream_synchronize", self._handle)
