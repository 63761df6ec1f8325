"""shadowsync.vllm.loader_trace: receive plans derived from a model's own load_weights.

The models here are small torch modules whose loaders have the shapes an engine's loaders have
(fused q/k/v and gate/up parameters written by shard id, a row-sharded weight of tensor-parallel
rank 1 of 2, a vocabulary-sharded embedding tied to the output head, a default loader, biases);
they are written for these tests. Skipped, visibly, where torch is not installed."""

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import shadowsync as ss  # noqa: E402
from shadowsync.receive_plan import PlanCopy  # noqa: E402
from shadowsync.vllm.loader_trace import (STAND_IN_FLAG, LoaderTrace,  # noqa: E402
                                          trace_load_weights)

nn = torch.nn

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 8, 4, 2, 2, 6, 10


def plain_loader(param, loaded):
    """Whole tensor into whole parameter, after checking the sizes (as engines' default does)."""
    assert param.size() == loaded.size(), (param.size(), loaded.size())
    param.data.copy_(loaded)


class Fused(nn.Module):
    """Several HF projections stacked along the output dimension, this rank's rows of each."""

    def __init__(self, shards: dict, inputs: int, bias: bool, rank: int, world: int, dtype):
        super().__init__()
        self.rank, self.world = rank, world
        self.offsets, offset = {}, 0
        for shard, rows in shards.items():
            self.offsets[shard] = (offset, rows // world)
            offset += rows // world
        self.weight = nn.Parameter(torch.empty(offset, inputs, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.load
        if bias:
            self.bias = nn.Parameter(torch.empty(offset, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.load

    def load(self, param, loaded, shard):
        start, rows = self.offsets[shard]
        mine = loaded.narrow(0, self.rank * rows, rows)
        target = param.data.narrow(0, start, rows)
        assert target.shape == mine.shape
        target.copy_(mine)


class RowSharded(nn.Module):
    """This rank's columns of an HF weight (input dimension split across ranks)."""

    def __init__(self, inputs: int, outputs: int, rank: int, world: int, dtype):
        super().__init__()
        self.rank = rank
        self.weight = nn.Parameter(torch.empty(outputs, inputs // world, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param, loaded):
        cols = param.data.shape[1]
        mine = loaded.narrow(1, self.rank * cols, cols)
        assert param.data.shape == mine.shape
        param.data.copy_(mine)


class VocabSharded(nn.Module):
    """This rank's rows of the vocabulary, padded to `padded` rows per rank; the padding is
    zeroed by the loader."""

    def __init__(self, vocab: int, padded: int, hidden: int, rank: int, world: int, dtype):
        super().__init__()
        self.start = rank * (vocab // world)
        self.rows = vocab // world
        self.weight = nn.Parameter(torch.empty(padded // world, hidden, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.load

    def load(self, param, loaded):
        mine = loaded.narrow(0, self.start, self.rows)
        param[: mine.shape[0]].data.copy_(mine)
        param[mine.shape[0]:].data.fill_(0)


class Norm(nn.Module):
    def __init__(self, hidden: int, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, rank, world, dtype):
        super().__init__()
        self.qkv_proj = Fused({"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM,
                               "v": KV_HEADS * HEAD_DIM}, HIDDEN, True, rank, world, dtype)
        self.o_proj = RowSharded(HEADS * HEAD_DIM, HIDDEN, rank, world, dtype)


class Mlp(nn.Module):
    def __init__(self, rank, world, dtype):
        super().__init__()
        self.gate_up_proj = Fused({0: INTER, 1: INTER}, HIDDEN, False, rank, world, dtype)
        self.down_proj = RowSharded(INTER, HIDDEN, rank, world, dtype)


class Layer(nn.Module):
    def __init__(self, rank, world, dtype):
        super().__init__()
        self.self_attn = Attention(rank, world, dtype)
        self.mlp = Mlp(rank, world, dtype)
        self.input_layernorm = Norm(HIDDEN, dtype)


class Head(nn.Module):
    def __init__(self, vocab, hidden, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=dtype), requires_grad=False)


# HF projection -> (engine's fused projection, shard id)
STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
           "v_proj": ("qkv_proj", "v"), "gate_proj": ("gate_up_proj", 0),
           "up_proj": ("gate_up_proj", 1)}


class Engine(nn.Module):
    """An engine's model: fused, sharded (rank of world), vocabulary padded to `padded`, output
    head tied to the embedding when `tied` (then it is one parameter)."""

    def __init__(self, rank=0, world=1, layers=2, padded=VOCAB, tied=True, dtype=torch.float32):
        super().__init__()
        self.tied = tied
        self.embed_tokens = VocabSharded(VOCAB, padded, HIDDEN, rank, world, dtype)
        self.layers = nn.ModuleList(Layer(rank, world, dtype) for _ in range(layers))
        self.norm = Norm(HIDDEN, dtype)
        self.lm_head = self.embed_tokens if tied else Head(VOCAB, HIDDEN, dtype)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        done = set()
        for name, loaded in weights:
            if self.tied and name.startswith("lm_head."):
                continue
            owner, proj, leaf = self._split(name)
            if proj in STACKED:
                fused, shard = STACKED[proj]
                param = params[f"{owner}.{fused}.{leaf}"]
                param.weight_loader(param, loaded, shard)
            else:
                param = params[name]
                getattr(param, "weight_loader", plain_loader)(param, loaded)
            done.add(name)
        return done

    @staticmethod
    def _split(name):
        path, _, leaf = name.rpartition(".")
        owner, _, proj = path.rpartition(".")
        return owner, proj, leaf


def hf_specs(layers=2, tied=True, dtype="fp32"):
    """The trainer's tensors (HF names, unfused, full shapes) in its named_parameters() order."""
    specs = [("embed_tokens.weight", dtype, (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", dtype, (HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.q_proj.bias", dtype, (HEADS * HEAD_DIM,)),
            (p + "self_attn.k_proj.weight", dtype, (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.k_proj.bias", dtype, (KV_HEADS * HEAD_DIM,)),
            (p + "self_attn.v_proj.weight", dtype, (KV_HEADS * HEAD_DIM, HIDDEN)),
            (p + "self_attn.v_proj.bias", dtype, (KV_HEADS * HEAD_DIM,)),
            (p + "self_attn.o_proj.weight", dtype, (HIDDEN, HEADS * HEAD_DIM)),
            (p + "mlp.gate_proj.weight", dtype, (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", dtype, (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", dtype, (HIDDEN, INTER)),
            (p + "input_layernorm.weight", dtype, (HIDDEN,)),
        ]
    specs.append(("norm.weight", dtype, (HIDDEN,)))
    if not tied:
        specs.append(("lm_head.weight", dtype, (VOCAB, HIDDEN)))
    return specs


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def real_sources(specs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen).to(TORCH_DTYPES[dtype])
            for name, dtype, shape in specs}


def randomize(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].view(torch.uint8) if a[n].numel() else a[n],
                           b[n].view(torch.uint8) if b[n].numel() else b[n]), n


def replay(trace: LoaderTrace, sources):
    """The plan's copies in plain torch, element offsets and strides as recorded."""
    for c in trace.copies:
        dst = trace.engine_params[c.engine].data
        src = sources[c.wire]
        dst.view(-1).as_strided(c.shape, c.dst_strides, c.dst_offset).copy_(
            src.view(-1).as_strided(c.shape, c.src_strides, c.src_offset))


def trace_unchanged(model, specs, **kwargs):
    """Traces, checking that the model's parameters come out as they went in."""
    randomize(model)
    before = snapshot(model)
    try:
        return trace_load_weights(model, specs, **kwargs)
    finally:
        assert_same(before, snapshot(model))


# -- plans ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_replayed_plan_equals_the_loader_bit_for_bit(rank, world, dtype):
    specs = hf_specs(dtype=dtype)
    engine = Engine(rank, world, dtype=TORCH_DTYPES[dtype])
    trace = trace_unchanged(engine, specs)
    assert not trace.identity
    assert list(trace.engine_params) == [n for n, _ in engine.named_parameters()]
    assert trace.unwritten_params == []
    assert all(isinstance(c, PlanCopy) for c in trace.copies)

    sources = real_sources(specs)
    reference = Engine(rank, world, dtype=TORCH_DTYPES[dtype])
    reference.load_weights(sources.items())
    randomize(engine, seed=7)  # the plan must write every element
    replay(trace, sources)
    assert_same(snapshot(reference), snapshot(engine))


def test_fused_and_sharded_copies_are_views():
    trace = trace_load_weights(Engine(rank=1, world=2), hf_specs())
    copies = {(c.wire, c.engine): c for c in trace.copies}
    # k rows of rank 1: the second of two kv heads; q is 8 rows, 4 per rank, so k starts at 4
    k = copies[("layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight")]
    assert k == PlanCopy("layers.0.self_attn.k_proj.weight", "layers.0.self_attn.qkv_proj.weight",
                         (2, HIDDEN), 2 * HIDDEN, (HIDDEN, 1), 4 * HIDDEN, (HIDDEN, 1))
    # o_proj of rank 1: columns 4..8 of the full [8, 8] weight into the [8, 4] parameter
    o = copies[("layers.1.self_attn.o_proj.weight", "layers.1.self_attn.o_proj.weight")]
    assert o == PlanCopy("layers.1.self_attn.o_proj.weight", "layers.1.self_attn.o_proj.weight",
                         (HIDDEN, 4), 4, (8, 1), 0, (4, 1))
    up = copies[("layers.0.mlp.up_proj.weight", "layers.0.mlp.gate_up_proj.weight")]
    assert (up.src_offset, up.dst_offset, up.shape) == (3 * HIDDEN, 3 * HIDDEN, (3, HIDDEN))
    bias = copies[("layers.0.self_attn.v_proj.bias", "layers.0.self_attn.qkv_proj.bias")]
    assert (bias.shape, bias.src_offset, bias.dst_offset) == ((2,), 2, 6)


def test_tied_embedding_is_one_parameter_and_an_untied_head_its_own():
    tied = trace_load_weights(Engine(), hf_specs(tied=True))
    assert "lm_head.weight" not in tied.engine_params
    untied = trace_load_weights(Engine(tied=False), hf_specs(tied=False))
    assert untied.engine_params["lm_head.weight"] is not untied.engine_params[
        "embed_tokens.weight"]
    # a tied engine given the trainer's untied head takes nothing from it
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"1 wire tensor\(s\) the loader copies nowhere: 'lm_head.weight'"):
        trace_load_weights(Engine(tied=True), hf_specs(tied=False))


class Plain(nn.Module):
    """An engine whose parameters are the trainer's tensors."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, loaded in weights:
            plain_loader(params[name], loaded)


PLAIN_SPECS = [("a.weight", "fp32", (3, 4)), ("a.bias", "fp32", (3,)), ("b.weight", "fp32", (2, 3))]


def test_identity_when_the_engine_keeps_the_trainer_layout():
    model = Plain()
    trace = trace_unchanged(model, PLAIN_SPECS)
    assert trace.identity
    assert [(c.wire, c.engine) for c in trace.copies] == [(n, n) for n, _, _ in PLAIN_SPECS]
    assert list(trace.engine_params) == ["a.weight", "a.bias", "b.weight"]
    # a loader that transposes on the way is no identity even where the names match
    square = nn.Module()
    square.w = nn.Parameter(torch.zeros(3, 3))
    trace = trace_load_weights(square, [("w", "fp32", (3, 3))],
                               load_weights=lambda ws: [square.w.data.copy_(t.t()) for _, t in ws])
    assert not trace.identity and trace.copies[0].src_strides == (1, 3)


def test_identity_when_a_loader_copies_a_tensor_in_pieces_to_its_own_positions():
    model = one_param_model(shape=(6, 4))

    def pieces(weights):  # as for q, k, v fused on disk: three row ranges, each in place
        for _, t in weights:
            for start, rows in ((0, 2), (2, 3), (5, 1)):
                model.w.data.narrow(0, start, rows).copy_(t.narrow(0, start, rows))

    trace = trace_load_weights(model, [("w", "fp32", (6, 4))], load_weights=pieces)
    assert trace.identity and len(trace.copies) == 3
    renamed = trace_load_weights(model, [("w.hf", "fp32", (6, 4))], load_weights=pieces)
    assert not renamed.identity


def as_loaded_stand_in(param):
    """What shadowsync.vllm.online_fp8.as_loaded puts in place of a weight vLLM quantized while
    loading: a meta parameter of the as-loaded shape and dtype, with its loader, marked."""
    stand = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                         requires_grad=False)
    stand.weight_loader = param.weight_loader
    setattr(stand, STAND_IN_FLAG, True)
    return stand


def test_copies_into_an_as_loaded_stand_in_are_those_into_the_parameter():
    """A fused weight quantized after loading is traced through a meta stand-in of the
    parameter the loader wrote: the copies are the ones the real parameter would get."""
    real = trace_load_weights(Engine(rank=1, world=2), hf_specs())
    model = Engine(rank=1, world=2)
    for layer in model.layers:
        for fused in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            fused._parameters["weight"] = as_loaded_stand_in(fused.weight)
    traced = trace_load_weights(model, hf_specs())
    assert traced.copies == real.copies
    assert traced.engine_params["layers.1.mlp.gate_up_proj.weight"].device.type == "meta"
    # Two stand-ins never alias: each is its own storage.
    assert len({c.engine for c in traced.copies if "qkv_proj.weight" in c.engine}) == 2
    # A meta parameter that is no stand-in is still refused: it holds no weights.
    unmarked = Engine()
    unmarked.layers[0].mlp.gate_up_proj._parameters["weight"] = nn.Parameter(
        torch.empty(2 * INTER, HIDDEN, device="meta"), requires_grad=False)
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"'layers.0.mlp.gate_up_proj.weight' is on the meta device"):
        trace_load_weights(unmarked, hf_specs())


def test_a_partial_update_lists_the_parameters_it_leaves():
    model = Plain()
    trace = trace_load_weights(model, PLAIN_SPECS[:1])
    assert trace.unwritten_params == ["a.bias", "b.weight"]
    assert list(trace.engine_params) == ["a.weight"]


def test_loader_keeps_working_on_metadata():
    seen = {}
    model = Plain()

    def loader(weights):
        params = dict(model.named_parameters())
        for name, t in weights:
            seen[name] = (t.is_meta, t.numel(), t.dim(), tuple(t.size()), tuple(t.shape), t.ndim)
            plain_loader(params[name], t)

    trace_load_weights(model, PLAIN_SPECS, load_weights=loader)
    assert seen["a.weight"] == (True, 12, 2, (3, 4), (3, 4), 2)


# -- refusals: computing on a wire tensor ---------------------------------------------------------

def one_param_model(shape=(4, 6), dtype=torch.float32):
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    return model


def refused(model, specs, loader, match):
    randomize(model)
    before = snapshot(model)
    with pytest.raises(ss.LayoutMismatchError, match=match):
        trace_load_weights(model, specs, load_weights=loader)
    assert_same(before, snapshot(model))


def each(fn):
    return lambda weights: [fn(name, t) for name, t in weights]


@pytest.mark.parametrize("make,op", [
    (lambda t: t.to(torch.float32), "aten::_to_copy"),
    (lambda t: t.float() * 2, "aten::_to_copy"),
    (lambda t: torch.cat([t[:2], t[2:]]), "aten::cat"),
    (lambda t: t.to(torch.float32) + 1, "aten::_to_copy"),
    (lambda t: t.clone(), "aten::clone"),
    (lambda t: t.t().contiguous().t(), "aten::clone"),
])
def test_computing_on_a_wire_tensor_is_refused_naming_both(make, op):
    model = one_param_model()
    specs = [("w.hf", "bf16", (4, 6))]
    refused(model, specs, each(lambda n, t: model.w.data.copy_(make(t))),
            rf"the loader computes \({op}\) on 'w.hf' for parameter 'w': a receive plan can only "
            rf"copy")


def test_arithmetic_on_a_wire_tensor_is_refused():
    model = one_param_model()
    refused(model, [("w.hf", "fp32", (4, 6))], each(lambda n, t: model.w.data.copy_(t * 2)),
            r"computes \(aten::mul.*\) on 'w.hf' for parameter 'w'")


def test_reading_a_value_is_refused():
    model = one_param_model(shape=(1,))
    refused(model, [("s", "fp32", (1,))],
            each(lambda n, t: model.w.data.fill_(t.item())),
            r"computes \(aten::_local_scalar_dense\) on 's' \(it reads an element's value")


def test_a_computation_that_reaches_no_parameter_is_refused():
    model = Plain()

    def loader(weights):
        params = dict(model.named_parameters())
        for name, t in weights:
            _ = t.abs()
            plain_loader(params[name], t)

    refused(model, PLAIN_SPECS, loader,
            r"computes \(aten::abs\) on 'a.weight' \(its result reaches no parameter\)")


def test_dtype_conversion_by_copy_names_both_dtypes():
    model = one_param_model()
    refused(model, [("w.hf", "bf16", (4, 6))], each(lambda n, t: model.w.data.copy_(t)),
            r"copies wire tensor 'w.hf' \(torch.bfloat16\) into parameter 'w' \(torch.float32\)")


def test_reinterpreting_a_wire_tensor_is_refused():
    model = one_param_model(shape=(4, 3))
    refused(model, [("w.hf", "bf16", (4, 6))],
            each(lambda n, t: model.w.data.copy_(t.view(torch.float32))),
            r"reinterprets wire tensor 'w.hf' \(torch.bfloat16\) as torch.float32")


@pytest.mark.parametrize("make", [lambda t: t[:1], lambda t: t[:1].expand(4, 6)])
def test_broadcasting_copies_are_refused(make):
    model = one_param_model()
    refused(model, [("w.hf", "fp32", (4, 6))], each(lambda n, t: model.w.data.copy_(make(t))),
            r"(broadcasts|broadcast \(expanded, stride 0\)).*wire tensor 'w.hf'.*parameter 'w'|"
            r"wire tensor 'w.hf'.*parameter 'w'.*broadcasts")


def test_modifying_a_wire_tensor_is_refused():
    model = one_param_model()

    def loader(weights):
        for _, t in weights:
            t.mul_(2)
            model.w.data.copy_(t)

    refused(model, [("w.hf", "fp32", (4, 6))], loader,
            r"modifies wire tensor 'w.hf' in place \(aten::mul_")


def test_copying_into_a_temporary_or_a_buffer_is_refused():
    model = one_param_model()
    model.register_buffer("scale", torch.ones(4, 6))

    def temporary(weights):
        for _, t in weights:
            tmp = torch.empty(4, 6)
            tmp.copy_(t)
            model.w.data.copy_(tmp)

    refused(model, [("w.hf", "fp32", (4, 6))], temporary,
            r"copies wire tensor 'w.hf' into a tensor of shape \[4, 6\].*no parameter")
    refused(model, [("w.hf", "fp32", (4, 6))], each(lambda n, t: model.scale.copy_(t)),
            r"copies wire tensor 'w.hf' into buffer 'scale', not a parameter")


# -- refusals: writing a parameter otherwise ------------------------------------------------------

@pytest.mark.parametrize("write,op", [
    (lambda p, t: p.data.fill_(1.5), "aten::fill_"),
    (lambda p, t: p.data[1:].zero_(), "aten::zero_"),
    (lambda p, t: p.data.copy_(torch.ones(4, 6)), "aten::copy_"),
    (lambda p, t: p.data.add_(1), "aten::add_"),
])
def test_other_writes_to_a_parameter_are_refused_before_they_run(write, op):
    model = one_param_model()

    def loader(weights):
        for _, t in weights:
            model.w.data.copy_(t)
            write(model.w, t)

    refused(model, [("w.hf", "fp32", (4, 6))], loader,
            rf"writes \d+ elements of parameter 'w' with {op}")


def test_computing_into_a_parameter_names_the_wire_tensor():
    model = one_param_model()
    refused(model, [("w.hf", "fp32", (4, 6))], each(lambda n, t: model.w.data.add_(t)),
            r"computes \(aten::add_.*\) on 'w.hf' for parameter 'w'")


def test_padding_that_no_wire_tensor_covers_is_refused_and_empty_padding_is_not():
    # 10 rows padded to 12 per rank: the loader zeroes 2 rows
    engine = Engine(padded=12)
    randomize(engine)
    before = snapshot(engine)
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"writes 16 elements of parameter 'embed_tokens.weight' with "
                             r"aten::fill_.*padding"):
        trace_load_weights(engine, hf_specs())
    assert_same(before, snapshot(engine))
    trace_load_weights(Engine(padded=VOCAB), hf_specs())  # fill_ of zero rows: nothing written


def test_a_loader_that_rebinds_param_data_is_refused_and_undone():
    model = one_param_model()
    original = model.w.data

    def loader(weights):
        for _, t in weights:
            model.w.data = torch.zeros(4, 6)  # a new tensor instead of a copy of t

    refused(model, [("w.hf", "fp32", (4, 6))], loader,
            r"replaced the data of parameter\(s\) 'w' \(param.data = ...\)")
    assert model.w.data.data_ptr() == original.data_ptr() and not model.w.is_meta


def test_a_refusal_the_loader_swallows_still_refuses():
    model = one_param_model()

    def loader(weights):
        for _, t in weights:
            try:
                model.w.data.copy_(t.to(torch.float32))
            except Exception:  # noqa: BLE001
                pass
            model.w.data.copy_(torch.zeros(4, 6, dtype=torch.bfloat16).float())

    refused(model, [("w.hf", "bf16", (4, 6))], loader, r"computes \(aten::_to_copy\) on 'w.hf'")


def test_the_loaders_own_errors_name_the_wire_tensor():
    refused(Engine(), hf_specs() + [("layers.0.extra.weight", "fp32", (2, 2))], None,
            r"raised KeyError \(the last wire tensor it took: 'layers.0.extra.weight'\)")
    refused(Engine(), [("norm.weight", "fp32", (HIDDEN + 1,))], None,
            r"raised AssertionError \(the last wire tensor it took: 'norm.weight'\)")


# -- refusals: parameters that are not the weights ------------------------------------------------

def test_empty_parameters_are_refused_before_tracing_all_named():
    model = Plain()
    model.a.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    model.b.weight = nn.Parameter(torch.empty(0), requires_grad=False)
    called = []
    with pytest.raises(ss.LayoutMismatchError,
                       match=r"parameter 'a.weight' is empty \(shape \[0\]\); parameter 'b.weight' "
                             r"is empty \(shape \[0\]\): the engine prepacked or quantized.*"
                             r"turn off the engine's weight prepacking"):
        trace_load_weights(model, PLAIN_SPECS, load_weights=lambda ws: called.append(1))
    assert called == []


# -- coverage -------------------------------------------------------------------------------------

def test_a_parameter_written_in_part_or_twice_is_refused_with_counts():
    model = one_param_model()
    refused(model, [("w.hf", "fp32", (4, 6))],
            each(lambda n, t: model.w.data[:3].copy_(t[:3])),
            r"'w' \(6 of 24 elements not written\)")
    refused(model, [("a", "fp32", (4, 6)), ("b", "fp32", (4, 6))],
            each(lambda n, t: model.w.data[1:].copy_(t[1:]) if n == "a" else
                 model.w.data[:2].copy_(t[:2])),
            r"'w' \(6 elements written more than once\)")


def test_wire_tensors_the_loader_ignores_are_all_listed():
    model = Plain()
    extra = [(f"rotary.{i}", "fp32", (2,)) for i in range(25)]

    def loader(weights):
        params = dict(model.named_parameters())
        for name, t in weights:
            if name in params:
                plain_loader(params[name], t)

    with pytest.raises(ss.LayoutMismatchError,
                       match=r"25 wire tensor\(s\) the loader copies nowhere: 'rotary.0', "
                             r"'rotary.1',.* and 5 more"):
        trace_load_weights(model, PLAIN_SPECS + extra, load_weights=loader)


def test_copies_outside_a_parameter_are_refused():
    model = one_param_model()
    big = torch.zeros(8, 6)
    model.w = nn.Parameter(big[:4], requires_grad=False)  # the storage goes on past the parameter
    refused(model, [("w.hf", "fp32", (4, 6))], each(lambda n, t: big[2:6].copy_(t)),
            r"lies outside each of them")


def test_bad_arguments():
    with pytest.raises(ss.InvalidArgumentError, match=r"'a.weight' is listed twice"):
        trace_load_weights(Plain(), PLAIN_SPECS + PLAIN_SPECS[:1])
    with pytest.raises(ss.InvalidArgumentError, match=r"no load_weights"):
        trace_load_weights(nn.Linear(2, 2), [])


def test_importing_the_vllm_package_imports_no_torch():
    python_dir = Path(__file__).resolve().parent.parent
    code = ("import sys; sys.path.insert(0, %r); import shadowsync.vllm, "
            "shadowsync.vllm.loader_trace; assert 'torch' not in sys.modules, 'torch'; "
            "assert 'vllm' not in sys.modules, 'vllm'" % str(python_dir))
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- vLLM's own loaders ---------------------------------------------------------------------------

def vllm_children(tmp_path, world, archs):
    """Runs vllm_trace_child.py as ranks 0..world-1 at once; returns {(arch, rank): findings}."""
    import importlib.util
    import json
    import socket

    for module in ("vllm", "transformers", "vllm_models"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not importable")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = Path(__file__).resolve().parent / "vllm_trace_child.py"
    procs = [subprocess.Popen([sys.executable, str(child), str(tmp_path), str(port), str(rank),
                               str(world), *archs],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    found, errors = {}, []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=540)
            if proc.returncode != 0:
                errors.append(err[-4000:])
            for line in out.splitlines():
                if line.startswith("{"):
                    r = json.loads(line)
                    found[(r["arch"], r["rank"])] = r
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not errors, errors
    assert sorted(found) == sorted((a, r) for a in archs for r in range(world))
    for r in found.values():
        assert r["unchanged"] and r["mismatched"] == [] and r["unwritten"] == [], r
        assert r["written"] == r["params"], r
        fused_attention = "c_attn.weight" if r["arch"] == "gpt2" else "qkv_proj.weight"
        assert "is empty (shape [0])" in r["prepacked"] and fused_attention in r["prepacked"], r
        assert "(torch.float32) into parameter" in r["converting"], r
        assert "(torch.bfloat16) with aten::copy_" in r["converting"], r
    return found


def test_vllm_loaders_trace_to_plans_that_replay_bit_for_bit(tmp_path):
    """vLLM's load_weights of tiny llama / qwen2 (tied, biases) / qwen3 / phi3 (fused on disk) /
    gpt2 (Hugging Face's Conv1D weights, [in, out], which vLLM's loader transposes into its
    [out, in] layers) checkpoints, in a child process (vLLM's parallel state is process-global):
    each plan replayed equals vLLM's loader on the real tensors; after
    process_weights_after_loading (CPU prepacking) tracing is refused, as is an engine in bf16
    given fp32 tensors."""
    found = vllm_children(tmp_path, 1, ["llama", "qwen2", "qwen3", "phi3", "gpt2"])
    qwen2, llama, phi3 = found[("qwen2", 0)], found[("llama", 0)], found[("phi3", 0)]
    # GPT-2's fused attention weight: the wire's [128, 384] (in, out) lands in the engine's
    # [384, 128] through transposing copies (replayed above: equal to vLLM's loader).
    c_attn = "transformer.h.0.attn.c_attn.weight"
    shapes = [shape for w, e, shape, _, _ in found[("gpt2", 0)]["plan"] if w == e == c_attn]
    assert shapes and sum(rows * cols for rows, cols in shapes) == 384 * 128, shapes
    assert qwen2["wires"] == qwen2["copies"]  # tied: no lm_head on the wire
    assert "model.layers.0.self_attn.qkv_proj.bias" in qwen2["fused"]
    assert "model.layers.0.mlp.gate_up_proj.weight" in llama["fused"]
    # phi3 sends qkv_proj and gate_up_proj fused; vLLM copies them in pieces to their own places
    assert phi3["copies"] > phi3["wires"] and phi3["identity"]


def test_vllm_tensor_parallel_ranks_trace_their_own_shards(tmp_path):
    """Two ranks of tensor parallelism (gloo): each traces its shard of qwen2 and its plan replays
    as its loader loads; rank 1 takes the second half of the rows (qkv, embedding) or columns
    (o_proj) of the wire tensors."""
    found = vllm_children(tmp_path, 2, ["qwen2"])
    plans = [{(w, e): (shape, src, dst) for w, e, shape, src, dst in found[("qwen2", r)]["plan"]}
             for r in (0, 1)]
    layer = "model.layers.0.self_attn."
    k = (layer + "k_proj.weight", layer + "qkv_proj.weight")
    o = (layer + "o_proj.weight", layer + "o_proj.weight")
    embed = ("model.embed_tokens.weight", "model.embed_tokens.weight")
    assert plans[0][k] == ([32, 128], 0, 64 * 128)
    assert plans[1][k] == ([32, 128], 32 * 128, 64 * 128)
    assert plans[0][o] == ([128, 64], 0, 0) and plans[1][o] == ([128, 64], 64, 0)
    assert plans[0][embed] == ([160, 128], 0, 0) and plans[1][embed] == ([160, 128], 160 * 128, 0)


def test_a_plan_for_the_live_arena_keeps_what_the_trainer_does_not_send():
    """With the live arena (swapped whole by remap) and allow_partial, the engine layout is every
    parameter in the model's order, as the arena's, and the ones no trainer tensor writes are the
    plan's kept tensors; without it they stay out of the layout. Then a receiver (host backend,
    rebind: both slots take updates in turn) takes the plan through the C API and two updates:
    the kept norm reads as the engine had it after each swap, the rest as the loader would."""
    from types import SimpleNamespace

    from shadowsync.layout import TensorSpec
    from shadowsync.vllm.receive_planning import receive_plan

    engine = Engine()
    randomize(engine)
    specs = [TensorSpec.coerce(s) for s in hf_specs() if s[0] != "norm.weight"]
    arena = SimpleNamespace(params=list(engine.parameters()))
    layout, plan, params = receive_plan(engine, specs, 0, True, live_arena=arena)
    names = [n for n, _ in engine.named_parameters()]
    assert [t.name for t in layout.groups[0].tensors] == names
    assert plan.kept == ["norm.weight"]
    assert [params[n] for n in names] == arena.params
    alone, alone_plan, _ = receive_plan(engine, specs, 0, True)
    assert "norm.weight" not in [t.name for t in alone.groups[0].tensors]
    assert alone_plan.kept == []

    backend = ss.HostBackend()
    loopback = ss.Loopback(2)
    sender = ss.Sender(plan.wire, backend, loopback.transport(0))
    receiver = ss.Receiver(layout, backend, loopback.transport(1), plan=plan)
    norm = engine.norm.weight.detach().clone()
    for t in layout.groups[0].tensors:  # the engine's weights in the live slot (adopted)
        receiver.live_array(t.name)[...] = params[t.name].detach().numpy()
    for version in (1, 2):
        sources = real_sources([(s.name, "fp32", s.shape) for s in specs], seed=version)
        handle = sender.publish(version, {n: t.numpy() for n, t in sources.items()})
        receiver.begin_update(handle.header_bytes)
        handle.wait(30)
        receiver.wait_applied(version, 30)
        reference = Engine()
        reference.load_weights(sources.items())
        for name, p in reference.named_parameters():
            want = norm if name == "norm.weight" else p.detach()
            assert torch.equal(torch.from_numpy(receiver.live_array(name).copy()), want), name
    receiver.close()
    sender.close()


def test_the_engines_own_tensors_in_another_order_than_the_live_arena_get_a_plan():
    """A trainer that sends the engine's own tensors receives in place (no plan) unless a live
    arena is swapped whole and the tensors are not laid out as it is (Phi-3's Hugging Face order
    puts o_proj before qkv_proj): then the set-up derives a plan that copies each into the
    arena's place (vLLM's loader takes fused tensors whole: test_vllm_loaders_trace_to_plans_that_replay_bit_for_bit)."""
    from types import SimpleNamespace

    from shadowsync.layout import Layout, TensorSpec
    from shadowsync.tensors import describe
    from shadowsync.vllm.receive_planning import receives_in_place

    engine = Engine()
    own = [TensorSpec(n, "fp32", tuple(p.shape)) for n, p in engine.named_parameters()]
    descs = {n: describe(n, p.detach()) for n, p in engine.named_parameters()}
    arena = SimpleNamespace(layout=Layout(own), params=list(engine.parameters()))
    shuffled = own[1:] + own[:1]
    assert receives_in_place(own, descs, arena)
    assert receives_in_place(shuffled, descs)  # no arena: any order is the engine's layout
    assert not receives_in_place(shuffled, descs, arena)
    assert not receives_in_place(own[:-1], descs, arena)  # the arena is swapped whole
    assert not receives_in_place([TensorSpec(own[0].name, "bf16", own[0].shape)] + own[1:],
                                 descs, arena)
    assert not receives_in_place([TensorSpec("not_a_param", "fp32", (4,))], descs)
    # A parameter's name with another shape (GPT-2's Conv1D weights, [in, out]) goes through the
    # loader's plan, which transposes it.
    matrix = next(s for s in own if len(s.shape) == 2 and s.shape[0] != s.shape[1])
    transposed = TensorSpec(matrix.name, "fp32", tuple(reversed(matrix.shape)))
    assert not receives_in_place([transposed if s is matrix else s for s in own], descs)
