// SameHostTransport across processes: the trainer is a child process (this binary, running the
// hidden test case "[.same_host_trainer]"), three receivers with their fake engines live in the
// test process. Both sides follow one deterministic schedule (update v carries base, LoRA or both
// by v % 3), so each side builds the update headers itself and no control channel is needed.
// Then the trainer is SIGKILLed and SIGSTOPped mid-update: the engines keep stepping, the failure
// is reported, the live bytes do not change, and a new trainer process connects and its next
// update applies. Last, 100 connect/abort cycles leave no fd, thread or memory file behind.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <future>
#include <thread>

#include "deadline.h"
#include "socket_dir.h"
#include "fake_engine.h"
#include "live_hash.h"
#include "pattern.h"
#include "process_resources.h"
#include "child_process.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/sender.h"


using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

const std::string kToken = "ssk1-4e217b3e708068e355dd91215ccb2ea999ee8d7530f4fd84340f63a34056aa56";
constexpr int kReceivers = 3;

Layout test_layout() {
  return Layout::build({{"embed", DType::kBFloat16, {300, 16}, "base"},
                        {"w", DType::kFloat32, {513}, "base"},
                        {"head", DType::kInt8, {1001}, "base"},
                        {"lora.A", DType::kBFloat16, {8, 16}, "lora"},
                        {"lora.B", DType::kFloat32, {33}, "lora"}},
                       {.bucket_bytes = 4096});
}

std::vector<std::string> groups_of(std::uint64_t v) {
  switch (v % 3) {
    case 0: return {"lora"};
    case 1: return {"base"};
    default: return {"base", "lora"};
  }
}

std::uint64_t env_u64(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? 0 : std::strtoull(value, nullptr, 10);
}

SameHostConfig config() {
  SameHostConfig c;
  c.connect_timeout = std::chrono::seconds(20);
  return c;
}

}  // namespace

// The trainer process. Environment: SS_SH_PATH, SS_SH_FIRST (first version), SS_SH_COUNT
// (updates to send), SS_SH_HANG (1: then start one more update, supply half of it, print "mid"
// on stdout and wait to be killed).
TEST_CASE("same-host trainer child", "[.same_host_trainer]") {
  const Layout layout = test_layout();
  HostBackend backend;
  auto transport = SameHostTransport::serve(std::getenv("SS_SH_PATH"), kToken, kReceivers, backend,
                                            SameHostMemory::kHost, layout.bucket_bytes(), config());
  Sender sender(layout, backend, std::move(transport));
  const std::uint64_t first = env_u64("SS_SH_FIRST");
  const std::uint64_t count = env_u64("SS_SH_COUNT");
  for (std::uint64_t v = first; v < first + count; ++v) {
    HostTensors tensors(layout, groups_of(v), v);
    sender.publish(v, groups_of(v), tensors.sources()).wait();
  }
  if (env_u64("SS_SH_HANG") == 1) {
    const std::uint64_t v = first + count;
    HostTensors tensors(layout, groups_of(v), v);
    StreamedPublish streamed = sender.publish_streamed(v, groups_of(v));
    const auto& all = tensors.sources();
    streamed.supply(std::vector<SourceTensor>(all.begin(), all.begin() + 2));
    std::fputs("mid\n", stdout);
    std::fflush(stdout);
    for (;;) ::pause();
  }
}

namespace {

std::unique_ptr<ChildProcess> spawn_trainer(const std::string& path, std::uint64_t first,
                                            std::uint64_t count, bool hang) {
  return spawn_self("[.same_host_trainer]",
                    {"SS_SH_PATH=" + path, "SS_SH_FIRST=" + std::to_string(first),
                     "SS_SH_COUNT=" + std::to_string(count),
                     std::string("SS_SH_HANG=") + (hang ? "1" : "0")});
}

struct Engines {
  const Layout& layout;
  std::vector<std::unique_ptr<HostBackend>> backends;
  std::vector<std::unique_ptr<Receiver>> receivers;
  std::vector<std::unique_ptr<HostFakeEngine>> engines;
  UpdateHistory history;

  explicit Engines(const Layout& l, ReceiverConfig rc) : layout(l) {
    for (int r = 0; r < kReceivers; ++r) {
      backends.push_back(std::make_unique<HostBackend>());
      receivers.push_back(std::make_unique<Receiver>(layout, *backends.back(), nullptr, rc));
      engines.push_back(std::make_unique<HostFakeEngine>(*backends.back(), *receivers.back()));
    }
  }
  ~Engines() {
    for (auto& e : engines) e->synchronize();
    engines.clear();
  }
  // Every receiver connects to the sender at `path` (blocks until one serves).
  void connect(const std::string& path) {
    std::vector<std::future<std::unique_ptr<SameHostTransport>>> futures;
    for (int r = 0; r < kReceivers; ++r) {
      HostBackend& backend = *backends[r];
      futures.push_back(std::async(std::launch::async, [&path, r, &backend] {
        return SameHostTransport::connect(path, kToken, r + 1, backend, config());
      }));
    }
    for (int r = 0; r < kReceivers; ++r) receivers[r]->replace_transport(futures[r].get());
  }
  void begin(std::uint64_t v) {
    const UpdateHeader header = make_update_header(layout, v, groups_of(v), true);
    history.add(v, {header.groups.begin(), header.groups.end()});
    for (auto& r : receivers) r->begin_update(header);
  }
  void apply(std::uint64_t v) {
    for (int r = 0; r < kReceivers; ++r) {
      const bool applied =
          receivers[r]->step_hook().wait_applied(v, deadline_from_now(), engines[r]->stream());
      // Read after the wait: the reason this update failed, if it did.
      INFO("receiver " << r << ", update " << v << ": " << receivers[r]->stats().last_error);
      REQUIRE(applied);
      engines[r]->step();
    }
  }
  void step_all() {
    for (auto& e : engines) e->step();
  }
  void check_oracle() {
    for (int r = 0; r < kReceivers; ++r) {
      engines[r]->synchronize();
      CHECK(engines[r]->torn_steps() == 0);
      CHECK(history.check(engines[r]->records()).empty());
    }
  }
  std::vector<std::uint64_t> hashes() {
    std::vector<std::uint64_t> out;
    for (int r = 0; r < kReceivers; ++r) {
      engines[r]->synchronize();
      out.push_back(live_hash(*receivers[r]));
    }
    return out;
  }
};

// `bucket_deadline`: how soon a trainer that stops sending fails the update.
ReceiverConfig receiver_config(std::chrono::milliseconds bucket_deadline) {
  ReceiverConfig rc;
  rc.bucket_deadline = bucket_deadline;
  rc.update_deadline = 5 * bucket_deadline;
  rc.require_checksums = true;
  return rc;
}

}  // namespace

TEST_CASE("same-host processes: 1,000 updates to three receivers, 0 torn steps") {
  const Layout layout = test_layout();
  shadowsync::testing::SocketDir dir{"shadowsync_same_host_proc"};
  // Generous deadlines: three receivers and a trainer process share a loaded 2-core machine, and
  // what is checked is torn steps, not speed (a stalled update still fails, with its reason,
  // before the test's own 20 s wait).
  Engines engines(layout, receiver_config(std::chrono::milliseconds(3000)));
  constexpr std::uint64_t kUpdates = 1000;
  auto trainer = spawn_trainer(dir.path(), 1, kUpdates, false);
  engines.connect(dir.path());
  for (std::uint64_t v = 1; v <= kUpdates; ++v) {
    engines.begin(v);
    engines.step_all();  // the engines step while the update streams in
    engines.apply(v);
  }
  const int status = trainer->reap();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  engines.check_oracle();
  for (auto& r : engines.receivers) {
    CHECK(r->stats().updates_ready == kUpdates);
    CHECK(r->stats().updates_failed == 0);
  }
}

TEST_CASE("same-host processes: a trainer killed or stopped mid-update fails it cleanly, and a "
          "new trainer's next update applies") {
  const Layout layout = test_layout();
  shadowsync::testing::SocketDir dir{"shadowsync_same_host_proc"};
  Engines engines(layout, receiver_config(std::chrono::milliseconds(1000)));
  const int signal = GENERATE(SIGKILL, SIGSTOP);
  CAPTURE(signal);

  auto trainer = spawn_trainer(dir.path(), 1, 3, true);
  engines.connect(dir.path());
  for (std::uint64_t v = 1; v <= 3; ++v) {
    engines.begin(v);
    engines.apply(v);
  }
  const auto before = engines.hashes();
  engines.begin(4);  // the trainer sends half of it, then dies or stops
  wait_for_output(*trainer, "mid\n");
  ::kill(trainer->pid, signal);
  for (int r = 0; r < kReceivers; ++r) {
    // The engine keeps stepping while the failure is detected (EOF at once for a kill, the
    // bucket deadline for a stop).
    wait_until(
        [&] {
          engines.engines[r]->step();
          return engines.receivers[r]->stats().updates_failed == 1;
        },
        "receiver " + std::to_string(r) + " reports update 4 failed");
    const std::string error = engines.receivers[r]->stats().last_error;
    CAPTURE(error);
    if (signal == SIGKILL) {
      CHECK_THAT(error, Catch::Contains("closed its socket"));
    } else {
      CHECK_THAT(error, Catch::Contains("deadline"));
    }
    CHECK(engines.receivers[r]->step_hook().applied_version() == 3);
  }
  engines.history.add(4, {});  // never applied: keep the history's versions increasing
  engines.history.mark_failed(4);
  CHECK(engines.hashes() == before);  // live bytes untouched
  ::kill(trainer->pid, SIGKILL);
  trainer->reap();

  // A new trainer process, a new connection; its next update applies.
  auto next = spawn_trainer(dir.path(), 5, 3, false);
  engines.connect(dir.path());
  for (std::uint64_t v = 5; v <= 7; ++v) {
    engines.begin(v);
    engines.apply(v);
  }
  const int status = next->reap();
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  engines.check_oracle();
}

TEST_CASE("same-host: 100 connect/abort cycles leave no fd, thread or memory file behind") {
  shadowsync::testing::SocketDir dir{"shadowsync_same_host_proc"};
  HostBackend sender_backend;
  HostBackend receiver_backend;
  auto sender_stream = sender_backend.create_stream(StreamPriority::kNormal);
  auto receiver_stream = receiver_backend.create_stream(StreamPriority::kNormal);
  std::vector<std::byte> source(300, std::byte{7});
  std::vector<std::byte> target(300);
  auto done = receiver_backend.create_event();
  const auto cycle = [&](int i) {
    auto connecting = std::async(std::launch::async, [&] {
      return SameHostTransport::connect(dir.path(), kToken, 1, receiver_backend, config());
    });
    auto sender = SameHostTransport::serve(dir.path(), kToken, 1, sender_backend,
                                           SameHostMemory::kHost, 128, config());
    auto receiver = connecting.get();
    receiver->broadcast_async(target.data(), target.size(), 0, *receiver_stream);
    if (i % 2 == 0) sender->broadcast_async(source.data(), source.size(), 0, *sender_stream);
    receiver_backend.event_record(*done, *receiver_stream);
    if (i % 2 == 1) {
      receiver->abort();  // blocked on a doorbell that never comes
    } else {
      REQUIRE(receiver_backend.event_wait_for(*done, std::chrono::seconds(10)));
      sender->abort();
    }
    REQUIRE(receiver_backend.event_wait_for(*done, std::chrono::seconds(10)));
    sender_backend.stream_synchronize(*sender_stream);
  };
  cycle(0);  // warm up: lazily made things (the async pool, OpenSSL's tables) exist from here on
  const ProcessResources baseline = ProcessResources::now();
  const std::size_t maps_baseline = same_host_memory_files();
  CHECK(maps_baseline == 0);
  for (int i = 1; i <= 100; ++i) cycle(i);
  wait_back_to(baseline, "100 connect/abort cycles");
  CHECK(same_host_memory_files() == 0);
  CHECK(target == source);
}
