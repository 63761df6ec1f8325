# Shared by scripts/gpu/run.sh tests and scripts/gpu/bench.sh on a GPU machine (no network, no apt):
# the environment, the machine report, the libraries from .deps/*.deb, and configuring build-gpu/.
# Sourced, not run. Each function prints why it failed and returns non-zero.

# NVLink multicast (NVLS) off: a program that uses it can put the host's shared GPUs out of
# service (see docs/gpu.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# gpu_machine_report: what the machine is, for env.log.
gpu_machine_report() {
  echo "== date"; date -u
  echo "== nvidia-smi -L"; nvidia-smi -L
  echo "== nvidia-smi topo -m"; nvidia-smi topo -m
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu --format=csv
  echo "== tools"; command -v nvcc && nvcc --version | tail -2; cmake --version | head -1; g++ --version | head -1
  echo "== nccl.h"; grep -E '^#define NCCL_(MAJOR|MINOR|PATCH)' /usr/include/nccl.h 2>/dev/null
  echo "== env"; env | grep -E '^(NCCL_|TORCH_SYMM|NVSHMEM_|CUDA_VISIBLE)' | sort
}

# gpu_unpack_deps ROOT: unpacks ROOT/.deps/*.deb (scripts/gpu/run.sh collect-debs) into
# ROOT/.deps/prefix and sets PREFIX, FMT_DIR, CATCH2_DIR, CQ_DIR, and DEPS_MESSAGE (what happened,
# or why it failed). Call it in the current shell, not in $(...): it exports variables.
gpu_unpack_deps() {
  local root=$1 deb
  PREFIX="$root/.deps/prefix"
  FMT_DIR="$PREFIX/usr/lib/x86_64-linux-gnu/cmake/fmt"
  CATCH2_DIR="$PREFIX/usr/lib/cmake/Catch2"
  CQ_DIR="$PREFIX/usr/include/concurrentqueue"
  shopt -s nullglob
  local debs=("$root"/.deps/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    DEPS_MESSAGE="no .deb files in .deps/ (run scripts/gpu/run.sh collect-debs on the dev machine and carry .deps)"
    return 1
  fi
  mkdir -p "$PREFIX"
  for deb in "${debs[@]}"; do
    dpkg -x "$deb" "$PREFIX" || { DEPS_MESSAGE="dpkg -x $deb failed"; return 1; }
  done
  local need
  for need in "$FMT_DIR/fmt-config.cmake" "$CATCH2_DIR/Catch2Config.cmake" "$CQ_DIR/blockingconcurrentqueue.h"; do
    [[ -f "$need" ]] || { DEPS_MESSAGE="$need missing after unpacking ${#debs[@]} .deb(s)"; return 1; }
  done
  # Test support sources include <fmt/format.h>, and the tests load libfmt.so.9 (and Debian's
  # libcrypto) from the prefix: make both findable whatever the CMake files say.
  export CPLUS_INCLUDE_PATH="$PREFIX/usr/include${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  DEPS_MESSAGE="${#debs[@]} .deb(s) unpacked into .deps/prefix"
}

# gpu_configure ROOT BUILD LOG TIMEOUT: configures BUILD with CUDA on against the unpacked prefix
# (gpu_unpack_deps first), appending to LOG.
gpu_configure() {
  local root=$1 build=$2 logfile=$3 limit=$4
  local generator=()
  if [[ ! -f "$build/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  timeout "$limit" cmake -S "$root" -B "$build" "${generator[@]}" \
    -DSHADOWSYNC_WITH_CUDA=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$PREFIX/usr" \
    -Dfmt_DIR="$FMT_DIR" \
    -DCatch2_DIR="$CATCH2_DIR" \
    -DSHADOWSYNC_CONCURRENTQUEUE_INCLUDE_DIR="$CQ_DIR" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    >>"$logfile" 2>&1
}
