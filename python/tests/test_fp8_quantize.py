"""The FP8 transform on the host backend (HostBackend::quantize_fp8_async, through the test hook
shadowsync_testing_quantize_fp8) against torch's float8_e4m3fn on the CPU, bit for bit: what
vLLM 0.25's dynamic per-tensor scaled_fp8_quant computes after loading for quantization="fp8"
(scale = max|x| / 448 in float32, the reciprocal once, x * reciprocal clamped with fmin/fmax to
+-448, rounded to the nearest e4m3, ties to even). Shapes of a fused parameter (a Llama qkv_proj:
one scale) and of stacked experts (w13_weight: a scale per expert), bf16, fp16 and fp32 sources,
with the values that round hardest: ties between two e4m3 values, subnormals, +-0 and an all-zero
part.

Needs torch (vLLM's lane) and the test-only library built beside the one the package loads
(libshadowsync_c_testing.so next to SHADOWSYNC_LIBRARY's, as a CMake build with the tests makes
them): the hook takes plain memory, so that library is loaded on its own."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from shadowsync import _library  # noqa: E402

TESTING_LIBRARY = "libshadowsync_c_testing.so"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def hook():
    path = Path(os.environ.get("SHADOWSYNC_LIBRARY") or _library.library_path())
    testing = path if path.name == TESTING_LIBRARY else path.with_name(TESTING_LIBRARY)
    if not testing.exists():
        pytest.fail(f"{testing} is missing: build the tests (cmake --build build) so that the "
                    f"test-only library lies beside {path}")
    lib = ctypes.CDLL(str(testing))
    fn = lib.shadowsync_testing_quantize_fp8
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                   ctypes.c_void_p, ctypes.c_void_p]
    return fn


def shadowsync_quantize(hook, x, parts: int):
    """(float8 bytes as uint8, float32 scales) from the host backend."""
    x = x.contiguous()
    name = next(n for n, d in DTYPES.items() if d == x.dtype)
    dst = torch.empty(x.numel(), dtype=torch.uint8)
    scales = torch.empty(parts, dtype=torch.float32)
    status = hook(x.data_ptr(), name.encode(), x.numel(), parts, dst.data_ptr(),
                  scales.data_ptr())
    assert status == 0, f"shadowsync_testing_quantize_fp8 returned {status}"
    return dst.reshape(x.shape), scales


def vllm_reference(x, parts: int):
    """vLLM 0.25's arithmetic in torch, part by part (its CUDA kernel's, on the CPU)."""
    rows = x.reshape(parts, -1).float()
    amax = rows.abs().amax(dim=1)
    scale = amax / torch.tensor(448.0, dtype=torch.float32)  # float32 division, as the kernel's
    inverse = torch.tensor(1.0, dtype=torch.float32) / scale
    scaled = rows * inverse[:, None]
    clamped = torch.fmax(torch.tensor(-448.0), torch.fmin(scaled, torch.tensor(448.0)))
    quantized = clamped.to(torch.float8_e4m3fn).view(torch.uint8)
    return quantized.reshape(x.shape), scale


def hard_values(shape, dtype, seed: int):
    """Random weights with the values that round hardest mixed in."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator, dtype=torch.float32) * 0.05
    flat = x.view(-1)
    # Scale 1 where a part's maximum is 448: e4m3's ties and subnormals land as they are.
    flat[0] = 448.0
    ties = torch.tensor([1.0625, 1.1875, 2 ** -10, 3 * 2 ** -10, 0.0, -0.0, 250.0, -17.0])
    flat[1:1 + ties.numel()] = ties
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_fused_parameter_quantizes_bit_for_bit_as_vllm(hook, dtype):
    """qkv_proj of a small Llama ([q + k + v rows, hidden]): one scale over the whole fused
    parameter."""
    x = hard_values((128 + 64 + 64, 128), DTYPES[dtype], seed=1)
    got, got_scale = shadowsync_quantize(hook, x, 1)
    want, want_scale = vllm_reference(x, 1)
    assert torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32))
    mismatched = (got != want).nonzero()
    assert mismatched.numel() == 0, (
        f"{len(mismatched)} elements differ, first at {mismatched[0].tolist()}: "
        f"{int(got[tuple(mismatched[0])])} vs {int(want[tuple(mismatched[0])])}")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_stacked_experts_quantize_with_a_scale_per_expert(hook, dtype):
    """w13_weight [experts, 2 x intermediate, hidden]: each expert its own scale (gate and up
    together); one expert all zeros (vLLM's scale 0, every byte 448's)."""
    x = hard_values((4, 2 * 64, 128), DTYPES[dtype], seed=2)
    x[1] *= 7.0  # another scale
    x[3] = 0.0
    got, got_scale = shadowsync_quantize(hook, x, 4)
    want, want_scale = vllm_reference(x, 4)
    assert torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32))
    assert got_scale[3] == 0.0 and bool((got[3] == 0x7E).all())
    assert torch.equal(got, want)
    # Per expert, not per tensor: the experts' scales differ.
    assert len(set(got_scale[:3].tolist())) == 3
