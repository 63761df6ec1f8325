// The GPU fake engine and the fill kernel: see gpu_fake_engine.cuh.
//
// Decode kernel, one launch per step:
//   * work items are (a) samples: single words, spread over all threads of the grid, and (b) on
//     full steps, chunks of up to kChunkWords complete words of one tensor, one chunk per block
//     at a time (grid-stride over chunks), read as 16-byte loads, several in flight per thread;
//   * every word is decoded to the version it was written at; each thread keeps the min and max
//     version of the group it is working on, merges them into the block's shared min/max when the
//     group changes, and each block merges into the step's global min/max (one atomic pair per
//     group per block);
//   * the last block to finish (a ticket counter) turns min/max into the record: min == max is
//     the one version the group read, anything else is torn; it resets the scratch for the next
//     step, so a step needs no memset and no host work.
// Items are ordered by group (samples of group 0, then 1, ...; the same for chunks), so a thread
// changes groups only a few times per step.
#include "gpu_fake_engine.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace shadowsync::testing {
namespace {

using u64 = unsigned long long;  // what CUDA's 64-bit atomics take
static_assert(sizeof(u64) == sizeof(std::uint64_t));

constexpr int kThreads = 256;
constexpr unsigned kChunkWords = 4096;  // 32 KiB per chunk: 2048 16-byte loads, 8 per thread
constexpr int kUnroll = 4;              // 16-byte loads in flight per thread

#define GPU_ENGINE_CHECK(call)                                                             \
  do {                                                                                     \
    const cudaError_t gpu_engine_status = (call);                                          \
    if (gpu_engine_status != cudaSuccess) {                                                \
      throw std::runtime_error(std::string("gpu_fake_engine: ") + #call + " failed: " +    \
                               cudaGetErrorString(gpu_engine_status) + " (" __FILE__ ":" + \
                               std::to_string(__LINE__) + ")");                            \
    }                                                                                      \
  } while (0)

// One sampled word. `bytes` < 8 only for a tensor's partial tail word.
struct DeviceSample {
  u64 tensor_key;  // pattern_tensor_key(group, tensor)
  u64 offset;      // byte offset of the word in the group's arena
  u64 word;        // word index inside the tensor
  unsigned group;
  unsigned bytes;  // 1..8
};

// A run of complete words of one tensor. offset is 16-byte aligned (tensors start at 256-byte
// aligned arena offsets, arenas on 256-byte aligned allocations, chunks are kChunkWords long).
struct DeviceChunk {
  u64 tensor_key;
  u64 offset;      // byte offset of the chunk's first word in the group's arena
  u64 first_word;  // its word index inside the tensor
  unsigned group;
  unsigned words;  // 1..kChunkWords
};

struct DeviceScratch {
  u64 lo[kGpuEngineMaxGroups];  // min version read this step (~0: none yet)
  u64 hi[kGpuEngineMaxGroups];  // max version read this step
  u64 torn_steps;               // steps with a group that read anything but its expected version
  u64 steps_done;               // steps finished
  unsigned blocks_done;         // ticket counter of the step in flight
  unsigned padding;
};

// Record layout in the device ring, uint64 words: [0] step + 1, [1] applied version,
// [2] torn mask (bit g: group g read something else than expected[g]), [3] full check,
// then expected[G], seen[G], lo[G], hi[G].
constexpr std::size_t kRecordHeaderWords = 4;
std::size_t record_words_for(std::size_t groups) { return kRecordHeaderWords + 4 * groups; }

struct StepParams {
  const unsigned char* arena[kGpuEngineMaxGroups];
  u64 expected[kGpuEngineMaxGroups];
  const DeviceSample* samples;
  const DeviceChunk* chunks;
  DeviceScratch* scratch;
  u64* record;  // this step's slot of the ring
  u64 sample_count;
  u64 chunk_count;  // 0 on a sample-only step
  u64 step;
  u64 applied;
  unsigned groups;
  unsigned full;
};

__device__ __forceinline__ u64 decode_word(u64 value, u64 tensor_key, u64 word) {
  return value == 0 ? 0 : (pattern_key_from_tensor(tensor_key, word) ^ value);
}

__device__ __forceinline__ void account(u64 version, u64& lo, u64& hi) {
  lo = version < lo ? version : lo;
  hi = version > hi ? version : hi;
}

__global__ void __launch_bounds__(kThreads) decode_step_kernel(const StepParams p) {
  __shared__ u64 s_lo[kGpuEngineMaxGroups];
  __shared__ u64 s_hi[kGpuEngineMaxGroups];
  __shared__ u64 s_torn;
  __shared__ unsigned s_last;
  if (threadIdx.x < kGpuEngineMaxGroups) {
    s_lo[threadIdx.x] = ~0ull;
    s_hi[threadIdx.x] = 0;
  }
  __syncthreads();

  u64 lo = ~0ull;
  u64 hi = 0;
  int current = -1;  // the group lo/hi belong to
  auto switch_group = [&](int group) {
    if (group == current) return;
    if (current >= 0 && lo <= hi) {
      atomicMin(&s_lo[current], lo);
      atomicMax(&s_hi[current], hi);
    }
    lo = ~0ull;
    hi = 0;
    current = group;
  };

  // (a) Samples: spread over every thread of the grid.
  const u64 grid_threads = static_cast<u64>(gridDim.x) * blockDim.x;
  for (u64 i = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.sample_count;
       i += grid_threads) {
    const DeviceSample s = p.samples[i];
    switch_group(static_cast<int>(s.group));
    const unsigned char* at = p.arena[s.group] + s.offset;
    u64 version;
    if (s.bytes == 8) {
      version = decode_word(__ldcg(reinterpret_cast<const u64*>(at)), s.tensor_key, s.word);
    } else {
      // A partial tail word is too short to decode (and the bytes after it may lie past the
      // arena's end): it either matches the expected version's bytes or is garbage.
      u64 got = 0;
      for (unsigned b = 0; b < s.bytes; ++b) got |= static_cast<u64>(__ldcg(at + b)) << (8 * b);
      const u64 expected = p.expected[s.group];
      const u64 want = expected == 0 ? 0 : (pattern_key_from_tensor(s.tensor_key, s.word) ^ expected);
      const u64 mask = (1ull << (8 * s.bytes)) - 1;
      version = got == (want & mask) ? expected : static_cast<u64>(kGarbageVersion);
    }
    account(version, lo, hi);
  }

  // (b) Full check: every complete word of every tensor, one chunk per block at a time.
  for (u64 c = blockIdx.x; c < p.chunk_count; c += gridDim.x) {
    const DeviceChunk chunk = p.chunks[c];
    switch_group(static_cast<int>(chunk.group));
    const unsigned char* base = p.arena[chunk.group] + chunk.offset;
    const uint4* pairs_at = reinterpret_cast<const uint4*>(base);
    const unsigned pairs = chunk.words / 2;
    for (unsigned i = threadIdx.x; i < pairs; i += kUnroll * blockDim.x) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const unsigned j = i + k * blockDim.x;
        v[k] = j < pairs ? __ldcg(pairs_at + j) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const unsigned j = i + k * blockDim.x;
        if (j < pairs) {
          const u64 word = chunk.first_word + 2ull * j;
          const u64 a = static_cast<u64>(v[k].x) | (static_cast<u64>(v[k].y) << 32);
          const u64 b = static_cast<u64>(v[k].z) | (static_cast<u64>(v[k].w) << 32);
          account(decode_word(a, chunk.tensor_key, word), lo, hi);
          account(decode_word(b, chunk.tensor_key, word + 1), lo, hi);
        }
      }
    }
    if ((chunk.words & 1u) != 0 && threadIdx.x == 0) {
      const u64 last = chunk.words - 1;
      account(decode_word(__ldcg(reinterpret_cast<const u64*>(base) + last), chunk.tensor_key,
                          chunk.first_word + last),
              lo, hi);
    }
  }
  switch_group(-1);  // merges the last group into shared memory
  __syncthreads();

  // One atomic pair per group per block.
  if (threadIdx.x < p.groups && s_lo[threadIdx.x] <= s_hi[threadIdx.x]) {
    atomicMin(&p.scratch->lo[threadIdx.x], s_lo[threadIdx.x]);
    atomicMax(&p.scratch->hi[threadIdx.x], s_hi[threadIdx.x]);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(&p.scratch->blocks_done, 1u) == gridDim.x - 1 ? 1u : 0u;
    s_torn = 0;
  }
  __syncthreads();
  if (s_last == 0) return;

  // The last block: every other block's atomics are done. Read and reset the scratch (atomics:
  // coherent at L2), write the record.
  __threadfence();
  const unsigned G = p.groups;
  if (threadIdx.x < G) {
    const unsigned g = threadIdx.x;
    const u64 group_lo = atomicExch(&p.scratch->lo[g], ~0ull);
    const u64 group_hi = atomicExch(&p.scratch->hi[g], 0ull);
    u64 seen;
    if (group_lo > group_hi) {
      seen = kGarbageVersion;  // read nothing: cannot happen (every group has samples)
    } else if (group_lo == group_hi) {
      seen = group_lo;
    } else {
      seen = kTornVersion;
    }
    u64* record = p.record;
    record[kRecordHeaderWords + g] = p.expected[g];
    record[kRecordHeaderWords + G + g] = seen;
    record[kRecordHeaderWords + 2 * G + g] = group_lo;
    record[kRecordHeaderWords + 3 * G + g] = group_hi;
    if (seen != p.expected[g]) atomicOr(&s_torn, 1ull << g);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    p.record[0] = p.step + 1;
    p.record[1] = p.applied;
    p.record[2] = s_torn;
    p.record[3] = p.full;
    if (s_torn != 0) p.scratch->torn_steps += 1;
    p.scratch->steps_done += 1;
    p.scratch->blocks_done = 0;  // the next step on this stream starts after this kernel ends
  }
}

__global__ void __launch_bounds__(kThreads)
    fill_pattern_kernel(unsigned char* dst, u64 bytes, u64 tensor_key, u64 version) {
  const u64 words = bytes / 8;
  const u64 stride = static_cast<u64>(gridDim.x) * blockDim.x;
  const u64 tid = static_cast<u64>(blockIdx.x) * blockDim.x + threadIdx.x;
  auto word_value = [&](u64 w) -> u64 {
    return version == 0 ? 0 : (pattern_key_from_tensor(tensor_key, w) ^ version);
  };
  if ((reinterpret_cast<std::uintptr_t>(dst) & 15) == 0) {
    uint4* out = reinterpret_cast<uint4*>(dst);
    const u64 pairs = words / 2;
    for (u64 i = tid; i < pairs; i += stride) {
      const u64 a = word_value(2 * i);
      const u64 b = word_value(2 * i + 1);
      out[i] = make_uint4(static_cast<unsigned>(a), static_cast<unsigned>(a >> 32),
                          static_cast<unsigned>(b), static_cast<unsigned>(b >> 32));
    }
    if ((words & 1) != 0 && tid == 0) {
      reinterpret_cast<u64*>(dst)[words - 1] = word_value(words - 1);
    }
  } else {
    for (u64 w = tid; w < words; w += stride) {
      const u64 value = word_value(w);
      for (int b = 0; b < 8; ++b) dst[w * 8 + b] = static_cast<unsigned char>(value >> (8 * b));
    }
  }
  const u64 tail = bytes % 8;
  if (tail != 0 && tid == 0) {
    // The low-order bytes of the partial word, as fill_pattern's memcpy writes on the host.
    const u64 value = word_value(words);
    for (u64 b = 0; b < tail; ++b) dst[words * 8 + b] = static_cast<unsigned char>(value >> (8 * b));
  }
}

int multiprocessor_count(int device) {
  int count = 0;
  GPU_ENGINE_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return std::max(count, 1);
}

std::string join_versions(const std::vector<std::uint64_t>& versions) {
  std::ostringstream out;
  for (std::size_t i = 0; i < versions.size(); ++i) out << (i ? "," : "") << versions[i];
  return out.str();
}

std::string version_text(std::uint64_t version) {
  if (version == kTornVersion) return "torn";
  if (version == kGarbageVersion) return "garbage";
  return std::to_string(version);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Fill
// ---------------------------------------------------------------------------------------------

void fill_pattern_async(CudaBackend& backend, Stream& stream, void* dst, std::size_t bytes,
                        std::size_t group, std::size_t tensor, std::uint64_t version) {
  if (bytes == 0) return;
  GPU_ENGINE_CHECK(cudaSetDevice(backend.device()));
  const u64 items = std::max<u64>((bytes / 8 + 1) / 2, 1);
  const u64 max_blocks = static_cast<u64>(multiprocessor_count(backend.device())) * 8;
  const unsigned blocks =
      static_cast<unsigned>(std::min<u64>((items + kThreads - 1) / kThreads, max_blocks));
  fill_pattern_kernel<<<blocks, kThreads, 0, CudaBackend::native(stream)>>>(
      static_cast<unsigned char*>(dst), bytes, pattern_tensor_key(group, tensor), version);
  GPU_ENGINE_CHECK(cudaGetLastError());
}

void fill_group_async(CudaBackend& backend, Stream& stream, const Layout& layout,
                      std::size_t group, std::uint64_t version, std::byte* arena) {
  const auto& tensors = layout.groups().at(group).tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    fill_pattern_async(backend, stream, arena + tensors[t].offset, tensors[t].bytes, group, t,
                       version);
  }
}

// ---------------------------------------------------------------------------------------------
// GpuFakeEngine
// ---------------------------------------------------------------------------------------------

struct GpuFakeEngine::Tables {
  DeviceBuffer samples;
  DeviceBuffer chunks;
  DeviceBuffer scratch;
  DeviceBuffer records;
  u64* host_records = nullptr;         // pinned, record_capacity records
  DeviceScratch* host_scratch = nullptr;  // pinned

  ~Tables() {
    if (host_records != nullptr) (void)cudaFreeHost(host_records);
    if (host_scratch != nullptr) (void)cudaFreeHost(host_scratch);
  }
};

GpuFakeEngine::GpuFakeEngine(CudaBackend& backend, Receiver& receiver, GpuFakeEngineOptions options)
    : backend_(backend), receiver_(receiver), options_(options) {
  const Layout& layout = receiver.layout();
  groups_ = layout.groups().size();
  if (groups_ == 0 || groups_ > kGpuEngineMaxGroups) {
    throw std::runtime_error("GpuFakeEngine: the layout has " + std::to_string(groups_) +
                             " groups; supported: 1 to " + std::to_string(kGpuEngineMaxGroups));
  }
  if (options_.record_capacity == 0) options_.record_capacity = 1;
  record_words_ = record_words_for(groups_);

  GPU_ENGINE_CHECK(cudaSetDevice(backend.device()));
  stream_ = options_.wrap_external_stream ? backend.wrap_stream(options_.external_stream)
                                          : backend.create_stream(StreamPriority::kNormal);
  sync_event_ = backend.create_event();
  if (!options_.host_sync_each_step) {
    for (std::size_t i = 0; i < options_.max_steps_in_flight; ++i) {
      step_events_.push_back(backend.create_event());
    }
  }

  // The sample list (as HostFakeEngine's: first, middle, last word of every tensor, and the words
  // on both sides of every bucket boundary inside it) and the chunk list of the full check.
  std::vector<DeviceSample> samples;
  std::vector<DeviceChunk> chunks;
  for (std::size_t g = 0; g < groups_; ++g) {
    const GroupLayout& group = layout.groups()[g];
    for (std::size_t t = 0; t < group.tensors().size(); ++t) {
      const TensorPlacement& placement = group.tensors()[t];
      const u64 key = pattern_tensor_key(g, t);
      const std::size_t words = (placement.bytes + 7) / 8;
      auto add_sample = [&](std::size_t word) {
        const std::size_t bytes = std::min<std::size_t>(8, placement.bytes - word * 8);
        samples.push_back(DeviceSample{key, placement.offset + word * 8, word,
                                       static_cast<unsigned>(g), static_cast<unsigned>(bytes)});
      };
      add_sample(0);
      add_sample(words / 2);
      add_sample(words - 1);
      const std::size_t end = placement.offset + placement.bytes;
      for (std::size_t b = (placement.offset / group.bucket_bytes() + 1) * group.bucket_bytes();
           b < end; b += group.bucket_bytes()) {
        const std::size_t word = (b - placement.offset) / 8;
        add_sample(word);
        if (word > 0) add_sample(word - 1);
      }
      const std::size_t full_words = placement.bytes / 8;
      for (std::size_t first = 0; first < full_words; first += kChunkWords) {
        const std::size_t n = std::min<std::size_t>(kChunkWords, full_words - first);
        chunks.push_back(DeviceChunk{key, placement.offset + first * 8, first,
                                     static_cast<unsigned>(g), static_cast<unsigned>(n)});
      }
      full_bytes_ += placement.bytes;
    }
  }
  sample_count_ = samples.size();
  chunk_count_ = chunks.size();

  tables_ = std::make_unique<Tables>();
  tables_->samples = DeviceBuffer(backend, std::max<std::size_t>(samples.size(), 1) * sizeof(DeviceSample));
  tables_->chunks = DeviceBuffer(backend, std::max<std::size_t>(chunks.size(), 1) * sizeof(DeviceChunk));
  tables_->scratch = DeviceBuffer(backend, sizeof(DeviceScratch));
  tables_->records = DeviceBuffer(backend, options_.record_capacity * record_words_ * sizeof(u64));
  GPU_ENGINE_CHECK(cudaMallocHost(reinterpret_cast<void**>(&tables_->host_records),
                                  options_.record_capacity * record_words_ * sizeof(u64)));
  GPU_ENGINE_CHECK(
      cudaMallocHost(reinterpret_cast<void**>(&tables_->host_scratch), sizeof(DeviceScratch)));

  DeviceScratch initial{};
  for (std::size_t g = 0; g < kGpuEngineMaxGroups; ++g) {
    initial.lo[g] = ~0ull;
    initial.hi[g] = 0;
  }
  *tables_->host_scratch = initial;
  const cudaStream_t s = CudaBackend::native(*stream_);
  if (!samples.empty()) {
    GPU_ENGINE_CHECK(cudaMemcpyAsync(tables_->samples.data(), samples.data(),
                                     samples.size() * sizeof(DeviceSample), cudaMemcpyHostToDevice, s));
  }
  if (!chunks.empty()) {
    GPU_ENGINE_CHECK(cudaMemcpyAsync(tables_->chunks.data(), chunks.data(),
                                     chunks.size() * sizeof(DeviceChunk), cudaMemcpyHostToDevice, s));
  }
  GPU_ENGINE_CHECK(cudaMemcpyAsync(tables_->scratch.data(), tables_->host_scratch,
                                   sizeof(DeviceScratch), cudaMemcpyHostToDevice, s));
  backend.event_record(*sync_event_, *stream_);
  wait_event(*sync_event_, "uploading the sample and chunk tables");  // pageable sources: done

  const int sms = multiprocessor_count(backend.device());
  int per_sm = 0;
  GPU_ENGINE_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decode_step_kernel, kThreads, 0));
  per_sm = std::max(per_sm, 1);
  sample_grid_ = static_cast<int>(std::clamp<std::size_t>(
      (sample_count_ + kThreads - 1) / kThreads, 1, static_cast<std::size_t>(sms)));
  full_grid_ = static_cast<int>(std::clamp<std::size_t>(
      std::max(chunk_count_, static_cast<std::size_t>(sample_grid_)), 1,
      static_cast<std::size_t>(sms) * static_cast<std::size_t>(per_sm)));
}

GpuFakeEngine::~GpuFakeEngine() {
  try {
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "GpuFakeEngine: %s (while being destroyed)\n", e.what());
    // Nothing may still read the buffers when they are freed: wait without a bound now.
    (void)cudaSetDevice(backend_.device());
    (void)cudaStreamSynchronize(CudaBackend::native(*stream_));
  }
}

void GpuFakeEngine::wait_event(Event& event, const char* what) {
  // A hot wait (yield between polls), as an engine's cudaStreamSynchronize spins by default; but
  // bounded.
  const auto deadline = std::chrono::steady_clock::now() + options_.wait_timeout;
  while (!backend_.event_query(event)) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("GpuFakeEngine (device " + std::to_string(backend_.device()) +
                               "): " + what + " did not complete within " +
                               std::to_string(options_.wait_timeout.count()) + " ms");
    }
    std::this_thread::yield();
  }
}

std::optional<std::uint64_t> GpuFakeEngine::step() {
  GPU_ENGINE_CHECK(cudaSetDevice(backend_.device()));
  if (ring_used_ == options_.record_capacity) flush_ring();
  const std::uint64_t index = steps_enqueued_;
  if (!step_events_.empty() && index >= step_events_.size()) {
    // Run-ahead bound: step index - max_steps_in_flight must be done.
    wait_event(*step_events_[index % step_events_.size()], "an earlier step (run-ahead bound)");
  }

  StepHook& hook = receiver_.step_hook();
  const std::optional<std::uint64_t> applied = hook.before_step(*stream_);
  // The engine reads the live pointer table when it enqueues the step (rebind).
  StepParams params{};
  for (std::size_t g = 0; g < groups_; ++g) {
    params.arena[g] = reinterpret_cast<const unsigned char*>(hook.live_arena(g));
    params.expected[g] = hook.live_content_version(g);
  }
  const bool full =
      options_.full_check_every != 0 && index % options_.full_check_every == 0 && chunk_count_ > 0;
  params.samples = static_cast<const DeviceSample*>(static_cast<void*>(tables_->samples.data()));
  params.chunks = static_cast<const DeviceChunk*>(static_cast<void*>(tables_->chunks.data()));
  params.scratch = static_cast<DeviceScratch*>(static_cast<void*>(tables_->scratch.data()));
  params.record = static_cast<u64*>(static_cast<void*>(tables_->records.data())) +
                  ring_used_ * record_words_;
  params.sample_count = sample_count_;
  params.chunk_count = full ? chunk_count_ : 0;
  params.step = index;
  params.applied = hook.applied_version();
  params.groups = static_cast<unsigned>(groups_);
  params.full = full ? 1u : 0u;

  decode_step_kernel<<<full ? full_grid_ : sample_grid_, kThreads, 0,
                       CudaBackend::native(*stream_)>>>(params);
  GPU_ENGINE_CHECK(cudaGetLastError());
  ++steps_enqueued_;
  ++ring_used_;
  if (full) ++full_steps_enqueued_;

  if (!step_events_.empty()) {
    backend_.event_record(*step_events_[index % step_events_.size()], *stream_);
  }
  if (options_.host_sync_each_step) {
    backend_.event_record(*sync_event_, *stream_);
    wait_event(*sync_event_, "a decode step (host sync)");
  }
  return applied;
}

void GpuFakeEngine::synchronize() {
  GPU_ENGINE_CHECK(cudaSetDevice(backend_.device()));
  flush_ring();
}

void GpuFakeEngine::flush_ring() {
  const cudaStream_t s = CudaBackend::native(*stream_);
  if (ring_used_ > 0) {
    GPU_ENGINE_CHECK(cudaMemcpyAsync(tables_->host_records, tables_->records.data(),
                                     ring_used_ * record_words_ * sizeof(u64),
                                     cudaMemcpyDeviceToHost, s));
  }
  GPU_ENGINE_CHECK(cudaMemcpyAsync(tables_->host_scratch, tables_->scratch.data(),
                                   sizeof(DeviceScratch), cudaMemcpyDeviceToHost, s));
  backend_.event_record(*sync_event_, *stream_);
  wait_event(*sync_event_, "the enqueued decode steps");
  pull_records(ring_used_);
  ring_used_ = 0;
  steps_done_ = tables_->host_scratch->steps_done;
  torn_steps_ = tables_->host_scratch->torn_steps;
  if (steps_done_ != steps_enqueued_) {
    throw std::runtime_error("GpuFakeEngine: " + std::to_string(steps_enqueued_) +
                             " steps enqueued but the device counted " +
                             std::to_string(steps_done_) + " done");
  }
}

void GpuFakeEngine::pull_records(std::uint64_t count) {
  const Layout& layout = receiver_.layout();
  const std::uint64_t first_step = steps_enqueued_ - count;
  const std::size_t G = groups_;
  for (std::uint64_t i = 0; i < count; ++i) {
    const u64* r = tables_->host_records + i * record_words_;
    if (r[0] != first_step + i + 1) {
      throw std::runtime_error("GpuFakeEngine: record slot " + std::to_string(i) +
                               " holds step " + std::to_string(r[0]) + " - 1, want step " +
                               std::to_string(first_step + i) + " (a decode step did not run)");
    }
    StepRecord record;
    record.applied_version = r[1];
    record.seen.assign(r + kRecordHeaderWords + G, r + kRecordHeaderWords + 2 * G);
    const u64 torn_mask = r[2];
    if (torn_mask != 0) {
      ++torn_records_;
      if (first_torn_.empty()) {
        std::ostringstream why;
        why << "step " << (first_step + i) << (r[3] ? " (full check)" : " (sampled)")
            << " at applied version " << r[1] << ":";
        for (std::size_t g = 0; g < G; ++g) {
          if ((torn_mask >> g & 1) == 0) continue;
          why << " group " << layout.groups()[g].name() << " expected version "
              << r[kRecordHeaderWords + g] << ", read "
              << version_text(r[kRecordHeaderWords + G + g]) << " (versions "
              << version_text(r[kRecordHeaderWords + 2 * G + g]) << " to "
              << version_text(r[kRecordHeaderWords + 3 * G + g]) << ");";
        }
        why << " expected per group [" << join_versions(std::vector<std::uint64_t>(
                                                r + kRecordHeaderWords, r + kRecordHeaderWords + G))
            << "]";
        first_torn_ = why.str();
      }
    }
    if (options_.merge_repeated_records && !records_.empty() &&
        records_.back().applied_version == record.applied_version &&
        records_.back().seen == record.seen) {
      continue;
    }
    records_.push_back(std::move(record));
  }
}

}  // namespace shadowsync::testing
