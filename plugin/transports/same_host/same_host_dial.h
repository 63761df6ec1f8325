// The receiver's side of the same-host handshake, up to ready: reaching a listener (which may
// start later, or be a stale socket file of one that died) and proving the token to it. Shared by
// SameHostTransport::connect and the pull transport's engine ranks, which each go on with what
// their transport exchanges next. Not installed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

// Connects to `path` (directory checked as check_private_directory(create=false) on every
// attempt), retrying every 5 ms while no one listens there (no file yet, or a stale one:
// connect refused), and checks the listener runs as this user before anything is sent. Returns
// an empty Fd once `deadline` passed, with the last attempt's errno in `last_errno`; other
// errors: Error(kTransport) naming the path.
Fd dial(const std::string& path, Clock::time_point deadline, int& last_errno);

// On a connected socket: reads the sender's challenge, sends the proof for `rank`, checks the
// sender's proof and sends ready, all by `deadline`. Throws Error(kTransport) naming `path`,
// `rank` and which side refused (the sender's refusal reason, a proof that does not verify), or
// Error(kTimeout) when the sender says nothing in time.
void prove_to_sender(int fd, const std::string& path, std::string_view token, std::uint32_t rank,
                     Clock::time_point deadline);

}  // namespace shadowsync::same_host
