// The control channel between two processes: an engine that keeps decoding while it takes
// updates, and a trainer that connects to it, hands over the rendezvous (which transport to build
// and where to find the trainer's end), publishes updates and waits for the engine's acks.
//
// --backend host (the default): the host backend and the same-host transport in its host-memory
// flavour (a Unix socket and a shared memory file): no GPU needed.
// tests/integration/test_control_e2e.cpp runs it as two real processes, killing the first trainer
// and connecting a second.
//
// --backend cuda --device N (CUDA builds): CudaBackend on GPU N. The engine decodes with the GPU
// toy engine (one kernel per step on its stream that checks the weights it reads,
// examples/common/gpu_engine.h); each round the trainer runs a "train step" (fill kernels writing
// the next version's weights) and publishes it. The transport is NCCL by default (the NCCL unique
// id travels over the control channel); --transport same_host uses the same-host transport's
// device-memory flavour instead (staging slots in the trainer's GPU memory).
// scripts/gpu/run.sh examples runs it on GPUs 0 (trainer) and 1 (engine).
//
// The trainer picks the transport (--transport) and the rendezvous names it: the engine builds
// whatever the rendezvous asks for that its backend can run (host: same_host; cuda: nccl or
// same_host). Both ends prove the control token on the same-host socket too.
//
//   export SHADOWSYNC_CONTROL_TOKEN=$(python3 -c 'import shadowsync; print(shadowsync.make_token())')
//   (or $(openssl rand -hex 32); a token that is plainly not random is refused)
//   control_channel engine [--address A] [--port P] [--backend host|cuda] [--device N]
//       prints "listening <port>", then one "rendezvous transport=T rank=R world_size=W" line per
//       transport installed and one "update ..." line per applied update; runs until SIGTERM,
//       then prints one "engine summary: ..." line; exits 0 only if no step was torn.
//       A failed update prints "failed version=V code=C unix_ms=T error=..." (T: wall clock).
//       --bucket-deadline-ms MS sets ReceiverConfig::bucket_deadline.
//       --address: the numeric IPv4 address the engine listens on and the trainer dials
//       (default 127.0.0.1; another of the machine's addresses takes the control channel off the
//       loopback interface, as between two hosts).
//   control_channel trainer [--address A] --port P [--rounds N] [--die-after-header]
//                           [--hang-mid-update] [--backend host|cuda] [--device N]
//                           [--transport nccl|same_host]
//                           [--socket PATH]
//       prints "trainer: rendezvous transport=T ...", one "round ..." line per acked round, then
//       "trainer: N rounds acked, ...".
//       --transport: same_host (the default with --backend host, the only one it can run) or nccl
//       (the default with --backend cuda).
//       --socket: the same-host socket (default $XDG_RUNTIME_DIR/shadowsync/trainer-<pid>.sock, or
//       /tmp/shadowsync-<uid>/trainer-<pid>.sock; the directory must be the user's own, mode 0700,
//       and is created so when absent).
//       --hang-mid-update: then sends part of one more update, prints "trainer: mid-update
//       version=V" and waits for a signal (scripts/gpu/run.sh faults kills or stops it there).
//
// --device defaults to 1 for the engine and 0 for the trainer.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "host_engine.h"
#include "shadowsync/control_channel.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/sender.h"
#include "weights.h"

#if defined(SHADOWSYNC_WITH_CUDA)
#include "gpu_engine.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/nccl_transport.h"
#endif

#if defined(__SANITIZE_THREAD__)
#define SHADOWSYNC_EXAMPLE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SHADOWSYNC_EXAMPLE_TSAN 1
#endif
#endif
#if defined(SHADOWSYNC_EXAMPLE_TSAN)
// As in tests/support/catch_main.cpp: TSan does not model the fences moodycamel's queue (inside
// the receiver) synchronizes with; this program has no Catch main to bring the suppression.
extern "C" const char* __tsan_default_suppressions() { return "race:moodycamel::\n"; }
#endif

using namespace shadowsync;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kDeadline = std::chrono::seconds(30);

struct Options {
  std::string role;
  std::string backend = "host";
  std::string transport;  // trainer: "nccl" or "same_host"; empty: the backend's default
  std::string socket;     // trainer: the same-host socket; empty: default_socket_path()
  int device = -1;  // -1: 1 for the engine, 0 for the trainer
  std::string address = "127.0.0.1";  // engine: where it listens; trainer: where it dials
  std::uint16_t port = 0;
  int rounds = 50;
  bool die_after_header = false;
  bool hang_mid_update = false;  // trainer: after the rounds, stop halfway through one more
  int bucket_deadline_ms = 0;    // engine: ReceiverConfig::bucket_deadline (0: the default)
};

// Small on purpose (the test runs under sanitizers), but with several buckets per group and two
// groups, so an update is more than one broadcast and a LoRA-only update is possible.
Layout host_layout() {
  return Layout::build({{"embed.weight", DType::kFloat32, {4096}, "base"},
                        {"layer0.weight", DType::kBFloat16, {64, 64}, "base"},
                        {"lm_head.weight", DType::kFloat32, {2048}, "base"},
                        {"lora.A", DType::kBFloat16, {8, 64}, "lora"},
                        {"lora.B", DType::kBFloat16, {64, 8}, "lora"}},
                       {.bucket_bytes = 8192});
}

// On GPUs: a ~0.5 GB bf16 base (the size of a small model, so a transfer spans many decode
// steps) in 64 MiB buckets, with tensors that cross bucket boundaries and one whose last 8-byte
// word is partial, and a LoRA adapter.
Layout cuda_layout() {
  std::vector<TensorSpec> specs;
  specs.push_back({"embed.weight", DType::kBFloat16, {16384, 4096}, "base"});  // 128 MiB
  for (int l = 0; l < 12; ++l) {
    const std::string prefix = fmt::format("layers.{}.", l);
    specs.push_back({prefix + "wqkv", DType::kBFloat16, {3072, 4096}, "base"});  // 24 MiB
    specs.push_back({prefix + "norm", DType::kBFloat16, {4099}, "base"});        // partial word
  }
  specs.push_back({"lm_head.weight", DType::kBFloat16, {4096, 4096}, "base"});
  specs.push_back({"final_norm", DType::kFloat32, {4096}, "base"});
  specs.push_back({"lora.A", DType::kBFloat16, {16, 4096}, "lora"});
  specs.push_back({"lora.B", DType::kBFloat16, {4096, 16}, "lora"});
  return Layout::build(std::move(specs), {.bucket_bytes = std::size_t{64} << 20});
}

Layout example_layout(const Options& options) {
  return options.backend == "cuda" ? cuda_layout() : host_layout();
}

#if !defined(SHADOWSYNC_WITH_CUDA)
[[noreturn]] void no_cuda() {
  throw std::runtime_error(
      "--backend cuda: this build has no CUDA backend (configure with -DSHADOWSYNC_WITH_CUDA=ON "
      "where CUDA and NCCL are installed)");
}
#endif

// The transport the trainer asks for: --transport, else NCCL between GPUs and the same-host
// transport on the CPU (the only one the host backend runs across processes).
TransportKind trainer_transport(const Options& options) {
  if (options.transport.empty()) {
    return options.backend == "cuda" ? TransportKind::kNccl : TransportKind::kSameHost;
  }
  if (options.transport == "same_host") return TransportKind::kSameHost;
  if (options.backend != "cuda") {
    throw std::runtime_error(fmt::format("--transport {} needs --backend cuda; the host backend "
                                         "runs --transport same_host",
                                         options.transport));
  }
  return TransportKind::kNccl;
}

// A socket in a directory of this user's own: the runtime directory when there is one.
std::string default_socket_path() {
  const char* runtime = std::getenv("XDG_RUNTIME_DIR");
  const std::string dir = runtime != nullptr && *runtime != '\0'
                              ? fmt::format("{}/shadowsync", runtime)
                              : fmt::format("/tmp/shadowsync-{}", ::getuid());
  return fmt::format("{}/trainer-{}.sock", dir, ::getpid());
}

SameHostConfig same_host_config() {
  SameHostConfig config;
  config.connect_timeout = kDeadline;
  return config;
}

// The engine's end of a same-host rendezvous, on `backend` (the memory flavour is the trainer's:
// host memory for a HostBackend, device memory for a CudaBackend).
std::unique_ptr<Transport> connect_same_host(const RendezvousRequest& request,
                                             const std::string& token, Backend& backend) {
  return SameHostTransport::connect(request.transport.path, token, request.rank, backend,
                                    same_host_config());
}

void print_rendezvous(const RendezvousRequest& request) {
  std::printf("rendezvous transport=%s rank=%d world_size=%d\n",
              std::string(to_string(request.transport.kind)).c_str(), request.rank,
              request.world_size);
  std::fflush(stdout);
}

double ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

std::atomic<bool> g_stop{false};
void on_signal(int) { g_stop.store(true); }

// ---------------------------------------------------------------------------------------------
// Engine
// ---------------------------------------------------------------------------------------------

// One "update" line per applied version. Its two halves come from two threads: the transfer from
// the receiver's observer (which runs right after the update is offered, so the engine may swap
// first) and the stall from the engine thread. The engine thread prints a line once both arrived.
class UpdateLines {
 public:
  void received(const UpdateReport& report) {
    std::lock_guard lock(mutex_);
    Entry& e = entries_[report.version];
    e.received = true;
    e.bytes = report.bytes;
    e.transfer_ms = std::chrono::duration<double, std::milli>(report.transfer).count();
  }
  void swapped(std::uint64_t version, double stall_us, std::uint64_t steps_between) {
    std::lock_guard lock(mutex_);
    Entry& e = entries_[version];
    e.swapped = true;
    e.stall_us = stall_us;
    e.steps_between = steps_between;
    max_stall_us_ = std::max(max_stall_us_, stall_us);
  }
  // Prints every complete entry; at the end (`all`) also what never completed.
  void print(bool all) {
    std::lock_guard lock(mutex_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      const Entry& e = it->second;
      if (e.received && e.swapped) {
        std::printf(
            "update version=%llu stall_us=%.1f transfer_ms=%.3f bytes=%zu steps_since_previous=%llu\n",
            static_cast<unsigned long long>(it->first), e.stall_us, e.transfer_ms, e.bytes,
            static_cast<unsigned long long>(e.steps_between));
      } else if (all) {
        std::printf("update version=%llu %s\n", static_cast<unsigned long long>(it->first),
                    e.received ? "received, never applied (superseded)"
                               : "applied, no transfer report");
      } else {
        ++it;
        continue;
      }
      it = entries_.erase(it);
    }
    std::fflush(stdout);
  }
  double max_stall_us() const {
    std::lock_guard lock(mutex_);
    return max_stall_us_;
  }

 private:
  struct Entry {
    bool received = false;
    bool swapped = false;
    std::size_t bytes = 0;
    double transfer_ms = 0;
    double stall_us = 0;
    std::uint64_t steps_between = 0;
  };
  mutable std::mutex mutex_;
  std::map<std::uint64_t, Entry> entries_;
  double max_stall_us_ = 0;
};

// The engine loop, the same for both backends: `Engine` is HostEngine or GpuEngine.
// `sync_each_step`: the host engine waits for each step and then pauses between batches (an engine
// with no requests does not spin); the GPU engine decodes without pause, bounded by its run-ahead
// limit, as a busy engine does.
template <typename Engine>
int serve(const Options& options, Backend& backend, Receiver& receiver, Engine& engine,
          TransportFactory factory, bool sync_each_step) {
  EngineChannelConfig config;
  config.bind_address = options.address;
  config.port = options.port;
  EngineChannel channel(receiver, std::move(factory), config);
  UpdateLines lines;
  std::atomic<std::uint64_t> failed{0};
  receiver.set_observer([&](const UpdateReport& report) {
    if (report.outcome == UpdateOutcome::kReady) lines.received(report);
    if (report.outcome != UpdateOutcome::kFailed) return;
    ++failed;
    // Wall-clock time, so that a script that killed the trainer can tell how long the engine took
    // to notice (scripts/gpu/run.sh faults).
    const auto unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::system_clock::now().time_since_epoch())
                             .count();
    std::printf("failed version=%llu code=%s unix_ms=%lld error=%s\n",
                static_cast<unsigned long long>(report.version),
                to_string(report.code),
                static_cast<long long>(unix_ms), report.error.c_str());
    std::fflush(stdout);
    channel.report_failed(report.version, report.code, report.error);
  });
  std::signal(SIGTERM, on_signal);
  std::signal(SIGINT, on_signal);
  std::printf("listening %u\n", static_cast<unsigned>(channel.port()));
  std::fflush(stdout);

  std::uint64_t applied = 0;
  std::uint64_t steps = 0;
  std::uint64_t steps_at_last_swap = 0;
  while (!g_stop.load()) {
    // The engine thread: the step hook, timed on its own (the stall is what the swap costs the
    // engine thread, not the decode step's launch or its run-ahead wait), then one decode step.
    // The step calls the hook again: an update that became ready in between is applied there,
    // and its stall is then the whole step() call (an upper bound).
    const auto before = Clock::now();
    auto version = receiver.step_hook().before_step(engine.stream());
    double stall_us = std::chrono::duration<double, std::micro>(Clock::now() - before).count();
    const auto step_start = Clock::now();
    if (const auto late = engine.step()) {
      version = late;
      stall_us = std::chrono::duration<double, std::micro>(Clock::now() - step_start).count();
    }
    ++steps;
    if (sync_each_step) engine.synchronize();
    if (version) {
      ++applied;
      lines.swapped(*version, stall_us, steps - steps_at_last_swap);
      steps_at_last_swap = steps;
      channel.report_applied(*version, steps);
    }
    lines.print(false);
    if (sync_each_step) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  const EngineChannelStats stats = channel.stats();
  channel.shutdown();
  receiver.shutdown();
  engine.synchronize();
  lines.print(true);
  std::printf(
      "engine summary: applied=%llu last=%llu failed=%llu torn=%llu trainers=%llu "
      "rendezvous=%llu headers=%llu refused=%llu auth_failures=%llu protocol_errors=%llu "
      "backend=%s steps=%llu max_stall_us=%.1f\n",
      static_cast<unsigned long long>(applied),
      static_cast<unsigned long long>(receiver.step_hook().applied_version()),
      static_cast<unsigned long long>(failed.load()),
      static_cast<unsigned long long>(engine.torn_steps()),
      static_cast<unsigned long long>(stats.trainers_authenticated),
      static_cast<unsigned long long>(stats.rendezvous_done),
      static_cast<unsigned long long>(stats.headers_accepted),
      static_cast<unsigned long long>(stats.headers_refused),
      static_cast<unsigned long long>(stats.authentication_failures),
      static_cast<unsigned long long>(stats.protocol_errors), std::string(backend.name()).c_str(),
      static_cast<unsigned long long>(steps), lines.max_stall_us());
  if (engine.torn_steps() != 0) std::printf("first torn step: %s\n", engine.first_torn().c_str());
  std::fflush(stdout);
  return engine.torn_steps() == 0 ? 0 : 1;
}

ReceiverConfig engine_config(const Options& options) {
  ReceiverConfig config;
  if (options.bucket_deadline_ms > 0) {
    config.bucket_deadline = std::chrono::milliseconds(options.bucket_deadline_ms);
  }
  return config;
}

int run_engine(const Options& options) {
  const Layout layout = example_layout(options);
  if (options.backend == "cuda") {
#if defined(SHADOWSYNC_WITH_CUDA)
    const int device = options.device < 0 ? 1 : options.device;
    CudaBackend backend(device);
    // The transport comes with the first rendezvous.
    Receiver receiver(layout, backend, nullptr, engine_config(options));
    // Only events between steps: where a missing wait in the library would show.
    examples::GpuEngine engine(backend, receiver);
    const std::string token = resolve_control_token("");
    return serve(
        options, backend, receiver, engine,
        [device, &backend, token](const RendezvousRequest& request) -> std::unique_ptr<Transport> {
          print_rendezvous(request);
          if (request.transport.kind == TransportKind::kSameHost) {
            return connect_same_host(request, token, backend);
          }
          NcclTransportConfig config;
          config.init_timeout = std::chrono::seconds(60);  // the trainer joins within seconds
          return NcclTransport::create(request.transport.unique_id, request.rank,
                                       request.world_size, device, config);
        },
        /*sync_each_step=*/false);
#else
    no_cuda();
#endif
  }
  HostBackend backend;
  // The transport comes with the first rendezvous.
  Receiver receiver(layout, backend, nullptr, engine_config(options));
  examples::HostEngine engine(backend, receiver, {.compute_time = std::chrono::microseconds(50)});
  const std::string token = resolve_control_token("");
  return serve(
      options, backend, receiver, engine,
      [&backend, token](const RendezvousRequest& request) -> std::unique_ptr<Transport> {
        print_rendezvous(request);
        if (request.transport.kind != TransportKind::kSameHost) {
          throw std::runtime_error(fmt::format("the host engine runs the same_host transport "
                                               "only; the trainer asked for {}",
                                               to_string(request.transport.kind)));
        }
        return connect_same_host(request, token, backend);
      },
      /*sync_each_step=*/true);
}

// ---------------------------------------------------------------------------------------------
// Trainer
// ---------------------------------------------------------------------------------------------

// Writes the tensors of `groups` at `version` (the optimizer step) and returns them as the
// sender's sources; they stay valid until the next call.
using TrainStep = std::function<std::vector<SourceTensor>(std::uint64_t version,
                                                          const std::vector<std::string>& groups)>;

// The rounds, the same for both backends: train step, publish, header over the channel, wait for
// the send and for the engine's ack. One line per round.
int train(const Options& options, const Layout& layout, TrainerChannel& channel, Sender& sender,
          const TrainStep& train_step, std::uint64_t first) {
  std::printf("trainer: connected, engine live at %llu, first version %llu\n",
              static_cast<unsigned long long>(channel.engines()[0].applied_version),
              static_cast<unsigned long long>(first));
  std::fflush(stdout);

  const std::vector<std::vector<std::string>> kinds = {{"base", "lora"}, {"lora"}, {"base"}};
  int acked = 0;
  for (int i = 0; i < options.rounds; ++i) {
    const std::uint64_t version = first + static_cast<std::uint64_t>(i);
    const auto& groups = kinds[static_cast<std::size_t>(i) % kinds.size()];
    const auto start = Clock::now();
    const std::vector<SourceTensor> tensors = train_step(version, groups);
    const auto trained = Clock::now();
    PublishHandle handle = sender.publish(version, groups, tensors);
    channel.send_update_header(handle.header());
    if (!handle.wait_for(kDeadline)) {
      throw std::runtime_error(fmt::format("update {}: not sent within {} s", version,
                                           kDeadline.count()));
    }
    const auto sent = Clock::now();
    if (!channel.wait_until_all_applied(version, Clock::now() + kDeadline)) {
      throw std::runtime_error(fmt::format("update {} was not acked in time", version));
    }
    const auto acked_at = Clock::now();
    ++acked;
    std::string group_list;
    for (const std::string& g : groups) group_list += (group_list.empty() ? "" : "+") + g;
    // send_ms: publish until every bucket was sent; ack_ms: publish until the engine's ack.
    std::printf("round %d version=%llu groups=%s train_ms=%.3f send_ms=%.3f ack_ms=%.3f\n", i + 1,
                static_cast<unsigned long long>(version), group_list.c_str(), ms(trained - start),
                ms(sent - trained), ms(acked_at - trained));
    std::fflush(stdout);
  }
  std::printf("trainer: %d rounds acked, last version %llu at engine step %llu\n", acked,
              static_cast<unsigned long long>(channel.engines()[0].applied_version),
              static_cast<unsigned long long>(channel.engines()[0].applied_step));
  std::fflush(stdout);
  if (options.die_after_header) {
    // A trainer that crashes after announcing an update, before sending a byte of it: no
    // goodbye, the engine's receive finds its peer gone.
    const UpdateHeader header = make_update_header(layout, first + options.rounds, {"base"});
    channel.send_update_header(header);
    std::raise(SIGKILL);
  }
  if (options.hang_mid_update) {
    // A trainer that stops halfway through an update: the first tensor of the base is sent (its
    // buckets are broadcast), the rest never comes. A fault script kills or stops it here.
    const std::uint64_t version = first + options.rounds;
    const std::vector<SourceTensor> tensors = train_step(version, {"base"});
    StreamedPublish streamed = sender.publish_streamed(version, {"base"});
    channel.send_update_header(streamed.header());
    streamed.supply({tensors.front()});
    std::printf("trainer: mid-update version=%llu\n", static_cast<unsigned long long>(version));
    std::fflush(stdout);
    for (;;) pause();  // until a signal ends the process
  }
  return 0;
}

// The trainer's end of the rendezvous (rank 0): tells the engine which transport to build and
// where, builds this side's, and waits until the engine installed its own.
std::unique_ptr<Transport> rendezvous(const Options& options, const Layout& layout,
                                      TrainerChannel& channel, Backend& backend) {
  const TransportKind kind = trainer_transport(options);
  std::unique_ptr<Transport> transport;
  if (kind == TransportKind::kSameHost) {
    // serve() returns once the engine connected and proved the token, so the address goes out
    // first. The staging slots are one bucket each: the sender packs each bucket into one.
    const std::string path = options.socket.empty() ? default_socket_path() : options.socket;
    const SameHostMemory memory =
        options.backend == "cuda" ? SameHostMemory::kDevice : SameHostMemory::kHost;
    std::printf("trainer: rendezvous transport=same_host memory=%s path=%s\n",
                memory == SameHostMemory::kDevice ? "device" : "host", path.c_str());
    std::fflush(stdout);
    channel.send_rendezvous(TransportAddress::same_host(path));
    transport = SameHostTransport::serve(path, resolve_control_token(""), 1, backend, memory,
                                         layout.bucket_bytes(), same_host_config());
  } else {
#if defined(SHADOWSYNC_WITH_CUDA)
    // NCCL's init blocks until the engine joined with the id the channel carried, so the id goes
    // out first.
    const int device = options.device < 0 ? 0 : options.device;
    std::printf("trainer: rendezvous transport=nccl device=%d\n", device);
    std::fflush(stdout);
    const NcclUniqueId id = NcclTransport::generate_unique_id();
    channel.send_rendezvous(TransportAddress::nccl(id));
    NcclTransportConfig transport_config;
    transport_config.init_timeout = std::chrono::seconds(60);
    transport = NcclTransport::create(id, 0, 2, device, transport_config);
#else
    no_cuda();
#endif
  }
  if (!channel.wait_rendezvous(Clock::now() + kDeadline)) {
    throw std::runtime_error("the engine did not finish the rendezvous in time");
  }
  return transport;
}

// Declared right after the Sender: on every way out (an exception too) the engines hear the
// trainer's goodbye, and release their ends of the transport, before the Sender's transport is
// torn down (TrainerChannel::close says why the order matters).
struct GoodbyeBeforeSender {
  TrainerChannel& channel;
  ~GoodbyeBeforeSender() { channel.close(); }
};

int run_trainer(const Options& options) {
  const Layout layout = example_layout(options);
  trainer_transport(options);  // a bad --transport fails before anything connects
  TrainerChannelConfig config;
  config.engines.push_back({options.address, options.port});
  TrainerChannel channel(layout, config);
  // A restarted trainer continues above whatever the engine accepted before.
  const std::uint64_t first = channel.highest_accepted_version() + 1;

  if (options.backend == "cuda") {
#if defined(SHADOWSYNC_WITH_CUDA)
    const int device = options.device < 0 ? 0 : options.device;
    CudaBackend backend(device);
    Sender sender(layout, backend, rendezvous(options, layout, channel, backend));
    const GoodbyeBeforeSender goodbye{channel};

    // The model's parameters: one device buffer per group, each tensor at its layout offset (the
    // sender packs them through its staging buffers as it would scattered parameters). One set
    // is enough: each round waits until its publish is done before the next train step.
    std::vector<DeviceBuffer> arenas;
    std::vector<std::vector<SourceTensor>> group_sources;
    for (const auto& group : layout.groups()) {
      arenas.emplace_back(backend, group.arena_bytes());
      group_sources.emplace_back();
      for (const auto& placement : group.tensors()) {
        group_sources.back().push_back({placement.spec.name, arenas.back().data() + placement.offset,
                                        placement.spec.dtype, placement.spec.shape});
      }
    }
    auto stream = backend.create_stream(StreamPriority::kNormal);
    auto filled = backend.create_event();
    const TrainStep step = [&](std::uint64_t version, const std::vector<std::string>& groups) {
      std::vector<SourceTensor> sources;
      for (const std::string& name : groups) {
        const std::size_t g = layout.group_index(name);
        examples::fill_weights_async(backend, *stream, layout, g, version, arenas[g].data());
        sources.insert(sources.end(), group_sources[g].begin(), group_sources[g].end());
      }
      // The sender reads the tensors on its own streams: the fill must be done first.
      backend.event_record(*filled, *stream);
      if (!backend.event_wait_for(*filled, kDeadline)) {
        throw std::runtime_error(fmt::format(
            "train step of version {}: fill kernels on GPU {} not done within {} s", version,
            device, kDeadline.count()));
      }
      return sources;
    };
    return train(options, layout, channel, sender, step, first);
#else
    no_cuda();
#endif
  }

  HostBackend backend;
  Sender sender(layout, backend, rendezvous(options, layout, channel, backend));
  const GoodbyeBeforeSender goodbye{channel};
  std::optional<examples::TrainerWeights> tensors;
  const TrainStep step = [&](std::uint64_t version, const std::vector<std::string>& groups) {
    tensors.emplace(layout, groups, version);
    return tensors->sources();
  };
  return train(options, layout, channel, sender, step, first);
}

int parse_int(const std::string& flag, const char* text, int minimum, int maximum) {
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || value < minimum || value > maximum) {
    throw std::runtime_error(fmt::format("{}: expected a number in [{}, {}], got '{}'", flag,
                                         minimum, maximum, text));
  }
  return static_cast<int>(value);
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) throw std::runtime_error("usage: control_channel engine|trainer [options]");
  Options options;
  options.role = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--port" && has_value) {
      options.port = static_cast<std::uint16_t>(parse_int(arg, argv[++i], 0, 65535));
    } else if (arg == "--address" && has_value) {
      options.address = argv[++i];
    } else if (arg == "--rounds" && has_value) {
      options.rounds = parse_int(arg, argv[++i], 1, 1'000'000);
    } else if (arg == "--die-after-header") {
      options.die_after_header = true;
    } else if (arg == "--hang-mid-update") {
      options.hang_mid_update = true;
    } else if (arg == "--bucket-deadline-ms" && has_value) {
      options.bucket_deadline_ms = parse_int(arg, argv[++i], 1, 3'600'000);
    } else if (arg == "--backend" && has_value) {
      options.backend = argv[++i];
      if (options.backend != "host" && options.backend != "cuda") {
        throw std::runtime_error(
            fmt::format("--backend: expected 'host' or 'cuda', got '{}'", options.backend));
      }
    } else if (arg == "--transport" && has_value) {
      options.transport = argv[++i];
      if (options.transport != "nccl" && options.transport != "same_host") {
        throw std::runtime_error(fmt::format(
            "--transport: expected 'nccl' or 'same_host', got '{}'", options.transport));
      }
    } else if (arg == "--socket" && has_value) {
      options.socket = argv[++i];
    } else if (arg == "--device" && has_value) {
      options.device = parse_int(arg, argv[++i], 0, 1023);
    } else {
      throw std::runtime_error(fmt::format("unknown argument '{}'", arg));
    }
  }
  if (options.role == "engine") return run_engine(options);
  if (options.role == "trainer") return run_trainer(options);
  throw std::runtime_error(fmt::format("unknown role '{}' (engine or trainer)", options.role));
} catch (const std::exception& error) {
  std::fprintf(stderr, "control_channel: %s\n", error.what());
  return 2;
}
