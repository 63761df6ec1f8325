"""A sharded trainer's update through the package (no torch): two trainer ranks, each a Sender
made with the routing plan and its rank that publishes only its shards (numpy arrays with their
TensorRegions: rows of one tensor, columns of another, a flat partition, a replicated norm sent
by one rank), one engine rank whose Receiver took the plan (use_routing_plan), over the test
library's loopback routes. The engine's slot comes out as the full tensors, the routes carry
exactly the plan's bytes into it, and each trainer rank stages two slots of its largest bucket
slice, never a full tensor."""

from __future__ import annotations

import numpy as np
import pytest

import shadowsync as ss
from shadowsync.errors import InvalidArgumentError

from testing_hooks import route_loopback

SHAPES = {"q": (13, 12), "c": (8, 8), "z": (6, 8), "norm": (8,)}


def _regions(rank: int) -> list[ss.TensorRegion]:
    """Trainer rank `rank` of 2: q rows (7 and 6: torch.chunk), c columns (half each), z a flat
    partition cut mid-row, the norm from rank 1 only."""
    regions = [
        ss.TensorRegion.box("q", (7 * rank, 0), (min(13, 7 * rank + 7), 12)),
        ss.TensorRegion.box("c", (0, 4 * rank), (8, 4 * rank + 4)),
        ss.TensorRegion.elements("z", 0 if rank == 0 else 27, 27 if rank == 0 else 21),
    ]
    if rank == 1:
        regions.append(ss.TensorRegion.whole("norm", SHAPES["norm"]))
    return regions


def _shard(full: np.ndarray, region: ss.TensorRegion) -> np.ndarray:
    if region.kind == "elements":
        return np.ascontiguousarray(full.reshape(-1)[region.first:region.first + region.count])
    index = tuple(slice(b, e) for b, e in zip(region.begin, region.end))
    return np.ascontiguousarray(full[index])


def test_two_trainer_ranks_update_one_engine_rank_with_their_shards():
    layout = ss.Layout([(name, "fp32", shape) for name, shape in SHAPES.items()], bucket_bytes=256)
    plan = ss.RoutingPlan(layout, [_regions(0), _regions(1)])
    trainer_transports, engine_transports = route_loopback(plan)
    backend = ss.HostBackend()
    senders = [ss.Sender(layout, backend, trainer_transports[t], routing_plan=plan, trainer_rank=t)
               for t in range(2)]
    receiver = ss.Receiver(layout, backend, engine_transports[0])
    receiver.use_routing_plan(plan, 0)
    try:
        rng = np.random.default_rng(43)
        full = {name: rng.standard_normal(shape).astype(np.float32)
                for name, shape in SHAPES.items()}
        # A shard that is not what the plan says this rank holds is refused before a byte moves.
        wrong = [(r.tensor, _shard(full[r.tensor], r), r) for r in _regions(0)]
        wrong[0] = ("q", full["q"][:6].copy(), ss.TensorRegion.box("q", (0, 0), (6, 12)))
        with pytest.raises(InvalidArgumentError, match="the routing plan has this rank hold"):
            senders[0].publish_shards(1, wrong)
        assert senders[0].routes_in_place == (None, "")  # a refused publish sends nothing

        handles = [
            senders[t].publish_shards(1, [(r.tensor, _shard(full[r.tensor], r), r)
                                          for r in _regions(t)])
            for t in range(2)
        ]
        receiver.begin_update(handles[0].header_bytes)
        for handle in handles:
            handle.wait(timeout=20)
        receiver.wait_applied(1, timeout=20)
        for name, values in full.items():
            np.testing.assert_array_equal(receiver.live_array(name), values)
        stats = receiver.stats()
        assert stats.routed_bytes == plan.bytes_to_engine(0)
        # Loopback routes are packed unless asked to read in place, and the sender says why; the
        # engine read nothing in place.
        in_place, why = senders[1].routes_in_place
        assert in_place is False and "reads no routes in place" in why, why
        assert stats.routed_in_place_bytes == 0
        assert stats.trainer_count == 2
        assert stats.routing_fingerprint == plan.fingerprint
        for t in range(2):
            assert senders[t].staging_bytes == 2 * plan.max_packed_bytes(t)
    finally:
        receiver.close()
        for sender in senders:
            sender.close()
