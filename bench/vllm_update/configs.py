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
}
# Engine memory share per config on cuda (weights + KV cache + graphs): the rest of the GPU holds
# what vLLM does not account for, allocated after the engine started: the trainer's copy, and
# shadowsync's receiver, which allocates both slots before copy_in frees the live one (vLLM's
# storage is the live copy). Llama-3-8B on an 80 GB H100 (GiB): engine 0.30 x 79.6 = 23.9
# (15.0 weights, the KV cache of 32 x 592 tokens is 2.3), receiver 2 x 15.0 at its peak, trainer
# 15.0 + 2 staging slots of 0.5, CUDA contexts ~1.5: ~72.
GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.25, "llama-3-8b": 0.30, "tiny": 0.15}
# With --live-arena the engine holds two copies of the weights (the arena) from the start: the
# same KV cache takes one weights' share (80 GiB GPU) more (live_arena.py counts them once).
LIVE_ARENA_GPU_MEMORY_UTILIZATION = {"qwen2.5-0.5b": 0.28, "llama-3-8b": 0.50, "tiny": 0.15}
GOALS = {"engine_stop_ms": 1.0, "slowdown": 1.10}
# What the shadowsync path's engine thread did for an update (ShadowsyncTransfer.engine_times):
# each has <event>_ms (its length) and, in the analysis, gap_at_<event>_ms (the gap it fell into).
ENGINE_EVENTS = ("swap", "begin_update", "wait_applied")
ENGINE_TIMES = tuple(f"{e}_ms" for e in ENGINE_EVENTS) + tuple(f"gap_at_{e}_ms" for e in ENGINE_EVENTS)
VLLM_REFERENCE_STOP_MS = {"qwen2.5-0.5b": 119.0, "llama-3-8b": 239.0}
PATHS = ("vllm", "shadowsync", "shadowsync-api", "copy")
TRANSPORTS = ("same-host", "nccl")
VLLM_BACKENDS = {"same-host": "ipc", "nccl": "nccl"}  # vLLM's weight-transfer backend of each
DEFAULT_PATHS = ("vllm", "shadowsync")  # "copy" is a reference, run when asked for
PROMPT_LEN = 16
