"""Real vLLM takes a trainer's update while it generates, and then answers exactly as a fresh vLLM
of the new checkpoint: the end-to-end check of the vLLM worker extension on one device.

    python3 scripts/vllm_e2e.py --device cuda          # one GPU: CUDA graphs on (vLLM's default)
    python3 scripts/vllm_e2e.py --device cpu           # vLLM's CPU build

Two tiny random Llama checkpoints A and B are made with transformers (no download). The
reference answers (greedy token ids of a few prompts) come from a fresh vLLM of A and of B, each
in its own process. The engine under test starts on A with the extension; a trainer process loads
B and A with transformers and serves the same-host transport (GPU memory on cuda, a shared memory
file on cpu); the worker joins it through collective_rpc with the trainer's own
named_parameters() as the layout (HF names: the worker derives the receive plan from vLLM's
load_weights). Then: answers unchanged after set-up; update 1 (B) streams while the engine keeps
generating; after apply_update the answers equal B's fresh vLLM token for token; update 2 (A)
back again. Exits non-zero on any difference; prints one line per stage. vLLM runs in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) so that collective_rpc runs between generate calls.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(ROOT / "python" / "tests"))
PROMPTS = [[1, 72, 101, 108, 108, 111], [1, 84, 104, 101, 32, 113, 117], [1, 50, 43, 50, 61]]
TOKENS = 24


def log(message: str) -> None:
    print(f"[vllm-e2e] {message}", flush=True)


def engine_kwargs(device: str, model: str, tp: int = 1) -> dict:
    kwargs = dict(model=model, max_model_len=256, max_num_seqs=8, seed=0, skip_tokenizer_init=True,
                  tensor_parallel_size=tp)
    if device == "cpu":
        import shadowsync.vllm.unpacked as unpacked

        unpacked.register()
        kwargs.update(dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                      quantization=unpacked.NAME)
    else:
        kwargs.update(dtype="bfloat16", gpu_memory_utilization=0.25, enforce_eager=False)
    return kwargs


def greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(device: str, model: str, tp: int) -> list[list[int]]:
    """Greedy answers of a fresh vLLM of `model`, in a process of its own."""
    out = subprocess.run([sys.executable, __file__, "--device", device, "--reference", model,
                          "--tp", str(tp)],
                         capture_output=True, text=True, timeout=400)
    if out.returncode != 0:
        raise RuntimeError(f"reference engine of {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def wait_ready(llm, version: int, timeout: float = 60.0) -> None:
    """Until every worker holds `version` ready (commit_mode coordinated)."""
    deadline = time.monotonic() + timeout
    while any(int(v) != version for v in llm.collective_rpc("ready_version")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"update {version} not ready on every worker after {timeout} s")
        time.sleep(0.005)


def trainer(conn, checkpoints: dict, device: str, path: str, token: bytes, bucket_bytes: int,
            receivers: int):
    """The trainer process: HF models of every version, one Sender over the same-host transport."""
    import torch
    import transformers

    import shadowsync as ss

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    models = {}
    for version, checkpoint in checkpoints.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        models[version] = model.to("cuda:0" if device == "cuda" else "cpu")
    named = {v: dict(m.named_parameters()) for v, m in models.items()}
    specs = [(n, str(p.dtype), tuple(p.shape)) for n, p in named[min(named)].items()]
    conn.send(("specs", specs))
    backend = ss.CudaBackend(0) if device == "cuda" else ss.HostBackend()
    layout = ss.Layout(specs, bucket_bytes=bucket_bytes)
    transport = ss.same_host_sender_transport(
        path, token, receivers, backend, slot_bytes=layout.groups[0].bucket_bytes,
        memory="device" if device == "cuda" else "host")
    sender = ss.Sender(layout, backend, transport)
    while True:
        message = conn.recv()
        if message[0] == "stop":
            break
        version, source = message[1], message[2]
        start = time.monotonic()
        handle = sender.publish(version, {n: t.detach() for n, t in named[source].items()})
        conn.send(("header", handle.header_bytes))
        handle.wait(120)
        conn.send(("sent", time.monotonic() - start, sum(g.arena_bytes for g in layout.groups)))
    sender.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    parser.add_argument("--bucket-bytes", type=int, default=64 << 10)
    parser.add_argument("--arch", default="llama", help="llama, qwen2 (biases, tied), qwen3, phi3")
    parser.add_argument("--multiprocess", action="store_true",
                        help="vLLM's default engine process (collective_rpc between steps)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor_parallel_size (> 1: multiprocess, coordinated commit)")
    args = parser.parse_args()
    if args.tp > 1:
        args.multiprocess = True
        if args.device == "cpu":
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tp))))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"
    import torch  # noqa: F401  (before vLLM: one NCCL/CUDA runtime in the process)
    from vllm import LLM

    if args.reference:
        print(json.dumps(greedy(LLM(**engine_kwargs(args.device, args.reference, args.tp)))))
        return 0

    from vllm_models import make_tiny_model

    import shadowsync as ss
    import shadowsync.vllm as ssv

    work = Path(tempfile.mkdtemp(prefix="vllm-e2e-"))
    # initializer_range 0.1: with the default 0.02 two random tied models can answer alike.
    a = make_tiny_model(args.arch, str(work / "A"), seed=1, initializer_range=0.1)
    b = make_tiny_model(args.arch, str(work / "B"), seed=2, initializer_range=0.1)
    started = time.monotonic()
    expected = {"A": reference(args.device, a, args.tp), "B": reference(args.device, b, args.tp)}
    log(f"{args.arch}, {'multiprocess' if args.multiprocess else 'in-process'} engine; "
        f"references of A and B from fresh engines in {time.monotonic() - started:.1f} s; "
        f"A {expected['A'][0][:6]}..., B {expected['B'][0][:6]}...")
    if expected["A"] == expected["B"]:
        log("FAIL: A and B answer alike; the check could not tell them apart")
        return 1

    llm = LLM(**engine_kwargs(args.device, a, args.tp),
              worker_extension_cls="shadowsync.vllm.WorkerExtension")
    failures = 0

    def check(stage: str, got, want: str) -> None:
        nonlocal failures
        same = got == expected[want]
        failures += not same
        log(f"{'ok  ' if same else 'FAIL'} {stage}: answers {'equal' if same else 'differ from'} "
            f"a fresh vLLM of {want}" + ("" if same else f" (got {got[0][:8]}, want {expected[want][0][:8]})"))

    check("before set-up", greedy(llm), "A")
    socket_dir = Path(tempfile.mkdtemp(prefix="ss-"))
    os.chmod(socket_dir, 0o700)
    path, token = str(socket_dir / "trainer.sock"), os.urandom(32)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=trainer, args=(child, {1: b, 2: a}, args.device, path, token,
                                                args.bucket_bytes, args.tp), daemon=True)
    process.start()
    kind, specs = parent.recv()
    settings = dict(bucket_bytes=args.bucket_bytes, same_host=dict(path=path, token=token),
                    track_request_versions=True)
    # Bad input first: a trainer tensor the model's load_weights does not take. Refused with its
    # name on every worker (under TP as a returned refusal: a raise would end vLLM's engine),
    # nothing set up, and the engine goes on answering.
    extra = ("model.layers.0.mlp.not_a_weight", specs[0][1], (4,))
    try:
        ssv.init_weight_update_group(llm, specs=specs + [extra], **settings)
        refused = "not refused"
    except ss.ShadowsyncError as error:
        refused = str(error)
    ok = extra[0] in refused and not any(llm.collective_rpc("has_weight_update_group"))
    failures += not ok
    log(f"{'ok  ' if ok else 'FAIL'} init with a tensor load_weights does not take refused, "
        f"nothing set up: {refused[:160]}")
    check("after the refused set-up", greedy(llm), "A")
    fingerprint = ssv.init_weight_update_group(llm, specs=specs, **settings)
    stats = llm.collective_rpc("weight_update_stats")[0]
    log(f"set-up: {len(specs)} trainer tensors, {stats['plan_copies']} plan copies, "
        f"fingerprint {fingerprint:#018x}")
    check("after set-up, before any update", greedy(llm), "A")

    for version, source, name in ((1, 1, "B"), (2, 2, "A")):
        parent.send(("publish", version, source))
        kind, header = parent.recv()
        llm.collective_rpc("begin_update", args=(header,))
        during = 0
        while not parent.poll():  # the engine keeps generating while the update streams
            during += sum(len(t) for t in greedy(llm))
        kind, seconds, nbytes = parent.recv()
        if args.tp > 1:  # every rank holds it ready; one collective_rpc makes it live on all
            wait_ready(llm, version)
            # A version no rank holds ready: refused on every rank, nothing flips anywhere.
            results = llm.collective_rpc("commit_update", args=(version + 100,))
            still = sorted({int(s["applied_version"]) for s in llm.collective_rpc("step_versions")})
            ok = (all("nothing was committed on any rank" in r.get("refused", "") for r in results)
                  and still == [version - 1])
            failures += not ok
            log(f"{'ok  ' if ok else 'FAIL'} commit_update({version + 100}) refused on every "
                f"rank, applied versions still {still}")
            applied = ssv.commit_update(llm, version, timeout=60)
        else:
            applied = ssv.apply_update(llm, version, timeout=60)
        log(f"update {version}: {nbytes} bytes sent in {seconds * 1e3:.1f} ms; {during} tokens "
            f"generated meanwhile; applied {applied}")
        check(f"after update {version}", greedy(llm), name)
    if args.tp > 1:
        logs = llm.collective_rpc("step_versions")
        same = all(log == logs[0] for log in logs)
        failures += not same
        log(f"{'ok  ' if same else 'FAIL'} step versions of the {args.tp} ranks "
            f"{'agree' if same else 'differ'}: {[log['transitions'] for log in logs]}, "
            f"steps {[log['steps'] for log in logs]}")
    versions = llm.collective_rpc("request_versions")[0]
    seen = sorted({v for segments in versions.values() for v, _ in segments})
    log(f"request_versions: {len(versions)} requests, versions seen {seen}")
    parent.send(("stop",))
    process.join(60)
    llm.collective_rpc("close_weight_update_group")
    log("PASSED" if failures == 0 else f"FAILED ({failures} stage(s))")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
