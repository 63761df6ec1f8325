#!/usr/bin/env bash
# Installs what building and testing shadowsync needs on Debian/Ubuntu, if it is missing:
# cmake, g++, ninja (or make), pkg-config, catch2 (v2), libfmt-dev, libconcurrentqueue-dev,
# libssl-dev (the control channel's HMAC), and for scripts/fuzz.sh clang with its libFuzzer runtime.
# Idempotent: when everything is present it only checks, and returns in well under a second.
# (nvcc and NCCL are not installed here: the CUDA backend is built when CMake finds them.)
#
# Optional, for a machine without a package registry: `scripts/gpu/run.sh collect-debs`, run on a
# machine with apt, downloads the library .debs into .deps/; copy .deps/ along with the tree. There,
# when a library package is not installed, deps.sh unpacks those .debs into .deps/prefix (dpkg -x:
# no root, no network, the same place `scripts/gpu/run.sh tests` uses), and test.sh / demo.sh add
# .deps/prefix/usr to CMAKE_PREFIX_PATH.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

readonly DEPS_DIR=.deps
readonly DEPS_PREFIX="$DEPS_DIR/prefix"
readonly LIB_PACKAGES=(catch2 libfmt-dev libconcurrentqueue-dev libssl-dev)

log() { echo "[deps] $*" >&2; }

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

missing=()
# Tools count as present when they are on PATH, however they were installed (pip cmake, say).
command -v cmake >/dev/null || installed cmake || missing+=(cmake)
command -v g++ >/dev/null || installed g++ || missing+=(g++)
command -v ninja >/dev/null || command -v make >/dev/null || missing+=(ninja-build)
command -v pkg-config >/dev/null || installed pkg-config || missing+=(pkg-config)
command -v clang++ >/dev/null || installed clang || missing+=(clang)

# libFuzzer's runtime (scripts/fuzz.sh) ships apart from clang on Debian 12: libclang-rt-<N>-dev.
fuzzer_runtime_present() {
  command -v clang++ >/dev/null &&
    [[ -f "$(clang++ -print-resource-dir)/lib/linux/libclang_rt.fuzzer-$(uname -m).a" ]]
}
fuzzer_runtime_package() {
  local major
  major=$(clang++ -dumpversion 2>/dev/null | cut -d. -f1)
  [[ -n "$major" ]] && echo "libclang-rt-${major}-dev"
}

missing_libs=()
for pkg in "${LIB_PACKAGES[@]}"; do
  installed "$pkg" || missing_libs+=("$pkg")
done

# Offline fallback: library packages from .deps/*.deb, unpacked under .deps/prefix.
shopt -s nullglob
debs=("$DEPS_DIR"/*.deb)
shopt -u nullglob
if ((${#missing_libs[@]})) && ((${#debs[@]})); then
  log "unpacking ${#debs[@]} .deb file(s) from $DEPS_DIR/ into $DEPS_PREFIX (missing: ${missing_libs[*]})"
  for deb in "${debs[@]}"; do
    dpkg -x "$deb" "$DEPS_PREFIX"
  done
  [[ -f "$DEPS_PREFIX/usr/include/catch2/catch.hpp" ]] || log "warning: no catch2 in $DEPS_DIR/"
  missing_libs=()
fi

missing+=("${missing_libs[@]}")
if command -v clang++ >/dev/null && ! fuzzer_runtime_present; then
  missing+=("$(fuzzer_runtime_package)")
fi
if ((${#missing[@]} == 0)); then
  log "all build dependencies present"
  exit 0
fi

log "installing: ${missing[*]}"
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "error: not root and no sudo; install ${missing[*]}"; exit 1; }
  sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
# clang was just installed: its libFuzzer runtime is a package of its own.
if ! fuzzer_runtime_present && [[ -n "$(fuzzer_runtime_package)" ]]; then
  log "installing $(fuzzer_runtime_package) (libFuzzer runtime)"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "$(fuzzer_runtime_package)"
fi
log "done"
