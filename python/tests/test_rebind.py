"""The swap's rebind (engine_adapters/vllm/rebind.py, Rebinding): every parameter ends up pointing
at its tensor, and a parameter class whose ``__torch_function__`` only forwards (vLLM's) is
rebound without going through it, the 0.5 ms that loop cost at Llama-3-8B on the engine thread.

Checked to fail without their behaviour (broken by hand once, then restored): with the dispatch
left on for the direct pairs, the forwarding handler is called 3 times, not 0; with every class
taken as forwarding, the intercepting handler's assignments are not seen."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shadowsync.vllm import rebind  # noqa: E402


class Forwarding(torch.nn.Parameter):
    """A parameter class like vLLM's: a __torch_function__ that only forwards (and counts)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class Intercepting(torch.nn.Parameter):
    """A parameter class whose handler does something of its own on every call."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(getattr(func, "__name__", repr(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def parameters(cls, n=3):
    return [torch.Tensor._make_subclass(cls, torch.zeros(4, 2), False) for _ in range(n)]


def targets(n=3):
    return [torch.full((4, 2), float(i + 1)) for i in range(n)]


def assert_bound(params, tensors):
    for param, tensor in zip(params, tensors):
        assert param.data_ptr() == tensor.data_ptr()
        assert torch.equal(param.detach(), tensor)


@pytest.fixture
def forwarding_listed(monkeypatch):
    monkeypatch.setattr(rebind, "PASS_THROUGH_HANDLERS",
                        rebind.PASS_THROUGH_HANDLERS | {f"{__name__}.Forwarding"})


def test_a_forwarding_handler_is_skipped_and_every_parameter_rebound(forwarding_listed):
    params, tensors = parameters(Forwarding), targets()
    rebinding = rebind.Rebinding(zip(params, tensors))
    assert (len(rebinding.direct), len(rebinding.dispatched)) == (3, 0)
    Forwarding.calls = 0
    rebinding.apply()
    assert Forwarding.calls == 0
    assert_bound(params, tensors)


def test_a_handler_not_known_to_forward_sees_every_assignment():
    params, tensors = parameters(Intercepting), targets()
    rebinding = rebind.Rebinding(zip(params, tensors))
    assert (len(rebinding.direct), len(rebinding.dispatched)) == (0, 3)
    Intercepting.seen.clear()
    rebinding.apply()
    assert len(Intercepting.seen) == 3, Intercepting.seen
    assert_bound(params, tensors)


def test_plain_parameters_and_mixed_sets_are_all_rebound(forwarding_listed):
    plain = [torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False) for _ in range(2)]
    params = plain + parameters(Forwarding, 1) + parameters(Intercepting, 1)
    tensors = targets(4)
    rebinding = rebind.Rebinding(zip(params, tensors))
    assert (len(rebinding.direct), len(rebinding.dispatched)) == (3, 1)
    rebinding.apply()
    assert_bound(params, tensors)


def test_objects_that_are_not_tensors_are_assigned_as_they_are():
    class Holder:
        data = None

    holders, values = [Holder(), Holder()], ["a", "b"]
    rebind.Rebinding(zip(holders, values)).apply()
    assert [h.data for h in holders] == values


def test_vllms_parameter_class_is_rebound_without_its_handler():
    """If vLLM renames or moves the class, the fast path turns off without a word: this fails."""
    parameter = pytest.importorskip("vllm.model_executor.parameter")
    for cls in (parameter.BasevLLMParameter, parameter.ModelWeightParameter):
        params, tensors = parameters(cls, 2), targets(2)
        rebinding = rebind.Rebinding(zip(params, tensors))
        assert (len(rebinding.direct), len(rebinding.dispatched)) == (2, 0), cls
        rebinding.apply()
        assert_bound(params, tensors)
