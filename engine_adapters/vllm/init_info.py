"""ShadowsyncInitInfo: how a vLLM worker takes updates, in one typed object, checked once.

The info goes to ``shadowsync.vllm.init_weight_update_group(llm, info)`` on the front end, or to
the worker extension's ``init_weight_update_group(info)`` (the object or a dict of its fields)
through collective_rpc. vLLM's own weight-transfer calls (``init_weight_transfer_engine``,
``update_weights``, ...) are refused by the shadowsync backend, naming these instead. Every field
has a default that is right for a single-GPU engine fed by one trainer over NCCL; a value that
cannot work is refused here, naming the field and the value, before anything is set up or
connected.
"""

from __future__ import annotations

import base64
import dataclasses
import os
from typing import Any, Callable, Mapping

from shadowsync.errors import InvalidArgumentError
from shadowsync.layout import TensorSpec
from shadowsync.receiver import ReceiverConfig
from shadowsync.regions import BOX, ELEMENTS, TensorRegion
from shadowsync.transport import NCCL_UNIQUE_ID_BYTES

from .rpc_bytes import bytes_from_rpc

__all__ = ["ShadowsyncInitInfo"]

_SWAP_STRATEGIES = ("rebind", "copy_in", "remap")
_COMMIT_MODES = ("auto", "coordinated")
_SAME_HOST_KEYS = ("path", "token", "rank", "connect_timeout_ms")
_TRAINER_RANKS_KEYS = ("count", "paths", "token", "nccl", "regions", "fingerprint",
                       "engine_needs", "connect_timeout_ms", "replica")


@dataclasses.dataclass
class ShadowsyncInitInfo:
    """What ``init_weight_update_group`` needs. Fields, by what they decide:

    The transport (one of them, or neither and a ready ``transport`` passed beside this object):

    * ``unique_id``: NCCL's unique id (``shadowsync.nccl_unique_id()`` on the trainer); the worker
      is rank ``rank_offset + its rank`` of ``world_size``. Set-up blocks until every rank joined,
      so the trainer creates its own transport concurrently.
    * ``same_host``: ``{"path", "token"[, "rank", "connect_timeout_ms"]}``, the receiver end of
      the trainer's same-host transport (same GPU, GPUs of one host, or CPU processes).
    * ``trainer_ranks``: a sharded trainer of M ranks on this host, each sending only what it
      holds (DESIGN §14) over the same-host pull transport: ``{"count": M, "paths": [one socket
      path per trainer rank], "token", "regions": [per trainer rank: [[tensor, "box", begin,
      end] | [tensor, "elements", first, count], ...]], "engine_needs": [per engine rank: [[group,
      begin, end], ...]], "fingerprint": the routing plan's, "connect_timeout_ms", "replica":
      which data-parallel replica of the engine this vLLM instance is, when the trainer ranks
      serve several (ShardedPublisher's ``engine_replicas``; default 0)}``.
      ``engine_needs`` are what the workers' ``weight_update_needs`` returned; with them and the
      regions every worker builds the trainers' routing plan and compares ``fingerprint``. The
      worker is engine rank = its tensor-parallel rank (trainer_ranks.py). Trainer ranks on
      other GPUs or hosts send over NCCL point-to-point instead: ``"nccl": {"unique_id": NCCL's
      unique id, "gpus": [M + R x N GPU names, shadowsync.gpu_name() of each rank's GPU, trainer
      ranks first, then each replica's engine ranks], "replicas": R (optional, default 1)}`` in
      place of ``paths`` and ``token``; every trainer rank creates
      ``shadowsync.nccl_routed_transport`` with it as communicator rank = its trainer rank, the
      worker joins as rank M + replica x N + its engine rank. With R replicas each trainer rank
      still sends every route once (to replica 0, whose workers forward it along the replicas).

    What is sent:

    * ``specs``: the trainer's tensor specs (``Layout.specs`` on its side, or tuples of name,
      dtype, shape, group). The engine's own parameters (same names) are received zero-copy;
      otherwise they are what the trainer's ``named_parameters()`` gives (HF names, unfused,
      unsharded) and a receive plan is derived from the model's own ``load_weights``. None: every
      parameter of the engine in its order, grouped by ``group_of`` (default one group "base").
    * ``bucket_bytes``: the transfer's bucket size (0: the library's default).
    * ``allow_partial``: parameters no trainer tensor writes are refused, named, unless this is
      set; then they keep the engine's values.
    * ``lora_adapter``: the ``lora_int_id`` of a LoRA adapter vLLM serves that the trainer's PEFT
      tensors (``...lora_A.weight``, ``lora_B``, in their own group) update in place.

    How a swap happens:

    * ``swap_strategy``: None chooses (the live arena's remap, graph pairs' rebind, copy_in under
      CUDA graphs, else rebind); "copy_in", "remap" or "rebind" asks for one, refused where it
      cannot be right.
    * ``engine_uses_cuda_graphs``: None reads vLLM's ``enforce_eager``.
    * ``gated_swaps``: None: on wherever the swap only remaps the live arena and vLLM's V2 runner
      frames each step; False: off; True: on, refused where it cannot be.
    * ``commit_mode``: "auto" (live at the worker's next step) or "coordinated" (held ready until
      ``commit_update``, on every rank between the same two steps); None: coordinated under
      tensor parallelism, else auto.

    Pacing (how much an update may slow decoding while it streams in):

    * ``decode_slowdown_budget``: e.g. 1.05: the mean step while an update streams in stays
      within 5 % of the step without one; the update takes longer instead. None: unpaced.
    * ``max_receive_bytes_per_second``: a cap on the receive rate (0: none).
    * ``offer_after_clean_step`` (on by default): a complete update goes live only after a step
      started once its last bucket landed (at most 4 idle steps later; an idle engine gets it
      then), so the step the swap delays is not also one a bucket slowed. With the trainer's
      checksums the receiver takes their block, the update's last broadcast, only after that
      step, so the trainer's send returns after it (vLLM's finish_weight_update, called then,
      swaps at a clean step). The step hook reads the clock once per step for it.

    Bookkeeping:

    * ``track_request_versions``: count each request's tokens per weight version
      (``request_versions()``).
    * ``adopt_current_weights``: under rebind, move the weights into the live slot so the model's
      own storage is freed (two copies of the weights, not three).
    * ``hook_execute_model``: install the step hook (off only for engines that call
      ``before_step`` themselves).
    * ``receiver_config``: every other receiver setting (``shadowsync.ReceiverConfig``); the fields
      above override its fields of the same name.
    """

    unique_id: bytes | None = None
    rank_offset: int = 1
    world_size: int = 2
    same_host: dict | None = None
    trainer_ranks: dict | None = None
    specs: list | None = None
    bucket_bytes: int = 0
    group_of: Callable[[str], str] | None = None
    allow_partial: bool = False
    lora_adapter: int | None = None
    swap_strategy: str | None = None
    engine_uses_cuda_graphs: bool | None = None
    gated_swaps: bool | None = None
    commit_mode: str | None = None
    decode_slowdown_budget: float | None = None
    max_receive_bytes_per_second: int = 0
    offer_after_clean_step: bool = True
    track_request_versions: bool = False
    adopt_current_weights: bool = True
    hook_execute_model: bool = True
    receiver_config: ReceiverConfig | None = None

    def __post_init__(self) -> None:
        if self.unique_id is not None:
            self.unique_id = _unique_id_bytes(self.unique_id)
        _check_int("rank_offset", self.rank_offset, minimum=0)
        _check_int("world_size", self.world_size, minimum=1)
        _check_int("bucket_bytes", self.bucket_bytes, minimum=0)
        _check_int("max_receive_bytes_per_second", self.max_receive_bytes_per_second, minimum=0)
        if self.lora_adapter is not None:
            _check_int("lora_adapter", self.lora_adapter, minimum=1)
        if self.unique_id is not None and self.same_host is not None:
            raise InvalidArgumentError(
                "ShadowsyncInitInfo: unique_id (NCCL) and same_host are both set; a worker has one "
                "transport: keep the one the trainer serves")
        if self.same_host is not None:
            _check_same_host(self.same_host)
        if self.trainer_ranks is not None:
            for other in ("unique_id", "same_host"):
                if getattr(self, other) is not None:
                    raise InvalidArgumentError(
                        f"ShadowsyncInitInfo: trainer_ranks and {other} are both set; "
                        f"trainer_ranks is its own transport (the same-host pull transport from "
                        f"every trainer rank): leave {other} unset")
            self.trainer_ranks = _checked_trainer_ranks(self.trainer_ranks)
        if self.swap_strategy not in (None, *_SWAP_STRATEGIES):
            _refuse("swap_strategy", self.swap_strategy, f"None or one of {_SWAP_STRATEGIES}")
        if self.commit_mode not in (None, *_COMMIT_MODES):
            _refuse("commit_mode", self.commit_mode, f"None or one of {_COMMIT_MODES}")
        for name in ("engine_uses_cuda_graphs", "gated_swaps"):
            if getattr(self, name) not in (None, True, False):
                _refuse(name, getattr(self, name), "None, True or False")
        for name in ("offer_after_clean_step", "allow_partial", "track_request_versions",
                     "adopt_current_weights", "hook_execute_model"):
            if getattr(self, name) not in (True, False):
                _refuse(name, getattr(self, name), "True or False")
        if self.group_of is not None and not callable(self.group_of):
            _refuse("group_of", self.group_of, "a function of a tensor name, or None")
        if isinstance(self.receiver_config, Mapping):  # as to_rpc() sends it
            self.receiver_config = ReceiverConfig(**self.receiver_config)
        if self.receiver_config is not None and not isinstance(self.receiver_config,
                                                               ReceiverConfig):
            _refuse("receiver_config", self.receiver_config, "a shadowsync.ReceiverConfig")
        self.merged_receiver_config()._c_fields()  # refuses a bad value (a budget < 1.0, ...)

    @classmethod
    def coerce(cls, info: ShadowsyncInitInfo | Mapping[str, Any] | None = None,
               **fields: Any) -> ShadowsyncInitInfo:
        """`info` (an instance, a dict of its fields, or None) with `fields` on top, checked.
        An unknown field is refused, naming it and the known ones."""
        if isinstance(info, cls):
            if not fields:
                return info
            base = {f.name: getattr(info, f.name) for f in dataclasses.fields(cls)}
        elif info is None:
            base = {}
        elif isinstance(info, Mapping):
            base = dict(info)
        else:
            raise InvalidArgumentError(
                f"init info: a ShadowsyncInitInfo or a dict of its fields is needed, got "
                f"{type(info).__name__}")
        merged = {**base, **fields}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise InvalidArgumentError(
                f"ShadowsyncInitInfo: unknown field(s) {unknown}; the fields are {sorted(known)}")
        return cls(**merged)

    def to_rpc(self) -> dict[str, Any]:
        """The fields as plain data (numbers, strings, lists, dicts; the unique id as base64
        text), which vLLM's collective_rpc carries to its workers without pickling, and JSON too
        when the same-host token is a str; coerce() reads it back.
        ``group_of`` (a function) cannot cross: give the specs with their groups instead."""
        if self.group_of is not None:
            raise InvalidArgumentError(
                "ShadowsyncInitInfo.group_of: a function cannot be sent to vLLM's workers; pass "
                "specs with each tensor's group (Layout.specs on the trainer's side) instead")
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if self.specs is not None:
            fields["specs"] = [[t.name, t.dtype, list(t.shape), t.group]
                               for t in map(TensorSpec.coerce, self.specs)]
        if self.receiver_config is not None:
            fields["receiver_config"] = dataclasses.asdict(self.receiver_config)
        if self.unique_id is not None:
            fields["unique_id"] = base64.b64encode(self.unique_id).decode("ascii")
        del fields["group_of"]
        return fields

    def merged_receiver_config(self) -> ReceiverConfig:
        """`receiver_config` with the fields given here (pacing, offer_after_clean_step) written
        into it: what the receiver is created with."""
        config = dataclasses.replace(self.receiver_config or ReceiverConfig())
        if self.decode_slowdown_budget is not None:
            config.decode_slowdown_budget = self.decode_slowdown_budget
        if self.max_receive_bytes_per_second:
            config.max_receive_bytes_per_second = self.max_receive_bytes_per_second
        config.offer_after_clean_step = self.offer_after_clean_step
        return config


def _unique_id_bytes(value: Any) -> bytes:
    """NCCL's unique id from its bytes, or as an RPC that carries JSON has it (base64 text, what
    to_rpc writes, or a list of ints)."""
    wanted = (f"the {NCCL_UNIQUE_ID_BYTES} bytes of shadowsync.nccl_unique_id() (or them as "
              f"base64 text or a list of ints)")
    try:
        unique_id = bytes_from_rpc(value)
    except (TypeError, ValueError):
        _refuse("unique_id", value, wanted)
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        _refuse("unique_id", value, f"{wanted}: it has {len(unique_id)} bytes")
    return unique_id


def _refuse(field: str, value: Any, wanted: str) -> None:
    raise InvalidArgumentError(f"ShadowsyncInitInfo.{field}: {value!r:.200} is not {wanted}")


def _check_int(field: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _refuse(field, value, f"an integer >= {minimum}")


def _check_same_host(same_host: Any) -> None:
    if not isinstance(same_host, dict) or "path" not in same_host or "token" not in same_host:
        raise InvalidArgumentError(
            f"ShadowsyncInitInfo.same_host: a dict with 'path' and 'token' (and optionally "
            f"'rank', 'connect_timeout_ms') is needed, got {same_host!r:.200}")
    unknown = sorted(set(same_host) - set(_SAME_HOST_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"ShadowsyncInitInfo.same_host: unknown key(s) {unknown}; the keys are "
            f"{list(_SAME_HOST_KEYS)}")


def region_data(region: TensorRegion) -> list:
    """A TensorRegion as trainer_ranks carries it: [tensor, "box", begin, end] or [tensor,
    "elements", first, count]."""
    if region.kind == ELEMENTS:
        return [region.tensor, ELEMENTS, region.first, region.count]
    return [region.tensor, BOX, list(region.begin), list(region.end)]


def trainer_regions(trainer_ranks: dict) -> list[list[TensorRegion]]:
    """The regions of each trainer rank of ``trainer_ranks``, as TensorRegions."""
    return [[_region(rank, i, r) for i, r in enumerate(regions)]
            for rank, regions in enumerate(trainer_ranks["regions"])]


def _region(rank: int, index: int, item: Any) -> TensorRegion:
    where = f"ShadowsyncInitInfo.trainer_ranks.regions[{rank}][{index}]"
    if isinstance(item, TensorRegion):
        return item
    if (not isinstance(item, (list, tuple)) or len(item) != 4 or not isinstance(item[0], str)
            or item[1] not in (BOX, ELEMENTS)):
        raise InvalidArgumentError(
            f"{where}: {item!r:.200} is not [tensor, \"box\", begin, end] or [tensor, "
            f"\"elements\", first, count]")
    try:
        if item[1] == BOX:
            return TensorRegion.box(item[0], item[2], item[3])
        return TensorRegion.elements(item[0], item[2], item[3])
    except InvalidArgumentError as error:
        raise InvalidArgumentError(f"{where}: {error.detail}") from None
    except (TypeError, ValueError) as error:
        raise InvalidArgumentError(f"{where}: {item!r:.200}: {error}") from None


def _checked_trainer_ranks(trainer_ranks: Any) -> dict:
    """``trainer_ranks`` checked, as plain data (regions as lists, needs as [group, begin, end]
    lists), so that to_rpc carries it as it is."""
    field = "ShadowsyncInitInfo.trainer_ranks"
    keys = set(trainer_ranks) if isinstance(trainer_ranks, Mapping) else set()
    if not {"count", "regions"} <= keys or not ({"paths", "token"} <= keys or "nccl" in keys):
        raise InvalidArgumentError(
            f"{field}: a dict with 'count', 'regions' and the transport, 'paths' and 'token' (the "
            f"same-host pull transport) or 'nccl' (NCCL point-to-point), is needed (and "
            f"optionally 'engine_needs', 'fingerprint', 'connect_timeout_ms', 'replica'), got "
            f"{trainer_ranks!r:.200}")
    if "nccl" in keys and keys & {"paths", "token"}:
        raise InvalidArgumentError(
            f"{field}: 'nccl' and {sorted(keys & {'paths', 'token'})} are both set; the trainer "
            f"ranks send over one transport: 'nccl' for NCCL point-to-point, or 'paths' and "
            f"'token' for the same-host pull transport")
    unknown = sorted(set(trainer_ranks) - set(_TRAINER_RANKS_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"{field}: unknown key(s) {unknown}; the keys are {list(_TRAINER_RANKS_KEYS)}")
    out = dict(trainer_ranks)
    count = out["count"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        _refuse("trainer_ranks.count", count, "an integer >= 1 (how many trainer ranks send)")
    for key, what in (("paths", "socket path"), ("regions", "list of regions")):
        if key not in out:
            continue  # NCCL routes: no paths
        value = out[key]
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            _refuse(f"trainer_ranks.{key}", value, f"a list of one {what} per trainer rank")
        if len(value) != count:
            raise InvalidArgumentError(
                f"{field}: count is {count}, but {key} has {len(value)} entries, one per "
                f"trainer rank is needed (a rank missing, or one too many)")
    if "nccl" in out:
        out["nccl"] = _checked_nccl_routes(out["nccl"], count)
    else:
        out["paths"] = [os.fspath(p) for p in out["paths"]]
    out["regions"] = [[region_data(r) for r in regions] for regions in trainer_regions(out)]
    fingerprint = out.get("fingerprint")
    if fingerprint is not None and (isinstance(fingerprint, bool)
                                    or not isinstance(fingerprint, int)
                                    or not 0 <= fingerprint < 1 << 64):
        _refuse("trainer_ranks.fingerprint", fingerprint,
                "the routing plan's fingerprint (an unsigned 64-bit integer) or None")
    timeout = out.get("connect_timeout_ms")
    if timeout is not None:
        _check_int("trainer_ranks.connect_timeout_ms", timeout, minimum=0)
    if "replica" in out:
        _check_int("trainer_ranks.replica", out["replica"], minimum=0)
    needs = out.get("engine_needs")
    if needs is not None:
        if isinstance(needs, (str, bytes)) or not isinstance(needs, (list, tuple)) or not needs:
            _refuse("trainer_ranks.engine_needs", needs,
                    "a list of each engine rank's needs (what weight_update_needs returned)")
        out["engine_needs"] = [_needs(rank, ranges) for rank, ranges in enumerate(needs)]
    return out


def _checked_nccl_routes(nccl: Any, count: int) -> dict:
    """``trainer_ranks["nccl"]`` checked, as plain data (the unique id as base64 text)."""
    where = "trainer_ranks.nccl"
    if (not isinstance(nccl, Mapping) or not {"unique_id", "gpus"} <= set(nccl)
            or not set(nccl) <= {"unique_id", "gpus", "replicas"}):
        _refuse(where, nccl, "a dict {'unique_id': shadowsync.nccl_unique_id(), 'gpus': [the "
                             "GPU name of every communicator rank, trainer ranks first], and "
                             "optionally 'replicas': the engine's data-parallel replicas}")
    replicas = nccl.get("replicas", 1)
    _check_int(f"{where}.replicas", replicas, minimum=1)
    gpus = nccl["gpus"]
    if (isinstance(gpus, (str, bytes)) or not isinstance(gpus, (list, tuple))
            or not all(isinstance(g, str) and g for g in gpus)):
        _refuse(f"{where}.gpus", gpus, "a list of GPU names (shadowsync.gpu_name(device) of each "
                                       "rank's GPU), trainer ranks first, then engine ranks")
    if len(gpus) <= count:
        raise InvalidArgumentError(
            f"ShadowsyncInitInfo.{where}.gpus holds {len(gpus)} names, but {count} trainer ranks "
            f"and at least one engine rank need more: name the GPU of every communicator rank, "
            f"the {count} trainer ranks first, then each engine rank")
    unique_id = _unique_id_bytes(nccl["unique_id"])
    out = {"unique_id": base64.b64encode(unique_id).decode("ascii"), "gpus": list(gpus)}
    if replicas != 1:
        out["replicas"] = replicas
    return out


def _needs(rank: int, ranges: Any) -> list[list[int]]:
    where = f"trainer_ranks.engine_needs[{rank}]"
    if not isinstance(ranges, (list, tuple)):
        _refuse(where, ranges, "a list of [group, begin, end] wire ranges")
    out = []
    for r in ranges:
        if (not isinstance(r, (list, tuple)) or len(r) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) for v in r)
                or r[0] < 0 or not 0 <= r[1] < r[2]):
            _refuse(where, r, "a [group, begin, end] wire range (0 <= begin < end)")
        out.append([int(v) for v in r])
    return out
