"""The live arena's memory accounting (engine_adapters/vllm/live_arena.py, count_weights_once):
vLLM sizes its KV cache from the weights' memory it measured at load (its model runner's
`model_memory_usage`) plus what the device uses outside torch since start-up, the arena among it.
Moving the weights into the arena must take the freed torch memory off the former, or the weights
count twice and the KV cache loses a copy of them. The GPU run proves it in real vLLM
(scripts/gpu/check_live_arena_kv.py); here the runner lookup and the correction, on the CPU.
Skipped where vllm is not installed (live_arena.py subclasses vLLM's weight-transfer engine)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("vllm")
from shadowsync.vllm.live_arena import count_weights_once  # noqa: E402

GIB = 1 << 30


class Runner:
    def __init__(self, model, usage):
        self.model = model
        self.model_memory_usage = usage

    def get_model(self):
        return self.model


class Worker:
    """What vLLM 0.25's Worker.load_model looks like to the engine it makes."""

    def __init__(self, runner):
        self.model_runner = runner

    def load_model(self, make_engine):
        return make_engine(self.model_runner.get_model())


def make_engine(model, freed=16 * GIB, slot=16 * GIB):
    return count_weights_once(model, freed, slot)  # called from the engine's __init__


def test_the_weights_are_counted_once_on_the_runner_that_loaded_the_model():
    model = object()
    runner = Runner(model, 16 * GIB + (300 << 20))
    report = Worker(runner).load_model(make_engine)
    assert runner.model_memory_usage == 300 << 20
    assert report == {"slot_bytes": 16 * GIB, "freed_torch_bytes": 16 * GIB,
                      "model_memory_usage_before": 16 * GIB + (300 << 20),
                      "model_memory_usage_after": 300 << 20, "corrected": True}


def test_more_freed_than_counted_leaves_zero_not_a_negative_size():
    model = object()
    runner = Runner(model, 1 * GIB)
    Worker(runner).load_model(make_engine)
    assert runner.model_memory_usage == 0


def test_a_runner_of_another_model_is_left_alone_and_the_user_is_told_what_it_costs():
    runner = Runner(object(), 16 * GIB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = Worker(runner).load_model(lambda _: make_engine(object()))
    assert runner.model_memory_usage == 16 * GIB
    assert not report["corrected"] and report["model_memory_usage_before"] is None
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "KV cache is 16.00 GiB smaller" in message and "gpu_memory_utilization" in message


def test_no_runner_among_the_callers_changes_nothing_and_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = make_engine(object(), freed=GIB)
    assert not report["corrected"]
    assert "model runner was not found" in str(caught[0].message)


def test_the_default_backend_copies_in_under_tensor_parallelism():
    """backend "shadowsync" places the weights for graph pairs or the live arena only on one
    rank: under tensor (or pipeline) parallelism it leaves them in place (copy_in under CUDA
    graphs, what TP runs have shown), saying why and how to ask for the others."""
    from types import SimpleNamespace

    from shadowsync.vllm.weight_transfer_backend import choose_placement

    def config(tp, pp=1, lora=None):
        return SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False), lora_config=lora,
                               parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                                               pipeline_parallel_size=pp))

    cuda = SimpleNamespace(type="cuda")
    for tp, pp in ((2, 1), (1, 2), (4, 2)):
        placement, why = choose_placement(config(tp, pp), cuda, model=None)
        assert placement == "in place", (tp, pp, placement, why)
        assert f"vLLM runs {tp * pp} ranks" in why and "'shadowsync_graph_pairs'" in why
    placement, _ = choose_placement(config(1, lora=object()), cuda, model=None)
    assert placement == "live arena"  # one rank: the parallelism rule does not apply


def test_the_default_backend_leaves_an_fp8_engines_weights_in_place_without_graph_pairs():
    """An engine vLLM quantizes to FP8 while loading is served by graph pairs or copy_in (its
    set-up refuses the plain live arena): where graph pairs are not possible (no runner found
    here), backend "shadowsync" leaves its weights in place, saying why, instead of placing them
    where the set-up would then refuse them."""
    from types import SimpleNamespace

    from shadowsync.vllm.weight_transfer_backend import choose_placement

    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False, quantization="fp8"), lora_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    placement, why = choose_placement(config, SimpleNamespace(type="cuda"), model=None)
    assert placement == "in place" and 'quantization="fp8"' in why and "copy_in" in why
