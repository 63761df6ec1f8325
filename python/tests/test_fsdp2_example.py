"""examples/fsdp2_trainer.py under torchrun: two FSDP2 gloo ranks stream every step into an engine.

* ``--engine vllm --steps 2 --check --engine-replicas 2`` (skipped without vllm and
  transformers): a tiny Llama streamed into two generating vLLMs (CPU), data-parallel replicas
  started by ranks 0 and 1. The bytes each replica's engine rank received, printed per update
  from weight_update_stats, are the routing plan's, which is every parameter byte; after the last
  step a fresh vLLM of the checkpoint assembled from the ranks' saved shards answers as each
  streamed replica does (the example's check). About 40 s on the 2-core machine alone.
* ``--engine stand-in --steps 2``: the stand-in engine (two engine ranks needing the parts of a
  tensor-parallel layout): each received the plan's bytes, every parameter byte reaches the engine
  (the row-parallel bias, needed by both engine ranks, twice); each rank's packing memory is
  printed. About 13 s.

Skipped without torch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_trainer.py"
STEPS = 2
TIMEOUT_S = 300  # a hung example fails the test instead of the whole run


def _ints(text):
    return [int(v) for v in text.split(",")]


def _run(*args):
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--steps", str(STEPS), *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ))
    tail = f"\nstdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 0, f"the example exited with {out.returncode}{tail}"
    return out, tail


def _example():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import fsdp2_trainer
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return fsdp2_trainer


def _updates_received_the_plan(out, tail, engine_ranks: int):
    """The plan's bytes per engine rank and the ranks' memory lines, after checking that every
    update received the plan's bytes."""
    plan = re.search(rf"^\[trainer\] plan: 2 trainer ranks -> {engine_ranks} engine ranks, bytes "
                     rf"per engine rank \[([\d, ]+)\]$", out.stdout, re.M)
    assert plan, f"no plan line{tail}"
    planned = _ints(plan.group(1))
    updates = re.findall(r"^\[trainer\] update (\d+): loss [\d.]+, bytes per engine rank "
                         r"\[([\d, ]+)\], transfer [\d.]+ ms, engine stop [\d.]+ ms", out.stdout,
                         re.M)
    assert [int(v) for v, _ in updates] == list(range(1, STEPS + 1)), f"updates {updates}{tail}"
    for _, received in updates:
        assert _ints(received) == planned, tail
    memory = re.findall(r"^\[trainer rank (\d)\] holds (\d+) parameter bytes, sends (\d+) per "
                        r"update; packing memory (\d+) bytes", out.stdout, re.M)
    assert sorted(int(r) for r, *_ in memory) == [0, 1], tail
    assert sum(int(sent) for _, _, sent, _ in memory) == sum(planned)
    return planned, memory


def test_fsdp2_trainer_streams_every_step_into_vllm():
    """Into two vLLM engines (data-parallel replicas, one started by each trainer rank): the
    ranks pack each bucket once, and both engines take every update and answer as a fresh vLLM
    of the trained checkpoint."""
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    out, tail = _run("--engine", "vllm", "--check", "--engine-replicas", "2")
    planned, memory = _updates_received_the_plan(out, tail, engine_ranks=1)
    replica = re.findall(r"^\[replica 1\] update (\d+): loss [\d.]+, bytes per engine rank "
                         r"\[([\d, ]+)\]", out.stdout, re.M)
    assert [(int(v), _ints(b)) for v, b in replica] == [
        (v, planned) for v in range(1, STEPS + 1)], tail
    # Independently of the plan: one engine rank (no tensor parallelism) reads every byte.
    total = sum(p.nbytes for p in _example().build_llama(torch, torch.float32).parameters())
    assert planned == [total], (planned, total)
    assert sum(int(held) for _, held, _, _ in memory) == total
    assert re.search(r"^\[trainer\] update \d+: .*\(publish to live [\d.]+ ms; \d+ generate calls "
                     r"while it streamed\)$", out.stdout, re.M), tail
    assert re.search(r"^\[trainer\] check: greedy tokens of each of the 2 streamed replicas "
                     r"equal a fresh vLLM of the trained checkpoint .*: PASSED$", out.stdout,
                     re.M), tail


def test_fsdp2_trainer_streams_every_step_into_the_stand_in_engine():
    out, tail = _run("--engine", "stand-in")
    planned, memory = _updates_received_the_plan(out, tail, engine_ranks=2)
    engine = re.findall(r"^\[engine\] rank (\d): update (\d+) live: (\d+) bytes received",
                        out.stderr, re.M)
    assert sorted((int(v), int(e), int(b)) for e, v, b in engine) == [
        (v, e, planned[e]) for v in range(1, STEPS + 1) for e in range(2)], tail
    # Independently of the plan: every parameter byte once, the row-parallel bias twice.
    model = _example().build_mlp(torch)
    total = sum(p.nbytes for p in model.parameters())
    assert sum(planned) == total + model[2].bias.nbytes, (planned, total)
    assert sum(int(held) for _, held, _, _ in memory) == total
