// How a same-host pull engine rank enqueues its copies (same_host_pull_copies.h), on the host
// backend: contiguous copies (one row, or rows back to back on both sides) go as one
// memcpy_batch_async with CopyHint::kBesideCompute, strided ones as memcpy_2d_async, and every
// byte lands where the 2-D copies put it; SHADOWSYNC_PULL_COPIES=plain keeps them all 2-D; any
// other value is refused when an engine rank connects, before it dials. The device flavour that
// runs these copies is in tests/gpu/test_same_host_pull_gpu.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "counting_backend.h"
#include "error_message.h"
#include "pull_fixture.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "transports/same_host/same_host_pull_copies.h"
#include "transports/same_host/same_host_pull_transport.h"

using namespace shadowsync;
using namespace shadowsync::testing;
using same_host::PullCopies;

namespace {

// SHADOWSYNC_PULL_COPIES set to `value` for the scope (nullopt: unset); restored after.
class ScopedPullCopies {
 public:
  explicit ScopedPullCopies(const std::optional<std::string>& value) {
    if (const char* old = std::getenv(same_host::kPullCopiesEnv)) old_ = old;
    set(value);
  }
  ~ScopedPullCopies() { set(old_); }
  ScopedPullCopies(const ScopedPullCopies&) = delete;
  ScopedPullCopies& operator=(const ScopedPullCopies&) = delete;

 private:
  static void set(const std::optional<std::string>& value) {
    if (value) {
      ::setenv(same_host::kPullCopiesEnv, value->c_str(), 1);
    } else {
      ::unsetenv(same_host::kPullCopiesEnv);
    }
  }
  std::optional<std::string> old_;
};

}  // namespace

// First in the file: setenv must not race with a getenv on another thread, and no stream thread
// exists yet.
TEST_CASE("SHADOWSYNC_PULL_COPIES: beside_compute by default, plain on request, others refused") {
  CHECK(same_host::pull_copies_from(nullptr) == PullCopies::kBesideCompute);
  CHECK(same_host::pull_copies_from("") == PullCopies::kBesideCompute);
  CHECK(same_host::pull_copies_from("beside_compute") == PullCopies::kBesideCompute);
  CHECK(same_host::pull_copies_from("plain") == PullCopies::kPlain);
  for (const char* wrong : {"fast", "Plain", "beside-compute"}) {
    CAPTURE(wrong);
    try {
      same_host::pull_copies_from(wrong);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK_THAT(e.what(), Catch::Contains(fmt::format("SHADOWSYNC_PULL_COPIES='{}'", wrong)) &&
                               Catch::Contains("'beside_compute'") && Catch::Contains("'plain'"));
    }
  }

  // Refused when the engine rank's transport is created, before it dials a trainer rank (none
  // serves at this path).
  const ScopedPullCopies env("fast");
  HostBackend backend;
  const std::string message = message_of([&] {
    SameHostPullTransport::connect_engine_rank({"/nonexistent/shadowsync/trainer0.sock"},
                                               "ssk1-4e217b3e708068e355dd91215ccb2ea999ee8d7530f4"
                                               "fd84340f63a34056aa56",
                                               make_plan(1, 1), 0, backend, SameHostConfig{});
  });
  CHECK_THAT(message, Catch::StartsWith("same-host pull connect as engine rank 0: "
                                        "SHADOWSYNC_PULL_COPIES='fast'") &&
                          Catch::Contains("accepted: 'beside_compute' (the default) or 'plain'"));
}

TEST_CASE(
    "pull copies: contiguous ones go as one batch beside compute, strided ones 2-D, and "
    "all land as 2-D copies would") {
  std::vector<std::byte> src(256);
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::byte>(i * 7 + 3);
  std::vector<std::byte> dst(256);
  std::vector<std::byte> expected(256);
  const std::vector<AddressedCopy> copies = {
      {src.data() + 0, 5, dst.data() + 0, 9, 10, 1},      // one row: pitches do not matter
      {src.data() + 16, 12, dst.data() + 16, 12, 12, 3},  // rows back to back on both sides
      {src.data() + 64, 12, dst.data() + 64, 16, 12, 3},  // strided target
      {src.data() + 112, 20, dst.data() + 112, 8, 8, 4},  // strided source
      {src.data() + 200, 8, dst.data() + 200, 12, 8, 2},  // back to back in the source only
  };
  for (const AddressedCopy& a : copies) {
    const auto offset = [&](const std::vector<std::byte>& v, const std::byte* p) {
      return static_cast<std::size_t>(p - v.data());
    };
    for (std::size_t r = 0; r < a.rows; ++r) {
      std::memcpy(expected.data() + offset(dst, a.dst) + r * a.dst_pitch,
                  src.data() + offset(src, a.src) + r * a.src_pitch, a.row_bytes);
    }
  }

  const auto mode = GENERATE(PullCopies::kBesideCompute, PullCopies::kPlain);
  CAPTURE(mode == PullCopies::kPlain ? "plain" : "beside_compute");
  std::fill(dst.begin(), dst.end(), std::byte{0});
  CountingBackend backend;
  auto stream = backend.create_stream(StreamPriority::kLow);
  same_host::enqueue_pull_copies(backend, copies, *stream, mode);
  backend.stream_synchronize(*stream);

  CHECK(dst == expected);
  CHECK(backend.copy_bytes.load() == 10 + 36 + 36 + 32 + 16);
  if (mode == PullCopies::kBesideCompute) {
    CHECK(backend.batch_calls.load() == 1);
    CHECK(backend.beside_compute_batches.load() == 1);
    CHECK(backend.calls_2d.load() == 3);
    CHECK(backend.copy_calls.load() == 2 + 3);  // the batch's two regions, the three 2-D copies
  } else {
    CHECK(backend.batch_calls.load() == 0);
    CHECK(backend.calls_2d.load() == 5);
  }
}

TEST_CASE("pull copies: nothing to copy enqueues nothing") {
  CountingBackend backend;
  auto stream = backend.create_stream(StreamPriority::kLow);
  same_host::enqueue_pull_copies(backend, {}, *stream, PullCopies::kBesideCompute);
  backend.stream_synchronize(*stream);
  CHECK(backend.batch_calls.load() == 0);
  CHECK(backend.calls_2d.load() == 0);
}
