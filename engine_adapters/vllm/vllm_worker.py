"""What the adapter reads off vLLM's worker: its weight-transfer engine, model config and LoRA
manager. Each answers None on a worker that is not vLLM's (the CPU tests' fake workers), so the
adapter works on any object with a model."""

from __future__ import annotations

import sys


def live_arena_engine(worker):
    """The live-arena weight-transfer engine vLLM made for this worker at load (live_arena.py:
    the weights sit in its remap arena), or None."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine if getattr(engine, "shadowsync_live_arena", False) else None


def model_config(worker):
    """vLLM's model config of the worker (None when the worker is not vLLM's)."""
    config = getattr(worker, "model_config", None)
    if config is None:
        config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    return config


def captures_cuda_graphs(worker) -> bool | None:
    """Whether vLLM replays CUDA graphs over the weights (its default): not enforce_eager.
    None when the worker is not vLLM's."""
    enforce_eager = getattr(model_config(worker), "enforce_eager", None)
    return None if enforce_eager is None else not enforce_eager


def quantization(worker) -> str | None:
    """The quantization vLLM was started with (None: none, or not vLLM's worker)."""
    quantization = getattr(model_config(worker), "quantization", None)
    return quantization if isinstance(quantization, str) else None


def lora_manager(worker):
    """vLLM's worker LoRA manager (None without enable_lora)."""
    return getattr(getattr(worker, "model_runner", None), "lora_manager", None)



def worker_loading(model, depth: int = 12):
    """The worker whose model runner holds `model` (its ``model_runner.get_model()``), found as a
    caller's `self` within `depth` frames; None if there is none. vLLM hands a weight-transfer
    engine only the model, from Worker.load_model: this is how the engine finds its worker."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        worker = frame.f_locals.get("self")
        runner = getattr(worker, "model_runner", None)
        get_model = getattr(runner, "get_model", None)
        if callable(get_model):
            try:
                if get_model() is model:
                    return worker
            except Exception:  # a runner of another state: not the one loading this model
                pass
        frame = frame.f_back
    return None


def runner_loading(model, depth: int = 12):
    """The model runner whose get_model() is `model`, of the worker loading it (worker_loading),
    if it keeps vLLM's ``model_memory_usage`` (GPU runners); None otherwise."""
    runner = getattr(worker_loading(model, depth), "model_runner", None)
    return runner if hasattr(runner, "model_memory_usage") else None
