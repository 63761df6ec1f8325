// The C++ engine adapter (engine_adapters/cpp, shadowsync::engine_adapter) on a fake vLLM-like
// worker, host backend and loopback transport: the step hook rebinds the worker's parameters to
// the live slots, they hold the new version's bytes after a swap (the pattern oracle of
// tests/support/pattern.h), no step reads two versions of a group, and the worker keeps stepping
// while an update streams in.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <atomic>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "deadline.h"
#include "fake_engine.h"
#include "pattern.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/sender.h"
#include "shadowsync/engine_adapter.h"

using namespace shadowsync;
using namespace shadowsync::testing;

namespace {

Layout model_layout() {
  return Layout::build({{"model.embed_tokens.weight", DType::kBFloat16, {300, 16}, "base"},
                        {"model.layers.0.mlp.weight", DType::kFloat32, {513}, "base"},
                        {"model.norm.weight", DType::kFloat16, {7}, "base"},
                        {"lm_head.weight", DType::kInt8, {1001}, "base"},
                        {"lora.q_proj.A", DType::kBFloat16, {8, 16}, "lora"},
                        {"lora.q_proj.B", DType::kBFloat16, {16, 8}, "lora"}},
                       {.bucket_bytes = 2048});
}

std::string group_of(std::string_view name) {
  return name.starts_with("lora.") ? "lora" : std::string(kBaseGroup);
}

// A vLLM-like worker: parameters by name, a load_weights-style rebind, an execute_model step that
// reads every word of every parameter on the engine stream and records the version it saw per
// group (kTornVersion when a group mixed versions).
class FakeVllmWorker final : public engine_adapter::Worker {
 public:
  FakeVllmWorker(HostBackend& backend, const Layout& layout, std::uint64_t version)
      : backend_(backend), layout_(layout) {
    std::vector<std::string> groups;
    for (const auto& g : layout.groups()) groups.push_back(g.name());
    initial_ = std::make_unique<HostTensors>(layout, groups, version);
    for (const SourceTensor& s : initial_->sources()) {
      bound_[s.name] = const_cast<void*>(s.data);
    }
  }

  std::vector<engine_adapter::NamedParameter> named_parameters() override {
    std::vector<engine_adapter::NamedParameter> out;
    for (const SourceTensor& s : initial_->sources()) {
      out.push_back({s.name, s.dtype, s.shape, bound_.at(s.name)});
    }
    return out;
  }

  void load_weights(std::span<const engine_adapter::WeightBinding> weights) override {
    for (const auto& w : weights) {
      auto it = bound_.find(std::string(w.name));
      REQUIRE(it != bound_.end());
      it->second = w.data;
    }
    ++load_calls_;
  }

  void execute_model(Stream& stream) override {
    // What the step reads is fixed when it is enqueued, as a kernel's arguments are.
    std::vector<std::pair<std::size_t, std::size_t>> where;
    std::vector<const std::byte*> data;
    for (std::size_t g = 0; g < layout_.groups().size(); ++g) {
      for (std::size_t t = 0; t < layout_.groups()[g].tensors().size(); ++t) {
        where.emplace_back(g, t);
        data.push_back(static_cast<const std::byte*>(bound_.at(layout_.groups()[g].tensors()[t].spec.name)));
      }
    }
    backend_.launch_async(stream, [this, where, data] {
      std::vector<std::uint64_t> seen(layout_.groups().size(), kGarbageVersion);
      for (std::size_t i = 0; i < where.size(); ++i) {
        const auto [g, t] = where[i];
        const std::size_t bytes = layout_.groups()[g].tensors()[t].bytes;
        const std::uint64_t first = read_version(data[i], bytes, g, t, 0, 0);
        for (std::size_t word = 0; word < (bytes + 7) / 8; ++word) {
          const std::uint64_t v = read_version(data[i], bytes, g, t, word, first);
          if (seen[g] == kGarbageVersion) seen[g] = v;
          if (v != seen[g]) seen[g] = kTornVersion;
        }
      }
      std::lock_guard lock(mutex_);
      steps_.push_back(std::move(seen));
    });
  }

  void* bound(const std::string& name) const { return bound_.at(name); }
  int load_calls() const { return load_calls_; }
  std::vector<std::vector<std::uint64_t>> steps() const {
    std::lock_guard lock(mutex_);
    return steps_;
  }

 private:
  HostBackend& backend_;
  const Layout& layout_;
  std::unique_ptr<HostTensors> initial_;
  std::map<std::string, void*> bound_;  // engine thread only
  int load_calls_ = 0;
  mutable std::mutex mutex_;
  std::vector<std::vector<std::uint64_t>> steps_;
};

// Every step saw one version per group, never going back; returns the last step's versions.
std::vector<std::uint64_t> check_steps(const std::vector<std::vector<std::uint64_t>>& steps) {
  REQUIRE(!steps.empty());
  std::vector<std::uint64_t> last = steps.front();
  for (std::size_t s = 0; s < steps.size(); ++s) {
    for (std::size_t g = 0; g < steps[s].size(); ++g) {
      INFO("step " << s << " group " << g);
      REQUIRE(steps[s][g] != kTornVersion);
      REQUIRE(steps[s][g] != kGarbageVersion);
      REQUIRE(steps[s][g] >= last[g]);
    }
    last = steps[s];
  }
  return last;
}

// The worker's parameters are the receiver's live slots.
void check_bound_to_live(const FakeVllmWorker& worker, Receiver& receiver) {
  const auto& groups = receiver.layout().groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::byte* arena = receiver.step_hook().live_arena(g);
    for (std::size_t t = 0; t < groups[g].tensors().size(); ++t) {
      const auto& placement = groups[g].tensors()[t];
      INFO(placement.spec.name);
      CHECK(worker.bound(placement.spec.name) == receiver.step_hook().live_tensor(g, t));
      CHECK(static_cast<std::byte*>(worker.bound(placement.spec.name)) >= arena);
      CHECK(static_cast<std::byte*>(worker.bound(placement.spec.name)) + placement.bytes <=
            arena + groups[g].arena_bytes());
    }
  }
}

// Trainer and engine on one loopback communicator; the engine side is the adapter.
struct Setup {
  explicit Setup(engine_adapter::WeightUpdateGroupOptions options = {}) : worker(backend, layout, 1) {
    engine_stream = backend.create_stream(StreamPriority::kNormal);
    sender = std::make_unique<Sender>(layout, backend, communicator.transport(0));
    extension = std::make_unique<engine_adapter::WorkerExtension>(worker, backend, *engine_stream);
    options.bucket_bytes = 2048;
    options.group_of = group_of;
    fingerprint = extension->init_weight_update_group(communicator.transport(1), options);
  }
  ~Setup() {
    extension.reset();  // the receiver first: the worker's parameters point into its slots
    sender.reset();
  }

  const Layout layout = model_layout();
  HostBackend backend;
  LoopbackCommunicator communicator{2};
  FakeVllmWorker worker;
  std::unique_ptr<Stream> engine_stream;
  std::unique_ptr<Sender> sender;
  std::unique_ptr<engine_adapter::WorkerExtension> extension;
  std::uint64_t fingerprint = 0;
};

}  // namespace

TEST_CASE("C++ engine adapter: init adopts the worker's weights into the live slots") {
  Setup setup;
  CHECK(setup.fingerprint == setup.layout.fingerprint());
  CHECK(setup.worker.load_calls() == 1);
  check_bound_to_live(setup.worker, setup.extension->receiver());
  for (int i = 0; i < 3; ++i) CHECK_FALSE(setup.extension->execute_model().has_value());
  setup.backend.stream_synchronize(*setup.engine_stream);
  const auto last = check_steps(setup.worker.steps());
  CHECK(last == std::vector<std::uint64_t>{1, 1});  // the worker's own weights, version 1
  CHECK_THROWS_WITH(setup.extension->init_weight_update_group(nullptr),
                    Catch::Contains("already initialized"));
}

TEST_CASE("C++ engine adapter: the worker keeps stepping while updates stream in; each swap rebinds it") {
  Setup setup;
  engine_adapter::WorkerExtension& extension = *setup.extension;
  StepHook& hook = extension.receiver().step_hook();

  // Update 2, streamed by the trainer in two halves: between them the update is certainly in
  // flight (the receiver posted its receives), and the worker must keep generating.
  StreamedPublish publish = setup.sender->publish_streamed(2, {"base", "lora"});
  extension.begin_update(serialize_update_header(publish.header()));  // bytes, as over RPC
  HostTensors v2(setup.layout, {"base", "lora"}, 2);
  std::vector<SourceTensor> ordered;
  for (const auto& [g, t] : publish.order()) {
    for (const SourceTensor& s : v2.sources()) {
      if (s.name == setup.layout.groups()[g].tensors()[t].spec.name) ordered.push_back(s);
    }
  }
  publish.supply({ordered.begin(), ordered.begin() + 3});
  const std::size_t steps_before = setup.worker.steps().size();
  int steps_during_transfer = 0;
  for (int i = 0; i < 5; ++i) {
    REQUIRE_FALSE(extension.execute_model().has_value());
    ++steps_during_transfer;
  }
  // The five steps RAN (on the engine stream) while the update's second half was not yet
  // supplied: a step held behind the receive would time out here.
  wait_until([&] { return setup.worker.steps().size() >= steps_before + 5; },
             "5 steps run while update 2 is in flight");
  publish.supply({ordered.begin() + 3, ordered.end()});
  publish.handle().wait();
  std::optional<std::uint64_t> applied;
  const auto deadline = deadline_from_now();
  while (!applied) {
    REQUIRE(std::chrono::steady_clock::now() < deadline);
    applied = extension.execute_model();
    if (!applied) ++steps_during_transfer;
    setup.backend.stream_synchronize(*setup.engine_stream);  // as an engine that samples does
  }
  CHECK(*applied == 2);
  CHECK(steps_during_transfer >= 5);
  check_bound_to_live(setup.worker, extension.receiver());

  // Update 3 carries the adapter only: the base parameters stay where they are.
  void* base_before = setup.worker.bound("model.norm.weight");
  void* lora_before = setup.worker.bound("lora.q_proj.A");
  HostTensors v3(setup.layout, {"lora"}, 3);
  PublishHandle handle3 = setup.sender->publish(3, {"lora"}, v3.sources());
  extension.begin_update(handle3.header());
  handle3.wait();
  REQUIRE(extension.wait_applied(3, deadline_from_now()));
  CHECK(setup.worker.bound("model.norm.weight") == base_before);
  CHECK(setup.worker.bound("lora.q_proj.A") != lora_before);
  check_bound_to_live(setup.worker, extension.receiver());
  extension.execute_model();

  // Updates 4..9 from a trainer thread, while the engine steps: latest wins, no torn step.
  std::exception_ptr trainer_error;  // reported after the join instead of terminating
  std::atomic<bool> trainer_failed{false};
  std::thread trainer([&] {
    try {
      for (std::uint64_t v = 4; v <= 9; ++v) {
        HostTensors tensors(setup.layout, {"base", "lora"}, v);
        PublishHandle handle = setup.sender->publish(v, {"base", "lora"}, tensors.sources());
        extension.begin_update(handle.header());
        handle.wait();  // the tensors must outlive the send
      }
    } catch (...) {
      trainer_error = std::current_exception();
      trainer_failed.store(true);
    }
  });
  const auto until = deadline_from_now();
  while (hook.applied_version() < 9 && !trainer_failed.load()) {
    REQUIRE(std::chrono::steady_clock::now() < until);
    extension.execute_model();
    // As a real engine does when it samples: without it this loop enqueues steps far faster than
    // the stream runs them, and a swap's release event sits behind millions of queued steps (the
    // receiver's bucket deadline then expires under a sanitizer).
    setup.backend.stream_synchronize(*setup.engine_stream);
  }
  trainer.join();
  if (trainer_error) std::rethrow_exception(trainer_error);
  extension.execute_model();
  setup.backend.stream_synchronize(*setup.engine_stream);
  check_bound_to_live(setup.worker, extension.receiver());
  const auto last = check_steps(setup.worker.steps());
  CHECK(last == std::vector<std::uint64_t>{9, 9});
  // Steps before the first swap read the adopted weights (1); some read 2 and 3.
  CHECK(setup.worker.steps().front() == std::vector<std::uint64_t>{1, 1});
}

TEST_CASE("C++ engine adapter: the trainer's specs must match the worker's parameters") {
  const Layout layout = model_layout();
  HostBackend backend;
  FakeVllmWorker worker(backend, layout, 1);
  auto stream = backend.create_stream(StreamPriority::kNormal);
  engine_adapter::WorkerExtension extension(worker, backend, *stream);
  CHECK_FALSE(extension.before_step().has_value());  // not initialized: nothing to do
  CHECK_THROWS_WITH(extension.begin_update(make_update_header(layout, 1, {"base"})),
                    Catch::Contains("call init_weight_update_group first"));

  engine_adapter::WeightUpdateGroupOptions options;
  options.specs = {{"model.norm.weight", DType::kBFloat16, {7}, "base"}};
  CHECK_THROWS_WITH(extension.init_weight_update_group(nullptr, options),
                    "tensor 'model.norm.weight': dtype bf16 of the trainer's layout does not "
                    "match the worker's fp16");
  options.specs = {{"model.norm.weight", DType::kFloat16, {8}, "base"}};
  CHECK_THROWS_WITH(extension.init_weight_update_group(nullptr, options),
                    "tensor 'model.norm.weight': shape [8] of the trainer's layout does not "
                    "match the worker's [7]");
  options.specs = {{"model.ghost", DType::kFloat16, {7}, "base"}};
  CHECK_THROWS_WITH(extension.init_weight_update_group(nullptr, options),
                    Catch::Contains("tensor 'model.ghost' of the trainer's layout is not a "
                                    "parameter of the worker"));
  CHECK_FALSE(extension.initialized());

  // A subset in the trainer's order: only those are rebound; the rest stay the worker's.
  void* embed = worker.bound("model.embed_tokens.weight");
  options.specs = {{"lm_head.weight", DType::kInt8, {1001}, "base"},
                   {"model.norm.weight", DType::kFloat16, {7}, "base"}};
  const std::uint64_t fingerprint = extension.init_weight_update_group(nullptr, options);
  CHECK(fingerprint == Layout::build(options.specs).fingerprint());
  CHECK(worker.bound("model.embed_tokens.weight") == embed);
  CHECK(worker.bound("lm_head.weight") == extension.receiver().step_hook().live_tensor(0, 0));
  // A corrupt header from the control plane is refused, named.
  const std::byte garbage[12] = {};
  CHECK_THROWS_WITH(extension.begin_update(std::span(garbage)), Catch::Contains("update header"));
}
