"""A worker fed by a sharded trainer (ShadowsyncInitInfo.trainer_ranks; DESIGN §14): every
trainer rank sends only the bytes it holds, and each worker receives only the bytes its own
(tensor-parallel) parameters read, over the same-host pull transport or NCCL point-to-point.

Two RPCs, because each side needs the other's half of the routing plan:

1. ``weight_update_needs(info)``: each worker plans its receive (set_up.plan_update_group: the
   same trace and checks as the set-up) and returns the wire ranges its receive plan reads
   (shadowsync.needed_ranges: the library's, without a receiver). The trainer ranks build their
   RoutingPlan from their regions and every worker's needs, serve their paths, and send the
   plan's fingerprint.
2. ``init_weight_update_group(info)`` with ``engine_needs`` and ``fingerprint``: each worker
   builds the same plan (``routing_plan``: shadowsync.sharded_publisher.engine_routing_plan,
   which refuses another fingerprint naming both), connects to every trainer rank (``connect``)
   and takes the plan for its receiver.

A worker is engine rank = its tensor-parallel rank, of tensor_parallel_size engine ranks, in the
data-parallel replica ``trainer_ranks["replica"]`` names (0 by default: each vLLM engine instance
of a group of replicas is given its own).
Neither vllm nor torch is imported here."""

from __future__ import annotations

from shadowsync.errors import InvalidArgumentError
from shadowsync.layout import Layout
from shadowsync.regions import WireRange
from shadowsync.routing import RoutingPlan
from shadowsync.sharded_publisher import check_replica, engine_routing_plan
from shadowsync.transport import Transport, nccl_engine_comm_rank, nccl_routed_transport, \
    same_host_pull_engine_transport

from .rpc_bytes import bytes_from_rpc

__all__ = ["connect", "from_engine_setup", "routing_plan"]


def from_engine_setup(setup: dict, token=None, connect_timeout_ms: int | None = None,
                      replica: int = 0) -> dict:
    """``ShadowsyncInitInfo.trainer_ranks`` from a ShardedPublisher's ``engine_setup`` (plain
    data, the same on every trainer rank) and the token its ranks serve with: count, paths,
    token, regions, engine_needs and fingerprint, `connect_timeout_ms` when given, and
    `replica`: which of the publisher's ``engine_replicas`` this vLLM engine is (each engine
    instance of a data-parallel group gets its own). A publisher of NCCL routes
    (``engine_setup["nccl"]``) gives ``nccl`` instead of paths and token (`token` then stays
    None). The wire layout goes into the info's own fields: ``specs=setup["wire"]``,
    ``bucket_bytes=setup["bucket_bytes"]``."""
    check_replica(setup, replica, "from_engine_setup")
    nccl = setup.get("nccl")
    if nccl is not None and token is not None:
        raise InvalidArgumentError(
            "from_engine_setup: the trainer ranks send over NCCL (engine_setup['nccl']), which "
            "takes no token; leave token unset")
    if nccl is None and token is None:
        raise InvalidArgumentError(
            "from_engine_setup: the trainer ranks serve the same-host pull transport "
            "(engine_setup['paths']); give the token they serve with")
    where = dict(nccl=dict(nccl)) if nccl is not None else dict(paths=list(setup["paths"]),
                                                                 token=token)
    out = dict(count=len(setup["regions"]), **where,
               regions=[list(regions) for regions in setup["regions"]],
               engine_needs=setup["engine_needs"], fingerprint=setup["fingerprint"])
    if connect_timeout_ms is not None:
        out["connect_timeout_ms"] = int(connect_timeout_ms)
    if replica:
        out["replica"] = replica
    return out


def needs_data(ranges: list[WireRange]) -> list[list[int]]:
    """Wire ranges as plain data: [[group, begin, end], ...] (what the RPCs carry)."""
    return [[r.group, r.begin, r.end] for r in ranges]


def routing_plan(wire: Layout, trainer_ranks: dict, engine_rank: int, engine_count: int,
                 own_needs: list[WireRange]) -> RoutingPlan:
    """The trainers' routing plan as this worker builds it from ``trainer_ranks`` (checked by
    ShadowsyncInitInfo): their regions and every engine rank's needs. Refused, named, before it
    is built: needs missing, needs of another number of engine ranks than this engine has (world
    size), this rank's needs not what its receive plan reads (needs of another engine or set-up).
    Then shadowsync.sharded_publisher.engine_routing_plan builds and checks it as every engine
    does: a plan the library refuses (regions that overlap, bytes no trainer rank holds, a region
    outside its tensor), a fingerprint that is not the trainers'."""
    what = "init_weight_update_group: trainer_ranks"
    needs = trainer_ranks.get("engine_needs")
    fingerprint = trainer_ranks.get("fingerprint")
    if needs is None or fingerprint is None:
        missing = " and ".join(k for k, v in (("engine_needs", needs),
                                              ("fingerprint", fingerprint)) if v is None)
        raise InvalidArgumentError(
            f"{what}: {missing} missing; call weight_update_needs (shadowsync.vllm."
            f"weight_update_needs) first, build the routing plan on every trainer rank from "
            f"the regions and those needs, and pass the needs and the plan's fingerprint")
    if len(needs) != engine_count:
        raise InvalidArgumentError(
            f"{what}: engine_needs holds the needs of {len(needs)} engine rank(s), but this "
            f"engine has {engine_count} (tensor_parallel_size): the world size differs; ask "
            f"this engine's weight_update_needs")
    if not 0 <= engine_rank < len(needs):
        raise InvalidArgumentError(
            f"{what}: engine rank {engine_rank} is outside 0..{len(needs) - 1} (engine_needs "
            f"holds {len(needs)} engine ranks)")
    own = needs_data(own_needs)
    if needs[engine_rank] != own:
        raise InvalidArgumentError(
            f"{what}: engine_needs[{engine_rank}] ({_bytes(needs[engine_rank])} bytes in "
            f"{len(needs[engine_rank])} ranges) is not what engine rank {engine_rank}'s "
            f"receive plan reads ({_bytes(own)} bytes in {len(own)} ranges); pass what this "
            f"engine's weight_update_needs returned, for the same specs and bucket_bytes")
    return engine_routing_plan(trainer_ranks, wire=wire, what=what)[1]


def connect(trainer_ranks: dict, plan: RoutingPlan, engine_rank: int, backend,
            device: int | None) -> Transport:
    """Engine rank `engine_rank`'s end of the trainer ranks' transport: with ``nccl``, joins
    their NCCL communicator as rank M + replica x N + engine_rank on CUDA device `device` (None:
    a CPU worker, refused); else connects to every trainer rank's path of the same-host pull
    transport (they serve it once they built the plan)."""
    nccl = trainer_ranks.get("nccl")
    replica = trainer_ranks.get("replica", 0)
    if nccl is not None:
        replicas = nccl.get("replicas", 1)
        if replica >= replicas:
            raise InvalidArgumentError(
                f"init_weight_update_group: trainer_ranks.replica is {replica}, but "
                f"trainer_ranks.nccl.replicas is {replicas} (replicas 0..{replicas - 1} join the "
                f"trainer ranks' communicator); give every replica's engine the same 'nccl' with "
                f"'replicas' set to their number")
        if device is None:
            raise InvalidArgumentError(
                "init_weight_update_group: trainer_ranks.nccl: NCCL routes need GPU workers, and "
                "this engine runs on the CPU; give the trainer ranks' 'paths' and 'token' (the "
                "same-host pull transport) instead")
        return nccl_routed_transport(bytes_from_rpc(nccl["unique_id"]), plan,
                                     nccl_engine_comm_rank(plan, engine_rank, replica), device,
                                     backend, nccl["gpus"], replicas=replicas)
    return same_host_pull_engine_transport(
        trainer_ranks["paths"], trainer_ranks["token"], plan, engine_rank, backend,
        connect_timeout_ms=trainer_ranks.get("connect_timeout_ms"), replica=replica)


def _bytes(ranges) -> int:
    return sum(end - begin for _, begin, end in ranges)
