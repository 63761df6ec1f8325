#!/usr/bin/env bash
# On a GPU machine: builds the wheel with CUDA on from the repository root (pip wheel), installs it
# into a venv that sees the machine's torch (--system-site-packages), and runs python/tests against
# the installed package: the NCCL runtime tests (which NCCL it loads, both import orders with
# torch, a one-rank communicator), the mini worker's CUDA case, packaging. Prints ldd of the
# installed library (it must name no libnccl).
#
# pip takes the build requirements (scikit-build-core, pathspec, packaging) and pytest and ninja
# from the package index. Optional, for a machine without one: if .whl/ exists, they are taken
# from the wheel files there instead (pip --no-index --find-links .whl); the build dependencies
# likewise from .deps/ if it holds Debian packages (scripts/gpu/common.sh).
#
#   bash scripts/gpu/run.sh python [PYTEST_ARGS...]
#
# Logs under ${OUT:-./gpu-out}: wheel.log, pytest-wheel.log, summary-python.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
readonly ROOT=$PWD
readonly OUT_DIR="${OUT:-$ROOT/gpu-out}"
readonly WORK="$ROOT/build-gpu-wheel"
readonly SUMMARY="$OUT_DIR/summary-python.txt"
mkdir -p "$OUT_DIR" "$WORK"
: >"$SUMMARY"
note() { echo "[gpu python] $*"; echo "$*" >>"$SUMMARY"; }

# shellcheck source=scripts/gpu/common.sh
source "$ROOT/scripts/gpu/common.sh"
gpu_unpack_deps "$ROOT" >/dev/null || { note "FAIL deps: $DEPS_MESSAGE"; exit 1; }
# Where pip finds packages: the index, or the wheel files of .whl/ when that folder exists.
pip_source=()
[[ -d "$ROOT/.whl" ]] && pip_source=(--no-index --find-links "$ROOT/.whl")
# The unpacked .deps prefix, when there is one, for the wheel's CMake configure.
cmake_deps=()
[[ -n "$PREFIX" ]] && cmake_deps=("-Ccmake.define.CMAKE_PREFIX_PATH=$PREFIX/usr"
  "-Ccmake.define.fmt_DIR=$FMT_DIR" "-Ccmake.define.SHADOWSYNC_CONCURRENTQUEUE_INCLUDE_DIR=$CQ_DIR")

python3 -m venv --clear "$WORK/venv" || { note "FAIL venv"; exit 1; }
readonly PY="$WORK/venv/bin/python"
# The machine's python3 may itself be a venv (torch in /opt/torch/.venv): --system-site-packages
# would reach only the base interpreter's packages, so hand the new venv python3's own ones.
python3 -c 'import site; print("\n".join(site.getsitepackages()))' \
  >"$("$PY" -c 'import site; print(site.getsitepackages()[0])')/machine-packages.pth"
"$PY" -m pip install --quiet "${pip_source[@]}" pytest ninja >"$WORK/pip.log" 2>&1 ||
  { cat "$WORK/pip.log"; note "FAIL pip install pytest ninja ${pip_source[*]}"; exit 1; }
note "info $("$PY" -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())' 2>&1 | tail -n 1)"

# pip's build isolation hides the machine's site-packages, so a `cmake` that is pip's Python
# shim (it imports the cmake module) fails there: put the real binary first on PATH.
cmake_bin=$(python3 -c 'import cmake; print(cmake.CMAKE_BIN_DIR)' 2>/dev/null) &&
  [[ -x "$cmake_bin/cmake" ]] && export PATH="$cmake_bin:$PATH"
note "info cmake for the wheel: $(command -v cmake) ($(cmake --version | head -n 1))"
rm -rf "$WORK/dist"
if ! SHADOWSYNC_WITH_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip wheel -v --no-deps \
    "${pip_source[@]}" -w "$WORK/dist" "-Cbuild-dir=$WORK/cmake" "${cmake_deps[@]}" \
    "-Ccmake.define.CMAKE_POLICY_VERSION_MINIMUM=3.5" . >"$OUT_DIR/wheel.log" 2>&1; then
  tail -n 40 "$OUT_DIR/wheel.log"
  note "FAIL wheel build (see wheel.log)"
  exit 1
fi
wheel=$(ls "$WORK"/dist/shadowsync-*.whl)
note "ok   wheel $(basename "$wheel"): $(grep -o 'CUDA/NCCL backend.*' "$OUT_DIR/wheel.log" | tail -n 1)"
"$PY" -m pip install --quiet --no-deps --force-reinstall "$wheel" ||
  { note "FAIL install the wheel"; exit 1; }
library=$("$PY" -c 'import shadowsync._library as l; print(l.library_path())' 2>&1 | tail -n 1)
note "info installed library: $library"
if ldd "$library" | grep -i nccl; then
  note "FAIL the installed library links NCCL"
else
  note "ok   ldd: no libnccl ($(ldd "$library" | awk '{print $1}' | tr '\n' ' '))"
fi

# From an empty directory, with SHADOWSYNC_LIBRARY and PYTHONPATH unset: the installed package.
mkdir -p "$WORK/run"
rc=0
(cd "$WORK/run" && env -u SHADOWSYNC_LIBRARY -u PYTHONPATH SHADOWSYNC_TEST_INSTALLED=1 \
  PYTHONDONTWRITEBYTECODE=1 "$PY" -m pytest "$ROOT/python/tests" -q -rs -s -p no:cacheprovider \
  --rootdir "$ROOT" "$@") >"$OUT_DIR/pytest-wheel.log" 2>&1 || rc=$?
grep -E "shadowsync-then|torch-then|loads-first|one-rank|shadowsync: NCCL" "$OUT_DIR/pytest-wheel.log" | sort -u | head -20 >>"$SUMMARY"
note "$([[ $rc == 0 ]] && echo ok || echo FAIL)   pytest (installed wheel): $(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/pytest-wheel.log" | tail -n 1)"
cat "$SUMMARY"
exit "$rc"
