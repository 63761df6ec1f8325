"""bench/bench_fsdp2_gather.py under torchrun on two gloo ranks (CPU, the tiny config): it
gathers a real FSDP2 model to rank 0 both ways and sets a ShardedPublisher up, and its JSON says
so with the model's own byte count. Figures are not checked (a benchmark measures; it does not
pass or fail on them). About 15 s. Skipped without torch or transformers."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_fsdp2_gather.py"


def test_the_gather_bench_runs_every_variant(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(BENCH), "--config", "tiny", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240)
    tail = f"\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, tail
    result = json.loads((tmp_path / "bench_fsdp2_gather.json").read_text())
    assert (tmp_path / "bench_fsdp2_gather.md").is_file()
    # The tiny Llama in bf16: 2 layers, hidden 128, vocab 320 (bench/vllm_update/configs.py).
    hidden, inter, vocab, layers, kv = 128, 256, 320, 2, 2 * 32
    per_layer = hidden * (hidden + kv + kv + hidden) + 3 * hidden * inter + 2 * hidden
    assert result["model_bytes"] == 2 * (2 * vocab * hidden + layers * per_layer + hidden), result
    for variant in ("gather_all", "gather_bucketed"):
        assert len(result[variant]["seconds"]) == 1 and result[variant]["seconds_median"] > 0, \
            result[variant]
    sharded = result["sharded"]
    assert len(sharded) == 2, sharded
    assert sum(rank["held_bytes"] for rank in sharded) == result["model_bytes"], sharded
    assert all(rank["staging_bytes"] > 0 for rank in sharded), sharded
