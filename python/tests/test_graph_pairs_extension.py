"""The worker extension's side of graph pairs (init_weight_update_group, the swap callback,
close_weight_update_group) on the fake vLLM worker of test_vllm_extension.py, on the host backend.
vLLM's graph-pairs engine (live_arena.GraphPairsEngine, CUDA only) is stood in for by an object
with its interface over a testing host arena (testing_hooks.HostArena: two host slots), which
records the slots it is moved to. The real engine in real vLLM: scripts/vllm_e2e.py
--graph-pairs on a GPU (docs/testing.md).

Checked to fail without their behaviour (each broken by hand once, then restored): with the swap
callback rebinding without use_slot, the first test fails on the recorded slots; with
close_weight_update_group settling before the receiver is closed, the close test fails."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support import BASE, DEADLINE_S, LORA, pattern, tensors, version_of
from test_vllm_extension import FakeWorker, _step_until, _trainer
from testing_hooks import HostArena

import shadowsync as ss

NAMES = BASE + LORA


class FakeGraphPairsEngine:
    """GraphPairsEngine's interface: the parameters live in the arena's slot `slot`; use_slot
    moves them (and, in vLLM, the graph sets); settle brings them to the slot the arena shows."""

    shadowsync_live_arena = True
    shadowsync_graph_pairs = True

    def __init__(self, worker: FakeWorker, live_slot: int = 0):
        named = dict(worker.model_runner.model.params)
        self.params = [named[n] for n in NAMES]
        self.layout = ss.Layout([(n, *_spec(n)) for n in NAMES])  # one group, model order
        self.arena = HostArena(ss.HostBackend(), self.layout.groups[0].arena_bytes, live_slot)
        self.slot = live_slot
        self.moves: list[int] = []  # the slots use_slot moved the parameters to
        self.receiver = None  # set by the test: whether it was closed when settle ran
        self.settled_with_receiver_closed: list[bool] = []
        for param, view in zip(self.params, self._views(live_slot)):
            view[...] = param.data
            param.data = view

    def _views(self, slot: int) -> list[np.ndarray]:
        group = self.layout.groups[0]
        raw = (ctypes.c_uint8 * group.arena_bytes).from_address(self.arena.slot_address(slot))
        arena = np.frombuffer(raw, dtype=np.uint8)
        return [arena[t.offset:t.offset + t.bytes].view(p.data.dtype).reshape(p.data.shape)
                for t, p in zip(group.tensors, self.params)]

    def use_slot(self, slot: int) -> None:
        for param, view in zip(self.params, self._views(slot)):
            param.data = view
        self.slot = slot
        self.moves.append(slot)

    def settle(self) -> None:
        if self.receiver is not None:
            self.settled_with_receiver_closed.append(self.receiver.closed)
        target = self.arena.live_slot
        if self.slot != target:
            for src, dst in zip(self._views(self.slot), self._views(target)):
                dst[...] = src
            self.use_slot(target)


def _spec(name: str):
    from support import spec

    return spec(name)[1:3]


def _worker(live_slot: int = 0):
    worker = FakeWorker()
    worker.weight_transfer_engine = FakeGraphPairsEngine(worker, live_slot)
    return worker, worker.weight_transfer_engine


def _init(worker, loopback, **kwargs):
    return worker.init_weight_update_group(transport=loopback.transport(1), bucket_bytes=1024,
                                           **kwargs)


def _address(param) -> int:
    return param.data.ctypes.data


def _group(worker, specs):
    """A trainer (Sender on rank 0 of a new loopback world) and the worker's group on rank 1."""
    loopback = ss.Loopback(2)
    layout, sender = _trainer(specs, loopback.transport(0))
    assert _init(worker, loopback) == layout.fingerprint
    return sender


def _update(worker, sender, version: int) -> None:
    """Publishes `version` of every tensor and steps the worker until its steps read it."""
    handle = sender.publish(version, tensors(NAMES, version))
    worker.begin_update(handle.header_bytes)
    _step_until(worker, version)
    handle.wait(DEADLINE_S)


def test_swaps_move_the_parameters_between_the_arenas_slots_and_nothing_else():
    worker, engine = _worker()
    sender = _group(worker, [(n, *_spec(n)) for n in NAMES])
    try:
        stats = worker.weight_update_stats()
        assert (stats["swap_strategy"], stats["live_arena"], stats["graph_pairs"]) == \
            ("rebind", True, True)
        receiver = worker._shadowsync.receiver
        assert receiver.live_arena_pointer(0) == engine.arena.slot_address(0)
        for version in (1, 2, 3):
            _update(worker, sender, version)
            slot = version % 2  # each update lands in the slot that was not live
            assert engine.moves[-1] == slot
            assert receiver.live_arena_pointer(0) == engine.arena.slot_address(slot)
            params = dict(worker.model_runner.model.params)
            assert _address(params[NAMES[0]]) == engine.arena.slot_address(slot)
            assert [version_of(n, params[n].data) for n in NAMES] == [version] * len(NAMES)
        assert engine.moves == [1, 0, 1]
        assert all(len(seen) == 1 and -1 not in seen for seen in worker.steps), worker.steps
    finally:
        worker.close_weight_update_group()
        sender.close()


def test_close_settles_into_the_arenas_slot_once_the_receiver_is_closed_and_a_new_group_starts_there():
    worker, engine = _worker()
    specs = [(n, *_spec(n)) for n in NAMES]
    sender = _group(worker, specs)
    engine.receiver = worker._shadowsync.receiver
    _update(worker, sender, 1)
    assert engine.slot == 1  # one swap: the model reads the slot the arena does not show
    worker.close_weight_update_group(keep_weights=True)
    sender.close()
    assert engine.settled_with_receiver_closed == [True]
    assert engine.slot == engine.arena.live_slot == 0
    params = dict(worker.model_runner.model.params)
    assert _address(params[NAMES[0]]) == engine.arena.slot_address(0)  # still in the arena
    assert [version_of(n, params[n].data) for n in NAMES] == [1] * len(NAMES)

    # A new group starts from slot 0, where the model reads: its first update lands in slot 1.
    sender = _group(worker, specs)
    try:
        _update(worker, sender, 2)
        assert engine.slot == 1
        assert all(len(seen) == 1 and -1 not in seen for seen in worker.steps), worker.steps
    finally:
        worker.close_weight_update_group()
        sender.close()


def test_init_settles_first_when_the_model_reads_the_other_slot():
    # As a close that failed before settling would leave it: the model computes with slot 1
    # (version 5) while the arena shows slot 0 (version 0), where a receiver would start.
    worker, engine = _worker()
    for view, name in zip(engine._views(1), NAMES):
        view[...] = pattern(name, 5)
    engine.use_slot(1)
    _init(worker, ss.Loopback(2))
    try:
        assert engine.slot == 0 == engine.arena.live_slot
        assert worker._shadowsync.receiver.live_arena_pointer(0) == engine.arena.slot_address(0)
        params = dict(worker.model_runner.model.params)
        assert [version_of(n, params[n].data) for n in NAMES] == [5] * len(NAMES)
    finally:
        worker.close_weight_update_group()


def test_gated_swaps_are_refused_naming_graph_pairs_and_nothing_is_set_up():
    worker, engine = _worker()
    with pytest.raises(ss.InvalidArgumentError, match="graph pairs swap without a remap"):
        _init(worker, ss.Loopback(2), gated_swaps=True)
    assert not worker.has_weight_update_group()
    assert engine.moves == []
