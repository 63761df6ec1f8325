"""Bad input to the trainer-side Sender: an exception naming the tensor and both values, and
nothing sent. "Nothing sent" is shown by the same version then going through end to end: had the
library taken the bad publish, the version would be spent (the sender refuses a version not above
the last) and the loopback ranks' broadcasts would be out of step."""

import numpy as np
import pytest
from support import BASE, DEADLINE_S, LORA, SPECS, pattern, tensors

import shadowsync as ss


def _wrong_dtype(t):
    t["embed"] = t["embed"].astype(np.int32)
    return r"tensor 'embed': dtype int32 \(int32\) does not match layout fp32"


def _wrong_shape(t):
    t["w"] = np.zeros(256, np.int32)
    return r"tensor 'w': shape \[256\] does not match layout \[257\]"


def _non_contiguous(t):
    t["embed"] = np.zeros((4, 300), np.float32).T  # the right shape, column-major
    return (r"tensor 'embed': not contiguous: strides \[1, 300\] \(elements\), contiguous would "
            r"be \[4, 1\]")


def _unknown_name(t):
    t["lm_head.weight"] = np.zeros(3, np.float32)
    return r"tensor 'lm_head.weight' is not in the layout"


def _missing_tensor(t):
    del t["norm"]
    return r"tensor 'norm' of group 'base' \(dtype fp16, shape \[7\]\) is missing"


def _unsupported_dtype(t):
    t["embed"] = t["embed"].astype(np.float64)
    return r"tensor 'embed': unsupported dtype 'float64'"


def _not_a_tensor(t):
    t["w"] = list(range(257))
    return r"tensor 'w': a builtins.list is neither a numpy array nor a torch tensor"


@pytest.mark.parametrize(
    "break_it",
    [_wrong_dtype, _wrong_shape, _non_contiguous, _unknown_name, _missing_tensor,
     _unsupported_dtype, _not_a_tensor],
    ids=lambda f: f.__name__.lstrip("_"),
)
def test_bad_tensor_raises_naming_it_and_sends_nothing(pair, break_it):
    bad = tensors(BASE + LORA, 1)
    message = break_it(bad)
    before = pair.receiver.stats()
    with pytest.raises(ss.InvalidArgumentError, match=message):
        pair.sender.publish(1, bad)
    assert pair.receiver.stats() == before
    assert pair.sender._inflight == []

    pair.update(1, BASE + LORA)  # the same version: it was not spent
    assert set(pair.live_versions().values()) == {1}


def test_tensor_on_another_device_is_refused(pair):
    pair.sender.backend.device = "cuda:0"  # as a CudaBackend's: numpy arrays are host memory
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"tensor 'embed': device cpu does not match the backend's cuda:0"):
        pair.sender.publish(1, tensors(BASE + LORA, 1))
    pair.sender.backend.device = "cpu"
    pair.update(1, BASE + LORA)


def test_tensor_twice_and_unknown_group_are_refused(pair):
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'embed' given twice"):
        pair.sender.publish(1, [("embed", pattern("embed", 1))] + list(tensors(BASE, 1).items()))
    with pytest.raises(ss.InvalidArgumentError, match=r"group 'vision' is not in the layout"):
        pair.sender.publish(1, tensors(BASE, 1), groups=["base", "vision"])
    pair.update(1, BASE)


def test_streamed_supply_out_of_order_is_refused(pair):
    streamed = pair.sender.publish_streamed(1, ["base"])
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"tensor 'w' supplied where 'embed' \(number 0 in layout order\) is next"):
        streamed.supply({"w": pattern("w", 1)})
    pair.receiver.begin_update(streamed.header_bytes)
    streamed.supply(tensors(BASE, 1))  # nothing was consumed by the refused supply
    pair.receiver.wait_applied(1, DEADLINE_S)
    streamed.handle.wait(DEADLINE_S)
    assert [pair.live_versions()[n] for n in BASE] == [1, 1, 1]


def test_gather_that_supplies_too_little_cancels_the_update(pair):
    streamed = pair.sender.publish_streamed(1, ["lora"])
    pair.receiver.begin_update(streamed.header_bytes)
    with pytest.raises(ss.InvalidArgumentError, match=r"supplied 0 of the 2 tensors of its bucket; "
                       r"missing: \['lora.A', 'lora.B'\]"):
        streamed.gather(lambda names, supply: None)
    pair.receiver.drain()
    assert pair.receiver.stats().updates_failed == 1
    assert pair.receiver.live_content_version("lora") == 0


def test_bad_header_bytes_are_refused_and_change_nothing(pair):
    handle = pair.sender.publish(1, tensors(BASE + LORA, 1))
    good = handle.header_bytes
    with pytest.raises(ss.BadHeaderError):
        pair.receiver.begin_update(good[:-1])
    with pytest.raises(ss.BadHeaderError):
        pair.receiver.begin_update(b"\0" * len(good))
    other = ss.Layout([s for s in SPECS if s[0] != "norm"], bucket_bytes=1024)
    header = handle.header
    foreign = ss.UpdateHeader(header.version, other.fingerprint, header.groups, header.bucket_count,
                              header.magic, header.protocol_version)
    with pytest.raises(ss.ShadowsyncError, match="fingerprint"):
        pair.receiver.begin_update(foreign)
    assert pair.receiver.stats().last_accepted_version == 0
    pair.receiver.begin_update(good)
    pair.receiver.wait_applied(1, DEADLINE_S)
    handle.wait(DEADLINE_S)


def test_bad_layout_specs_are_refused():
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'x': unsupported dtype 'complex64'"):
        ss.Layout([("x", "complex64", (3,))])
    with pytest.raises(ss.InvalidArgumentError, match=r"expected \(name, dtype, shape\[, group\]\)"):
        ss.Layout([("x", "fp32")])
    with pytest.raises(ss.InvalidArgumentError):
        ss.Layout([("x", "fp32", (3,))], bucket_bytes=100)  # not a multiple of 256


def test_layout_sizes_and_versions_that_would_wrap_are_refused(pair):
    # 2^62 fp32 elements are 2^64 bytes: refused, not a 0-byte arena.
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'x': shape \[4611686018427387904\]"):
        ss.Layout([("x", "fp32", (2**62,))])
    with pytest.raises(ss.InvalidArgumentError, match=r"tensor 'c' .* takes group 'base' past"):
        ss.Layout([("a", "fp32", (2**53,)), ("b", "fp32", (2**53,)), ("c", "fp32", (2**53,))])
    # A version near 2^64 would leave the trainer's next one nowhere to go.
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"update 9223372036854775808: above the highest version"):
        pair.sender.publish(2**63, tensors(BASE + LORA, 1))
    pair.update(1, BASE + LORA)  # nothing was spent
    assert set(pair.live_versions().values()) == {1}
