"""The benchmark's models: random weights at a config's real shapes (configs.CONFIGS; with
--layers, its first N layers), built by transformers directly on the device, saved for vLLM to
load, and counted."""

from __future__ import annotations

from .configs import config_kwargs, model_label


def make_model(config: str, device: str, seed: int, gpu: int = 0, layers: int | None = None):
    """A transformers model of `config` (`layers` decoder layers instead of its own, when given)
    with random weights (`seed`), built on `device` (cuda: GPU `gpu`) in the benchmark's dtype
    (bf16 on cuda, fp32 on cpu; "meta": bf16 shapes without memory)."""
    import torch
    import transformers

    dtype = torch.bfloat16 if device in ("cuda", "meta") else torch.float32
    kwargs = config_kwargs(config, layers)
    model_type = kwargs.pop("model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    with torch.device({"cuda": f"cuda:{gpu}", "meta": "meta"}.get(device, "cpu")):
        try:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except TypeError:  # transformers 4: torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def model_specs(config: str, device: str, layers: int | None = None) -> list[tuple]:
    """(name, dtype, shape) of each parameter a trainer of `config` publishes on `device` (bf16 on
    cuda, fp32 on cpu, as make_model builds it), read from the model built on the meta device:
    no memory, no values (a sharded trainer's ranks make only their own rows)."""
    model = make_model(config, "meta", seed=0, layers=layers)
    dtype = "torch.bfloat16" if device == "cuda" else "torch.float32"
    return [(name, dtype, tuple(p.shape)) for name, p in model.named_parameters()]


def make_checkpoint(path: str, config: str, device: str, dummy_load: bool,
                    layers: int | None = None) -> None:
    # vLLM makes its own random weights with load_format="dummy": the shapes suffice (meta).
    model = make_model(config, "meta" if dummy_load else device, seed=1, layers=layers)
    if dummy_load:  # vLLM makes its own random weights (load_format="dummy"): the config only
        model.config.save_pretrained(path)
    else:
        model.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    print(f"checkpoint {model_label(config, layers)}: {params / 1e9:.3f} B parameters, "
          f"{sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30:.2f} GiB, in {path}")


def parameter_bytes(config: str, device: str, layers: int | None = None) -> int:
    """The bytes of `config`'s parameters (`layers` decoder layers, when given) in the
    benchmark's dtype, counted on the meta device."""
    import torch
    import transformers

    kwargs = config_kwargs(config, layers)
    hf_config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    element = 2 if device == "cuda" else 4  # bf16 on cuda, fp32 on cpu (make_model)
    return sum(p.numel() for p in model.parameters()) * element
