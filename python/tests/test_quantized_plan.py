"""FP8 in the shadow: a receive plan whose engine tensors hold the FP8 quantization of what the
trainer sends (vLLM's quantization="fp8" after loading). The trainer sends q, k, v (fp32) and
four experts' gate and up projections (fp16); the engine holds a fused qkv in fp8_e4m3 with one
float32 scale, and stacked experts w13 in fp8 with a scale per expert. Through the loopback
transport on the host backend, over small buckets (tensors cut across them), three updates: the
engine's bytes and scales must equal the host backend's quantization of the fused tensors
(itself bit for bit against torch's float8_e4m3fn: test_fp8_quantize.py), and bad plans are
refused, named. Needs the test hooks (libshadowsync_c_testing.so, as scripts/test.sh's python step
loads it) for the reference quantization."""

import ctypes

import numpy as np
import pytest
from support import DEADLINE_S
from testing_hooks import NO_HOOKS

import shadowsync as ss
from shadowsync import _library

H, I, E = 32, 16, 4  # hidden, experts' intermediate, experts
WIRE = [("q", "fp32", (H, H)), ("k", "fp32", (H // 2, H)), ("v", "fp32", (H // 2, H)),
        ("norm", "fp32", (H,))]
WIRE += [(f"e{e}.{p}", "fp16", (I, H)) for e in range(E) for p in ("gate", "up")]
ENGINE = [("qkv", "fp8_e4m3", (2 * H, H)), ("qkv_scale", "fp32", (1,)), ("norm", "fp32", (H,)),
          ("w13", "fp8_e4m3", (E, 2 * I, H)), ("w13_scale", "fp32", (E,))]
COPIES = [
    ss.PlanCopy("q", "qkv", (H, H), 0, (H, 1), 0, (H, 1)),
    ss.PlanCopy("k", "qkv", (H // 2, H), 0, (H, 1), H * H, (H, 1)),
    ss.PlanCopy("v", "qkv", (H // 2, H), 0, (H, 1), H * H + H * H // 2, (H, 1)),
    ss.PlanCopy("norm", "norm", (H,), 0, (1,), 0, (1,)),
] + [ss.PlanCopy(f"e{e}.{p}", "w13", (I, H), 0, (H, 1), (e * 2 + j) * I * H, (H, 1))
     for e in range(E) for j, p in enumerate(("gate", "up"))]
QUANTIZED = [ss.PlanQuantization("qkv", "qkv_scale"), ss.PlanQuantization("w13", "w13_scale", E)]


def reference(array: np.ndarray, dtype: str, parts: int):
    """The host backend's quantization of `array` (shadowsync_testing_quantize_fp8)."""
    lib = _library.load()
    if not hasattr(lib, "shadowsync_testing_quantize_fp8"):
        pytest.skip(f"{NO_HOOKS} (shadowsync_testing_quantize_fp8, {_library.library_path()})")
    fn = lib.shadowsync_testing_quantize_fp8
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_void_p]
    array = np.ascontiguousarray(array)
    out = np.empty(array.size, np.uint8)
    scales = np.empty(parts, np.float32)
    assert fn(array.ctypes.data, dtype.encode(), array.size, parts, out.ctypes.data,
              scales.ctypes.data) == 0
    return out.reshape(array.shape), scales


def wire_tensors(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, dtype, shape in WIRE:
        values = rng.standard_normal(shape) * (0.02 if dtype == "fp16" else 0.05)
        out[name] = values.astype(np.float16 if dtype == "fp16" else np.float32)
    out["e1.up"] *= 9.0  # expert 1's scale differs from the others'
    return out


def test_the_receiver_quantizes_fused_and_expert_tensors_as_vllm_does():
    wire = ss.Layout(WIRE, bucket_bytes=1024)  # q alone spans four buckets
    engine = ss.Layout(ENGINE)
    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(engine, backend, loopback.transport(1),
                           ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
                           plan=ss.ReceivePlan(wire, COPIES, quantized=QUANTIZED))
    sender = ss.Sender(wire, backend, loopback.transport(0))
    try:
        for version in (1, 2, 3):
            tensors = wire_tensors(version)
            handle = sender.publish(version, tensors)
            receiver.begin_update(handle.header_bytes)
            receiver.wait_applied(version, DEADLINE_S)
            handle.wait(DEADLINE_S)
            qkv, qkv_scale = reference(
                np.concatenate([tensors["q"], tensors["k"], tensors["v"]]), "fp32", 1)
            w13, w13_scale = reference(
                np.stack([np.concatenate([tensors[f"e{e}.gate"], tensors[f"e{e}.up"]])
                          for e in range(E)]), "fp16", E)
            np.testing.assert_array_equal(receiver.live_array("qkv", np.uint8), qkv)
            np.testing.assert_array_equal(receiver.live_array("qkv_scale").view(np.uint32),
                                          qkv_scale.view(np.uint32))
            np.testing.assert_array_equal(receiver.live_array("w13", np.uint8), w13)
            np.testing.assert_array_equal(receiver.live_array("w13_scale").view(np.uint32),
                                          w13_scale.view(np.uint32))
            np.testing.assert_array_equal(receiver.live_array("norm"), tensors["norm"])
            assert len(set(w13_scale.tolist())) > 1 and qkv_scale[0] > 0
        # Staging holds the quantized tensors' wire bytes while their pieces arrive: at least the
        # largest of them (q, k, v: 8 KiB of fp32), at most both (w13's fp16: 8 KiB more).
        stats = receiver.stats()
        assert 8192 <= stats.plan_staging_bytes <= 16384, stats
        assert stats.plan_pieces >= len(COPIES), stats  # each copy, cut at the buckets
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("change,message", [
    (dict(quantized=[ss.PlanQuantization("norm", "qkv_scale")]),
     r"quantized tensor 'norm' is fp32; a quantized tensor is fp8_e4m3"),
    (dict(quantized=[ss.PlanQuantization("w13", "w13_scale", 3)]),
     r"quantized tensor 'w13': its 4096 elements do not split into 3 equal parts"),
    (dict(quantized=[ss.PlanQuantization("w13", "qkv_scale", E)]),
     r"scale tensor 'qkv_scale' is fp32 of 1 elements .* needs fp32 of 4 elements"),
    (dict(quantized=QUANTIZED[:1]),
     r"'w13' is fp8_e4m3 but .*fp16|a receive plan copies bytes, it does not convert"),
    (dict(copies=COPIES + [ss.PlanCopy("norm", "qkv_scale", (1,), 0, (1,), 0, (1,))]),
     r"'qkv_scale' holds the scales of a quantized tensor"),
    (dict(copies=COPIES[1:]),
     r"'qkv' \(quantized: 4096 of 8192 staged bytes\)"),
])
def test_bad_quantized_plans_are_refused_naming_the_tensor(change, message):
    wire = ss.Layout(WIRE)
    engine = ss.Layout(ENGINE)
    plan = ss.ReceivePlan(wire, change.get("copies", COPIES),
                          quantized=change.get("quantized", QUANTIZED))
    with pytest.raises((ss.InvalidArgumentError, ss.LayoutMismatchError), match=message):
        ss.Receiver(engine, ss.HostBackend(), None, plan=plan)
