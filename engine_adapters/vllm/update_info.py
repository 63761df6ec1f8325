"""ShadowsyncUpdateInfo: what vLLM's ``update_weights`` carries to the "shadowsync" backend, as
plain data (JSON-safe: the header as base64 text)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from shadowsync.errors import InvalidArgumentError

__all__ = ["ShadowsyncUpdateInfo"]


@dataclasses.dataclass
class ShadowsyncUpdateInfo:
    """One update, announced to every worker:

    * ``header``: the trainer's ``PublishHandle.header_base64`` (or its ``header_bytes``, or the
      bytes as a list of ints): which version, which tensors, the checksums.
    * ``verify_matches_live``: the self-check (worker extension's ``begin_update``): for an update
      of the checkpoint the engine holds, every byte the receive plan writes is compared with
      the engine's own.
    * ``finish_timeout_s``: how long ``finish_weight_update`` waits for this update to land and
      be checked before it fails it (nothing goes live then). The engine does not step while it
      waits: call finish once the trainer's send returned (the shadowsync trainer engine does).
    """

    header: Any
    verify_matches_live: bool = False
    finish_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.verify_matches_live not in (True, False):
            raise InvalidArgumentError(
                f"ShadowsyncUpdateInfo.verify_matches_live: {self.verify_matches_live!r} is not "
                f"True or False")
        timeout = self.finish_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < math.inf):
            raise InvalidArgumentError(
                f"ShadowsyncUpdateInfo.finish_timeout_s: {timeout!r} is not a positive, finite "
                f"number of seconds")

    @classmethod
    def coerce(cls, info: ShadowsyncUpdateInfo | Mapping[str, Any]) -> ShadowsyncUpdateInfo:
        """`info` (an instance or a dict of its fields), checked; an unknown field is refused,
        naming it and the known ones."""
        if isinstance(info, cls):
            return info
        if not isinstance(info, Mapping):
            raise InvalidArgumentError(
                f"update_weights: the shadowsync backend's update info is a dict with 'header' "
                f"(the trainer's PublishHandle.header_base64), got {type(info).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(info) - known)
        if unknown or "header" not in info:
            raise InvalidArgumentError(
                f"update_weights: the shadowsync backend's update info has the fields "
                f"{sorted(known)} ('header' required), got {sorted(info)}")
        return cls(**info)
