"""bench_vllm_update.py's command line: its options, the engine placements it refuses (shared with
scripts/vllm_e2e.py), and the options a path's child process is given."""

from __future__ import annotations

import argparse
import math

from .configs import (CONFIGS, DEFAULT_PATHS, GPU_MEMORY_UTILIZATION, PATHS, QUANTIZATIONS,
                      TRANSPORTS)


def parse_args(description: str):
    """The command line (sys.argv), checked: what cannot run is refused (exit 2) before anything
    starts. `description`: the --help text's."""
    parser = build_parser(description)
    args = parser.parse_args()
    refused = engine_options_error(args)
    if refused:
        parser.error(refused)
    if args.progress_poll_s is not None and not 0 < args.progress_poll_s < math.inf:
        parser.error(f"--progress-poll-s {args.progress_poll_s}: a positive, finite number of "
                     f"seconds")
    # A child runs its one path; --paths is the parent's (a child sees its default).
    paths = [args.child] if args.child else args.paths.split(",")
    refused = (layers_error(args) or quantization_error(args, paths)
               or sharded_trainers_error(args, paths))
    if refused:
        parser.error(refused)
    if (args.device == "cuda" and args.transport == "same-host"
            and (args.tp > 1 or args.trainer_gpu != 0) and "vllm" in paths):
        parser.error(f"--paths {args.paths} with --tp {args.tp} --trainer-gpu {args.trainer_gpu}: "
                     f"vLLM's IPC backend (the vllm path's with --transport same-host) hands each "
                     f"worker its own GPU's handles of a buffer packed on the trainer's GPU, so it "
                     f"runs with one worker on the trainer's GPU only (--tp 1 --trainer-gpu 0); "
                     f"use --transport nccl, or leave the vllm path out")
    return args


def engine_options_error(args) -> str | None:
    """Why the engine options in `args` (--backend, --live-arena, --graph-pairs, --tp, --device,
    --transport, --trainer-gpu) cannot run together, or None. Shared with scripts/vllm_e2e.py,
    whose engine takes the same options."""
    if sum(map(bool, (args.live_arena, args.graph_pairs, args.backend))) > 1:
        return ("--backend, --live-arena and --graph-pairs each name a weight-transfer backend: "
                "pick one")
    if args.tp < 1:
        return f"--tp {args.tp}: the tensor-parallel size is at least 1"
    return placement_error(args.device, args.transport, args.trainer_gpu, args.tp)


def layers_error(args) -> str | None:
    """Why --layers cannot apply to every config of --config, or None (an unknown config is
    left to the orchestrator, which names the known ones)."""
    if args.layers is None:
        return None
    if args.layers < 1:
        return f"--layers {args.layers}: a model has at least 1 decoder layer"
    for config in (c.strip() for c in args.config.split(",")):
        total = CONFIGS.get(config, {}).get("num_hidden_layers")
        if total is not None and args.layers > total:
            return (f"--layers {args.layers} with --config {config}: {config} has {total} "
                    f"layers; pick 1..{total} (--layers takes the first N of them)")
    return None


def quantization_error(args, paths: list[str]) -> str | None:
    """Why --quantization cannot run with the other options, or None. vLLM quantizes the bf16
    checkpoint while loading; shadowsync's receiver quantizes each update the same way and
    swaps it in by copy_in or, under graph pairs, by rebind (the extension refuses the rest at
    init: refused here first, before any engine starts)."""
    q = args.quantization
    if q is None:
        return None
    if args.device != "cuda":
        return (f"--quantization {q} with --device {args.device}: vLLM's FP8 kernels run on "
                f"CUDA only (its CPU build cannot run an FP8 engine); use --device cuda")
    if args.live_arena:
        return (f"--quantization {q} with --live-arena: the live arena's remap has not been "
                f"shown with FP8 weights; use --graph-pairs or --backend shadowsync (which "
                f"chooses graph pairs, or copy_in where they are not possible)")
    if args.swap_strategy not in (None, "copy_in"):
        return (f"--quantization {q} with --swap-strategy {args.swap_strategy}: shadowsync "
                f"swaps an FP8 engine's updates in by copy_in, or with --graph-pairs or "
                f"--backend shadowsync by graph pairs' rebind, which they choose themselves; "
                f"leave --swap-strategy out or pass copy_in")
    return None


def sharded_trainers_error(args, paths: list[str]) -> str | None:
    """Why --trainer-ranks or --gather-ranks cannot run with the other options, or None. The
    sharded trainers follow the shadowsync path's run on its engine, into the extension's own
    calls: routing, over the same-host pull transport or (--transport nccl) NCCL point-to-point
    routes; gathering, over the same-host transport from rank 0."""
    if args.trainer_ranks is None and args.gather_ranks is None:
        return None
    flag = "--trainer-ranks" if args.trainer_ranks is not None else "--gather-ranks"
    if "shadowsync" not in paths and not args.child:  # another path's child ignores it
        return (f"{flag} with --paths {','.join(paths)}: the sharded trainers run after "
                f"the shadowsync path, on its engine; add shadowsync to --paths")
    if args.gather_ranks is not None:
        if args.transport != "same-host":
            return (f"--gather-ranks with --transport {args.transport}: rank 0 publishes the "
                    f"gathered tensors over the same-host transport; use --transport same-host")
        if args.device == "cuda" and args.trainer_gpu != 0:
            return (f"--gather-ranks with --trainer-gpu {args.trainer_gpu}: the gathering ranks "
                    f"run on GPUs 0..M-1, rank 0 beside engine rank 0; leave --trainer-gpu at 0")
    return None


def rank_counts(text: str) -> list[int]:
    """--trainer-ranks' and --gather-ranks' value: comma-separated counts, each at least 1, none
    twice."""
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1 or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(
            f"{text!r}: comma-separated trainer rank counts, each at least 1 and none twice "
            f"(e.g. 1,2,4)")
    return counts


def placement_error(device: str, transport: str, trainer_gpu: int, tp: int) -> str | None:
    """Why a trainer on `trainer_gpu` sending over `transport` to `tp` engine ranks on GPUs
    0..tp-1 cannot run, or None."""
    if device != "cuda" and (transport == "nccl" or trainer_gpu != 0):
        return (f"--transport {transport} --trainer-gpu {trainer_gpu} with --device {device}: "
                f"NCCL and a trainer GPU need --device cuda")
    if transport == "nccl" and trainer_gpu < tp:
        return (f"--transport nccl --trainer-gpu {trainer_gpu} with --tp {tp}: GPU {trainer_gpu} "
                f"is one of the engine's (0..{tp - 1}) and NCCL refuses two ranks of one "
                f"communicator on one GPU; pick a GPU >= {tp}")
    return None


def build_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen2.5-0.5b,llama-3-8b",
                   help=f"comma-separated, of {sorted(CONFIGS)}")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int,
                   help="build each config with its first N decoder layers instead of all (the "
                        "same shapes; e.g. --layers 24 for Qwen3-30B-A3B, whose 48 layers do not "
                        "fit the trainer, the engine and the receiver's slots on one 141 GB GPU); "
                        "at most each config's own count")
    p.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="every engine of the run starts with quantization=QUANTIZATION (cuda "
                        "only): vLLM quantizes the bf16 checkpoint while loading, shadowsync's "
                        "receiver each update the same way (swapped by copy_in, or by rebind with "
                        "--graph-pairs; refused with --live-arena and another "
                        "--swap-strategy); the "
                        "vllm path runs vLLM's documented sequence unchanged")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help="comma-separated: vllm, shadowsync, copy (a reference: the model's bytes "
                        "copied in another process, no weights change)")
    p.add_argument("--copy-passes", type=int, default=2,
                   help="copy path: passes over the model's bytes per update (2: as many as "
                        "shadowsync's pack and receive)")
    p.add_argument("--out", help="output folder (default $OUT, else ./bench-vllm-update)")
    p.add_argument("--commit", help="the commit to name (default: git rev-parse of this checkout)")
    p.add_argument("--requests", type=int, default=32, help="concurrent decode requests")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--updates", type=int, default=5, help="measured updates per path")
    p.add_argument("--baseline-s", type=float, default=3.0, help="the no-update window")
    p.add_argument("--gap-s", type=float, default=1.0, help="decode time between updates")
    p.add_argument("--bucket-bytes", type=int, default=0,
                   help="shadowsync bucket size (0: the library's default, 512 MiB)")
    p.add_argument("--swap-strategy", choices=("copy_in", "remap", "rebind"),
                   help="shadowsync swap strategy (default: the extension's, copy_in under "
                        "CUDA graphs)")
    p.add_argument("--vllm-packed-bytes", type=int, default=1 << 30,
                   help="vLLM IPC packed buffer size (vLLM's default 1 GiB)")
    p.add_argument("--vllm-no-pause", action="store_true",
                   help="do not pause vLLM's scheduler around its update (not its documented flow)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (default: graphs on)")
    p.add_argument("--tp", type=int, default=1,
                   help="vLLM's tensor_parallel_size (its ranks on GPUs 0..tp-1); > 1: the "
                        "shadowsync path commits each update with commit_update_async "
                        "(coordinated) and compares the ranks' per-step versions")
    p.add_argument("--commit-mode", choices=("coordinated", "auto"), default="coordinated",
                   help="with --tp > 1, the shadowsync paths' commit_mode: coordinated (each "
                        "update goes live by commit_update_async, a collective_rpc between two "
                        "steps) or auto (the ranks' step hooks make it live at one step, agreed "
                        "over shared memory; apply_update_async returns once it is)")
    p.add_argument("--transport", choices=TRANSPORTS, default="same-host",
                   help="same-host: vLLM's IPC backend and shadowsync's same-host transport; "
                        "nccl: vLLM's NCCL backend and shadowsync's NCCL transport, the trainer "
                        "rank 0 of 1 + tp (on a GPU of its own: --trainer-gpu)")
    p.add_argument("--trainer-gpu", type=int, default=0,
                   help="the GPU the trainer of each path runs on (default 0, the engine's; with "
                        "--transport nccl it must be none of the engine's GPUs 0..tp-1)")
    p.add_argument("--trainer-ranks", type=rank_counts, metavar="M[,M...]",
                   help="shadowsync path: after its own run (one trainer process, full tensors), "
                        "a sharded trainer of each M in turn takes over the same engine: M rank "
                        "processes on --trainer-gpu (with --tp > 1: rank r on GPU r mod tp), "
                        "each holding only its rows of every tensor "
                        "(FSDP2-like Shard(0)) and publishing them over the same-host pull "
                        "transport (with --transport nccl: rank r on GPU --trainer-gpu + r, its "
                        "routes over NCCL point-to-point); reported as shadowsync-ranks-M")
    p.add_argument("--gather-ranks", type=rank_counts, metavar="M[,M...]",
                   help="shadowsync path: after its own run (and --trainer-ranks'), a sharded "
                        "trainer of each M in turn that gathers before it sends, as an FSDP2 "
                        "trainer does with full_tensor(): rank r on GPU r holds its rows, every "
                        "rank all-gathers every tensor each update, rank 0 keeps them and "
                        "publishes them over the same-host transport; reported as "
                        "shadowsync-gather-M (its update time includes the gather)")
    p.add_argument("--decode-slowdown-budget", type=float,
                   help="shadowsync path: pace the receive to this decode slowdown (e.g. 1.05)")
    p.add_argument("--backend", choices=("shadowsync",),
                   help="shadowsync path: weight_transfer_config {'backend': 'shadowsync'}, which "
                        "chooses the placement at load (graph pairs, the live arena, or in place; "
                        "the result's setup says which), as a user with no option gets it")
    p.add_argument("--live-arena", action="store_true",
                   help="shadowsync path: weight_transfer_config {'backend': "
                        "'shadowsync_live_arena'} (weights in a remap arena before graph capture; "
                        "swaps by remap)")
    p.add_argument("--graph-pairs", action="store_true",
                   help="shadowsync path: weight_transfer_config {'backend': "
                        "'shadowsync_graph_pairs'} (weights in the arena's two slots, vLLM's CUDA "
                        "graphs captured over each; a swap rebinds and switches graph sets)")
    p.add_argument("--no-gated-swaps", action="store_true",
                   help="shadowsync path with --live-arena: init_weight_update_group("
                        "gated_swaps=False) (the engine thread waits for the step in flight, "
                        "then remaps; default: the remap waits behind a gate on vLLM's stream "
                        "where the extension can place one)")
    p.add_argument("--trace-steps", action="store_true",
                   help="shadowsync path: trace vLLM's forward calls around each swap "
                        "(bench/vllm_step_trace.py; host and CUDA-event times per step, logged)")
    p.add_argument("--progress-poll-s", type=float,
                   help="shadowsync path: how often apply_update_async asks the workers whether "
                        "the update is live, and commit_update_async (--tp > 1) whether every "
                        "rank holds it ready (each ask is an RPC the engine thread serves between "
                        "two steps; their poll_s, default 0.02)")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help=f"vLLM's share of the GPU (default per config: {GPU_MEMORY_UTILIZATION})")
    p.add_argument("--dummy-load", action="store_true",
                   help="save only the config; vLLM makes random weights (load_format=dummy): faster")
    p.add_argument("--path-timeout-s", type=float, default=300, help="deadline of each subprocess")
    p.add_argument("--budget-s", type=float, default=570,
                   help="the whole run's deadline: a part that would start with less than 60 s "
                        "left is skipped (listed), a running one is cut at it")
    p.add_argument("--work-dir", help="where the checkpoints go (default: the system's temp)")
    p.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--make-checkpoint", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    return p


def child_passthrough(args) -> list[str]:
    """The options a path's child process is given: every one that shapes what it measures."""
    flags = ["--device", args.device, "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--updates", str(args.updates),
             "--baseline-s", str(args.baseline_s), "--gap-s", str(args.gap_s),
             "--bucket-bytes", str(args.bucket_bytes),
             "--vllm-packed-bytes", str(args.vllm_packed_bytes)]
    if args.swap_strategy:
        flags += ["--swap-strategy", args.swap_strategy]
    if args.backend:
        flags += ["--backend", args.backend]
    if args.decode_slowdown_budget:
        flags += ["--decode-slowdown-budget", str(args.decode_slowdown_budget)]
    if args.gpu_memory_utilization:
        flags += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.progress_poll_s is not None:
        flags += ["--progress-poll-s", str(args.progress_poll_s)]
    if args.layers is not None:
        flags += ["--layers", str(args.layers)]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    if args.trainer_ranks:
        flags += ["--trainer-ranks", ",".join(map(str, args.trainer_ranks))]
    if args.gather_ranks:
        flags += ["--gather-ranks", ",".join(map(str, args.gather_ranks))]
    flags += ["--commit-mode", args.commit_mode]
    flags += ["--copy-passes", str(args.copy_passes), "--tp", str(args.tp),
              "--transport", args.transport, "--trainer-gpu", str(args.trainer_gpu)]
    for flag in ("vllm_no_pause", "enforce_eager", "dummy_load", "live_arena", "graph_pairs",
                 "no_gated_swaps", "trace_steps"):
        if getattr(args, flag):
            flags.append("--" + flag.replace("_", "-"))
    return flags
