"""Tiny random Hugging Face checkpoints that real vLLM can load, made at test time with no
download: `make_tiny_model(arch, path, seed)` writes config, safetensors weights and a tokenizer
into `path` and returns it.

The shapes are the smallest vLLM's CPU backend runs: 2 layers, hidden 128, 4 query heads of
head_dim 32 (its attention kernels need head_dim >= 32) and 2 key/value heads (grouped-query, so
q/k/v have different row counts in the fused qkv_proj). The tokenizer is byte-level BPE with no
merges: every text encodes to one token per byte, it needs no files from anywhere, and its vocab
(256 bytes, 3 specials, fillers) is exactly the model's vocab_size so every id the model can emit
decodes. The default vocab_size (320) is a multiple of 64, so vLLM's embedding and lm_head
parameters have the checkpoint's shape; another vocab_size (>= 259) makes vLLM pad their rows
to the next multiple of 64.

Architectures, chosen for what they exercise in vLLM's weight loading:
  llama  - separate q/k/v and gate/up in HF, fused qkv_proj / gate_up_proj in vLLM; own lm_head.
  qwen2  - the same fusion plus q/k/v biases; tie_word_embeddings (lm_head is embed_tokens).
  qwen3  - q_norm / k_norm per head, no biases; own lm_head.
  phi3   - qkv_proj and gate_up_proj already fused in HF (vLLM loads them whole).
  qwen3_moe, mixtral - 4 experts, 2 per token: vLLM stacks them into w13/w2, and its CPU backend
           repacks those after loading (same shape, other order); Mixtral's router gate is built
           without the model's quantization config.
  gemma2 - embedding and lm_head tied, built by vLLM without the model's quantization config.
  gpt2   - Hugging Face's Conv1D weights ([in, out]), which vLLM's loader transposes; tied.

Weights are float32 on disk (vLLM casts to the dtype it is given); torch and transformers are
imported lazily, so importing this module costs nothing for tests that skip."""

from __future__ import annotations

import os
from pathlib import Path

ARCHS = ("llama", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral", "gemma2", "gpt2")
# Architectures whose module names in transformers 5 are not what vLLM's loader takes: Mixtral
# holds each layer's experts as one fused tensor (mlp.experts.gate_up_proj) while its
# checkpoints, and vLLM's loader, name each expert's w1/w2/w3. Their trainer sends the tensors as
# the checkpoint names them (what save_pretrained writes: trainer_tensors).
CHECKPOINT_NAMED = ("mixtral",)
# qwen3_moe with an experts' intermediate size (48) vLLM CPU pads to a multiple of 32 after
# loading: a post-load step shadowsync does not reproduce, so the set-up refuses it.
PADDED_MOE = "qwen3_moe_padded"
PADDED_MOE_INTERMEDIATE = 48
EXPERTS = 4
# qwen3_moe with 16 experts: with quantization="fp8" on CUDA vLLM quantizes the router gate too,
# and its kernel holds the 4 experts' gate with rows of padding after them, which graph pairs do
# not swap (online_fp8.py); 16 experts' gate is held as loaded, so graph pairs hold the model.
WIDE_MOE = "qwen3_moe_16"
WIDE_MOE_EXPERTS = 16

VOCAB_SIZE = 320  # 256 byte tokens + 3 specials + fillers
HIDDEN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS  # 32
INTERMEDIATE = 256
LAYERS = 2
MAX_POSITIONS = 512

BOS, EOS, UNK = "<s>", "</s>", "<unk>"


def _common(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def make_config(arch: str, vocab_size: int = VOCAB_SIZE):
    """The transformers config of `arch` (one of ARCHS) at the tiny shapes above."""
    import transformers

    common = _common(vocab_size)
    if arch == "llama":
        return transformers.LlamaConfig(**common, head_dim=HEAD_DIM,
                                        tie_word_embeddings=False)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                        use_sliding_window=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=HEAD_DIM,
                                        tie_word_embeddings=False, use_sliding_window=False)
    if arch == "phi3":
        return transformers.Phi3Config(**common, tie_word_embeddings=False,
                                       sliding_window=None)
    if arch in ("qwen3_moe", PADDED_MOE, WIDE_MOE):
        experts_intermediate = PADDED_MOE_INTERMEDIATE if arch == PADDED_MOE else INTERMEDIATE // 2
        experts = WIDE_MOE_EXPERTS if arch == WIDE_MOE else EXPERTS
        return transformers.Qwen3MoeConfig(**common, head_dim=HEAD_DIM, num_experts=experts,
                                           num_experts_per_tok=2,
                                           moe_intermediate_size=experts_intermediate,
                                           decoder_sparse_step=1, tie_word_embeddings=False,
                                           use_sliding_window=False)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, head_dim=HEAD_DIM, num_local_experts=EXPERTS,
                                          num_experts_per_tok=2, tie_word_embeddings=False,
                                          sliding_window=None)
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab_size, n_positions=MAX_POSITIONS,
                                       n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                       n_inner=INTERMEDIATE, bos_token_id=1, eos_token_id=2,
                                       tie_word_embeddings=True)
    if arch == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=HEAD_DIM, tie_word_embeddings=True,
                                         sliding_window=MAX_POSITIONS)
    raise ValueError(f"make_config: unknown arch {arch!r}; known: "
                     f"{', '.join(ARCHS + (PADDED_MOE, WIDE_MOE))}")


def make_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE tokenizer with no merges and exactly `vocab_size` tokens, built in-process
    (no files, no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte-level symbols
    specials = [UNK, BOS, EOS]
    smallest = len(specials) + len(byte_chars)
    if vocab_size < smallest:
        raise ValueError(f"make_tokenizer: vocab_size {vocab_size} is below the {smallest} tokens "
                         f"every byte and the specials need")
    fillers = [f"<|filler_{i}|>" for i in range(vocab_size - smallest)]
    vocab = {tok: i for i, tok in enumerate(specials + byte_chars + fillers)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, pad_token=UNK)


def make_tiny_model(arch: str, path: str | os.PathLike, seed: int = 0,
                    vocab_size: int = VOCAB_SIZE, initializer_range: float | None = None) -> str:
    """Writes a random tiny `arch` checkpoint (config.json, model.safetensors, tokenizer files)
    into `path` (created if missing) and returns str(path). The same (arch, seed, vocab_size,
    initializer_range) gives the same weights bit for bit. Not thread-safe: it seeds torch's
    global generator.

    `initializer_range`: the std of the random matrices (None: transformers' 0.02). At 0.02 the
    residual stream is mostly the input embedding, so a tied model (qwen2) greedily repeats the
    prompt's last token whatever its other weights; 0.1 makes the layers decide the output, so
    that greedy tokens tell two seeds apart."""
    import torch
    import transformers

    tokenizer = make_tokenizer(vocab_size)  # first: it checks vocab_size
    config = make_config(arch, vocab_size)
    if initializer_range is not None:
        config.initializer_range = float(initializer_range)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_config's init gives norms weight 1 and biases 0; randomize them too so that a test
    # which loads them wrong (or not at all) sees different outputs.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                        else 0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)


def trainer_tensors(path: str | os.PathLike, dtype) -> dict:
    """What a trainer of checkpoint `path` sends, in torch dtype `dtype`: its Hugging Face
    model's named_parameters(), or for CHECKPOINT_NAMED architectures the tensors as the
    checkpoint names them."""
    import json

    import torch
    import transformers

    model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
    if model_type in CHECKPOINT_NAMED:
        from safetensors.torch import load_file

        return {n: t.to(dtype).contiguous()
                for n, t in load_file(str(Path(path) / "model.safetensors")).items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: p.detach().to(dtype).contiguous() for n, p in model.named_parameters()}


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The input embedding and the output head: PEFT adapts the embedding with lora_embedding_A
# [r, vocab] and lora_embedding_B [hidden, r] (bare parameters), lm_head as a linear layer.
LORA_EMBEDDING_TARGETS = ("embed_tokens", "lm_head")


def make_tiny_lora(base: str | os.PathLike, path: str | os.PathLike, seed: int, r: int = 8,
                   lora_alpha: int = 16, std: float = 0.2,
                   targets: tuple[str, ...] = LORA_TARGETS) -> str:
    """Writes a random PEFT LoRA adapter for the checkpoint `base` (the modules named `targets`:
    by default every linear projection of every layer; LORA_EMBEDDING_TARGETS adds the embedding
    and lm_head; adapter_config.json and adapter_model.safetensors, PEFT's names) into `path` and
    returns str(path). Unlike PEFT's initialization (lora_B = 0) both A and B are random, so the
    adapter changes the output; same seed, same adapter."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.split(".")[-1] not in targets:
            continue
        prefix = f"base_model.model.{name}"
        if isinstance(module, torch.nn.Embedding):
            vocab, hidden = module.weight.shape
            tensors[f"{prefix}.lora_embedding_A"] = std * torch.randn(r, vocab,
                                                                      generator=generator)
            tensors[f"{prefix}.lora_embedding_B"] = std * torch.randn(hidden, r,
                                                                      generator=generator)
        else:
            out_features, in_features = module.weight.shape
            tensors[f"{prefix}.lora_A.weight"] = std * torch.randn(r, in_features,
                                                                   generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = std * torch.randn(out_features, r,
                                                                   generator=generator)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=r, lora_alpha=lora_alpha,
                  target_modules=list(targets), bias="none", lora_dropout=0.0,
                  base_model_name_or_path=str(base))
    (path / "adapter_config.json").write_text(json.dumps(config))
    return str(path)


def with_tensors_of(base: str | os.PathLike, donor: str | os.PathLike, names: list[str],
                    path: str | os.PathLike) -> str:
    """A copy of checkpoint `base` at `path` whose tensors `names` are `donor`'s: what an engine
    of `donor` holds after an update of `base` that leaves `names` out (kept, frozen)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = Path(path)
    shutil.copytree(base, path)
    tensors = load_file(str(Path(base) / "model.safetensors"))
    given = load_file(str(Path(donor) / "model.safetensors"))
    missing = [n for n in names if n not in given or n not in tensors]
    if missing:
        raise ValueError(f"tensors {missing} are not in both checkpoints")
    tensors.update({n: given[n] for n in names})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)
