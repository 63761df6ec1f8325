# Shared by the scripts of scripts/gpu/ on a GPU machine: the environment, the machine report, the
# build dependencies, and configuring build-gpu/ with CUDA on. Sourced, not run. Each function
# sets or prints why it failed and returns non-zero.
#
# The build dependencies (Catch2 v2, fmt, concurrentqueue, OpenSSL) come from the system, as
# scripts/deps.sh installs them. Optional, for a machine without a package registry: if .deps/
# holds Debian packages (scripts/gpu/collect_debs.sh fetches them on another machine), they are
# unpacked and used from there instead of the system's.

# NVLink multicast (NVLS) off: on some hosts whose GPUs are shared between virtual machines, a
# program that uses it can put the GPUs out of service.
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

# gpu_unpack_deps ROOT: if ROOT/.deps holds .deb files, unpacks them into ROOT/.deps/prefix and
# sets PREFIX, FMT_DIR, CATCH2_DIR, CQ_DIR; without them leaves those empty (the system's packages
# are used). Sets DEPS_MESSAGE (what happened, or why it failed). Call it in the current shell, not
# in $(...): it exports variables.
gpu_unpack_deps() {
  local root=$1 deb
  PREFIX="" FMT_DIR="" CATCH2_DIR="" CQ_DIR=""
  shopt -s nullglob
  local debs=("$root"/.deps/*.deb)
  shopt -u nullglob
  if ((${#debs[@]} == 0)); then
    DEPS_MESSAGE="no .deb files in .deps/: the system's packages are used (scripts/deps.sh installs them)"
    return 0
  fi
  PREFIX="$root/.deps/prefix"
  FMT_DIR="$PREFIX/usr/lib/x86_64-linux-gnu/cmake/fmt"
  CATCH2_DIR="$PREFIX/usr/lib/cmake/Catch2"
  CQ_DIR="$PREFIX/usr/include/concurrentqueue"
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

# gpu_configure ROOT BUILD LOG TIMEOUT: configures BUILD with CUDA on (against the unpacked .deps
# prefix when gpu_unpack_deps found one: call it first), appending to LOG.
gpu_configure() {
  local root=$1 build=$2 logfile=$3 limit=$4
  local generator=() deps=()
  if [[ ! -f "$build/CMakeCache.txt" ]] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  if [[ -n "${PREFIX:-}" ]]; then
    deps=(-DCMAKE_PREFIX_PATH="$PREFIX/usr" -Dfmt_DIR="$FMT_DIR" -DCatch2_DIR="$CATCH2_DIR"
          -DSHADOWSYNC_CONCURRENTQUEUE_INCLUDE_DIR="$CQ_DIR")
  fi
  timeout "$limit" cmake -S "$root" -B "$build" "${generator[@]}" \
    -DSHADOWSYNC_WITH_CUDA=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    "${deps[@]}" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    >>"$logfile" 2>&1
}
