// How a pull engine rank enqueues its copies; see same_host_pull_copies.h.
#include "transports/same_host/same_host_pull_copies.h"

#include <cstdlib>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync::same_host {

PullCopies pull_copies_from(const char* value) {
  const std::string_view v = value == nullptr ? std::string_view() : std::string_view(value);
  if (v.empty() || v == "beside_compute") return PullCopies::kBesideCompute;
  if (v == "plain") return PullCopies::kPlain;
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("{}='{}' is not a mode of the same-host pull transport's copies; "
                          "accepted: 'beside_compute' (the default) or 'plain'",
                          kPullCopiesEnv, v));
}

PullCopies pull_copies_from_environment() {
  return pull_copies_from(std::getenv(kPullCopiesEnv));  // NOLINT(concurrency-mt-unsafe)
}

void enqueue_pull_copies(Backend& backend, std::span<const AddressedCopy> copies, Stream& stream,
                         PullCopies mode) {
  std::vector<Backend::CopyRegion> flat;
  if (mode == PullCopies::kBesideCompute) flat.reserve(copies.size());
  for (const AddressedCopy& a : copies) {
    const bool contiguous =
        a.rows == 1 || (a.src_pitch == a.row_bytes && a.dst_pitch == a.row_bytes);
    if (mode == PullCopies::kBesideCompute && contiguous) {
      flat.push_back({a.dst, a.src, a.rows * a.row_bytes});
    } else {
      backend.memcpy_2d_async(a.dst, a.dst_pitch, a.src, a.src_pitch, a.row_bytes, a.rows, stream);
    }
  }
  if (!flat.empty()) backend.memcpy_batch_async(flat, stream, CopyHint::kBesideCompute);
}

}  // namespace shadowsync::same_host
