// The transport conformance suite's fixture for SameHostTransport (transport_conformance.h): rank
// 0 serve()s, ranks 1..n-1 connect() from threads of this process, each rank with its own
// backend as separate processes would have. The socket lives in a private directory (mode 0700,
// made by mkdtemp) that the fixture removes when it goes.
//
// The same-host sender is always rank 0, the root of every broadcast: capabilities() says so, and
// the suite skips the cases that broadcast from other roots.
//
// Both memory flavours: kHost with HostBackends (tests/unit/test_same_host_conformance.cpp),
// kDevice with one CudaBackend per rank, all on one GPU (tests/gpu/test_same_host_gpu.cu). The
// fixture itself needs no CUDA: the caller says how to make each rank's backend.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/same_host_transport.h"
#include "transport_conformance.h"

namespace shadowsync::testing {

class SameHostFixture final : public TransportFixture {
 public:
  // Makes rank r's backend; called once per rank, in the constructor.
  using BackendFactory = std::function<std::unique_ptr<Backend>(int rank)>;

  // `world_size` ranks (at least 2: the sender and one receiver); each staging slot holds
  // `slot_bytes` (small slots make the suite's broadcasts cross many chunks). Connects at once;
  // throws what serve() or connect() throws (the first receiver's error when several fail).
  SameHostFixture(int world_size, SameHostMemory memory, std::size_t slot_bytes,
                  BackendFactory make_backend);
  ~SameHostFixture() override;
  SameHostFixture(const SameHostFixture&) = delete;
  SameHostFixture& operator=(const SameHostFixture&) = delete;

  std::string name() const override;  // "same-host (host memory, 4 KiB slots), 4 ranks"
  int world_size() const override { return world_size_; }
  TransportCapabilities capabilities() const override;
  Backend& backend(int rank) override;
  Transport& transport(int rank) override;
  // Destroys every transport (to each peer, a peer that died), then serves and connects anew on
  // the same path: the sender replaces nothing, since the last one unlinked its socket.
  void reconnect() override;

  SameHostTransport& same_host(int rank);
  const std::string& socket_path() const { return socket_path_; }

 private:
  const int world_size_;
  const SameHostMemory memory_;
  const std::size_t slot_bytes_;
  std::filesystem::path directory_;
  std::string socket_path_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::vector<std::unique_ptr<SameHostTransport>> transports_;
};

// The conformance cases that need a root other than rank 0, and only those (the same-host
// sender is always rank 0): what a same-host fixture must skip.
extern const std::vector<std::string> kSkippedOnSameHost;

// Reports one conformance case of a same-host fixture to Catch: its notes, its failures, and a
// failure when it was skipped though it applies (or ran though it needs a root other than 0).
void report_same_host_case(const ConformanceResult& result);

}  // namespace shadowsync::testing
