"""``quantization="shadowsync_unpacked"``: vLLM's unquantized weights, kept as the parameters the
model computes with.

vLLM's CPU backend repacks each linear layer's weight after loading (oneDNN or its own kernels)
and from then on computes from the packed copy: linear weights become empty parameters, and the
embedding/lm_head keeps its parameter while the logits come from a packed copy of it. An update
written into the parameters would then change nothing (or, for a tied lm_head, only half of the
model) — the worker extension refuses such an engine. This "quantization" method is vLLM's
unquantized storage with the repacking step left out: ``F.linear`` on the parameter itself, so
the parameters are the weights and an update takes effect. It changes no weight loader, so a
checkpoint loads exactly as without it. (On CUDA, vLLM's unquantized layers already compute from
their parameters; this method is not needed there.)

Use: import this module in the process that creates the engine (or install the package: its
``vllm.general_plugins`` entry point, ``register``, runs in every vLLM process), then
``vllm.LLM(model=..., quantization="shadowsync_unpacked", worker_extension_cls=...)``. vLLM's
spawned processes import it again when they unpickle the config, which registers it there.

vLLM builds some layers without the model's quantization config (Gemma-2's embedding, Mixtral's
router gate): they get vLLM's plain unquantized methods, which repack. In an engine started with
this method, ``unpack_unconfigured_layers`` gives them the unpacked methods too, just before vLLM's
post-load step runs (the post-load trace calls it), so every unquantized weight stays unpacked.

Cost: the layers run ``torch.nn.functional.linear`` instead of vLLM's packed CPU kernels.
"""

from __future__ import annotations

NAME = "shadowsync_unpacked"


def register() -> None:
    """Registers the method with vLLM (idempotent): the ``vllm.general_plugins`` entry point."""
    _register()


def unpack_unconfigured_layers(model, model_config) -> None:
    """In an engine started with quantization="shadowsync_unpacked", the layers vLLM built
    without that config (plain UnquantizedLinearMethod / UnquantizedEmbeddingMethod) get the
    unpacked methods before vLLM's post-load step runs. Nothing for any other engine."""
    if getattr(model_config, "quantization", None) != NAME:
        return
    _register()
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    unpacked = {UnquantizedLinearMethod: UnpackedLinearMethod,
                UnquantizedEmbeddingMethod: UnpackedEmbeddingMethod}
    for module in model.modules():
        replacement = unpacked.get(type(getattr(module, "quant_method", None)))
        if replacement is not None:
            module.quant_method = replacement()


def _register():
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers import quantization
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from .post_load_trace import install as trace_post_load

    trace_post_load()  # this runs in every vLLM process that is to serve shadowsync
    global UnpackedConfig, UnpackedLinearMethod, UnpackedEmbeddingMethod
    if "UnpackedConfig" in globals():
        return UnpackedConfig

    class _UnpackedLinearMethod(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer):
            pass  # the loaded parameter stays the weight: no packed copy, no empty parameter

        def apply(self, layer, x, bias=None):
            return F.linear(x, layer.weight, bias)

    class _UnpackedEmbeddingMethod(UnquantizedEmbeddingMethod):
        def process_weights_after_loading(self, layer):
            pass

        def apply(self, layer, x, bias=None):  # lm_head's logits, from the parameter itself
            return F.linear(x, layer.weight, bias)

    UnpackedLinearMethod, UnpackedEmbeddingMethod = _UnpackedLinearMethod, _UnpackedEmbeddingMethod

    class _UnpackedConfig(QuantizationConfig):
        def get_name(self):
            return NAME

        def get_supported_act_dtypes(self):
            return [torch.float32, torch.bfloat16, torch.float16]

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, LinearBase):
                return UnpackedLinearMethod()
            if isinstance(layer, VocabParallelEmbedding):
                return UnpackedEmbeddingMethod()
            return None

    # Pickled by qualified name: vLLM sends the config to its spawned processes.
    _UnpackedConfig.__name__ = _UnpackedConfig.__qualname__ = "UnpackedConfig"
    _UnpackedConfig.__module__ = __name__
    UnpackedConfig = quantization.register_quantization_config(NAME)(_UnpackedConfig)
    return UnpackedConfig


def __getattr__(name):
    # Unpickling `shadowsync.vllm.unpacked.UnpackedConfig` in a spawned vLLM process imports this
    # module and asks for the class: registering then makes the name known in that process too.
    if name == "UnpackedConfig":
        return _register()
    raise AttributeError(name)
