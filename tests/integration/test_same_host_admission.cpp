// The same-host sender's admission of receivers against a peer that connects to its socket and
// then says nothing (another process of the same user: a careless script, or a hostile one). The
// silent peer is a child process (this binary, running the hidden test case
// "[.same_host_silent_peer]"), so that its pid is not the test's. Its handshakes run side by side:
// the silent peer delays no real receiver, and when set-up does time out, the error names the
// peers that stalled (pid, uid, what they did not send), not the rank left waiting.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <string>

#include "child_process.h"
#include "deadline.h"
#include "socket_dir.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/same_host_transport.h"
#include "transports/same_host/same_host_socket.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

const std::string kToken = "ssk1-849d29db7f6df71cf9a1cb02cd4d3c33b78f594d7aeec6ed21eaed9fb4c86d7d";
constexpr std::size_t kSlotBytes = 128;

// Connects to the sender at `path` once it listens (the test's deadline if it never does) and
// reads its challenge: from then on the sender has accepted the connection and awaits a proof.
same_host::Fd connect_and_take_challenge(const std::string& path) {
  same_host::Fd socket;
  wait_until(
      [&] {
        socket = same_host::try_connect(path);
        return static_cast<bool>(socket);
      },
      "a sender listening on " + path);
  std::array<std::byte, 40> challenge{};
  const same_host::Io io = same_host::read_exact(socket.get(), challenge, -1, deadline_from_now());
  REQUIRE(io == same_host::Io::kOk);
  return socket;
}

}  // namespace

// The silent peer. Environment: SS_SILENT_PATH. Connects, takes the challenge, prints
// "challenged", then sends nothing; prints "dropped" once the sender closes the connection.
TEST_CASE("same-host silent peer child", "[.same_host_silent_peer]") {
  const same_host::Fd socket = connect_and_take_challenge(std::getenv("SS_SILENT_PATH"));
  std::fputs("challenged\n", stdout);
  std::fflush(stdout);
  char byte = 0;
  REQUIRE(::recv(socket.get(), &byte, 1, 0) == 0);
  std::fputs("dropped\n", stdout);
  std::fflush(stdout);
}

TEST_CASE("same-host admission: a silent peer on the socket delays no receiver") {
  shadowsync::testing::SocketDir dir{"shadowsync_same_host_admission"};
  HostBackend sender_backend;
  HostBackend receiver_backend;
  SameHostConfig config;
  config.connect_timeout = std::chrono::seconds(20);
  // The silent peer keeps its connection longer than this test waits for the receiver: a sender
  // that admits one connection at a time cannot get to the receiver in time.
  config.handshake_timeout = std::chrono::seconds(20);
  constexpr auto kReceiverIn = std::chrono::seconds(10);

  auto serving = std::async(std::launch::async, [&] {
    return SameHostTransport::serve(dir.path(), kToken, 1, sender_backend, SameHostMemory::kHost,
                                    kSlotBytes, config);
  });
  auto silent = spawn_self("[.same_host_silent_peer]", {"SS_SILENT_PATH=" + dir.path()});
  wait_for_output(*silent, "challenged\n");  // accepted first; now it says nothing
  auto connecting = std::async(std::launch::async, [&] {
    return SameHostTransport::connect(dir.path(), kToken, 1, receiver_backend, config);
  });
  const bool served = serving.wait_for(kReceiverIn) == std::future_status::ready;
  if (!served) {
    ::kill(silent->pid, SIGKILL);  // lets a sender stuck on the silent peer go on, and end
    silent->reap();
  }
  INFO("the sender admitted the receiver within " << kReceiverIn.count() << " s: " << served);
  REQUIRE(served);
  const auto sender = serving.get();
  const auto receiver = connecting.get();
  CHECK(sender->world_size() == 2);
  CHECK(receiver->rank() == 1);
  // Set-up done, the sender closed the handshake it never finished: the child sees it and exits.
  require_exited_zero(*silent);
  CHECK_THAT(silent->output, Catch::Contains("dropped\n"));
}

TEST_CASE("same-host admission: a set-up that times out names the peers that stalled") {
  shadowsync::testing::SocketDir dir{"shadowsync_same_host_admission"};
  HostBackend sender_backend;
  SameHostConfig config;
  // The peers connect within milliseconds of the socket appearing; both are still there (the
  // silent one within its handshake time) when the wait for the receiver ends.
  config.connect_timeout = std::chrono::seconds(3);
  config.handshake_timeout = std::chrono::seconds(10);

  // The child starts first and waits for the socket, so that its start-up does not count.
  auto silent = spawn_self("[.same_host_silent_peer]", {"SS_SILENT_PATH=" + dir.path()});
  auto serving = std::async(std::launch::async, [&] {
    return SameHostTransport::serve(dir.path(), kToken, 1, sender_backend, SameHostMemory::kHost,
                                    kSlotBytes, config);
  });
  wait_for_output(*silent, "challenged\n");
  // A second peer, this process, leaves after the challenge.
  connect_and_take_challenge(dir.path()).reset();

  const bool ended = serving.wait_for(kTestDeadline) == std::future_status::ready;
  const pid_t silent_pid = silent->pid;
  ::kill(silent_pid, SIGKILL);
  silent->reap();
  REQUIRE(ended);
  std::string message;
  ErrorCode code = ErrorCode::kInternal;
  try {
    serving.get();
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  }
  CAPTURE(message);
  CHECK(code == ErrorCode::kTimeout);
  CHECK_THAT(message, Catch::Contains("0 of 1 receivers connected within 3000 ms"));
  CHECK_THAT(message, Catch::Contains("rank(s) 1 not admitted"));
  const std::string uid = std::to_string(::geteuid());
  CHECK_THAT(message, Catch::Contains("peer pid " + std::to_string(silent_pid) + " (uid " + uid +
                                      ") connected") &&
                          Catch::Contains("has not sent its proof of the token"));
  CHECK_THAT(message, Catch::Contains("peer pid " + std::to_string(::getpid()) + " (uid " + uid +
                                      ") closed its socket") &&
                          Catch::Contains("before sending its proof of the token"));
}
