// The same-host transport's device flavour on ONE GPU, at the layouts of real models
// (bench/support/bench_models.h): the trainer in one process, the engine in another, both on
// device 0, as in colocated RL. This program is the engine; it spawns itself as the trainer
// (--role trainer) and drives it over two pipes, one command line and one reply line at a time,
// so that each phase starts when the engine says and the memory figures of the two processes are
// taken at points where the other one is idle.
//
// Per model, in one run:
//   connection   the trainer serves a SameHostTransport (SameHostMemory::kDevice, slots of the
//                bucket size) on a socket in a private 0700 temporary directory, the engine
//                connects; the token is $SHADOWSYNC_CONTROL_TOKEN, or 32 random bytes written to a
//                0600 file there and handed to the trainer as --token-file.
//   raw copy     --reps cudaMemcpyAsync device-to-device of the model's bytes, CUDA events: the
//                reference (median, min).
//   transport    --reps transfers through the transport alone: the engine posts one receive per
//                bucket into a buffer of the model's size (its posting thread runs before the
//                trainer is told to send, as a Receiver waits for an update), the trainer
//                broadcasts every bucket
//                straight from its staging slots (Transport::staging_buffer: nothing packed).
//                Trainer-side wall time, first broadcast enqueued -> last ack in (engine-side wall
//                time too, which adds a pipe round trip). "added" = its median minus the raw
//                copy's.
//                Each side's per-chunk timeline over those reps (SameHostTransport::
//                timeline_summary: medians of slot filled -> doorbell -> copy -> ack) is printed
//                and written to the notes and the JSON, to say where each chunk's time went.
//   end to end   --updates updates through Sender::publish (the trainer's tensors packed into the
//                staging slots) and a Receiver (into the shadow slot), after 2 warm-up ones:
//                trainer-side publish -> done (the receiver had posted its receives), and
//                UpdateReport::transfer on the engine. Each byte crosses HBM twice here (packed,
//                then received), so two back-to-back raw copies are its ceiling on one GPU.
//   stall        after each of those updates, at a step boundary, on the engine thread: the wall
//                time of StepHook::before_step (rebind) and the engine-stream time it holds.
//   decode       a memory-bound decode step (every block sums a 128 KiB slice of the live weights,
//                up to --decode-gib GiB) alone (--decode-steps), then for --during-seconds each:
//                while real updates stream in (back to back, the engine swapping between steps);
//                while the same bytes are copied bucket by bucket by cudaMemcpyAsync on a
//                low-priority stream in the engine process (the transport's copy engines, no
//                trainer); and while an SM copy kernel (--sm-copy-ctas blocks) does that copy.
//   memory       device-wide cudaMemGetInfo deltas, each taken while the other process is idle:
//                the connection (the trainer's slots, plus whatever connect() adds on the engine),
//                the Receiver (two slots per group), the Sender; and each side's
//                Backend::bytes_allocated. Goals: two staging buckets on the trainer, nothing
//                beyond the shadow on the engine.
//
// When the trainer's tensors do not fit beside the engine's two slots (Qwen2.5-14B on an 80 GB
// GPU: 29.5 GB of tensors + 59 GB of slots), every source tensor of the trainer points into one
// buffer of the largest tensor's size (--sources auto; full and shared force either): packing
// still reads and writes every byte once, so the transfer figures stay honest, and the output says
// "shared" for that model.
//
//   bench_same_host_one_gpu [--out DIR] [--commit SHA] [--machine NAME] [--models a,b]
//       [--updates N] [--reps N] [--decode-gib G] [--decode-steps N] [--during-seconds S]
//       [--sources auto|full|shared] [--checksums] [--sm-copy-ctas N] [--budget S] [--device D]
//       [--trainer-device T]
//
// --device D is the engine's GPU; --trainer-device T (default D) the trainer's. With T != D the
// transfer crosses GPUs: the engine maps the trainer's staging (on GPU T) and its copy engines
// read it over the link between them (NVLink on the machines here); the raw copy and the copy
// references stay on GPU D. The decode phase then shows what a trainer on another GPU costs the
// engine's decode, next to bench_gpu's NCCL broadcast between the same two GPUs.
//
// Writes DIR/bench-same-host-<UTC>.json (schema shadowsync-bench-same-host/1) and .md, rewritten
// after each model; bench/plot_same_host.py plots the JSON. No phase starts past --budget seconds
// (default 200; what is skipped is listed); a watchdog at budget + 35 s kills the trainer and
// exits 3. Exit status: 0 every model ran, 1 a model failed (the rest still ran), 2 bad
// arguments, 3 watchdog, 77 without a GPU.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <future>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/token.h"
#include "shadowsync/sender.h"
#include "shadowsync/update_header.h"
#include "support/bench_cuda.h"
#include "support/bench_models.h"

extern char** environ;

namespace {

using namespace shadowsync;
using bench::BenchError;
using bench::cat;
using bench::Clock;
using bench::Json;
using bench::strf;

constexpr int kWarmup = 2;
constexpr const char* kSchema = "shadowsync-bench-same-host/1";
constexpr const char* kTokenEnv = "SHADOWSYNC_CONTROL_TOKEN";
// The trainer's serve() and the engine's connect() wait this long for each other.
constexpr auto kConnectTimeout = std::chrono::seconds(60);
// Allocation slack in the memory goals: cudaMemGetInfo moves in 2 MiB pages, and both sides keep
// a few small buffers (events, checksum words).
constexpr std::int64_t kMemorySlack = 64ll << 20;
// Left free when deciding whether the trainer's tensors fit (driver, streams, kernels' images).
constexpr std::size_t kFitMargin = std::size_t{1536} << 20;

const Clock::time_point g_start = Clock::now();
double elapsed_s() { return bench::to_s(Clock::now() - g_start); }

void progress(const std::string& line) {
  std::printf("[%6.1f s] %s\n", elapsed_s(), line.c_str());
  std::fflush(stdout);
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

double gbps(double bytes, double ms) { return ms > 0 ? bytes / ms / 1e6 : 0.0; }
double gb(double bytes) { return bytes / 1e9; }

std::size_t free_device_bytes() {
  std::size_t free = 0;
  std::size_t total = 0;
  BENCH_CUDA(cudaMemGetInfo(&free, &total));
  return free;
}

// ---------------------------------------------------------------------------------------------
// Options.
// ---------------------------------------------------------------------------------------------
struct Options {
  std::string role = "engine";
  std::string out_dir = "docs/bench";
  std::string commit;
  std::string machine;
  std::string models;
  int updates = 50;
  int reps = 10;
  double decode_gib = 4;
  int decode_steps = 100;
  double during_s = 1.5;
  std::string sources = "auto";
  bool checksums = false;
  int sm_copy_ctas = 0;  // 0: one per SM
  double budget_s = 200;
  int device = 0;
  int trainer_device = -1;  // -1: --device (both processes on one GPU)
  // --role trainer only (set by the engine when it spawns the trainer).
  int command_fd = -1;
  int reply_fd = -1;
  std::string token_file;
};

constexpr const char* kUsage =
    "usage: bench_same_host_one_gpu [--out DIR] [--commit SHA] [--machine NAME] [--models a,b]\n"
    "         [--updates N] [--reps N] [--decode-gib G] [--decode-steps N] [--during-seconds S]\n"
    "         [--sources auto|full|shared] [--checksums] [--sm-copy-ctas N] [--budget S]\n"
    "         [--device D] [--trainer-device T]\n";

// Parses argv into `o`; on bad input prints what was wrong and returns false.
bool parse_options(int argc, char** argv, Options& o) {
  const auto fail = [](const std::string& why) {
    std::fprintf(stderr, "bench_same_host_one_gpu: %s\n%s", why.c_str(), kUsage);
    return false;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::printf("%s", kUsage);
      std::exit(0);
    }
    if (arg == "--checksums") {
      o.checksums = true;
      continue;
    }
    if (i + 1 >= argc) return fail(cat(arg, " needs a value"));
    const std::string value = argv[++i];
    const auto number = [&](double low, double& out) {
      char* end = nullptr;
      out = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(out >= low)) {
        return fail(cat(arg, " needs a number >= ", low, ", got '", value, "'"));
      }
      return true;
    };
    double x = 0;
    if (arg == "--role") {
      if (value != "engine" && value != "trainer") {
        return fail(cat("--role is engine or trainer, got '", value, "'"));
      }
      o.role = value;
    } else if (arg == "--out") {
      o.out_dir = value;
    } else if (arg == "--commit") {
      o.commit = value;
    } else if (arg == "--machine") {
      o.machine = value;
    } else if (arg == "--models") {
      o.models = value;
    } else if (arg == "--sources") {
      if (value != "auto" && value != "full" && value != "shared") {
        return fail(cat("--sources is auto, full or shared, got '", value, "'"));
      }
      o.sources = value;
    } else if (arg == "--token-file") {
      o.token_file = value;
    } else if (arg == "--updates") {
      if (!number(5, x)) return false;
      o.updates = static_cast<int>(x);
    } else if (arg == "--reps") {
      if (!number(3, x)) return false;
      o.reps = static_cast<int>(x);
    } else if (arg == "--decode-gib") {
      if (!number(0.0625, x)) return false;
      o.decode_gib = x;
    } else if (arg == "--decode-steps") {
      if (!number(10, x)) return false;
      o.decode_steps = static_cast<int>(x);
    } else if (arg == "--during-seconds") {
      if (!number(0.1, x)) return false;
      o.during_s = x;
    } else if (arg == "--sm-copy-ctas") {
      if (!number(1, x)) return false;
      o.sm_copy_ctas = static_cast<int>(x);
    } else if (arg == "--budget") {
      if (!number(10, x)) return false;
      o.budget_s = x;
    } else if (arg == "--device") {
      if (!number(0, x)) return false;
      o.device = static_cast<int>(x);
    } else if (arg == "--trainer-device") {
      if (!number(0, x)) return false;
      o.trainer_device = static_cast<int>(x);
    } else if (arg == "--command-fd") {
      if (!number(0, x)) return false;
      o.command_fd = static_cast<int>(x);
    } else if (arg == "--reply-fd") {
      if (!number(0, x)) return false;
      o.reply_fd = static_cast<int>(x);
    } else {
      return fail(cat("unknown argument '", arg, "'"));
    }
  }
  if (o.role == "trainer" && (o.command_fd < 0 || o.reply_fd < 0)) {
    return fail("--role trainer needs --command-fd and --reply-fd (the engine passes them)");
  }
  if (o.trainer_device < 0) o.trainer_device = o.device;
  if (o.commit.empty()) {
    for (const char* name : {"SHADOWSYNC_COMMIT", "GIT_COMMIT"}) {
      if (const char* v = std::getenv(name); v != nullptr && *v != '\0' && o.commit.empty()) {
        o.commit = v;
      }
    }
    if (o.commit.empty()) o.commit = "unknown";
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The line protocol between the two processes.
// ---------------------------------------------------------------------------------------------
void write_line(int fd, const std::string& text) {
  const std::string line = one_line(text) + '\n';
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw BenchError(cat("writing '", text, "' to the other process: ", std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
}

class LineReader {
 public:
  explicit LineReader(int fd) : fd_(fd) {}

  // The next line, without its newline; nothing at end of file. Throws BenchError naming `what`
  // once `timeout` passes.
  std::optional<std::string> next(std::chrono::milliseconds timeout, const std::string& what) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        throw BenchError(cat("timed out after ", timeout.count(), " ms waiting for ", what));
      }
      pollfd pfd{fd_, POLLIN, 0};
      const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
      if (ready < 0 && errno != EINTR) throw BenchError(cat("poll: ", std::strerror(errno)));
      if (ready <= 0) continue;
      char chunk[4096];
      const ssize_t n = ::read(fd_, chunk, sizeof chunk);
      if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (n < 0) throw BenchError(cat("reading ", what, ": ", std::strerror(errno)));
      if (n == 0) return std::nullopt;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }

  // Whether a line (or the end of the file) may be read now: a line is buffered, or the fd
  // becomes readable within `wait`.
  bool readable(std::chrono::milliseconds wait) {
    if (buffer_.find('\n') != std::string::npos) return true;
    pollfd pfd{fd_, POLLIN, 0};
    return ::poll(&pfd, 1, static_cast<int>(wait.count())) > 0;
  }

 private:
  int fd_;
  std::string buffer_;
};

// "ok key=value ..." or "error message".
struct Reply {
  std::map<std::string, std::string> fields;
  std::string line;  // the whole reply, "ok ..." (for replies that are not key=value words)

  double number(const std::string& key) const {
    const auto it = fields.find(key);
    if (it == fields.end()) throw BenchError(cat("the trainer's reply has no '", key, "'"));
    return std::strtod(it->second.c_str(), nullptr);
  }
  std::int64_t integer(const std::string& key) const {
    const auto it = fields.find(key);
    if (it == fields.end()) throw BenchError(cat("the trainer's reply has no '", key, "'"));
    return std::strtoll(it->second.c_str(), nullptr, 10);
  }
};

Reply parse_reply(const std::string& command, const std::string& line) {
  if (line.rfind("error ", 0) == 0) {
    throw BenchError(cat("trainer process, '", command, "': ", line.substr(6)));
  }
  if (line != "ok" && line.rfind("ok ", 0) != 0) {
    throw BenchError(cat("trainer process, '", command, "': unexpected reply '", line, "'"));
  }
  Reply reply;
  reply.line = line;
  std::istringstream words(line.substr(2));
  std::string word;
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) reply.fields[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return reply;
}

std::string load_token(const std::string& token_file) {
  if (const char* env = std::getenv(kTokenEnv); env != nullptr && *env != '\0') return env;
  if (token_file.empty()) {
    throw BenchError(cat("no token: set ", kTokenEnv, " or pass --token-file"));
  }
  std::ifstream in(token_file);
  std::string token;
  if (!(in >> token)) throw BenchError(cat("cannot read the token from '", token_file, "'"));
  return token;
}

// ---------------------------------------------------------------------------------------------
// The trainer process (--role trainer). Commands, one per line on --command-fd; one reply line
// each on --reply-fd:
//   ready (sent once, unasked, when the CUDA context exists)
//   model NAME full|shared  the model's layout and source tensors      -> source_bytes
//   serve PATH              SameHostTransport::serve, kDevice          -> ms, free_*, backend_delta
//   send                    every bucket from the staging slots         -> ms, chunks
//   sender                  a Sender over the transport                 -> free_*, backend_delta
//   publish V               Sender::publish of every group, waited for  -> ms, backend_bytes
//   close                   everything of the model freed
//   quit
// ---------------------------------------------------------------------------------------------
int trainer_main(const Options& o) {
  std::signal(SIGPIPE, SIG_IGN);
  LineReader in(o.command_fd);
  const auto reply = [&](const std::string& text) { write_line(o.reply_fd, text); };
  std::string token;
  std::unique_ptr<CudaBackend> backend;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Event> sent;
  try {
    token = load_token(o.token_file);
    backend = std::make_unique<CudaBackend>(o.device);
    stream = backend->create_stream(StreamPriority::kNormal);
    sent = backend->create_event();
    reply(cat("ok ready pid=", ::getpid()));
  } catch (const std::exception& e) {
    try {
      reply(cat("error ", e.what()));
    } catch (...) {
    }
    return 1;
  }

  std::optional<Layout> layout;
  std::vector<std::string> groups;
  std::vector<SourceTensor> sources;
  std::vector<void*> memory;
  std::unique_ptr<SameHostTransport> transport;
  std::unique_ptr<Sender> sender;
  const auto release = [&] {
    sender.reset();
    transport.reset();
    for (void* p : memory) (void)cudaFree(p);
    memory.clear();
    sources.clear();
    groups.clear();
    layout.reset();
  };
  const auto allocate = [&](std::size_t bytes) {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, bytes));
    memory.push_back(p);
    // 0x3c3c: a finite bf16 in every element (a non-finite guard, if on, passes).
    BENCH_CUDA(cudaMemset(p, 0x3c, bytes));
    return static_cast<std::byte*>(p);
  };

  for (;;) {
    std::optional<std::string> line;
    try {
      line = in.next(std::chrono::hours(2), "the engine's next command");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trainer] %s\n", e.what());
    }
    if (!line) {  // the engine went away
      release();
      return 0;
    }
    std::istringstream words(*line);
    std::string verb;
    words >> verb;
    try {
      if (verb == "model") {
        std::string name;
        std::string mode;
        words >> name >> mode;
        release();
        const bench::ModelConfig* model = bench::find_model(name);
        if (model == nullptr) throw BenchError(cat("unknown model '", name, "'"));
        layout = bench::model_layout(*model, 1, kDefaultBucketBytes);
        std::size_t source_bytes = 0;
        std::byte* shared = nullptr;
        if (mode == "shared") {
          source_bytes = bench::largest_tensor_bytes(*layout);
          shared = allocate(source_bytes);
        } else if (mode != "full") {
          throw BenchError(cat("model: sources are full or shared, got '", mode, "'"));
        }
        for (const GroupLayout& group : layout->groups()) {
          groups.push_back(group.name());
          std::byte* arena = shared;
          if (shared == nullptr) {
            arena = allocate(group.arena_bytes());
            source_bytes += group.arena_bytes();
          }
          for (const TensorPlacement& t : group.tensors()) {
            sources.push_back({t.spec.name, shared != nullptr ? shared : arena + t.offset,
                               t.spec.dtype, t.spec.shape});
          }
        }
        BENCH_CUDA(cudaDeviceSynchronize());
        reply(cat("ok source_bytes=", source_bytes));
      } else if (verb == "serve") {
        std::string path;
        words >> path;
        if (!layout) throw BenchError("serve before model");
        SameHostConfig config;
        config.connect_timeout = kConnectTimeout;
        const std::size_t free_before = free_device_bytes();
        const std::size_t bytes_before = backend->bytes_allocated();
        const auto start = Clock::now();
        transport = SameHostTransport::serve(path, token, 1, *backend, SameHostMemory::kDevice,
                                             layout->bucket_bytes(), config);
        const double ms = bench::to_ms(Clock::now() - start);
        reply(cat("ok ms=", ms, " free_before=", free_before, " free_after=", free_device_bytes(),
                  " backend_delta=",
                  static_cast<std::int64_t>(backend->bytes_allocated()) -
                      static_cast<std::int64_t>(bytes_before),
                  " slot_bytes=", transport->slot_bytes()));
      } else if (verb == "send") {
        if (!transport) throw BenchError("send without a served transport");
        std::size_t chunk = 0;
        const auto start = Clock::now();
        for (const GroupLayout& group : layout->groups()) {
          for (std::size_t k = 0; k < group.bucket_count(); ++k, ++chunk) {
            const std::size_t n = group.bucket(k).bytes;
            void* slot = transport->staging_buffer(static_cast<int>(chunk % 2), n);
            if (slot == nullptr) {
              throw BenchError(
                  cat("the transport has no staging slot ", chunk % 2, " for ", n, " bytes"));
            }
            transport->broadcast_async(slot, n, 0, *stream);
          }
        }
        transport->flush();  // every receiver copied every chunk out
        backend->event_record(*sent, *stream);
        if (!backend->event_wait_for(*sent, bench::kWaitLimit)) {
          throw BenchError(
              cat(chunk, " broadcasts not done after ", bench::kWaitLimit.count(), " s"));
        }
        const double ms = bench::to_ms(Clock::now() - start);
        if (auto error = transport->async_error()) throw BenchError(*error);
        reply(cat("ok ms=", ms, " chunks=", chunk));
      } else if (verb == "timeline") {
        // The sender's per-chunk medians since the last "timeline" (SameHostTransport's).
        if (!transport) throw BenchError("timeline without a served transport");
        reply(cat("ok ", transport->timeline_summary()));
      } else if (verb == "sender") {
        if (!transport) throw BenchError("sender without a served transport");
        SenderConfig config;
        config.checksums = o.checksums;
        const std::size_t free_before = free_device_bytes();
        const std::size_t bytes_before = backend->bytes_allocated();
        sender = std::make_unique<Sender>(*layout, *backend, std::move(transport), config);
        reply(cat("ok free_before=", free_before, " free_after=", free_device_bytes(),
                  " backend_delta=",
                  static_cast<std::int64_t>(backend->bytes_allocated()) -
                      static_cast<std::int64_t>(bytes_before)));
      } else if (verb == "publish") {
        std::uint64_t version = 0;
        words >> version;
        if (!sender) throw BenchError("publish without a sender");
        const auto start = Clock::now();
        const PublishHandle handle = sender->publish(version, groups, sources);
        if (!handle.wait_for(bench::kWaitLimit)) {
          throw BenchError(
              cat("update ", version, " not done after ", bench::kWaitLimit.count(), " s"));
        }
        handle.wait();  // throws the update's error, if it failed
        const double ms = bench::to_ms(Clock::now() - start);
        reply(cat("ok ms=", ms, " backend_bytes=", backend->bytes_allocated()));
      } else if (verb == "close") {
        release();
        reply("ok");
      } else if (verb == "quit") {
        release();
        reply("ok");
        return 0;
      } else {
        throw BenchError(cat("unknown command '", *line, "'"));
      }
    } catch (const std::exception& e) {
      try {
        reply(cat("error ", e.what()));
      } catch (const std::exception& lost) {
        std::fprintf(stderr, "[trainer] %s (and the reply was lost: %s)\n", e.what(), lost.what());
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The engine's handle on the trainer process.
// ---------------------------------------------------------------------------------------------
std::atomic<pid_t> g_trainer_pid{-1};

int cloexec_above(int fd, int floor) {
  const int moved = ::fcntl(fd, F_DUPFD_CLOEXEC, floor);
  ::close(fd);
  if (moved < 0) throw BenchError(cat("fcntl(F_DUPFD_CLOEXEC): ", std::strerror(errno)));
  return moved;
}

class TrainerProcess {
 public:
  // Spawns this binary as the trainer with `args` and waits for its "ready".
  explicit TrainerProcess(const std::vector<std::string>& args) {
    int down[2];
    int up[2];
    if (::pipe2(down, O_CLOEXEC) != 0 || ::pipe2(up, O_CLOEXEC) != 0) {
      throw BenchError(cat("pipe2: ", std::strerror(errno)));
    }
    // Above 4, so that the dup2 onto 3 and 4 below never meets an fd already there.
    for (int* fd : {&down[0], &down[1], &up[0], &up[1]}) *fd = cloexec_above(*fd, 10);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, down[0], 3);
    posix_spawn_file_actions_adddup2(&actions, up[1], 4);
    std::vector<std::string> argv_strings = {
        "/proc/self/exe", "--role", "trainer", "--command-fd", "3", "--reply-fd", "4"};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);
    const int status =
        ::posix_spawn(&pid_, "/proc/self/exe", &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(down[0]);
    ::close(up[1]);
    to_ = down[1];
    from_ = up[0];
    if (status != 0) {
      pid_ = -1;
      throw BenchError(cat("posix_spawn of the trainer: ", std::strerror(status)));
    }
    g_trainer_pid.store(pid_);
    reader_ = std::make_unique<LineReader>(from_);
    try {
      read_reply("start", std::chrono::seconds(60));
    } catch (...) {  // no destructor runs for a constructor that throws
      kill();
      ::close(to_);
      ::close(from_);
      throw;
    }
  }

  ~TrainerProcess() {
    if (pid_ > 0) {
      try {
        call("quit", std::chrono::seconds(10));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_same_host_one_gpu: the trainer did not quit: %s\n", e.what());
      }
    }
    kill();
    ::close(to_);
    ::close(from_);
  }
  TrainerProcess(const TrainerProcess&) = delete;
  TrainerProcess& operator=(const TrainerProcess&) = delete;

  void send(const std::string& command) { write_line(to_, command); }

  Reply read_reply(const std::string& command,
                   std::chrono::milliseconds timeout = bench::kWaitLimit) {
    const std::optional<std::string> line =
        reader_->next(timeout, cat("the trainer's reply to '", command, "'"));
    if (!line) {
      int status = 0;
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      g_trainer_pid.store(-1);
      throw BenchError(cat("the trainer process ended during '", command, "' (",
                           WIFEXITED(status) ? cat("exit status ", WEXITSTATUS(status))
                                             : cat("signal ", WTERMSIG(status)),
                           ")"));
    }
    return parse_reply(command, *line);
  }

  Reply call(const std::string& command, std::chrono::milliseconds timeout = bench::kWaitLimit) {
    send(command);
    return read_reply(command, timeout);
  }

  // Whether the reply to the last command can be read now, waiting at most `wait`.
  bool reply_ready(std::chrono::milliseconds wait) { return reader_->readable(wait); }

  void kill() noexcept {
    if (pid_ <= 0) return;
    // Given a moment to quit by itself, then killed: it may be stuck in the driver.
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (::waitpid(pid_, nullptr, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    pid_ = -1;
    g_trainer_pid.store(-1);
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1;
  int from_ = -1;
  std::unique_ptr<LineReader> reader_;
};

// ---------------------------------------------------------------------------------------------
// Kernels.
// ---------------------------------------------------------------------------------------------
constexpr int kDecodeThreads = 512;
constexpr int kDecodeWordsPerThread = 16;  // 16-byte words: 128 KiB per block
constexpr std::size_t kDecodeBlockBytes = std::size_t{kDecodeThreads} * kDecodeWordsPerThread * 16;

__device__ __forceinline__ float bf16_pair_sum(unsigned word) {
  return __uint_as_float(word << 16) + __uint_as_float(word & 0xffff0000u);
}

// A memory-bound decode step (a batch-1 GEMV reads each weight once): block b sums the bf16
// values of its own 128 KiB slice with coalesced 16-byte loads, eight in flight per thread, and
// writes one partial, so nothing is optimized away. Many short blocks, as a decode step's kernels.
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const uint4* __restrict__ data, std::size_t n, float* __restrict__ partials) {
  const std::size_t base =
      static_cast<std::size_t>(blockIdx.x) * (kDecodeBlockBytes / 16) + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int batch = 0; batch < kDecodeWordsPerThread; batch += 8) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(batch + u) * kDecodeThreads;
      v[u] = i < n ? data[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      acc += (bf16_pair_sum(v[u].x) + bf16_pair_sum(v[u].y)) +
             (bf16_pair_sum(v[u].z) + bf16_pair_sum(v[u].w));
    }
  }
  __shared__ float warp_sums[kDecodeThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < kDecodeThreads / 32 ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
  }
}

// The receiver's copy done by SMs instead of copy engines: a grid-stride copy of 16-byte words,
// four loads in flight per thread, on gridDim.x blocks.
constexpr int kCopyThreads = 512;
__global__ void __launch_bounds__(kCopyThreads)
    sm_copy_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * kCopyThreads;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * kCopyThreads + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = src[i];
    const uint4 b = src[i + stride];
    const uint4 c = src[i + 2 * stride];
    const uint4 d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    throw BenchError(cat(what, " launch failed: ", cudaGetErrorString(status)));
  }
}

// cudaMalloc'ed memory the benchmark uses around the library (not through the backend, so that
// Backend::bytes_allocated counts only what the library itself allocates).
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes) {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, bytes));
    ptr_ = static_cast<std::byte*>(p);
  }
  ~DeviceMemory() { reset(); }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void reset() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
    ptr_ = nullptr;
  }
  std::byte* data() const { return ptr_; }

 private:
  std::byte* ptr_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// What one model's run found.
// ---------------------------------------------------------------------------------------------
struct DecodeRow {
  std::string variant;
  std::vector<double> ms;
  double copy_gbps = 0;  // the copy's own rate while decoding (0: no copy)
  int copies = 0;        // updates (or emulated updates) done in the window
  double busy = 0;       // fraction of the window with a copy in flight
};

struct MemoryFigures {
  std::int64_t slot_bytes = 0;
  std::int64_t connection_delta = 0;  // device-wide, serve + connect
  std::int64_t trainer_serve_backend_delta = 0;
  std::int64_t engine_connect_backend_delta = 0;
  std::int64_t receiver_delta = 0;  // device-wide, Receiver constructed
  std::int64_t receiver_backend_delta = 0;
  std::int64_t sender_delta = 0;  // device-wide (trainer-measured), Sender constructed
  std::int64_t sender_backend_delta = 0;
  std::int64_t updates_delta = 0;  // device-wide, across the measured updates
  std::int64_t trainer_backend_after_updates = 0;
};

struct ModelRun {
  std::string name;
  std::size_t bytes = 0;
  std::size_t tensors = 0;
  std::size_t buckets = 0;
  std::size_t largest_tensor = 0;
  std::string sources;  // full, shared, or empty when skipped
  std::size_t source_bytes = 0;
  std::string sources_note;
  // The transport's per-chunk medians over the "transport alone" reps (after the warm-up one):
  // where each chunk's time went, on each side.
  std::string sender_timeline;
  std::string receiver_timeline;
  std::vector<double> raw_ms;
  std::vector<double> transport_ms;          // trainer side
  std::vector<double> transport_engine_ms;   // engine side (adds a pipe round trip)
  std::vector<double> publish_ms;            // trainer side, end to end
  std::vector<double> receiver_transfer_ms;  // UpdateReport::transfer
  std::vector<double> stall_host_us;
  std::vector<double> stall_stream_us;
  std::size_t decode_bytes = 0;
  std::vector<DecodeRow> decode;
  MemoryFigures memory;
  std::vector<std::string> skipped;
  std::string error;
  double seconds = 0;
};

double median(const std::vector<double>& v) { return bench::summarize(v).median; }

// ---------------------------------------------------------------------------------------------
// The engine.
// ---------------------------------------------------------------------------------------------
class Reports {
 public:
  void add(const UpdateReport& report) {
    std::lock_guard lock(mutex_);
    // A late "superseded" must not hide that the update was offered (kReady) first.
    auto [it, fresh] = by_version_.emplace(report.version, report);
    if (!fresh && report.outcome != UpdateOutcome::kSuperseded) it->second = report;
    changed_.notify_all();
  }
  // The report of `version` (kReady); throws for any other outcome or none in time.
  UpdateReport wait(std::uint64_t version) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, bench::kWaitLimit,
                           [&] { return by_version_.count(version) > 0; })) {
      throw BenchError(cat("update ", version, ": no report from the receiver in ",
                           bench::kWaitLimit.count(), " s"));
    }
    const UpdateReport report = by_version_.at(version);
    by_version_.erase(by_version_.begin(), by_version_.lower_bound(version));
    if (report.outcome != UpdateOutcome::kReady) {
      throw BenchError(cat("update ", version, " ",
                           report.outcome == UpdateOutcome::kFailed ? "failed: " : "superseded",
                           report.error));
    }
    return report;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::uint64_t, UpdateReport> by_version_;
};

struct Engine {
  const Options& options;
  CudaBackend& backend;
  TrainerProcess* trainer = nullptr;
  std::string token;
  std::string socket_dir;
  int sms = 0;
  std::unique_ptr<Stream> stream;  // the engine's steps
  cudaStream_t native = nullptr;
  std::unique_ptr<Stream> copy_stream;  // low priority, as the receiver's: raw and emulated copies
  cudaStream_t copy_native = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
  float* partials = nullptr;
  std::size_t partials_capacity = 0;

  Engine(const Options& o, CudaBackend& b) : options(o), backend(b) {
    stream = backend.create_stream(StreamPriority::kNormal);
    native = CudaBackend::native(*stream);
    copy_stream = backend.create_stream(StreamPriority::kLow);
    copy_native = CudaBackend::native(*copy_stream);
    BENCH_CUDA(cudaEventCreate(&start));
    BENCH_CUDA(cudaEventCreate(&stop));
    const auto decode_bytes = static_cast<std::size_t>(o.decode_gib * double(bench::kGiB));
    partials_capacity = decode_bytes / kDecodeBlockBytes + 1;
    BENCH_CUDA(cudaMalloc(&partials, partials_capacity * sizeof(float)));
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, o.device));
    sms = prop.multiProcessorCount;
  }
  ~Engine() {
    (void)cudaFree(partials);
    (void)cudaEventDestroy(start);
    (void)cudaEventDestroy(stop);
  }

  // One decode step over `bytes` of `data` on the engine stream, timed with events (ms).
  double decode(const std::byte* data, std::size_t bytes) {
    const std::size_t blocks = (bytes + kDecodeBlockBytes - 1) / kDecodeBlockBytes;
    if (blocks == 0 || blocks > partials_capacity) {
      throw BenchError(cat("decode of ", bytes, " bytes: ", blocks, " blocks (room for ",
                           partials_capacity, ")"));
    }
    BENCH_CUDA(cudaEventRecord(start, native));
    (void)cudaGetLastError();
    decode_kernel<<<static_cast<unsigned>(blocks), kDecodeThreads, 0, native>>>(
        reinterpret_cast<const uint4*>(data), bytes / 16, partials);
    check_launch("decode_kernel");
    BENCH_CUDA(cudaEventRecord(stop, native));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return ms;
  }

  // Decode steps as an engine runs them: before_step (swapping when an update is pending), then
  // a step over the live weights; `steps` of them, or until `until`.
  std::vector<double> decode_loop(StepHook& hook, std::size_t group, std::size_t bytes, int steps,
                                  std::optional<Clock::time_point> until) {
    std::vector<double> ms;
    for (int i = 0; until ? Clock::now() < *until : i < steps; ++i) {
      hook.before_step(*stream);
      ms.push_back(decode(hook.live_arena(group), bytes));
    }
    return ms;
  }
};

std::vector<std::string> group_names(const Layout& layout) {
  std::vector<std::string> names;
  for (const GroupLayout& group : layout.groups()) names.push_back(group.name());
  return names;
}

// Copies `update_bytes` bucket by bucket (bucket-sized pieces from a two-bucket source ring into a
// two-bucket destination ring) on `stream`, one emulated update after the other, until `stop`.
// With `sm_ctas` > 0 an SM kernel copies, else cudaMemcpyAsync (the copy engines).
struct CopyLoop {
  int updates = 0;
  double copy_gbps = 0;
  std::string error;

  void run(int device, cudaStream_t stream, std::byte* src, std::byte* dst, std::size_t bucket,
           std::size_t update_bytes, int sm_ctas, const std::atomic<bool>& stop) {
    try {
      BENCH_CUDA(cudaSetDevice(device));
      const auto begin = Clock::now();
      std::size_t copied = 0;
      while (!stop.load()) {
        std::size_t k = 0;
        for (std::size_t offset = 0; offset < update_bytes; offset += bucket, ++k) {
          const std::size_t n = std::min(bucket, update_bytes - offset) & ~std::size_t{15};
          std::byte* to = dst + (k % 2) * bucket;
          const std::byte* from = src + (k % 2) * bucket;
          if (sm_ctas > 0) {
            (void)cudaGetLastError();
            sm_copy_kernel<<<static_cast<unsigned>(sm_ctas), kCopyThreads, 0, stream>>>(
                reinterpret_cast<uint4*>(to), reinterpret_cast<const uint4*>(from), n / 16);
            check_launch("sm_copy_kernel");
          } else {
            BENCH_CUDA(cudaMemcpyAsync(to, from, n, cudaMemcpyDeviceToDevice, stream));
          }
          copied += n;
        }
        BENCH_CUDA(cudaStreamSynchronize(stream));
        ++updates;
      }
      copy_gbps = gbps(static_cast<double>(copied), bench::to_ms(Clock::now() - begin));
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
};

// Joins a background thread however the scope is left; `stop` tells it to finish.
struct Background {
  std::atomic<bool> stop{false};
  std::thread thread;
  ~Background() {
    stop.store(true);
    if (thread.joinable()) thread.join();
  }
};

ModelRun run_model(const bench::ModelConfig& model, Engine& e, int index) {
  const Options& o = e.options;
  TrainerProcess& trainer = *e.trainer;
  ModelRun r;
  r.name = model.name;
  const auto model_start = Clock::now();
  const Layout layout = bench::model_layout(model, 1, kDefaultBucketBytes);
  const std::vector<std::string> groups = group_names(layout);
  for (const GroupLayout& group : layout.groups()) {
    r.bytes += group.arena_bytes();
    r.tensors += group.tensors().size();
    r.buckets += group.bucket_count();
  }
  r.largest_tensor = bench::largest_tensor_bytes(layout);
  const std::size_t bucket = layout.bucket_bytes();
  const auto M = static_cast<double>(r.bytes);

  // Does it fit? The engine's peak is two model-sized buffers (the raw copy's, later the
  // Receiver's two slots) plus the emulated copies' four buckets; the trainer's, its tensors and
  // its two slots. With the trainer on another GPU (--trainer-device) only the engine's part is
  // on this one; the trainer's (one model and two buckets) is less than the engine's peak, so a
  // GPU of the same kind holds it.
  const std::size_t free = free_device_bytes();
  const std::size_t engine_peak = 2 * r.bytes + 4 * bucket;
  const bool beside = o.trainer_device == o.device;
  const std::size_t full_need = engine_peak + (beside ? r.bytes + 2 * bucket : 0) + kFitMargin;
  const std::size_t shared_need =
      engine_peak + (beside ? r.largest_tensor + 2 * bucket : 0) + kFitMargin;
  if (o.sources == "full" || (o.sources == "auto" && full_need <= free)) {
    r.sources = "full";
    if (full_need > free) {
      r.skipped.push_back(
          strf("the model: --sources full needs %.1f GB, %.1f GB free", gb(full_need), gb(free)));
      return r;
    }
  } else if (shared_need <= free) {
    r.sources = "shared";
    r.sources_note = strf(
        "the trainer's %zu source tensors all read one %.2f GB buffer (the largest tensor's "
        "size)%s; packing still reads and writes every byte once",
        r.tensors, gb(r.largest_tensor),
        o.sources == "shared"
            ? " (--sources shared)"
            : strf(
                  ": %.1f GB of tensors do not fit beside the engine's two slots (%.1f GB; %.1f GB "
                  "free)",
                  gb(r.bytes), gb(2 * r.bytes), gb(free))
                  .c_str());
  } else {
    r.skipped.push_back(strf("the model: needs %.1f GB even with shared sources, %.1f GB free",
                             gb(shared_need), gb(free)));
    return r;
  }
  progress(strf("%s: %.2f GB, %zu tensors, %zu buckets of %zu MiB; trainer sources %s",
                r.name.c_str(), gb(M), r.tensors, r.buckets, bucket >> 20, r.sources.c_str()));
  r.source_bytes = static_cast<std::size_t>(
      trainer.call(cat("model ", r.name, " ", r.sources)).integer("source_bytes"));

  // 1. The connection.
  const std::string path = cat(e.socket_dir, "/model", index, ".sock");
  const std::size_t q0 = free_device_bytes();
  const auto engine_bytes0 = static_cast<std::int64_t>(e.backend.bytes_allocated());
  trainer.send(cat("serve ", path));
  // Connect once the trainer listens. A serve() that fails first answers at once (with the
  // reason), where connect() would retry until its timeout: wait for whichever comes first.
  for (const auto deadline = Clock::now() + kConnectTimeout;;) {
    std::error_code ignored;
    if (std::filesystem::is_socket(path, ignored)) break;
    if (trainer.reply_ready(std::chrono::milliseconds(5))) {
      trainer.read_reply("serve");  // throws the trainer's error
      throw BenchError("the trainer answered 'serve' before the engine connected");
    }
    if (Clock::now() > deadline) {
      throw BenchError(
          cat("the trainer did not listen on ", path, " within ", kConnectTimeout.count(), " s"));
    }
  }
  SameHostConfig config;
  config.connect_timeout = kConnectTimeout;
  std::unique_ptr<SameHostTransport> transport =
      SameHostTransport::connect(path, e.token, 1, e.backend, config);
  const Reply served = trainer.read_reply("serve", kConnectTimeout + std::chrono::seconds(5));
  const std::size_t q1 = free_device_bytes();
  MemoryFigures& mem = r.memory;
  mem.slot_bytes = static_cast<std::int64_t>(transport->slot_bytes());
  mem.connection_delta = static_cast<std::int64_t>(q0) - static_cast<std::int64_t>(q1);
  mem.trainer_serve_backend_delta = served.integer("backend_delta");
  mem.engine_connect_backend_delta =
      static_cast<std::int64_t>(e.backend.bytes_allocated()) - engine_bytes0;
  progress(
      strf("%s: connected (serve %.1f ms); device memory taken by the connection %.3f GB "
           "(two slots: %.3f GB)",
           r.name.c_str(), served.number("ms"), gb(mem.connection_delta), gb(2 * mem.slot_bytes)));

  // 2. The raw copy, then the transport alone into a buffer of the model's size.
  {
    DeviceMemory src(r.bytes);
    DeviceMemory dst(r.bytes);
    const auto raw = bench::time_on_stream(e.copy_native, o.reps + 1, [&] {
      BENCH_CUDA(cudaMemcpyAsync(dst.data(), src.data(), r.bytes, cudaMemcpyDeviceToDevice,
                                 e.copy_native));
    });
    r.raw_ms.assign(raw.begin() + 1, raw.end());
    src.reset();
    progress(strf("%s: raw device copy x%d: median %.3f ms (%.0f GB/s), min %.3f ms",
                  r.name.c_str(), o.reps, median(r.raw_ms), gbps(M, median(r.raw_ms)),
                  bench::summarize(r.raw_ms).min));

    std::unique_ptr<Stream> receive_stream = e.backend.create_stream(StreamPriority::kLow);
    std::unique_ptr<Event> received = e.backend.create_event();
    for (int rep = 0; rep < o.reps + 1; ++rep) {
      const auto start = Clock::now();
      // Posted from a thread of their own: a receive waits on the host for its chunk's doorbell,
      // which the trainer (told to send below) rings. The trainer is told only once that thread
      // runs: its start-up (tens of microseconds) is the bench's, and a receiver that posts its
      // receives late is not what the transport's figure is about.
      std::atomic<bool> posting_started{false};
      auto posting = std::async(std::launch::async, [&] {
        posting_started.store(true);
        std::size_t base = 0;
        for (const GroupLayout& group : layout.groups()) {
          for (std::size_t k = 0; k < group.bucket_count(); ++k) {
            const Bucket b = group.bucket(k);
            transport->broadcast_async(dst.data() + base + b.offset, b.bytes, 0, *receive_stream);
          }
          base += group.arena_bytes();
        }
        e.backend.event_record(*received, *receive_stream);
      });
      for (const auto deadline = Clock::now() + std::chrono::seconds(10);
           !posting_started.load();) {
        if (Clock::now() > deadline) throw BenchError("transport alone: the posting thread did "
                                                      "not start within 10 s");
        std::this_thread::yield();
      }
      const Reply sent = trainer.call("send");
      posting.get();
      if (!e.backend.event_wait_for(*received, bench::kWaitLimit)) {
        throw BenchError(cat("transport alone: the receives not done ", bench::kWaitLimit.count(),
                             " s after the trainer's sends"));
      }
      const double engine_ms = bench::to_ms(Clock::now() - start);
      if (auto error = transport->async_error()) throw BenchError(cat("transport alone: ", *error));
      if (rep > 0) {
        r.transport_ms.push_back(sent.number("ms"));
        r.transport_engine_ms.push_back(engine_ms);
      } else {  // the timelines start after the warm-up rep
        (void)transport->timeline_summary();
        (void)trainer.call("timeline");
      }
    }
    r.receiver_timeline = transport->timeline_summary();
    r.sender_timeline = trainer.call("timeline").line.substr(3);
    progress(cat(r.name, ": transport alone: ", r.sender_timeline));
    progress(cat(r.name, ": transport alone: ", r.receiver_timeline));
    progress(
        strf("%s: transport alone x%d: median %.3f ms (%.0f GB/s, %.2f of the raw copy), min "
             "%.3f ms; engine-observed median %.3f ms",
             r.name.c_str(), o.reps, median(r.transport_ms), gbps(M, median(r.transport_ms)),
             median(r.raw_ms) / median(r.transport_ms), bench::summarize(r.transport_ms).min,
             median(r.transport_engine_ms)));
  }

  // 3. The receiver and the sender over that connection.
  const std::size_t q1b = free_device_bytes();
  const auto engine_bytes1 = static_cast<std::int64_t>(e.backend.bytes_allocated());
  ReceiverConfig receiver_config;
  receiver_config.root_rank = 0;
  Reports reports;  // outlives the receiver, whose thread calls the observer
  auto receiver =
      std::make_unique<Receiver>(layout, e.backend, std::move(transport), receiver_config);
  // Destroyed before the receiver: the engine stream is done reading the slots by then.
  struct SyncEngine {
    cudaStream_t stream;
    ~SyncEngine() { (void)cudaStreamSynchronize(stream); }
  } sync_engine{e.native};
  receiver->set_observer([&reports](const UpdateReport& report) { reports.add(report); });
  StepHook& hook = receiver->step_hook();
  const std::size_t q2 = free_device_bytes();
  mem.receiver_delta = static_cast<std::int64_t>(q1b) - static_cast<std::int64_t>(q2);
  mem.receiver_backend_delta =
      static_cast<std::int64_t>(e.backend.bytes_allocated()) - engine_bytes1;
  const Reply made = trainer.call("sender");
  mem.sender_delta = made.integer("free_before") - made.integer("free_after");
  mem.sender_backend_delta = made.integer("backend_delta");
  const std::size_t q2b = free_device_bytes();
  progress(strf("%s: receiver %.3f GB (backend %.3f GB), sender %.3f GB (backend %.3f GB)",
                r.name.c_str(), gb(mem.receiver_delta), gb(mem.receiver_backend_delta),
                gb(mem.sender_delta), gb(mem.sender_backend_delta)));

  // 4. Updates end to end, each swapped at a step boundary on this (the engine) thread.
  std::uint64_t version = 0;
  const auto header = [&](std::uint64_t v) {
    return make_update_header(layout, v, groups, o.checksums);
  };
  for (int i = 0; i < kWarmup + o.updates; ++i) {
    if (i >= kWarmup + 5 && elapsed_s() > o.budget_s) {
      r.skipped.push_back(strf("updates %d..%d (budget)", i - kWarmup + 1, o.updates));
      break;
    }
    const std::uint64_t v = ++version;
    receiver->begin_update(header(v));
    const Reply published = trainer.call(cat("publish ", v));
    const UpdateReport report = reports.wait(v);
    bench::wait_until([&] { return hook.has_pending(); }, cat("update ", v, " to be offered"));
    BENCH_CUDA(cudaStreamSynchronize(e.native));  // a step boundary
    BENCH_CUDA(cudaEventRecord(e.start, e.native));
    const auto swap_start = Clock::now();
    const std::optional<std::uint64_t> applied = hook.before_step(*e.stream);
    const double host_us = bench::to_us(Clock::now() - swap_start);
    BENCH_CUDA(cudaEventRecord(e.stop, e.native));
    BENCH_CUDA(cudaEventSynchronize(e.stop));
    if (applied != v) throw BenchError(cat("update ", v, " was offered but not applied"));
    float stream_ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&stream_ms, e.start, e.stop));
    mem.trainer_backend_after_updates = published.integer("backend_bytes");
    if (i < kWarmup) continue;
    r.publish_ms.push_back(published.number("ms"));
    r.receiver_transfer_ms.push_back(bench::to_ms(report.transfer));
    r.stall_host_us.push_back(host_us);
    r.stall_stream_us.push_back(stream_ms * 1e3);
  }
  mem.updates_delta =
      static_cast<std::int64_t>(q2b) - static_cast<std::int64_t>(free_device_bytes());
  const bench::Summary stall = bench::summarize(r.stall_host_us);
  progress(
      strf("%s: %zu updates end to end: median %.3f ms (%.0f GB/s, %.2f of the raw copy), "
           "receiver transfer median %.3f ms; swap stall median %.1f us, p99 %.1f us",
           r.name.c_str(), r.publish_ms.size(), median(r.publish_ms), gbps(M, median(r.publish_ms)),
           median(r.raw_ms) / median(r.publish_ms), median(r.receiver_transfer_ms), stall.median,
           stall.p99));

  // 5. Decode: alone, during real updates, during the engine-side copy on copy engines or SMs.
  const std::size_t group = 0;
  r.decode_bytes = std::min(static_cast<std::size_t>(o.decode_gib * double(bench::kGiB)),
                            layout.groups()[group].arena_bytes()) &
                   ~std::size_t{15};
  const auto window =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.during_s));
  {
    e.decode_loop(hook, group, r.decode_bytes, 5, std::nullopt);  // warm-up
    DecodeRow alone{"alone",
                    e.decode_loop(hook, group, r.decode_bytes, o.decode_steps, std::nullopt)};
    r.decode.push_back(alone);
  }
  if (elapsed_s() > o.budget_s) {
    r.skipped.push_back("decode during updates and copies (budget)");
  } else {
    DecodeRow row{"during updates"};
    std::vector<double> ms;
    std::string error;
    {
      Background driver;
      driver.thread = std::thread([&] {
        try {
          while (!driver.stop.load()) {
            const std::uint64_t v = ++version;
            receiver->begin_update(header(v));
            const Reply published = trainer.call(cat("publish ", v));
            reports.wait(v);
            ms.push_back(published.number("ms"));
          }
        } catch (const std::exception& ex) {
          error = ex.what();
        }
      });
      const auto begin = Clock::now();
      row.ms = e.decode_loop(hook, group, r.decode_bytes, 0, begin + window);
      driver.stop.store(true);
      driver.thread.join();
      const double window_ms = bench::to_ms(Clock::now() - begin);
      double busy_ms = 0;
      for (double x : ms) busy_ms += x;
      row.busy = busy_ms / window_ms;
    }
    if (!error.empty()) throw BenchError(cat("decode during updates: ", error));
    hook.apply_pending_now(*e.stream);
    BENCH_CUDA(cudaStreamSynchronize(e.native));
    row.copies = static_cast<int>(ms.size());
    row.copy_gbps = ms.empty() ? 0 : gbps(M, median(ms));
    r.decode.push_back(std::move(row));

    DeviceMemory rings(4 * bucket);  // a two-bucket source and a two-bucket destination
    BENCH_CUDA(cudaMemset(rings.data(), 0x3c, 4 * bucket));
    for (const int ctas : {0, o.sm_copy_ctas > 0 ? o.sm_copy_ctas : e.sms}) {
      DecodeRow copy_row{ctas == 0 ? "during copy-engine copy" : "during SM-kernel copy"};
      CopyLoop loop;
      {
        Background copier;
        copier.thread = std::thread([&] {
          loop.run(o.device, e.copy_native, rings.data(), rings.data() + 2 * bucket, bucket,
                   r.bytes, ctas, copier.stop);
        });
        copy_row.ms = e.decode_loop(hook, group, r.decode_bytes, 0, Clock::now() + window);
        copier.stop.store(true);
        copier.thread.join();
      }
      if (!loop.error.empty()) throw BenchError(cat(copy_row.variant, ": ", loop.error));
      copy_row.copies = loop.updates;
      copy_row.copy_gbps = loop.copy_gbps;
      copy_row.busy = 1;
      r.decode.push_back(std::move(copy_row));
    }
  }
  {
    const double alone = median(r.decode.front().ms);
    std::string line = strf("%s: decode step over %.2f GB: alone median %.3f ms", r.name.c_str(),
                            gb(r.decode_bytes), alone);
    for (std::size_t i = 1; i < r.decode.size(); ++i) {
      line += strf("; %s %.2fx (copy %.0f GB/s)", r.decode[i].variant.c_str(),
                   median(r.decode[i].ms) / alone, r.decode[i].copy_gbps);
    }
    progress(line);
  }

  // 6. Teardown: the receiver first (its end of the connection closes), then the trainer's side.
  hook.apply_pending_now(*e.stream);
  BENCH_CUDA(cudaStreamSynchronize(e.native));
  receiver.reset();
  trainer.call("close");
  r.seconds = bench::to_s(Clock::now() - model_start);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Results: JSON, Markdown tables, goals.
// ---------------------------------------------------------------------------------------------
struct Goal {
  std::string model;
  std::string name;
  double value = 0;
  double target = 0;
  std::string unit;
  bool met = false;
};

std::vector<Goal> goals_of(const ModelRun& r) {
  std::vector<Goal> goals;
  if (!r.raw_ms.empty() && !r.transport_ms.empty()) {
    const double ratio = median(r.raw_ms) / median(r.transport_ms);
    goals.push_back(
        {r.name, "transport GB/s >= 0.90 x raw device copy", ratio, 0.90, "x", ratio >= 0.90});
  }
  if (!r.raw_ms.empty() && !r.publish_ms.empty()) {
    const double ratio = 2 * median(r.raw_ms) / median(r.publish_ms);
    goals.push_back({r.name, "end-to-end GB/s >= 0.90 x two raw device copies (pack + receive)",
                     ratio, 0.90, "x", ratio >= 0.90});
  }
  if (!r.publish_ms.empty()) {
    const MemoryFigures& m = r.memory;
    const double trainer = static_cast<double>(m.connection_delta + m.sender_delta);
    goals.push_back({r.name, "trainer extra device memory <= two staging buckets", trainer,
                     static_cast<double>(2 * m.slot_bytes + kMemorySlack), "bytes",
                     trainer <= static_cast<double>(2 * m.slot_bytes + kMemorySlack)});
    // Beyond the live weights: the shadow, plus whatever the connection took beyond the
    // trainer's two slots (which could only be the engine's side of connect()).
    const double beyond =
        static_cast<double>(m.receiver_delta) - static_cast<double>(r.bytes) +
        std::max<double>(0, static_cast<double>(m.connection_delta - 2 * m.slot_bytes));
    goals.push_back({r.name, "engine extra device memory <= the shadow", beyond,
                     static_cast<double>(r.bytes + kMemorySlack), "bytes",
                     beyond <= static_cast<double>(r.bytes + kMemorySlack)});
  }
  return goals;
}

Json summary_json(const std::vector<double>& v) { return bench::to_json(bench::summarize(v)); }

Json gbps_json(double bytes, const std::vector<double>& ms) {
  if (ms.empty()) return Json();
  const bench::Summary s = bench::summarize(ms);
  return Json::object()
      .set("median", gbps(bytes, s.median))
      .set("min", gbps(bytes, s.max))
      .set("max", gbps(bytes, s.min));
}

Json model_json(const ModelRun& r) {
  const auto M = static_cast<double>(r.bytes);
  Json j = Json::object()
               .set("name", r.name)
               .set("bytes", r.bytes)
               .set("tensors", r.tensors)
               .set("buckets", r.buckets)
               .set("largest_tensor_bytes", r.largest_tensor)
               .set("sources", Json::object()
                                   .set("mode", r.sources)
                                   .set("bytes", r.source_bytes)
                                   .set("note", r.sources_note))
               .set("seconds", r.seconds)
               .set("transport_timeline", Json::object()
                                              .set("sender", r.sender_timeline)
                                              .set("receiver", r.receiver_timeline));
  if (!r.raw_ms.empty()) {
    j.set("raw_copy",
          Json::object().set("ms", summary_json(r.raw_ms)).set("gbps", gbps_json(M, r.raw_ms)));
  }
  if (!r.transport_ms.empty()) {
    j.set("transport", Json::object()
                           .set("ms", summary_json(r.transport_ms))
                           .set("gbps", gbps_json(M, r.transport_ms))
                           .set("engine_observed_ms", summary_json(r.transport_engine_ms))
                           .set("ratio_to_raw", median(r.raw_ms) / median(r.transport_ms))
                           .set("added_ms", median(r.transport_ms) - median(r.raw_ms)));
  }
  if (!r.publish_ms.empty()) {
    j.set("end_to_end", Json::object()
                            .set("publish_ms", summary_json(r.publish_ms))
                            .set("gbps", gbps_json(M, r.publish_ms))
                            .set("receiver_transfer_ms", summary_json(r.receiver_transfer_ms))
                            .set("ratio_to_raw", median(r.raw_ms) / median(r.publish_ms))
                            .set("ratio_to_two_copies", 2 * median(r.raw_ms) / median(r.publish_ms))
                            .set("added_ms", median(r.publish_ms) - 2 * median(r.raw_ms)));
    j.set("stall", Json::object()
                       .set("swap_strategy", "rebind")
                       .set("host_us", summary_json(r.stall_host_us))
                       .set("engine_stream_us", summary_json(r.stall_stream_us)));
  }
  if (!r.decode.empty()) {
    Json rows = Json::array();
    const double alone = median(r.decode.front().ms);
    for (const DecodeRow& row : r.decode) {
      rows.push(Json::object()
                    .set("variant", row.variant)
                    .set("ms", summary_json(row.ms))
                    .set("ratio_median", median(row.ms) / alone)
                    .set("ratio_p99",
                         bench::summarize(row.ms).p99 / bench::summarize(r.decode.front().ms).p99)
                    .set("copy_gbps", row.copy_gbps)
                    .set("copies", row.copies)
                    .set("busy_fraction", row.busy));
    }
    j.set("decode", Json::object().set("bytes", r.decode_bytes).set("rows", rows));
  }
  if (r.memory.slot_bytes > 0) {
    const MemoryFigures& m = r.memory;
    j.set("memory", Json::object()
                        .set("slot_bytes", m.slot_bytes)
                        .set("connection_delta_bytes", m.connection_delta)
                        .set("trainer_serve_backend_delta_bytes", m.trainer_serve_backend_delta)
                        .set("engine_connect_backend_delta_bytes", m.engine_connect_backend_delta)
                        .set("receiver_delta_bytes", m.receiver_delta)
                        .set("receiver_backend_delta_bytes", m.receiver_backend_delta)
                        .set("sender_delta_bytes", m.sender_delta)
                        .set("sender_backend_delta_bytes", m.sender_backend_delta)
                        .set("updates_delta_bytes", m.updates_delta)
                        .set("trainer_backend_bytes_after_updates", m.trainer_backend_after_updates)
                        .set("trainer_extra_bytes", m.connection_delta + m.sender_delta)
                        .set("engine_beyond_live_bytes",
                             m.receiver_delta - static_cast<std::int64_t>(r.bytes)));
  }
  Json skipped = Json::array();
  for (const std::string& s : r.skipped) skipped.push(s);
  j.set("skipped", skipped);
  if (!r.error.empty()) j.set("error", r.error);
  return j;
}

std::string ms_pair(const std::vector<double>& v) {
  if (v.empty()) return "-";
  const bench::Summary s = bench::summarize(v);
  return strf("%.3f / %.3f", s.median, s.min);
}

std::string tables(const std::vector<ModelRun>& runs) {
  std::string t;
  t += "Transfer (ms median / min; GB/s of the median; goals: transport >= 0.90 x raw, end to end "
       ">= 0.90 x two raw copies):\n\n";
  t += "| model | GB | sources | raw copy ms | raw GB/s | transport ms | transport GB/s | "
       "transport / raw "
       "| added ms | end-to-end ms | e2e GB/s | e2e / raw | e2e / two copies | receiver transfer "
       "ms |\n";
  t += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const ModelRun& r : runs) {
    if (r.raw_ms.empty()) continue;
    const auto M = static_cast<double>(r.bytes);
    const double raw = median(r.raw_ms);
    const double tr = median(r.transport_ms);
    const double e2e = median(r.publish_ms);
    t += strf(
        "| %s | %.2f | %s | %s | %.0f | %s | %.0f | %.2f | %+.3f | %s | %.0f | %.2f | %.2f | %s "
        "|\n",
        r.name.c_str(), gb(M), r.sources.c_str(), ms_pair(r.raw_ms).c_str(), gbps(M, raw),
        ms_pair(r.transport_ms).c_str(), gbps(M, tr), tr > 0 ? raw / tr : 0, tr - raw,
        ms_pair(r.publish_ms).c_str(), gbps(M, e2e), e2e > 0 ? raw / e2e : 0,
        e2e > 0 ? 2 * raw / e2e : 0, ms_pair(r.receiver_transfer_ms).c_str());
  }
  t += "\nEngine stall per swap (rebind, at a step boundary; p99 is the maximum below 100 "
       "swaps):\n\n";
  t += "| model | swaps | host us median | host us p99 | engine stream us median |\n";
  t += "| --- | --- | --- | --- | --- |\n";
  for (const ModelRun& r : runs) {
    if (r.stall_host_us.empty()) continue;
    const bench::Summary h = bench::summarize(r.stall_host_us);
    t += strf("| %s | %zu | %.1f | %.1f | %.1f |\n", r.name.c_str(), h.n, h.median, h.p99,
              median(r.stall_stream_us));
  }
  t +=
      "\nDecode step (ms median / p99; x = median over alone; copy GB/s: the copy's own rate while "
      "decoding):\n\n";
  t += "| model | decode GB | variant | steps | ms median / p99 | x median | copy GB/s | copies | "
       "window with a copy in flight |\n";
  t += "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const ModelRun& r : runs) {
    if (r.decode.empty()) continue;
    const double alone = median(r.decode.front().ms);
    for (const DecodeRow& row : r.decode) {
      const bench::Summary s = bench::summarize(row.ms);
      t += strf("| %s | %.2f | %s | %zu | %.3f / %.3f | %.2f | %s | %d | %s |\n", r.name.c_str(),
                gb(r.decode_bytes), row.variant.c_str(), s.n, s.median, s.p99, s.median / alone,
                row.copy_gbps > 0 ? strf("%.0f", row.copy_gbps).c_str() : "-", row.copies,
                row.copies > 0 ? strf("%.0f %%", 100 * row.busy).c_str() : "-");
    }
  }
  t += "\nExtra device memory (GB; device-wide cudaMemGetInfo deltas, each while the other process "
       "was idle; backend = Backend::bytes_allocated):\n\n";
  t += "| model | two slots | connection (serve + connect) | trainer Sender (backend) | trainer "
       "extra | "
       "goal <= | engine Receiver (backend) | engine beyond live | goal <= (shadow) | across "
       "updates |\n";
  t += "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const ModelRun& r : runs) {
    if (r.publish_ms.empty()) continue;
    const MemoryFigures& m = r.memory;
    t += strf(
        "| %s | %.3f | %.3f | %.3f (%.3f) | %.3f | %.3f | %.3f (%.3f) | %.3f | %.3f | %.3f |\n",
        r.name.c_str(), gb(2 * m.slot_bytes), gb(m.connection_delta), gb(m.sender_delta),
        gb(m.sender_backend_delta), gb(m.connection_delta + m.sender_delta),
        gb(2 * m.slot_bytes + kMemorySlack), gb(m.receiver_delta), gb(m.receiver_backend_delta),
        gb(m.receiver_delta - static_cast<std::int64_t>(r.bytes)), gb(r.bytes + kMemorySlack),
        gb(m.updates_delta));
  }
  std::string notes;
  for (const ModelRun& r : runs) {
    if (!r.sources_note.empty())
      notes += strf("* %s: %s.\n", r.name.c_str(), r.sources_note.c_str());
    if (!r.sender_timeline.empty())
      notes += strf("* %s, transport alone: %s.\n", r.name.c_str(), r.sender_timeline.c_str());
    if (!r.receiver_timeline.empty())
      notes += strf("* %s, transport alone: %s.\n", r.name.c_str(), r.receiver_timeline.c_str());
    for (const std::string& s : r.skipped)
      notes += strf("* %s: skipped %s.\n", r.name.c_str(), s.c_str());
    if (!r.error.empty()) notes += strf("* %s: FAILED: %s\n", r.name.c_str(), r.error.c_str());
  }
  if (!notes.empty()) t += "\nNotes:\n\n" + notes;
  std::string goals;
  for (const ModelRun& r : runs) {
    for (const Goal& g : goals_of(r)) {
      goals += g.unit == "bytes"
                   ? strf("* %s: %s: %.3f GB (<= %.3f GB): %s\n", g.model.c_str(), g.name.c_str(),
                          gb(g.value), gb(g.target), g.met ? "met" : "MISSED")
                   : strf("* %s: %s: %.2f: %s\n", g.model.c_str(), g.name.c_str(), g.value,
                          g.met ? "met" : "MISSED");
    }
  }
  if (!goals.empty()) t += "\nGoals:\n\n" + goals;
  return t;
}

struct RunInfo {
  std::string machine;
  std::string date;
  std::string stamp;
  std::string command;
  std::string device;
  std::size_t device_memory = 0;
  std::string token_source;
  int sm_copy_ctas = 0;
};

void write_outputs(const Options& o, const RunInfo& info, const std::vector<ModelRun>& runs,
                   bool complete, const std::vector<std::string>& errors) {
  Json models = Json::array();
  Json goals = Json::array();
  Json skipped = Json::array();
  for (const ModelRun& r : runs) {
    models.push(model_json(r));
    for (const Goal& g : goals_of(r)) {
      goals.push(Json::object()
                     .set("model", g.model)
                     .set("goal", g.name)
                     .set("value", g.value)
                     .set("target", g.target)
                     .set("unit", g.unit)
                     .set("met", g.met));
    }
    for (const std::string& s : r.skipped) skipped.push(cat(r.name, ": ", s));
  }
  Json error_list = Json::array();
  for (const std::string& e : errors) error_list.push(e);
  const Json run = Json::object()
                       .set("schema", kSchema)
                       .set("label", o.trainer_device == o.device
                                         ? "GPU figures (one GPU, trainer and engine processes)"
                                         : "GPU figures (trainer and engine processes on two GPUs)")
                       .set("machine", info.machine)
                       .set("device", info.device)
                       .set("device_memory_bytes", info.device_memory)
                       .set("date", info.date)
                       .set("commit", o.commit)
                       .set("command", info.command)
                       .set("elapsed_s", elapsed_s())
                       .set("complete", complete)
                       .set("config", Json::object()
                                          .set("engine_device", o.device)
                                          .set("trainer_device", o.trainer_device)
                                          .set("updates", o.updates)
                                          .set("warmup_updates", kWarmup)
                                          .set("reps", o.reps)
                                          .set("bucket_bytes", kDefaultBucketBytes)
                                          .set("memory", "device")
                                          .set("swap_strategy", "rebind")
                                          .set("checksums", o.checksums)
                                          .set("decode_gib", o.decode_gib)
                                          .set("decode_steps", o.decode_steps)
                                          .set("during_seconds", o.during_s)
                                          .set("sm_copy_ctas", info.sm_copy_ctas)
                                          .set("sm_copy_threads", kCopyThreads)
                                          .set("sources", o.sources)
                                          .set("token", info.token_source)
                                          .set("budget_s", o.budget_s))
                       .set("models", models)
                       .set("goals", goals)
                       .set("skipped", skipped)
                       .set("errors", error_list);
  std::filesystem::create_directories(o.out_dir);
  const std::string stem = cat(o.out_dir, "/bench-same-host-", info.stamp);
  std::ofstream(stem + ".json") << run.dump();
  std::ofstream md(stem + ".md");
  if (o.trainer_device == o.device) {
    md << "# Same-host transport (device memory), one GPU\n\n"
       << "GPU figures: the trainer and the engine are two processes on one GPU.\n\n";
  } else {
    md << "# Same-host transport (device memory), two GPUs\n\n"
       << "GPU figures: the trainer process on GPU " << o.trainer_device
       << ", the engine process on GPU " << o.device
       << " (the engine's copy engines read the trainer's staging across GPUs; the raw copy and "
          "the copy references are on the engine's GPU). The memory figures are the engine GPU's "
          "(cudaMemGetInfo there): the trainer's slots, on its own GPU, are not in them.\n\n";
  }
  md
     << "* machine: " << info.machine << " (" << info.device << ")\n"
     << "* date: " << info.date << "\n* commit: " << o.commit << "\n* command: `" << info.command
     << "`\n* complete: " << (complete ? "yes" : "no") << strf(" (%.0f s)", elapsed_s()) << "\n\n"
     << tables(runs);
  for (const std::string& e : errors) md << "\nERROR: " << e << "\n";
}

// Kills the trainer and ends the process if the run is still going at `limit_s`; the results of
// the models done so far are already on disk.
class Watchdog {
 public:
  Watchdog(double limit_s, std::string temp_dir) {
    thread_ = std::thread([this, limit_s, temp_dir = std::move(temp_dir)] {
      std::unique_lock lock(mutex_);
      if (cv_.wait_for(lock, std::chrono::duration<double>(limit_s), [this] { return done_; }))
        return;
      std::fprintf(stderr,
                   "bench_same_host_one_gpu: watchdog: still running after %.0f s; the "
                   "trainer is killed, the results of the finished models are on disk\n",
                   limit_s);
      if (const pid_t pid = g_trainer_pid.load(); pid > 0) ::kill(pid, SIGKILL);
      std::error_code ignored;
      std::filesystem::remove_all(temp_dir, ignored);
      std::_Exit(3);
    });
  }
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

int engine_main(const Options& o, int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  std::vector<bench::ModelConfig> models;
  try {
    models = bench::models_named(o.models);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_same_host_one_gpu: --models: %s\n", e.what());
    return 2;
  }
  int count = 0;
  const int highest = std::max(o.device, o.trainer_device);
  if (cudaGetDeviceCount(&count) != cudaSuccess || count <= highest) {
    std::printf("SKIP: bench_same_host_one_gpu needs GPU %d, found %d\n", highest, count);
    return 77;
  }

  RunInfo info;
  info.command = bench::command_line(argc, argv);
  info.date = bench::utc_now("%Y-%m-%dT%H:%M:%SZ");
  info.stamp = bench::utc_now("%Y%m%dT%H%M%SZ");
  std::vector<ModelRun> runs;
  std::vector<std::string> errors;
  std::string temp_dir;
  try {
    CudaBackend backend(o.device);
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, o.device));
    info.device = prop.name;
    info.device_memory = prop.totalGlobalMem;
    info.machine = o.machine.empty() ? cat(o.trainer_device == o.device ? "1x " : "2x ", prop.name)
                                     : o.machine;

    // The socket's private directory (mkdtemp: mode 0700, as the transport requires) and the
    // token: the environment's, or a fresh one in a 0600 file there for the trainer to read.
    char pattern[] = "/tmp/shadowsync-bench-same-host-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) throw BenchError(cat("mkdtemp: ", std::strerror(errno)));
    temp_dir = pattern;
    std::string token;
    std::string token_file;
    if (const char* env = std::getenv(kTokenEnv); env != nullptr && *env != '\0') {
      token = env;
      info.token_source = cat("$", kTokenEnv);
    } else {
      token = make_token();
      token_file = temp_dir + "/token";
      const int fd = ::open(token_file.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) throw BenchError(cat("creating ", token_file, ": ", std::strerror(errno)));
      write_line(fd, token);
      ::close(fd);
      info.token_source = "generated, in a 0600 file of the private directory";
    }

    std::printf(
        "bench_same_host_one_gpu: engine on device %d, trainer on device %d: %s, %.1f GB; %d "
        "updates (+%d warm-up) and %d repetitions per model; socket directory %s; token %s; "
        "commit %s\n",
        o.device, o.trainer_device, prop.name, gb(prop.totalGlobalMem), o.updates, kWarmup, o.reps, temp_dir.c_str(),
        info.token_source.c_str(), o.commit.c_str());
    Watchdog watchdog(o.budget_s + 35, temp_dir);
    Engine engine(o, backend);
    engine.token = token;
    info.sm_copy_ctas = o.sm_copy_ctas > 0 ? o.sm_copy_ctas : engine.sms;
    engine.socket_dir = temp_dir;
    std::vector<std::string> trainer_args = {"--device", std::to_string(o.trainer_device)};
    if (!token_file.empty()) trainer_args.insert(trainer_args.end(), {"--token-file", token_file});
    if (o.checksums) trainer_args.push_back("--checksums");
    auto trainer = std::make_unique<TrainerProcess>(trainer_args);
    progress("trainer process started");

    for (std::size_t i = 0; i < models.size(); ++i) {
      if (elapsed_s() > o.budget_s) {
        ModelRun skipped;
        skipped.name = models[i].name;
        skipped.skipped.push_back("the model (budget)");
        runs.push_back(skipped);
        continue;
      }
      engine.trainer = trainer.get();
      try {
        runs.push_back(run_model(models[i], engine, static_cast<int>(i)));
      } catch (const std::exception& ex) {
        ModelRun failed;
        failed.name = models[i].name;
        failed.error = one_line(ex.what());
        runs.push_back(failed);
        errors.push_back(cat(models[i].name, ": ", failed.error));
        progress(cat(models[i].name, ": FAILED: ", failed.error));
        // The trainer's state is unknown now: a fresh one for the next model.
        trainer.reset();
        trainer = std::make_unique<TrainerProcess>(trainer_args);
      }
      write_outputs(o, info, runs, false, errors);
    }
    trainer.reset();
    write_outputs(o, info, runs, true, errors);
  } catch (const std::exception& e) {
    errors.push_back(one_line(e.what()));
    std::fprintf(stderr, "bench_same_host_one_gpu: %s\n", e.what());
    write_outputs(o, info, runs, false, errors);
  }
  if (!temp_dir.empty()) {
    std::error_code ignored;
    std::filesystem::remove_all(temp_dir, ignored);
  }
  std::printf("\n%s", tables(runs).c_str());
  std::printf("\nwrote %s/bench-same-host-%s.json and .md\n", o.out_dir.c_str(),
              info.stamp.c_str());
  return errors.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse_options(argc, argv, o)) return 2;
  if (o.role == "trainer") return trainer_main(o);
  return engine_main(o, argc, argv);
}
