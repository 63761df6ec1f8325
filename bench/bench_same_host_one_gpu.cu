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
//
// This file holds the run: options, the private directory and the token, the trainer process,
// every model in turn, the watchdog and the artefacts. The pieces: support/same_host_*.h.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/token.h"
#include "support/bench_cuda.h"
#include "support/bench_models.h"
#include "support/bench_stamp.h"
#include "support/bench_watchdog.h"
#include "support/same_host_device.h"
#include "support/same_host_engine.h"
#include "support/same_host_model_run.h"
#include "support/same_host_options.h"
#include "support/same_host_protocol.h"
#include "support/same_host_report.h"
#include "support/same_host_trainer.h"
#include "support/same_host_trainer_process.h"

namespace {

using namespace shadowsync;
using namespace shadowsync::bench::same_host;
using bench::BenchError;
using bench::cat;

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
  const bench::RunDate date = bench::run_date_now();
  info.date = date.date;
  info.stamp = date.file_stamp;
  info.sm_copy_threads = kSmCopyThreads;
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
        o.device, o.trainer_device, prop.name, gb(static_cast<double>(prop.totalGlobalMem)),
        o.updates, kWarmup, o.reps, temp_dir.c_str(), info.token_source.c_str(), o.commit.c_str());
    // Past the budget and its grace, the trainer is killed and the process ends; the results of
    // the models done so far are on disk (rewritten after each).
    const double watchdog_s = o.budget_s + 35;
    const bench::Watchdog watchdog(watchdog_s, [watchdog_s, temp_dir] {
      std::fprintf(stderr,
                   "bench_same_host_one_gpu: watchdog: still running after %.0f s; the "
                   "trainer is killed, the results of the finished models are on disk\n",
                   watchdog_s);
      if (const pid_t pid = running_trainer_pid(); pid > 0) ::kill(pid, SIGKILL);
      std::error_code ignored;
      std::filesystem::remove_all(temp_dir, ignored);
      std::_Exit(3);
    });
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
