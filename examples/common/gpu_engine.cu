#include "gpu_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "weights.h"

namespace shadowsync::examples {
namespace {

// No fmt in this file: nvcc does not evaluate fmt's compile-time format checks.
using u64 = unsigned long long;  // CUDA's atomics take unsigned long long
constexpr std::size_t kMaxGroups = 8;  // groups travel in the kernel's parameters
constexpr unsigned kThreads = 256;

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

std::string hex(u64 value) {
  char text[19];
  std::snprintf(text, sizeof text, "%#018llx", value);
  return text;
}

struct TensorEntry {
  std::uint32_t group;
  std::uint32_t tensor;
  std::uint64_t offset;  // in the group's arena; layouts align tensors to 256 bytes
  std::uint64_t words;   // full 8-byte words
};

struct Counters {
  u64 steps_done;
  u64 torn_steps;
  unsigned int step_torn;      // the step running now read a wrong word
  unsigned int first_claimed;  // the first wrong word was recorded
  u64 first_step, first_group, first_tensor, first_word, first_expected, first_value;
};

struct StepParams {
  const unsigned char* arenas[kMaxGroups];
  u64 versions[kMaxGroups];
  const TensorEntry* tensors;
  Counters* counters;
  u64 step;
  int full;
};

__global__ void fill_kernel(unsigned char* dst, u64 bytes, std::size_t group, std::size_t tensor,
                            u64 version) {
  for (u64 word = blockIdx.x * u64{blockDim.x} + threadIdx.x; word * 8 < bytes;
       word += u64{gridDim.x} * blockDim.x) {
    const u64 value = weight_word(group, tensor, word, version);
    const u64 n = bytes - word * 8 < 8 ? bytes - word * 8 : 8;
    for (u64 i = 0; i < n; ++i) dst[word * 8 + i] = static_cast<unsigned char>(value >> (8 * i));
  }
}

// blockIdx.y: the tensor. A sampled step reads three words per tensor, a full one every word.
__global__ void read_step_kernel(StepParams p) {
  const TensorEntry e = p.tensors[blockIdx.y];
  if (e.words == 0) return;
  const u64 version = p.versions[e.group];
  const auto* words = reinterpret_cast<const u64*>(p.arenas[e.group] + e.offset);
  auto read = [&](u64 word) {
    const u64 value = words[word];
    const u64 expected = weight_word(e.group, e.tensor, word, version);
    if (value == expected) return;
    atomicExch(&p.counters->step_torn, 1u);
    if (atomicCAS(&p.counters->first_claimed, 0u, 1u) == 0u) {
      p.counters->first_step = p.step;
      p.counters->first_group = e.group;
      p.counters->first_tensor = e.tensor;
      p.counters->first_word = word;
      p.counters->first_expected = expected;
      p.counters->first_value = value;
    }
  };
  if (p.full) {
    for (u64 word = blockIdx.x * u64{blockDim.x} + threadIdx.x; word < e.words;
         word += u64{gridDim.x} * blockDim.x) {
      read(word);
    }
  } else if (blockIdx.x == 0 && threadIdx.x < 3) {
    read(threadIdx.x == 0 ? 0 : threadIdx.x == 1 ? e.words / 2 : e.words - 1);
  }
}

// One thread, after read_step_kernel on the same stream: closes the step's books.
__global__ void finish_step_kernel(Counters* counters) {
  ++counters->steps_done;
  if (counters->step_torn != 0) {
    ++counters->torn_steps;
    counters->step_torn = 0;
  }
}

}  // namespace

void fill_weights_async(CudaBackend& backend, Stream& stream, const Layout& layout,
                        std::size_t group, std::uint64_t version, std::byte* arena) {
  check_cuda(cudaSetDevice(backend.device()), "cudaSetDevice");
  const auto& tensors = layout.groups().at(group).tensors();
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const u64 words = (tensors[t].bytes + 7) / 8;
    if (words == 0) continue;
    const unsigned blocks =
        static_cast<unsigned>(std::min<u64>((words + kThreads - 1) / kThreads, 1024));
    fill_kernel<<<blocks, kThreads, 0, CudaBackend::native(stream)>>>(
        reinterpret_cast<unsigned char*>(arena + tensors[t].offset), tensors[t].bytes, group, t,
        version);
    check_cuda(cudaGetLastError(), "fill kernel launch");
  }
}

struct GpuEngine::Device {
  DeviceBuffer tensors;   // TensorEntry[tensor_count]
  DeviceBuffer counters;  // Counters, zero-filled by the backend
  unsigned tensor_count = 0;
  unsigned full_blocks = 1;  // blocks per tensor of a full read
};

GpuEngine::GpuEngine(CudaBackend& backend, Receiver& receiver, GpuEngineOptions options)
    : backend_(backend),
      receiver_(receiver),
      options_(options),
      stream_(backend.create_stream(StreamPriority::kNormal)),
      device_(std::make_unique<Device>()) {
  const Layout& layout = receiver.layout();
  if (layout.groups().size() > kMaxGroups) {
    throw std::runtime_error("GpuEngine: " + std::to_string(layout.groups().size()) +
                             " groups, at most " + std::to_string(kMaxGroups));
  }
  std::vector<TensorEntry> entries;
  u64 most_words = 1;
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    const auto& tensors = layout.groups()[g].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      entries.push_back({static_cast<std::uint32_t>(g), static_cast<std::uint32_t>(t),
                         tensors[t].offset, tensors[t].bytes / 8});
      most_words = std::max<u64>(most_words, tensors[t].bytes / 8);
    }
  }
  device_->tensor_count = static_cast<unsigned>(entries.size());
  // At least 16 words per thread of the largest tensor; a bounded grid.
  device_->full_blocks =
      static_cast<unsigned>(std::clamp<u64>(most_words / (16 * kThreads), 1, 64));
  device_->tensors =
      DeviceBuffer(backend, std::max<std::size_t>(entries.size(), 1) * sizeof(TensorEntry));
  device_->counters = DeviceBuffer(backend, sizeof(Counters));
  if (!entries.empty()) {
    backend.memcpy_async(device_->tensors.data(), entries.data(),
                         entries.size() * sizeof(TensorEntry), *stream_);
  }
  backend.stream_synchronize(*stream_);  // `entries` is read until here
  for (std::size_t i = 0; i < std::max<std::size_t>(options_.max_steps_in_flight, 1); ++i) {
    step_done_.push_back(backend.create_event());
  }
}

GpuEngine::~GpuEngine() {
  try {
    synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "GpuEngine: %s (while being destroyed)\n", e.what());
    (void)cudaSetDevice(backend_.device());
    (void)cudaStreamSynchronize(CudaBackend::native(*stream_));  // nothing may read freed memory
  }
}

void GpuEngine::wait(Event& event, const char* what) {
  if (!backend_.event_wait_for(event, options_.wait_timeout)) {
    throw std::runtime_error("GpuEngine (device " + std::to_string(backend_.device()) + "): " +
                             what + " not done within " +
                             std::to_string(options_.wait_timeout.count()) + " ms");
  }
}

std::optional<std::uint64_t> GpuEngine::step() {
  const std::optional<std::uint64_t> applied = receiver_.step_hook().before_step(*stream_);
  const std::uint64_t index = steps_enqueued_++;
  // Stay at most max_steps_in_flight steps ahead of the GPU.
  Event& slot = *step_done_[index % step_done_.size()];
  if (index >= step_done_.size()) wait(slot, "an earlier decode step");

  const StepHook& hook = receiver_.step_hook();
  StepParams params{};
  for (std::size_t g = 0; g < receiver_.layout().groups().size(); ++g) {
    params.arenas[g] = reinterpret_cast<const unsigned char*>(hook.live_arena(g));
    params.versions[g] = hook.live_content_version(g);
  }
  params.tensors = reinterpret_cast<const TensorEntry*>(device_->tensors.data());
  params.counters = reinterpret_cast<Counters*>(device_->counters.data());
  params.step = index;
  params.full = options_.full_read_every != 0 && index % options_.full_read_every == 0;
  if (device_->tensor_count > 0) {
    const dim3 grid(params.full ? device_->full_blocks : 1, device_->tensor_count);
    read_step_kernel<<<grid, kThreads, 0, CudaBackend::native(*stream_)>>>(params);
    check_cuda(cudaGetLastError(), "decode step kernel launch");
  }
  finish_step_kernel<<<1, 1, 0, CudaBackend::native(*stream_)>>>(params.counters);
  check_cuda(cudaGetLastError(), "decode step kernel launch");
  backend_.event_record(slot, *stream_);
  return applied;
}

void GpuEngine::synchronize() {
  Event& last = *step_done_[(steps_enqueued_ + step_done_.size() - 1) % step_done_.size()];
  Counters counters{};
  backend_.event_record(last, *stream_);
  wait(last, "the decode steps");
  backend_.memcpy_async(&counters, device_->counters.data(), sizeof counters, *stream_);
  backend_.event_record(last, *stream_);
  wait(last, "reading the engine's counters");
  steps_done_ = counters.steps_done;
  torn_steps_ = counters.torn_steps;
  if (counters.first_claimed != 0 && first_torn_.empty()) {
    first_torn_ = "step " + std::to_string(counters.first_step) + ": group " +
                  std::to_string(counters.first_group) + " tensor " +
                  std::to_string(counters.first_tensor) + " word " +
                  std::to_string(counters.first_word) + " read " + hex(counters.first_value) +
                  ", the live version " + std::to_string(counters.first_expected >> 32) +
                  " wrote " + hex(counters.first_expected);
  }
}

}  // namespace shadowsync::examples
