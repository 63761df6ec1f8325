"""The benchmark's models: random weights at a config's real shapes (configs.CONFIGS), built by
transformers directly on the device, saved for vLLM to load, and counted."""

from __future__ import annotations

from .configs import CONFIGS


def make_model(config: str, device: str, seed: int, gpu: int = 0):
    """A transformers model of `config` with random weights (`seed`), built on `device` (cuda:
    GPU `gpu`) in the benchmark's dtype (bf16 on cuda, fp32 on cpu; "meta": bf16 shapes without
    memory)."""
    import torch
    import transformers

    dtype = torch.bfloat16 if device in ("cuda", "meta") else torch.float32
    kwargs = dict(CONFIGS[config])
    model_type = kwargs.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    with torch.device({"cuda": f"cuda:{gpu}", "meta": "meta"}.get(device, "cpu")):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers 4: torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def make_checkpoint(path: str, config: str, device: str, dummy_load: bool) -> None:
    # vLLM makes its own random weights with load_format="dummy": the shapes suffice (meta).
    model = make_model(config, "meta" if dummy_load else device, seed=1)
    if dummy_load:  # vLLM makes its own random weights (load_format="dummy"): the config only
        model.config.save_pretrained(path)
    else:
        model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint {config}: {params / 1e9:.3f} B parameters, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB, in {path}")



def parameter_bytes(config: str, device: str) -> int:
    """The bytes of `config`'s parameters in the benchmark's dtype, counted on the meta device."""
    import torch
    import transformers

    kwargs = dict(CONFIGS[config])
    hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    element = 2 if device == "cuda" else 4  # bf16 on cuda, fp32 on cpu (make_model)
    return sum(p.numel() for p in model.parameters()) * element
