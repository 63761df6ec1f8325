"""shadowsync.vllm.outside_torchrun: a process started inside it sees none of torchrun's
variables (vLLM's workers, spawned while vLLM starts, would otherwise join torchrun's store), and
the rank's environment is whole again after it, also when the body raises. No vLLM or torch
needed."""

import json
import os
import subprocess
import sys

import pytest

from shadowsync.vllm import outside_torchrun
from shadowsync.vllm.torchrun_env import TORCHRUN_VARIABLES

TORCHRUN = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "1", "LOCAL_RANK": "1",
            "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _child_environment() -> dict:
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, check=True, timeout=60).stdout)


def test_a_process_started_inside_sees_none_of_torchruns_variables(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHADOWSYNC_TEST_KEPT", "yes")
    with outside_torchrun():
        inside = _child_environment()
    assert not set(TORCHRUN) & set(inside), sorted(set(TORCHRUN) & set(inside))
    assert not set(TORCHRUN_VARIABLES) & set(inside), sorted(set(TORCHRUN_VARIABLES) & set(inside))
    assert inside["SHADOWSYNC_TEST_KEPT"] == "yes"  # nothing else is taken away
    assert {name: os.environ.get(name) for name in TORCHRUN} == TORCHRUN


def test_the_environment_is_restored_when_the_body_raises(monkeypatch):
    for name, value in TORCHRUN.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match="vLLM failed to start"):
        with outside_torchrun():
            assert "RANK" not in os.environ
            raise RuntimeError("vLLM failed to start")
    assert {name: os.environ.get(name) for name in TORCHRUN} == TORCHRUN
