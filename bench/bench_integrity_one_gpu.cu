// What the receiver's integrity checks cost, on ONE GPU, at the layouts of real models
// (bench/support/bench_models.h). bench_gpu measures the same behind a real NCCL transfer, which
// needs two GPUs; the checks themselves do not, so this program fills the shadow with
// tests/support/device_copy_transport.h instead, its copy paced to a link's rate.
//
// Per model:
//   kernels alone (idle GPU, CUDA events, --updates repetitions): the checksum of every bucket
//     and the non-finite count of every floating tensor, launched exactly as the receiver does
//     (CudaBackend::checksum_async / count_nonfinite_async): median ms and GB/s. This is what the
//     checks would add if they ran after the transfer instead of overlapping it.
//   receive: --updates updates (after 2 warm-up ones) with no check, with checksums (the header
//     announces them; the trainer's block is queued as the last "broadcast"), with the guard
//     (ReceiverConfig::reject_nonfinite), with both: UpdateReport::transfer (first bucket posted
//     to ready, checks included), median ms; "added" = median minus the plain median: the
//     fraction that decides the default (checksums on by default if under 5 % of the transfer).
//     And with the self-check (UpdateChecks::verify_matches_live, from the second update on, the
//     same bytes sent each time): its checksums of every tensor in the slot and of its live copy
//     run after the last bucket, so "added" is its whole cost.
//   The transfer: with --link-gbps G (default 368.5, NCCL's broadcast GPU0->GPU1 measured on
//     nvidia-h200-x2, docs/benchmarks.md) each bucket is copied by --link-ctas N blocks (default
//     16, about what NCCL runs) paced to G GB/s, so the checks overlap a transfer of a link's
//     length and compete with it for SMs and memory as they would with NCCL's kernels; with
//     --link-gbps 0, a plain cudaMemcpyAsync (HBM speed, far shorter than any link).
//
//   bench_integrity_one_gpu [--updates N] [--models name,name] [--link-gbps G] [--link-ctas N]
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
#include "support/bench_text.h"

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
  bool match_live = false;  // UpdateChecks::verify_matches_live (the self-check)
};
constexpr Checks kCheckSets[] = {
    {"none", false, false},
    {"checksums", true, false},
    {"guard", false, true},
    {"both", true, true},
    {"self-check", false, false, true},
};

struct Link {
  double gbps = 368.5;  // 0: unpaced cudaMemcpyAsync
  int ctas = 16;
};

constexpr int kCopyThreads = 1024;
constexpr int kCopyUnroll = 4;

// Copies `vectors` 16-byte vectors: each block its contiguous share, in chunks of kCopyThreads x
// kCopyUnroll vectors, the k-th chunk not before start + k * ns_per_chunk: a link of the rate the
// caller computed ns_per_chunk from, on gridDim.x SMs.
__global__ void paced_copy(uint4* dst, const uint4* src, std::size_t vectors, double ns_per_chunk) {
  const std::size_t share = (vectors + gridDim.x - 1) / gridDim.x;
  const std::size_t begin = blockIdx.x * share;
  const std::size_t end = begin + share < vectors ? begin + share : vectors;
  __shared__ unsigned long long start;
  if (threadIdx.x == 0) start = bench::global_timer_ns();
  __syncthreads();
  std::size_t chunk = 0;
  for (std::size_t base = begin; base < end; base += kCopyThreads * kCopyUnroll, ++chunk) {
    if (threadIdx.x == 0) {
      const auto due =
          start + static_cast<unsigned long long>(static_cast<double>(chunk) * ns_per_chunk);
      while (bench::global_timer_ns() < due) {
      }
    }
    __syncthreads();
    uint4 v[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const std::size_t i = base + u * kCopyThreads + threadIdx.x;
      if (i < end) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      const std::size_t i = base + u * kCopyThreads + threadIdx.x;
      if (i < end) dst[i] = v[u];
    }
  }
}

testing::DeviceCopyTransport::Copy paced(const Link& link) {
  if (link.gbps <= 0) return {};
  return [link](void* dst, const void* src, std::size_t bytes, cudaStream_t stream) {
    if (bytes % 16 != 0) {  // the small checksum block
      return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream);
    }
    const double chunk_bytes = 16.0 * kCopyThreads * kCopyUnroll;
    const double ns_per_chunk = chunk_bytes * link.ctas / link.gbps;  // GB/s = bytes per ns
    paced_copy<<<link.ctas, kCopyThreads, 0, stream>>>(static_cast<uint4*>(dst),
                                                       static_cast<const uint4*>(src), bytes / 16,
                                                       ns_per_chunk);
    return cudaGetLastError();
  };
}

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
    // On `stream`, before the checksums read it (the backend's streams do not wait for the
    // legacy default stream a plain cudaMemset runs on).
    BENCH_CUDA(cudaMemsetAsync(arena.data(), 0x3c, group.arena_bytes(), CudaBackend::native(stream)));
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
                  const Checks& checks, const Link& link, int updates) {
  auto owned = std::make_unique<testing::DeviceCopyTransport>(paced(link));
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
    // The self-check needs live weights equal to what is sent: from the second update on (the
    // trainer sends the same bytes every time), one more pass after the transfer.
    UpdateChecks asked;
    asked.verify_matches_live = checks.match_live && version > 1;
    receiver.begin_update(make_update_header(layout, version, trainer.groups, checks.checksums),
                          asked);
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

bool parse_number(const char* text, double& value) {
  char* end = nullptr;
  value = std::strtod(text, &end);
  return end != text && *end == '\0' && value >= 0;
}

}  // namespace

int main(int argc, char** argv) {
  int updates = 10;
  Link link;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    double value = 0;
    if (arg == "--models" && i + 1 < argc) {
      only = argv[++i];
      continue;
    }
    const bool numeric = arg == "--updates" || arg == "--link-gbps" || arg == "--link-ctas";
    if (!numeric) {
      std::fprintf(stderr,
                   "bench_integrity_one_gpu: unknown argument '%s'\nusage: bench_integrity_one_gpu "
                   "[--updates N] [--models a,b] [--link-gbps G] [--link-ctas N]\n",
                   arg.c_str());
      return 2;
    }
    const bool zero_ok = arg == "--link-gbps";
    if (i + 1 >= argc || !parse_number(argv[i + 1], value) || (value == 0 && !zero_ok)) {
      std::fprintf(stderr, "bench_integrity_one_gpu: %s needs a %s number, got '%s'\n",
                   arg.c_str(), zero_ok ? "non-negative" : "positive",
                   i + 1 < argc ? argv[i + 1] : "");
      return 2;
    }
    ++i;
    if (arg == "--updates") updates = static_cast<int>(value);
    if (arg == "--link-gbps") link.gbps = value;
    if (arg == "--link-ctas") link.ctas = static_cast<int>(value);
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
    if (link.gbps > 0) {
      std::printf("transfer: each bucket copied by %d blocks paced to %.1f GB/s (a link)\n",
                  link.ctas, link.gbps);
    } else {
      std::printf("transfer: cudaMemcpyAsync per bucket, unpaced (HBM speed)\n");
    }
    std::printf("%s", bench::table_head({"model", "bytes", "kernel", "alone ms", "GB/s"}).c_str());
    std::vector<std::string> receive_rows;
    for (const auto& model : bench::models_named(only)) {
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

      double plain = 0;
      for (const Checks& checks : kCheckSets) {
        const double ms = receive_ms(layout, trainer, backend, checks, link, updates);
        if (!checks.checksums && !checks.guard && !checks.match_live) plain = ms;
        const double added = ms - plain;
        const double serial =
            (checks.checksums ? k.checksum_ms : 0) + (checks.guard ? k.guard_ms : 0);
        receive_rows.push_back(bench::strf(
            "| %s | %s | %.3f | %.1f | %+.3f | %+.1f %% | %.1f %% |", model.name.c_str(),
            checks.name, ms, bench::gb_per_s(static_cast<double>(bytes), ms / 1e3), added,
            100.0 * added / plain, 100.0 * serial / plain));
        std::fprintf(stderr, "progress: %s checks=%s receive median %.3f ms\n",
                     model.name.c_str(), checks.name, ms);
      }
    }
    std::printf("\nreceive (UpdateReport::transfer, median of %d):\n", updates);
    std::printf("%s",
                bench::table_head({"model", "checks", "ms", "GB/s", "added ms", "added / plain",
                                   "kernels alone / plain (had they run after the transfer)"})
                    .c_str());
    for (const std::string& row : receive_rows) std::printf("%s\n", row.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_integrity_one_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
