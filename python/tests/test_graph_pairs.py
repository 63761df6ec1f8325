"""Graph pairs (engine_adapters/vllm/graph_pairs.py, GraphSets) on stand-ins of vLLM's graph
holders: a runner whose capture_model fills its CudaGraphManager's dict and two
CUDAGraphWrappers' dicts the way vLLM's does (refusing a batch size it already holds), each
"graph" remembering which slot the parameters pointed at when it was captured. A replay looks the
graphs up as vLLM does, so a step replays the slot its graphs were captured over. The GPU run
(scripts/vllm_e2e.py --graph-pairs, docs/testing.md) proves it in real vLLM with real graphs.

Checked to fail without their behaviour (each broken by hand once, then restored): without
the empty dicts before the second capture, the stand-in capture refuses ("already captured");
with use() not switching the wrappers' dicts, the piecewise replay reads slot 0 after the swap."""

from __future__ import annotations

import pytest

from shadowsync.errors import InvalidArgumentError
from shadowsync.vllm import graph_pairs

SIZES = (8, 4, 1)


class Manager:
    def __init__(self):
        self.graphs: dict = {}


class Wrapper:
    def __init__(self):
        self.concrete_cudagraph_entries: dict = {}


class Runner:
    """vLLM's V2 runner as far as graph pairs see it."""

    def __init__(self, wrappers):
        self.cudagraph_manager = Manager()
        self.wrappers = wrappers
        self.speculator = None
        self.bound = 0  # the slot the model's parameters point at
        self.captures: list[int] = []  # the slot of each capture_model call

    def capture_model(self) -> int:
        self.captures.append(self.bound)
        for size in SIZES:
            if size in self.cudagraph_manager.graphs:
                raise AssertionError(f"Graph already captured for {size}")
            self.cudagraph_manager.graphs[size] = ("full", self.bound)
            for w in self.wrappers:
                w.concrete_cudagraph_entries[size] = ("piece", self.bound)
        return 1 << 20

    def profile_cudagraph_memory(self) -> int:
        """vLLM's estimate, before it sizes the KV cache, of what one capture will take."""
        return 3 << 20

    def replay(self, size: int) -> set:
        """The slots a step of `size` tokens reads: its full graph's and every piece's."""
        slots = {self.cudagraph_manager.graphs[size][1]}
        slots |= {w.concrete_cudagraph_entries[size][1] for w in self.wrappers}
        return slots


@pytest.fixture
def rig(monkeypatch):
    wrappers = [Wrapper(), Wrapper()]
    monkeypatch.setattr(graph_pairs, "_cuda_graph_wrappers", lambda: wrappers)
    runner = Runner(wrappers)

    def bind(slot: int) -> None:
        runner.bound = slot

    return runner, bind


@pytest.mark.parametrize("live", [0, 1])
def test_capture_model_captures_over_each_slot_and_leaves_the_live_one(rig, live):
    runner, bind = rig
    bind(live)
    sets = graph_pairs.GraphSets(runner, bind, live)
    sets.install()
    assert runner.capture_model() == 2 << 20  # vLLM's call reaches the pair capture
    assert runner.captures == [live, 1 - live]
    assert runner.bound == live  # the parameters are back on the live slot
    for size in SIZES:
        assert runner.replay(size) == {live}


def test_vllms_graph_memory_estimate_counts_both_sets(rig):
    # vLLM sizes its KV cache from this estimate: one set would leave no room for the second.
    runner, bind = rig
    one_set = runner.profile_cudagraph_memory()
    sets = graph_pairs.GraphSets(runner, bind, 0)
    sets.install()
    assert runner.profile_cudagraph_memory() == 2 * one_set
    assert runner.capture_model() == sets.graph_bytes == 2 << 20


def test_use_switches_every_holder_to_the_slots_graphs(rig):
    runner, bind = rig
    sets = graph_pairs.GraphSets(runner, bind, 0)
    sets.install()
    runner.capture_model()
    for slot in (1, 0, 1):
        bind(slot)  # what the swap callback does first
        sets.use(slot)
        assert sets.slot == slot
        for size in SIZES:
            assert runner.replay(size) == {slot}
    sets.use(1)  # the same slot again: nothing changes
    assert runner.replay(1) == {1}


def test_use_without_captured_graphs_only_records_the_slot(rig):
    runner, bind = rig  # enforce_eager: vLLM never calls capture_model
    sets = graph_pairs.GraphSets(runner, bind, 0)
    sets.use(1)
    assert sets.slot == 1
    assert runner.cudagraph_manager.graphs == {}


def test_a_speculative_decoder_is_refused_at_start_up(rig):
    runner, bind = rig
    runner.speculator = object()
    with pytest.raises(InvalidArgumentError, match="speculative decoder.*'shadowsync'"):
        graph_pairs.GraphSets(runner, bind, 0)


def test_breakable_cuda_graphs_are_refused_at_start_up(rig, monkeypatch):
    runner, bind = rig
    monkeypatch.setattr(graph_pairs, "_breakable_cuda_graphs", lambda: True)
    with pytest.raises(InvalidArgumentError, match="VLLM_USE_BREAKABLE_CUDAGRAPH=1"):
        graph_pairs.GraphSets(runner, bind, 0)


def test_a_failed_second_capture_leaves_the_live_slot_and_its_graphs(rig):
    runner, bind = rig
    sets = graph_pairs.GraphSets(runner, bind, 0)
    sets.install()
    original = Runner.capture_model
    calls = []

    def failing_second(self):
        calls.append(self.bound)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return original(self)

    sets._capture = failing_second.__get__(runner)
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.capture_model()
    assert runner.bound == 0
    for size in SIZES:
        assert runner.replay(size) == {0}
    # Had vLLM gone on, a swap must not move the parameters under graphs of the other slot.
    with pytest.raises(InvalidArgumentError, match="captured over slot 0 only"):
        sets.use(1)
    assert sets.slot == 0


def test_a_runner_other_than_vllms_gpu_runners_is_refused(rig):
    runner, bind = rig
    del runner.cudagraph_manager
    with pytest.raises(InvalidArgumentError, match="is neither of vLLM's GPU runners"):
        graph_pairs.GraphSets(runner, bind, 0)


class V1Runner(Runner):
    """vLLM's V1 runner as far as graph pairs see it: no CudaGraphManager, its FULL graphs in a
    CUDAGraphWrapper around the model (the first wrapper here), a dispatcher."""

    def __init__(self, wrappers):
        super().__init__(wrappers)
        del self.cudagraph_manager
        self.cudagraph_dispatcher = object()
        self.parallel_config = type("ParallelConfig", (), {"use_ubatching": False})()
        self.compilation_config = type("CompilationConfig", (), {"cudagraph_mm_encoder": False})()
        self.supports_mm_inputs = False

    def capture_model(self) -> int:
        self.captures.append(self.bound)
        for size in SIZES:
            for w in self.wrappers:
                if size in w.concrete_cudagraph_entries:
                    raise AssertionError(f"Graph already captured for {size}")
                w.concrete_cudagraph_entries[size] = ("graph", self.bound)
        return 1 << 20

    def replay(self, size: int) -> set:
        return {w.concrete_cudagraph_entries[size][1] for w in self.wrappers}


def test_vllms_v1_runner_switches_its_wrappers_graphs_and_refuses_what_it_cannot(monkeypatch):
    """On the V1 runner (vLLM's for mixture-of-experts models) every graph is a
    CUDAGraphWrapper's: both sets are captured and a swap replays only the new slot's. What
    keeps graphs elsewhere there is refused by name."""
    wrappers = [Wrapper(), Wrapper()]
    monkeypatch.setattr(graph_pairs, "_cuda_graph_wrappers", lambda: wrappers)
    runner = V1Runner(wrappers)

    def bind(slot: int) -> None:
        runner.bound = slot

    assert graph_pairs.why_unswitchable(runner) is None
    sets = graph_pairs.GraphSets(runner, bind, 0)
    sets.install()
    runner.capture_model()  # vLLM's call: the installed capture, over both slots
    assert runner.captures == [0, 1] and runner.bound == 0
    for size in SIZES:
        assert runner.replay(size) == {0}
    bind(1)
    sets.use(1)
    for size in SIZES:
        assert runner.replay(size) == {1}

    runner.parallel_config.use_ubatching = True
    assert "micro-batches" in graph_pairs.why_unswitchable(runner)
    runner.parallel_config.use_ubatching = False
    runner.compilation_config.cudagraph_mm_encoder = True
    runner.supports_mm_inputs = True
    with pytest.raises(InvalidArgumentError, match="multimodal encoder"):
        graph_pairs.GraphSets(runner, bind, 0)
