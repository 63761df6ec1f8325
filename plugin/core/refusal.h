// Why the receiver discards an update, and where when a check of its bytes refused it. Made on
// the receiver thread by the receive and its checks, turned into an UpdateReport by the receiver.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "shadowsync/error.h"

namespace shadowsync {

struct Refusal {
  ErrorCode code = ErrorCode::kInternal;
  std::string why;
  bool transport_failed = true;  // the collective did not complete cleanly: abort the transport
  std::string group;
  std::optional<std::size_t> bucket;
  std::string tensor;
};

}  // namespace shadowsync
