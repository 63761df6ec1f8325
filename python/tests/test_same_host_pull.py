"""The same-host pull transport through the Python package (no torch): two trainer ranks serve on
threads, an engine rank connects from plain values (paths, token, plan, rank); its handshake's
refusals arrive as the named errors. Last, three updates through routed Senders (one per
trainer rank) and a Receiver with the plan, and two updates into two engine replicas."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest

import shadowsync as ss
from shadowsync import TensorRegion

TOKEN = "ssk1-ded952b6063bf160ed7d94ce93798cced35abbce9b811bd0d11a58d3eaf21707"
WIRE = [("q", "fp32", (13, 8)), ("norm", "fp32", (8,))]


def _plan(trainers: int, engines_need_norm: bool = True):
    wire = ss.Layout(WIRE, bucket_bytes=256)
    held = []
    for r in range(trainers):
        regions = [TensorRegion.box("q", (13 * r // trainers, 0), (13 * (r + 1) // trainers, 8))]
        if r == trainers - 1:
            regions.append(TensorRegion.whole("norm", (8,)))
        held.append(regions)
    needs = None
    if not engines_need_norm:
        needs = [wire.region_ranges(TensorRegion.whole("q", (13, 8)))]
    return ss.RoutingPlan(wire, held, needs)


@pytest.fixture
def paths():
    directory = tempfile.mkdtemp(prefix="ss_pull_")  # mode 0700, as the transport requires
    yield [os.path.join(directory, f"trainer{t}.sock") for t in range(2)]
    shutil.rmtree(directory, ignore_errors=True)


def _serve(path, plan, rank, timeout_ms, results, engine_processes=1):
    try:
        results[rank] = ss.same_host_pull_trainer_transport(
            path, TOKEN, plan, rank, engine_processes, ss.HostBackend(),
            connect_timeout_ms=timeout_ms)
    except ss.ShadowsyncError as error:
        results[rank] = error


def test_two_trainer_ranks_and_an_engine_rank_connect(paths):
    plan = _plan(2)
    results = {}
    threads = [threading.Thread(target=_serve, args=(paths[t], plan, t, 20000, results))
               for t in range(2)]
    for t in threads:
        t.start()
    engine = ss.same_host_pull_engine_transport(paths, TOKEN, plan, 0, ss.HostBackend(),
                                                connect_timeout_ms=20000)
    for t in threads:
        t.join()
    assert "engine rank 0 of 2 trainer ranks" in repr(engine)
    for rank in range(2):
        assert isinstance(results[rank], ss.Transport), results[rank]
        assert f"trainer rank {rank}" in repr(results[rank])
        results[rank].close()
    engine.close()


def test_a_trainer_rank_of_another_plan_is_refused_by_name(paths):
    results = {}
    trainer_plan = _plan(1, engines_need_norm=False)
    engine_plan = _plan(1)
    thread = threading.Thread(target=_serve, args=(paths[0], trainer_plan, 0, 1000, results))
    thread.start()
    with pytest.raises(ss.LayoutMismatchError) as refused:
        ss.same_host_pull_engine_transport(paths[:1], TOKEN, engine_plan, 0, ss.HostBackend(),
                                           connect_timeout_ms=20000)
    thread.join()
    assert (f"routing plan (fingerprint {engine_plan.fingerprint:#018x}) differs from trainer "
            f"rank 0's at {paths[0]} ({trainer_plan.fingerprint:#018x})") in str(refused.value)
    assert isinstance(results[0], ss.ShadowsyncTimeoutError)
    assert "has routing plan" in str(results[0])


def test_a_trainer_rank_that_never_serves_and_bad_arguments(paths):
    plan = _plan(2)
    with pytest.raises(ss.ShadowsyncTimeoutError, match=r"trainer rank 0 \(.*trainer0.sock\) "
                                                        r"never served within 50 ms"):
        ss.same_host_pull_engine_transport(paths, TOKEN, plan, 0, ss.HostBackend(),
                                           connect_timeout_ms=50)
    with pytest.raises(ss.InvalidArgumentError, match="1 trainer paths, but the routing plan "
                                                      "has 2 trainer ranks"):
        ss.same_host_pull_engine_transport(paths[:1], TOKEN, plan, 0, ss.HostBackend())
    with pytest.raises(ss.InvalidArgumentError, match="not one path"):
        ss.same_host_pull_engine_transport(paths[0], TOKEN, plan, 0, ss.HostBackend())
    with pytest.raises(ss.InvalidArgumentError, match="plan must be a shadowsync.RoutingPlan"):
        ss.same_host_pull_trainer_transport(paths[0], TOKEN, None, 0, 1, ss.HostBackend())
    # Device memory runs on a CudaBackend's streams (built without CUDA: NotSupportedError).
    with pytest.raises((ss.InvalidArgumentError, ss.NotSupportedError),
                       match="needs a cuda backend, but 'backend' is 'host'|built without CUDA"):
        ss.same_host_pull_trainer_transport(paths[0], TOKEN, plan, 0, 1, ss.HostBackend(),
                                            memory="device")


def _routed_pair(paths, layout, plan, backend, config=None):
    """Two trainer ranks' routed Senders over their pull transports (served on threads) and the
    engine rank's Receiver, which took the plan."""
    results = {}
    threads = [threading.Thread(target=_serve, args=(paths[t], plan, t, 20000, results))
               for t in range(2)]
    for t in threads:
        t.start()
    engine = ss.same_host_pull_engine_transport(paths, TOKEN, plan, 0, backend,
                                                connect_timeout_ms=20000)
    for t in threads:
        t.join()
    senders = [ss.Sender(layout, backend, results[t], routing_plan=plan, trainer_rank=t)
               for t in range(2)]
    receiver = ss.Receiver(layout, backend, engine, config)
    receiver.use_routing_plan(plan, 0)
    return senders, receiver


def _shards(full, regions):
    """(name, array, region) of each region of `full`'s tensors."""
    shards = []
    for r in regions:
        index = tuple(slice(b, e) for b, e in zip(r.begin, r.end))
        shards.append((r.tensor, np.ascontiguousarray(full[r.tensor][index]), r))
    return shards


def _two_rank_split():
    """q [13, 8] and norm [8] in 256-byte buckets (3 of them); trainer rank 0 holds q's rows
    0..6, rank 1 the rest and the norm; one engine rank needing every byte."""
    shapes = {"q": (13, 8), "norm": (8,)}
    layout = ss.Layout([(name, "fp32", shape) for name, shape in shapes.items()], bucket_bytes=256)
    regions = [[TensorRegion.box("q", (0, 0), (7, 8))],
               [TensorRegion.box("q", (7, 0), (13, 8)), TensorRegion.whole("norm", (8,))]]
    return shapes, layout, regions, ss.RoutingPlan(layout, regions)


def test_two_trainer_ranks_update_an_engine_rank_through_senders_and_a_receiver(paths):
    """End to end: each trainer rank a routed Sender over its pull transport, publishing only its
    shards; the engine rank's Receiver took the plan. Three updates (the slots alternate across
    updates as the Sender counts its sends); the live slot comes out as the full tensors."""
    shapes, layout, regions, plan = _two_rank_split()
    assert layout.groups[0].bucket_count % 2 == 1  # the slots alternate across updates
    backend = ss.HostBackend()
    senders, receiver = _routed_pair(paths, layout, plan, backend)
    try:
        rng = np.random.default_rng(4)
        for version in (1, 2, 3):
            full = {name: rng.standard_normal(shape).astype(np.float32)
                    for name, shape in shapes.items()}
            handles = [senders[t].publish_shards(version, _shards(full, regions[t]))
                       for t in range(2)]
            receiver.begin_update(handles[0].header_bytes)
            for handle in handles:
                handle.wait(timeout=20)
            receiver.wait_applied(version, timeout=20)
            for name, values in full.items():
                np.testing.assert_array_equal(receiver.live_array(name), values)
            assert receiver.stats().routed_bytes == plan.bytes_to_engine(0)
            # Host memory is read from the staging slots: packed, saying so.
            assert receiver.stats().routed_in_place_bytes == 0
            assert senders[0].routes_in_place == (
                False, 'host memory (memory="host") is read from the staging slots')
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


def test_a_bucket_deadline_names_the_trainer_rank_that_did_not_send(paths):
    """Trainer rank 1 never publishes update 1: the engine rank's bucket deadline fails the update,
    and its error names trainer rank 1 as the one whose doorbell never came (trainer rank 0's
    did); nothing goes live."""
    shapes, layout, regions, plan = _two_rank_split()
    backend = ss.HostBackend()
    senders, receiver = _routed_pair(paths, layout, plan, backend,
                                     ss.ReceiverConfig(bucket_deadline_ms=300))
    try:
        full = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
        handle = senders[0].publish_shards(1, _shards(full, regions[0]))
        receiver.begin_update(handle.header_bytes)
        with pytest.raises(ss.ShadowsyncError):
            handle.wait(timeout=20)  # the engine rank gave up: trainer rank 0's send fails too
        deadline = time.monotonic() + 20
        while receiver.stats().updates_failed == 0:
            assert time.monotonic() < deadline, "the engine rank never failed update 1"
            time.sleep(0.01)
        error = receiver.last_update_error()
        assert "bucket 0 of 3 did not complete within its deadline of 300 ms" in error
        assert ("; the transport waits for the doorbell of bucket 0 of update 1 (group 0, "
                "bucket 0) from trainer rank 1, for ") in error
        assert error.endswith(" ms (trainer rank 0 sent its)"), error
        assert receiver.stats().applied_version == 0
    finally:
        receiver.close()
        for sender in senders:
            sender.close()


def test_two_engine_replicas_take_every_update_from_senders_that_send_once(paths):
    """Engine replicas: the trainer ranks serve 2 processes for the plan's one engine rank
    (engine_processes = replicas x engine ranks), and each publishes every update once; both
    replicas' Receivers (replica 0 and 1) come out with the full tensors and the plan's bytes.
    A replica the trainers do not serve is refused, naming both values, before it connects."""
    shapes, layout, regions, plan = _two_rank_split()
    backend = ss.HostBackend()
    results = {}
    threads = [threading.Thread(target=_serve, args=(paths[t], plan, t, 20000, results, 2),
                                daemon=True) for t in range(2)]
    for t in threads:
        t.start()
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"engine rank 0, replica 2: trainer rank 0 at .* serves 2 "
                             r"replica\(s\) of each engine rank \(replicas 0..1\)"):
        ss.same_host_pull_engine_transport(paths, TOKEN, plan, 0, backend, replica=2,
                                           connect_timeout_ms=20000)
    receivers, senders = [], []
    try:
        for replica in range(2):
            transport = ss.same_host_pull_engine_transport(paths, TOKEN, plan, 0, backend,
                                                           replica=replica,
                                                           connect_timeout_ms=20000)
            receivers.append(ss.Receiver(layout, backend, transport))
            receivers[-1].use_routing_plan(plan, 0)
        for t in threads:
            t.join(20)
        assert all(isinstance(results.get(t), ss.Transport) for t in range(2)), results
        senders = [ss.Sender(layout, backend, results[t], routing_plan=plan, trainer_rank=t)
                   for t in range(2)]
        rng = np.random.default_rng(5)
        for version in (1, 2):
            full = {name: rng.standard_normal(shape).astype(np.float32)
                    for name, shape in shapes.items()}
            handles = [senders[t].publish_shards(version, _shards(full, regions[t]))
                       for t in range(2)]
            for receiver in receivers:
                receiver.begin_update(handles[0].header_bytes)
            for handle in handles:
                handle.wait(timeout=20)
            for replica, receiver in enumerate(receivers):
                receiver.wait_applied(version, timeout=20)
                for name, values in full.items():
                    np.testing.assert_array_equal(receiver.live_array(name), values,
                                                  err_msg=f"replica {replica}")
                assert receiver.stats().routed_bytes == plan.bytes_to_engine(0)
    finally:
        for receiver in receivers:
            receiver.close()
        for sender in senders:
            sender.close()


def test_a_replica_outside_the_publishers_replicas_is_refused_before_connecting():
    from shadowsync.sharded_publisher import sharded_receiver
    from shadowsync.vllm.trainer_ranks import from_engine_setup

    setup = {"engine_replicas": 2}  # nothing else is read before the refusal
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"sharded_receiver: replica 2 is outside the 2 engine replica\(s\)"):
        sharded_receiver(setup, TOKEN, 0, replica=2)
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"from_engine_setup: replica 1 is outside the 1 engine replica\(s\)"):
        from_engine_setup({}, TOKEN, replica=1)
