// The transport conformance suite (tests/support/transport_conformance.h) on NCCL: one
// CudaBackend and one NcclTransport per GPU, ranks as threads of this process, world size
// min(4, device count). tests/unit/test_transport_conformance.cpp runs the same cases on the
// loopback transport.
//
// A standalone program, not Catch2: prints PASS or FAIL per case and a final line; exit 0 passes,
// 1 fails, 77 skips (fewer than two GPUs, or a build without CUDA; ctest's SKIP_RETURN_CODE). A
// watchdog ends the process if anything, NCCL included, hangs past the overall deadline.
//
// After abort(), NcclTransport refuses new broadcasts by throwing Error(kTransport); the suite
// accepts that (the loopback transport completes them instead) and prints it as a note.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport_conformance.h"
#include "watchdog.h"

#if defined(SHADOWSYNC_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/nccl_transport.h"
#endif

namespace {

constexpr int kSkipReturnCode = 77;

#if defined(SHADOWSYNC_WITH_CUDA)

using namespace std::chrono_literals;
using shadowsync::Backend;
using shadowsync::CudaBackend;
using shadowsync::NcclTransport;
using shadowsync::NcclTransportConfig;
using shadowsync::NcclUniqueId;
using shadowsync::Transport;
using shadowsync::testing::ConformanceOptions;
using shadowsync::testing::ConformanceResult;
using shadowsync::testing::TransportFixture;

constexpr int kMaxWorldSize = 4;
// The whole program, NCCL init and teardown of a communicator per aborting case included. Below
// ctest's 600 s so that a hang reads as this message, not as a ctest timeout.
constexpr auto kWatchdogTimeout = 540s;

// Runs fn(rank) on one thread per rank and rethrows the first exception (after joining all).
template <typename Fn>
void on_every_rank(int world_size, Fn fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world_size));
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

// Rank r on device r.
class NcclFixture final : public TransportFixture {
 public:
  explicit NcclFixture(int world_size) : world_size_(world_size) {
    for (int r = 0; r < world_size; ++r) backends_.push_back(std::make_unique<CudaBackend>(r));
    config_.init_timeout = 60s;
    config_.enqueue_timeout = 60s;
    config_.finalize_timeout = 30s;
    reconnect();
  }
  ~NcclFixture() override { destroy_transports(); }

  std::string name() const override { return "nccl, " + std::to_string(world_size_) + " ranks"; }
  int world_size() const override { return world_size_; }
  Backend& backend(int rank) override { return *backends_[static_cast<std::size_t>(rank)]; }
  Transport& transport(int rank) override { return *transports_[static_cast<std::size_t>(rank)]; }

  // A new unique id and one create() per rank, each on its own thread: create() blocks until
  // every rank has joined.
  void reconnect() override {
    destroy_transports();
    const NcclUniqueId id = NcclTransport::generate_unique_id();
    std::vector<std::unique_ptr<NcclTransport>> created(static_cast<std::size_t>(world_size_));
    try {
      on_every_rank(world_size_, [&](int r) {
        created[static_cast<std::size_t>(r)] =
            NcclTransport::create(id, r, world_size_, /*device=*/r, config_);
      });
    } catch (...) {
      // Ranks that did join must not wait in finalize for those that did not.
      for (auto& t : created) {
        if (t) t->abort();
      }
      throw;
    }
    transports_.assign(std::make_move_iterator(created.begin()),
                       std::make_move_iterator(created.end()));
  }

 private:
  // Each rank's transport destroyed on its own thread, as each process would destroy its own:
  // ncclCommFinalize of one rank may wait for the others.
  void destroy_transports() noexcept {
    if (transports_.empty()) return;
    try {
      on_every_rank(world_size_, [&](int r) { transports_[static_cast<std::size_t>(r)].reset(); });
    } catch (...) {  // the destructor is noexcept; nothing else throws here
    }
    transports_.clear();
  }

  const int world_size_;
  NcclTransportConfig config_;
  std::vector<std::unique_ptr<CudaBackend>> backends_;
  std::vector<std::unique_ptr<Transport>> transports_;
};


int run() {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count < 2) {
    const std::string reason = status == cudaSuccess ? std::string()
                                                     : std::string(" (cudaGetDeviceCount: ") +
                                                           cudaGetErrorString(status) + ")";
    std::printf("SKIP: needs 2 GPUs, found %d%s\n", status == cudaSuccess ? device_count : 0,
                reason.c_str());
    return kSkipReturnCode;
  }
  const int world_size = std::min(kMaxWorldSize, device_count);

  shadowsync::testing::Watchdog watchdog(kWatchdogTimeout);
  std::unique_ptr<NcclFixture> fixture;
  try {
    fixture = std::make_unique<NcclFixture>(world_size);
  } catch (const std::exception& e) {
    std::printf("FAIL: setting up %d NCCL ranks: %s\n", world_size, e.what());
    return 1;
  }

  ConformanceOptions options;
  options.deadline = 60s;  // the first collective of a communicator also connects its peers

  std::printf("transport conformance on %s\n", fixture->name().c_str());
  std::fflush(stdout);
  const std::vector<std::string> names = shadowsync::testing::conformance_case_names();
  std::size_t passed = 0;
  for (const std::string& name : names) {
    ConformanceResult result;
    try {
      result = shadowsync::testing::run_conformance_case(*fixture, name, options);
    } catch (const std::exception& e) {
      result.name = name;
      result.failures.push_back(std::string("the runner threw: ") + e.what());
    }
    // NCCL has every capability: a skipped case is a failure here.
    const bool ok = result.passed() && !result.skipped;
    std::printf("%s: %s\n", ok ? "PASS" : "FAIL", name.c_str());
    for (const std::string& failure : result.failures) std::printf("    %s\n", failure.c_str());
    if (result.skipped) std::printf("    skipped: %s\n", result.skipped->c_str());
    for (const std::string& note : result.notes) std::printf("    note: %s\n", note.c_str());
    std::fflush(stdout);
    if (ok) ++passed;
  }
  fixture.reset();  // ncclCommFinalize + ncclCommDestroy on every rank, under the watchdog

  const bool ok = passed == names.size();
  std::printf("%s: %zu of %zu transport conformance cases passed on NCCL with %d ranks\n",
              ok ? "PASS" : "FAIL", passed, names.size(), world_size);
  return ok ? 0 : 1;
}

#else  // !SHADOWSYNC_WITH_CUDA: the build globs tests/gpu only with CUDA, but say so anyway.

int run() {
  std::printf("SKIP: built without CUDA (SHADOWSYNC_WITH_CUDA is not defined)\n");
  return kSkipReturnCode;
}

#endif

}  // namespace

int main() {
  // Before anything NCCL: NVLink SHARP (multicast) is off on these machines. No overwrite, so the
  // environment still decides.
  ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return run();
}
