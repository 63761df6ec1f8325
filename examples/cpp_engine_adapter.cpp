// The C++ engine adapter (CMake target shadowsync::engine_adapter, header
// shadowsync/engine_adapter.h) on a toy model. A C++ engine implements engine_adapter::Worker (its
// parameters by name, a load_weights-style rebind, one decode step), hands it to a
// WorkerExtension, and from then on steps through extension.execute_model(). Meanwhile a trainer
// thread publishes new weights: each update is received on the receiver's own thread and swapped
// in between two steps by rebinding the worker's parameters, without copying. Every step checks
// that it read one version of the whole model, never a mix. Host backend and loopback transport:
// no GPU needed.
//
//   build/examples/cpp_engine_adapter [--updates N]
//
// Exit status: 0 when the last update went live and no step read two versions, else 1.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shadowsync/engine_adapter.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/sender.h"
#include "weights.h"

using namespace shadowsync;

namespace {

// The model both sides agree on: one group ("base"), tensors in this order. Sizes are multiples
// of 8 bytes so that every tensor holds whole words of the examples' weight pattern (weights.h).
std::vector<TensorSpec> toy_model() {
  return {{"model.embed_tokens.weight", DType::kBFloat16, {512, 64}},
          {"model.layers.0.self_attn.qkv_proj.weight", DType::kBFloat16, {192, 64}},
          {"model.layers.0.mlp.down_proj.weight", DType::kBFloat16, {64, 172}},
          {"model.norm.weight", DType::kFloat32, {64}},
          {"lm_head.weight", DType::kBFloat16, {512, 64}}};
}

// The bucket size of the update: the trainer's layout and the adapter's must use the same one
// (it is part of the layout fingerprint). Small here so that an update takes several buckets.
constexpr std::size_t kBucketBytes = 16 << 10;

// A toy engine's model as the adapter sees it. Parameter i is tensor (0, i) of the layout: the
// weight pattern of weights.h lets a step tell from any word which version wrote it.
class ToyWorker final : public engine_adapter::Worker {
 public:
  ToyWorker(HostBackend& backend, const std::vector<TensorSpec>& model) : backend_(backend) {
    for (std::size_t t = 0; t < model.size(); ++t) {
      std::size_t bytes = dtype_size(model[t].dtype);
      for (std::int64_t d : model[t].shape) bytes *= static_cast<std::size_t>(d);
      bytes_.push_back(bytes);
      // The weights the engine loaded itself: version 1.
      storage_.emplace_back(bytes / 8);
      examples::fill_weights(storage_.back().data(), bytes, 0, t, 1);
      parameters_.push_back(
          {model[t].name, model[t].dtype, model[t].shape, storage_.back().data()});
    }
  }

  std::vector<engine_adapter::NamedParameter> named_parameters() override { return parameters_; }

  // The adapter calls this between two steps with every parameter it rebinds: the parameter now
  // reads from the live slot the update landed in. No bytes move here (vLLM: param.data = view).
  void load_weights(std::span<const engine_adapter::WeightBinding> weights) override {
    for (const engine_adapter::WeightBinding& w : weights) {
      for (engine_adapter::NamedParameter& p : parameters_) {
        if (p.name == w.name) p.data = w.data;
      }
    }
  }

  // One decode step, enqueued on the engine stream. What it reads is fixed when it is enqueued,
  // as a kernel's arguments are; it runs later, on the stream.
  void execute_model(Stream& stream) override {
    std::vector<const std::byte*> data;
    for (const engine_adapter::NamedParameter& p : parameters_) {
      data.push_back(static_cast<const std::byte*>(p.data));
    }
    backend_.launch_async(stream, [this, data] { read_weights(data); });
  }

  std::uint64_t steps() const { return steps_.load(); }
  std::uint64_t mixed_steps() const { return mixed_steps_.load(); }
  std::uint64_t last_version() const { return last_version_.load(); }

 private:
  // Every word of every tensor must be the pattern of the version the first word shows.
  void read_weights(const std::vector<const std::byte*>& data) {
    std::uint64_t first_word = 0;
    std::memcpy(&first_word, data[0], sizeof first_word);
    const std::uint64_t version = first_word >> 32;
    std::size_t wrong = 0;
    for (std::size_t t = 0; t < data.size(); ++t) {
      wrong += examples::count_wrong_words(data[t], bytes_[t], 0, t, version, /*sampled=*/false);
    }
    if (wrong != 0) ++mixed_steps_;
    last_version_.store(version);
    ++steps_;
  }

  HostBackend& backend_;
  std::vector<std::vector<std::uint64_t>> storage_;  // the engine's own weights, 8-byte aligned
  std::vector<std::size_t> bytes_;
  std::vector<engine_adapter::NamedParameter> parameters_;  // engine thread only
  std::atomic<std::uint64_t> steps_{0}, mixed_steps_{0}, last_version_{0};
};

int parse_updates(int argc, char** argv) {
  if (argc == 1) return 10;
  const int updates = argc == 3 && std::strcmp(argv[1], "--updates") == 0 ? std::atoi(argv[2]) : 0;
  if (updates <= 0) {
    throw std::runtime_error("usage: cpp_engine_adapter [--updates N] (N a positive number)");
  }
  return updates;
}

int run(int updates) {
  HostBackend backend;
  const Layout layout = Layout::build(toy_model(), {.bucket_bytes = kBucketBytes});
  // Rank 0 is the trainer, rank 1 the engine; here both are threads of this process. Across
  // processes and GPUs this is an NCCL communicator (shadowsync/nccl_transport.h).
  LoopbackCommunicator communicator(2);
  Sender sender(layout, backend, communicator.transport(0));

  // --- the engine side: the worker, its stream, and the adapter around them -------------------
  ToyWorker worker(backend, toy_model());
  std::unique_ptr<Stream> engine_stream = backend.create_stream(StreamPriority::kNormal);
  engine_adapter::WorkerExtension extension(worker, backend, *engine_stream);
  engine_adapter::WeightUpdateGroupOptions options;
  options.bucket_bytes = kBucketBytes;
  // adopt_current_weights (on by default): the worker's weights are copied into the live slots
  // and the worker rebound to them, so that the engine could free its own copy now.
  const std::uint64_t fingerprint =
      extension.init_weight_update_group(communicator.transport(1), options);
  if (fingerprint != layout.fingerprint()) {
    fmt::print(stderr, "layout fingerprint: engine {:#x}, trainer {:#x}; the models differ\n",
               fingerprint, layout.fingerprint());
    return 1;
  }

  // --- the trainer: versions 2 .. updates + 1, one after the other ------------------------------
  const std::uint64_t last = static_cast<std::uint64_t>(updates) + 1;
  std::exception_ptr trainer_error;  // reported after the join
  std::atomic<bool> trainer_failed{false};
  std::thread trainer([&] {
    try {
      for (std::uint64_t v = 2; v <= last; ++v) {
        examples::TrainerWeights weights(layout, {"base"}, v);  // "the optimizer step"
        PublishHandle handle = sender.publish(v, {"base"}, weights.sources());
        // The header goes to the engine's control thread; across processes it travels as bytes
        // (serialize_update_header) and begin_update(std::span<const std::byte>) takes those.
        extension.begin_update(handle.header());
        handle.wait();  // the weights must outlive their send
      }
    } catch (...) {
      trainer_error = std::current_exception();
      trainer_failed.store(true);
    }
  });

  // --- the engine loop: it never waits for an update ---------------------------------------------
  std::uint64_t swaps = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool timed_out = false;
  while (extension.receiver().step_hook().applied_version() < last && !trainer_failed.load()) {
    if (std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      break;
    }
    // The step hook, then the step: an update that finished arriving goes live here.
    if (std::optional<std::uint64_t> live = extension.execute_model()) {
      ++swaps;
      fmt::print("step {}: version {} live\n", worker.steps(), *live);
    }
    // An engine samples each step's tokens before it enqueues the next one.
    backend.stream_synchronize(*engine_stream);
  }
  trainer.join();
  if (trainer_error) std::rethrow_exception(trainer_error);
  extension.execute_model();  // one step on the last version
  backend.stream_synchronize(*engine_stream);

  // Latest wins: an update that arrives while an older one still waits for its swap replaces it,
  // so there may be fewer swaps than updates.
  const bool ok = !timed_out && worker.mixed_steps() == 0 && worker.last_version() == last;
  fmt::print("cpp_engine_adapter: updates={} swaps={} steps={} mixed_steps={} last_version={} {}\n",
             updates, swaps, worker.steps(), worker.mixed_steps(), worker.last_version(),
             ok ? "PASS" : (timed_out ? "FAIL (version not live within 60 s)" : "FAIL"));
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_updates(argc, argv));
  } catch (const std::exception& e) {
    fmt::print(stderr, "cpp_engine_adapter: {}\n", e.what());
    return 1;
  }
}
