// The second-level watchdog: when aborting a failed transport (ncclCommAbort), or releasing a
// departed trainer's, does not return within ReceiverConfig::abort_deadline, the receiver says so
// (stderr, stats) and, with exit_on_stuck_abort, ends the process with kStuckAbortExitStatus. The
// transport here is a loopback rank whose abort() (or destructor) blocks until the test lets it
// go, as a hung ncclCommAbort (or a teardown waiting for its peer) would.
//
// How each test was checked to fail without its behaviour: with Receiver::Impl::abort_transport
// calling transport->abort() directly (no watch), the first test timed out waiting for
// stats().stuck_aborts and the second saw the child killed at its deadline instead of exiting 70.
// With release_transport destroying the transport unwatched, the release test timed out waiting
// for stats().stuck_aborts.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "deadline.h"
#include "fake_engine.h"
#include "live_hash.h"
#include "pattern.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"

extern char** environ;

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

using namespace std::chrono_literals;

Layout watchdog_layout() {
  return Layout::build({{"w0", DType::kFloat32, {700}, "base"}}, {.bucket_bytes = 1024});
}

// A loopback rank whose abort() blocks until release(): a communicator abort that hangs.
class StuckAbortTransport final : public Transport {
 public:
  explicit StuckAbortTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  std::string_view name() const override { return "stuck-abort"; }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    inner_->broadcast_async(buffer, bytes, root, stream);
  }
  std::optional<std::string> async_error() override { return inner_->async_error(); }
  void abort() noexcept override {
    {
      std::unique_lock lock(gate_->mutex);
      gate_->entered = true;
      gate_->cv.wait(lock, [&] { return gate_->released; });
    }
    inner_->abort();  // then the blocked collective returns, as after a real abort
  }

  struct Gate {
    std::mutex mutex;
    std::condition_variable cv;
    bool entered = false;
    bool released = false;
    void release() {
      {
        std::lock_guard lock(mutex);
        released = true;
      }
      cv.notify_all();
    }
    bool was_entered() {
      std::lock_guard lock(mutex);
      return entered;
    }
  };
  // Shared: the test keeps it after the receiver destroyed the transport.
  std::shared_ptr<Gate> gate() const { return gate_; }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
};

// A loopback rank whose destructor blocks until release(): a communicator teardown that waits
// for a peer that never tears its end down.
class StuckTeardownTransport final : public Transport {
 public:
  using Gate = StuckAbortTransport::Gate;
  explicit StuckTeardownTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}
  ~StuckTeardownTransport() override {
    std::unique_lock lock(gate_->mutex);
    gate_->entered = true;
    gate_->cv.wait(lock, [&] { return gate_->released; });
  }
  std::string_view name() const override { return "stuck-teardown"; }
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override {
    inner_->broadcast_async(buffer, bytes, root, stream);
  }
  std::optional<std::string> async_error() override { return inner_->async_error(); }
  void abort() noexcept override { inner_->abort(); }
  std::shared_ptr<Gate> gate() const { return gate_; }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<Gate> gate_ = std::make_shared<Gate>();
};

ReceiverConfig watchdog_config(bool exit_on_stuck_abort) {
  ReceiverConfig config;
  config.bucket_deadline = 100ms;  // nobody sends: the update fails here and aborts the transport
  config.abort_deadline = 200ms;
  config.exit_on_stuck_abort = exit_on_stuck_abort;
  return config;
}


// A receiver over a stuck transport (StuckAbortTransport or StuckTeardownTransport) on a dead
// loopback pair, and a fake engine stepping it. The gate is let go before the receiver is
// destroyed (which joins its thread): a failing check must not turn into a hung test.
template <typename StuckTransport>
struct StuckReceiver {
  struct LetGoAtExit {
    std::shared_ptr<StuckAbortTransport::Gate> gate;
    ~LetGoAtExit() { gate->release(); }
  };

  const Layout layout = watchdog_layout();
  HostBackend backend;
  LoopbackCommunicator dead{2};
  std::unique_ptr<StuckTransport> stuck = std::make_unique<StuckTransport>(dead.transport(1));
  const std::shared_ptr<StuckAbortTransport::Gate> gate = stuck->gate();
  Receiver receiver{layout, backend, std::move(stuck), watchdog_config(false)};
  LetGoAtExit let_go_at_exit{gate};
  HostFakeEngine engine{backend, receiver, {.full_check_every = 1}};
};

}  // namespace

TEST_CASE("abort watchdog: an abort that does not return is reported; the engine keeps stepping") {
  StuckReceiver<StuckAbortTransport> setup;
  auto& [layout, backend, dead, stuck, gate, receiver, let_go, engine] = setup;
  const std::uint64_t hash_before = live_hash(receiver);

  const auto started = std::chrono::steady_clock::now();
  receiver.begin_update(make_update_header(layout, 1, {"base"}));  // no sender: it never lands
  wait_until([&] { return receiver.stats().stuck_aborts == 1; },
             "the watchdog to report the stuck abort");
  const auto reported_after = std::chrono::steady_clock::now() - started;
  INFO("reported after " << std::chrono::duration_cast<std::chrono::milliseconds>(reported_after).count()
                         << " ms");
  CHECK(gate->was_entered());
  CHECK(reported_after >= 300ms);  // bucket deadline + abort deadline: not before it overran
  const ReceiverStats stats = receiver.stats();
  CHECK(stats.updates_failed == 0);  // the abort is still running: the failure is not reported yet
  CHECK_THAT(stats.last_error,
             Catch::Contains("aborting transport 'stuck-abort' (rank 1 of 2) after update 1 "
                             "failed has not returned after 200 ms"));
  // The engine is not held up by the stuck receiver thread.
  for (int i = 0; i < 3; ++i) CHECK_FALSE(engine.step().has_value());
  engine.synchronize();
  CHECK(live_hash(receiver) == hash_before);

  // The abort returns at last: the failure is reported and a new transport brings updates back.
  gate->release();
  wait_until([&] { return receiver.stats().updates_failed == 1; }, "update 1 reported failed");
  CHECK(receiver.stats().stuck_aborts == 1);
  CHECK(receiver.stats().needs_transport);
  LoopbackCommunicator fresh(2);
  Sender sender(layout, backend, fresh.transport(0));
  receiver.replace_transport(fresh.transport(1));
  HostTensors tensors(layout, {"base"}, 2);
  PublishHandle handle = sender.publish(2, {"base"}, tensors.sources());
  receiver.begin_update(handle.header());
  handle.wait();
  REQUIRE(receiver.step_hook().wait_applied(2, deadline_from_now(), engine.stream()));
  engine.step();
  engine.synchronize();
  CHECK(engine.torn_steps() == 0);
  // A prompt abort is not counted: update 3 has no sender, fails at its bucket deadline, and
  // its abort (of a plain loopback transport) returns at once.
  receiver.begin_update(make_update_header(layout, 3, {"base"}));
  wait_until([&] { return receiver.stats().updates_failed == 2; }, "update 3 reported failed");
  CHECK(receiver.stats().needs_transport);    // the abort ran
  CHECK(receiver.stats().stuck_aborts == 1);  // and was not counted as stuck
}

TEST_CASE("abort watchdog: a release whose teardown does not return is reported too") {
  StuckReceiver<StuckTeardownTransport> setup;
  auto& [layout, backend, dead, stuck, gate, receiver, let_go, engine] = setup;

  receiver.release_transport("trainer 127.0.0.1:1 left: said goodbye");
  wait_until([&] { return receiver.stats().stuck_aborts == 1; },
             "the watchdog to report the stuck teardown");
  CHECK(gate->was_entered());
  CHECK_THAT(receiver.stats().last_error,
             Catch::Contains("releasing transport 'stuck-teardown' (rank 1 of 2): trainer "
                             "127.0.0.1:1 left: said goodbye has not returned after 200 ms"));
  for (int i = 0; i < 3; ++i) CHECK_FALSE(engine.step().has_value());  // the engine steps on
  engine.synchronize();

  gate->release();
  wait_until([&] { return receiver.stats().needs_transport; }, "the release to finish");
  receiver.begin_update(make_update_header(layout, 1, {"base"}));
  wait_until([&] { return receiver.stats().updates_failed == 1; }, "update 1 reported failed");
  CHECK_THAT(receiver.stats().last_error,
             Catch::Contains("update 1: no transport (released: trainer 127.0.0.1:1 left: said "
                             "goodbye; the next rendezvous installs a new one)"));
  CHECK(receiver.stats().stuck_aborts == 1);
}

// Run by the next test in a child process: the abort never returns, the watchdog must end it.
TEST_CASE("abort watchdog child: exit_on_stuck_abort ends the process", "[.stuck_abort_child]") {
  const Layout layout = watchdog_layout();
  HostBackend backend;
  LoopbackCommunicator dead(2);
  Receiver receiver(layout, backend, std::make_unique<StuckAbortTransport>(dead.transport(1)),
                    watchdog_config(true));
  receiver.begin_update(make_update_header(layout, 1, {"base"}));
  // Only the watchdog ends this process; the parent kills it at its deadline otherwise.
  std::mutex mutex;
  std::condition_variable never;
  std::unique_lock lock(mutex);
  never.wait(lock, [] { return false; });
}

TEST_CASE("abort watchdog: with exit_on_stuck_abort a stuck abort ends the process") {
  char log_template[] = "/tmp/shadowsync_stuck_abort_XXXXXX";
  const int log_fd = mkstemp(log_template);
  REQUIRE(log_fd >= 0);
  close(log_fd);
  const std::string log_path = log_template;

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(), O_WRONLY | O_TRUNC,
                                   0);
  std::string self = "/proc/self/exe";
  std::string spec = "[.stuck_abort_child]";
  char* argv[] = {self.data(), spec.data(), nullptr};
  pid_t child = -1;
  REQUIRE(posix_spawn(&child, self.c_str(), &actions, nullptr, argv, environ) == 0);
  posix_spawn_file_actions_destroy(&actions);

  int status = 0;
  bool ended = false;
  try {
    wait_until([&] { return (ended = waitpid(child, &status, WNOHANG) == child); },
               "the child to exit on its stuck abort");
  } catch (...) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
  }
  std::ifstream log(log_path);
  std::stringstream text;
  text << log.rdbuf();
  std::remove(log_path.c_str());
  INFO("child stderr:\n" << text.str());
  REQUIRE(ended);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == kStuckAbortExitStatus);
  CHECK_THAT(text.str(), Catch::Contains("has not returned after 200 ms") &&
                             Catch::Contains("exiting the process with status 70 "
                                             "(ReceiverConfig::exit_on_stuck_abort)"));
}
