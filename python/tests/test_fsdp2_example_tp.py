"""examples/fsdp2_trainer.py under torchrun into a tensor-parallel vLLM (CPU): ``--engine vllm
--engine-tp 2 --steps 2 --check``. Two FSDP2 gloo ranks stream every step into one vLLM of two
ranks, whose updates go live only by ``commit_update`` (the coordinated commit: both ranks flip
at one step). Each engine rank received the routing plan's bytes on every update (its own
parameters'), and after the last step a fresh TP=2 vLLM of the checkpoint assembled from the
ranks' saved shards answers as the streamed engine does (the example's check). About 40 s on the
2-core machine alone. Skipped without torch, vllm or transformers."""

import re

import pytest

from test_fsdp2_example import STEPS, _run, _updates_received_the_plan

pytest.importorskip("torch")


def test_fsdp2_trainer_streams_every_step_into_a_tensor_parallel_vllm():
    pytest.importorskip("vllm")
    pytest.importorskip("transformers")
    out, tail = _run("--engine", "vllm", "--engine-tp", "2", "--check")
    planned, _ = _updates_received_the_plan(out, tail, engine_ranks=2)
    assert all(b > 0 for b in planned), (planned, tail)
    updates = re.findall(r"^\[trainer\] update (\d+): .*\(publish to live [\d.]+ ms; \d+ "
                         r"generate calls while it streamed\)$", out.stdout, re.M)
    assert [int(v) for v in updates] == list(range(1, STEPS + 1)), tail
    assert re.search(r"^\[trainer\] check: greedy tokens of the streamed engine equal a fresh vLLM "
                     r"of the trained checkpoint .*: PASSED$", out.stdout, re.M), tail
