#!/usr/bin/env python3
"""Check (GPU machine, real vLLM): with the live arena, vLLM's KV cache is smaller than without it
by the memory the arena really adds — its two slots less the torch memory the move freed, about
one copy of the weights — and not by a second copy on top.

The live-arena engine (engine_adapters/vllm/live_arena.py) moves vLLM's weights into a remap arena
of two copies before vLLM sizes its KV cache, and takes the torch memory it freed off the weights'
memory vLLM measured at load, so that vLLM counts the weights once. For each of "plain" (the
worker extension, no live arena) and "live arena", a fresh engine in its own process (random
weights from the config, load_format="dummy", the same gpu_memory_utilization), then the worker's
`memory_report()`. PASS when plain's KV cache minus the live arena's is 2 x slot - freed within
TOLERANCE of the freed memory (without the correction it is 2 x slot: off by all of it).

    python3 scripts/gpu/check_live_arena_kv.py [--config qwen2.5-0.5b] [--utilization 0.3]
                                               [--cuda-graphs] [--graph-pairs]

--cuda-graphs starts the engines with CUDA graphs (else enforce_eager); --graph-pairs (with
--cuda-graphs) adds an engine on the graph-pairs backend, whose KV cache must also leave room
for its second graph set. Each engine's KV capacity in tokens is vLLM's own ("GPU KV cache size").
Prints one line per engine and a verdict; exit 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import argparse
import json
import re
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
TOLERANCE = 0.10  # of the weights' size
CHILD_TIMEOUT_S = 300


BACKENDS = {"plain": None, "live arena": "shadowsync_live_arena",
            "graph pairs": "shadowsync_graph_pairs"}


def child(model_dir: str, utilization: float, engine: str, cuda_graphs: bool) -> None:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm import LLM

    import shadowsync.vllm  # noqa: F401  registers the shadowsync weight-transfer backends

    backend = BACKENDS[engine]
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              gpu_memory_utilization=utilization, enforce_eager=not cuda_graphs,
              max_model_len=1024, seed=0, worker_extension_cls="shadowsync.vllm.WorkerExtension",
              **({"weight_transfer_config": {"backend": backend}} if backend else {}))
    print("RESULT " + json.dumps(llm.collective_rpc("memory_report")[0]), flush=True)


def run(model_dir: str, utilization: float, engine: str, cuda_graphs: bool) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", model_dir, str(utilization),
                           engine, "1" if cuda_graphs else "0"], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"[live-arena-kv] the {engine} engine failed (exit "
                         f"{proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(lines[-1][len("RESULT "):])
    # vLLM's own count of the KV cache's capacity, from its log line.
    tokens = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", proc.stdout + proc.stderr)
    report["kv_tokens"] = int(tokens[-1].replace(",", "")) if tokens else None
    return report


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="qwen2.5-0.5b")
    parser.add_argument("--utilization", type=float, default=0.3)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="engines with CUDA graphs (default: enforce_eager)")
    parser.add_argument("--graph-pairs", action="store_true",
                        help="also an engine on the graph-pairs backend (needs --cuda-graphs)")
    args = parser.parse_args()
    if args.graph_pairs and not args.cuda_graphs:
        parser.error("--graph-pairs needs --cuda-graphs (graph pairs are two sets of CUDA graphs)")
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_vllm_update

    # The engines (and the processes vLLM spawns) import shadowsync of this checkout.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "python")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

    gib = 2**30
    with tempfile.TemporaryDirectory(prefix="ss-kv-") as model_dir:
        bench_vllm_update.make_checkpoint(model_dir, args.config, "cuda", dummy_load=True)
        plain = run(model_dir, args.utilization, "plain", args.cuda_graphs)
        live = run(model_dir, args.utilization, "live arena", args.cuda_graphs)
        pairs = run(model_dir, args.utilization, "graph pairs", True) if args.graph_pairs else None
    accounting = live["live_arena"] or {}
    freed = accounting.get("freed_torch_bytes", 0)
    added = 2 * accounting.get("slot_bytes", 0) - freed  # what the live arena really adds
    less = plain["kv_cache_bytes"] - live["kv_cache_bytes"]
    print(f"[live-arena-kv] {args.config}, gpu_memory_utilization {args.utilization}: KV cache "
          f"plain {plain['kv_cache_bytes'] / gib:.3f} GiB, live arena "
          f"{live['kv_cache_bytes'] / gib:.3f} GiB (arena 2 x {accounting.get('slot_bytes', 0) / gib:.3f}"
          f" GiB, torch memory freed by the move {freed / gib:.3f} GiB, vLLM's weights memory "
          f"{(accounting.get('model_memory_usage_before') or 0) / gib:.3f} -> "
          f"{(accounting.get('model_memory_usage_after') or 0) / gib:.3f} GiB, corrected: "
          f"{accounting.get('corrected')})", flush=True)
    for name, report in (("plain", plain), ("live arena", live), ("graph pairs", pairs)):
        if report is not None:
            graphs = (report["live_arena"] or {}).get("graph_sets_bytes")
            print(f"[live-arena-kv] {name}: KV cache {report['kv_cache_bytes'] / gib:.3f} GiB, "
                  f"{report['kv_tokens']} tokens"
                  + (f" ({report['kv_tokens'] / plain['kv_tokens']:.1%} of plain's)"
                     if report["kv_tokens"] and plain["kv_tokens"] else "")
                  + ("" if graphs is None else f"; both graph sets took {graphs / gib:.3f} GiB"),
                  flush=True)
    ok = freed > 0 and abs(less - added) <= TOLERANCE * freed
    print(f"[live-arena-kv] {'PASS' if ok else 'FAIL'}: the live arena's KV cache is "
          f"{less / gib:.3f} GiB smaller; the arena adds {added / gib:.3f} GiB (2 x slot - freed; "
          f"expected within {TOLERANCE:.0%} of the freed {freed / gib:.3f} GiB; counting the "
          f"weights twice would make it {(added + freed) / gib:.3f})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
