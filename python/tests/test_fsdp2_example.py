"""examples/fsdp2_trainer.py under torchrun: two FSDP2 gloo ranks stream two steps into the
example's stand-in engine (two engine ranks). The bytes each engine rank received, printed per
update by the trainer and by the engine, are the routing plan's; every parameter byte reaches
the engine (the row-parallel bias, needed by both engine ranks, twice); each rank's packing memory
is printed. Skipped without torch."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp2_trainer.py"
STEPS = 2
TIMEOUT_S = 180  # a hung example fails the test instead of the whole run


def _ints(text):
    return [int(v) for v in text.split(",")]


def test_fsdp2_trainer_example_streams_every_step():
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(EXAMPLE), "--steps", str(STEPS)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ))
    tail = f"\nstdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 0, f"the example exited with {out.returncode}{tail}"

    plan = re.search(r"^\[trainer\] plan: 2 trainer ranks -> 2 engine ranks, bytes per engine "
                     r"rank \[([\d, ]+)\]$", out.stdout, re.M)
    assert plan, f"no plan line{tail}"
    planned = _ints(plan.group(1))
    updates = re.findall(r"^\[trainer\] update (\d+): loss [\d.]+, bytes per engine rank "
                         r"\[([\d, ]+)\], transfer [\d.]+ ms", out.stdout, re.M)
    assert [int(v) for v, _ in updates] == list(range(1, STEPS + 1)), f"updates {updates}{tail}"
    for _, received in updates:
        assert _ints(received) == planned, tail
    engine = re.findall(r"^\[engine\] rank (\d): update (\d+) live: (\d+) bytes received",
                        out.stderr, re.M)
    assert sorted((int(v), int(e), int(b)) for e, v, b in engine) == [
        (v, e, planned[e]) for v in range(1, STEPS + 1) for e in range(2)], tail

    # Independently of the plan: every parameter byte once, the row-parallel bias twice.
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from fsdp2_trainer import build_model
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    model = build_model(torch)
    total = sum(p.nbytes for p in model.parameters())
    assert sum(planned) == total + model[2].bias.nbytes, (planned, total)

    memory = re.findall(r"^\[trainer rank (\d)\] holds (\d+) parameter bytes, sends (\d+) per "
                        r"update; packing memory (\d+) bytes", out.stdout, re.M)
    assert sorted(int(r) for r, *_ in memory) == [0, 1], tail
    assert sum(int(held) for _, held, _, _ in memory) == total
    assert sum(int(sent) for _, _, sent, _ in memory) == sum(planned)
