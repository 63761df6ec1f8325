// bench_same_host_one_gpu's engine process: decode steps and the copy loop (see
// same_host_engine.h).
#include "same_host_engine.h"

#include <algorithm>
#include <exception>

#include "bench_cuda.h"
#include "same_host_device.h"
#include "same_host_report.h"

namespace shadowsync::bench::same_host {

Engine::Engine(const Options& o, CudaBackend& b) : options(o), backend(b) {
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

Engine::~Engine() {
  (void)cudaFree(partials);
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
}

double Engine::decode(const std::byte* data, std::size_t bytes) {
  const std::size_t blocks = (bytes + kDecodeBlockBytes - 1) / kDecodeBlockBytes;
  if (blocks == 0 || blocks > partials_capacity) {
    throw BenchError(
        cat("decode of ", bytes, " bytes: ", blocks, " blocks (room for ", partials_capacity, ")"));
  }
  BENCH_CUDA(cudaEventRecord(start, native));
  launch_decode(data, bytes, partials, native);
  BENCH_CUDA(cudaEventRecord(stop, native));
  BENCH_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
  return ms;
}

std::vector<double> Engine::decode_loop(StepHook& hook, std::size_t group, std::size_t bytes,
                                        int steps, std::optional<Clock::time_point> until) {
  std::vector<double> ms;
  for (int i = 0; until ? Clock::now() < *until : i < steps; ++i) {
    hook.before_step(*stream);
    ms.push_back(decode(hook.live_arena(group), bytes));
  }
  return ms;
}

void CopyLoop::run(int device, cudaStream_t stream, std::byte* src, std::byte* dst,
                   std::size_t bucket, std::size_t update_bytes, int sm_ctas,
                   const std::atomic<bool>& stop) {
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
          launch_sm_copy(to, from, n, sm_ctas, stream);
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

}  // namespace shadowsync::bench::same_host
