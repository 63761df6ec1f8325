"""Messages from a helper process of a path (the shadowsync trainer, the copy reference's copier)
over a multiprocessing pipe."""

from __future__ import annotations

import asyncio


async def pipe_recv(conn, who: str, expected: str, timeout: float = 300):
    """The next message from a helper process (`who`): its fields after the name `expected`; its
    error raised; anything else, or nothing within `timeout`, an error naming both."""
    ready = await asyncio.to_thread(conn.poll, timeout)
    if not ready:
        raise TimeoutError(f"{who}: no '{expected}' message in {timeout} s")
    message = conn.recv()
    if message[0] == "error":
        raise RuntimeError(message[1])
    if message[0] != expected:
        raise RuntimeError(f"{who}: expected '{expected}', got '{message[0]}'")
    return message[1:]
