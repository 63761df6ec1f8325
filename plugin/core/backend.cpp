// The default implementations of Backend's optional calls.
#include "shadowsync/backend.h"

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync {

void Backend::memcpy_batch_async(const std::vector<CopyRegion>& copies, Stream& stream) {
  for (const CopyRegion& c : copies) memcpy_async(c.dst, c.src, c.bytes, stream);
}

void Backend::checksum_async(const void* /*data*/, std::size_t bytes, std::uint64_t* /*result*/,
                             Stream& /*stream*/) {
  throw Error(ErrorCode::kBackend,
              fmt::format("backend '{}' has no checksum_async (asked for {} bytes); checksums "
                          "need a backend whose supports_integrity() is true",
                          name(), bytes));
}

void Backend::count_nonfinite_async(const void* /*data*/, std::size_t elements, DType dtype,
                                    std::uint64_t* /*result*/, Stream& /*stream*/) {
  throw Error(ErrorCode::kBackend,
              fmt::format("backend '{}' has no count_nonfinite_async (asked for {} {} elements); "
                          "the non-finite guard needs a backend whose supports_integrity() is true",
                          name(), elements, dtype_name(dtype)));
}

void Backend::quantize_fp8_async(const void* /*src*/, DType dtype, std::size_t elements,
                                 std::size_t /*parts*/, void* /*dst*/, float* /*scales*/,
                                 Stream& /*stream*/) {
  throw Error(ErrorCode::kBackend,
              fmt::format("backend '{}' has no quantize_fp8_async (asked for {} {} elements); an "
                          "engine whose weights are FP8 needs the host or the CUDA backend",
                          name(), elements, dtype_name(dtype)));
}

std::string Backend::remap_unsupported_reason() const {
  return fmt::format("backend '{}' has no virtual memory remapping (only the CUDA backend on a "
                     "device with CUDA VMM has)",
                     name());
}

std::unique_ptr<RemappableArena> Backend::create_remappable_arena(std::size_t bytes) {
  throw Error(ErrorCode::kBackend,
              fmt::format("cannot create a remappable arena of {} bytes: {}", bytes,
                          remap_unsupported_reason()));
}

std::unique_ptr<StreamGate> Backend::create_stream_gate() {
  throw Error(ErrorCode::kBackend,
              fmt::format("backend '{}' has no stream gates (the gated remap swap needs one: the "
                          "CUDA backend, or the host backend)",
                          name()));
}

}  // namespace shadowsync
