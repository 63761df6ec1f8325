"""The models the benchmark builds, the engine's share of the GPU for each, the goals and
references its figures are held to, and the names of its paths and transports."""

# Public configs' shapes (random weights). transformers config kwargs; "model_type" picks the class.
CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
        intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
        use_sliding_window=False, sliding_window=32768, max_window_layers=24,
        attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643),
    "llama-3-8b": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        attention_bias=False, mlp_bias=False, bos_token_id=128000, eos_token_id=128001),
    "tiny": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=128,
        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=320, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
        bos_token_id=1, eos_token_id=2),
    # Mixture of experts: every layer's MLP is 128 experts of intermediate 768, 8 per token (the
    # dense intermediate_size is unused: decoder_sparse_step 1 and no mlp_only_layers). 30.5 B
    # parameters, 57 GiB in bf16: per layer 1.16 GiB (the experts 1.13: 128 x 3 x 2048 x 768),
    # the embedding and lm_head 1.16 together; --layers takes fewer layers of it. head_dim 128
    # (not hidden / heads = 64): transformers' Qwen3MoeConfig keeps it as given.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, sliding_window=None, attention_dropout=0.0,
        bos_token_id=151643, eos_token_id=151645),
    # 64 experts of intermediate 1024, 8 per token, full multi-head attention (16 key/value
    # heads) with q/k norms over the whole projection. 6.9 B parameters, 12.9 GiB in bf16. Its
    # public config names no bos_token_id (transformers' default, None) and pads with 1.
    "olmoe-1b-7b": dict(
        model_type="olmoe", architectures=["OlmoeForCausalLM"], hidden_size=2048,
        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
        vocab_size=50304, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, hidden_act="silu", attention_bias=False, clip_qkv=None,
        attention_dropout=0.0, pad_token_id=1, eos_token_id=50279),
    # A tiny Qwen3-MoE for CPU checks: head_dim 32 (vLLM CPU's attention needs >= 32), experts'
    # intermediate 128 (a multiple of 32: vLLM CPU pads others after loading, which the
    # extension refuses), 16 experts so that FP8's router gate has a multiple of 16 outputs.
    "tiny-moe": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=128,
        intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
        num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        vocab_size=320, max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False,
        bos_token_id=1, eos_token_id=2),
}


def config_kwargs(config: str, layers: int | None = None) -> dict:
    """`config`'s transformers kwargs (a copy), with `layers` decoder layers instead of its own
    when given (--layers: the first `layers` of the same shapes)."""
    kwargs = dict(CONFIGS[config])
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
        if "max_window_layers" in kwargs:  # Qwen2: the layers before sliding windows begin
            kwargs["max_window_layers"] = min(kwargs["max_window_layers"], layers)
    return kwargs


def model_label(config: str, layers: int | None = None) -> str:
    """How the report names `config`: with --layers, "qwen3-30b-a3b (24 of 48 layers)"."""
    total = CONFIGS[config]["num_hidden_layers"]
    if layers is None or layers == total:
        return config
    return f"{config} ({layers} of {total} layers)"
# Engine memory share per config on cuda (weights + KV cache + graphs): the rest of the GPU holds
# what vLLM does not account for, allocated after the engine started: the trainer's copy, and
# shadowsync's receiver, which allocates both slots before copy_in frees the live one (vLLM's
# storage is the live copy). Llama-3-8B on an 80 GB H100 (GiB): engine 0.30 x 79.6 = 23.9
# (15.0 weights, the KV cache of 32 x 592 tokens is 2.3), receiver 2 x 15.0 at its peak, trainer
# 15.0 + 2 staging slots of 0.5, CUDA contexts ~1.5: ~72.
# OLMoE-1B-7B on the same 80 GB GPU: engine 0.25 x 79.6 = 19.9 (12.9 weights, the KV cache of
# 32 x 592 tokens is 2.3 with 16 key/value heads), receiver 2 x 12.9, trainer 12.9 + 1.0, CUDA
# contexts ~1.5: ~61. Qwen3-30B-A3B does not fit one GPU whole (4 copies of 57 GiB): the value is
# for a 141 GB H200 (139.8 GiB) with --layers up to 26 (1.16 GiB a layer + 1.16): engine 0.26 x
# 139.8 = 36.3 (31.3 weights at 26 layers, the KV cache of 32 x 592 tokens 0.9 at 48 KiB a
# token, the rest activations, the experts' workspace and graphs), receiver 2 x 31.3, trainer
# 31.3 + 1.0, contexts ~1.5: ~133. Fewer layers leave the engine more KV cache; with
# --quantization fp8 its weights are half as large (the trainer and the update stay bf16).
# Other layer counts or GPUs: --gpu-memory-utilization.
GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.25, "llama-3-8b": 0.30, "tiny": 0.15,
                          "qwen3-30b-a3b": 0.26, "olmoe-1b-7b": 0.25, "tiny-moe": 0.15}
# With --live-arena the engine holds two copies of the weights (the arena) from the start: the
# same KV cache takes one weights' share (80 GiB GPU) more (live_arena.py counts them once).
# OLMoE-1B-7B: 0.25 + 12.9 / 79.6 = 0.41. Qwen3-30B-A3B (H200, up to 26 layers): 0.26 + 31.3 /
# 139.8 = 0.48; the arena's two slots are the receiver's, so outside the engine only the trainer
# (32.3) and the contexts (1.5): ~101.
LIVE_ARENA_GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.28, "llama-3-8b": 0.50, "tiny": 0.15,
                                     "qwen3-30b-a3b": 0.48, "olmoe-1b-7b": 0.41, "tiny-moe": 0.15}
GOALS = {"engine_stop_ms": 1.0, "slowdown": 1.10}
# What the shadowsync path's engine thread did for an update (ShadowsyncTransfer.engine_times):
# each has <event>_ms (its length) and, in the analysis, gap_at_<event>_ms (the gap it fell into).
ENGINE_EVENTS = ("swap", "begin_update", "wait_applied", "commit")
ENGINE_TIMES = tuple(f"{e}_ms" for e in ENGINE_EVENTS) + tuple(f"gap_at_{e}_ms" for e in ENGINE_EVENTS)
VLLM_REFERENCE_STOP_MS = {"qwen2.5-0.5b": 119.0, "llama-3-8b": 239.0}
# --quantization: what every engine of the run is started with (vLLM quantizes the bf16
# checkpoint while loading; shadowsync's receiver quantizes each update the same way).
QUANTIZATIONS = ("fp8",)
PATHS = ("vllm", "shadowsync", "shadowsync-api", "copy")
TRANSPORTS = ("same-host", "nccl")
VLLM_BACKENDS = {"same-host": "ipc", "nccl": "nccl"}  # vLLM's weight-transfer backend of each
DEFAULT_PATHS = ("vllm", "shadowsync")  # "copy" is a reference, run when asked for
PROMPT_LEN = 16
