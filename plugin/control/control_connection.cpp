#include "control/control_connection.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <cstring>

#include "shadowsync/error.h"

namespace shadowsync::control {
namespace {

// One read per poll wake-up: a busy peer cannot starve the others, and what is buffered stays
// below one incomplete frame plus this.
constexpr std::size_t kReadChunk = 16 * 1024;

}  // namespace

Connection::Connection(Fd fd, std::string peer, Role role)
    : fd_(std::move(fd)), peer_(std::move(peer)), role_(role) {}

void Connection::start_session(const SessionKeys& keys) {
  keys_ = keys;
  in_session_ = true;
  send_sequence_ = 0;
  receive_sequence_ = 0;
}

void Connection::send(const ControlMessage& message, Clock::time_point deadline) {
  std::vector<std::byte> frame = encode_frame(message);
  const FrameType type = frame_type_of(message);
  if (is_tagged(type) != in_session_) {
    throw Error(ErrorCode::kInternal, fmt::format("control channel: {} frame sent {} the session",
                                                  to_string(type), in_session_ ? "in" : "outside"));
  }
  if (in_session_) {
    const ControlMac& key =
        role_ == Role::kTrainer ? keys_.trainer_to_engine : keys_.engine_to_trainer;
    const ControlMac tag = frame_tag(key, send_sequence_++, frame);
    frame.insert(frame.end(), tag.begin(), tag.end());
  }
  std::size_t sent = 0;
  while (sent < frame.size()) {
    const ssize_t n = ::send(fd_.get(), frame.data() + sent, frame.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd_.get(), POLLOUT, deadline)) {
        throw Error(ErrorCode::kTimeout,
                    fmt::format("control peer {}: {} frame not written within its deadline "
                                "({} of {} bytes sent; the peer stopped reading)",
                                peer_, to_string(type), sent, frame.size()));
      }
      continue;
    }
    throw Error(ErrorCode::kTransport,
                fmt::format("control peer {}: sending {} frame failed: {}", peer_, to_string(type),
                            n < 0 ? std::strerror(errno) : "wrote nothing"));
  }
}

bool Connection::read_available(std::string& why) {
  std::array<std::byte, kReadChunk> chunk;
  for (;;) {
    const ssize_t n = ::recv(fd_.get(), chunk.data(), chunk.size(), 0);
    if (n > 0) {
      if (!assembler_.has_partial()) partial_since_ = Clock::now();
      assembler_.feed(std::span<const std::byte>(chunk.data(), static_cast<std::size_t>(n)));
      return true;
    }
    if (n == 0) {
      why = assembler_.has_partial() ? "closed the connection in the middle of a frame"
                                     : "closed the connection";
      return false;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    why = fmt::format("read failed: {}", std::strerror(errno));
    return false;
  }
}

Connection::Next Connection::next(ControlMessage& out, std::string& why) {
  switch (assembler_.next()) {
    case FrameAssembler::Status::kNeedMore:
      return Next::kNeedMore;
    case FrameAssembler::Status::kMalformed:
      why = fmt::format("malformed frame: {}", assembler_.error());
      return Next::kBad;
    case FrameAssembler::Status::kFrame:
      break;
  }
  // A fresh partial frame starts now if bytes are left over.
  partial_since_ = Clock::now();
  const FrameType type = assembler_.header().type;
  const std::span<const std::byte> frame = assembler_.frame();
  // A goodbye goes either way; every other frame has one direction.
  const bool for_engine = is_trainer_to_engine(type);
  if (type != FrameType::kGoodbye && for_engine != (role_ == Role::kEngine)) {
    why = fmt::format("{} frame is never sent to {}", to_string(type),
                      role_ == Role::kEngine ? "an engine" : "a trainer");
    return Next::kBad;
  }
  if (is_tagged(type) != in_session_) {
    why = fmt::format("{} frame {} the handshake", to_string(type),
                      in_session_ ? "after" : "before the end of");
    return Next::kBad;
  }
  std::span<const std::byte> payload = frame.subspan(kFrameHeaderBytes);
  if (in_session_) {
    // Verified before a field of the payload is looked at: nothing unauthenticated is decoded.
    const std::span<const std::byte> body = frame.first(frame.size() - kControlMacBytes);
    const ControlMac& key =
        role_ == Role::kEngine ? keys_.trainer_to_engine : keys_.engine_to_trainer;
    const ControlMac expected = frame_tag(key, receive_sequence_, body);
    if (!macs_equal(expected, frame.last(kControlMacBytes))) {
      why = fmt::format(
          "{} frame #{} fails its authentication tag (forged, replayed or "
          "reordered)",
          to_string(type), receive_sequence_);
      return Next::kBad;
    }
    ++receive_sequence_;
    payload = payload.first(payload.size() - kControlMacBytes);
  }
  if (auto error = decode_payload(type, payload, out)) {
    why = fmt::format("malformed {} frame: {}", to_string(type), *error);
    return Next::kBad;
  }
  return Next::kMessage;
}

ControlMessage Connection::receive(Clock::time_point deadline) {
  for (;;) {
    ControlMessage message;
    std::string why;
    switch (next(message, why)) {
      case Next::kMessage:
        return message;
      case Next::kBad:
        throw Error(ErrorCode::kTransport, fmt::format("control peer {}: {}", peer_, why));
      case Next::kNeedMore:
        break;
    }
    if (!wait_fd(fd_.get(), POLLIN, deadline)) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("control peer {}: no complete frame within the deadline", peer_));
    }
    if (!read_available(why)) {
      throw Error(ErrorCode::kTransport, fmt::format("control peer {}: {}", peer_, why));
    }
  }
}

void Connection::shutdown() noexcept {
  if (fd_) ::shutdown(fd_.get(), SHUT_RDWR);
}

}  // namespace shadowsync::control
