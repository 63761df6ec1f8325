"""TRL's GRPOTrainer in server mode with shadowsync.trl on vLLM's CPU build: two GRPO steps of a
tiny random Llama against vLLM's OpenAI server (its own process, with the worker extension), the
weights synced by shadowsync, and after each sync the engine's parameters equal the trainer's bit
for bit.

What makes it shadowsync's path and not TRL's: the worker's receiver counts every byte it
received (weight_update_stats through vLLM's /collective_rpc), and this test wants exactly the
trainer's bytes per sync and the version live that the sync published. (TRL's own path cannot
run here anyway: it needs CUDA.) The engine's parameters are read with vLLM's own /weight_checker
(a sha256 per parameter) and compared with the trainer's tensors in vLLM's fused layout.

Skipped where trl, vllm, torch or transformers are not importable. Starts vLLM's server (about
30 s on two cores); the two steps take seconds."""

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

for _module in ("trl", "vllm", "torch", "transformers", "datasets"):
    pytest.importorskip(_module)

from vllm_models import make_tiny_model  # noqa: E402

STEPS = 2
SERVER_START_TIMEOUT_S = 240  # vLLM's server on two busy cores takes 20-60 s
# The server, with the quantization that keeps vLLM CPU's linear weights as the parameters it
# computes with (an installed shadowsync registers it through its vLLM plugin; a source checkout
# has no entry point, so the server process registers it before vLLM parses its arguments).
SERVER = ("import runpy, sys; from shadowsync.vllm import unpacked; unpacked.register(); "
          "sys.argv[0] = 'api_server'; "
          "runpy.run_module('vllm.entrypoints.openai.api_server', run_name='__main__')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """vLLM's OpenAI server of a tiny Llama, with shadowsync's worker extension: (base URL,
    model path). Its log is printed when it fails to start."""
    import requests

    import shadowsync

    model = make_tiny_model("llama", tmp_path / "tiny-llama")
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING",
               # vLLM's processes import this test's shadowsync (a checkout or an installation)
               PYTHONPATH=os.pathsep.join(filter(None, [
                   str(Path(shadowsync.__file__).resolve().parent.parent),
                   os.environ.get("PYTHONPATH")])))
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", SERVER, "--model", model, "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
             "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager", "--seed", "0",
             "--quantization", "shadowsync_unpacked",
             "--worker-extension-cls", "shadowsync.vllm.WorkerExtension"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"vLLM's server exited with {process.returncode} while starting:\n"
                            f"{log_path.read_text(errors='replace')[-6000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server not up after {SERVER_START_TIMEOUT_S} s:\n"
                            f"{log_path.read_text(errors='replace')[-6000:]}")
            try:
                if requests.get(f"{base_url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.5)  # polling a server that is starting: the deadline above fails it
        yield base_url, model
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _vllm_layout(hf_params: dict) -> dict:
    """The trainer's tensors as vLLM's Llama holds them: q/k/v fused into qkv_proj and gate/up
    into gate_up_proj (rows stacked in that order), the others as they are."""
    import torch

    fused = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    out, used = {}, set()
    for name in hf_params:
        for target, parts in fused.items():
            if f".{parts[0]}." in name:
                names = [name.replace(parts[0], part) for part in parts]
                out[name.replace(parts[0], target)] = torch.cat([hf_params[n] for n in names])
                used.update(names)
    for name, tensor in hf_params.items():
        if name not in used:
            out[name] = tensor
    return out


def _sha256(tensor) -> str:
    return hashlib.sha256(
        tensor.detach().cpu().contiguous().view(-1).view(dtype=__import__("torch").uint8)
        .numpy()).hexdigest()


def _post(base_url: str, route: str, body: dict) -> dict:
    import requests

    response = requests.post(f"{base_url}{route}", json=body, timeout=120)
    assert response.status_code == 200, f"{route}: HTTP {response.status_code}: {response.text}"
    return response.json()


@pytest.fixture
def shadowsync_trl():
    import shadowsync.trl

    shadowsync.trl.enable()
    yield
    shadowsync.trl.disable()  # TRL's own methods back for whatever runs next in this process


def test_grpo_server_mode_syncs_through_shadowsync(server, shadowsync_trl, tmp_path):
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    base_url, model_path = server
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    expected_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def reward(completions, **_):
        # Differs between a prompt's completions, so GRPO's advantages (and the update) are not 0.
        return [float(sum(map(ord, c)) % 7) for c in completions]

    config = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=8, learning_rate=1e-2, bf16=False,
        use_cpu=True, report_to="none", logging_steps=1, save_strategy="no", seed=0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=base_url,
        vllm_server_timeout=60, vllm_importance_sampling_correction=False)
    dataset = datasets.Dataset.from_dict({"prompt": ["abc", "hello", "xyz", "qrs"] * 4})

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    assert trainer.vllm_generation.mode == "server"

    # After each of TRL's syncs: the engine's receiver statistics and its parameters.
    syncs = []
    sync_weights = trainer.vllm_generation.sync_weights

    def checked_sync_weights():
        sync_weights()
        stats = _post(base_url, "/collective_rpc", {"method": "weight_update_stats"})["results"]
        engine = _post(base_url, "/weight_checker", {"action": "checksum"})["checksums"]
        engine = {name.split(":", 4)[-1]: digest for name, digest in engine.items()}
        trainer_side = {name: _sha256(t) for name, t in _vllm_layout(
            {n: p.data for n, p in trainer.model.named_parameters()}).items()}
        syncs.append((stats[0], engine, trainer_side))

    trainer.vllm_generation.sync_weights = checked_sync_weights
    trainer.train()

    # TRL syncs before generating at each step: STEPS syncs, the second after an optimizer step.
    assert len(syncs) == STEPS, f"{len(syncs)} syncs in {STEPS} GRPO steps"
    for version, (stats, engine, trainer_side) in enumerate(syncs, start=1):
        assert stats["applied_version"] == version, (version, stats)
        assert stats["updates_failed"] == 0, stats["last_update_error"]
        assert stats["bytes_received"] == version * expected_bytes, (
            f"sync {version}: the engine's receiver received {stats['bytes_received']} bytes in "
            f"all, expected {version} x {expected_bytes} (the trainer's parameters)")
        assert set(engine) == set(trainer_side), (sorted(engine), sorted(trainer_side))
        differing = sorted(n for n in engine if engine[n] != trainer_side[n])
        assert not differing, f"sync {version}: engine parameters differ from the trainer's: " \
                              f"{differing}"
    # The second sync carried trained weights: otherwise equal bytes would prove little.
    changed = sorted(n for n in syncs[0][2] if syncs[0][2][n] != syncs[1][2][n])
    assert changed, "the trainer's weights did not change between the two syncs"


# --- what is refused, with what to do (no server needed) ----------------------------------------

class _Response:
    def __init__(self, status_code: int, body: str):
        self.status_code, self.text, self.content = status_code, body, body.encode()

    def json(self):
        import json

        return json.loads(self.text)


class _Client:
    base_url = "http://127.0.0.1:1"  # only named in messages: requests.post is replaced


def test_rpc_names_what_the_server_lacks(monkeypatch):
    import json

    import requests

    from shadowsync import InvalidArgumentError, NotSupportedError
    from shadowsync.trl import _rpc

    def answer(status: int, body: str):
        monkeypatch.setattr(requests, "post", lambda *args, **kwargs: _Response(status, body))

    answer(404, '{"detail":"Not Found"}')
    with pytest.raises(NotSupportedError, match="VLLM_SERVER_DEV_MODE=1"):
        _rpc(_Client(), "has_weight_update_group", timeout=1)
    # vLLM's answer when the worker has no such method (no extension):
    answer(500, json.dumps({"error": {"message": (
        "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has "
        "no attribute 'has_weight_update_group''"), "code": 500}}))
    with pytest.raises(NotSupportedError,
                       match="--worker-extension-cls shadowsync.vllm.WorkerExtension"):
        _rpc(_Client(), "has_weight_update_group", timeout=1)
    # A refusal of the worker extension reaches the trainer whole, not as HTTP's retries.
    answer(500, json.dumps({"error": {"message": "Worker failed with error 'start vLLM with "
                                                 "quantization=\"shadowsync_unpacked\"'"}}))
    with pytest.raises(InvalidArgumentError, match='init_weight_update_group .* failed '
                                                   r'\(HTTP 500\): .*shadowsync_unpacked'):
        _rpc(_Client(), "init_weight_update_group", {}, timeout=1)


def test_enable_refuses_a_trl_without_the_methods(monkeypatch):
    import trl.generation.vllm_client as vllm_client

    import shadowsync.trl
    from shadowsync import InvalidArgumentError

    class OtherClient:
        def init_communicator(self, device=0):
            pass

        def update_named_params(self, named_params):  # another signature
            pass

    monkeypatch.setattr(vllm_client, "VLLMClient", OtherClient)
    with pytest.raises(InvalidArgumentError, match=r"update_named_params takes \('self', "
                                                   r"'named_params'\).*install trl==1\.16\.0"):
        shadowsync.trl.enable()
    del OtherClient.update_named_params
    with pytest.raises(InvalidArgumentError, match="has no VLLMClient.update_named_params"):
        shadowsync.trl.enable()
    assert not shadowsync.trl.is_enabled()
    assert OtherClient.init_communicator.__qualname__.startswith("test_enable_refuses")
