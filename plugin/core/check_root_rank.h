// The broadcast root named in a config must be a rank of the transport it is used with.
#pragma once

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "shadowsync/transport.h"

namespace shadowsync {

inline void check_root_rank(int root_rank, const Transport* transport, const char* what) {
  const int world = transport != nullptr ? transport->world_size() : 0;
  if (root_rank < 0 || (transport != nullptr && root_rank >= world)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} is {}, outside the transport's ranks 0..{}", what, root_rank,
                            world - 1));
  }
}

}  // namespace shadowsync
