// SameHostFixture. See same_host_fixture.h.
#include "same_host_fixture.h"

#include <stdlib.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <future>
#include <stdexcept>
#include <system_error>
#include <utility>

#include <fmt/format.h>

namespace shadowsync::testing {

namespace {

// Both ends prove it; what it is does not matter here.
constexpr const char* kToken = "ssk1-f60a0d73c64b42c0e81d8f56d4163ab7f678b06ec84a526e7eba48ea216213df";

SameHostConfig fixture_config() {
  SameHostConfig config;
  // Every receiver is a thread of this process that starts before the sender serves: only a bug
  // makes either side wait long.
  config.connect_timeout = std::chrono::seconds(30);
  config.handshake_timeout = std::chrono::seconds(10);
  return config;
}

std::string describe_bytes(std::size_t bytes) {
  if (bytes % 1024 == 0) return fmt::format("{} KiB", bytes / 1024);
  return fmt::format("{} B", bytes);
}

}  // namespace

SameHostFixture::SameHostFixture(int world_size, SameHostMemory memory, std::size_t slot_bytes,
                                 BackendFactory make_backend)
    : world_size_(world_size), memory_(memory), slot_bytes_(slot_bytes) {
  if (world_size < 2) {
    throw std::invalid_argument(fmt::format(
        "same-host fixture: world size {}, want at least 2 (a sender and a receiver)", world_size));
  }
  char name[] = "/tmp/shadowsync_same_host_conformance_XXXXXX";
  if (::mkdtemp(name) == nullptr) {
    throw std::system_error(errno, std::generic_category(),
                            "same-host fixture: mkdtemp(/tmp/shadowsync_same_host_conformance_*)");
  }
  directory_ = name;  // mkdtemp makes it 0700: what serve() requires of the socket's directory
  socket_path_ = (directory_ / "sender.sock").string();
  try {
    for (int r = 0; r < world_size; ++r) backends_.push_back(make_backend(r));
    reconnect();
  } catch (...) {
    transports_.clear();
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
    throw;
  }
}

SameHostFixture::~SameHostFixture() {
  transports_.clear();  // before the backends whose streams the transports' tasks ran on
  backends_.clear();
  std::error_code ignored;
  std::filesystem::remove_all(directory_, ignored);
}

std::string SameHostFixture::name() const {
  return fmt::format("same-host ({} memory, {} slots), {} ranks",
                     memory_ == SameHostMemory::kHost ? "host" : "device",
                     describe_bytes(slot_bytes_), world_size_);
}

TransportCapabilities SameHostFixture::capabilities() const {
  TransportCapabilities capabilities;
  capabilities.any_rank_as_root = false;  // the sender, rank 0, is the root of every broadcast
  // Device flavour: a receiver's call waits on its thread for each doorbell (same_host_transport.h).
  capabilities.receive_blocks_caller = memory_ == SameHostMemory::kDevice;
  return capabilities;
}

Backend& SameHostFixture::backend(int rank) { return *backends_[static_cast<std::size_t>(rank)]; }

Transport& SameHostFixture::transport(int rank) { return same_host(rank); }

SameHostTransport& SameHostFixture::same_host(int rank) {
  return *transports_[static_cast<std::size_t>(rank)];
}

void SameHostFixture::reconnect() {
  transports_.clear();
  const SameHostConfig config = fixture_config();
  // Receivers first, each on its own thread: connect() retries until the sender listens, and
  // serve() blocks until every receiver has connected.
  std::vector<std::future<std::unique_ptr<SameHostTransport>>> connecting;
  for (int r = 1; r < world_size_; ++r) {
    Backend& backend = *backends_[static_cast<std::size_t>(r)];
    connecting.push_back(std::async(std::launch::async, [this, r, &backend, config] {
      return SameHostTransport::connect(socket_path_, kToken, r, backend, config);
    }));
  }
  std::vector<std::unique_ptr<SameHostTransport>> made(static_cast<std::size_t>(world_size_));
  std::exception_ptr sender_error;
  std::exception_ptr receiver_error;
  try {
    made[0] = SameHostTransport::serve(socket_path_, kToken, world_size_ - 1, *backends_[0],
                                       memory_, slot_bytes_, config);
  } catch (...) {
    sender_error = std::current_exception();
  }
  for (int r = 1; r < world_size_; ++r) {
    try {
      made[static_cast<std::size_t>(r)] = connecting[static_cast<std::size_t>(r - 1)].get();
    } catch (...) {
      if (!receiver_error) receiver_error = std::current_exception();
    }
  }
  // A receiver's own reason says more than the sender's timeout that follows from it.
  if (receiver_error) std::rethrow_exception(receiver_error);
  if (sender_error) std::rethrow_exception(sender_error);
  transports_ = std::move(made);
}

const std::vector<std::string> kSkippedOnSameHost = {
    "grouped batch of 8 broadcasts with changing roots", "broadcast from the last rank"};

void report_same_host_case(const ConformanceResult& result) {
  for (const std::string& note : result.notes) UNSCOPED_INFO(result.name << ": " << note);
  for (const std::string& failure : result.failures) FAIL_CHECK(result.name << ": " << failure);
  const bool expected_skip = std::find(kSkippedOnSameHost.begin(), kSkippedOnSameHost.end(),
                                       result.name) != kSkippedOnSameHost.end();
  if (result.skipped) WARN("skipped: " << result.name << ": " << *result.skipped);
  CHECK(result.skipped.has_value() == expected_skip);
}

}  // namespace shadowsync::testing
