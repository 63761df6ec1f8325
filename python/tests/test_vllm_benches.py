"""The two real-vLLM benchmarks (bench/bench_vllm_update.py, bench/bench_vllm_pacing.py) run to the
end on vLLM's CPU build with a tiny model. Their figures mean little on a CPU; what this guards
is that they still run: they share pieces, and on the GPU machine, where device time is scarce,
bench_vllm_pacing.py once stopped at once with "AttributeError: 'Namespace' object has no
attribute 'live_arena'" after bench_vllm_update.py gained options. Skipped where vllm, torch or
transformers are not importable. Each starts vLLM's multiprocess engine (about 50-90 s here)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("vllm", "torch", "transformers"):
    pytest.importorskip(_module)

BENCH = Path(__file__).resolve().parents[2] / "bench"
TIMEOUT_S = 420  # a hung benchmark fails its test instead of the whole run
# The decode windows, shorter than the benchmarks' defaults (baseline 3 or 2 s, 1 s between
# updates): the engine decodes through them with a core busy, and one second of baseline held
# over 300 of the tiny model's steps on a 2-core machine.
WINDOWS = ("--baseline-s", "1", "--gap-s", "0.5")


def run_bench(script: str, out: Path, *args: str) -> dict:
    command = [sys.executable, str(BENCH / script), "--device", "cpu", "--config", "tiny",
               "--requests", "4", "--max-tokens", "64", *WINDOWS, "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ))
    tail = f"\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{script} exited with {done.returncode}{tail}"
    result = out / (Path(script).stem + ".json")
    assert result.is_file(), f"{script} wrote no {result.name}{tail}"
    return json.loads(result.read_text())


def test_pacing_bench_runs_every_budget(tmp_path):
    # A 4 s baseline (the bench's default is 2 s): CI's other lanes spin vLLM workers on the same
    # two cores, and one stall as long as a 2 s window left it without a whole inter-token gap.
    report = run_bench("bench_vllm_pacing.py", tmp_path, "--budgets", "none,1.5", "--updates", "1",
                       "--checksums", "both", "--trace-steps", "--baseline-s", "4")
    assert "error" not in report["result"], report["result"]["error"]
    runs = report["result"]["runs"]
    assert [(run["checksums"], run["budget"]) for run in runs] == [
        (True, None), (True, 1.5), (False, None), (False, 1.5)], runs
    buckets = {}
    for run in runs:
        assert len(run["updates"]) == 1, run
        update = run["updates"][0]
        assert update["transfer_ms"] > 0, update
        assert update["pacing"]["paced"] is (run["budget"] is not None), update
        buckets.setdefault(run["checksums"], set()).add(update["header_buckets"])
        # --trace-steps: the engine's steps from the baseline to the update, split into windows.
        steps = run["steps"]
        assert steps["baseline"]["steps"] > 0 and steps["baseline"]["mean_ms"] > 0, steps["baseline"]
        (traced,) = steps["updates"]
        assert traced["last_32_before"]["steps"] > 0, traced
        assert traced["last_32_before_begin"]["steps"] >= traced["last_32_before"]["steps"], traced
    # The trainer really sent (or left out) its checksum block: one bucket more with checksums.
    assert len(buckets[False]) == 1 and buckets[True] == {b + 1 for b in buckets[False]}, buckets


def test_update_bench_runs_every_path(tmp_path):
    # Paced (the goals' setting); the same transfer unpaced runs in the pacing bench's test above.
    # --trainer-ranks 2: a sharded trainer takes the shadowsync path's engine over after its run
    # (host memory, HostBackend, on the CPU): no engine start of its own; then --gather-ranks 2:
    # two ranks that all-gather every tensor (gloo) and publish from rank 0.
    report = run_bench("bench_vllm_update.py", tmp_path, "--updates", "2", "--trace-steps",
                       "--paths", "vllm,shadowsync,copy", "--decode-slowdown-budget", "2.0",
                       "--trainer-ranks", "2", "--gather-ranks", "2")
    paths = report["configs"]["tiny"]
    assert sorted(paths) == ["copy", "shadowsync", "shadowsync-gather-2", "shadowsync-ranks-2",
                             "vllm"], sorted(paths)
    for name, path in paths.items():
        assert "error" not in path, f"{name}: {path.get('error')}"
        assert len(path["updates"]) == 2, f"{name}: {path['updates']}"
    # shadowsync's updates reach the engine; the copy reference's bytes never do, and it copied
    # the whole model each time.
    assert paths["shadowsync"]["output_changed_by_update"] is True, paths["shadowsync"]
    copy = paths["copy"]
    assert copy["output_changed_by_update"] is False, copy
    assert copy["setup"]["bytes"] == paths["shadowsync"]["setup"]["bytes"] > 0, (
        copy["setup"], paths["shadowsync"]["setup"])
    assert all(update["copier_ms"] > 0 for update in copy["updates"]), copy["updates"]
    # The load recorded its requests' first tokens (at least one per request slot), and each
    # swap says whether a prefill shared its steps.
    shadowsync = paths["shadowsync"]
    assert shadowsync["requests_started"] >= 4, shadowsync["requests_started"]
    # (None where the swap fell where no request was between two tokens: a busy CPU can put every
    # request's step elsewhere; then no gap holds the swap.)
    for u in shadowsync["updates"]:
        if math.isnan(u["swap_gaps_ms"]):
            assert "swap_step_admitted" not in u and u["engine_stop_ms"] is None, u
        else:
            assert isinstance(u["swap_step_admitted"], bool), u
    # Paced by a budget: each update says how long the receiver held it, complete, for a step
    # that started after its last bucket (from the worker's weight_update_stats).
    assert all(isinstance(u["clean_step_missed"], bool) and u["clean_step_wait_ms"] >= 0
               for u in shadowsync["updates"]), shadowsync["updates"]
    # Every path's updates say the decode time they cost.
    assert all("decode_lost_ms" in path["summary"] for path in paths.values()), paths
    # The sharded trainer: its updates reach the engine; each update's routes carried exactly the
    # plan's bytes into the engine rank (counted at the transport), the ranks' rows cover the
    # model once, and each rank's peak is its rows plus the transport's two staging slots.
    ranks = paths["shadowsync-ranks-2"]
    setup = ranks["setup"]
    assert ranks["output_changed_by_update"] is True and ranks["trainer_ranks"] == 2, ranks
    assert ranks["engine_rank_bytes_equal_plan"] is True, ranks
    assert all(u["engine_rank_bytes"] == setup["bytes_to_engine_rank"]
               for u in ranks["updates"]), (setup, ranks["updates"])
    memory = ranks["trainer_rank_memory"]
    assert sum(m["held_bytes"] for m in memory) == sum(setup["bytes_from_trainer_rank"]) == \
        sum(setup["bytes_to_engine_rank"]) > 0, (memory, setup)
    assert all(m["staging_bytes"] == 2 * m["max_packed_bytes"] > 0 and
               m["peak_bytes"] == m["held_bytes"] + m["staging_bytes"] for m in memory), memory
    # The gathering trainer: the gathered model reaches the engine (its random rows are not the
    # one-process trainer's), its ranks' rows are the model's bytes once, and only rank 0 sends.
    gather = paths["shadowsync-gather-2"]
    assert gather["output_changed_by_update"] is True and gather["gather_ranks"] == 2, gather
    memory = gather["trainer_rank_memory"]
    assert sum(m["held_bytes"] for m in memory) == shadowsync["setup"]["bytes"], (
        memory, shadowsync["setup"])
    assert memory[0]["staging_bytes"] > 0 == memory[1]["staging_bytes"], memory
    assert all(len(u["trainer_rank_sent_ms"]) == 2 for u in gather["updates"]), gather["updates"]


def test_every_switch_of_the_update_bench_reaches_its_child():
    # Each path runs in a child process made from child_passthrough(args): a switch left out there
    # is silently off in the measured engine (--gated-swaps once was: its runs measured the
    # synchronous remap).
    import argparse

    sys.path.insert(0, str(BENCH))
    import bench_vllm_update as bench

    switches = [a.option_strings[0] for a in bench.build_parser()._actions
                if isinstance(a, argparse._StoreTrueAction)]
    assert switches, "no switches found"
    parent = bench.build_parser().parse_args(switches)
    child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                             "--child", "shadowsync"])
    missing = [s for s in switches if not getattr(child, s.lstrip("-").replace("-", "_"))]
    assert not missing, f"switches the child does not get: {missing}"
    # The placement options too: a child on one GPU with the trainer beside it would measure
    # another layout than the one asked for.
    parent = bench.build_parser().parse_args(["--tp", "2", "--transport", "nccl",
                                              "--trainer-gpu", "3"])
    child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                             "--child", "vllm"])
    assert (child.tp, child.transport, child.trainer_gpu) == (2, "nccl", 3), child
    parent = bench.build_parser().parse_args(["--progress-poll-s", "0.02"])
    child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                             "--child", "shadowsync"])
    assert child.progress_poll_s == 0.02, child
    # The model each process builds and how its engine loads it: a child without them would
    # build the whole model into a bf16 engine beside a trainer of fewer layers.
    parent = bench.build_parser().parse_args(["--layers", "24", "--quantization", "fp8"])
    child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                             "--child", "shadowsync"])
    assert (child.layers, child.quantization) == (24, "fp8"), child
    # The sharded trainers run in the shadowsync path's child; another path's child ignores them.
    parent = bench.build_parser().parse_args(["--trainer-ranks", "1,2,4", "--gather-ranks", "2"])
    child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                             "--child", "shadowsync"])
    assert (child.trainer_ranks, child.gather_ranks) == ([1, 2, 4], [2]), child
    # Every option with choices, each choice (--commit-mode auto once stayed in the parent: its
    # run measured the coordinated commit).
    for action in bench.build_parser()._actions:
        for choice in action.choices or ():
            flag, name = action.option_strings[0], action.dest
            if flag == "--child":
                continue  # the child's own
            parent = bench.build_parser().parse_args([flag, choice])
            child = bench.build_parser().parse_args([*bench.child_passthrough(parent),
                                                     "--child", "shadowsync"])
            assert getattr(child, name) == choice, (flag, choice)


def test_a_child_runs_its_own_path_not_the_parents_default_paths(monkeypatch):
    # A child sees --paths' default (vllm among them): the IPC refusal must look at its one path,
    # or every TP=2 same-host shadowsync run fails in its child (seen on 2x H200, f71125a).
    sys.path.insert(0, str(BENCH))
    import bench_vllm_update as bench

    parent = bench.build_parser().parse_args(["--tp", "2", "--paths", "shadowsync"])
    monkeypatch.setattr(sys, "argv", ["bench_vllm_update.py", *bench.child_passthrough(parent),
                                      "--child", "shadowsync"])
    child = bench.parse_args()
    assert (child.child, child.tp, child.device) == ("shadowsync", 2, "cuda"), child


@pytest.mark.parametrize("args,message", [
    (["--device", "cpu", "--transport", "nccl"], "NCCL and a trainer GPU need --device cuda"),
    (["--tp", "2", "--transport", "nccl", "--trainer-gpu", "1"],
     "GPU 1 is one of the engine's (0..1) and NCCL refuses two ranks of one communicator on one "
     "GPU; pick a GPU >= 2"),
    (["--tp", "0"], "--tp 0: the tensor-parallel size is at least 1"),
    (["--progress-poll-s", "0"], "--progress-poll-s 0.0: a positive, finite number of seconds"),
    (["--tp", "2"], "vLLM's IPC backend (the vllm path's with --transport same-host) hands each "
                    "worker its own GPU's handles"),
    (["--paths", "vllm", "--trainer-gpu", "1"], "runs with one worker on the trainer's GPU only"),
    (["--device", "cpu", "--quantization", "fp8"],
     "--quantization fp8 with --device cpu: vLLM's FP8 kernels run on CUDA only"),
    (["--quantization", "fp8", "--live-arena"],
     "--quantization fp8 with --live-arena: the live arena's remap has not been shown with FP8 "
     "weights; use --graph-pairs"),
    (["--quantization", "fp8", "--swap-strategy", "remap"],
     "--quantization fp8 with --swap-strategy remap: shadowsync swaps an FP8 engine's updates "
     "in by copy_in, or with --graph-pairs or --backend shadowsync by graph pairs' rebind"),
    (["--layers", "0"], "--layers 0: a model has at least 1 decoder layer"),
    (["--paths", "vllm", "--trainer-ranks", "2"],
     "the sharded trainers run after the shadowsync path, on its engine; add shadowsync"),
    (["--trainer-ranks", "2,0"], "each at least 1 and none twice"),
    (["--gather-ranks", "2", "--transport", "nccl", "--trainer-gpu", "1"],
     "--gather-ranks with --transport nccl: rank 0 publishes the gathered tensors over the "
     "same-host transport"),
    (["--layers", "99", "--config", "tiny-moe"],
     "--layers 99 with --config tiny-moe: tiny-moe has 2 layers; pick 1..2"),
])
def test_the_update_bench_refuses_a_placement_nccl_or_vllm_cannot_run(args, message, tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "bench_vllm_update.py"), "--out",
                           str(tmp_path), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, (done.returncode, done.stderr)
    assert not list(tmp_path.iterdir()), "a refused run wrote outputs"


def _timeline(long_steps: dict, admitting: tuple, until: float = 1.6):
    """A DecodeLoad that saw 4 requests step every 5 ms until `until`, except the steps in
    `long_steps` (end time -> length, s); a request was admitted by each step ending at a time in
    `admitting` (its first token arrives with that step's outputs)."""
    sys.path.insert(0, str(BENCH))
    import bench_vllm_update as bench

    load = bench.DecodeLoad.__new__(bench.DecodeLoad)
    load.tokens, load.gaps = [], []
    ends, t = [], 0.0
    while t < until:
        t += next((length for end, length in long_steps.items()
                   if abs(t + length - end) < 1e-9), 0.005)
        ends.append(t)
    for request in range(4):
        for a, b in zip(ends, ends[1:]):
            load.gaps.append((a + request * 1e-5, b + request * 1e-5, 1))
            load.tokens.append((b, 1))
    load.first_tokens = [end + 2e-5 for end in admitting]
    return load


def test_the_update_bench_marks_swaps_that_share_a_step_with_a_prefill():
    # The steps ending at 0.500 s and 1.300 s admit a request and take 15 ms. Update 1's swap
    # falls in the admitting step at 0.500 s, update 2's in an ordinary step at 1.100 s, update
    # 3's in the ordinary step right before the admitting one at 1.300 s (the next gap counts too).
    load = _timeline({0.5: 0.015, 1.3: 0.015}, admitting=(0.5, 1.3))
    windows = [(0.45, 0.55, {"swap_started_at": 0.49, "swap_ms": 0.2}),
               (1.05, 1.15, {"swap_started_at": 1.098, "swap_ms": 0.2}),
               (1.25, 1.35, {"swap_started_at": 1.2825, "swap_ms": 0.2})]
    result = load.analyse(0.05, 0.45, windows)
    first, second, third = result["updates"]
    assert first["swap_step_admitted"] is True and first["engine_stop_ms"] > 9, first
    assert second["swap_step_admitted"] is False and second["engine_stop_ms"] < 0.1, second
    assert third["swap_step_admitted"] is True and third["engine_stop_ms"] > 9, third
    summary = result["summary"]
    assert summary["swap_step_admitted_count"] == 2, summary
    assert summary["engine_stop_ms_not_admitting"]["median"] < 0.1, summary
    assert summary["engine_stop_ms"]["max"] > 9, summary  # the measure itself counts every update
    assert first["engine_stop_like_for_like_ms"] is None  # that baseline had no admitting step
    assert summary["engine_stop_like_for_like_ms"]["count"] == 1, summary  # update 2 only
    # A baseline holding the admitting step at 0.500 s: its length is reported.
    baseline = load.analyse(0.05, 1.0, windows)["baseline"]
    assert baseline["admitting_step_ms_median"] == pytest.approx(15.0, abs=0.05), baseline


def test_the_floor_without_admitting_steps_leaves_them_out():
    # Every 50 ms a 15 ms step admits a request: about a quarter of the baseline's pairs of
    # steps hold one, so the full floor's p90 is ~10 ms and the floor without them ~0.
    admitting = tuple(round(0.1 + 0.05 * k, 3) for k in range(8))
    load = _timeline({end: 0.015 for end in admitting}, admitting=admitting, until=0.6)
    baseline = load.analyse(0.05, 0.5, [])["baseline"]
    assert baseline["stop_floor_ms_p90"] == pytest.approx(10.0, abs=0.1), baseline
    assert baseline["stop_floor_not_admitting_ms_p90"] == pytest.approx(0.0, abs=0.05), baseline
    assert baseline["stop_floor_not_admitting_ms_median"] == pytest.approx(0.0, abs=0.05), baseline


def test_the_update_bench_compares_each_swap_gap_with_a_step_of_its_kind():
    # Admitting steps take 15 ms (0.300 and 0.500 s in the baseline). Update 1's swap falls in
    # an admitting step that took 17 ms (ending at 1.002 s): 2 ms like for like, 12 ms against
    # the median step. Update 2's in an ordinary step that took 8 ms (1.300 s): 3 ms either way.
    # Update 3's in an ordinary step before an admitting one of 18 ms (1.598 s): the next gap
    # counts, 3 ms. Update 4's in two admitting steps of 13 ms in a row (1.896 and 1.909 s): 2 ms
    # shorter than their kind, 0 and not below. (Each long step starts where the steps before it
    # ended.)
    load = _timeline({0.3: 0.015, 0.5: 0.015, 1.002: 0.017, 1.3: 0.008, 1.598: 0.018,
                      1.896: 0.013, 1.909: 0.013},
                     admitting=(0.3, 0.5, 1.002, 1.598, 1.896, 1.909), until=2.1)
    windows = [(0.95, 1.05, {"swap_started_at": 0.99, "swap_ms": 0.2}),
               (1.25, 1.35, {"swap_started_at": 1.295, "swap_ms": 0.2}),
               (1.55, 1.65, {"swap_started_at": 1.577, "swap_ms": 0.2}),
               (1.85, 1.95, {"swap_started_at": 1.89, "swap_ms": 0.2})]
    result = load.analyse(0.05, 0.6, windows)
    stops = [u["engine_stop_like_for_like_ms"] for u in result["updates"]]
    assert stops == pytest.approx([2.0, 3.0, 3.0, 0.0], abs=0.05), result["updates"]
    assert [u["engine_stop_ms"] for u in result["updates"]] == \
        pytest.approx([12.0, 3.0, 13.0, 8.0], abs=0.05), result["updates"]
    like = result["summary"]["engine_stop_like_for_like_ms"]
    assert (like["median"], like["max"], like["count"]) == pytest.approx((2.5, 3.0, 4)), like


def test_the_gathering_trainer_reassembles_every_tensor_in_row_order():
    # --gather-ranks' gather, every rank simulated in this process: each rank's rows as
    # shard_regions splits them (uneven: 7 rows over 3 ranks; a rank without rows of a 2-row
    # tensor), padded and all-gathered as FSDP2's full_tensor() does; rank 0 must hold each
    # tensor exactly, the other ranks nothing.
    import torch

    sys.path.insert(0, str(BENCH))
    from vllm_update.gather_transfer import gathered
    from vllm_update.shard_regions import shard0_regions

    specs = [("w", "float32", (7, 3)), ("b", "float32", (2,)), ("s", "float32", ()),
             ("even", "float32", (6, 2))]
    count = 3
    full = {name: torch.randn(shape) for name, _, shape in specs}
    regions = shard0_regions(specs, count)
    shape_of = {name: shape for name, _, shape in specs}
    shards = [{name: full[name][begin[0]:end[0]] if shape_of[name] else full[name]
               for name, _, begin, end in rank_regions} for rank_regions in regions]
    # The pieces every rank contributes to the k-th all-gather (each rank's call k is the same
    # parameter: gathered() walks specs in order).
    pieces: list[list] = [[] for _ in range(count)]
    for rank in range(count):
        gathered(torch, specs, shards[rank], rank, count,
                 lambda out, piece, rank=rank: pieces[rank].append(piece.clone()),
                 torch.float32, "cpu")

    calls = iter(range(len(pieces[0])))

    def all_gather(out, piece):  # as torch.distributed's: equal pieces, out their count
        k = next(calls)
        assert all(pieces[r][k].shape == piece.shape for r in range(count)), k
        assert out.shape[0] == count * piece.shape[0], (out.shape, piece.shape)
        out.copy_(torch.cat([pieces[r][k] for r in range(count)]))

    got = gathered(torch, specs, shards[0], 0, count, all_gather, torch.float32, "cpu")
    for name, _, _ in specs:
        assert torch.equal(got[name], full[name]), (name, got[name], full[name])
    others = gathered(torch, specs, shards[1], 1, count, lambda out, piece: None, torch.float32,
                      "cpu")
    assert all(t is None for t in others.values()), others


def test_a_trainer_ranks_error_is_answered_while_another_rank_is_silent():
    # A gathering rank that fails leaves the others waiting in a collective: the driver must get
    # the failed rank's error at once, not a timeout.
    import multiprocessing

    sys.path.insert(0, str(BENCH))
    from vllm_update.sharded_transfer import RankPipes

    silent, silent_child = multiprocessing.Pipe()
    failed, failed_child = multiprocessing.Pipe()
    pipes = RankPipes([silent, failed])
    failed_child.send(("error", "trainer rank 1: RuntimeError: boom"))
    assert pipes.poll(5.0)  # not the whole 5 s: rank 1's answer is an error
    assert pipes.recv() == ("error", "trainer rank 1: RuntimeError: boom")
    silent_child.send(("sent", 0.5, 10))
    failed_child.send(("sent", 0.7, 20))
    assert pipes.poll(5.0) and pipes.recv() == ("sent", 0.7)
    assert not pipes.poll(0.05)  # nothing more came
