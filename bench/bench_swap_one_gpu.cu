// The swap strategies' stall on ONE GPU, at the layouts of real models (bench/support/
// bench_models.h): rebind, copy_in and remap, next to a raw device-to-device copy of the same bytes.
// What bench_gpu measures for them needs two GPUs (an NCCL transfer first); the stall itself does
// not, so this program fills the shadow with tests/support/device_copy_transport.h instead.
//
// Per model and strategy: --swaps measured swaps (after 2 warm-up ones). Before each, the update is
// received and offered (StepHook::has_pending) and the engine stream is idle, as at a step
// boundary. Then, on the engine thread:
//   host µs    = wall time of before_step() (for remap: includes synchronizing the engine stream
//                and the unmap/map/set-access calls; for copy_in: enqueueing the copy);
//   stream ms  = CUDA-event time on the engine stream from just before to just after before_step
//                (for copy_in: the copy itself; rebind and remap enqueue only an event record).
// raw copy ms  = cudaMemcpyAsync of the same bytes between two plain cudaMalloc buffers, events.
// read ms      = after the swap, a kernel that reads every live byte once (what a decode step's
//                weight reads cost), timed with events on the engine stream: first right after the
//                swap, then once more. A swap that leaves work for the GPU beyond its own calls
//                (remap: the new mappings' page tables) shows as a first read slower than the next.
//
//   bench_swap_one_gpu [--swaps N] [--models name,name]      (default 10; every known model)
// Exit status: 0, 1 on an error, 77 without a GPU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <thread>
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
using Clock = std::chrono::steady_clock;

// Reads `bytes` (a multiple of 16) once, 16 bytes per load, and folds them into `sink` so that
// the loads are not optimized away.
__global__ void read_all(const uint4* data, std::size_t count, unsigned* sink) {
  unsigned fold = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    fold ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (fold == 0x9e3779b9u) atomicAdd(sink, 1u);  // almost never: only keeps the loads
}

constexpr int kWarmup = 2;

double raw_copy_ms(std::size_t bytes, int reps) {
  void* from = nullptr;
  void* to = nullptr;
  BENCH_CUDA(cudaMalloc(&from, bytes));
  BENCH_CUDA(cudaMalloc(&to, bytes));
  cudaStream_t stream = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const auto ms = bench::time_on_stream(stream, reps + kWarmup, [&] {
    BENCH_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  cudaStreamDestroy(stream);
  cudaFree(from);
  cudaFree(to);
  return bench::summarize({ms.begin() + kWarmup, ms.end()}).median;
}

struct StallFigures {
  double host_us_median = 0;
  double host_us_p99 = 0;
  double stream_ms_median = 0;
  double first_read_ms_median = 0;  // every live byte read once, right after the swap
  double next_read_ms_median = 0;   // the same read again
};

StallFigures measure(const Layout& layout, CudaBackend& backend, SwapStrategy strategy,
                     int swaps) {
  auto owned = std::make_unique<testing::DeviceCopyTransport>();
  testing::DeviceCopyTransport& transport = *owned;
  ReceiverConfig config;
  config.root_rank = 0;
  config.swap_strategy = strategy;
  config.engine_uses_cuda_graphs = strategy != SwapStrategy::kRebind;
  Receiver receiver(layout, backend, std::move(owned), config);
  StepHook& hook = receiver.step_hook();
  std::vector<DeviceBuffer> trainer;  // the bytes each update "receives" (contents irrelevant)
  std::vector<std::string> groups;
  for (const auto& group : layout.groups()) {
    trainer.emplace_back(backend, group.arena_bytes());
    groups.push_back(group.name());
  }
  std::unique_ptr<Stream> engine = backend.create_stream(StreamPriority::kNormal);
  const cudaStream_t engine_handle = CudaBackend::native(*engine);
  cudaEvent_t before = nullptr;
  cudaEvent_t after = nullptr;
  BENCH_CUDA(cudaEventCreate(&before));
  BENCH_CUDA(cudaEventCreate(&after));

  std::vector<double> host_us;
  std::vector<double> stream_ms;
  std::vector<double> first_read_ms;
  std::vector<double> next_read_ms;
  unsigned* sink = nullptr;
  BENCH_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
  int sms = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const auto read_live = [&] {
    return bench::time_on_stream(engine_handle, 1, [&] {
      for (std::size_t g = 0; g < layout.groups().size(); ++g) {
        const std::size_t bytes = layout.groups()[g].arena_bytes();
        read_all<<<sms * 4, 512, 0, engine_handle>>>(
            reinterpret_cast<const uint4*>(hook.live_arena(g)), bytes / sizeof(uint4), sink);
      }
      BENCH_CUDA(cudaGetLastError());
    })[0];
  };
  for (int i = 0; i < kWarmup + swaps; ++i) {
    const std::uint64_t version = static_cast<std::uint64_t>(i) + 1;
    for (std::size_t g = 0; g < layout.groups().size(); ++g) {
      const GroupLayout& group = layout.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        transport.queue(trainer[g].data() + group.bucket(k).offset);
      }
    }
    receiver.begin_update(make_update_header(layout, version, groups));
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    // The engine stream is idle (synchronized after the last swap), so the release events the
    // receiver waits on have passed; poll for the offer without touching the hook.
    while (!hook.has_pending()) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (Clock::now() > deadline) {
        throw Error(ErrorCode::kTimeout, "update " + std::to_string(version) + " never arrived");
      }
    }
    BENCH_CUDA(cudaStreamSynchronize(engine_handle));  // step boundary
    BENCH_CUDA(cudaEventRecord(before, engine_handle));
    const auto start = Clock::now();
    const auto applied = hook.before_step(*engine);
    const auto host = Clock::now() - start;
    BENCH_CUDA(cudaEventRecord(after, engine_handle));
    BENCH_CUDA(cudaEventSynchronize(after));
    if (applied != version) {
      throw Error(ErrorCode::kInternal, "update " + std::to_string(version) + " was not applied");
    }
    float elapsed = 0;
    BENCH_CUDA(cudaEventElapsedTime(&elapsed, before, after));
    const double first_read = read_live();
    const double next_read = read_live();
    if (i >= kWarmup) {
      host_us.push_back(std::chrono::duration<double, std::micro>(host).count());
      stream_ms.push_back(elapsed);
      first_read_ms.push_back(first_read);
      next_read_ms.push_back(next_read);
    }
  }
  cudaEventDestroy(before);
  cudaEventDestroy(after);
  cudaFree(sink);
  const bench::Summary host = bench::summarize(host_us);
  return {host.median, host.p99, bench::summarize(stream_ms).median,
          bench::summarize(first_read_ms).median, bench::summarize(next_read_ms).median};
}

}  // namespace

int main(int argc, char** argv) {
  int swaps = 10;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--swaps" && i + 1 < argc) {
      swaps = std::atoi(argv[++i]);
    } else if (arg == "--models" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: bench_swap_one_gpu [--swaps N] [--models a,b]\n");
      return 1;
    }
  }
  if (swaps < 1) {
    std::fprintf(stderr, "bench_swap_one_gpu: --swaps %d (at least 1)\n", swaps);
    return 1;
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("SKIP: bench_swap_one_gpu needs a GPU\n");
    return 77;
  }
  try {
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device 0: %s; %d measured swaps per row after %d warm-up\n", prop.name, swaps,
                kWarmup);
    std::printf("%s",
                bench::table_head({"model", "bytes", "tensors", "strategy", "host µs median / p99",
                                   "engine stream ms median", "raw device copy ms", "stream / raw",
                                   "read after the swap ms", "read again ms"})
                    .c_str());
    for (const auto& model : bench::models_named(only)) {
      const Layout layout = bench::model_layout(model, 1, kDefaultBucketBytes);
      std::size_t bytes = 0;
      std::size_t tensors = 0;
      for (const auto& group : layout.groups()) {
        bytes += group.arena_bytes();
        tensors += group.tensors().size();
      }
      const double raw = raw_copy_ms(bytes, swaps);
      CudaBackend backend(0);
      for (const SwapStrategy strategy :
           {SwapStrategy::kRebind, SwapStrategy::kCopyIn, SwapStrategy::kRemap}) {
        const StallFigures f = measure(layout, backend, strategy, swaps);
        std::printf("| %s | %.2f GB | %zu | %s | %.1f / %.1f | %.3f | %.3f | %.2f | %.3f | %.3f |\n",
                    model.name.c_str(), static_cast<double>(bytes) / 1e9, tensors,
                    std::string(swap_strategy_name(strategy)).c_str(), f.host_us_median,
                    f.host_us_p99, f.stream_ms_median, raw, f.stream_ms_median / raw,
                    f.first_read_ms_median, f.next_read_ms_median);
        std::fflush(stdout);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_swap_one_gpu: %s\n", e.what());
    return 1;
  }
  return 0;
}
