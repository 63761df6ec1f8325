"""A mini vLLM-like worker for the tests: a small Llama-style model built from a config with
transformers (random init from a fixed seed, nothing downloaded), a step loop with greedy decoding,
and load_weights, with shadowsync.vllm.WorkerExtension mixed in the way vLLM mixes in
``worker_extension_cls``.

Needs torch and transformers (test_mini_worker.py skips without them). Runs on the CPU (torch CPU
tensors: the extension's views of the live slot are torch.frombuffer over the host arena) and on
a GPU (CUDA views of the slot, the engine stream being torch's current stream).

Each step recomputes the whole sequence (no KV cache): a step's logits are then a pure function
of (weights, tokens), which is what lets a test compare them bit for bit with a reference model.
A KV cache filled before a swap would mix two versions' keys and values in one step, which is
the engine's concern (vLLM drops or recomputes it), not the weight transfer's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, NamedTuple

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shadowsync.errors import InvalidArgumentError
from shadowsync.vllm import WorkerExtension


def mini_config() -> LlamaConfig:
    """Two layers, hidden size 64: ~107k parameters (0.4 MB in fp32), enough for a layout of
    several buckets and a real attention/MLP/norm stack."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        # Plain matmul + softmax attention: no backend choice (flash, memory-efficient) that could
        # differ between the worker and its reference.
        attn_implementation="eager",
    )


def build_model(seed: int, device: str, dtype: torch.dtype) -> LlamaForCausalLM:
    """Random init from `seed` on the CPU, then moved: the same seed gives the same weights on
    every device."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(mini_config())
    finally:
        torch.random.set_rng_state(generator_state)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)  # an inference engine's weights
    return model


class StepOutput(NamedTuple):
    version: int  # the weight version live during the step (0: the initial weights)
    input_ids: torch.Tensor  # (batch, length), on the CPU
    logits: torch.Tensor  # (batch, vocab) of the last position, on the CPU
    next_tokens: torch.Tensor  # (batch,), greedy


class MiniWorker(WorkerExtension):
    """What a vLLM worker looks like to the extension: the model at ``model_runner.model`` and an
    ``execute_model`` step. Each step decodes one token per sequence greedily; a sequence that
    reaches ``max_len`` starts again from its prompt (a new request)."""

    def __init__(self, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 batch: int = 2, prompt_len: int = 4, max_len: int = 16):
        self.device = torch.device(device)
        self.model_runner = SimpleNamespace(model=build_model(seed, device, dtype))
        config = self.model_runner.model.config
        prompts = torch.Generator().manual_seed(seed + 1000)
        self.prompts = torch.randint(0, config.vocab_size, (batch, prompt_len),
                                     generator=prompts).to(self.device)
        self.max_len = max_len
        self.tokens = self.prompts.clone()
        self.outputs: list[StepOutput] = []

    @property
    def model(self) -> LlamaForCausalLM:
        return self.model_runner.model

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies (name, tensor) pairs into the model's parameters in place, as vLLM's
        ``model.load_weights`` does; returns the names loaded. An unknown name or a shape that
        differs raises, naming the tensor and both values."""
        params = dict(self.model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                param = params.get(name)
                if param is None:
                    raise InvalidArgumentError(
                        f"load_weights: '{name}' is not a parameter of the model "
                        f"({len(params)} parameters)")
                if tuple(tensor.shape) != tuple(param.shape):
                    raise InvalidArgumentError(
                        f"load_weights: '{name}': shape {tuple(tensor.shape)} does not match the "
                        f"model's {tuple(param.shape)}")
                param.copy_(tensor.to(device=param.device, dtype=param.dtype))
                loaded.add(name)
        return loaded

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The last position's logits for `input_ids` (batch, length): one forward pass over the
        whole sequence, no cache."""
        return self.model(input_ids=input_ids.to(self.device), use_cache=False).logits[:, -1, :]

    def execute_model(self, scheduler_output=None) -> StepOutput:
        """One decode step. init_weight_update_group shadows this method so that the step hook
        (a swap, when an update was received) runs first."""
        state = self._shadowsync
        version = state.receiver.applied_version if state is not None else 0
        input_ids = self.tokens
        logits = self.logits(input_ids)
        next_tokens = logits.argmax(dim=-1)
        self.tokens = torch.cat([input_ids, next_tokens[:, None]], dim=1)
        if self.tokens.shape[1] >= self.max_len:
            self.tokens = self.prompts.clone()
        # .cpu() waits for the step, as a sampler that hands tokens back does.
        out = StepOutput(version, input_ids.cpu(), logits.float().cpu(), next_tokens.cpu())
        self.outputs.append(out)
        return out
