#include "control/channel_loop.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace shadowsync::control {
namespace {

// A failed accept (out of file descriptors) leaves the listener readable: back off instead of
// spinning.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);
// Bytes read from the wake-up pipe at a time: 64 of the engine's 24-byte reports.
constexpr std::size_t kWakeReadBytes = 64 * 24;
// An idle loop still wakes up this often.
constexpr auto kLongestPoll = std::chrono::seconds(60);

}  // namespace

void log_line(const ControlConfig& config, const std::string& line) {
  if (config.log) {
    config.log(line);
  } else {
    std::fprintf(stderr, "shadowsync control: %s\n", line.c_str());
  }
}

void LoopHandler::on_accept(Fd, const std::string&) {}
void LoopHandler::on_wake(std::span<const std::byte>) {}
void LoopHandler::after_reads() {}
void LoopHandler::end_turn() {}

ChannelLoop::ChannelLoop(const ControlConfig& config, std::string poll_failure_note)
    : config_(config), poll_failure_note_(std::move(poll_failure_note)) {
  make_wake_pipe(wake_read_, wake_write_);
}

void ChannelLoop::listen(Fd listener) { listener_ = std::move(listener); }

void ChannelLoop::stop(std::span<const std::byte> wake_record) noexcept {
  stopping_.store(true);
  // A full pipe already wakes the loop: a failed write loses nothing.
  notify(wake_record);
}

bool ChannelLoop::notify(std::span<const std::byte> record) noexcept {
  const ssize_t n = ::write(wake_write_.get(), record.data(), record.size());
  return n == static_cast<ssize_t>(record.size());
}

void ChannelLoop::run(LoopHandler& handler) {
  std::vector<pollfd> fds;
  std::vector<Link*> links;
  while (!stopping_.load()) {
    links.clear();
    handler.collect(links);
    fds.clear();
    fds.push_back({wake_read_.get(), POLLIN, 0});
    const bool listening = listener_ && Clock::now() >= accept_resume_;
    fds.push_back({listening ? listener_.get() : -1, POLLIN, 0});
    for (const Link* link : links) fds.push_back({link->connection->fd(), POLLIN, 0});

    // Sleep until the nearest deadline (or a wake-up).
    Clock::time_point next = Clock::now() + kLongestPoll;
    if (listener_ && !listening) next = std::min(next, accept_resume_);
    for (const Link* link : links) {
      next = std::min(next, link->handshake_deadline);
      if (link->connection->has_partial()) {
        next = std::min(next, link->connection->partial_since() + config_.frame_timeout);
      }
    }
    const int ready = ::poll(fds.data(), fds.size(), poll_timeout_ms(next));
    if (ready < 0 && errno != EINTR) {
      log_line(config_,
               fmt::format("poll failed: {}; {}", std::strerror(errno), poll_failure_note_));
      break;
    }
    if (ready > 0) {
      if (fds[0].revents != 0) drain_wake_pipe(handler);
      if (fds[1].revents != 0) accept_all(handler);
      // Connections accepted just now are polled from the next turn on.
      for (std::size_t i = 0; i < links.size(); ++i) {
        if (fds[i + 2].revents != 0 && handler.is_open(*links[i])) read(handler, *links[i]);
      }
    }
    handler.after_reads();
    links.clear();
    handler.collect(links);
    check_deadlines(handler, links);
    handler.end_turn();
  }
}

void ChannelLoop::drain_wake_pipe(LoopHandler& handler) {
  std::byte buffer[kWakeReadBytes];
  for (;;) {
    const ssize_t n = ::read(wake_read_.get(), buffer, sizeof buffer);
    if (n <= 0) return;  // EAGAIN: drained
    handler.on_wake(std::span<const std::byte>(buffer, static_cast<std::size_t>(n)));
  }
}

void ChannelLoop::accept_all(LoopHandler& handler) {
  for (;;) {
    sockaddr_in address{};
    socklen_t length = sizeof address;
    Fd fd(::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&address), &length,
                    SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        log_line(config_, fmt::format("accept failed: {}; retrying in {} ms", std::strerror(errno),
                                      kAcceptBackoff.count()));
        accept_resume_ = Clock::now() + kAcceptBackoff;
      }
      return;
    }
    handler.on_accept(std::move(fd), format_address(address));
  }
}

void ChannelLoop::read(LoopHandler& handler, Link& link) {
  Connection& connection = *link.connection;
  std::string why;
  if (!connection.read_available(why)) {
    handler.on_failure(link, LinkFailure::kClosed, why);
    return;
  }
  while (handler.is_open(link)) {
    ControlMessage message;
    switch (connection.next(message, why)) {
      case Connection::Next::kNeedMore:
        return;
      case Connection::Next::kBad:
        handler.on_failure(link, LinkFailure::kProtocol, why);
        return;
      case Connection::Next::kMessage:
        handler.on_message(link, message);
        break;
    }
  }
}

void ChannelLoop::check_deadlines(LoopHandler& handler, const std::vector<Link*>& links) {
  const auto now = Clock::now();
  for (Link* link : links) {
    if (!handler.is_open(*link)) continue;
    const Connection& connection = *link->connection;
    if (now >= link->handshake_deadline) {
      handler.on_failure(
          *link, LinkFailure::kProtocol,
          fmt::format("handshake not completed within {} ms", config_.handshake_timeout.count()));
    } else if (connection.has_partial() &&
               now >= connection.partial_since() + config_.frame_timeout) {
      handler.on_failure(
          *link, LinkFailure::kProtocol,
          fmt::format("a frame was not completed within {} ms", config_.frame_timeout.count()));
    }
  }
}

}  // namespace shadowsync::control
