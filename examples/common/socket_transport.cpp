#include "socket_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

#include "shadowsync/error.h"

namespace shadowsync::examples {

using Clock = std::chrono::steady_clock;

struct SocketTransport::State {
  int rank = 0;
  int world_size = 0;
  RendezvousId id;
  int listener = -1;
  std::vector<int> peers;  // rank 0: one socket per other rank; others: the root's
  std::mutex mutex;
  std::optional<std::string> error;
  bool aborted = false;

  ~State() {
    if (listener >= 0) ::close(listener);
    for (const int fd : peers) ::close(fd);
  }
  void fail(std::string why) {
    std::lock_guard lock(mutex);
    if (!error) error = std::move(why);
  }
  bool failed() {
    std::lock_guard lock(mutex);
    return error.has_value();
  }
};

namespace {

// Id layout: u16 port, then 16 cookie bytes.
constexpr std::size_t kCookieBytes = 16;

bool write_all(int fd, const std::byte* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::send(fd, data, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool read_all(int fd, std::byte* data, std::size_t bytes) {
  while (bytes > 0) {
    const ssize_t n = ::recv(fd, data, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

bool wait_readable(int fd, Clock::time_point deadline) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (n > 0) return true;
  }
}

void no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace

SocketTransport::SocketTransport(HostBackend& backend, std::shared_ptr<State> state)
    : backend_(backend), state_(std::move(state)) {}

SocketTransport::~SocketTransport() = default;

std::unique_ptr<SocketTransport> SocketTransport::listen(HostBackend& backend, int world_size) {
  auto state = std::make_shared<State>();
  state->rank = 0;
  state->world_size = world_size;
  state->listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  if (state->listener < 0 ||
      ::bind(state->listener, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::listen(state->listener, 16) != 0 ||
      ::getsockname(state->listener, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw Error(ErrorCode::kTransport,
                fmt::format("socket transport: cannot listen: {}", std::strerror(errno)));
  }
  const std::uint16_t port = ntohs(address.sin_port);
  std::memcpy(state->id.bytes.data(), &port, sizeof port);
  std::random_device random;
  for (std::size_t i = 0; i < kCookieBytes; ++i) {
    state->id.bytes[2 + i] = static_cast<std::byte>(random() & 0xff);
  }
  return std::unique_ptr<SocketTransport>(new SocketTransport(backend, std::move(state)));
}

void SocketTransport::accept_peers(Clock::time_point deadline) {
  State& s = *state_;
  std::vector<int> by_rank(static_cast<std::size_t>(s.world_size), -1);
  for (int joined = 1; joined < s.world_size;) {
    if (!wait_readable(s.listener, deadline)) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("socket transport: {} of {} ranks joined before the deadline", joined,
                              s.world_size));
    }
    const int fd = ::accept4(s.listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::byte hello[kCookieBytes + 4];
    std::int32_t rank = -1;
    if (!wait_readable(fd, deadline) || !read_all(fd, hello, sizeof hello) ||
        std::memcmp(hello, s.id.bytes.data() + 2, kCookieBytes) != 0 ||
        (std::memcpy(&rank, hello + kCookieBytes, 4), rank < 1 || rank >= s.world_size) ||
        by_rank[static_cast<std::size_t>(rank)] >= 0) {
      ::close(fd);  // not one of ours
      continue;
    }
    no_delay(fd);
    by_rank[static_cast<std::size_t>(rank)] = fd;
    ++joined;
  }
  for (std::size_t r = 1; r < by_rank.size(); ++r) s.peers.push_back(by_rank[r]);
}

std::unique_ptr<SocketTransport> SocketTransport::connect(HostBackend& backend,
                                                          const RendezvousId& id, int rank,
                                                          int world_size,
                                                          Clock::time_point deadline) {
  auto state = std::make_shared<State>();
  state->rank = rank;
  state->world_size = world_size;
  state->id = id;
  std::uint16_t port = 0;
  std::memcpy(&port, id.bytes.data(), sizeof port);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
      std::byte hello[kCookieBytes + 4];
      std::memcpy(hello, id.bytes.data() + 2, kCookieBytes);
      const std::int32_t r = rank;
      std::memcpy(hello + kCookieBytes, &r, 4);
      if (!write_all(fd, hello, sizeof hello)) {
        ::close(fd);
        throw Error(ErrorCode::kTransport, "socket transport: root closed during the join");
      }
      no_delay(fd);
      state->peers.push_back(fd);
      break;
    }
    if (fd >= 0) ::close(fd);
    if (Clock::now() >= deadline) {
      throw Error(
          ErrorCode::kTimeout,
          fmt::format("socket transport: rank {} could not reach the root on port {}", rank, port));
    }
    // The root listens before it sends the id, so this only retries a refused connection
    // under load; poll() with no descriptors is a bounded wait.
    ::poll(nullptr, 0, 10);
  }
  return std::unique_ptr<SocketTransport>(new SocketTransport(backend, std::move(state)));
}

const RendezvousId& SocketTransport::id() const { return state_->id; }
int SocketTransport::rank() const { return state_->rank; }
int SocketTransport::world_size() const { return state_->world_size; }

void SocketTransport::broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) {
  if (root != 0) {
    throw Error(ErrorCode::kInvalidArgument, "socket transport: only rank 0 can be the root");
  }
  backend_.launch_async(stream, [state = state_, data = static_cast<std::byte*>(buffer), bytes] {
    if (state->failed()) return;  // like an aborted NCCL collective: completes, bytes undefined
    for (const int fd : state->peers) {
      const bool ok = state->rank == 0 ? write_all(fd, data, bytes) : read_all(fd, data, bytes);
      if (!ok) {
        state->fail(
            fmt::format("socket transport rank {}: peer lost during a broadcast of {} "
                        "bytes",
                        state->rank, bytes));
        return;
      }
    }
  });
}

std::optional<std::string> SocketTransport::async_error() {
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

void SocketTransport::abort() noexcept {
  State& s = *state_;
  std::lock_guard lock(s.mutex);
  if (s.aborted) return;
  s.aborted = true;
  if (!s.error) s.error = "socket transport aborted";
  // Wakes a task blocked on a peer; the descriptors close with the state.
  for (const int fd : s.peers) ::shutdown(fd, SHUT_RDWR);
}

}  // namespace shadowsync::examples
