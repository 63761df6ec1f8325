// The engine adapter for C++ engines (CMake target shadowsync::engine_adapter, installed with the
// package): gives a vLLM-like worker (named parameters, a load_weights-style binding, an
// execute_model step) the methods a trainer drives a weight update through:
// init_weight_update_group(), a non-blocking begin_update(header), and a step hook run before
// each execute_model() that rebinds the worker's parameters to the live slots when an update
// lands. The receive runs on the receiver's own thread; the engine thread only ever pays the step
// hook (one atomic load when nothing is pending).
//
// The Python WorkerExtension (engine_adapters/vllm/, shadowsync.vllm) is the same design over the
// C ABI, for vLLM's worker_extension_cls.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/layout.h"
#include "shadowsync/receiver.h"
#include "shadowsync/transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync::engine_adapter {

// One parameter of the worker's model.
struct NamedParameter {
  std::string name;
  DType dtype = DType::kBFloat16;
  std::vector<std::int64_t> shape;
  void* data = nullptr;  // contiguous memory of the adapter's backend
};

// The worker's parameter `name` is to read from `data` from now on (same dtype and shape).
struct WeightBinding {
  std::string_view name;
  void* data = nullptr;
};

// What the adapter needs from a vLLM-like worker.
class Worker {
 public:
  virtual ~Worker() = default;
  // The model's parameters with their current storage (vLLM: model.named_parameters()).
  virtual std::vector<NamedParameter> named_parameters() = 0;
  // load_weights-style binding, one call per swap with every rebound parameter: point each named
  // parameter at new storage of the same dtype and shape, without copying (vLLM in Python:
  // param.data = view). Engine thread only, between two steps.
  virtual void load_weights(std::span<const WeightBinding> weights) = 0;
  // One engine step, enqueued on `stream` (vLLM: execute_model). Engine thread only.
  virtual void execute_model(Stream& stream) = 0;
};

struct WeightUpdateGroupOptions {
  // The layout's bucket size: the trainer must use the same (it is part of the fingerprint).
  std::size_t bucket_bytes = kDefaultBucketBytes;
  // The specs the trainer announced (names, dtypes, shapes, groups, in its order). Each must be
  // a parameter of the worker with that dtype and shape; parameters not named stay as they are.
  // Empty: every parameter, in the worker's order, in the group group_of() names.
  std::vector<TensorSpec> specs;
  // Group of a parameter when `specs` is empty: "base" or a LoRA adapter's name. Unset: "base".
  std::function<std::string(std::string_view name)> group_of;
  // Copy the worker's current weights into the live slots and rebind the worker to them now, so
  // that the worker's own storage can be freed (two copies of the weights, not three) and a group
  // an update does not carry keeps the worker's weights. Off: the worker keeps its storage until
  // an update carries the group (the live slots then start zero-filled, unused).
  bool adopt_current_weights = true;
  ReceiverConfig receiver;
};

class WorkerExtension {
 public:
  // `engine_stream` is the stream execute_model() runs on, of `backend`. Both must outlive this.
  WorkerExtension(Worker& worker, Backend& backend, Stream& engine_stream);
  ~WorkerExtension();
  WorkerExtension(const WorkerExtension&) = delete;
  WorkerExtension& operator=(const WorkerExtension&) = delete;

  // Builds the layout from the worker's parameters (or checks the trainer's specs against them),
  // allocates both slots of every group, starts the receiver with `transport` (null until a
  // rendezvous; see receiver()), and with adopt_current_weights rebinds the worker to the live
  // slots. Returns the layout fingerprint, which the trainer compares with its own. Throws
  // Error(kInvalidArgument / kLayoutMismatch) naming the parameter and both values; Error(
  // kInvalidArgument) if called twice. Engine thread, before stepping.
  std::uint64_t init_weight_update_group(std::unique_ptr<Transport> transport,
                                         WeightUpdateGroupOptions options = {});

  // Announces an update: validates the header (throws Error naming the field and both values),
  // queues it and returns at once. Thread-safe (any control thread).
  void begin_update(const UpdateHeader& header);
  void begin_update(std::span<const std::byte> header_bytes);

  // The step hook, before each execute_model: with an update received, flips every group of it
  // live and rebinds the worker's parameters (Worker::load_weights). Returns the version made
  // live. Nothing pending: one atomic load. Engine thread only.
  std::optional<std::uint64_t> before_step();
  // before_step(), then the worker's execute_model(). Engine thread only.
  std::optional<std::uint64_t> execute_model();

  // For an idle engine: applies updates as they arrive until `version` is live. Engine thread.
  bool wait_applied(std::uint64_t version, std::chrono::steady_clock::time_point deadline);

  bool initialized() const { return receiver_ != nullptr; }
  // Errors if not initialized. Thread-safe where the Receiver call is.
  Receiver& receiver();
  const Layout& layout() const;

 private:
  void rebind(const AppliedUpdate& update);  // the swap callback (engine thread)
  void adopt(const std::vector<NamedParameter>& parameters);

  Worker& worker_;
  Backend& backend_;
  Stream& engine_stream_;
  std::unique_ptr<Receiver> receiver_;
  std::vector<WeightBinding> bindings_;  // reused by rebind(): no allocation per swap after warm-up
};

}  // namespace shadowsync::engine_adapter
