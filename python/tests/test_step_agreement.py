"""Step agreement (commit_mode "auto" under tensor parallelism, step_agreement.py): the ranks'
step hooks commit a ready update at the same step, every rank or none, over one page of shared
memory. Ranks here are threads driving StepAgreement as vLLM's step hooks would."""

import os
import random
import threading
import time

import pytest

from shadowsync.errors import InvalidArgumentError
from shadowsync.vllm import step_agreement
from shadowsync.vllm.step_agreement import RING, LiveWatch, StepAgreement, open_for_tensor_parallel_group

DEADLINE_S = 20.0


@pytest.fixture
def page(tmp_path):
    return str(tmp_path / "steps")


def ranks_on(path: str, ranks: int) -> list[StepAgreement]:
    return [StepAgreement(path, 0, ranks, create=True)] + [
        StepAgreement(path, r, ranks) for r in range(1, ranks)]


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S} s: {what}"
        time.sleep(0.0005)


def follower_waiting(follower: StepAgreement, step: int, ready: int):
    """follower.goes_live(step, ready) on a thread, returned once its promise is on the page (it
    then waits for rank 0's decision): the thread and the list its answer goes to. A daemon:
    where the invariant is broken it would wait for a decision that never comes."""
    answer = []
    thread = threading.Thread(target=lambda: answer.append(follower.goes_live(step, ready)),
                              daemon=True)
    thread.start()
    wait_for(lambda: follower._words[follower.rank] != 0, "the follower's promise")
    return thread, answer


def test_a_follower_that_became_ready_ahead_of_rank_0_is_not_committed_behind_it(page):
    leader, follower = ranks_on(page, 2)
    # The follower runs step 5 first and finds update 7 ready there: it promises from step 5 on
    # and waits for rank 0's decision for step 5.
    thread, answer = follower_waiting(follower, 5, 7)
    # Rank 0, one step behind, holds 7 ready too: the follower did not read step 4's decision,
    # so 7 must not go live at 4.
    assert leader.goes_live(4, 7) is False
    assert answer == []  # still waiting for step 5
    assert leader.goes_live(5, 7) is True
    thread.join(DEADLINE_S)
    assert answer == [True]


def test_rank_0_alone_ready_commits_nothing_and_a_follower_not_ready_waits_for_nothing(page):
    leader, follower = ranks_on(page, 2)
    assert leader.goes_live(1, 3) is False  # the follower promised nothing
    assert follower.goes_live(1, 0) is False  # holds nothing: returns at once
    assert follower.goes_live(2, 0) is False  # no decision for step 2 exists, none is needed


def test_every_rank_commits_each_version_at_the_same_step_under_skew(page):
    """Three ranks, each update becoming ready on each rank at its own random step, the ranks
    running up to two steps apart with random delays: every version goes live on every rank, at
    one step."""
    ranks, steps, versions = 3, 400, 12
    agreements = ranks_on(page, ranks)
    rng = random.Random(1234)
    # ready_at[v][r]: the step from which rank r's receiver holds update v (after v-1 committed)
    ready_after = [[rng.randint(0, 12) for _ in range(ranks)] for _ in range(versions)]
    done_steps = [0] * ranks  # each rank's last finished step (a forward needs every rank's part)
    committed = [[] for _ in range(ranks)]  # (step, version)
    errors = []

    def run(rank: int) -> None:
        jitter = random.Random(rank)
        agreement, version, since = agreements[rank], 1, None
        try:
            for step in range(1, steps + 1):
                # A step's forward waits for every rank's part of the step before it.
                wait_for(lambda: min(done_steps) >= step - 2, "the other ranks' steps")
                for _ in range(jitter.randint(0, 200)):
                    os.sched_yield() if jitter.random() < 0.01 else None
                ready = 0
                if version <= versions:
                    since = step if since is None else since
                    if step - since >= ready_after[version - 1][rank]:
                        ready = version
                if agreement.goes_live(step, ready):
                    agreement.committed(step, version)  # as UpdateGroup.committed does
                    committed[rank].append((step, ready))
                    version, since = version + 1, None
                done_steps[rank] = step
        except BaseException as error:  # noqa: BLE001
            errors.append(error)
            done_steps[rank] = steps + 10  # do not hold the others

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [v for _, v in committed[0]] == list(range(1, versions + 1)), committed[0]
    for rank in range(1, ranks):
        assert committed[rank] == committed[0], (rank, committed)


def test_a_promise_from_before_the_last_commit_counts_for_nothing(page):
    """A fresh page's zero word, and a follower's promise for an update that went live since
    (its version's low bits alike: 1 and 1 + 2**23), never let rank 0 commit alone."""
    leader, follower = ranks_on(page, 2)
    assert leader.goes_live(1, 1 << 23) is False  # the zero word: "version 0 since step 0"
    thread, answer = follower_waiting(follower, 2, 1)
    assert leader.goes_live(2, 1) is True
    thread.join(DEADLINE_S)
    assert answer == [True]
    leader.committed(2, 1)
    follower.committed(2, 1)
    # Rank 0 holds 1 + 2**23 at step 3; the follower holds nothing yet, and its word still
    # promises 1 since step 2.
    assert leader.goes_live(3, 1 + (1 << 23)) is False
    assert follower.goes_live(3, 0) is False


def test_a_decision_rank_0_overwrote_stops_the_step(page):
    leader, follower = ranks_on(page, 2)
    leader.goes_live(1 + RING, 0)  # rank 0 ran RING steps ahead: step 1's word is step 65's now
    with pytest.raises(RuntimeError, match=r"rank 1 at step 1 finds rank 0's decision for step "
                                           rf"{1 + RING}.*ran {RING} or more steps ahead"):
        follower.goes_live(1, 2)


def test_a_follower_waits_for_rank_0_within_a_deadline_then_stops_the_step(page, monkeypatch):
    monkeypatch.setattr(step_agreement, "DECISION_DEADLINE_S", 0.05)
    _, follower = ranks_on(page, 2)
    with pytest.raises(RuntimeError, match=r"rank 1 holds update 2 ready and waited 0 s at step "
                                           r"3 for rank 0's decision"):
        follower.goes_live(3, 2)


def test_bad_ranks_and_a_page_of_another_size_are_refused(page):
    with pytest.raises(InvalidArgumentError, match="rank 2 of 2 ranks"):
        StepAgreement(page, 2, 2, create=True)
    StepAgreement(page, 0, 2, create=True)
    with pytest.raises(InvalidArgumentError, match=r"for 3 ranks; every rank must be of the same"):
        StepAgreement(page, 1, 3)


class Group:
    """tensor_parallel.gathered for `ranks` threads: an all-gather per call."""

    def __init__(self, ranks: int, hosts: list[str]):
        self.ranks, self.hosts = ranks, hosts
        self.barrier = threading.Barrier(ranks, timeout=DEADLINE_S)
        self.values = [None] * ranks
        self.local = threading.local()

    def gathered(self, value):
        rank = self.local.rank
        self.values[rank] = value
        self.barrier.wait()
        values = list(self.values)
        self.barrier.wait()  # everyone read them before the next call writes
        return values, rank

    def open_on_every_rank(self, monkeypatch) -> list:
        """open_for_tensor_parallel_group on each rank (each with its own host name): what each
        returned or raised."""
        results = [None] * self.ranks

        def rank_thread(rank):
            self.local.rank = rank
            try:
                results[rank] = open_for_tensor_parallel_group(self.gathered)
            except BaseException as error:  # noqa: BLE001
                results[rank] = error

        monkeypatch.setattr(step_agreement.socket, "gethostname",
                            lambda: self.hosts[self.local.rank])
        threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(self.ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        return results


def test_ranks_on_two_hosts_are_refused_on_every_rank_and_leave_no_file(monkeypatch, tmp_path):
    monkeypatch.setattr(step_agreement, "_SHM_DIR", str(tmp_path))
    results = Group(2, ["host-a", "host-b"]).open_on_every_rank(monkeypatch)
    for result in results:
        assert isinstance(result, InvalidArgumentError), results
        assert ("commit_mode \"auto\" under tensor parallelism: the tensor-parallel ranks run on "
                "2 hosts (host-a, host-b)") in str(result)
        assert "leave commit_mode unset" in str(result)
    assert list(tmp_path.iterdir()) == []


def test_one_host_opens_one_page_on_every_rank_and_removes_its_file(monkeypatch, tmp_path):
    monkeypatch.setattr(step_agreement, "_SHM_DIR", str(tmp_path))
    leader, follower = Group(2, ["host-a", "host-a"]).open_on_every_rank(monkeypatch)
    assert (leader.rank, follower.rank, leader.ranks) == (0, 1, 2)
    assert list(tmp_path.iterdir()) == []  # removed once every rank opened it
    # One page: the follower's promise is what rank 0 reads.
    thread, answer = follower_waiting(follower, 1, 4)
    assert leader._words[1] != 0  # on rank 0's page
    assert leader.goes_live(1, 4) is True
    thread.join(DEADLINE_S)
    assert answer == [True]


def test_a_page_rank_0_cannot_create_is_refused_on_every_rank(monkeypatch, tmp_path):
    monkeypatch.setattr(step_agreement, "_SHM_DIR", str(tmp_path / "missing"))
    results = Group(2, ["host-a", "host-a"]).open_on_every_rank(monkeypatch)
    for result in results:
        assert isinstance(result, InvalidArgumentError), results
        assert "rank 0 could not create" in str(result) and "missing" in str(result)


def test_a_follower_that_does_not_share_the_page_is_refused_with_the_likely_cause(
        monkeypatch, tmp_path):
    monkeypatch.setattr(step_agreement, "_SHM_DIR", str(tmp_path))
    real_init = StepAgreement.__init__

    def elsewhere(self, path, rank, ranks, create=False):  # rank 1 sees another /dev/shm
        real_init(self, path if rank == 0 else path + "-not-here", rank, ranks, create)

    monkeypatch.setattr(StepAgreement, "__init__", elsewhere)
    results = Group(2, ["host-a", "host-a"]).open_on_every_rank(monkeypatch)
    for result in results:
        assert isinstance(result, InvalidArgumentError), results
        assert "rank 1 finds no" in str(result) and "--ipc=host" in str(result), str(result)
    assert list(tmp_path.iterdir()) == []  # rank 0 removed its file and closed


def test_the_front_end_reads_the_live_version_and_rank_0s_step_through_its_descriptor(page):
    leader, follower = ranks_on(page, 2)
    os.unlink(page)  # as the set-up does once every rank opened it
    reader = leader.reader()
    assert reader["path"] == f"/proc/{os.getpid()}/fd/{leader._fd}" and follower.reader() is None
    watch = LiveWatch.open(reader)
    assert watch.read() == (0, 0)
    leader.goes_live(3, 0)
    assert watch.read() == (0, 3)  # rank 0 stepped, nothing went live
    leader.committed(3, 7)
    assert watch.read() == (7, 3)
    # Not this page (a descriptor number reused by another group's), no page, a bad answer:
    # nothing to watch, and the front end asks the workers instead.
    assert LiveWatch.open(dict(reader, token=reader["token"] ^ 2)) is None
    assert LiveWatch.open(dict(reader, path=page)) is None
    assert LiveWatch.open(None) is None and LiveWatch.open({"path": reader["path"]}) is None
    leader.close()
    assert watch.read() is None  # closed: a new group names its own page
    assert leader.reader() is None
    follower.close()
    watch.close()
