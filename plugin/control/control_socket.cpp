#include "control/control_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "shadowsync/error.h"

namespace shadowsync::control {

std::string format_address(const sockaddr_in& address) {
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof text);
  return fmt::format("{}:{}", text, ntohs(address.sin_port));
}

in_addr parse_ipv4(const std::string& address, const char* what) {
  in_addr out{};
  if (::inet_pton(AF_INET, address.c_str(), &out) != 1) {
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("control channel: {} '{}' is not a numeric IPv4 address", what, address));
  }
  return out;
}

void tune_socket(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
}

int poll_timeout_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 60'000));
}

bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) return true;  // let the caller's read or write report it
    if (n == 0 && Clock::now() >= deadline) return false;
  }
}

void make_wake_pipe(Fd& read_end, Fd& write_end) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(ErrorCode::kTransport,
                fmt::format("control channel: pipe2 failed: {}", std::strerror(errno)));
  }
  read_end.reset(fds[0]);
  write_end.reset(fds[1]);
}

Fd listen_tcp(const std::string& address, std::uint16_t port, std::uint16_t& bound) {
  sockaddr_in local{};
  local.sin_family = AF_INET;
  local.sin_addr = parse_ipv4(address, "bind address");
  local.sin_port = htons(port);
  const std::string where = fmt::format("{}:{}", address, port);

  Fd listener(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listener) {
    throw Error(ErrorCode::kTransport,
                fmt::format("engine channel: socket failed: {}", std::strerror(errno)));
  }
  const int one = 1;
  ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&local), sizeof local) != 0 ||
      ::listen(listener.get(), 64) != 0) {
    throw Error(ErrorCode::kTransport, fmt::format("engine channel: cannot listen on {}: {}", where,
                                                   std::strerror(errno)));
  }
  socklen_t length = sizeof local;
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&local), &length);
  bound = ntohs(local.sin_port);
  return listener;
}

Fd connect_tcp(const std::string& host, std::uint16_t port, Clock::time_point deadline) {
  sockaddr_in target{};
  target.sin_family = AF_INET;
  target.sin_addr = parse_ipv4(host, "engine address");
  target.sin_port = htons(port);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd) {
    throw Error(ErrorCode::kTransport,
                fmt::format("control channel: socket failed: {}", std::strerror(errno)));
  }
  const std::string where = fmt::format("{}:{}", host, port);
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&target), sizeof target) != 0) {
    if (errno != EINPROGRESS) {
      throw Error(ErrorCode::kTransport, fmt::format("control channel: connecting to engine {} "
                                                     "failed: {}",
                                                     where, std::strerror(errno)));
    }
    if (!wait_fd(fd.get(), POLLOUT, deadline)) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("control channel: connecting to engine {} timed out", where));
    }
    int error = 0;
    socklen_t length = sizeof error;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      throw Error(ErrorCode::kTransport, fmt::format("control channel: connecting to engine {} "
                                                     "failed: {}",
                                                     where, std::strerror(error)));
    }
  }
  tune_socket(fd.get());
  return fd;
}

}  // namespace shadowsync::control
