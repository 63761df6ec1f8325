// The sockets under the control channel: an owned file descriptor, the TCP listener (engine) and
// connect (trainer), socket options, deadline waits and the wake-up pipe. All POSIX, IPv4 only
// (addresses are numeric: no resolver that could block). Every function is thread-safe; an Fd is
// not.
#pragma once

#include <netinet/in.h>

#include <chrono>
#include <cstdint>
#include <string>

#include "core/unique_fd.h"

namespace shadowsync::control {

using Clock = std::chrono::steady_clock;

using Fd = UniqueFd;

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
// Milliseconds from now until `deadline` for poll(): 0 once it passed, at most one minute.
int poll_timeout_ms(Clock::time_point deadline);

// A non-blocking, close-on-exec socket listening on `address`:`port` (0: any free port; `bound`
// says which). Throws Error(kInvalidArgument) for an address that is not numeric IPv4 and
// Error(kTransport) naming the address when it cannot listen there.
Fd listen_tcp(const std::string& address, std::uint16_t port, std::uint16_t& bound);

// A non-blocking, close-on-exec socket connected to the engine at `host`:`port` (tuned with
// tune_socket), connected before `deadline`. Throws Error(kInvalidArgument) for an address that
// is not numeric IPv4, Error(kTimeout) or Error(kTransport) naming the engine.
Fd connect_tcp(const std::string& host, std::uint16_t port, Clock::time_point deadline);

}  // namespace shadowsync::control
