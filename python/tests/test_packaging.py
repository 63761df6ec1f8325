"""The package's version is the CMake project's, and an installed package (pip install ., the
wheel) carries its library and finds it with no environment variable.

The installed-package tests run where scripts/test.sh's wheel step runs pytest
(SHADOWSYNC_TEST_INSTALLED=1: the package from a fresh virtual environment, not this checkout)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import shadowsync as ss
from shadowsync import _library

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = Path(ss.__file__).resolve().parent

installed_only = pytest.mark.skipif(
    os.environ.get("SHADOWSYNC_TEST_INSTALLED") != "1",
    reason="tests the pip-installed package (SHADOWSYNC_TEST_INSTALLED=1, scripts/test.sh's wheel "
           "step); this run imports the source checkout")


checkout_only = pytest.mark.skipif(
    os.environ.get("SHADOWSYNC_TEST_INSTALLED") == "1",
    reason="tests the source checkout; this run imports the pip-installed package")


def _cmake_project_version() -> str:
    text = (REPO / "CMakeLists.txt").read_text(encoding="utf-8")
    match = re.search(r"project\(\s*shadowsync\s+VERSION\s+([0-9][0-9.]*)", text)
    assert match, "no project(shadowsync VERSION x.y.z) in CMakeLists.txt"
    return match.group(1)


def test_version_is_the_cmake_projects():
    assert ss.__version__ == _cmake_project_version()


@installed_only
def test_installed_version_metadata_is_the_cmake_projects():
    from importlib.metadata import version

    assert version("shadowsync") == ss.__version__ == _cmake_project_version()
    assert (PACKAGE_DIR / "_version.py").is_file()  # written by the wheel build


@installed_only
def test_installed_package_is_not_the_checkout():
    # (The environment it is installed in may lie inside the checkout, as scripts/test.sh's does.)
    assert REPO / "python" not in PACKAGE_DIR.parents, PACKAGE_DIR
    assert PACKAGE_DIR.parent.name in ("site-packages", "dist-packages"), PACKAGE_DIR
    assert _library._repo_root() is None


@installed_only
def test_installed_package_carries_the_library_and_its_parts():
    assert (PACKAGE_DIR / "libshadowsync_c.so").is_file()
    assert (PACKAGE_DIR / "py.typed").is_file()
    import shadowsync.vllm

    assert Path(shadowsync.vllm.__file__).resolve().parent == PACKAGE_DIR / "vllm"
    assert shadowsync.vllm.WorkerExtension.__module__ == "shadowsync.vllm.worker_extension"


@installed_only
def test_installed_package_finds_its_library_without_any_variable(tmp_path):
    assert _library.locate(environ={}) == str(PACKAGE_DIR / "libshadowsync_c.so")
    # A fresh interpreter with neither SHADOWSYNC_LIBRARY nor LD_LIBRARY_PATH, away from the
    # checkout: it loads the library inside the installed package and uses it.
    env = {k: v for k, v in os.environ.items()
           if k not in ("SHADOWSYNC_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "-c",
         "import shadowsync as ss\n"
         "layout = ss.Layout([('x', 'fp32', (4,))])\n"
         "print(ss.library_path())\n"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(PACKAGE_DIR / "libshadowsync_c.so")


@checkout_only
def test_in_a_checkout_the_vllm_adapter_is_reached_through_its_link_not_a_search_path():
    # engine_adapters/vllm is shadowsync.vllm through the link python/shadowsync/vllm (the wheel
    # maps it through pyproject.toml's wheel.packages): the package's search path is its own.
    import shadowsync.vllm

    assert [Path(p).resolve() for p in ss.__path__] == [PACKAGE_DIR]
    assert (PACKAGE_DIR / "vllm").is_symlink()
    assert Path(shadowsync.vllm.__file__).resolve().parent == REPO / "engine_adapters" / "vllm"
