// The default implementations of Backend's optional calls.
#include "shadowsync/backend.h"

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync {

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

}  // namespace shadowsync
