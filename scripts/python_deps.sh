#!/usr/bin/env bash
# Installs what the Python package's tests need (python/tests: numpy and pytest for python3; venv
# with ensurepip for the wheel step of scripts/test.sh), if missing. Idempotent: when all import, it
# only checks.
#
# First `python3 -m pip install`; where that is refused (Debian's own python3 is "externally
# managed", PEP 668) or there is no pip or no python3 at all, Debian's packages python3-numpy and
# python3-pytest instead (they serve /usr/bin/python3).
set -euo pipefail

log() { echo "[python-deps] $*" >&2; }

have_all() { python3 -c 'import numpy, pytest, venv, ensurepip' >/dev/null 2>&1; }

if have_all; then
  log "numpy, pytest and venv present for $(command -v python3)"
  exit 0
fi

if command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1; then
  log "python3 -m pip install numpy pytest"
  if output=$(python3 -m pip install --quiet --disable-pip-version-check numpy pytest 2>&1) &&
    have_all; then
    exit 0
  fi
  log "pip could not install them for $(command -v python3) ($(grep -m 1 -i error <<<"$output" ||
    echo "no error line")); trying Debian's packages"
fi

if ! command -v apt-get >/dev/null; then
  log "error: no python3 with pip and no apt-get: install numpy, pytest and venv for python3"
  exit 1
fi
sudo=()
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { log "error: not root and no sudo; install python3-numpy python3-pytest python3-venv"; exit 1; }
  sudo=(sudo)
fi
log "apt-get install python3 python3-numpy python3-pytest python3-venv"
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends python3 python3-numpy python3-pytest python3-venv
if ! have_all; then
  log "error: $(command -v python3) still cannot import numpy, pytest and venv (is python3 another" \
    "interpreter than Debian's /usr/bin/python3? install them for it)"
  exit 1
fi
