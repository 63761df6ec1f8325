"""Finding the library, errors carrying the library's message, closed and NULL handles, and the
CUDA wrappers on a library or machine without CUDA."""

import os
import shutil
import subprocess
import sys
import textwrap
from ctypes import byref, c_uint64
from pathlib import Path

import numpy as np
import pytest
from support import BASE, LORA, SPECS, tensors

import shadowsync as ss
from shadowsync import _library, errors

PACKAGE_DIR = Path(ss.__file__).resolve().parent


def _run_python(code: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_missing_library_from_the_environment_is_named(tmp_path):
    missing = tmp_path / "nowhere" / "libshadowsync_c.so"
    env = dict(os.environ, SHADOWSYNC_LIBRARY=str(missing), PYTHONPATH=str(PACKAGE_DIR.parent))
    result = _run_python("""
        import shadowsync  # importing never needs the library
        try:
            shadowsync.HostBackend()
        except shadowsync.LibraryNotFoundError as e:
            print("ERROR:", e)
        """, env, tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"SHADOWSYNC_LIBRARY is set to '{missing}', which is not a file" in result.stdout


def test_library_not_found_lists_every_place_looked(tmp_path):
    # A copy of the package outside any checkout, with nothing to find anywhere.
    shutil.copytree(PACKAGE_DIR, tmp_path / "shadowsync",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
    env = {k: v for k, v in os.environ.items() if k not in ("SHADOWSYNC_LIBRARY", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(tmp_path)
    result = _run_python("""
        import shadowsync
        try:
            shadowsync.Layout([("x", "fp32", (4,))])
        except shadowsync.LibraryNotFoundError as e:
            print("ERROR:", e)
        """, env, tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "libshadowsync_c.so not found. Looked in:" in out
    assert "SHADOWSYNC_LIBRARY (unset)" in out
    assert str(tmp_path / "shadowsync" / "libshadowsync_c.so") in out
    assert "the system loader ('libshadowsync_c.so'" in out


def test_search_order():
    paths, places = _library.candidates(environ={})
    expected = [str(PACKAGE_DIR / "libshadowsync_c.so")]
    if os.environ.get("SHADOWSYNC_TEST_INSTALLED") != "1":
        # A source checkout: then its CMake build trees.
        repo = PACKAGE_DIR.parent.parent
        expected += [str(repo / "build" / "libshadowsync_c.so"),
                     str(repo / "build-release" / "libshadowsync_c.so")]
    assert paths == expected
    assert places[0] == "SHADOWSYNC_LIBRARY (unset)"
    assert _library.candidates(environ={"SHADOWSYNC_LIBRARY": "/x/lib.so"})[0] == ["/x/lib.so"]


def test_errors_carry_the_library_message_and_status():
    with pytest.raises(ss.InvalidArgumentError) as info:
        ss.Layout([("a", "fp32", (4,)), ("a", "fp32", (4,))])
    e = info.value
    assert e.status == 1 and "shadowsync_layout_create" in e.detail and "'a'" in e.detail
    assert "SHADOWSYNC_INVALID_ARGUMENT" in str(e)
    assert e.hint.startswith("invalid argument")
    assert isinstance(e, ValueError)  # the Python-side category too


def test_closed_and_null_handles_raise_instead_of_crashing(pair):
    layout = ss.Layout(SPECS, bucket_bytes=1024)
    layout.close()
    layout.close()  # idempotent
    with pytest.raises(ss.InvalidHandleError, match="layout"):
        ss.Receiver(layout, pair.backend)

    # A transport taken by a receiver is spent; giving it again is refused by the library.
    loopback = ss.Loopback(2)
    transport = loopback.transport(1)
    receiver = ss.Receiver(pair.layout, pair.backend, transport)
    assert transport.closed
    with pytest.raises(ss.InvalidHandleError, match="transport"):
        ss.Sender(pair.layout, pair.backend, transport)

    receiver.close()
    for use in (receiver.before_step, receiver.stats, receiver.apply_pending_now,
                lambda: receiver.wait_applied(1, 0.01), lambda: receiver.live_array("embed"),
                lambda: receiver.begin_update(b"\0" * 44)):
        with pytest.raises(ss.InvalidHandleError, match="receiver"):
            use()

    handle = pair.update(1, BASE + LORA)
    handle.close()
    with pytest.raises(ss.InvalidHandleError, match="publish"):
        handle.done()

    # NULL handles straight into the C ABI.
    with pytest.raises(ss.InvalidHandleError):
        errors.call("shadowsync_layout_fingerprint", None, byref(c_uint64()))
    with pytest.raises(ss.InvalidHandleError):
        errors.call("shadowsync_receiver_before_step", None, None, None)
    with pytest.raises(ss.InvalidHandleError):
        errors.call("shadowsync_publish_wait", None, 0)


def test_cuda_wrappers_refuse_clearly_without_cuda(monkeypatch):
    from shadowsync import backend

    monkeypatch.setattr(backend, "has_cuda", lambda: False)
    library = ss.library_path()
    for make, what in ((lambda: ss.CudaBackend(0), "CudaBackend(device=0)"),
                       (ss.nccl_unique_id, "nccl_unique_id()"),
                       (lambda: ss.nccl_transport(bytes(128), 0, 2, 0),
                        "nccl_transport(rank=0, world_size=2, device=0)")):
        with pytest.raises(ss.NotSupportedError) as info:
            make()
        assert what in str(info.value) and library in str(info.value)
        assert "built without CUDA/NCCL" in str(info.value)


def test_cuda_backend_without_a_gpu_is_an_error_not_a_crash():
    if not ss.has_cuda():
        with pytest.raises(ss.NotSupportedError):
            ss.CudaBackend(0)
        return
    try:
        ss.CudaBackend(0).close()  # a GPU machine
    except ss.ShadowsyncError as e:
        assert e.status in (ss.InvalidArgumentError.status, ss.BackendError.status), e
    with pytest.raises(ss.ShadowsyncError):
        ss.CudaBackend(-1)
    with pytest.raises(ss.InvalidArgumentError, match="NCCL unique id: 3 bytes, expected 128"):
        ss.nccl_transport(b"abc", 0, 2, 0)


def test_live_arrays_are_host_backend_views_that_follow_swaps(pair):
    pair.update(1, BASE + LORA)
    view = pair.receiver.live_array("embed")
    assert view.shape == (300, 4) and view.dtype == np.float32
    np.testing.assert_array_equal(view, tensors(["embed"], 1)["embed"])
    pair.update(2, BASE)
    # The old view now shows the shadow; the live pointer moved.
    assert pair.receiver.live_array("embed").ctypes.data != view.ctypes.data
    assert pair.receiver.live_array("embed").ctypes.data == pair.receiver.live_pointer("embed")
    with pytest.raises(ss.InvalidArgumentError, match="tensor 'nope' is not in the layout"):
        pair.receiver.live_array("nope")
