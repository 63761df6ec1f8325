// What the receiver's integrity checks cost, on ONE GPU, at the layouts of real models
// (bench/support/bench_models.h). bench_gpu measures the same behind a real NCCL transfer, which
// needs two GPUs; the checks themselves do not, so this program fills the shadow with
// tests/support/device_copy_transport.h (one device-to-device copy per bucket) instead.
//
// Per model:
//   kernels alone (idle GPU, CUDA events, --updates repetitions): the checksum of every bucket
//     and the non-finite count of every floating tensor, launched exactly as the receiver does
//     (CudaBackend::checksum_async / count_nonfinite_async): median ms and GB/s. This is what the
//     checks would add if they ran after the transfer instead of overlapping it.
//   receive: --updates updates (after 2 warm-up ones) with no check, with checksums (the header
//     announces them; the trainer's block is queued as the last "broadcast"), with the guard
//     (ReceiverConfig::reject_nonfinite), with both: UpdateReport::transfer (first bucket posted
//     to ready, checks included), median ms; "added" = median minus the plain median.
//   With --link-gbps G: the added time against a transfer of the same bytes at G GB/s, the
//     fraction issue 7 asks about (on by default if under 5 %). It is a projection: the checks
//     here overlap a device copy that is ~10x faster than a link, which hides less of them.
//
//   bench_integrity_one_gpu [--updates N] [--models name,name] [--link-gbps G]
// Exit status: 0, 1 on an error, 2 on bad arguments, 77 without a GPU.
#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "device_copy_transport.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/update_header.h"
#include "support/bench_cuda.h"
#include "support/bench_models.h"

namespace {

using namespace shadowsync;
using bench::BenchError;
using bench::cat;
using Clock = std::chrono::steady_clock;

constexpr int kWarmup = 2;

struct Checks {
  const char* name;
  bool checksums;
  bool guard;
};
constexpr Checks kCheckSets[] = {
    {"none", false, false}, {"checksums", true, false}, {"guard", false, true}, {"both", true, true}};

// The trainer's side: the bytes every update "receives" and their per-bucket checksums (the block
// a sender broadcasts after the last bucket), computed once with the receiver's own kernel.
struct Trainer {
  std::vector<DeviceBuffer> arenas;
  DeviceBuffer checksums;
  std::vector<std::string> groups;
};

Trainer make_trainer(const Layout& layout, CudaBackend& backend, Stream& stream) {
  Trainer trainer;
  std::size_t buckets = 0;
  for (const auto& group : layout.groups()) buckets += group.bucket_count();
  trainer.checksums = DeviceBuffer(backend, buckets * sizeof(std::uint64_t));
  auto* sums = reinterpret_cast<std::uint64_t*>(trainer.checksums.data());
  std::size_t n = 0;
  for (const auto& group : layout.groups()) {
    DeviceBuffer& arena = trainer.arenas.emplace_back(backend, group.arena_bytes());
    // 0x3c3c: a finite bf16/fp16 value in every element, so the guard passes.
    BENCH_CUDA(cudaMemset(arena.data(), 0x3c, group.arena_bytes()));
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      const Bucket bucket = group.bucket(k);
      backend.checksum_async(arena.data() + bucket.offset, bucket.bytes, sums + n++, stream);
    }
    trainer.groups.push_back(group.name());
  }
  backend.stream_synchronize(stream);
  return trainer;
}

struct KernelFigures {
  double checksum_ms = 0;
  double guard_ms = 0;
  std::size_t guarded_bytes = 0;
};

KernelFigures time_kernels(const Layout& layout, const Trainer& trainer, CudaBackend& backend,
                           Stream& stream, int reps) {
  std::size_t buckets = 0;
  std::size_t tensors = 0;
  for (const auto& group : layout.groups()) {
    buckets += group.bucket_count();
    tensors += group.tensors().size();
  }
  DeviceBuffer results(backend, (buckets + tensors) * sizeof(std::uint64_t));
  auto* words = reinterpret_cast<std::uint64_t*>(results.data());
  const cudaStream_t native = CudaBackend::native(stream);
  KernelFigures f;
  const auto checksum_ms = bench::time_on_stream(native, kWarmup + reps, [&] {
    std::size_t n = 0;
    for (std::size_t g = 0; g < layout.groups().size(); ++g) {
      const GroupLayout& group = layout.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        const Bucket bucket = group.bucket(k);
        backend.checksum_async(trainer.arenas[g].data() + bucket.offset, bucket.bytes,
                               words + n++, stream);
      }
    }
  });
  const auto guard_ms = bench::time_on_stream(native, kWarmup + reps, [&] {
    std::size_t n = 0;
    f.guarded_bytes = 0;
    for (std::size_t g = 0; g < layout.groups().size(); ++g) {
      for (const TensorPlacement& tensor : layout.groups()[g].tensors()) {
        if (!dtype_has_nonfinite_check(tensor.spec.dtype)) continue;
        backend.count_nonfinite_async(trainer.arenas[g].data() + tensor.offset,
                                      tensor.bytes / dtype_size(tensor.spec.dtype),
                                      tensor.spec.dtype, words + buckets + n++, stream);
        f.guarded_bytes += tensor.bytes;
      }
    }
  });
  f.checksum_ms = bench::summarize({checksum_ms.begin() + kWarmup, checksum_ms.end()}).median;
  f.guard_ms = bench::summarize({guard_ms.begin() + kWarmup, guard_ms.end()}).median;
  return f;
}

// Median UpdateReport::transfer (ms) of `updates` received updates with `checks` on.
double receive_ms(const Layout& layout, const Trainer& trainer, CudaBackend& backend,
                  const Checks& checks, int updates) {
  auto owned = std::make_unique<testing::DeviceCopyTransport>();
  testing::DeviceCopyTransport& transport = *owned;
  ReceiverConfig config;
  config.root_rank = 0;
  config.require_checksums = checks.checksums;
  config.reject_nonfinite = checks.guard;
  Receiver receiver(layout, backend, std::move(owned), config);

  std::mutex mutex;
  std::condition_variable changed;
  std::optional<UpdateReport> last;
  receiver.set_observer([&](const UpdateReport& report) {
    std::lock_guard lock(mutex);
    last = report;
    changed.notify_all();
  });
  std::unique_ptr<Stream> engine = backend.create_stream(StreamPriority::kNormal);
  std::vector<double> ms;
  for (int i = 0; i < kWarmup + updates; ++i) {
    const std::uint64_t version = static_cast<std::uint64_t>(i) + 1;
    for (std::size_t g = 0; g < layout.groups().size(); ++g) {
      const GroupLayout& group = layout.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        transport.queue(trainer.arenas[g].data() + group.bucket(k).offset);
      }
    }
    if (checks.checksums) transport.queue(trainer.checksums.data());
    receiver.begin_update(make_update_header(layout, version, trainer.groups, checks.checksums));
    UpdateReport report;
    {
      std::unique_lock lock(mutex);
      if (!changed.wait_for(lock, bench::kWaitLimit,
                            [&] { return last.has_value() && last->version == version; })) {
        throw BenchError(cat("update ", version, " (checks: ", checks.name, ") got no report in ",
                             bench::kWaitLimit.count(), " s"));
      }
      report = *last;
    }
    if (report.outcome != UpdateOutcome::kReady) {
      throw BenchError(cat("update ", version, " (checks: ", checks.name, ") failed: ",
                           report.error));
    }
    // Swap at a step boundary, so the next update writes the other slot as in an engine.
    if (receiver.step_hook().before_step(*engine) != version) {
      throw BenchError(cat("update ", version, " was ready but not applied"));
    }
    backend.stream_synchronize(*engine);
    if (i >= kWarmup) ms.push_back(bench::to_ms(report.transfer));
  }
  return bench::summarize(ms).median;
}

bool parse_positive(const char* text, double& value) {
  char* end = nullptr;
  value = std::strtod(text, &end);
  return end != text && *end == '\0' && value > 0;
}

}  // namespace

int main(int argc, char** argv) {
  int updates = 10;
  double link_gbps = 0;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    double value = 0;
    if ((arg == "--updates" || arg == "--link-gbps") &&
        (i + 1 >= argc || !parse_positive(argv[i + 1], value))) {
      std::fprintf(stderr, "bench_integrity_one_gpu: %s needs a positive number, got '%s'\n",
                   arg.c_str(), i + 1 < argc ? argv[i + 1] : "");
      return 2;
    }
    if (arg == "--updates") {
      updates = static_cast<int>(value);
      ++i;
    } else if (arg == "--link-gbps") {
      link_gbps = value;
      ++i;
    } else if (arg == "--models" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "bench_integrity_one_gpu: bad argument '%s'\nusage: bench_integrity_one_gpu "
                   "[--updates N>0] [--models a,b] [--link-gbps G>0]\n",
                   arg.c_str());
      return 2;
    }
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIP: bench_integrity_one_gpu needs a GPU\n");
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device 0: %s; %d measured repetitions/updates per row after %d warm-up\n",
                prop.name, updates, kWarmup);
    std::printf("| model | bytes | kernel | alone ms | GB/s |\n| --- | --- | --- | --- | --- |\n");
    std::vector<std::string> receive_rows;
    for (const auto& model : bench::known_models()) {
      if (!only.empty() && ("," + only + ",").find("," + model.name + ",") == std::string::npos) {
        continue;
      }
      const Layout layout = bench::model_layout(model, 1, kDefaultBucketBytes);
      std::size_t bytes = 0;
      for (const auto& group : layout.groups()) bytes += group.arena_bytes();
      CudaBackend backend(0);
      std::unique_ptr<Stream> stream = backend.create_stream(StreamPriority::kLow);
      const Trainer trainer = make_trainer(layout, backend, *stream);
      const KernelFigures k = time_kernels(layout, trainer, backend, *stream, updates);
      std::printf("| %s | %.2f GB | checksum, every bucket | %.3f | %.0f |\n", model.name.c_str(),
                  static_cast<double>(bytes) / 1e9, k.checksum_ms,
                  bench::gb_per_s(static_cast<double>(bytes), k.checksum_ms / 1e3));
      std::printf("| %s | %.2f GB | non-finite count, every floating tensor | %.3f | %.0f |\n",
                  model.name.c_str(), static_cast<double>(k.guarded_bytes) / 1e9, k.guard_ms,
                  bench::gb_per_s(static_cast<double>(k.guarded_bytes), k.guard_ms / 1e3));
      std::fflush(stdout);

      const double link_ms = link_gbps > 0 ? static_cast<double>(bytes) / (link_gbps * 1e9) * 1e3 : 0;
      double plain = 0;
      for (const Checks& checks : kCheckSets) {
        const double ms = receive_ms(layout, trainer, backend, checks, updates);
        if (!checks.checksums && !checks.guard) plain = ms;
        const double added = ms - plain;
        std::string row = bench::strf("| %s | %s | %.3f | %+.3f | %+.1f %%", model.name.c_str(),
                                      checks.name, ms, added, 100.0 * added / plain);
        if (link_ms > 0) {
          const double serial = (checks.checksums ? k.checksum_ms : 0) + (checks.guard ? k.guard_ms : 0);
          row += bench::strf(" | %.2f | %+.2f %% | %.1f %%", link_ms, 100.0 * added / link_ms,
                             100.0 * serial / link_ms);
        }
        receive_rows.push_back(row + " |");
        std::fprintf(stderr, "progress: %s checks=%s receive median %.3f ms\n", model.name.c_str(),
                     checks.name, ms);
      }
    }
    std::printf("\nreceive through a device copy (UpdateReport::transfer, median of %d):\n", updates);
    if (link_gbps > 0) {
      std::printf("| model | checks | ms | added ms | added / plain | transfer at %.1f GB/s ms | "
                  "added / that (projected) | kernels alone / that (if run after it) |\n"
                  "| --- | --- | --- | --- | --- | --- | --- | --- |\n",
                  link_gbps);
    } else {
      std::printf("| model | checks | ms | added ms | added / plain |\n| --- | --- | --- | --- | --- |\n");
    }
    for (const std::string& row : receive_rows) std::printf("%s\n", row.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_integrity_one_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
