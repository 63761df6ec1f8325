// The same-host transport's Unix socket plumbing: the private directory, a listener that replaces
// a stale socket file, connecting, exact reads and writes that an eventfd can interrupt, and
// passing a file descriptor (SCM_RIGHTS). Linux only.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/unique_fd.h"

namespace shadowsync::same_host {

using Clock = std::chrono::steady_clock;

using Fd = UniqueFd;

// The directory that holds the socket: created (mode 0700) when absent and `create`; otherwise it
// must be a real directory (not a symbolic link) owned by this process's effective user with no
// permission bits for group or others, in a parent no other user can rename it in (owned by this
// user or root, and writable by no one else unless sticky, as /tmp is). Throws
// Error(kInvalidArgument) naming what it found.
void check_private_directory(const std::string& directory, bool create);

// The directory of socket path `path` (for check_private_directory); Error(kInvalidArgument) for
// a path without both a directory and a file name.
std::string socket_directory(const std::string& path);

// The uid of the process that listens on the other end of connected socket `fd` (SO_PEERCRED),
// which must be this process's effective user: else Error(kTransport) naming both uids. Call it
// before anything is sent, so that no proof of the token reaches another user's listener.
void check_listener_is_this_user(int fd, const std::string& path);

// Listens on `path` (mode 0600). A socket file already there is replaced if no one listens on
// it (connect refused: its sender died); a live one, a file that is not a socket or one owned by
// another user is refused with Error(kInvalidArgument).
Fd listen_on(const std::string& path, int backlog);

// One attempt to connect to `path`: the socket, or an empty Fd with errno set.
Fd try_connect(const std::string& path);

// A `wake` for the calls below: an eventfd (close-on-exec, non-blocking) that an abort writes
// once, readable from then on. Throws Error(kTransport) when the kernel gives none.
Fd make_wake();

enum class Io { kOk, kClosed, kWoken, kTimeout, kError };
// Reads exactly `out.size()` bytes (or writes all of `data`), waiting in poll() on `fd` and on
// `wake` (an eventfd: readable means give up; -1: none) until `deadline` (none: forever).
// kClosed: the peer closed (EOF, reset, broken pipe); kError: errno says why.
Io read_exact(int fd, std::span<std::byte> out, int wake, std::optional<Clock::time_point> deadline);
Io write_all(int fd, std::span<const std::byte> data, int wake,
             std::optional<Clock::time_point> deadline);
// As write_all, with `passed` riding along in an SCM_RIGHTS message on the first byte.
Io write_with_fd(int fd, std::span<const std::byte> data, int passed, Clock::time_point deadline);
// As read_exact; a descriptor received along is stored in `received` (close-on-exec).
Io read_with_fd(int fd, std::span<std::byte> out, Fd& received, Clock::time_point deadline);

// Reads one record of `record_bytes` bytes from every socket of `fds` side by side: one poll()
// over all of them and `wake`, so that a peer that closed its socket is seen at once, whatever
// the others do. Record i lands at out[i * record_bytes] (`out` is resized). Reads no byte past
// each record, so the next ones stay queued. kOk once every record came; otherwise the first
// other result, with `failed` the index of its socket (fds.size() for kWoken) and errno kept.
// kTimeout at `deadline` (none: it waits until the records came, a peer closed, or `wake` is
// readable), with `failed` the first socket whose record is still missing. `arrived`, if given,
// is called with i once socket i's record is complete (for what a caller reports while waiting).
Io read_each(std::span<const Fd> fds, std::size_t record_bytes, std::vector<std::byte>& out,
             int wake, std::size_t& failed,
             std::optional<Clock::time_point> deadline = std::nullopt,
             const std::function<void(std::size_t)>& arrived = {});

// Words for an Io result, for messages ("the peer closed its socket", "timed out", ...).
std::string describe(Io result, int saved_errno);

}  // namespace shadowsync::same_host
