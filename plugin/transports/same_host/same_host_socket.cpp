#include "transports/same_host/same_host_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync::same_host {
namespace {

sockaddr_un socket_address(const std::string& path) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(address.sun_path)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket path '{}' must be 1..{} bytes long", path,
                            sizeof(address.sun_path) - 1));
  }
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  return address;
}

// Milliseconds until `deadline` for poll(): -1 for none, 0 once passed.
int poll_timeout(std::optional<Clock::time_point> deadline) {
  if (!deadline) return -1;
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(*deadline - Clock::now());
  if (left.count() <= 0) return 0;
  return static_cast<int>(std::min<std::int64_t>(left.count(), 1'000'000));
}

// Waits until `fd` has `events` or `wake` is readable.
Io wait_for(int fd, short events, int wake, std::optional<Clock::time_point> deadline) {
  for (;;) {
    pollfd fds[2] = {{fd, events, 0}, {wake, POLLIN, 0}};
    const int n = ::poll(fds, wake >= 0 ? 2 : 1, poll_timeout(deadline));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Io::kError;
    }
    if (wake >= 0 && (fds[1].revents & POLLIN)) return Io::kWoken;
    if (n == 0) {
      if (deadline && Clock::now() >= *deadline) return Io::kTimeout;
      continue;
    }
    if (fds[0].revents != 0) return Io::kOk;  // readable, writable, hang-up or error: try it
  }
}

bool closed_errno(int e) { return e == ECONNRESET || e == EPIPE || e == ENOTCONN; }

}  // namespace

void check_private_directory(const std::string& directory, bool create) {
  // The parent first: whoever may rename entries in it could swap the directory for their own.
  const std::string parent = std::filesystem::path(directory).lexically_normal().parent_path()
                                 .string();
  struct stat up {};
  if (!parent.empty() && ::stat(parent.c_str(), &up) == 0) {
    const bool others_own = up.st_uid != ::geteuid() && up.st_uid != 0;
    const bool others_write = (up.st_mode & 022) != 0 && (up.st_mode & S_ISVTX) == 0;
    if (others_own || others_write) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket directory '{}' lies in '{}' (mode {:04o}, owner uid "
                              "{}), where {} could rename it and put their own in its place; "
                              "use a directory in one only this user (or root, sticky like /tmp) "
                              "controls. Refusing it",
                              directory, parent, up.st_mode & 07777, up.st_uid,
                              others_own ? "its owner" : "other users"));
    }
  }
  struct stat st {};
  if (::lstat(directory.c_str(), &st) != 0) {
    if (errno != ENOENT || !create) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket directory '{}': {}", directory,
                              std::strerror(errno)));
    }
    if (::mkdir(directory.c_str(), 0700) != 0 && errno != EEXIST) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket directory '{}' could not be created (mode 0700): "
                              "{}",
                              directory, std::strerror(errno)));
    }
    if (::lstat(directory.c_str(), &st) != 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket directory '{}': {}", directory,
                              std::strerror(errno)));
    }
  }
  const uid_t me = ::geteuid();
  if (!S_ISDIR(st.st_mode)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket directory '{}' is not a directory{}; refusing it",
                            directory, S_ISLNK(st.st_mode) ? " (a symbolic link)" : ""));
  }
  if (st.st_uid != me || (st.st_mode & 077) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket directory '{}' has mode {:04o} and owner uid {}; it "
                            "must be private to this user (mode 0700, owner uid {}): other users "
                            "could reach or replace the socket. Refusing it",
                            directory, st.st_mode & 07777, st.st_uid, me));
  }
}

std::string socket_directory(const std::string& path) {
  const std::filesystem::path p(path);
  if (!p.has_parent_path() || p.filename().empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket path '{}' needs a directory and a file name", path));
  }
  return p.parent_path().string();
}

void check_listener_is_this_user(int fd, const std::string& path) {
  ucred cred{};
  socklen_t size = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &size) != 0) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the listener's credentials (SO_PEERCRED): "
                            "{}",
                            path, std::strerror(errno)));
  }
  if (cred.uid != ::geteuid()) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the process listening there (pid {}) runs "
                            "as uid {}, not this user (uid {}); nothing was sent to it. Another "
                            "user may have put a socket in the sender's place",
                            path, cred.pid, cred.uid, ::geteuid()));
  }
}

Fd listen_on(const std::string& path, int backlog) {
  const sockaddr_un address = socket_address(path);
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket path '{}' exists and is not a socket; refusing "
                              "to replace it",
                              path));
    }
    if (st.st_uid != ::geteuid()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket '{}' belongs to uid {}, not {}; refusing to "
                              "replace it",
                              path, st.st_uid, ::geteuid()));
    }
    Fd probe = try_connect(path);
    if (probe) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket '{}' is in use: another sender listens on it",
                              path));
    }
    if (errno != ECONNREFUSED) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host socket '{}' exists and connecting to it failed: {}",
                              path, std::strerror(errno)));
    }
    // Stale: its sender died before every receiver came. Ours to replace.
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("stale same-host socket '{}' could not be removed: {}", path,
                              std::strerror(errno)));
    }
  }
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) {
    throw Error(ErrorCode::kTransport, fmt::format("socket(AF_UNIX): {}", std::strerror(errno)));
  }
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket '{}': bind failed: {}", path, std::strerror(errno)));
  }
  if (::chmod(path.c_str(), 0600) != 0 || ::listen(fd.get(), backlog) != 0) {
    const int saved = errno;
    ::unlink(path.c_str());
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host socket '{}': {}", path, std::strerror(saved)));
  }
  return fd;
}

Fd make_wake() {
  Fd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) {
    throw Error(ErrorCode::kTransport, fmt::format("eventfd: {}", std::strerror(errno)));
  }
  return wake;
}

Fd try_connect(const std::string& path) {
  const sockaddr_un address = socket_address(path);
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) return fd;
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0) {
    const int saved = errno;
    fd.reset();
    errno = saved;
  }
  return fd;
}

Io read_exact(int fd, std::span<std::byte> out, int wake,
              std::optional<Clock::time_point> deadline) {
  std::size_t done = 0;
  while (done < out.size()) {
    if (const Io waited = wait_for(fd, POLLIN, wake, deadline); waited != Io::kOk) return waited;
    const ssize_t n = ::recv(fd, out.data() + done, out.size() - done, MSG_DONTWAIT);
    if (n == 0) return Io::kClosed;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return closed_errno(errno) ? Io::kClosed : Io::kError;
    }
    done += static_cast<std::size_t>(n);
  }
  return Io::kOk;
}

Io write_all(int fd, std::span<const std::byte> data, int wake,
             std::optional<Clock::time_point> deadline) {
  std::size_t done = 0;
  while (done < data.size()) {
    if (const Io waited = wait_for(fd, POLLOUT, wake, deadline); waited != Io::kOk) return waited;
    const ssize_t n =
        ::send(fd, data.data() + done, data.size() - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return closed_errno(errno) ? Io::kClosed : Io::kError;
    }
    done += static_cast<std::size_t>(n);
  }
  return Io::kOk;
}

Io write_with_fd(int fd, std::span<const std::byte> data, int passed, Clock::time_point deadline) {
  if (const Io waited = wait_for(fd, POLLOUT, -1, deadline); waited != Io::kOk) return waited;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  iovec iov{const_cast<std::byte*>(data.data()), data.size()};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(header), &passed, sizeof(int));
  ssize_t n = -1;
  do {
    n = ::sendmsg(fd, &message, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return closed_errno(errno) ? Io::kClosed : Io::kError;
  return write_all(fd, data.subspan(static_cast<std::size_t>(n)), -1, deadline);
}

Io read_with_fd(int fd, std::span<std::byte> out, Fd& received, Clock::time_point deadline) {
  std::size_t done = 0;
  while (done < out.size()) {
    if (const Io waited = wait_for(fd, POLLIN, -1, deadline); waited != Io::kOk) return waited;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)] = {};
    iovec iov{out.data() + done, out.size() - done};
    msghdr message{};
    message.msg_iov = &iov;
    message.msg_iovlen = 1;
    message.msg_control = control;
    message.msg_controllen = sizeof(control);
    const ssize_t n = ::recvmsg(fd, &message, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return closed_errno(errno) ? Io::kClosed : Io::kError;
    }
    // Every descriptor that arrived is owned here: the first is kept, any other closed.
    for (cmsghdr* h = CMSG_FIRSTHDR(&message); h != nullptr; h = CMSG_NXTHDR(&message, h)) {
      if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS) continue;
      const std::size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int passed = -1;
        std::memcpy(&passed, CMSG_DATA(h) + i * sizeof(int), sizeof(int));
        if (!received) {
          received = Fd(passed);
        } else {
          ::close(passed);
        }
      }
    }
    if (n == 0) return Io::kClosed;
    done += static_cast<std::size_t>(n);
  }
  return Io::kOk;
}

Io read_each(std::span<const Fd> fds, std::size_t record_bytes, std::vector<std::byte>& out,
             int wake, std::size_t& failed, std::optional<Clock::time_point> deadline,
             const std::function<void(std::size_t)>& arrived) {
  out.assign(fds.size() * record_bytes, std::byte{0});
  std::vector<std::size_t> filled(fds.size(), 0);
  std::size_t complete = 0;
  std::vector<pollfd> polled;
  std::vector<std::size_t> index;  // polled[i + 1] is fds[index[i]]
  while (complete < fds.size()) {
    polled.assign(1, {wake, POLLIN, 0});
    index.clear();
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (filled[i] == record_bytes) continue;
      polled.push_back({fds[i].get(), POLLIN, 0});
      index.push_back(i);
    }
    const int n = ::poll(polled.data(), polled.size(), poll_timeout(deadline));
    if (n < 0) {
      if (errno == EINTR) continue;
      failed = fds.size();
      return Io::kError;
    }
    if (wake >= 0 && (polled[0].revents & POLLIN)) {
      failed = fds.size();
      return Io::kWoken;
    }
    if (n == 0 && deadline && Clock::now() >= *deadline) {
      failed = index.front();  // the first peer whose record is still missing
      return Io::kTimeout;
    }
    for (std::size_t p = 1; p < polled.size(); ++p) {
      if (polled[p].revents == 0) continue;
      const std::size_t i = index[p - 1];
      const ssize_t got = ::recv(fds[i].get(), out.data() + i * record_bytes + filled[i],
                                 record_bytes - filled[i], MSG_DONTWAIT);
      if (got == 0 || (got < 0 && closed_errno(errno))) {
        failed = i;
        return Io::kClosed;
      }
      if (got < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        failed = i;
        return Io::kError;
      }
      filled[i] += static_cast<std::size_t>(got);
      if (filled[i] == record_bytes) {
        ++complete;
        if (arrived) arrived(i);
      }
    }
  }
  return Io::kOk;
}

std::string describe(Io result, int saved_errno) {
  switch (result) {
    case Io::kOk: return "ok";
    case Io::kClosed: return "the peer closed its socket (its process exited or aborted)";
    case Io::kWoken: return "aborted";
    case Io::kTimeout: return "timed out";
    case Io::kError: return std::strerror(saved_errno);
  }
  return "unknown";
}

}  // namespace shadowsync::same_host
