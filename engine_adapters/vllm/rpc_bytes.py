"""bytes_from_rpc: bytes as an RPC carried them to a worker. vLLM's collective_rpc carries bytes
(msgpack); its HTTP /collective_rpc only JSON, where the sender writes them as base64 text or a
list of ints. The update header and NCCL's unique id travel this way."""

from __future__ import annotations

import base64
from typing import Any

__all__ = ["bytes_from_rpc"]


def bytes_from_rpc(value: Any) -> bytes:
    """`value` as bytes: bytes (or bytearray), base64 text, or a list of ints 0-255. ValueError
    (not base64, an int out of range) or TypeError (another type) otherwise: the caller names
    the field."""
    if isinstance(value, str):
        return base64.b64decode(value, validate=True)  # binascii.Error is a ValueError
    if isinstance(value, (bytes, bytearray, list, tuple)):
        return bytes(value)
    raise TypeError(f"a {type(value).__name__}")
