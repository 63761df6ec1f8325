"""Real vLLM CPU with tensor_parallel_size=2 (two worker processes, one core each): an update
streams in while vLLM generates, both ranks hold it ready and shadowsync.vllm.commit_update makes
it live on both between the same two steps (a commit of a version no rank holds ready is refused
on every rank and flips none); the ranks' step versions agree at every step and the
answers equal a fresh TP=2 vLLM of the new checkpoint, back and forth, and still do after
close_weight_update_group (scripts/vllm_e2e.py --tp 2, which exits non-zero on any difference). Before that, a set-up the workers refuse is raised on
the front end and leaves every rank as it was. Without LoRA also --reinit: a third update, the
close keeps it, a second group with a new trainer commits a fourth.

With LoRA: vLLM also serves adapter lora_int_id 1 and every update carries a new adapter in its
own group (PEFT tensors) with the base; each rank's LoRA shards land in its slot of vLLM's
stacked LoRA buffers, and the answers of requests with the adapter equal a fresh TP=2 vLLM that
loaded the new checkpoint and adapter (--lora)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("lora", [False, True], ids=["base", "base_and_lora"])
def test_two_tensor_parallel_ranks_commit_each_update_at_the_same_step(lora):
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_e2e.py"), "--device", "cpu",
                          "--tp", "2"] + (["--lora"] if lora else ["--reinit"]),
                         capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[vllm-e2e]")]
    assert out.returncode == 0, "\n".join(lines) + "\n" + out.stderr[-3000:]
    assert any("step versions of the 2 ranks agree" in line for line in lines), lines
    # before, after the refused set-up and after set-up; each update (2, or 4 with --reinit, and
    # the self-checked one); after each close (and the second set-up with --reinit)
    updates = 3 if lora else 5
    assert sum("answers equal a fresh vLLM" in line for line in lines) == \
        (7 if lora else 11), lines
    assert sum(line.startswith("[vllm-e2e] update ") for line in lines) == updates, lines
    # The self-check passed on both ranks: every parameter of each rank's shard matched.
    assert sum("(self-check: every parameter matched the live copy" in line
               for line in lines) == 1, lines
    if lora:  # every answer is that of a request with the adapter, against one with it
        assert sum("with adapter L" in line for line in lines) == 7, lines
    # A set-up the workers refuse (a trainer tensor load_weights does not take) is raised on the
    # front end with the tensor's name; no rank is set up and the engine goes on (a worker that
    # raised would have ended vLLM's TP engine).
    assert any(line.startswith("[vllm-e2e] ok") and "does not take refused" in line
               for line in lines), lines
    # A commit of a version no rank holds ready: refused on every rank, nothing flipped anywhere.
    assert sum("refused on every rank" in line and line.startswith("[vllm-e2e] ok")
               for line in lines) == updates
