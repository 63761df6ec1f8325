#include "shadowsync/engine_adapter.h"

#include <fmt/format.h>

#include <unordered_map>

#include "shadowsync/error.h"

namespace shadowsync::engine_adapter {
namespace {

std::vector<TensorSpec> specs_from(const std::vector<NamedParameter>& parameters,
                                   const WeightUpdateGroupOptions& options) {
  if (options.specs.empty()) {
    std::vector<TensorSpec> specs;
    specs.reserve(parameters.size());
    for (const NamedParameter& p : parameters) {
      TensorSpec spec{p.name, p.dtype, p.shape, std::string(kBaseGroup)};
      if (options.group_of) spec.group = options.group_of(p.name);
      specs.push_back(std::move(spec));
    }
    return specs;
  }
  // The trainer's specs: each must be a parameter of this worker, exactly.
  std::unordered_map<std::string_view, const NamedParameter*> by_name;
  for (const NamedParameter& p : parameters) by_name.emplace(p.name, &p);
  for (const TensorSpec& spec : options.specs) {
    const auto it = by_name.find(spec.name);
    if (it == by_name.end()) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("tensor '{}' of the trainer's layout is not a parameter of the "
                              "worker ({} parameters)",
                              spec.name, parameters.size()));
    }
    const NamedParameter& p = *it->second;
    if (p.dtype != spec.dtype) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("tensor '{}': dtype {} of the trainer's layout does not match the "
                              "worker's {}",
                              spec.name, dtype_name(spec.dtype), dtype_name(p.dtype)));
    }
    if (p.shape != spec.shape) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("tensor '{}': shape {} of the trainer's layout does not match the "
                              "worker's {}",
                              spec.name, format_shape(spec.shape), format_shape(p.shape)));
    }
  }
  return options.specs;
}

}  // namespace

WorkerExtension::WorkerExtension(Worker& worker, Backend& backend, Stream& engine_stream)
    : worker_(worker), backend_(backend), engine_stream_(engine_stream) {}

WorkerExtension::~WorkerExtension() {
  if (receiver_) receiver_->shutdown();
}

std::uint64_t WorkerExtension::init_weight_update_group(std::unique_ptr<Transport> transport,
                                                        WeightUpdateGroupOptions options) {
  if (receiver_) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("init_weight_update_group: already initialized (layout {:#018x}); "
                            "use receiver().replace_transport for a new rendezvous",
                            receiver_->layout().fingerprint()));
  }
  const std::vector<NamedParameter> parameters = worker_.named_parameters();
  for (const NamedParameter& p : parameters) {
    if (p.data == nullptr) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("parameter '{}': data pointer is null", p.name));
    }
  }
  Layout layout =
      Layout::build(specs_from(parameters, options), LayoutOptions{options.bucket_bytes});
  auto receiver =
      std::make_unique<Receiver>(std::move(layout), backend_, std::move(transport), options.receiver);
  receiver->step_hook().set_swap_callback([this](const AppliedUpdate& update) { rebind(update); });
  receiver_ = std::move(receiver);
  if (options.adopt_current_weights) adopt(parameters);
  return receiver_->layout().fingerprint();
}

void WorkerExtension::adopt(const std::vector<NamedParameter>& parameters) {
  std::unordered_map<std::string_view, const NamedParameter*> by_name;
  for (const NamedParameter& p : parameters) by_name.emplace(p.name, &p);
  StepHook& hook = receiver_->step_hook();
  bindings_.clear();
  const auto& groups = receiver_->layout().groups();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (std::size_t t = 0; t < groups[g].tensors().size(); ++t) {
      const TensorPlacement& placement = groups[g].tensors()[t];
      void* live = hook.live_tensor(g, t);
      // Ordered on the engine stream: steps already enqueued still read the worker's storage,
      // later ones read the copy.
      backend_.memcpy_async(live, by_name.at(placement.spec.name)->data, placement.bytes,
                            engine_stream_);
      bindings_.push_back(WeightBinding{placement.spec.name, live});
    }
  }
  // The worker may free its own storage once load_weights returns: the copies must be done.
  backend_.stream_synchronize(engine_stream_);
  worker_.load_weights(bindings_);
}

void WorkerExtension::rebind(const AppliedUpdate& update) {
  StepHook& hook = receiver_->step_hook();
  const auto& groups = receiver_->layout().groups();
  bindings_.clear();
  for (const GroupSwap& swap : *update.swaps) {
    const auto& tensors = groups[swap.group].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      bindings_.push_back(WeightBinding{tensors[t].spec.name, hook.live_tensor(swap.group, t)});
    }
  }
  worker_.load_weights(bindings_);
}

void WorkerExtension::begin_update(const UpdateHeader& header) { receiver().begin_update(header); }

void WorkerExtension::begin_update(std::span<const std::byte> header_bytes) {
  receiver().begin_update(parse_update_header(header_bytes));
}

std::optional<std::uint64_t> WorkerExtension::before_step() {
  if (!receiver_) return std::nullopt;  // no update group yet: nothing can be pending
  return receiver_->step_hook().before_step(engine_stream_);
}

std::optional<std::uint64_t> WorkerExtension::execute_model() {
  const auto applied = before_step();
  worker_.execute_model(engine_stream_);
  return applied;
}

bool WorkerExtension::wait_applied(std::uint64_t version,
                                   std::chrono::steady_clock::time_point deadline) {
  return receiver().step_hook().wait_applied(version, deadline, engine_stream_);
}

Receiver& WorkerExtension::receiver() {
  if (!receiver_) {
    throw Error(ErrorCode::kInvalidArgument,
                "the weight update group is not initialized: call init_weight_update_group first");
  }
  return *receiver_;
}

const Layout& WorkerExtension::layout() const {
  if (!receiver_) {
    throw Error(ErrorCode::kInvalidArgument,
                "the weight update group is not initialized: call init_weight_update_group first");
  }
  return receiver_->layout();
}

}  // namespace shadowsync::engine_adapter
