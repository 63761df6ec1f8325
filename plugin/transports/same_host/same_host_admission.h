// The same-host sender's admission of receivers: every accepted connection runs its handshake side
// by side with the others in one poll() loop, each against its own deadline, so that a peer that
// connects and then says nothing (a careless script, a hostile process of this user) delays no
// real receiver. When not every receiver came in time, the error names each peer that stalled or
// was refused by its process id and user (SO_PEERCRED) and the record it did not send, not the
// rank that was left waiting. Not installed.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync::same_host {

// A step some transports add after ready (the pull transport's hello): each receiver then sends
// one record of `record_bytes`, and `answer` decides from it and from the rank the receiver proved
// which seat (1..receivers) it takes, asking `taken` whether another receiver holds a seat
// already. Only then is the seat checked and held, so that a receiver set up for another world
// size hears why from `answer`'s refusal, not a bare "rank outside". (The pull transport's seats:
// one per engine rank and replica, while the proof names the engine rank only.)
struct HelloAnswer {
  bool admit = false;
  std::uint32_t seat = 0;        // admitted: its place, 1..receivers (index seat - 1 returned)
  std::vector<std::byte> reply;  // sent back (with the shared fd when admitted); empty: none
  std::string why;               // not admitted: for the timeout's message
};
struct AdmissionHello {
  std::size_t record_bytes = 0;
  std::function<HelloAnswer(std::uint32_t rank, std::span<const std::byte> record,
                            const std::function<bool(std::uint32_t seat)>& taken)>
      answer;
  std::string receivers = "receivers";  // what the timeout's message calls them
  int shown_rank_offset = 0;            // a proved rank r is named r + this in messages
  std::function<std::string(std::uint32_t seat)> seat_name;  // a missing seat, as named
};

// Accepts connections on `listener` (listening on `path`, for messages) until `receivers`
// receivers (ranks 1..receivers) proved `token`, checked the sender's proof and got
// `setup_record` with `shared_fd` passed along (SCM_RIGHTS). Returns their sockets, rank r at
// index r-1 (with a hello: seat s at index s-1). A peer of another user, one that fails the proof
// or asks for a rank out of range or already taken, closes its socket or does not finish its
// handshake within config.handshake_timeout of connecting is dropped, and the others go on; one
// admitted that closes its socket before every receiver came gives its rank back. Throws
// Error(kTimeout) once config.connect_timeout passed, naming the ranks still missing and every
// peer that stalled or was refused (pid, uid, what it did not send). Blocks the calling thread.
// With `hello`, each receiver's hello is read after ready and hello->answer's reply replaces
// `setup_record` (unused then).
std::vector<Fd> admit_receivers(int listener, const std::string& path, std::string_view token,
                                int receivers, std::span<const std::byte> setup_record,
                                int shared_fd, const SameHostConfig& config,
                                const AdmissionHello* hello = nullptr);

}  // namespace shadowsync::same_host
