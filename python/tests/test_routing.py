"""Routing plans of sharded trainers through the Python package (no torch): regions as wire
ranges, engine ranks' needs (from their receive plans without a receiver, and from their
receivers), routes and counts, the fingerprint, and the refusals, named."""

import itertools
from math import prod

import pytest

import shadowsync as ss
from shadowsync import TensorRegion, WireRange

# q [13, 8] fp32 (no rank count divides its rows), k [3, 8], a norm [8]; buckets of 256 bytes.
WIRE = [("q", "fp32", (13, 8)), ("k", "fp32", (3, 8)), ("norm", "fp32", (8,))]
ROW = 8 * 4


def _wire():
    return ss.Layout(WIRE, bucket_bytes=256)


def _fsdp(ranks):
    """FSDP2 Shard(0) over `ranks` (the first ranks one row more), the norm sent by rank 0."""
    out = []
    for r in range(ranks):
        regions = []
        for name, rows in (("q", 13), ("k", 3)):
            per = -(-rows // ranks)
            lo, hi = r * per, min(rows, (r + 1) * per)
            if lo < hi:
                regions.append(TensorRegion.box(name, (lo, 0), (hi, 8)))
        if r == 0:
            regions.append(TensorRegion.whole("norm", (8,)))
        out.append(regions)
    return out


def _all_routes(plan, wire):
    return [r for g in wire.groups for b in range(g.bucket_count) for r in plan.routes(g.index, b)]


def test_a_box_of_part_rows_is_one_range_per_row_and_whole_rows_merge():
    wire = _wire()
    q = wire.tensor("q")
    half = wire.region_ranges(TensorRegion.box("q", (0, 4), (5, 8)))  # Shard(1), rank 1 of 2
    assert half == [WireRange(0, q.offset + i * ROW + 16, q.offset + (i + 1) * ROW)
                    for i in range(5)]
    assert wire.region_ranges(TensorRegion.box("q", (1, 0), (3, 8))) == [
        WireRange(0, q.offset + ROW, q.offset + 3 * ROW)]
    assert wire.region_ranges(TensorRegion.elements("q", 3, 10)) == [
        WireRange(0, q.offset + 12, q.offset + 52)]
    # More ranges than the first guess of the array's capacity: asked again with the count.
    tall = ss.Layout([("t", "bf16", (300, 4))])
    assert len(tall.region_ranges(TensorRegion.box("t", (0, 2), (300, 4)))) == 300


def test_routes_carry_every_byte_once_and_the_counts_add_up():
    wire = _wire()
    for ranks in (1, 2, 4):
        plan = ss.RoutingPlan(wire, _fsdp(ranks))
        assert (plan.trainer_count, plan.engine_count) == (ranks, 1)
        total = sum(t.bytes for t in wire.groups[0].tensors)
        assert plan.bytes_to_engine(0) == total
        assert sum(plan.bytes_from_trainer(t) for t in range(ranks)) == total
        routes = _all_routes(plan, wire)
        assert len(routes) == plan.route_count
        # Every tensor byte exactly once.
        covered = sorted((r.wire_offset, r.wire_offset + r.bytes) for r in routes)
        assert sum(e - b for b, e in covered) == total
        assert all(a[1] <= b[0] for a, b in zip(covered, covered[1:]))
        for t in range(ranks):
            sizes = []
            for b in range(wire.groups[0].bucket_count):
                begin, end = plan.packed_range(t, "base", b)
                sizes.append(end - begin)
                for r in plan.routes(0, b):
                    if r.trainer == t:
                        assert begin <= r.source_offset and r.source_offset + r.bytes <= end
            assert plan.max_packed_bytes(t) == max(sizes)


def test_each_engine_rank_receives_what_its_receiver_reads():
    # Two engine ranks, each with its half of q's and k's rows (column-parallel) and the norm.
    wire = _wire()
    backend = ss.HostBackend()
    receivers, needs = [], []
    for r in range(2):
        q_rows, k_rows = (7, 2) if r == 0 else (6, 1)
        engine = ss.Layout([("q", "fp32", (q_rows, 8)), ("k", "fp32", (k_rows, 8)),
                            ("norm", "fp32", (8,))])
        plan = ss.ReceivePlan(wire, [
            ss.PlanCopy("q", "q", (q_rows, 8), r * 7 * 8, (8, 1), 0, (8, 1)),
            ss.PlanCopy("k", "k", (k_rows, 8), r * 2 * 8, (8, 1), 0, (8, 1)),
            ss.PlanCopy("norm", "norm", (8,), 0, (1,), 0, (1,)),
        ])
        receiver = ss.Receiver(engine, backend, plan=plan)
        receivers.append(receiver)
        needs.append(receiver.needed_ranges())
        assert ss.needed_ranges(engine, plan) == needs[-1]  # the same, without a receiver
    try:
        q = wire.tensor("q")
        assert needs[1][0] == WireRange(0, q.offset + 7 * ROW, q.offset + 13 * ROW)
        plan = ss.RoutingPlan(wire, _fsdp(2), needs)
        for r in range(2):
            assert plan.bytes_to_engine(r) == sum(n.end - n.begin for n in needs[r])
        assert plan.bytes_to_engine(0) == (7 * 8 + 2 * 8 + 8) * 4
        assert {route.engine for route in _all_routes(plan, wire)} == {0, 1}
        # Without a plan a receiver needs every tensor of its layout.
        plain = ss.Receiver(wire, backend)
        try:
            assert plain.needed_ranges() == [WireRange(0, t.offset, t.offset + t.bytes)
                                             for t in wire.groups[0].tensors]
        finally:
            plain.close()
    finally:
        for receiver in receivers:
            receiver.close()


def _bytes_read(wire, plan):
    """What `plan`'s copies read of `wire`, element by element: the expectation, computed apart
    from the library (no rows, no merging of runs), as sorted and merged WireRanges."""
    read = {}
    for c in plan.copies:
        t = wire.tensor(c.wire)
        size = t.bytes // prod(t.shape)
        for index in itertools.product(*(range(n) for n in c.shape)):
            at = t.offset + (c.src_offset + sum(i * s for i, s in zip(index, c.src_strides))) * size
            read.setdefault(t.group_index, set()).update(range(at, at + size))
    out = []
    for group in sorted(read):
        begin = previous = None
        for byte in sorted(read[group]):
            if previous is not None and byte != previous + 1:
                out.append(WireRange(group, begin, previous + 1))
                begin = None
            begin = byte if begin is None else begin
            previous = byte
        out.append(WireRange(group, begin, previous + 1))
    return out


def test_needed_ranges_without_a_receiver_are_the_bytes_the_plan_reads():
    # Row slices, column slices, a transposed read and a tensor read twice, over buckets that
    # split rows; in two groups.
    h = 12
    wire = ss.Layout([("q", "fp32", (h, h)), ("k", "fp32", (h // 2, h)), ("o", "fp32", (h, h)),
                      ("norm", "fp32", (h,)), ("lora.A", "fp32", (4, h), "lora")],
                     bucket_bytes=256)
    engine = ss.Layout([("qk", "fp32", (h + h // 4, h)), ("o_cols", "fp32", (h, h // 3)),
                        ("o_t", "fp32", (h // 2, h)), ("norm", "fp32", (h,)),
                        ("lora.A", "fp32", (2, h), "lora")], bucket_bytes=256)
    plan = ss.ReceivePlan(wire, [
        ss.PlanCopy("q", "qk", (h, h), 0, (h, 1), 0, (h, 1)),
        ss.PlanCopy("k", "qk", (h // 4, h), 2 * h, (h, 1), h * h, (h, 1)),  # rows 2..4
        ss.PlanCopy("o", "o_cols", (h, h // 3), h // 3, (h, 1), 0, (h // 3, 1)),  # columns
        ss.PlanCopy("o", "o_t", (h // 2, h), 1, (1, h), 0, (h, 1)),  # transposed, columns 1..6
        ss.PlanCopy("norm", "norm", (h,), 0, (1,), 0, (1,)),
        ss.PlanCopy("lora.A", "lora.A", (2, h), 2 * h, (h, 1), 0, (h, 1)),  # rows 2..3
    ])
    needed = ss.needed_ranges(engine, plan)
    assert needed == _bytes_read(wire, plan)
    assert {r.group for r in needed} == {0, 1}
    # Without a plan: every tensor of the layout, a range each.
    assert ss.needed_ranges(wire) == [WireRange(t.group_index, t.offset, t.offset + t.bytes)
                                      for g in wire.groups for t in g.tensors]
    # A plan a receiver would refuse is refused alike, named.
    outside = ss.ReceivePlan(wire, plan.copies[:-1] + [
        ss.PlanCopy("lora.A", "lora.A", (2, h), 3 * h, (h, 1), 0, (h, 1))])  # rows 3..4 of 4
    with pytest.raises(ss.InvalidArgumentError) as error:
        ss.needed_ranges(engine, outside)
    assert "plan copy 5 ('lora.A' -> 'lora.A')" in str(error.value)
    assert "outside tensor 'lora.A'" in str(error.value)


def test_an_engine_rebuilds_the_trainers_plan_from_engine_setup_and_checks_its_fingerprint():
    from shadowsync.sharded_publisher import engine_routing_plan

    wire = _wire()
    trainers = ss.RoutingPlan(wire, _fsdp(2))
    setup = dict(wire=[list(s) + ["base"] for s in WIRE], bucket_bytes=256, engine_needs=None,
                 fingerprint=trainers.fingerprint,
                 regions=[[[r.tensor, r.kind, list(r.begin), list(r.end)] if r.kind == "box"
                           else [r.tensor, r.kind, r.first, r.count] for r in rank]
                          for rank in _fsdp(2)])
    layout, plan = engine_routing_plan(setup)
    assert layout.fingerprint == wire.fingerprint and plan.fingerprint == trainers.fingerprint
    assert engine_routing_plan(setup, wire=wire)[1].fingerprint == trainers.fingerprint
    with pytest.raises(ss.LayoutMismatchError) as error:
        engine_routing_plan(dict(setup, fingerprint=trainers.fingerprint ^ 1))
    assert (f"engine_setup: this engine rank's routing plan (fingerprint "
            f"{trainers.fingerprint:#018x}, 2 trainer ranks -> 1 engine ranks") in str(error.value)
    assert f"differs from the trainers' ({trainers.fingerprint ^ 1:#018x})" in str(error.value)
    with pytest.raises(ss.InvalidArgumentError) as error:
        engine_routing_plan(dict(setup, regions=setup["regions"][:1]), what="here")
    assert str(error.value).startswith("here: the routing plan is refused: ")
    assert "engine rank 0 needs bytes 224..416 of tensor 'q' (group 'base'), which no trainer " \
           "rank holds" in str(error.value)


def test_the_fingerprint_is_stable_and_follows_the_sharding():
    wire = _wire()
    two = ss.RoutingPlan(wire, _fsdp(2)).fingerprint
    assert ss.RoutingPlan(wire, _fsdp(2)).fingerprint == two
    assert ss.RoutingPlan(_wire(), _fsdp(2)).fingerprint == two  # another Layout, same specs
    assert ss.RoutingPlan(wire, _fsdp(4)).fingerprint != two
    # By rank number, in any order: the same plan.
    assert ss.RoutingPlan(wire, dict(reversed(list(enumerate(_fsdp(2)))))).fingerprint == two


def test_refusals_name_the_ranks_and_the_bytes():
    wire = _wire()
    held = _fsdp(2)
    with pytest.raises(ss.InvalidArgumentError, match="engine rank 0 needs bytes 0..32 of "
                       r"tensor 'norm' \(group 'base'\), which no trainer rank holds"):
        ss.RoutingPlan(wire, [held[0][:-1], held[1]])
    with pytest.raises(ss.InvalidArgumentError, match="trainer ranks 0 and 1 both hold bytes "
                       "16..32 of tensor 'norm'"):
        ss.RoutingPlan(wire, [held[0], held[1] + [TensorRegion.elements("norm", 4, 4)]])
    with pytest.raises(ss.InvalidArgumentError, match=r"trainer ranks 0..1 expected \(2 lists "
                       r"given, one per rank\): rank 1 missing, rank 2 outside"):
        ss.RoutingPlan(wire, {0: held[0], 2: held[1]})
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'q' of shape \[13, 8\]: the box "
                       r"\[0, 0\]..\[14, 8\] is empty or outside it"):
        ss.RoutingPlan(wire, [[TensorRegion.box("q", (0, 0), (14, 8))]])
    with pytest.raises(ss.LayoutMismatchError, match="tensor 'v' is not in the wire layout"):
        wire.region_ranges(TensorRegion.elements("v", 0, 1))
    with pytest.raises(ss.InvalidArgumentError, match="engine rank 0: .* is not a WireRange"):
        ss.RoutingPlan(wire, held, [[TensorRegion.whole("norm", (8,))]])
    plan = ss.RoutingPlan(wire, held)
    with pytest.raises(ss.InvalidArgumentError, match=r"engine rank 1 is outside the routing "
                       r"plan's ranks 0..0"):
        plan.bytes_to_engine(1)
    with pytest.raises(ss.InvalidArgumentError, match=r"bucket 9 out of range \(group 'base' has "
                       r"4 buckets\)"):
        plan.routes(0, 9)
