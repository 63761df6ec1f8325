"""The README's vLLM quick start runs, and what it makes live is right: the engine's greedy tokens
after its three updates equal a fresh vLLM's loaded with the trainer's final weights, token for
token, and differ from the tokens before the updates.

The block under README's ``<!-- quick start: vllm ... -->`` runs as written except its two
settings lines (the model and device; the engine options), which name a tiny random Qwen2
checkpoint made here (no download) and, on vLLM's CPU build, the options the README's comment
gives for it (plus a small KV cache). A check made of plain vLLM calls follows at the end of its
main(), in the same process.
Skipped where vllm, torch or transformers are not importable; on a machine with CUDA it runs on
GPU 0 (``QUICK_START_DEVICE=cuda``; ``scripts/gpu/vllm_runs.sh`` runs it that way).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

for _module in ("vllm", "torch", "transformers"):
    pytest.importorskip(_module)

import vllm_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- quick start: vllm"
TIMEOUT_S = 420  # two engine starts on two cores; a hung run fails the test, not the suite

MODEL_LINE = re.compile(r"^    model, device = .*$", re.M)
OPTIONS_LINE = re.compile(r"^    options = .*$", re.M)
GUARD = '\n\nif __name__ == "__main__":' 
CPU_OPTIONS = dict(quantization="shadowsync_unpacked", enforce_eager=True, max_model_len=128,
                   kv_cache_memory_bytes=64 << 20, seed=0)
GPU_OPTIONS = dict(gpu_memory_utilization=0.3, max_model_len=256, seed=0)

# vLLM's CPU build needs the "shadowsync_unpacked" method registered in this process: an installed
# package does that through its vllm.general_plugins entry point, a checkout through this line.
PROLOGUE = "import shadowsync.vllm.unpacked; shadowsync.vllm.unpacked.register()\n"

# At the end of the README's main(): the updated weights as a checkpoint, and a fresh engine of
# them. On the CPU that engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 read anew:
# vLLM cached its environment when the README's engine started): no engine-core and worker
# processes to start, and the same tokens (test_vllm_real.py's engines of both kinds agree).
EPILOGUE = textwrap.indent(textwrap.dedent("""
    import json as _json, shutil as _shutil
    _updated = os.path.join(os.environ["QUICK_START_WORK"], "updated")
    policy.save_pretrained(_updated)
    for _name in os.listdir(model):
        if _name.startswith(("tokenizer", "special_tokens")):
            _shutil.copy(os.path.join(model, _name), _updated)
    _stats = llm.collective_rpc("weight_update_stats")[0]
    llm.collective_rpc("close_weight_update_group")
    sender.close()
    llm.llm_engine.engine_core.shutdown()
    if device == "cpu":
        import vllm.envs as _envs
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        _envs.disable_envs_cache()
    _fresh = vllm.LLM(_updated, dtype="bfloat16", **options)
    _expected = _fresh.generate(["The capital of France is"], greedy)[0].outputs[0].token_ids
    print("QUICK-START-RESULT " + _json.dumps(dict(
        before=list(before), after=list(after), expected=list(_expected),
        applied_version=_stats["applied_version"], bytes_received=_stats["bytes_received"],
        layout_bytes=sum(t.bytes for g in layout.groups for t in g.tensors))), flush=True)
"""), "    ")


def quick_start_block() -> str:
    """The python block under the README's quick-start marker."""
    text = (ROOT / "README.md").read_text()
    at = text.find(MARKER)
    assert at >= 0, f"README.md has no '{MARKER}' marker"
    block = re.search(r"```python\n(.*?)```", text[at:], re.S)
    assert block, "no ```python block follows README.md's quick-start marker"
    return block.group(1)


def script_for(device: str, model: str) -> str:
    """The README's block with its settings lines replaced and the check at the end of main()."""
    block = quick_start_block()
    for line, what in ((MODEL_LINE, "model, device = ..."), (OPTIONS_LINE, "options = ...")):
        assert len(line.findall(block)) == 1, (
            f"the quick start's settings line '{what}' is not in the README's block once: "
            f"update it here with the README")
    assert block.count(GUARD) == 1, "the quick start does not end with its __main__ guard"
    options = CPU_OPTIONS if device == "cpu" else GPU_OPTIONS
    block = MODEL_LINE.sub(lambda _: f"    model, device = {model!r}, {device!r}", block)
    block = OPTIONS_LINE.sub(lambda _: f"    options = {options!r}", block)
    block = block.replace(GUARD, "\n" + EPILOGUE + GUARD)
    return (PROLOGUE if device == "cpu" else "") + block


def test_the_readme_quick_start_updates_vllm_token_for_token(tmp_path):
    device = os.environ.get("QUICK_START_DEVICE", "cpu")
    # A Qwen2 (tied embeddings, biases) like the README's model; initializer_range 0.1 so the
    # layers, not the input embedding, decide the greedy tokens (see vllm_models).
    model = vllm_models.make_tiny_model("qwen2", tmp_path / "model", seed=1,
                                        initializer_range=0.1)
    script = tmp_path / "quick_start.py"
    script.write_text(script_for(device, model))
    env = dict(os.environ, QUICK_START_WORK=str(tmp_path))
    if os.environ.get("SHADOWSYNC_TEST_INSTALLED") != "1":
        # The checkout's package, for this process and vLLM's spawned ones.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=TIMEOUT_S, env=env)
    tail = f"\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    assert out.returncode == 0, f"the quick start exited with {out.returncode}{tail}"
    found = re.search(r"^QUICK-START-RESULT (.*)$", out.stdout, re.M)
    assert found, f"the quick start printed no result{tail}"
    result = json.loads(found.group(1))

    assert result["applied_version"] == 3, result
    assert result["bytes_received"] >= 3 * result["layout_bytes"], result
    assert result["after"] != result["before"], (
        f"the greedy tokens did not change over three updates: the check below could not tell a "
        f"lost update from a right one{tail}")
    assert result["after"] == result["expected"], (
        f"after the updates the engine answered {result['after']}, a fresh vLLM of the same "
        f"weights {result['expected']}{tail}")
    assert f"before: {result['before']} after: {result['after']}" in out.stdout, tail
