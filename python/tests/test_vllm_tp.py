"""Real vLLM CPU with tensor_parallel_size=2 (two worker processes, one core each), in one run
of scripts/vllm_e2e.py --tp 2 --lora --reinit (which exits non-zero on any difference): an update
streams in while vLLM generates, both ranks hold it ready and shadowsync.vllm.commit_update makes
it live on both between the same two steps (a commit of a version no rank holds ready is refused
on every rank and flips none); the ranks' step versions agree at every step and the answers
equal a fresh TP=2 vLLM of the new checkpoint, back and forth, and still do after
close_weight_update_group; the second group (--reinit) has commit_mode "auto", and its update goes
live in both ranks' step hooks at one step (step_agreement.py), with no commit_update. Last, a sharded trainer of two rank processes (--trainer-ranks 2) takes
the engine over, each rank sending only its shards over the same-host pull transport, and each
engine rank receiving only its own parameters' bytes; then one of its ranks is SIGKILLed
mid-update (the update fails on both engine ranks, nothing goes live) and a restarted trainer's
update applies. Before that, a set-up the workers refuse is raised on the front end
and leaves every rank as it was. --reinit: a third update leaves the engine on B, the close keeps
it, and a second group with a new trainer commits one more (update 5; update 4 is the
self-checked one).

LoRA throughout: vLLM also serves adapter lora_int_id 1 and every update carries a new adapter in
its own group (PEFT tensors) with the base; each rank's LoRA shards land in its slot of vLLM's
stacked LoRA buffers. At every stage both the requests without an adapter (the base model
alone) and those with the adapter answer as a fresh TP=2 vLLM (enable_lora) of the new checkpoint
that loaded the new adapter. Three TP=2 engines start: the references of A and B, and the
engine under test. A second run does the same for a MoE model (qwen3_moe, its experts packed by
vLLM CPU), without LoRA, its sharded trainer of four rank processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


# Stages whose answers are checked: before set-up, after the refused set-up, after set-up, after
# each of the 5 updates, after each of the 2 closes, after the second set-up; then the sharded
# trainer's: after its set-up, after each of its 2 updates, after a rank was killed mid-update,
# after that group's close, after the restarted trainer's update, after its close.
STAGES = 11 + 7
UPDATES = 5 + 3
TRAINER_RANKS = 2


def run_e2e(*args: str) -> tuple[list[str], list[str]]:
    """scripts/vllm_e2e.py --device cpu --tp 2 ARGS, one core per rank: its [vllm-e2e] lines and
    those of them that say ok; a non-zero exit fails the test with its log."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_e2e.py"), "--device", "cpu",
                          "--tp", "2", *args],
                         capture_output=True, text=True, timeout=900, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("[vllm-e2e]")]
    assert out.returncode == 0, "\n".join(lines) + "\n" + out.stderr[-3000:]
    return lines, [line for line in lines if line.startswith("[vllm-e2e] ok")]


def test_two_tensor_parallel_ranks_commit_each_update_at_the_same_step():
    lines, ok = run_e2e("--lora", "--reinit", "--trainer-ranks", str(TRAINER_RANKS))
    # Both sets of answers at every stage: the base model alone, and with the adapter (each
    # against the adapter the reference loaded from its directory).
    assert sum("answers equal a fresh vLLM" in line for line in ok) == 2 * STAGES, lines
    assert sum("answers equal a fresh vLLM of" in line and "(requests without an adapter)" in line
               for line in ok) == STAGES, lines
    assert sum("answers equal a fresh vLLM of" in line and " with adapter L" in line
               for line in ok) == STAGES, lines
    # The stages saw both checkpoints and both adapters, back and forth.
    for want in ("A (requests", "B (requests", "A with adapter L1", "B with adapter L2"):
        assert sum(f"a fresh vLLM of {want}" in line for line in ok) >= 2, (want, lines)
    assert sum(line.startswith("[vllm-e2e] update ") for line in lines) == UPDATES, lines
    # The four groups' updates (before and after the second init_weight_update_group, the sharded
    # trainer's and the restarted sharded trainer's).
    assert sum("step versions of the 2 ranks agree" in line for line in ok) == 4, lines
    # The second group's commit_mode "auto": its update went live in both ranks' step hooks (the
    # step agreement), at the same step (the step versions above), with no commit_update.
    assert sum("update 5 went live in the step hooks of the 2 ranks (commit_mode auto" in line
               for line in ok) == 1, lines
    # The self-check passed on both ranks: every parameter of each rank's shard matched.
    assert sum("(self-check: every parameter matched the live copy" in line
               for line in lines) == 1, lines
    # A set-up the workers refuse (a trainer tensor load_weights does not take) is raised on the
    # front end with the tensor's name; no rank is set up and the engine goes on (a worker that
    # raised would have ended vLLM's TP engine).
    assert any("does not take refused" in line for line in ok), lines
    # A commit of a version no rank holds ready: refused on every rank, nothing flipped anywhere
    # (at each update but the commit_mode "auto" group's, which no commit makes live).
    assert sum("refused on every rank" in line for line in ok) == UPDATES - 1, lines
    # The sharded trainer: its ranks built one routing plan from the engine ranks' needs; one of
    # another fingerprint is refused naming both; each engine rank received exactly the bytes
    # its own parameters read (less than the wire: it holds half of each sharded layer).
    assert any(f"{TRAINER_RANKS} trainer ranks built one routing plan" in line
               for line in ok), lines
    assert any("a routing plan of another fingerprint refused, nothing set up" in line
               for line in ok), lines
    assert any("routed bytes per engine rank" in line for line in ok), lines
    # A trainer rank SIGKILLed mid-update: the update failed on both engine ranks, neither holds
    # it ready, nothing went live (the answers after it are A's, counted in STAGES); a restarted
    # trainer's update applies.
    assert any("trainer rank 1 SIGKILLed mid-update 3: failed on every engine rank [1, 1]" in line
               for line in ok), lines


MOE_TRAINER_RANKS = 4


def test_a_tensor_parallel_moe_engine_takes_updates_into_its_packed_experts():
    """qwen3_moe with tensor_parallel_size=2 (scripts/vllm_e2e.py --arch qwen3_moe --tp 2): each
    rank holds its slice of every expert, repacked by vLLM CPU for its grouped GEMM; each rank's
    plan writes its slice of the trainer's experts into that packed order. Three updates, the
    third self-checked, each token for token against a fresh TP=2 vLLM; the ranks commit at the
    same steps. Then a sharded trainer of 4 rank processes takes the engine over (each engine
    rank receives only its slices of their shards), its last rank is SIGKILLed mid-update, and a
    restarted trainer's update applies. (No LoRA: vLLM CPU serves none for MoE layers.)"""
    lines, ok = run_e2e("--arch", "qwen3_moe", "--trainer-ranks", str(MOE_TRAINER_RANKS))
    # Before set-up, after the refused set-up, after set-up, after each update, after the close;
    # then the sharded trainer's 7 (as in the dense run above).
    assert sum("answers equal a fresh vLLM of" in line for line in ok) == 7 + 7, lines
    assert sum(line.startswith("[vllm-e2e] update ") for line in lines) == 3 + 3, lines
    assert sum("step versions of the 2 ranks agree" in line for line in ok) == 1 + 2, lines
    assert sum("(self-check: every parameter matched the live copy" in line
               for line in lines) == 1, lines
    assert any(f"{MOE_TRAINER_RANKS} trainer ranks built one routing plan" in line
               for line in ok), lines
    assert any("routed bytes per engine rank" in line for line in ok), lines
    assert any(f"trainer rank {MOE_TRAINER_RANKS - 1} SIGKILLed mid-update 3: failed on every "
               f"engine rank [1, 1]" in line for line in ok), lines
