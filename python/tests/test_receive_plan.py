"""Receive plans through the Python package: the trainer sends its own tensors (q, k, v; a
row-parallel weight), the receiver's slots hold the engine's (a fused qkv; the second half of
every row), host backend, numpy arrays."""

import numpy as np
import pytest
from support import DEADLINE_S

import shadowsync as ss

H = 8
WIRE = [("q", "fp32", (H, H)), ("k", "fp32", (H // 2, H)), ("v", "fp32", (H // 2, H)),
        ("o", "fp32", (H, H))]
ENGINE = [("qkv", "fp32", (2 * H, H)), ("o_shard", "fp32", (H, H // 2))]
COPIES = [
    ss.PlanCopy("q", "qkv", (H, H), 0, (H, 1), 0, (H, 1)),
    ss.PlanCopy("k", "qkv", (H // 2, H), 0, (H, 1), H * H, (H, 1)),
    ss.PlanCopy("v", "qkv", (H // 2, H), 0, (H, 1), H * H + H * H // 2, (H, 1)),
    ss.PlanCopy("o", "o_shard", (H, H // 2), H // 2, (H, 1), 0, (H // 2, 1)),  # columns H/2..
]


def _wire_tensors(seed):
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, _, shape in WIRE}


def test_a_plan_puts_the_trainers_tensors_into_the_engines_layout():
    wire = ss.Layout(WIRE, bucket_bytes=256)  # rows cross bucket boundaries
    engine = ss.Layout(ENGINE)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(engine, backend, loopback.transport(1),
                           ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
                           plan=ss.ReceivePlan(wire, COPIES))
    sender = ss.Sender(wire, backend, loopback.transport(0))
    try:
        assert receiver.wire_layout is wire
        for version in (1, 2, 3):
            tensors = _wire_tensors(version)
            handle = sender.publish(version, tensors)
            assert handle.header.layout_fingerprint == wire.fingerprint
            receiver.begin_update(handle.header_bytes)
            receiver.wait_applied(version, DEADLINE_S)
            handle.wait(DEADLINE_S)
            expected_qkv = np.concatenate([tensors["q"], tensors["k"], tensors["v"]])
            np.testing.assert_array_equal(receiver.live_array("qkv"), expected_qkv)
            np.testing.assert_array_equal(receiver.live_array("o_shard"), tensors["o"][:, H // 2:])
        assert receiver.stats().bytes_received == 3 * sum(g.arena_bytes for g in wire.groups)
    finally:
        sender.close()
        receiver.close()


def test_a_plan_that_leaves_engine_bytes_unwritten_is_refused_naming_them():
    wire = ss.Layout(WIRE)
    engine = ss.Layout(ENGINE)
    with pytest.raises(ss.InvalidArgumentError, match=r"'qkv' \(256 of 512 bytes\)"):
        ss.Receiver(engine, ss.HostBackend(), None, plan=ss.ReceivePlan(wire, COPIES[:1] + COPIES[3:]))


def test_a_header_of_the_engine_layout_is_refused_by_a_receiver_with_a_plan():
    wire = ss.Layout(WIRE)
    engine = ss.Layout(ENGINE)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(engine, backend, loopback.transport(1), plan=ss.ReceivePlan(wire, COPIES))
    # A sender of the engine's layout: its update is never received, so it fails after 0.5 s.
    sender = ss.Sender(engine, backend, loopback.transport(0), ss.SenderConfig(update_deadline_ms=500))
    try:
        handle = sender.publish(1, {"qkv": np.zeros((2 * H, H), np.float32),
                                    "o_shard": np.zeros((H, H // 2), np.float32)})
        with pytest.raises(ss.LayoutMismatchError, match=f"{wire.fingerprint:#018x}"):
            receiver.begin_update(handle.header_bytes)
    finally:
        sender.close()
        receiver.close()
