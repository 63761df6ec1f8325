"""Child process of test_loader_trace.py's real-vLLM test: traces vLLM's own load_weights of tiny
random checkpoints (vllm_models.py) and prints one JSON line of findings per architecture.

vLLM's model classes need its parallel state (one rank of gloo) and its config context; both are
process-global, hence a process of their own. The models are built as vLLM's loader builds them
but not loaded: tracing runs before process_weights_after_loading, which on the CPU backend
replaces the linear weights by empty parameters (prepacked copies live elsewhere).

    python vllm_trace_child.py WORKDIR PORT RANK WORLD ARCH [ARCH...]

With WORLD > 1, WORLD children of ranks 0..WORLD-1 run at once (tensor parallel over gloo), each
tracing its own shard of the model.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from shadowsync.errors import LayoutMismatchError  # noqa: E402
from shadowsync.vllm.loader_trace import trace_load_weights  # noqa: E402


def refusal(model, specs) -> str:
    try:
        trace_load_weights(model, specs)
    except LayoutMismatchError as e:
        return str(e)
    return ""


def main(workdir: str, port: int, rank: int, world: int, archs: list[str]) -> None:
    import transformers
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_models import make_tiny_model

    started = False

    def build(path, dtype):
        nonlocal started
        config = EngineArgs(model=path, dtype=dtype, enforce_eager=True,
                            max_model_len=256).create_engine_config()
        with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype):
            if not started:
                # vLLM's CPU worker names the ranks' shared-memory group so; its CPU communicator
                # reads it where vLLM's shared-memory ops are built for this CPU.
                os.environ.setdefault("VLLM_DIST_IDENT", f"shadowsync-trace-{port}")
                init_distributed_environment(world_size=world, rank=rank, local_rank=rank,
                                             distributed_init_method=f"tcp://127.0.0.1:{port}",
                                             backend="gloo")
                initialize_model_parallel(world, 1)
                started = True
            return config, initialize_model(vllm_config=config)

    for arch in archs:
        path = make_tiny_model(arch, Path(workdir) / f"{arch}-{rank}")
        config, model = build(path, "float32")
        with set_current_vllm_config(config):
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            sources = {n: p.detach() for n, p in hf.named_parameters()}
            specs = [(n, "fp32", tuple(t.shape)) for n, t in sources.items()]
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            trace = trace_load_weights(model, specs)
            unchanged = all(torch.equal(before[n].view(torch.int32), p.view(torch.int32))
                            for n, p in model.named_parameters())

            # vLLM's loader on the real tensors against the plan replayed in plain torch
            with torch.no_grad():
                model.load_weights(iter(sources.items()))
                loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
                for p in model.parameters():
                    p.data.fill_(float("nan"))
                for c in trace.copies:
                    dst = trace.engine_params[c.engine].data.view(-1)
                    src = sources[c.wire].reshape(-1)
                    dst.as_strided(c.shape, c.dst_strides, c.dst_offset).copy_(
                        src.as_strided(c.shape, c.src_strides, c.src_offset))
            mismatched = [n for n, p in model.named_parameters()
                          if not torch.equal(p.view(torch.int32), loaded[n].view(torch.int32))]

            process_weights_after_loading(model, config.model_config, torch.device("cpu"))
            prepacked = refusal(model, specs)
        config16, model16 = build(path, "bfloat16")
        with set_current_vllm_config(config16):
            converting = refusal(model16, specs)
        plan = [[c.wire, c.engine, c.shape, c.src_offset, c.dst_offset] for c in trace.copies]
        print(json.dumps(dict(
            arch=arch, rank=rank, plan=plan, copies=len(trace.copies), wires=len(specs),
            params=len(before), written=len(trace.engine_params),
            unwritten=trace.unwritten_params, identity=trace.identity, unchanged=unchanged,
            mismatched=mismatched, fused=sorted({c.engine for c in trace.copies
                                                 if c.engine != c.wire}),
            prepacked=prepacked, converting=converting)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
