"""ShadowsyncInitInfo (engine_adapters/vllm/init_info.py) travels to vLLM's workers as plain data:
to_rpc() is JSON-safe (NCCL's unique id as base64 text) where the same-host token is a str, and
coerce() reads back the same info; the unique id is taken as bytes, base64 text or a list of ints
and refused, named, otherwise. Needs neither vllm nor torch."""

import base64
import json

import pytest

import shadowsync as ss
from shadowsync.vllm import ShadowsyncInitInfo

UNIQUE_ID = bytes(range(128))


def test_to_rpc_is_json_and_coerce_reads_back_the_same_info():
    for info in (ShadowsyncInitInfo(unique_id=UNIQUE_ID, world_size=3, specs=[("w", "bf16", (4, 8))]),
                 ShadowsyncInitInfo(same_host={"path": "/run/x/s.sock", "token": ss.make_token()},
                                    decode_slowdown_budget=1.1)):
        carried = json.loads(json.dumps(info.to_rpc()))
        back = ShadowsyncInitInfo.coerce(carried)
        assert back.to_rpc() == info.to_rpc()
        assert back.unique_id == info.unique_id


def test_the_unique_id_as_bytes_base64_or_a_list_of_ints_is_the_same():
    for form in (UNIQUE_ID, bytearray(UNIQUE_ID), base64.b64encode(UNIQUE_ID).decode(),
                 list(UNIQUE_ID)):
        assert ShadowsyncInitInfo(unique_id=form).unique_id == UNIQUE_ID


@pytest.mark.parametrize("bad, says", [
    ("not base64!", "is not the 128 bytes"),
    (b"short", "it has 5 bytes"),
    ([256] * 128, "is not the 128 bytes"),
    (12345, "is not the 128 bytes"),
])
def test_a_bad_unique_id_is_refused_naming_it(bad, says):
    with pytest.raises(ss.InvalidArgumentError, match="ShadowsyncInitInfo.unique_id") as refused:
        ShadowsyncInitInfo(unique_id=bad)
    assert says in str(refused.value)
