"""NCCL is opened at run time, not linked: which library the NCCL transport uses, that it is the
one already in the process (torch's) whichever is imported first, and a one-rank communicator on
a GPU through that loading path. Needs a CUDA build of the library; the torch cases need a torch
with NCCL (a CUDA torch), the GPU case a GPU."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import shadowsync

requires_cuda_build = pytest.mark.skipif(
    not shadowsync.has_cuda(), reason="the library was built without CUDA (no NCCL transport)")


def _torch_with_nccl() -> bool:
    # Probed in a subprocess: importing torch here would load its NCCL into the test process.
    if importlib.util.find_spec("torch") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import torch; torch.cuda.nccl.version()"],
                           capture_output=True, text=True, timeout=300)
    return probe.returncode == 0


def _mapped_nccl_libraries() -> set:
    libraries = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "libnccl" in Path(path).name:
                libraries.add(os.path.realpath(path))
    return libraries


@requires_cuda_build
def test_reports_the_nccl_it_loaded():
    library = shadowsync.nccl_library()
    assert Path(library.path).exists(), library
    assert library.version >= (2, 14, 0), library
    # The one it reports is the one in this process, and there is only one.
    assert _mapped_nccl_libraries() == {os.path.realpath(library.path)}


# Each order runs in a fresh interpreter: what is imported first decides which NCCL is loaded.
# "shadowsync-loads-first" makes shadowsync open NCCL before torch is even imported: the case where
# two NCCLs in one process could happen.
_ORDERS = {
    "shadowsync-then-torch": "import shadowsync\nimport torch\n",
    "torch-then-shadowsync": "import torch\nimport shadowsync\n",
    "shadowsync-loads-first": "import shadowsync\nshadowsync.nccl_library()\nimport torch\n",
}

_CHECK = textwrap.dedent("""
    import json, os
    torch_version = tuple(torch.cuda.nccl.version())  # loads torch's NCCL if it is lazy
    library = shadowsync.nccl_library()
    mapped = set()
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and "libnccl" in os.path.basename(fields[-1]):
            mapped.add(os.path.realpath(fields[-1]))
    print(json.dumps({"torch": torch_version, "shadowsync": library.version,
                      "path": os.path.realpath(library.path), "mapped": sorted(mapped)}))
""")


@requires_cuda_build
@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_import_order_same_nccl_as_torch(order):
    if not _torch_with_nccl():
        pytest.skip("no torch with NCCL (a CUDA build of torch) in this Python")
    env = {k: v for k, v in os.environ.items() if k != "SHADOWSYNC_NCCL_LIBRARY"}
    run = subprocess.run([sys.executable, "-c", _ORDERS[order] + _CHECK], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, f"{order}: exit {run.returncode}\n{run.stderr[-3000:]}"
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{order}: {result} | {run.stderr.strip().splitlines()[-1] if run.stderr else ''}")
    assert tuple(result["torch"]) == tuple(result["shadowsync"]), result
    assert result["mapped"] == [result["path"]], f"{order}: NCCLs in the process: {result}"


@requires_cuda_build
def test_one_rank_communicator_on_a_gpu():
    try:
        backend = shadowsync.CudaBackend(0)
    except shadowsync.ShadowsyncError as error:
        pytest.skip(f"no usable GPU: {error}")
    try:
        unique_id = shadowsync.nccl_unique_id()
        assert len(unique_id) == 128 and any(unique_id)
        transport = shadowsync.nccl_transport(unique_id, rank=0, world_size=1, device=0)
        assert "nccl rank 0 of 1" in repr(transport)
        transport.close()
        print(f"one-rank communicator through {shadowsync.nccl_library()}")
    finally:
        backend.close()
