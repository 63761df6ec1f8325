"""shadowsync.vllm.lora_plan: the receive plan of a LoRA adapter, learned by probing each LoRA
layer's own set_lora with element indices.

The layers here are small torch stand-ins written for these tests, with the shapes of vLLM's
LoRA layers (stacked buffers [slots, 1, rank, in] and [slots, 1, out, rank]) and the slicing
their set_lora does under tensor parallelism: a fused q/k/v layer that keeps this rank's rows of
each B (three slices), a merged gate/up layer (two slices), a row-parallel layer that keeps this
rank's columns of A. The embedding and lm_head layers are vLLM's own classes
(VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA: one stacked tensor each, the
embedding's lora_A stored transposed), over stand-in base layers. The oracle: the plan, replayed
on real tensors, fills the adapter's slot exactly as the layer's own set_lora does with the same
tensors, bit for bit. Real vLLM with a LoRA adapter: test_vllm_real.py. Skipped, visibly, where
torch (vllm, for vLLM's classes) is not installed."""

import re

import pytest

torch = pytest.importorskip("torch")

import shadowsync as ss  # noqa: E402
from shadowsync.vllm.lora_plan import lora_receive_plan, scaled_lora_b  # noqa: E402

HIDDEN, Q_ROWS, KV_ROWS, INTER, RANK, SLOTS = 8, 8, 4, 6, 2, 3


class StackedLayer:
    """What the plan sees of a vLLM LoRA layer: its stacked buffers and its set_lora."""

    def __init__(self, a_shapes, b_shapes, rank, world):
        self.tp_rank, self.tp_size = rank, world
        self.lora_a_stacked = tuple(torch.zeros(SLOTS, 1, RANK, c) for c in a_shapes)
        self.lora_b_stacked = tuple(torch.zeros(SLOTS, 1, r, RANK) for r in b_shapes)

    def place(self, index, slices_a, slices_b):
        for s, (a, b) in enumerate(zip(slices_a, slices_b)):
            self.lora_a_stacked[s][index] = 0
            self.lora_b_stacked[s][index] = 0
            if a is not None:
                self.lora_a_stacked[s][index, 0, :a.shape[0], :a.shape[1]].copy_(a)
                self.lora_b_stacked[s][index, 0, :b.shape[0], :b.shape[1]].copy_(b)


class FusedColumnLayer(StackedLayer):
    """q/k/v (or gate/up) fused, column-parallel: each slice keeps this rank's rows of its B."""

    def __init__(self, rows, rank, world):
        super().__init__([HIDDEN] * len(rows), [r // world for r in rows], rank, world)
        self.rows = rows

    def set_lora(self, index, lora_a, lora_b):
        sliced = [b[self.tp_rank * (r // self.tp_size):(self.tp_rank + 1) * (r // self.tp_size)]
                  if b is not None else None for b, r in zip(lora_b, self.rows)]
        self.place(index, lora_a, sliced)


class RowParallelLayer(StackedLayer):
    """o/down: row-parallel, keeps this rank's input columns of A; one slice."""

    def __init__(self, inputs, outputs, rank, world):
        super().__init__([inputs // world], [outputs], rank, world)
        self.inputs = inputs

    def set_lora(self, index, lora_a, lora_b):
        shard = self.inputs // self.tp_size
        self.place(index, [lora_a[:, self.tp_rank * shard:(self.tp_rank + 1) * shard]], [lora_b])


class Manager:
    """What the plan reads of vLLM's WorkerLoRAManager and its LoRAModelManager."""

    def __init__(self, rank, world, slot_ids=(None, 7, None)):
        self._adapter_manager = self
        self.lora_index_to_id = list(slot_ids)
        attn, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
        self.packed_modules = {f"{attn}.qkv_proj": [f"{attn}.q_proj", f"{attn}.k_proj",
                                                    f"{attn}.v_proj"],
                               f"{mlp}.gate_up_proj": [f"{mlp}.gate_proj", f"{mlp}.up_proj"]}
        self.modules = {
            f"{attn}.qkv_proj": FusedColumnLayer([Q_ROWS, KV_ROWS, KV_ROWS], rank, world),
            f"{attn}.o_proj": RowParallelLayer(Q_ROWS, HIDDEN, rank, world),
            f"{mlp}.gate_up_proj": FusedColumnLayer([INTER, INTER], rank, world),
            f"{mlp}.down_proj": RowParallelLayer(INTER, HIDDEN, rank, world),
        }


SHAPES = {"self_attn.q_proj": (Q_ROWS, HIDDEN), "self_attn.k_proj": (KV_ROWS, HIDDEN),
          "self_attn.v_proj": (KV_ROWS, HIDDEN), "self_attn.o_proj": (HIDDEN, Q_ROWS),
          "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
          "mlp.down_proj": (HIDDEN, INTER)}


def adapter(seed, modules=SHAPES):
    """PEFT tensors of one adapter: lora_A [r, in] and lora_B [out, r] per module."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out, inp) in modules.items():
        prefix = f"base_model.model.model.layers.0.{module}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, inp, generator=generator)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, RANK, generator=generator)
    return tensors


def specs_of(tensors):
    return [ss.TensorSpec(n, "fp32", tuple(t.shape), "lora") for n, t in tensors.items()]


def replay(plan, tensors):
    """Each engine tensor as the plan's copies fill it from `tensors` (zeros elsewhere)."""
    out = {name: torch.zeros_like(live) for name, live in plan.engine_tensors.items()}
    for c in plan.copies:
        src = tensors[c.wire].reshape(-1).as_strided(c.shape, c.src_strides, c.src_offset)
        out[c.engine].reshape(-1).as_strided(c.shape, c.dst_strides, c.dst_offset).copy_(src)
    return out


def by_set_lora(manager, index, tensors):
    """What vLLM's own path puts in the slot: each layer's set_lora with the real tensors."""
    layers = {}
    for name, layer in manager.modules.items():
        parts = manager.packed_modules.get(name, [name])
        a = [tensors.get(f"base_model.model.{p}.lora_A.weight") for p in parts]
        b = [tensors.get(f"base_model.model.{p}.lora_B.weight") for p in parts]
        if all(x is None for x in a):
            continue
        layer.set_lora(index, a, b) if len(parts) > 1 else layer.set_lora(index, a[0], b[0])
        layers[name] = layer
    return {f"{name}.lora_{which}.{s}": stacked[s][index, 0]
            for name, layer in layers.items()
            for which, stacked in (("a", layer.lora_a_stacked), ("b", layer.lora_b_stacked))
            for s in range(len(stacked)) if bool(stacked[s][index, 0].any())}


@pytest.mark.parametrize("rank,world", [(0, 1), (0, 2), (1, 2)])
def test_replayed_plan_fills_the_slot_as_set_lora_does_bit_for_bit(rank, world):
    tensors = adapter(seed=rank + 10 * world)
    plan = lora_receive_plan(Manager(rank, world), 7, specs_of(tensors))
    expected = by_set_lora(Manager(rank, world), 1, tensors)
    got = replay(plan, tensors)
    assert sorted(got) == sorted(expected)  # q, k, v, gate, up, o, down: A and B blocks each
    assert len(got) == 2 * 7
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # The live storage is the slot itself (slot 1 holds adapter 7), never a copy of it.
    manager = Manager(rank, world)
    plan = lora_receive_plan(manager, 7, specs_of(tensors))
    qkv = manager.modules["model.layers.0.self_attn.qkv_proj"]
    live = plan.engine_tensors["model.layers.0.self_attn.qkv_proj.lora_b.1"]
    assert live.data_ptr() == qkv.lora_b_stacked[1][1, 0].data_ptr()


def test_projections_the_adapter_leaves_out_are_not_written():
    tensors = adapter(seed=1, modules={k: v for k, v in SHAPES.items() if k != "self_attn.k_proj"})
    plan = lora_receive_plan(Manager(0, 1), 7, specs_of(tensors))
    assert not [c for c in plan.copies if c.engine.endswith("qkv_proj.lora_a.1")]
    assert len(plan.copies) == 2 * 6


def test_scaled_lora_b_scales_only_b():
    tensors = adapter(seed=2) | embedding_adapter(seed=2)
    scaled = scaled_lora_b(tensors, 2.0)
    for name, t in tensors.items():
        is_b = ".lora_B." in name or name.endswith(".lora_embedding_B")
        assert torch.equal(scaled[name], t * 2.0 if is_b else t), name
    assert sum(not torch.equal(scaled[n], t) for n, t in tensors.items()) == 7 + 2


@pytest.mark.parametrize("change,message", [
    (lambda t: t | {"base_model.model.model.layers.0.mlp.fc9.lora_A.weight": torch.zeros(2, 8),
                    "base_model.model.model.layers.0.mlp.fc9.lora_B.weight": torch.zeros(8, 2)},
     "module 'model.layers.0.mlp.fc9' has no LoRA layer in vLLM"),
    (lambda t: {n: v for n, v in t.items() if "o_proj.lora_B" not in n},
     "tensor 'base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight' comes without its "
     "lora_B"),
    (lambda t: t | {"model.layers.0.mlp.up_proj.weight": torch.zeros(6, 8)},
     "tensor 'model.layers.0.mlp.up_proj.weight' is not a LoRA tensor"),
    (lambda t: {n: (v[:1] if ".lora_A." in n else v[:, :1]) for n, v in t.items()},
     "vLLM's max_lora_rank must equal the adapter's rank"),
    # A rank above max_lora_rank: vLLM's own set_lora refuses the shapes; named, not a raw error.
    (lambda t: {n: (torch.cat([v, v]) if ".lora_A." in n else torch.cat([v, v], 1))
                for n, v in t.items()},
     "vLLM's LoRA layer 'model.layers.0.self_attn.qkv_proj' does not take the trainer's tensors"),
    # Two names for one slot (with and without PEFT's prefix): one would be lost.
    (lambda t: t | {"model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(RANK, HIDDEN)},
     "tensors 'base_model.model.model.layers.0.mlp.up_proj.lora_A.weight' and "
     "'model.layers.0.mlp.up_proj.lora_A.weight' both go to lora_A of slice 1"),
])
def test_bad_adapters_are_refused_naming_the_tensor(change, message):
    tensors = change(adapter(seed=3))
    with pytest.raises(ss.LayoutMismatchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        lora_receive_plan(Manager(0, 1), 7, specs_of(tensors))


def test_an_adapter_vllm_does_not_hold_is_refused_naming_what_it_holds():
    with pytest.raises(ss.InvalidArgumentError, match=r"lora_adapter=3: vLLM holds no LoRA adapter "
                                                      r"with that lora_int_id in its slots \(they "
                                                      r"hold \[None, 7, None\]\)"):
        lora_receive_plan(Manager(0, 1), 3, specs_of(adapter(seed=4)))


def test_a_dtype_other_than_the_slots_is_refused_naming_both():
    specs = [ss.TensorSpec(s.name, "bf16", s.shape, s.group) for s in specs_of(adapter(seed=5))]
    with pytest.raises(ss.LayoutMismatchError, match="dtype bf16 of the trainer's layout does not "
                                                     "match fp32 of vLLM's LoRA slot"):
        lora_receive_plan(Manager(0, 1), 7, specs)


def test_a_tensor_set_lora_puts_nowhere_is_refused_not_dropped():
    manager = Manager(0, 1)
    manager.modules["model.layers.0.self_attn.o_proj"].set_lora = lambda *args: None
    with pytest.raises(ss.LayoutMismatchError, match=r"2 of the trainer's LoRA tensors land "
                                                     r"nowhere in vLLM's slots \(e.g. "
                                                     r"'base_model.model.model.layers.0.self_attn."
                                                     r"o_proj.lora_A.weight'\)"):
        lora_receive_plan(manager, 7, specs_of(adapter(seed=6)))


@pytest.mark.parametrize("form", ["mixed", "missing"])
def test_a_lora_layer_whose_slots_are_in_another_form_is_refused_naming_it(form):
    manager = Manager(0, 1)
    layer = manager.modules["model.layers.0.self_attn.o_proj"]
    if form == "mixed":
        layer.lora_a_stacked = layer.lora_a_stacked[0]  # one tensor; lora_b a tuple of slices
    else:
        del layer.lora_a_stacked  # as a layer that keeps its slots under other names
    with pytest.raises(ss.LayoutMismatchError, match=r"LoRA layer 'model.layers.0.self_attn.o_proj' "
                                                     r"\(RowParallelLayer\) keeps its slots in "
                                                     r"another form"):
        lora_receive_plan(manager, 7, specs_of(adapter(seed=7)))


# --- the embedding and lm_head layers: vLLM's own classes ---------------------------------------

VOCAB, DIM, VLLM_RANK = 24, 16, 8  # vLLM's LoRAConfig takes max_lora_rank 1, 8, 16, ...
EMBED, HEAD = "model.embed_tokens", "lm_head"


def embedding_adapter(seed, adapter_name="", vocab=VOCAB, rank=RANK):
    """PEFT tensors of an adapter of embed_tokens (lora_embedding_A [r, vocab], lora_embedding_B
    [dim, r]: bare parameters, `adapter_name` as in a live PEFT model's names) and lm_head
    (lora_A [r, dim], lora_B [vocab, r])."""
    generator = torch.Generator().manual_seed(seed)
    embed, head = f"base_model.model.{EMBED}", f"base_model.model.{HEAD}"
    return {f"{embed}.lora_embedding_A{adapter_name}": torch.randn(rank, vocab,
                                                                  generator=generator),
            f"{embed}.lora_embedding_B{adapter_name}": torch.randn(DIM, rank, generator=generator),
            f"{head}.lora_A.weight": torch.randn(rank, DIM, generator=generator),
            f"{head}.lora_B.weight": torch.randn(vocab, rank, generator=generator)}


@pytest.fixture
def vllm_manager(monkeypatch):
    """A Manager over vLLM's own embedding and lm_head LoRA layers (stand-in base layers: the
    classes' set_lora and create_lora_weights are what the plan reads); a new one per call."""
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    import vllm.lora.layers.logits_processor as logits_module
    from vllm.config.lora import LoRAConfig
    from vllm.lora.layers import LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA

    # One rank: the logits layer reads vLLM's parallel state, which a test process has not set up.
    monkeypatch.setattr(logits_module, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(logits_module, "get_tensor_model_parallel_rank", lambda: 0)
    config = LoRAConfig(max_lora_rank=VLLM_RANK, max_loras=SLOTS, lora_dtype=torch.float32)

    def make(slot_ids=(None, 7, None)):
        manager = Manager(0, 1, slot_ids)
        manager.packed_modules = {}
        embed = VocabParallelEmbeddingWithLoRA(SimpleNamespace(
            org_vocab_size=VOCAB, embedding_dim=DIM, weight=torch.zeros(1)))
        head = LogitsProcessorWithLoRA(SimpleNamespace(vocab_size=VOCAB), DIM, torch.float32,
                                       torch.device("cpu"), None)
        manager.modules = {EMBED: embed, HEAD: head}
        for layer in manager.modules.values():
            layer.create_lora_weights(SLOTS, config, None)
        return manager

    return make


@pytest.mark.parametrize("adapter_name", ["", ".default"])
def test_embedding_and_lm_head_plans_fill_vllms_slots_as_its_set_lora_does(vllm_manager,
                                                                           adapter_name):
    tensors = embedding_adapter(seed=20, adapter_name=adapter_name, rank=VLLM_RANK)
    planned, direct = vllm_manager(), vllm_manager()
    plan = lora_receive_plan(planned, 7, specs_of(tensors))
    # Replayed into the live slot views the plan hands out (slot 1 holds adapter 7; as_strided
    # counts from the storage's start, the plan from the view's first element).
    for c in plan.copies:
        src = tensors[c.wire].reshape(-1).as_strided(c.shape, c.src_strides, c.src_offset)
        live = plan.engine_tensors[c.engine]
        live.as_strided(c.shape, c.dst_strides, live.storage_offset() + c.dst_offset).copy_(src)
    # vLLM's own path: each layer's set_lora with the real tensors, as its model manager calls it.
    names = list(tensors)  # embed A, embed B, lm_head A, lm_head B
    direct.modules[EMBED].set_lora(1, tensors[names[0]], tensors[names[1]])
    direct.modules[HEAD].set_lora(1, tensors[names[2]], tensors[names[3]])
    for name in (EMBED, HEAD):
        for buffer in ("lora_a_stacked", "lora_b_stacked"):
            got = getattr(planned.modules[name], buffer)
            assert torch.equal(got, getattr(direct.modules[name], buffer)), (name, buffer)
            assert bool(got[1].any()) and not bool(got[0].any()) and not bool(got[2].any())
    assert len(plan.copies) == 4
    # vLLM keeps the embedding's lora_A transposed ([vocab, r]): one strided view of the wire's
    # [r, vocab], no computation (the receiver copies it element by element).
    (embed_a,) = [c for c in plan.copies if c.engine == f"{EMBED}.lora_a.0"]
    assert (embed_a.shape, embed_a.src_strides, embed_a.dst_strides) == (
        (VOCAB, VLLM_RANK), (1, VOCAB), (VLLM_RANK, 1))
    live = plan.engine_tensors[f"{EMBED}.lora_a.0"]
    assert live.data_ptr() == planned.modules[EMBED].lora_a_stacked[1].data_ptr()
    # The forward reads the same storage through its 2-D view of every slot.
    assert torch.equal(planned.modules[EMBED].lora_a_stacked_2d[VOCAB:2 * VOCAB],
                       tensors[names[0]].T)


def test_embedding_and_lm_head_plans_run_through_the_receiver_bit_for_bit(vllm_manager):
    # The native receive plan takes the copies (it copies rows: the transposed lora_A's rows are
    # one element) and fills the engine's slot blocks as vLLM's set_lora does; host backend.
    from support import DEADLINE_S

    tensors = embedding_adapter(seed=23, rank=VLLM_RANK)
    planned, direct = vllm_manager(), vllm_manager()
    plan = lora_receive_plan(planned, 7, specs_of(tensors))
    names = list(tensors)
    direct.modules[EMBED].set_lora(1, tensors[names[0]], tensors[names[1]])
    direct.modules[HEAD].set_lora(1, tensors[names[2]], tensors[names[3]])
    wire = ss.Layout(specs_of(tensors), bucket_bytes=256)  # runs cross bucket boundaries
    engine = ss.Layout([ss.TensorSpec(n, "fp32", tuple(t.shape), "lora")
                        for n, t in plan.engine_tensors.items()])
    loopback = ss.Loopback(2)
    receiver = ss.Receiver(engine, ss.HostBackend(), loopback.transport(1),
                           ss.ReceiverConfig(update_deadline_ms=int(DEADLINE_S * 1000)),
                           plan=ss.ReceivePlan(wire, plan.copies))
    sender = ss.Sender(wire, ss.HostBackend(), loopback.transport(0))
    try:
        handle = sender.publish(1, {n: t.numpy() for n, t in tensors.items()})
        receiver.begin_update(handle.header_bytes)
        receiver.wait_applied(1, DEADLINE_S)
        handle.wait(DEADLINE_S)
        for layer, which, buffer in ((EMBED, "a", "lora_a_stacked"), (EMBED, "b", "lora_b_stacked"),
                                     (HEAD, "a", "lora_a_stacked"), (HEAD, "b", "lora_b_stacked")):
            expected = getattr(direct.modules[layer], buffer)[1].reshape(
                receiver.live_array(f"{layer}.lora_{which}.0").shape)
            got = torch.from_numpy(receiver.live_array(f"{layer}.lora_{which}.0").copy())
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), (layer, which)
    finally:
        sender.close()
        receiver.close()


def test_embedding_tensor_names_are_lora_tensors():
    from shadowsync.vllm.lora_plan import is_lora_tensor

    assert is_lora_tensor("base_model.model.model.embed_tokens.lora_embedding_A")
    assert is_lora_tensor("base_model.model.model.embed_tokens.lora_embedding_B.default")
    assert is_lora_tensor("base_model.model.lm_head.lora_B.weight")
    assert not is_lora_tensor("model.embed_tokens.weight")
    assert not is_lora_tensor("base_model.model.model.embed_tokens.lora_embedding_C")


@pytest.mark.parametrize("change,message", [
    # A vocabulary larger than the model's: vLLM's set_lora refuses the shapes.
    (lambda t: embedding_adapter(seed=21, vocab=VOCAB + 8, rank=VLLM_RANK),
     "vLLM's LoRA layer 'model.embed_tokens' does not take the trainer's tensors "
     "('base_model.model.model.embed_tokens.lora_embedding_A' [8, 32]"),
    # A smaller one (new tokens left out, or a vocabulary of another model): part of the slot.
    (lambda t: embedding_adapter(seed=21, vocab=VOCAB - 8, rank=VLLM_RANK),
     "LoRA slot block 'model.embed_tokens.lora_a.0' [24, 8]: the trainer's tensors "
     "('base_model.model.model.embed_tokens.lora_embedding_A' [8, 16]) fill 128 of its 192 "
     "elements"),
    (lambda t: {n: v for n, v in t.items() if not n.endswith("lora_embedding_B")},
     "tensor 'base_model.model.model.embed_tokens.lora_embedding_A' comes without its lora_B"),
    # PEFT's linear names for the embedding go to the same slot as its embedding names.
    (lambda t: t | {f"{EMBED}.lora_A.weight": torch.zeros(VLLM_RANK, VOCAB)},
     "tensors 'base_model.model.model.embed_tokens.lora_embedding_A' and "
     "'model.embed_tokens.lora_A.weight' both go to lora_A of slice 0 of vLLM's LoRA layer "
     "'model.embed_tokens'"),
])
def test_bad_embedding_adapters_are_refused_naming_the_tensor(vllm_manager, change, message):
    tensors = change(embedding_adapter(seed=21, rank=VLLM_RANK))
    with pytest.raises(ss.LayoutMismatchError, match=re.escape(message)):
        lora_receive_plan(vllm_manager(), 7, specs_of(tensors))


def test_an_embedding_adapter_in_another_dtype_is_refused_naming_both(vllm_manager):
    specs = [ss.TensorSpec(s.name, "bf16", s.shape, s.group)
             for s in specs_of(embedding_adapter(seed=22, rank=VLLM_RANK))]
    with pytest.raises(ss.LayoutMismatchError, match=re.escape(
            "tensor 'base_model.model.model.embed_tokens.lora_embedding_A': dtype bf16 of the "
            "trainer's layout does not match fp32 of vLLM's LoRA slot "
            "'model.embed_tokens.lora_a.0'")):
        lora_receive_plan(vllm_manager(), 7, specs)


class _Wrapper(torch.nn.Module):
    """A stand-in of vLLM's LoRA wrapper: the loaded layer as base_layer, slots via set_lora."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def set_lora(self, index, lora_a, lora_b):
        raise AssertionError("not called here")


class _CheckpointNamedModel(torch.nn.Module):
    """A model whose load_weights finds parameters by the checkpoint's names only (as vLLM
    0.25's embedding does): after wrapping, 'embed.weight' is 'embed.base_layer.weight'."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(4, 3)
        self.proj = torch.nn.Linear(3, 3, bias=False)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            if name not in params:
                raise ValueError(f"no parameter named '{name}'")
            params[name].data.copy_(tensor)


def test_lora_wrappers_are_unwrapped_for_load_weights_and_put_back_also_on_error():
    from shadowsync.vllm.loader_trace import trace_load_weights
    from shadowsync.vllm.lora_plan import lora_layers_unwrapped

    model = _CheckpointNamedModel()
    embed, proj = model.embed, model.proj
    model.embed, model.proj = _Wrapper(embed), _Wrapper(proj)
    wrappers = (model.embed, model.proj)
    specs = [("embed.weight", "fp32", (4, 3)), ("proj.weight", "fp32", (3, 3))]
    with pytest.raises(ss.LayoutMismatchError, match="no parameter named 'embed.weight'"):
        trace_load_weights(model, specs)  # wrapped: the loader does not find its names
    with lora_layers_unwrapped(model):
        assert model.embed is embed and model.proj is proj
        trace = trace_load_weights(model, specs)
    assert (model.embed, model.proj) == wrappers
    # The plan writes the parameters the wrappers compute with, under the checkpoint's names.
    assert trace.engine_params["embed.weight"] is embed.weight
    assert trace.engine_params["proj.weight"] is proj.weight
    with pytest.raises(RuntimeError, match="inside"):
        with lora_layers_unwrapped(model):
            raise RuntimeError("inside")
    assert (model.embed, model.proj) == wrappers
