// Internal to the sender and the receiver: how a deadline's message names what the transport
// still waits for (Transport::waiting_for), so that a late peer is named, not just the deadline.
#pragma once

#include <string>

#include <fmt/format.h>

#include "shadowsync/transport.h"

namespace shadowsync {

// "; the transport waits for the doorbell of bucket 0 of update 2 (group 0, bucket 0) from trainer
// rank 1, for 10004 ms (trainer rank 0 sent its)", or "" when the transport has nothing to say.
inline std::string transport_wait_clause(Transport& transport) {
  const std::optional<std::string> waiting = transport.waiting_for();
  return waiting ? fmt::format("; the transport waits for {}", *waiting) : std::string();
}

}  // namespace shadowsync
