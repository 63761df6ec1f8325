#!/usr/bin/env bash
# Optional: only for a GPU machine that cannot reach a package registry. Where the GPU machine has
# apt, scripts/deps.sh installs the build dependencies there and this script is not needed.
#
# Run it on a Debian or Ubuntu machine that has apt and a network (the same release as the GPU
# machine). It downloads the .deb files of the build dependencies (Catch2 v2, fmt and its shared
# library, moodycamel concurrentqueue, OpenSSL's libcrypto for the control channel) into .deps/,
# which .gitignore ignores. Copy the tree with .deps/ to the GPU machine: the scripts of
# scripts/gpu/ (and scripts/deps.sh) unpack them there with dpkg -x, without root or network.
# Nothing is installed on the machine that runs this script.
#
# Idempotent: a package whose .deb is already in .deps/ is not downloaded again. apt-get update
# runs only when a download fails (stale package lists), then the download is retried once.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

readonly DEPS_DIR=.deps
readonly PACKAGES=(catch2 libfmt-dev libfmt9 libconcurrentqueue-dev libssl-dev libssl3)

log() { echo "[gpu_collect_debs] $*" >&2; }

command -v apt-get >/dev/null || { log "error: apt-get not found (run this on a Debian/Ubuntu machine)"; exit 1; }

if ! git check-ignore -q "$DEPS_DIR/x.deb" 2>/dev/null; then
  log "warning: $DEPS_DIR/ is not git-ignored; add '.deps/' to .gitignore so the .debs are not committed"
fi

mkdir -p "$DEPS_DIR"
missing=()
for pkg in "${PACKAGES[@]}"; do
  # apt-get download names files <package>_<version>_<arch>.deb
  if compgen -G "$DEPS_DIR/${pkg}_*.deb" >/dev/null; then
    log "have $(cd "$DEPS_DIR" && echo "${pkg}"_*.deb)"
  else
    missing+=("$pkg")
  fi
done

if ((${#missing[@]} == 0)); then
  log "all ${#PACKAGES[@]} packages present in $DEPS_DIR/"
  exit 0
fi

download() { (cd "$DEPS_DIR" && apt-get download "$@"); }

log "downloading ${missing[*]} into $DEPS_DIR/"
if ! download "${missing[@]}"; then
  log "download failed; running apt-get update and retrying once"
  sudo=()
  if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  download "${missing[@]}"
fi

for pkg in "${PACKAGES[@]}"; do
  compgen -G "$DEPS_DIR/${pkg}_*.deb" >/dev/null || { log "error: no .deb for $pkg in $DEPS_DIR/"; exit 1; }
done
debs=("$DEPS_DIR"/*.deb)
log "done: ${#debs[@]} .deb file(s), $(du -sh "$DEPS_DIR" | cut -f1) in $DEPS_DIR/"
