// The update benchmark on two GPUs: the sender (trainer) on GPU 0 through Sender/NcclTransport,
// the receiver (engine) on GPU 1 through Receiver/NcclTransport, one process. What it measures
// and how: bench/README.md and docs/benchmarks.md; the scenarios: support/bench_scenarios.h.
//
//   bench_gpu [--out DIR] [--commit SHA] [--models ...] [--no-sweep] [--budget S] ...
//   bench_gpu --cpu ...      the CPU smoke mode (as bench_updates)
//
// This file holds only what is CUDA: the platform (backends, NCCL transports, an engine stream,
// event stamps, a plain device copy, cudaMemGetInfo) and three kernels (hold, decode, fill).
// Exit: 0 all phases ran, 1 a phase failed (results are still written), 2 bad arguments,
// 3 watchdog, 77 fewer than 2 GPUs.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "shadowsync/cuda_backend.h"
#include "shadowsync/nccl_transport.h"
#include "support/bench_cuda.h"
#include "support/bench_platform.h"
#include "support/bench_runner.h"

namespace {

using namespace shadowsync;
using namespace shadowsync::bench;

// Before a launch: drop a stale "last error" some other runtime user (NCCL probes, a NotReady
// query) left on this thread, so that the check after the launch sees the launch's own.
void clear_last_error() { (void)cudaGetLastError(); }
void check_launch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) throw BenchError(cat(what, " launch failed: ", cudaGetErrorString(status)));
}

// ---------------------------------------------------------------------------------------------
// Kernels.
// ---------------------------------------------------------------------------------------------
// Occupies its stream (one warp on one SM) for `ns` nanoseconds.
__global__ void hold_kernel(unsigned long long ns) {
  const unsigned long long start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(2000);
}

__device__ __forceinline__ float bf16_pair_sum(unsigned word) {
  return __uint_as_float(word << 16) + __uint_as_float(word & 0xffff0000u);
}
__device__ __forceinline__ float sum_bf16x8(uint4 v) {
  return (bf16_pair_sum(v.x) + bf16_pair_sum(v.y)) + (bf16_pair_sum(v.z) + bf16_pair_sum(v.w));
}

constexpr int kDecodeThreads = 512;
constexpr int kDecodeWordsPerThread = 16;  // 16-byte words: 128 KiB per block
constexpr int kDecodeUnroll = 8;           // 16-byte loads in flight per thread
constexpr std::size_t kDecodeBlockBytes = std::size_t{kDecodeThreads} * kDecodeWordsPerThread * 16;
static_assert(kDecodeWordsPerThread % kDecodeUnroll == 0);

// The fake decode step: memory-bound like a batch-1 decode's weight reads (a GEMV kernel: many
// short blocks, each streaming its own slice of the weights once). Block b sums the bf16 values of
// 16-byte words [b * W, (b + 1) * W) of `data` (W = kDecodeBlockBytes / 16): coalesced 16-byte
// loads, kDecodeUnroll in flight per thread; one partial per block, so nothing is optimized away.
// Many blocks (32768 for 4 GiB) let the block scheduler fit them around an NCCL kernel's CTAs as
// a real decode step's kernels would.
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const uint4* __restrict__ data,
                                                                std::size_t n,
                                                                float* __restrict__ partials) {
  const std::size_t base = static_cast<std::size_t>(blockIdx.x) * (kDecodeBlockBytes / 16) + threadIdx.x;
  float acc = 0.f;
#pragma unroll
  for (int batch = 0; batch < kDecodeWordsPerThread; batch += kDecodeUnroll) {
    uint4 v[kDecodeUnroll];
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) {
      const std::size_t i = base + static_cast<std::size_t>(batch + u) * kDecodeThreads;
      v[u] = i < n ? data[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kDecodeUnroll; ++u) acc += sum_bf16x8(v[u]);
  }

  __shared__ float warp_sums[kDecodeThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x < 32) {
    acc = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
  }
}

__device__ __forceinline__ unsigned long long mix(unsigned long long x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}
// Finite bf16 values (exponent field 0x3C: magnitudes 2^-7..2^-6) from a hash of the index.
__device__ __forceinline__ unsigned bf16_pair(unsigned long long h) {
  const unsigned lo = 0x3C00u | static_cast<unsigned>(h & 0x3FFu);
  const unsigned hi = 0x3C00u | static_cast<unsigned>((h >> 10) & 0x3FFu);
  return lo | (hi << 16);
}
__global__ void fill_kernel(uint4* data, std::size_t n, unsigned long long seed) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const unsigned long long a = mix(i * 2 + seed);
    const unsigned long long b = mix(i * 2 + 1 + seed);
    data[i] = make_uint4(bf16_pair(a), bf16_pair(a >> 20), bf16_pair(b), bf16_pair(b >> 20));
  }
}

// Hot, bounded wait on a CUDA event (cudaEventQuery + yield).
void wait_event(cudaEvent_t event, int device, const std::string& what) {
  BENCH_CUDA(cudaSetDevice(device));
  const auto deadline = Clock::now() + kWaitLimit;
  for (;;) {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) {
      throw BenchError(cat("waiting for ", what, ": ", cudaGetErrorString(status)));
    }
    (void)cudaGetLastError();  // NotReady may linger as the thread's last error
    if (Clock::now() > deadline) {
      throw BenchError(cat("timed out after ", kWaitLimit.count(), " s waiting for ", what));
    }
    std::this_thread::yield();
  }
}

class CudaStamp final : public Stamp {
 public:
  explicit CudaStamp(int device) : device_(device) {
    BENCH_CUDA(cudaSetDevice(device));
    BENCH_CUDA(cudaEventCreate(&event_));  // timing enabled
  }
  ~CudaStamp() override {
    (void)cudaSetDevice(device_);
    (void)cudaEventDestroy(event_);
  }
  CudaStamp(const CudaStamp&) = delete;
  CudaStamp& operator=(const CudaStamp&) = delete;

  void record(Stream& stream) override {
    BENCH_CUDA(cudaSetDevice(device_));
    BENCH_CUDA(cudaEventRecord(event_, CudaBackend::native(stream)));
  }
  void wait(const std::string& what) override { wait_event(event_, device_, what); }
  double ms_since(Stamp& earlier) override {
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, dynamic_cast<CudaStamp&>(earlier).event_, event_));
    return ms;
  }

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

class CudaPlatform final : public Platform {
 public:
  CudaPlatform() : backend0_(0), backend1_(1) {
    for (int d = 0; d < 2; ++d) {
      BENCH_CUDA(cudaGetDeviceProperties(&props_[d], d));
      BENCH_CUDA(cudaSetDevice(d));
      BENCH_CUDA(cudaStreamCreateWithFlags(&fill_streams_[d], cudaStreamNonBlocking));
      BENCH_CUDA(cudaEventCreateWithFlags(&fill_events_[d], cudaEventDisableTiming));
    }
    BENCH_CUDA(cudaSetDevice(1));
    BENCH_CUDA(cudaDeviceGetStreamPriorityRange(&priorities_.least, &priorities_.greatest));
    // One partial per block of any buffer the device can hold.
    partials_capacity_ = props_[1].totalGlobalMem / kDecodeBlockBytes + 1;
    BENCH_CUDA(cudaMalloc(&partials_, sizeof(float) * partials_capacity_));
  }
  ~CudaPlatform() override {
    for (cudaStream_t s : engine_streams_) {
      (void)cudaSetDevice(1);
      (void)cudaStreamSynchronize(s);
      (void)cudaStreamDestroy(s);
    }
    (void)cudaSetDevice(1);
    (void)cudaFree(partials_);
    for (int d = 0; d < 2; ++d) {
      (void)cudaSetDevice(d);
      (void)cudaEventDestroy(fill_events_[d]);
      (void)cudaStreamDestroy(fill_streams_[d]);
    }
  }
  CudaPlatform(const CudaPlatform&) = delete;
  CudaPlatform& operator=(const CudaPlatform&) = delete;

  bool is_gpu() const override { return true; }
  std::string machine() const override {
    return std::string(props_[0].name) == props_[1].name
               ? cat("2x ", props_[1].name)
               : cat(props_[0].name, " + ", props_[1].name);
  }
  Json machine_detail() const override {
    int driver = 0, runtime = 0;
    (void)cudaDriverGetVersion(&driver);
    (void)cudaRuntimeGetVersion(&runtime);
    Json devices = Json::array();
    for (int d = 0; d < 2; ++d) {
      devices.push(Json::object()
                       .set("index", d)
                       .set("name", props_[d].name)
                       .set("memory_bytes", props_[d].totalGlobalMem)
                       .set("sms", props_[d].multiProcessorCount)
                       .set("l2_bytes", props_[d].l2CacheSize)
                       .set("compute_capability", cat(props_[d].major, ".", props_[d].minor)));
    }
    Json env = Json::object();
    for (const char* name : {"NCCL_NVLS_ENABLE", "NCCL_CGA_CLUSTER_SIZE", "NCCL_MAX_CTAS", "NCCL_MIN_CTAS",
                             "NCCL_PROTO", "NCCL_ALGO", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS"}) {
      const char* value = std::getenv(name);
      env.set(name, value ? Json(value) : Json());
    }
    return Json::object()
        .set("backend", "cuda")
        .set("transport", "nccl")
        .set("devices", devices)
        .set("cuda_driver", driver)
        .set("cuda_runtime", runtime)
        .set("decode_block_bytes", kDecodeBlockBytes)
        .set("decode_threads_per_block", kDecodeThreads)
        .set("env", env);
  }
  Backend& backend(int rank) override { return rank == 0 ? static_cast<Backend&>(backend0_) : backend1_; }

  TransportPair make_transports(int max_ctas) override {
    NcclTransportConfig config;
    config.max_ctas = max_ctas;
    config.init_timeout = std::chrono::seconds(60);
    config.enqueue_timeout = std::chrono::seconds(30);
    config.finalize_timeout = std::chrono::seconds(10);
    const NcclUniqueId id = NcclTransport::generate_unique_id();
    // create() returns once every rank joined: one thread per rank.
    TransportPair pair;
    std::string error1;
    std::thread rank1([&] {
      try {
        pair.rank1 = NcclTransport::create(id, 1, 2, 1, config);
      } catch (const std::exception& e) {
        error1 = e.what();
      }
    });
    std::string error0;
    try {
      pair.rank0 = NcclTransport::create(id, 0, 2, 0, config);
    } catch (const std::exception& e) {
      error0 = e.what();
    }
    rank1.join();
    if (!error0.empty() || !error1.empty()) {
      destroy_pair(pair.rank0, pair.rank1);
      throw BenchError(cat("NcclTransport::create (max_ctas ", max_ctas, "): ", error0, error0.empty() ? "" : "; ", error1));
    }
    return pair;
  }

  std::unique_ptr<Stream> make_engine_stream(bool raised_priority) override {
    BENCH_CUDA(cudaSetDevice(1));
    cudaStream_t stream = nullptr;
    BENCH_CUDA(cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking,
                                            raised_priority ? priorities_.greatest : 0));
    engine_streams_.push_back(stream);  // destroyed with the platform; the wrapper does not own it
    return backend1_.wrap_stream(stream);
  }
  PriorityRange priority_range() const override { return priorities_; }

  std::unique_ptr<Stamp> make_stamp(int rank) override { return std::make_unique<CudaStamp>(rank); }

  void hold(Stream& stream, std::chrono::microseconds duration) override {
    BENCH_CUDA(cudaSetDevice(CudaBackend::device_of(stream)));
    clear_last_error();
    hold_kernel<<<1, 32, 0, CudaBackend::native(stream)>>>(
        static_cast<unsigned long long>(duration.count()) * 1000ull);
    check_launch("hold_kernel");
  }

  void decode(Stream& stream, const std::byte* data, std::size_t bytes) override {
    const std::size_t blocks = (bytes + kDecodeBlockBytes - 1) / kDecodeBlockBytes;
    if (blocks == 0 || blocks > partials_capacity_) {
      throw BenchError(cat("decode of ", bytes, " bytes: ", blocks, " blocks (capacity ", partials_capacity_, ")"));
    }
    BENCH_CUDA(cudaSetDevice(1));
    clear_last_error();
    decode_kernel<<<static_cast<unsigned>(blocks), kDecodeThreads, 0, CudaBackend::native(stream)>>>(
        reinterpret_cast<const uint4*>(data), bytes / 16, partials_);
    check_launch("decode_kernel");
  }

  void device_copy(Stream& stream, std::byte* dst, const std::byte* src, std::size_t bytes) override {
    BENCH_CUDA(cudaSetDevice(1));
    BENCH_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, CudaBackend::native(stream)));
  }

  void fill(int rank, std::byte* data, std::size_t bytes, std::uint64_t seed) override {
    BENCH_CUDA(cudaSetDevice(rank));
    const std::size_t words = bytes / 16;
    if (words > 0) {
      clear_last_error();
      fill_kernel<<<props_[rank].multiProcessorCount * 4, 512, 0, fill_streams_[rank]>>>(
          reinterpret_cast<uint4*>(data), words, seed);
      check_launch("fill_kernel");
    }
    if (bytes % 16 != 0) {
      BENCH_CUDA(cudaMemsetAsync(data + words * 16, 0x3C, bytes % 16, fill_streams_[rank]));
    }
    BENCH_CUDA(cudaEventRecord(fill_events_[rank], fill_streams_[rank]));
    wait_event(fill_events_[rank], rank, "the fill kernel");
  }

  std::optional<std::size_t> free_bytes(int rank) override {
    BENCH_CUDA(cudaSetDevice(rank));
    std::size_t free = 0, total = 0;
    BENCH_CUDA(cudaMemGetInfo(&free, &total));
    return free;
  }

 private:
  CudaBackend backend0_;
  CudaBackend backend1_;
  cudaDeviceProp props_[2] = {};
  cudaStream_t fill_streams_[2] = {};
  cudaEvent_t fill_events_[2] = {};
  PriorityRange priorities_;
  std::size_t partials_capacity_ = 0;
  float* partials_ = nullptr;
  std::vector<cudaStream_t> engine_streams_;
};

std::unique_ptr<Platform> make_cuda_platform() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess || count < 2) {
    std::printf("SKIP: bench_gpu needs 2 GPUs, found %d%s%s\n", status == cudaSuccess ? count : 0,
                status == cudaSuccess ? "" : "; cudaGetDeviceCount: ",
                status == cudaSuccess ? "" : cudaGetErrorString(status));
    return nullptr;
  }
  return std::make_unique<CudaPlatform>();
}

}  // namespace

int main(int argc, char** argv) {
  // NVLink multicast stays off in this process whatever the environment says (NcclTransport only
  // sets it when unset); set before any thread or NCCL call reads the environment.
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  if (nvls != nullptr && std::string(nvls) != "0") {
    std::fprintf(stderr, "bench_gpu: NCCL_NVLS_ENABLE=%s overridden to 0\n", nvls);
  }
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  return shadowsync::bench::bench_main(argc, argv, make_cuda_platform);
}
