"""Updates end to end through the Python package: sender rank 0 and receiver rank 1 on a loopback
world, host backend, numpy arrays. The engine is this test's thread calling the step hook."""

import threading
import time

import pytest
from support import BASE, DEADLINE_S, LORA, SPECS, pattern, tensors, version_of
from testing_hooks import inject_delay, inject_drop

import shadowsync as ss


def test_update_end_to_end(pair):
    handle = pair.sender.publish(1, tensors(BASE + LORA, 1))
    assert handle.header.version == 1
    assert handle.header.layout_fingerprint == pair.layout.fingerprint
    assert handle.header.groups == (0, 1)
    assert ss.UpdateHeader.from_bytes(handle.header_bytes) == handle.header

    pair.receiver.begin_update(handle.header_bytes)  # returns at once; the receive is native
    pair.receiver.wait_applied(1, DEADLINE_S)
    handle.wait(DEADLINE_S)

    assert handle.done()
    assert pair.live_versions() == {s[0]: 1 for s in SPECS}
    assert pair.receiver.applied_version == 1
    assert pair.receiver.live_content_version("base") == 1
    assert pair.receiver.live_content_version("lora") == 1
    stats = pair.receiver.stats()
    assert (stats.updates_ready, stats.updates_failed, stats.applied_version) == (1, 0, 1)
    assert stats.bytes_received == sum(g.arena_bytes for g in pair.layout.groups)
    assert pair.receiver.last_update_error() == ""


def test_a_publish_handle_closed_when_done_does_not_stop_the_next_publish(pair):
    """A trainer that closes each handle once it waited for it (what the vLLM trainer engine
    does) publishes again: the sender skips closed handles among those it keeps alive."""
    for version in (1, 2):
        handle = pair.sender.publish(version, tensors(BASE + LORA, version))
        pair.receiver.begin_update(handle.header_bytes)
        pair.receiver.wait_applied(version, DEADLINE_S)
        handle.wait(DEADLINE_S)
        handle.close()
    assert pair.live_versions() == {s[0]: 2 for s in SPECS}


def test_engine_steps_on_the_old_version_while_the_update_streams(pair):
    """The trainer holds the update after its first bucket; meanwhile the engine steps and every
    step reads version 1 whole. Released, the update lands between two steps, all at once."""
    pair.update(1, BASE + LORA)
    streamed = pair.sender.publish_streamed(2, ["base", "lora"])
    pair.receiver.begin_update(streamed.header_bytes)
    first_bucket_sent = threading.Event()
    release = threading.Event()
    trainer_error = []

    def gather(names, supply):
        supply(tensors(names, 2))
        if not first_bucket_sent.is_set():
            first_bucket_sent.set()
            assert release.wait(DEADLINE_S), "the test never released the trainer"

    def trainer():
        try:
            streamed.gather(gather).wait(DEADLINE_S)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            trainer_error.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        assert first_bucket_sent.wait(DEADLINE_S)
        # The update is in flight (its first bucket supplied, the rest held back): the engine
        # keeps stepping on version 1, and no step sees anything else.
        for _ in range(50):
            assert pair.receiver.before_step() is None
            assert pair.live_versions() == {s[0]: 1 for s in SPECS}
        assert not streamed.handle.done()
    finally:
        release.set()
    steps, applied = 0, None
    deadline = time.monotonic() + DEADLINE_S
    while applied is None:
        assert time.monotonic() < deadline, f"version 2 not applied after {steps} steps"
        applied = pair.receiver.before_step()
        seen = set(pair.live_versions().values())
        assert seen == ({2} if applied else {1}), f"step {steps} read versions {seen}"
        steps += 1
    thread.join(DEADLINE_S)
    assert not trainer_error, trainer_error
    assert applied == 2


def test_versions_strictly_increase_and_latest_wins(pair):
    applied = []
    for version in (1, 2, 3):
        pair.update(version, BASE + LORA)
        applied.append(pair.receiver.applied_version)
    assert applied == [1, 2, 3]

    # A version not above the last is refused by the sender (nothing sent) ...
    with pytest.raises(ss.StaleVersionError, match="version must be greater than the last one, 3"):
        pair.sender.publish(3, tensors(BASE + LORA, 3))
    # ... and by the receiver (nothing changes): a header of version 2 again.
    header = pair.update(4, BASE + LORA).header
    stale = ss.UpdateHeader(2, header.layout_fingerprint, header.groups, header.bucket_count,
                            header.magic, header.protocol_version)
    before = pair.receiver.stats()
    with pytest.raises(ss.StaleVersionError):
        pair.receiver.begin_update(stale.to_bytes())
    assert pair.receiver.stats() == before

    # Two updates received while the engine does not step: only the later one is applied, and
    # the base that only the earlier one carried comes with it (a LoRA-only update never lands on
    # a stale base).
    h5 = pair.sender.publish(5, tensors(BASE + LORA, 5))
    pair.receiver.begin_update(h5.header_bytes)
    h6 = pair.sender.publish(6, tensors(LORA, 6))
    pair.receiver.begin_update(h6.header_bytes)
    pair.receiver.drain()  # both received; version 5 was offered, then taken back
    assert pair.receiver.applied_version == 4
    assert pair.receiver.before_step() == 6
    versions = pair.live_versions()
    assert [versions[n] for n in BASE] == [5, 5, 5] and [versions[n] for n in LORA] == [6, 6]
    assert pair.receiver.stats().updates_superseded == 1


def test_lora_only_update_leaves_the_base_alone(pair):
    pair.update(1, BASE + LORA)
    handle = pair.update(2, LORA)  # groups default to those of the tensors given
    assert handle.header.groups == (pair.layout.group("lora").index,)
    versions = pair.live_versions()
    assert {n: versions[n] for n in BASE} == {n: 1 for n in BASE}
    assert {n: versions[n] for n in LORA} == {n: 2 for n in LORA}
    assert pair.receiver.live_content_version("base") == 1
    assert pair.receiver.live_content_version("lora") == 2


def test_streamed_publish_asks_for_each_bucket_in_layout_order(pair):
    streamed = pair.sender.publish_streamed(1, ["lora", "base"])  # any order: layout order wins
    pair.receiver.begin_update(streamed.header_bytes)
    asked = []

    def gather(names, supply):
        asked.append(names)
        supply([(n, pattern(n, 1)) for n in names])  # (name, tensor) pairs work too

    handle = streamed.gather(gather)
    pair.receiver.wait_applied(1, DEADLINE_S)
    handle.wait(DEADLINE_S)
    assert asked == pair.layout.bucket_plan(["base", "lora"])
    # embed spans buckets 0..4 of base, w and norm start in bucket 4 and 5.
    assert asked[0] == ["embed"] and [n for names in asked for n in names] == [s[0] for s in SPECS]
    assert pair.live_versions() == {s[0]: 1 for s in SPECS}


def test_failed_streamed_update_is_discarded_and_a_new_transport_resumes(pair):
    """A gathered tensor that fails its check cancels the update: the receiver discards it, live
    weights untouched; after new transports on both sides updates go on."""
    pair.update(1, BASE + LORA)
    streamed = pair.sender.publish_streamed(2, ["base"])
    pair.receiver.begin_update(streamed.header_bytes)

    def gather(names, supply):
        bad = {n: pattern(n, 2) for n in names}
        if "norm" in bad:
            bad["norm"] = bad["norm"].astype("float32")
        supply(bad)

    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'norm': dtype fp32 \(float32\) does not match layout fp16"):
        streamed.gather(gather)
    with pytest.raises(ss.ShadowsyncError):
        streamed.handle.wait(DEADLINE_S)
    pair.receiver.drain()
    stats = pair.receiver.stats()
    assert (stats.updates_failed, stats.applied_version, stats.needs_transport) == (1, 1, True)
    assert pair.receiver.last_update_error() != ""
    assert pair.receiver.before_step() is None
    assert pair.live_versions() == {s[0]: 1 for s in SPECS}

    fresh = ss.Loopback(2)
    pair.sender.replace_transport(fresh.transport(0))
    pair.receiver.replace_transport(fresh.transport(1))
    pair.update(3, BASE + LORA)
    assert pair.live_versions() == {s[0]: 3 for s in SPECS}


def test_swap_callback_sees_every_group_of_the_update(pair):
    seen = []
    pair.receiver.set_swap_callback(lambda version, swaps: seen.append((version, [s.group for s in swaps])))
    pair.update(1, BASE + LORA)
    pair.update(2, LORA)
    assert seen == [(1, [0, 1]), (2, [1])]

    def broken(version, swaps):
        raise RuntimeError(f"rebind failed at {version}")

    pair.receiver.set_swap_callback(broken)
    handle = pair.sender.publish(3, tensors(LORA, 3))
    pair.receiver.begin_update(handle.header_bytes)
    with pytest.raises(RuntimeError, match="rebind failed at 3"):
        pair.receiver.wait_applied(3, DEADLINE_S)


def test_loopback_fault_injection_reaches_the_receiver():
    """A delayed bucket still lands; a sender rank that drops out fails the update at the
    receiver's bucket deadline, and the live weights stay as they were."""
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(layout, backend, loopback.transport(1),
                           ss.ReceiverConfig(update_deadline_ms=5000, bucket_deadline_ms=300))
    sender = ss.Sender(layout, backend, loopback.transport(0),
                       ss.SenderConfig(update_deadline_ms=2000))
    try:
        inject_delay(loopback, 0, 1, 50_000)  # the sender's second broadcast waits 50 ms
        handle = sender.publish(1, tensors(BASE + LORA, 1))
        receiver.begin_update(handle.header_bytes)
        receiver.wait_applied(1, DEADLINE_S)
        handle.wait(DEADLINE_S)

        buckets_of_v1 = sum(g.bucket_count for g in layout.groups)
        inject_drop(loopback, 0, buckets_of_v1 + 2)  # rank 0 dies in the middle of update 2
        handle = sender.publish(2, tensors(BASE + LORA, 2))
        receiver.begin_update(handle.header_bytes)
        receiver.drain()
        stats = receiver.stats()
        assert (stats.updates_failed, stats.applied_version, stats.needs_transport) == (1, 1, True)
        assert receiver.last_update_error().startswith("update 2 (base+lora) discarded")
        assert receiver.before_step() is None
        assert {version_of(s[0], receiver.live_array(s[0])) for s in SPECS} == {1}
        with pytest.raises(ss.ShadowsyncError):
            handle.wait(DEADLINE_S)
    finally:
        receiver.close()
        sender.close()
