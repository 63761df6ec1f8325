// One control-channel TCP connection: the socket, the frame assembler, and, after the handshake,
// the session keys and sequence numbers that tag and verify every frame. Used by both endpoints;
// which frames it accepts depends on the local role. Not thread-safe, except that one thread may
// send while another reads (they share no state).
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "control/control_auth.h"
#include "shadowsync/control_frame.h"

namespace shadowsync::control {

using Clock = std::chrono::steady_clock;

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

// "127.0.0.1:4242"
std::string format_address(const sockaddr_in& address);
// Parses a numeric IPv4 address; throws Error(kInvalidArgument) naming it.
in_addr parse_ipv4(const std::string& address, const char* what);
// TCP_NODELAY (small frames must not wait for Nagle) and SO_KEEPALIVE (finds dead idle peers).
void tune_socket(int fd);
// Blocks until `events` are ready on `fd` or `deadline` passes; false on timeout.
bool wait_fd(int fd, short events, Clock::time_point deadline);
// A pipe whose ends are non-blocking and close-on-exec: [0] read, [1] write.
void make_wake_pipe(Fd& read_end, Fd& write_end);

enum class Role { kEngine, kTrainer };

class Connection {
 public:
  // `fd` must be a connected, non-blocking socket.
  Connection(Fd fd, std::string peer, Role role);

  int fd() const { return fd_.get(); }
  const std::string& peer() const { return peer_; }

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
