"""shadowsync.vllm.online_fp8 on the CPU: an engine that vLLM quantized to FP8 while loading
(quantization="fp8"), from the set-up's discovery of its float8 weights to their bytes after a
receive.

vLLM's CPU build cannot run FP8 layers, so the model here is a small torch module built the way
vLLM 0.25 leaves one (online/fp8.py): a fused q/k/v linear whose weight is the float8 transpose
([in, out] view) of row-major [out, in] bytes with one float32 scale, and a MoE layer whose
w13_weight/w2_weight are float8 [experts, ...] with a scale per expert; vLLM's record of the
as-loaded parameters (its layerwise reload metadata: meta bf16 tensors whose loaders are wrapped
by vLLM's online-processing loader, or bound to its placeholder) is registered in vLLM's own
table. The real engines are covered on one H200 (scripts/vllm_e2e.py --quantization fp8).

The receive: the plan is traced from the model's load_weights through the as-loaded stand-ins,
the trainer's bf16 tensors go through the loopback transport on the host backend, and the
engine's float8 bytes and scales must equal torch's float8_e4m3fn quantization of the fused
tensors (vLLM's arithmetic: scale = max|x| / 448, x times its reciprocal, clamped, rounded to
the nearest e4m3) bit for bit. Then every refusal, named. Needs torch and vllm (vLLM's lane)."""

from __future__ import annotations

import types

import numpy as np
import pytest
from support import DEADLINE_S

torch = pytest.importorskip("torch")
layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")
reload_types = pytest.importorskip("vllm.model_executor.model_loader.reload.types")
sanitize = pytest.importorskip("vllm.model_executor.model_loader.reload.sanitize")

import shadowsync as ss  # noqa: E402
from shadowsync.layout import TensorSpec  # noqa: E402
from shadowsync.vllm.loader_trace import STAND_IN_FLAG  # noqa: E402
from shadowsync.vllm.online_fp8 import as_loaded, online_fp8_weights  # noqa: E402
from shadowsync.vllm.receive_planning import receive_plan  # noqa: E402

nn = torch.nn
FP8 = torch.float8_e4m3fn
H, Q, KV, I, E = 32, 32, 8, 16, 4  # hidden, q rows, k/v rows, experts' intermediate, experts


def method(name: str, **attributes):
    """A quant method object of vLLM's class name (the set-up knows them by name)."""
    return type(name, (), {"uses_meta_device": True, **attributes})()


def online_process_loader(original):
    """vLLM's online-processing wrapper of a loader, as the record holds it (buffers the load in
    vLLM; here it must never be called)."""
    def online_process_loader(*args, **kwargs):
        raise AssertionError("the trace called vLLM's buffering wrapper, not the loader")

    online_process_loader.__wrapped__ = original
    return online_process_loader


def record(layer, **as_loaded_params):
    """vLLM's record of `layer`'s parameters as created before loading (meta tensors)."""
    layerwise.LAYERWISE_INFO[layer] = reload_types.LayerReloadingInfo(
        restore_metadata=(as_loaded_params, {}), restore_device=torch.device("cpu"))


def meta(shape, loader):
    p = nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"), requires_grad=False)
    p.weight_loader = loader
    return p


class QkvLinear(nn.Module):
    """vLLM's fused q/k/v after online FP8: weight [in, out] float8 (a view of [out, in] bytes),
    weight_scale [1]. `padded_in`: bytes laid out for a K padded to it (a kernel that pads)."""

    SHARDS = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}

    def __init__(self, padded_in: int = H, scale_parts: int = 1, padded_out: int = Q + 2 * KV):
        super().__init__()
        self.quant_method = method("Fp8PerTensorOnlineLinearMethod")
        rows = torch.zeros(padded_out, padded_in, dtype=FP8)
        self.weight = nn.Parameter(rows[:, :H].t(), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(scale_parts), requires_grad=False)
        record(self, weight=meta((Q + 2 * KV, H), online_process_loader(self.load)))

    def load(self, param, loaded, shard):
        start, rows = self.SHARDS[shard]
        param.data.narrow(0, start, rows).copy_(loaded)


class Experts(nn.Module):
    """vLLM's stacked experts after online FP8 (per-expert scales)."""

    def __init__(self, backend: str = "TRITON"):
        super().__init__()
        self.quant_method = method("Fp8PerTensorOnlineMoEMethod",
                                   fp8_backend=types.SimpleNamespace(value=backend))
        self.w13_weight = nn.Parameter(torch.zeros(E, 2 * I, H, dtype=FP8), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(E, H, I, dtype=FP8), requires_grad=False)
        self.w13_weight_scale = nn.Parameter(torch.ones(E), requires_grad=False)
        self.w2_weight_scale = nn.Parameter(torch.ones(E), requires_grad=False)
        # As vLLM records them: loaders bound to its placeholder instead of the layer.
        placeholder = self.load.__func__.__get__(sanitize.layer_ref_sentinel)
        record(self, w13_weight=meta((E, 2 * I, H), placeholder),
               w2_weight=meta((E, H, I), placeholder))

    def load(self, param, loaded, shard, expert):
        target = param.data[expert]
        if shard in ("w1", "w3"):
            target = target.narrow(0, 0 if shard == "w1" else I, I)
        target.copy_(loaded)


class Model(nn.Module):
    def __init__(self, **layers):
        super().__init__()
        self.qkv = layers.get("qkv") or QkvLinear()
        self.experts = layers.get("experts") or Experts()
        self.norm = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, loaded in weights:
            parts = name.split(".")
            if parts[0] in ("q_proj", "k_proj", "v_proj"):
                p = params["qkv.weight"]
                p.weight_loader(p, loaded, parts[0][0])
            elif parts[0] == "experts":
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[parts[2]]
                p = params["experts.w2_weight" if shard == "w2" else "experts.w13_weight"]
                p.weight_loader(p, loaded, shard, int(parts[1]))
            else:
                params[name].data.copy_(loaded)


WIRE = [("q_proj.weight", (Q, H)), ("k_proj.weight", (KV, H)), ("v_proj.weight", (KV, H))]
WIRE += [(f"experts.{e}.{p}.weight", (I, H)) for e in range(E) for p in ("gate_proj", "up_proj")]
WIRE += [(f"experts.{e}.down_proj.weight", (H, I)) for e in range(E)]
WIRE += [("norm", (H,))]
SPECS = [TensorSpec(n, "bf16", shape) for n, shape in WIRE]


def vllm_quantize(x, parts: int):
    """What vLLM's dynamic per-tensor scaled_fp8_quant computes, per part: (float8 bytes, scales)."""
    x = x.float().reshape(parts, -1)
    scales = x.abs().amax(dim=1) / 448.0
    q = (x * (1.0 / scales)[:, None]).clamp(-448.0, 448.0).to(FP8)
    return q.view(torch.uint8).reshape(-1).numpy(), scales.numpy()


def test_discovery_describes_the_float8_bytes_in_the_as_loaded_layout():
    model = Model()
    found = online_fp8_weights(model)
    assert list(found) == ["qkv.weight", "experts.w13_weight", "experts.w2_weight"]
    qkv = found["qkv.weight"]
    assert tuple(qkv.storage.shape) == (Q + 2 * KV, H) and qkv.storage.is_contiguous()
    assert qkv.storage.data_ptr() == model.qkv.weight.data_ptr()  # the engine's own bytes
    assert (qkv.scale_name, qkv.parts) == ("qkv.weight_scale", 1)
    assert [(w.scale_name, w.parts) for w in list(found.values())[1:]] == [
        ("experts.w13_weight_scale", E), ("experts.w2_weight_scale", E)]
    # While the trace runs, the as-loaded stand-ins are the parameters; then the float8 again.
    quantized = model.qkv.weight
    with as_loaded(found):
        stand = model.qkv.weight
        assert stand.device.type == "meta" and stand.dtype == torch.bfloat16
        assert getattr(stand, STAND_IN_FLAG) and stand.weight_loader == model.qkv.load
        assert model.experts.w13_weight.weight_loader == model.experts.load
    assert model.qkv.weight is quantized
    with pytest.raises(RuntimeError, match="boom"), as_loaded(found):
        raise RuntimeError("boom")
    assert model.qkv.weight is quantized and model.experts.w2_weight.dtype == FP8


def loopback_pair(engine, plan):
    """A receiver of `engine` by `plan` and the sender of the plan's wire layout, over loopback."""
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(engine, ss.HostBackend(), loopback.transport(1),
                           ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
                           plan=plan)
    return receiver, ss.Sender(plan.wire, ss.HostBackend(), loopback.transport(0))


def random_wire(seed: int) -> dict:
    """The trainer's bf16 tensors of WIRE, random."""
    gen = torch.Generator().manual_seed(seed)
    return {n: (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16) for n, shape in WIRE}


def test_the_receive_quantizes_as_vllm_does_bit_for_bit():
    model = Model()
    engine, plan, params = receive_plan(model, SPECS, 1024, False, fp8=online_fp8_weights(model))
    # The model's order, each scale right after its weight.
    assert [t.name for t in engine.specs] == [
        "norm", "qkv.weight", "qkv.weight_scale", "experts.w13_weight",
        "experts.w13_weight_scale", "experts.w2_weight", "experts.w2_weight_scale"]
    assert [(q.engine, q.parts) for q in plan.quantized] == [
        ("qkv.weight", 1), ("experts.w13_weight", E), ("experts.w2_weight", E)]
    receiver, sender = loopback_pair(engine, plan)
    try:
        for version in (1, 2):
            wire = random_wire(version)
            wire["experts.2.up_proj.weight"] *= 7  # expert 2's scale stands apart
            handle = sender.publish(version, wire)
            receiver.begin_update(handle.header_bytes)
            receiver.wait_applied(version, DEADLINE_S)
            handle.wait(DEADLINE_S)
            fused = {
                "qkv.weight": (torch.cat([wire[f"{p}_proj.weight"] for p in "qkv"]), 1),
                "experts.w13_weight": (torch.stack([torch.cat(
                    [wire[f"experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")])
                    for e in range(E)]), E),
                "experts.w2_weight": (torch.stack(
                    [wire[f"experts.{e}.down_proj.weight"] for e in range(E)]), E),
            }
            for name, (tensor, parts) in fused.items():
                want, scales = vllm_quantize(tensor, parts)
                got = receiver.live_array(name, np.uint8).reshape(-1)
                np.testing.assert_array_equal(got, want, err_msg=name)
                np.testing.assert_array_equal(
                    receiver.live_array(name + "_scale").view(np.uint32),
                    scales.view(np.uint32), err_msg=name)
            np.testing.assert_array_equal(receiver.live_array("norm", np.int16),
                                          wire["norm"].view(torch.int16).numpy())
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("layers,message", [
    (dict(qkv=QkvLinear(padded_in=H + 16)),
     r"layer 'qkv' \(Fp8PerTensorOnlineLinearMethod\): its weight is torch.float8_e4m3fn, shape "
     r"\[32, 48\], strides \[1, 48\], not the float8 bytes of the loaded \[48, 32\]"),
    (dict(qkv=QkvLinear(scale_parts=3)),
     r"layer 'qkv' .*its scale 'weight_scale' is torch.float32, shape \[3\], not 1 float32"),
    (dict(experts=Experts(backend="FLASHINFER_CUTLASS")),
     r"layer 'experts' \(Fp8PerTensorOnlineMoEMethod\): vLLM's FP8 expert kernel "
     r"FLASHINFER_CUTLASS rearranges the quantized experts"),
])
def test_layouts_vllm_rearranged_are_refused_naming_the_layer(layers, message):
    with pytest.raises(ss.LayoutMismatchError, match=message):
        online_fp8_weights(Model(**layers))


def test_other_online_quantization_and_a_missing_record_are_refused():
    blockwise = Model()
    blockwise.qkv.quant_method = method("Fp8PerBlockOnlineLinearMethod")
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"layer 'qkv' \(Fp8PerBlockOnlineLinearMethod\): this online "
                             r"quantization is not served"):
        online_fp8_weights(blockwise)
    unrecorded = Model()
    del layerwise.LAYERWISE_INFO[unrecorded.experts]
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"layer 'experts' .*keeps no record of the layer's parameters as "
                             r"loaded"):
        online_fp8_weights(unrecorded)


def test_an_fp8_engine_refuses_what_its_swap_cannot_do():
    """init_weight_update_group's checks for an FP8 engine, each named: no specs (the trainer's
    own tensors are needed), a LoRA adapter, the plain live arena, a swap strategy other than
    copy_in (or rebind under graph pairs), tensor parallelism, a weight vLLM holds padded under
    graph pairs. Nothing else passes; copy_in (or none chosen) on one rank does, and graph
    pairs with rebind."""
    from shadowsync.vllm.set_up import check_fp8_engine

    live_arena = types.SimpleNamespace(shadowsync_graph_pairs=False)
    graph_pairs = types.SimpleNamespace(shadowsync_graph_pairs=True)
    padded = online_fp8_weights(Model(qkv=QkvLinear(padded_out=Q + 2 * KV + 16)))
    cases = [
        ((None, None, None, None), r"pass specs \(the trainer's tensors"),
        ((SPECS, 1, None, None), r"lora_adapter=1 with an FP8 engine"),
        ((SPECS, None, None, live_arena),
         r"in a live arena \('shadowsync_live_arena'\): not supported .*'backend': 'shadowsync'"),
        ((SPECS, None, "rebind", None), r"swap_strategy 'rebind' with an FP8 engine"),
        ((SPECS, None, "remap", graph_pairs),
         r"swap_strategy 'remap' with an FP8 engine .*pass 'copy_in' or 'rebind'"),
        ((SPECS, None, None, None, 2), r"tensor_parallel_size 2: not supported yet"),
        ((SPECS, None, None, graph_pairs, 1, padded),
         r"FP8 weight 'qkv.weight' is held padded by vLLM's kernel \(64 rows for the 48 "
         r"loaded; 1 weight\(s\) so\), which graph pairs cannot swap"),
    ]
    for args, message in cases:
        with pytest.raises(ss.InvalidArgumentError, match=message):
            check_fp8_engine(*args)
    check_fp8_engine(SPECS, None, None, None)
    check_fp8_engine(SPECS, None, "copy_in", None, 1)
    check_fp8_engine(SPECS, None, "rebind", graph_pairs, 1, online_fp8_weights(Model()))
    check_fp8_engine(SPECS, None, "copy_in", graph_pairs, 1, padded)


def test_the_default_backend_chooses_graph_pairs_for_an_fp8_engine_it_can_swap(monkeypatch):
    """backend "shadowsync" with quantization="fp8": graph pairs where vLLM's runner can switch
    graph sets and no FP8 weight is held padded; else in place (copy_in), saying why."""
    from shadowsync.vllm import graph_pairs, vllm_worker
    from shadowsync.vllm.weight_transfer_backend import choose_placement

    def config(tp=1, lora=None):
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(enforce_eager=False, quantization="fp8"),
            lora_config=lora, parallel_config=types.SimpleNamespace(
                tensor_parallel_size=tp, pipeline_parallel_size=1))

    cuda = types.SimpleNamespace(type="cuda")
    monkeypatch.setattr(vllm_worker, "runner_loading", lambda model, depth=12: object())
    monkeypatch.setattr(graph_pairs, "why_unswitchable", lambda runner: None)
    placement, why = choose_placement(config(), cuda, Model())
    assert placement == "graph pairs" and "FP8 weights and scales included" in why
    padded = Model(qkv=QkvLinear(padded_out=Q + 2 * KV + 16))
    placement, why = choose_placement(config(), cuda, padded)
    assert placement == "in place", why
    assert "holds 1 FP8 weight(s) padded (first 'qkv.weight')" in why and "copy_in" in why
    placement, why = choose_placement(config(tp=2), cuda, Model())
    assert placement == "in place" and "runs 2 ranks" in why
    placement, why = choose_placement(config(lora=object()), cuda, Model())
    assert placement == "in place" and "serves LoRA adapters" in why
    # quantization="fp8" on a checkpoint already in FP8: nothing quantized while loading.
    placement, why = choose_placement(config(), cuda, nn.Linear(2, 2))
    assert placement == "in place" and "no layer was quantized while loading" in why
    monkeypatch.setattr(graph_pairs, "why_unswitchable", lambda runner: "a reason")
    placement, why = choose_placement(config(), cuda, Model())
    assert placement == "in place" and "graph pairs are not possible here (a reason)" in why


def in_arena(model):
    """`model`'s parameters moved into an arena of host memory as the live arena moves them:
    (arena stand-in with its layout and parameters, its bytes, the transposed flags)."""
    from shadowsync.vllm.live_arena import arena_layout, arena_views

    params = dict(model.named_parameters())
    layout, transposed = arena_layout(params)
    raw = torch.zeros(layout.groups[0].arena_bytes, dtype=torch.uint8)
    with torch.no_grad():
        for param, view in zip(params.values(), arena_views(raw, layout, params.values(),
                                                            transposed)):
            view.copy_(param.data)
            param.data = view
    arena = types.SimpleNamespace(layout=layout, params=list(params.values()),
                                  shadowsync_graph_pairs=True)
    return arena, raw, transposed


def receive_into_arena(engine, plan, arena, raw, wire) -> None:
    """One update of `wire` through `plan`, then its slot's bytes copied into the arena's bytes
    place for place (what a swap to that slot makes the model read). The plan's kept tensors
    are left as they are: the receiver fills them from the live slot, which this stand-in
    receiver does not hold."""
    receiver, sender = loopback_pair(engine, plan)
    try:
        handle = sender.publish(1, wire)
        receiver.begin_update(handle.header_bytes)
        receiver.wait_applied(1, DEADLINE_S)
        handle.wait(DEADLINE_S)
        for t, param in zip(arena.layout.groups[0].tensors, arena.params):
            if t.name in plan.kept:
                continue
            words = {1: np.uint8, 2: np.uint16, 4: np.uint32}[param.element_size()]
            raw[t.offset:t.offset + t.bytes] = torch.from_numpy(
                receiver.live_array(t.name, words).reshape(-1).view(np.uint8).copy())
    finally:
        sender.close()
        receiver.close()


def test_graph_pairs_hold_the_float8_rows_and_scales_where_the_receive_writes_them():
    """Under graph pairs the arena holds every parameter in the model's order, an FP8 weight as
    its row-major float8 bytes (the parameter stays their transpose): the receive plan's engine
    layout is the arena's, place for place, and the set-up's check that it fits passes. A receive
    into that layout quantizes into the float8 rows, which the transposed parameter then reads."""
    from shadowsync.vllm.set_up import check_fits_live_arena

    model = Model()
    arena, raw, transposed = in_arena(model)
    layout = arena.layout
    assert [(t.name, tuple(t.shape)) for t in layout.groups[0].tensors] == [
        ("norm", (H,)), ("qkv.weight", (Q + 2 * KV, H)), ("qkv.weight_scale", (1,)),
        ("experts.w13_weight", (E, 2 * I, H)), ("experts.w2_weight", (E, H, I)),
        ("experts.w13_weight_scale", (E,)), ("experts.w2_weight_scale", (E,))]
    assert transposed == [False, True] + [False] * 5
    assert model.qkv.weight.shape == (H, Q + 2 * KV) and not model.qkv.weight.is_contiguous()

    engine, plan, planned = receive_plan(model, SPECS, 1024, False, live_arena=arena,
                                         fp8=online_fp8_weights(model))
    assert [t.name for t in engine.specs] == [t.name for t in layout.groups[0].tensors]
    check_fits_live_arena(engine.groups, planned, arena)
    assert [t.offset for t in engine.groups[0].tensors] == [
        t.offset for t in layout.groups[0].tensors]

    wire = random_wire(5)
    receive_into_arena(engine, plan, arena, raw, wire)
    want, scales = vllm_quantize(torch.cat([wire[f"{p}_proj.weight"] for p in "qkv"]), 1)
    np.testing.assert_array_equal(model.qkv.weight.view(torch.uint8).t().contiguous()
                                  .reshape(-1).numpy(), want)
    np.testing.assert_array_equal(model.qkv.weight_scale.numpy().view(np.uint32),
                                  scales.view(np.uint32))


def test_an_fp8_weight_the_trainer_does_not_send_is_kept_with_its_scale_under_graph_pairs():
    """allow_partial under graph pairs: a quantized weight no trainer tensor writes is kept
    (its float8 bytes and its scale, copied from the live slot), not quantized, and the receiver
    takes the plan (it refuses a quantized tensor that is also kept); the rest is quantized."""
    from shadowsync.vllm.set_up import check_fits_live_arena

    model = Model()
    with torch.no_grad():
        model.qkv.weight.view(torch.uint8).fill_(0x11)
        model.qkv.weight_scale.fill_(0.25)
    arena, raw, _ = in_arena(model)
    specs = [s for s in SPECS if not s.name.endswith(("q_proj.weight", "k_proj.weight",
                                                      "v_proj.weight"))]
    engine, plan, planned = receive_plan(model, specs, 1024, True, live_arena=arena,
                                         fp8=online_fp8_weights(model))
    assert [q.engine for q in plan.quantized] == ["experts.w13_weight", "experts.w2_weight"]
    assert sorted(plan.kept) == ["qkv.weight", "qkv.weight_scale"]
    check_fits_live_arena(engine.groups, planned, arena)

    wire = {n: t for n, t in random_wire(6).items() if n in {s.name for s in specs}}
    receive_into_arena(engine, plan, arena, raw, wire)
    assert bool((model.qkv.weight.view(torch.uint8) == 0x11).all())
    assert model.qkv.weight_scale.tolist() == [0.25]
    want, scales = vllm_quantize(torch.stack(
        [wire[f"experts.{e}.down_proj.weight"] for e in range(E)]), E)
    np.testing.assert_array_equal(model.experts.w2_weight.view(torch.uint8).reshape(-1).numpy(),
                                  want)
    np.testing.assert_array_equal(model.experts.w2_weight_scale.numpy().view(np.uint32),
                                  scales.view(np.uint32))


def test_the_arena_refuses_a_transposed_parameter_that_is_not_float8():
    """Only float8 weights are held as their rows; any other non-contiguous parameter is refused
    before anything moves, naming it and what to do. A one-element scale with no dimensions is
    held like any tensor."""
    from shadowsync.vllm.live_arena import arena_layout

    turned = nn.Parameter(torch.zeros(4, 8, dtype=torch.bfloat16).t(), requires_grad=False)
    with pytest.raises(ss.InvalidArgumentError,
                       match=r"parameter 'w' \(bf16, shape \[8, 4\], strides \[1, 8\]\) is not a "
                             r"non-empty contiguous tensor, nor the transpose of float8 bytes; "
                             r"start vLLM without a shadowsync weight-transfer backend"):
        arena_layout({"w": turned})
    layout, transposed = arena_layout({"s": nn.Parameter(torch.tensor(0.5), requires_grad=False)})
    assert [(t.name, tuple(t.shape), t.bytes) for t in layout.groups[0].tensors] == [("s", (), 4)]
    assert transposed == [False]


def test_the_kv_cache_methods_scales_pass_and_nothing_else_it_does():
    """quantization="fp8" also gives attention layers vLLM's KV-cache method, whose post-load
    step turns the checkpoint's q/k/v/prob scales into constants (removing those parameters):
    no trained weights, so the post-load check passes them. Anything else such a layer's step
    does to a parameter is still refused, naming it."""
    from shadowsync.vllm.post_load_trace import (RECORD_ATTR, PostLoadChange, PostLoadRecord,
                                                 check_post_load_transforms)

    def engine(*extra):
        model = nn.Module()
        model.attn = nn.Module()
        model.attn.quant_method = types.SimpleNamespace()  # vLLM's layers have one
        scales = [PostLoadChange("attn", "Fp8KVCacheMethod", "parameter", name, "removed it")
                  for name in ("q_scale", "k_scale", "v_scale", "prob_scale")]
        object.__setattr__(model, RECORD_ATTR, PostLoadRecord(changes=list(extra) + scales))
        return model

    assert check_post_load_transforms(engine(), "fp8", "cuda") == {}
    rewritten = PostLoadChange("attn", "Fp8KVCacheMethod", "parameter", "weight",
                               "converted it from torch.bfloat16 to torch.float8_e4m3fn")
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"layer 'attn' \(Fp8KVCacheMethod\): parameter 'weight': converted "
                             r"it from torch.bfloat16 to torch.float8_e4m3fn; parameter 'q_scale'"):
        check_post_load_transforms(engine(rewritten), "fp8", "cuda")
