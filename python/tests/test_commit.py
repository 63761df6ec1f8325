"""Coordinated commit (ReceiverConfig.commit_mode = "coordinated"): two tensor-parallel "ranks",
each with its own receiver, driven in lockstep by a fake TP engine whose every step combines what
both ranks read. Updates are held ready until commit(v), which the engine makes on both ranks
between the same two steps; no step may see the ranks on different versions.

The same run in "auto" mode (each rank flips at its own next step) is the broken-on-purpose
control: it must show steps where the ranks differ, or this test could not tell."""

import random
import threading
import time

import numpy as np
import pytest
from testing_hooks import inject_delay

import shadowsync as ss

SPECS = [("w", "int32", (256,))]
UPDATES = 2000
DEADLINE_S = 30.0


def _run(mode: str, updates: int, seed: int) -> dict:
    rng = random.Random(seed)
    loopback = ss.Loopback(3)
    backend = ss.HostBackend()
    layout = ss.Layout(SPECS, bucket_bytes=256)
    config = ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000), commit_mode=mode)
    ranks = [ss.Receiver(layout, backend, loopback.transport(r), config) for r in (1, 2)]
    sender = ss.Sender(layout, backend, loopback.transport(0),
                       ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000), checksums=False))
    # Random delays of either rank's broadcasts: their receives complete at different moments.
    for rank in (1, 2):
        for call in rng.sample(range(updates), updates // 4):
            inject_delay(loopback, rank, call, rng.randrange(50, 1500))
    sent = [0]
    failures = []

    def trainer():
        try:
            for v in range(1, updates + 1):
                handle = sender.publish(v, {"w": np.full(256, v, np.int32)})
                for r in ranks:
                    r.begin_update(handle.header_bytes)
                handle.wait(DEADLINE_S)
                sent[0] = v
        except BaseException as e:  # noqa: BLE001 - reported by the engine loop
            failures.append(e)

    thread = threading.Thread(target=trainer)
    thread.start()
    steps = differing = commits = 0
    deadline = time.monotonic() + 120
    try:
        while True:
            assert not failures, failures
            assert time.monotonic() < deadline, f"{mode}: stuck at step {steps}, sent {sent[0]}"
            if mode == "coordinated":
                # The trainer-side helper: commit once every rank reported the same version ready.
                ready = {r.stats().ready_version for r in ranks}
                if len(ready) == 1 and 0 not in ready:
                    (v,) = ready
                    assert [r.commit(v) for r in ranks] == [v, v]
                    commits += 1
            # One step of the TP engine: each rank's hook, then a result that needs both shards.
            for r in ranks:
                r.before_step()
            arrays = [r.live_array("w") for r in ranks]
            # Each rank's tensor holds one version whole (invariant 1 within a rank).
            assert all(np.all(a == a[0]) for a in arrays), (mode, steps, arrays)
            seen = [int(a[0]) for a in arrays]
            steps += 1
            differing += seen[0] != seen[1]
            if seen == [updates, updates]:
                break
        thread.join(DEADLINE_S)
    finally:
        sender.close()
        for r in ranks:
            r.close()
    return dict(steps=steps, differing=differing, commits=commits)


def test_coordinated_commit_keeps_every_rank_on_one_version_at_every_step():
    result = _run("coordinated", UPDATES, seed=1)
    assert result["differing"] == 0, result
    assert result["commits"] > UPDATES // 20, result  # many updates went live, each on both ranks


def test_auto_mode_lets_ranks_differ_the_control_that_shows_the_test_can_fail():
    result = _run("auto", UPDATES, seed=1)
    assert result["differing"] > 0, result


def test_commit_refusals_change_nothing():
    loopback = ss.Loopback(2)
    backend = ss.HostBackend()
    layout = ss.Layout(SPECS, bucket_bytes=256)
    auto = ss.Receiver(layout, backend, None)
    with pytest.raises(ss.InvalidArgumentError, match=r"commit\(1\): the receiver's commit_mode is auto"):
        auto.commit(1)
    auto.close()
    receiver = ss.Receiver(layout, backend, loopback.transport(1),
                           ss.ReceiverConfig(commit_mode="coordinated"))
    sender = ss.Sender(layout, backend, loopback.transport(0))
    try:
        with pytest.raises(ss.InvalidArgumentError, match=r"commit\(1\): none is ready on this rank "
                                                          r"\(applied version 0\)"):
            receiver.commit(1)
        handle = sender.publish(1, {"w": np.full(256, 1, np.int32)})
        receiver.begin_update(handle.header_bytes)
        handle.wait(DEADLINE_S)
        deadline = time.monotonic() + DEADLINE_S
        while receiver.stats().ready_version != 1:
            assert time.monotonic() < deadline, receiver.stats()
            time.sleep(0.001)
        assert receiver.before_step() is None  # held: no step flips it
        assert int(receiver.live_array("w")[0]) == 0
        with pytest.raises(ss.InvalidArgumentError, match=r"commit\(2\): update 1 is ready"):
            receiver.commit(2)
        assert receiver.commit(1) == 1
        assert int(receiver.live_array("w")[0]) == 1 and receiver.stats().ready_version == 0
        with pytest.raises(ss.InvalidArgumentError, match=r"none is ready on this rank \(applied "
                                                          r"version 1\)"):
            receiver.commit(1)
        with pytest.raises(ss.InvalidArgumentError, match="commit_mode"):
            ss.ReceiverConfig(commit_mode="eventually")._c_fields()
    finally:
        sender.close()
        receiver.close()


def test_an_update_ready_on_some_ranks_only_is_discarded_and_the_next_lands_alike_on_every_rank():
    """Update 2 fails on rank 2 (a flipped byte: its checksum) while rank 1 holds it ready: no
    commit can come, and rank 1 would take no newer update. discard(2) on both ranks, as between
    two steps, drops it; update 3, of the adapter only, then lands on both alike: its base stays
    update 1's on rank 1 too (update 2's base bytes never go live). A discard that comes while the
    update still arrives drops it when it completes."""
    from support import BASE, LORA, SPECS as MODEL, tensors, version_of
    from testing_hooks import inject_flip

    loopback = ss.Loopback(3)
    backend = ss.HostBackend()
    layout = ss.Layout(MODEL, bucket_bytes=1024)
    config = ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000), commit_mode="coordinated")
    ranks = [ss.Receiver(layout, backend, loopback.transport(r), config) for r in (1, 2)]
    sender = ss.Sender(layout, backend, loopback.transport(0),
                       ss.SenderConfig(update_deadline_ms=int(DEADLINE_S * 1000)))

    def wait_for(condition, what):
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}: " + str(
                [r.stats() for r in ranks])
            time.sleep(0.001)

    def publish(version, names, groups, receivers=ranks):
        handle = sender.publish(version, tensors(names, version), groups=groups)
        for r in receivers:
            r.begin_update(handle.header_bytes)
        return handle

    def live(rank):
        return {s[0]: version_of(s[0], rank.live_array(s[0])) for s in MODEL}

    try:
        first = publish(1, BASE + LORA, ["base", "lora"])
        first.wait(DEADLINE_S)
        wait_for(lambda: [r.ready_version for r in ranks] == [1, 1], "update 1 ready on both")
        assert [r.commit(1) for r in ranks] == [1, 1]
        # Update 2: rank 2's first bucket of it arrives with a byte flipped (update 1 took one
        # broadcast per bucket, the checksums' block included).
        calls = ss.UpdateHeader.from_bytes(first.header_bytes).bucket_count
        inject_flip(loopback, 2, calls, 3)
        handle = publish(2, BASE + LORA, ["base", "lora"])
        wait_for(lambda: ranks[0].ready_version == 2 and ranks[1].stats().updates_failed == 1,
                 "update 2 ready on rank 1, failed on rank 2")
        handle.wait(DEADLINE_S)  # the trainer sent it whole: the loss is rank 2's alone
        assert [r.discard(2) for r in ranks] == [True, False]
        assert [r.ready_version for r in ranks] == [0, 0]
        publish(3, LORA, ["lora"]).wait(DEADLINE_S)
        wait_for(lambda: [r.ready_version for r in ranks] == [3, 3], "update 3 ready on both")
        assert [r.commit(3) for r in ranks] == [3, 3]
        expected = {**{n: 1 for n in BASE}, **{n: 3 for n in LORA}}
        assert [live(r) for r in ranks] == [expected, expected]
        # Update 4: rank 1 is told to drop it before its receive even began; rank 2 holds it.
        assert ranks[0].discard(4) is False
        publish(4, BASE + LORA, ["base", "lora"]).wait(DEADLINE_S)
        wait_for(lambda: ranks[1].ready_version == 4 and ranks[0].stats().updates_ready == 4,
                 "update 4 ready on rank 2, received on rank 1")
        assert ranks[0].ready_version == 0  # received, and dropped on completion
        assert ranks[1].discard(4) is True
        publish(5, BASE, ["base"]).wait(DEADLINE_S)
        wait_for(lambda: [r.ready_version for r in ranks] == [5, 5], "update 5 ready on both")
        assert [r.commit(5) for r in ranks] == [5, 5]
        expected = {**{n: 5 for n in BASE}, **{n: 3 for n in LORA}}
        assert [live(r) for r in ranks] == [expected, expected]
        # No update is held ready in auto mode: nothing to drop, refused.
        auto = ss.Receiver(layout, backend, None)
        with pytest.raises(ss.InvalidArgumentError, match=r"discard\(1\): the receiver's "
                                                          r"commit_mode is auto"):
            auto.discard(1)
        auto.close()
    finally:
        sender.close()
        for r in ranks:
            r.close()
