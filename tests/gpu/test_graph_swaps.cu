// CUDA-graph-safe swaps on one GPU: an engine captures its decode step ONCE as a CUDA
// graph over the live weights and replays it; 200 updates are swapped in with each of copy_in and
// remap. Every replay must read each group at exactly one version, the one the hook made live (no
// torn step); the live addresses the graph baked in never change; and after each swap the graph's
// output equals that of the same kernel run eagerly over the trainer's bytes of that version.
// rebind, declared under graphs, is refused.
//
// Remap with engine arenas (EngineArenas, receiver.h): the engine makes the remappable arenas and
// captures its graph over them BEFORE any receiver exists (vLLM captures at start-up); a receiver
// made later takes them; halfway it is destroyed and a second receiver takes the same arenas,
// whose live slot is then whichever the first left live. The same checks hold throughout.
//
// vLLM's live arena with a LoRA adapter: the engine's arena holds the base group only, and the
// adapters live in the engine's own buffers (vLLM's stacked LoRA slots), which each receiver is
// given with use_engine_storage. A swap remaps the base and copies the adapters on the engine
// stream; the graph, captured over both before any receiver, must see both at one version.
//
// The trainer is this test: it fills a device arena per group with the oracle's pattern and a
// small in-process transport copies bucket by bucket from it into the receiver's shadow, on the
// receiver's stream (NCCL needs two GPUs; what is tested here is the swap, not the transport).
// The graph is replayed right after before_step() with no host wait between them, so a copy_in
// copy that was not ordered before it on the engine stream shows up as a torn step.
//
// Skips (77) without a GPU. A watchdog ends the process if anything hangs.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "device_copy_transport.h"
#include "gpu_fake_engine.cuh"
#include "pattern_word.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/receiver.h"
#include "shadowsync/update_header.h"
#include "watchdog.h"

namespace {

using namespace shadowsync;
using namespace shadowsync::testing;
using namespace std::chrono_literals;

#define REQUIRE_CUDA(call) REQUIRE((call) == cudaSuccess)

constexpr int kDevice = 0;
constexpr int kSwaps = 200;

// One entry per tensor: where its words are and how to decode them.
struct TensorEntry {
  std::uint32_t group;
  std::uint32_t tensor;
  std::uint64_t offset;  // bytes into the group's arena
  std::uint64_t words;   // whole 8-byte words
};

struct Arenas {
  const std::uint64_t* group[kGpuEngineMaxGroups];
};

// Per group: [0] min version read, [1] max version read, [2] the "output": a wrapping sum of
// mix64 over every word (what a real decode step's logits are to its weights: a pure function).
__global__ void reset_results(std::uint64_t* results, std::size_t groups) {
  for (std::size_t g = 0; g < groups; ++g) {
    results[3 * g + 0] = ~std::uint64_t{0};
    results[3 * g + 1] = 0;
    results[3 * g + 2] = 0;
  }
}

// One block per tensor; every word of every tensor, every replay.
__global__ void decode_step(Arenas arenas, const TensorEntry* entries, std::uint64_t* results) {
  const TensorEntry e = entries[blockIdx.x];
  const std::uint64_t* words = arenas.group[e.group] + e.offset / 8;
  std::uint64_t lo = ~std::uint64_t{0};
  std::uint64_t hi = 0;
  std::uint64_t sum = 0;
  for (std::uint64_t w = threadIdx.x; w < e.words; w += blockDim.x) {
    const std::uint64_t value = words[w];
    const std::uint64_t version = decode_version(e.group, e.tensor, w, value);
    lo = version < lo ? version : lo;
    hi = version > hi ? version : hi;
    sum += mix64(value ^ w);
  }
  auto* r = reinterpret_cast<unsigned long long*>(results + 3 * e.group);
  atomicMin(&r[0], static_cast<unsigned long long>(lo));
  atomicMax(&r[1], static_cast<unsigned long long>(hi));
  atomicAdd(&r[2], static_cast<unsigned long long>(sum));
}

// Keeps the stream busy for about `cycles` clocks: the step before a gate is still running when
// the gate closes.
__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

Layout graph_layout() {
  // A few MiB over several dtypes, tensors spanning 256 KiB buckets, two adapters.
  return Layout::build({{"embed", DType::kBFloat16, {1024, 512}, "base"},
                        {"l0.w", DType::kFloat32, {300'001}, "base"},
                        {"l1.w", DType::kFloat16, {65'537}, "base"},
                        {"head", DType::kBFloat16, {512, 1000}, "base"},
                        {"a.A", DType::kBFloat16, {16, 4096}, "lora_a"},
                        {"a.B", DType::kBFloat16, {4096, 16}, "lora_a"},
                        {"b.A", DType::kFloat32, {8, 4096}, "lora_b"}},
                       {.bucket_bytes = 256 << 10});
}

struct Results {
  std::vector<std::uint64_t> lo, hi, out;
};

Results read_results(const std::uint64_t* device, std::size_t groups, cudaStream_t stream) {
  std::vector<std::uint64_t> host(3 * groups);
  REQUIRE_CUDA(cudaMemcpyAsync(host.data(), device, host.size() * 8, cudaMemcpyDeviceToHost,
                               stream));
  REQUIRE_CUDA(cudaStreamSynchronize(stream));
  Results r;
  for (std::size_t g = 0; g < groups; ++g) {
    r.lo.push_back(host[3 * g]);
    r.hi.push_back(host[3 * g + 1]);
    r.out.push_back(host[3 * g + 2]);
  }
  return r;
}

enum class ArenaOwner {
  kReceivers,          // each receiver makes its own arenas
  kEngine,             // the engine made every group's arena
  kEngineBaseStorage,  // the engine made the base group's arena; the adapters are its own buffers
};

// What the engine reads for group `g` now: its live arena, or its own storage (laid out as the
// group's arena here), located by its first tensor.
const std::uint64_t* live_words(const StepHook& hook, const Layout& layout, std::size_t g) {
  const std::byte* arena = hook.live_arena(g);
  if (arena == nullptr) {
    arena = static_cast<const std::byte*>(hook.live_tensor(g, 0)) -
            layout.groups()[g].tensors()[0].offset;
  }
  return reinterpret_cast<const std::uint64_t*>(arena);
}

// `gated` (remap): ReceiverConfig::gated_swaps. Each step is then a replay still in flight (its
// results copied aside) when before_step closes the gate, and the replay behind the gate before
// after_launch remaps: the one before must read the old versions, the one behind the new.
void run_graph_swaps(SwapStrategy strategy, ArenaOwner owner = ArenaOwner::kReceivers,
                     bool gated = false) {
  Watchdog watchdog(240s);
  const Layout layout = graph_layout();
  const std::size_t groups = layout.groups().size();
  CudaBackend backend(kDevice);
  if (strategy == SwapStrategy::kRemap) {
    // H100/H200 support VMM: a device here that does not is a finding, not a skip.
    const std::string why = backend.remap_unsupported_reason();
    INFO("remap unavailable: " << why);
    REQUIRE(why.empty());
  }
  ReceiverConfig config;
  config.root_rank = 0;
  config.swap_strategy = strategy;
  config.engine_uses_cuda_graphs = true;
  config.gated_swaps = gated;
  EngineArenas engine_arenas;
  std::vector<DeviceBuffer> adapter_storage(groups);  // kEngineBaseStorage: groups 1.. only
  if (owner == ArenaOwner::kEngine) {
    for (const auto& group : layout.groups()) {
      engine_arenas.push_back(backend.create_remappable_arena(group.arena_bytes()));
    }
  } else if (owner == ArenaOwner::kEngineBaseStorage) {
    engine_arenas.push_back(backend.create_remappable_arena(layout.groups()[0].arena_bytes()));
    for (std::size_t g = 1; g < groups; ++g) {
      adapter_storage[g] = DeviceBuffer(backend, layout.groups()[g].arena_bytes());
    }
  }
  DeviceCopyTransport* transport = nullptr;
  const auto make_receiver = [&] {
    auto transport_owned = std::make_unique<DeviceCopyTransport>();
    transport = transport_owned.get();
    auto made = std::make_unique<Receiver>(layout, backend, std::move(transport_owned), config,
                                           engine_arenas);
    for (std::size_t g = 1; g < groups && owner == ArenaOwner::kEngineBaseStorage; ++g) {
      std::vector<void*> tensors;
      for (const auto& t : layout.groups()[g].tensors()) {
        tensors.push_back(adapter_storage[g].data() + t.offset);
      }
      made->use_engine_storage(g, tensors);
    }
    return made;
  };
  // With engine arenas the graph is captured before the first receiver is made.
  std::unique_ptr<Receiver> receiver =
      owner == ArenaOwner::kReceivers ? make_receiver() : nullptr;

  std::vector<TensorEntry> entries;
  for (std::size_t g = 0; g < groups; ++g) {
    const auto& tensors = layout.groups()[g].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      entries.push_back({static_cast<std::uint32_t>(g), static_cast<std::uint32_t>(t),
                         tensors[t].offset, tensors[t].bytes / 8});
    }
  }
  DeviceBuffer entry_table(backend, entries.size() * sizeof(TensorEntry));
  DeviceBuffer graph_results(backend, 3 * groups * 8);
  DeviceBuffer eager_results(backend, 3 * groups * 8);
  DeviceBuffer before_gate_results(backend, 3 * groups * 8);
  std::vector<DeviceBuffer> trainer;
  for (std::size_t g = 0; g < groups; ++g) {
    trainer.emplace_back(backend, layout.groups()[g].arena_bytes());
  }
  REQUIRE_CUDA(cudaMemcpy(entry_table.data(), entries.data(), entries.size() * sizeof(TensorEntry),
                          cudaMemcpyHostToDevice));
  const auto* table = reinterpret_cast<const TensorEntry*>(entry_table.data());

  std::unique_ptr<Stream> engine = backend.create_stream(StreamPriority::kNormal);
  std::unique_ptr<Stream> trainer_stream = backend.create_stream(StreamPriority::kNormal);
  const cudaStream_t engine_handle = CudaBackend::native(*engine);
  const cudaStream_t trainer_handle = CudaBackend::native(*trainer_stream);

  // The decode step, captured once over the live addresses of this moment.
  Arenas live{};
  for (std::size_t g = 0; g < groups; ++g) {
    live.group[g] = reinterpret_cast<const std::uint64_t*>(
        receiver                 ? receiver->step_hook().live_arena(g)
        : g < engine_arenas.size() ? engine_arenas[g]->live_address()
                                   : adapter_storage[g].data());
  }
  auto* graph_out = reinterpret_cast<std::uint64_t*>(graph_results.data());
  cudaGraph_t graph = nullptr;
  REQUIRE_CUDA(cudaStreamBeginCapture(engine_handle, cudaStreamCaptureModeThreadLocal));
  reset_results<<<1, 1, 0, engine_handle>>>(graph_out, groups);
  decode_step<<<static_cast<unsigned>(entries.size()), 256, 0, engine_handle>>>(live, table,
                                                                                 graph_out);
  REQUIRE_CUDA(cudaStreamEndCapture(engine_handle, &graph));
  cudaGraphExec_t exec = nullptr;
  REQUIRE_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  if (!receiver) receiver = make_receiver();
  // The version each group's live bytes hold, carried over from one receiver to the next (a new
  // receiver's live_content_version starts at 0 over bytes an earlier one made live).
  std::vector<std::uint64_t> carried(groups, 0);

  std::vector<std::string> all_groups;
  for (const auto& g : layout.groups()) all_groups.push_back(g.name());
  std::uint64_t torn = 0;
  std::uint64_t replays = 0;
  std::string first_torn;
  for (std::uint64_t v = 1; v <= kSwaps; ++v) {
    if (owner != ArenaOwner::kReceivers && v == kSwaps / 2 + 2) {
      // Past halfway, after an odd number of swaps: a second receiver takes the arenas the
      // first one left with slot 1 live.
      for (std::size_t g = 0; g < groups; ++g) {
        carried[g] = receiver->step_hook().live_content_version(g);
      }
      REQUIRE(engine_arenas[0]->live_slot() == 1);  // the new receiver must start from slot 1
      receiver.reset();
      receiver = make_receiver();
      for (std::size_t g = 0; g < groups; ++g) {
        INFO("group " << g);
        REQUIRE(live_words(receiver->step_hook(), layout, g) == live.group[g]);
      }
    }
    StepHook& hook = receiver->step_hook();
    // The trainer's bytes of version v, and the eager reference over them.
    Arenas reference{};
    for (std::size_t g = 0; g < groups; ++g) {
      fill_group_async(backend, *trainer_stream, layout, g, v, trainer[g].data());
      reference.group[g] = reinterpret_cast<const std::uint64_t*>(trainer[g].data());
    }
    auto* eager_out = reinterpret_cast<std::uint64_t*>(eager_results.data());
    reset_results<<<1, 1, 0, trainer_handle>>>(eager_out, groups);
    decode_step<<<static_cast<unsigned>(entries.size()), 256, 0, trainer_handle>>>(
        reference, table, eager_out);
    const Results expected = read_results(eager_out, groups, trainer_handle);

    for (std::size_t g = 0; g < groups; ++g) {
      const GroupLayout& group = layout.groups()[g];
      for (std::size_t k = 0; k < group.bucket_count(); ++k) {
        transport->queue(trainer[g].data() + group.bucket(k).offset);
      }
    }
    receiver->begin_update(make_update_header(layout, v, all_groups));

    // Engine: step hook, then replay, with no host wait between them, until v is live.
    const auto deadline = std::chrono::steady_clock::now() + 60s;
    Results seen;
    for (;;) {
      std::vector<std::uint64_t> want_before(groups);
      auto* before_out = reinterpret_cast<std::uint64_t*>(before_gate_results.data());
      if (gated) {
        // The step before the gate: a replay, its results set aside, then ~0.2 ms more work.
        for (std::size_t g = 0; g < groups; ++g) {
          const std::uint64_t live_version = hook.live_content_version(g);
          want_before[g] = live_version != 0 ? live_version : carried[g];
        }
        REQUIRE_CUDA(cudaGraphLaunch(exec, engine_handle));
        REQUIRE_CUDA(cudaMemcpyAsync(before_out, graph_out, 3 * groups * 8,
                                     cudaMemcpyDeviceToDevice, engine_handle));
        spin<<<1, 1, 0, engine_handle>>>(400'000);
        ++replays;
      }
      hook.before_step(*engine);
      REQUIRE_CUDA(cudaGraphLaunch(exec, engine_handle));
      if (gated) hook.after_launch(*engine);
      ++replays;
      seen = read_results(graph_out, groups, engine_handle);
      if (gated) {
        const Results before = read_results(before_out, groups, engine_handle);
        for (std::size_t g = 0; g < groups; ++g) {
          if ((before.lo[g] != want_before[g] || before.hi[g] != want_before[g]) && torn++ == 0) {
            first_torn = "update " + std::to_string(v) + ", group " + std::to_string(g) +
                         ", the step before the gate: read versions " +
                         std::to_string(before.lo[g]) + ".." + std::to_string(before.hi[g]) +
                         ", live was " + std::to_string(want_before[g]);
          }
        }
      }
      for (std::size_t g = 0; g < groups; ++g) {
        const std::uint64_t live_version = hook.live_content_version(g);
        const std::uint64_t want = live_version != 0 ? live_version : carried[g];
        if (seen.lo[g] != want || seen.hi[g] != want) {
          if (torn++ == 0) {
            first_torn = "update " + std::to_string(v) + ", group " + std::to_string(g) +
                         ": read versions " + std::to_string(seen.lo[g]) + ".." +
                         std::to_string(seen.hi[g]) + ", live is " + std::to_string(want);
          }
        }
        // The addresses the graph baked in are still what the engine reads.
        REQUIRE(live_words(hook, layout, g) == live.group[g]);
      }
      if (hook.applied_version() >= v) break;
      REQUIRE(std::chrono::steady_clock::now() < deadline);
    }
    INFO("update " << v);
    REQUIRE(receiver->stats().updates_failed == 0);
    for (std::size_t g = 0; g < groups; ++g) {
      REQUIRE(seen.lo[g] == v);
      REQUIRE(seen.out[g] == expected.out[g]);  // equal to eager mode at the same version
    }
  }
  INFO(first_torn);
  CHECK(torn == 0);
  CHECK(receiver->step_hook().applied_version() == kSwaps);
  CHECK(receiver->step_hook().gates_abandoned() == 0);
  if (gated) CHECK(receiver->step_hook().gated_swaps() > 0);
  std::printf("%s%s%s: %d swaps (%llu behind a gate), %llu graph replays, %llu torn\n",
              std::string(swap_strategy_name(strategy)).c_str(), gated ? ", gated" : "",
              owner == ArenaOwner::kEngine              ? " (engine arenas, 2 receivers)"
              : owner == ArenaOwner::kEngineBaseStorage ? " (engine's base arena, adapters in "
                                                          "its storage, 2 receivers)"
                                                        : "",
              kSwaps, static_cast<unsigned long long>(receiver->step_hook().gated_swaps()),
              static_cast<unsigned long long>(replays), static_cast<unsigned long long>(torn));

  REQUIRE_CUDA(cudaStreamSynchronize(engine_handle));
  REQUIRE_CUDA(cudaGraphExecDestroy(exec));
  REQUIRE_CUDA(cudaGraphDestroy(graph));
  receiver->shutdown();
  watchdog.stop();
}

}  // namespace

TEST_CASE("graph swaps: copy_in, 200 swaps under a graph captured once") {
  run_graph_swaps(SwapStrategy::kCopyIn);
}

TEST_CASE("graph swaps: remap, 200 swaps under a graph captured once") {
  run_graph_swaps(SwapStrategy::kRemap);
}

TEST_CASE("graph swaps: gated remap, 200 swaps; the replay in flight when the gate closes reads "
          "the old versions, the replay behind it the new") {
  run_graph_swaps(SwapStrategy::kRemap, ArenaOwner::kReceivers, /*gated=*/true);
}

TEST_CASE("graph swaps: gated remap over engine arenas, two receivers in turn") {
  run_graph_swaps(SwapStrategy::kRemap, ArenaOwner::kEngine, /*gated=*/true);
}

TEST_CASE("graph swaps: remap over engine arenas captured before any receiver, two receivers "
          "in turn") {
  run_graph_swaps(SwapStrategy::kRemap, ArenaOwner::kEngine);
}

TEST_CASE("graph swaps: remap of the engine's base arena and copies into its adapter buffers at "
          "the same swaps (vLLM's live arena with LoRA), two receivers in turn") {
  run_graph_swaps(SwapStrategy::kRemap, ArenaOwner::kEngineBaseStorage);
}

TEST_CASE("graph swaps: rebind is refused when the engine declares CUDA graphs") {
  CudaBackend backend(kDevice);
  ReceiverConfig config;
  config.engine_uses_cuda_graphs = true;
  CHECK_THROWS_WITH(Receiver(graph_layout(), backend, nullptr, config),
                    Catch::Contains("swap_strategy is rebind") &&
                        Catch::Contains("engine_uses_cuda_graphs is true"));
}

TEST_CASE("graph swaps: gated remap, an engine thread that synchronizes its stream behind the "
          "gate is let go by the watchdog; the update goes live at the next step, ungated") {
  Watchdog watchdog(120s);
  const Layout layout = graph_layout();
  CudaBackend backend(kDevice);
  REQUIRE(backend.remap_unsupported_reason().empty());
  ReceiverConfig config;
  config.swap_strategy = SwapStrategy::kRemap;
  config.engine_uses_cuda_graphs = true;
  config.gated_swaps = true;
  config.gate_deadline = 20ms;
  auto transport_owned = std::make_unique<DeviceCopyTransport>();
  DeviceCopyTransport* transport = transport_owned.get();
  Receiver receiver(layout, backend, std::move(transport_owned), config);
  StepHook& hook = receiver.step_hook();
  std::unique_ptr<Stream> engine = backend.create_stream(StreamPriority::kNormal);
  const cudaStream_t engine_handle = CudaBackend::native(*engine);

  std::vector<DeviceBuffer> trainer;
  std::vector<std::string> all_groups;
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    const GroupLayout& group = layout.groups()[g];
    trainer.emplace_back(backend, group.arena_bytes());
    fill_group_async(backend, *engine, layout, g, 1, trainer[g].data());
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      transport->queue(trainer[g].data() + group.bucket(k).offset);
    }
    all_groups.push_back(group.name());
  }
  REQUIRE_CUDA(cudaStreamSynchronize(engine_handle));
  receiver.begin_update(make_update_header(layout, 1, all_groups));
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!hook.has_pending()) REQUIRE(std::chrono::steady_clock::now() < deadline);

  CHECK_FALSE(hook.before_step(*engine).has_value());  // the gate closes
  REQUIRE(hook.gated_swaps() == 1);
  spin<<<1, 1, 0, engine_handle>>>(100'000);  // behind the gate
  const auto waited_from = std::chrono::steady_clock::now();
  REQUIRE_CUDA(cudaStreamSynchronize(engine_handle));  // waits for the gate: the watchdog opens it
  const double waited_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - waited_from)
          .count();
  CHECK(hook.gates_abandoned() == 1);
  CHECK_FALSE(hook.after_launch(*engine).has_value());
  CHECK(hook.applied_version() == 0);
  CHECK(hook.before_step(*engine) == std::optional<std::uint64_t>(1));  // synchronously
  CHECK(hook.gated_swaps() == 1);
  REQUIRE_CUDA(cudaStreamSynchronize(engine_handle));
  std::printf("gated remap, engine thread synchronizing behind the gate: let go after %.1f ms "
              "(gate_deadline 20 ms), update applied at the next step\n",
              waited_ms);
  receiver.shutdown();
  watchdog.stop();
}
