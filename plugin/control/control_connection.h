// One control-channel TCP connection: the socket, the frame assembler, and, after the handshake,
// the session keys and sequence numbers that tag and verify every frame. Used by both endpoints;
// which frames it accepts depends on the local role. Not thread-safe, except that one thread may
// send while another reads (they share no state).
#pragma once

#include <cstdint>
#include <string>

#include "control/control_auth.h"
#include "control/control_frame.h"
#include "control/control_socket.h"
#include "control/frame_assembler.h"

namespace shadowsync::control {

enum class Role { kEngine, kTrainer };

class Connection {
 public:
  // `fd` must be a connected, non-blocking socket; the connection owns it from now on and
  // closes it when destroyed. `peer` names it in messages; `role` is this side's.
  Connection(Fd fd, std::string peer, Role role);

  int fd() const { return fd_.get(); }
  const std::string& peer() const { return peer_; }
  Role role() const { return role_; }

  // From now on every frame sent is tagged and every frame received must be tagged and verify.
  void start_session(const SessionKeys& keys);
  bool in_session() const { return in_session_; }

  // Encodes the message (tags it in a session) and writes it whole before `deadline`. Throws
  // Error(kTimeout) or Error(kTransport) naming the peer; the connection is unusable after that.
  void send(const ControlMessage& message, Clock::time_point deadline);

  // Reads one chunk of what the socket holds (never blocks). Returns false when the peer closed
  // or the read failed; `why` says which.
  bool read_available(std::string& why);

  enum class Next { kMessage, kNeedMore, kBad };
  // The next complete frame, checked in this order: header (magic, version, type, length), that
  // this role may receive it, that it belongs to the phase (untagged before the session, tagged
  // in it), its tag and sequence number, then every field of the payload. kBad: `why` says what
  // was wrong; close the connection.
  Next next(ControlMessage& out, std::string& why);

  // Bytes of an incomplete frame are waiting, since `partial_since()`.
  bool has_partial() const { return assembler_.has_partial(); }
  Clock::time_point partial_since() const { return partial_since_; }

  // Blocking receive for the trainer's handshake: reads until a message arrives or `deadline`
  // passes. Throws Error(kTimeout) or Error(kTransport) naming the peer.
  ControlMessage receive(Clock::time_point deadline);

  // Shuts the socket down both ways (a reader blocked in poll wakes up); the fd stays open.
  void shutdown() noexcept;

 private:
  Fd fd_;
  std::string peer_;
  Role role_;
  FrameAssembler assembler_;
  bool in_session_ = false;
  SessionKeys keys_;
  std::uint64_t send_sequence_ = 0;
  std::uint64_t receive_sequence_ = 0;
  Clock::time_point partial_since_{};
};

}  // namespace shadowsync::control
