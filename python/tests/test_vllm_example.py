"""examples/vllm_rl_loop.py runs to completion on vLLM's CPU build: an AsyncLLM generating while a
trainer process streams two updates into it. Skipped where vllm, torch or transformers are not
importable. Starts vLLM's multiprocess engine (about 30-60 s on two cores)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

for _module in ("vllm", "torch", "transformers"):
    pytest.importorskip(_module)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_rl_loop.py"
UPDATES = 2
TIMEOUT_S = 300  # a hung example fails the test instead of the whole run


def test_vllm_rl_loop_example_applies_every_update():
    # The example finds the checkout's shadowsync itself (and vLLM's processes inherit that); the
    # library comes from SHADOWSYNC_LIBRARY when the caller set it.
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu", "--updates", str(UPDATES),
         "--every-seconds", "1"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=dict(os.environ))
    tail = f"\nstdout:\n{out.stdout[-4000:]}\nstderr:\n{out.stderr[-4000:]}"
    assert out.returncode == 0, f"the example exited with {out.returncode}{tail}"
    versions = [int(v) for v in re.findall(r"^\[rl-loop\] update version=(\d+) ", out.stdout, re.M)]
    assert versions == list(range(1, UPDATES + 1)), f"update lines of versions {versions}{tail}"
    assert "[rl-loop] PASSED" in out.stdout, tail
