// The same-host sender's admission of receivers: every accepted connection runs its handshake side
// by side with the others in one poll() loop, each against its own deadline, so that a peer that
// connects and then says nothing (a careless script, a hostile process of this user) delays no
// real receiver. When not every receiver came in time, the error names each peer that stalled or
// was refused by its process id and user (SO_PEERCRED) and the record it did not send, not the
// rank that was left waiting. Not installed.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

// Accepts connections on `listener` (listening on `path`, for messages) until `receivers`
// receivers (ranks 1..receivers) proved `token`, checked the sender's proof and got
// `setup_record` with `shared_fd` passed along (SCM_RIGHTS). Returns their sockets, rank r at
// index r-1. A peer of another user, one that fails the proof or asks for a rank out of range or
// already taken, closes its socket or does not finish its handshake within
// config.handshake_timeout of connecting is dropped, and the others go on. Throws
// Error(kTimeout) once config.connect_timeout passed, naming the ranks still missing and every
// peer that stalled or was refused (pid, uid, what it did not send). Blocks the calling thread.
std::vector<Fd> admit_receivers(int listener, const std::string& path, std::string_view token,
                                int receivers, std::span<const std::byte> setup_record,
                                int shared_fd, const SameHostConfig& config);

}  // namespace shadowsync::same_host
