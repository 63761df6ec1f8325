"""The same-host transport through the Python API, across two real processes.

The trainer (this process) serves with ``same_host_sender_transport`` and publishes through a
Sender; the engine is a second process (multiprocessing, spawn: a fresh interpreter, as a vLLM
worker is) that builds its side from plain values only, the way a worker gets them from
collective_rpc: the socket path (str), the token (str or bytes) and its rank. Every live tensor the
engine reads after each update is sent back and compared byte for byte with what was published.
A wrong token is refused on both sides with a message that says so; bad arguments are refused
before anything listens."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import tempfile
import traceback

import pytest

import shadowsync as ss
from support import BASE, BUCKET_BYTES, DEADLINE_S, LORA, SPECS, pattern, tensors

TOKEN = "ssk1-ded952b6063bf160ed7d94ce93798cced35abbce9b811bd0d11a58d3eaf21707"
DEADLINE_MS = int(DEADLINE_S * 1000)


@pytest.fixture
def socket_path():
    directory = tempfile.mkdtemp(prefix="ss_same_host_")  # mode 0700, as the transport requires
    yield os.path.join(directory, "trainer.sock")
    shutil.rmtree(directory, ignore_errors=True)


def _engine(path: str, token, rank: int, conn) -> None:
    """The engine process: its transport from plain values, a Receiver, then one update per
    header the trainer sends; answers with every live tensor's bytes. Reports failures as
    ("error", class name, message)."""
    try:
        backend = ss.HostBackend()
        transport = ss.same_host_transport(path, token, rank, backend,
                                           connect_timeout_ms=DEADLINE_MS)
        layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
        receiver = ss.Receiver(layout, backend, transport,
                               ss.ReceiverConfig(update_deadline_ms=DEADLINE_MS))
        conn.send(("connected", repr(transport)))
        while True:
            message = conn.recv()
            if message is None:
                break
            version, header = message
            receiver.begin_update(header)
            receiver.wait_applied(version, DEADLINE_S)
            live = {s[0]: receiver.live_array(s[0]).tobytes() for s in SPECS}
            conn.send(("live", version, live))
        receiver.close()
        conn.send(("done",))
    except BaseException as error:  # noqa: BLE001 - everything goes back to the test
        conn.send(("error", type(error).__name__, f"{error}\n{traceback.format_exc()}"))


def _receive(conn, what: str):
    if not conn.poll(DEADLINE_S):
        pytest.fail(f"the engine process sent nothing within {DEADLINE_S} s ({what})")
    message = conn.recv()
    if message[0] == "error":
        pytest.fail(f"the engine process failed ({what}): {message[1]}: {message[2]}")
    return message


def _start_engine(path: str, token, rank: int = 1):
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_engine, args=(path, token, rank, child), daemon=True)
    process.start()
    child.close()
    return process, parent


def _join(process) -> None:
    process.join(DEADLINE_S)
    if process.is_alive():
        process.kill()
        process.join()
        pytest.fail(f"the engine process did not exit within {DEADLINE_S} s")


def test_two_processes_move_several_updates_byte_for_byte(socket_path):
    process, conn = _start_engine(socket_path, TOKEN)  # a str token: taken as UTF-8
    try:
        backend = ss.HostBackend()
        layout = ss.Layout(SPECS, bucket_bytes=BUCKET_BYTES)
        # The same token as bytes on this side: both spellings are one secret.
        transport = ss.same_host_sender_transport(
            socket_path, TOKEN.encode(), 1, backend, layout.groups[0].bucket_bytes,
            connect_timeout_ms=DEADLINE_MS)
        # No memory given: the backend's own (host memory for a HostBackend).
        assert "same_host sender" in repr(transport) and "(host memory)" in repr(transport)
        assert _receive(conn, "connect")[0] == "connected"
        assert not os.path.exists(socket_path)  # removed once every receiver came
        sender = ss.Sender(layout, backend, transport,
                           ss.SenderConfig(update_deadline_ms=DEADLINE_MS))
        live_version = {s[0]: 0 for s in SPECS}
        rounds = [BASE + LORA, LORA, BASE, BASE + LORA, LORA]
        for version, names in enumerate(rounds, start=1):
            handle = sender.publish(version, tensors(names, version))
            conn.send((version, handle.header_bytes))
            handle.wait(DEADLINE_S)
            for name in names:
                live_version[name] = version
            kind, got_version, live = _receive(conn, f"update {version}")
            assert (kind, got_version) == ("live", version)
            for spec in SPECS:
                name = spec[0]
                expected = pattern(name, live_version[name]).tobytes()
                assert live[name] == expected, f"{name} after update {version}"
        conn.send(None)
        assert _receive(conn, "shutdown") == ("done",)
        sender.close()
    finally:
        if process.is_alive():
            try:
                conn.send(None)  # a failed check above: let the engine end now
            except OSError:
                pass
        _join(process)


def test_a_wrong_token_is_refused_on_both_sides(socket_path):
    process, conn = _start_engine(socket_path, b"ssk1-63797165b3dfe0a594bfd143e51ff27ac4b85e06f81699463bcc565a25d9897c")
    try:
        backend = ss.HostBackend()
        with pytest.raises(ss.ShadowsyncTimeoutError) as refused:
            ss.same_host_sender_transport(socket_path, TOKEN, 1, backend, BUCKET_BYTES,
                                          connect_timeout_ms=3000)
        # The sender waited for a receiver that could prove the token, and says why none did.
        assert "0 of 1 receivers connected within 3000 ms" in str(refused.value)
        assert "wrong token" in str(refused.value)
        if not conn.poll(DEADLINE_S):
            pytest.fail("the engine process reported nothing")
        kind, name, message = conn.recv()
        assert (kind, name) == ("error", "TransportError")
        assert "the sender refused" in message and "wrong token" in message
    finally:
        _join(process)


def test_bad_arguments_are_refused_naming_them(socket_path):
    backend = ss.HostBackend()
    receiver = ss.same_host_transport
    sender = ss.same_host_sender_transport
    path = socket_path
    cases = [
        (lambda: receiver(path, TOKEN, 0, backend), "rank is 0, expected 1..65535"),
        (lambda: receiver(path, TOKEN, "1", backend), "rank must be an int, not str"),
        (lambda: receiver(path, TOKEN, True, backend), "rank must be an int, not bool"),
        (lambda: receiver(path, 12345, 1, backend), "token must be bytes or str, not int"),
        (lambda: receiver(path, "short", 1, backend), "it has 5 bytes, fewer than the 16 required"),
        (lambda: receiver(path + "\0x", TOKEN, 1, backend), "holds a NUL character"),
        (lambda: receiver("", TOKEN, 1, backend), "is empty"),
        (lambda: receiver(42, TOKEN, 1, backend), "path must be a str or os.PathLike, not int"),
        (lambda: receiver(path, TOKEN, 1, "host"),
         "backend must be a HostBackend or CudaBackend, not str"),
        (lambda: receiver(path, TOKEN, 1, backend, connect_timeout_ms=-1),
         "connect_timeout_ms is -1"),
        (lambda: sender(path, TOKEN, 0, backend, 1024), "receivers is 0, expected 1..65535"),
        (lambda: sender(path, TOKEN, 1, backend, 0), "slot_bytes is 0"),
        (lambda: sender(path, TOKEN, 1, backend, 1024, memory="gpu"),
         "memory is 'gpu', expected one of ['device', 'host']"),
    ]
    for make, expected in cases:
        with pytest.raises(ss.InvalidArgumentError) as error:
            make()
        assert expected in str(error.value)
    # A directory others may enter is refused, naming it; nothing is created in it.
    shared = tempfile.mkdtemp(prefix="ss_same_host_shared_")
    try:
        os.chmod(shared, 0o755)
        with pytest.raises(ss.InvalidArgumentError) as error:
            ss.same_host_sender_transport(os.path.join(shared, "s"), TOKEN, 1, backend, 1024,
                                          connect_timeout_ms=100)
        assert shared in str(error.value)
        assert os.listdir(shared) == []
        assert stat.S_IMODE(os.stat(shared).st_mode) == 0o755
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    # The device flavour needs a CUDA build and a CUDA backend.
    with pytest.raises((ss.NotSupportedError, ss.InvalidArgumentError)) as error:
        ss.same_host_sender_transport(socket_path, TOKEN, 1, backend, 1024, memory="device")
    assert "SHADOWSYNC_SAME_HOST_MEMORY_DEVICE" in str(error.value)
    assert not os.path.exists(socket_path)


def test_make_token_is_accepted_and_a_weak_token_is_refused_saying_how_to_make_one(socket_path):
    token = ss.make_token()
    assert token.startswith("ssk1-") and len(token) == 69 and token != ss.make_token()
    backend = ss.HostBackend()
    for weak in ("password12345678", "0" * 16, "aaaaaaaaaaaaaaaa"):
        with pytest.raises(ss.InvalidArgumentError,
                           match=r"the same-host token is too weak .*shadowsync.make_token\(\)"):
            ss.same_host_sender_transport(socket_path, weak, 1, backend, 1024,
                                          connect_timeout_ms=100)
    # A made token gets past the check: the sender then waits for a receiver that never comes.
    with pytest.raises(ss.ShadowsyncTimeoutError):
        ss.same_host_sender_transport(socket_path, token, 1, backend, 1024, connect_timeout_ms=100)


def test_the_staging_slots_default_to_the_backends_own_memory():
    """same_host_sender_transport without `memory`: device memory for a CudaBackend (checked on
    an uninitialised instance: no GPU needed to see the rule), host memory otherwise."""
    from shadowsync.transport import _backend_memory

    assert _backend_memory(ss.CudaBackend.__new__(ss.CudaBackend)) == "device"
    assert _backend_memory(ss.HostBackend()) == "host"
