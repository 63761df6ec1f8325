"""Starting vLLM from a torchrun rank (a colocated trainer that holds a ``vllm.LLM``).

torchrun puts its rendezvous in every rank's environment, and with
``TORCHELASTIC_USE_AGENT_STORE=True`` every TCP rendezvous in the rank's processes becomes a client
of torchrun's own store instead of hosting one. vLLM's workers, spawned from the rank, would take
that environment: their ``torch.distributed`` start then waits for a store nobody hosts, and the
engine never comes up. While vLLM starts its workers they must see a plain process's
environment; they then form vLLM's own world, apart from the trainers'."""

from __future__ import annotations

import contextlib
import os

__all__ = ["TORCHRUN_VARIABLES", "outside_torchrun"]

# What torchrun sets in a rank's environment that a torch.distributed start reads.
TORCHRUN_VARIABLES = ("TORCHELASTIC_USE_AGENT_STORE", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def outside_torchrun():
    """Within it, os.environ holds none of torchrun's variables; they are restored after (also
    when the body raises). Build the ``vllm.LLM`` inside it::

        with shadowsync.vllm.outside_torchrun():
            llm = vllm.LLM(model=..., worker_extension_cls="shadowsync.vllm.WorkerExtension")

    The rank's own process group, made before, is not touched. Not thread-safe: no other thread
    of the process may read or change these variables meanwhile."""
    saved = {name: os.environ.pop(name) for name in TORCHRUN_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
