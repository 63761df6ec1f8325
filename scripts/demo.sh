#!/usr/bin/env bash
# Builds and runs the demo (examples/demo.cpp): scripts/demo.sh [demo arguments...]
# Progress goes to stderr so that the demo's own output can be piped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
readonly JOBS="${SHADOWSYNC_JOBS:-2}"

log() { echo "==> $*" >&2; }

log "dependencies"
./scripts/deps.sh

# Reuse build/ (shared with scripts/test.sh) as configured; configure it only the first time.
if [[ ! -f build/CMakeCache.txt ]]; then
  args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSHADOWSYNC_WITH_CUDA=AUTO)
  if [[ -d .deps/prefix/usr ]]; then
    args+=("-DCMAKE_PREFIX_PATH=$PWD/.deps/prefix/usr")
  fi
  if command -v ninja >/dev/null; then
    args+=(-G Ninja)
  fi
  log "configure build/"
  cmake -S . -B build "${args[@]}" >&2
fi
log "build target demo"
cmake --build build --target demo -j "$JOBS" >&2

readonly DEMO=build/examples/demo
[[ -x "$DEMO" ]] || { log "error: $DEMO was not built"; exit 1; }
log "run $DEMO $*"
exec "$DEMO" "$@"
