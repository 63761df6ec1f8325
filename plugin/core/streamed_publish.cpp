#include "core/streamed_publish.h"

#include <fmt/format.h>

#include "core/check_source_tensor.h"

namespace shadowsync {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void StreamedPublish::State::finish(const std::optional<Error>& error) {
  {
    std::lock_guard lock(mutex);
    if (error && !failure) failure = error;
    finished = true;
  }
  cv.notify_all();
}

StreamedPublish::StreamedPublish(PublishHandle handle, std::shared_ptr<State> state)
    : handle_(std::move(handle)), state_(std::move(state)) {}
StreamedPublish::StreamedPublish(StreamedPublish&&) noexcept = default;
StreamedPublish& StreamedPublish::operator=(StreamedPublish&& other) noexcept {
  if (this != &other) {
    cancel();
    handle_ = std::move(other.handle_);
    state_ = std::move(other.state_);
  }
  return *this;
}
StreamedPublish::~StreamedPublish() { cancel(); }

const std::vector<std::pair<std::size_t, std::size_t>>& StreamedPublish::order() const {
  return state_->order;
}

std::size_t StreamedPublish::supplied() const {
  std::lock_guard lock(state_->mutex);
  return state_->supplied;
}

void StreamedPublish::cancel() noexcept {
  if (!state_) return;
  {
    std::lock_guard lock(state_->mutex);
    if (state_->supplied == state_->order.size()) return;
    state_->cancelled = true;
  }
  state_->cv.notify_all();
}

void StreamedPublish::supply(const std::vector<SourceTensor>& tensors) {
  State& st = *state_;
  std::unique_lock lock(st.mutex);
  if (st.failure) throw *st.failure;
  if (st.cancelled) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: supply after cancel()", st.version));
  }
  if (tensors.size() > st.order.size() - st.supplied) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: {} tensors supplied but only {} of {} remain",
                            st.version, tensors.size(), st.order.size() - st.supplied,
                            st.order.size()));
  }
  std::vector<const std::byte*> batch;
  batch.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto [g, t] = st.order[st.supplied + i];
    const GroupLayout& group = st.layout->groups()[g];
    const TensorSpec& spec = group.tensors()[t].spec;
    const SourceTensor& given = tensors[i];
    if (given.name != spec.name) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: tensor '{}' supplied where '{}' (tensor {} of {} of "
                              "group '{}') comes next",
                              st.version, given.name, spec.name, t + 1, group.tensors().size(),
                              group.name()));
    }
    check_source_tensor(given, spec);
    batch.push_back(static_cast<const std::byte*>(given.data));
  }
  if (batch.empty()) return;
  st.supplied += batch.size();
  st.queued.push_back(std::move(batch));
  const std::uint64_t seq = ++st.batches_pushed;
  st.cv.notify_all();
  st.cv.wait(lock, [&] { return st.batches_copied >= seq || st.failure || st.finished; });
  if (st.batches_copied >= seq) return;
  if (st.failure) throw *st.failure;
  throw Error(ErrorCode::kInternal,
              fmt::format("update {}: the sender finished without taking a supply", st.version));
}

void StreamedPublish::State::check(const StreamedWorkerContext& context, bool caller_side_too) {
  if (caller_side_too) {
    std::lock_guard lock(mutex);
    if (cancelled) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: cancelled after {} of {} tensors were supplied",
                              version, supplied, order.size()));
    }
  }
  if (context.stopping.load()) {
    throw Error(ErrorCode::kShutdown,
                fmt::format("update {}: the sender is shutting down", version));
  }
  if (auto transport_error = context.transport.async_error()) {
    throw Error(ErrorCode::kTransport,
                fmt::format("update {}: send failed: {}", version, *transport_error));
  }
  if (Clock::now() - context.start > context.update_deadline) {
    std::lock_guard lock(mutex);
    throw Error(ErrorCode::kTimeout,
                fmt::format("update {}: deadline of {} ms passed with {} of {} tensors supplied",
                            version, context.update_deadline.count(), supplied, order.size()));
  }
}

const std::byte* StreamedPublish::State::next_tensor(const StreamedWorkerContext& context) {
  if (batch_open && batch_position == batch.size()) complete_batch(context);
  while (!batch_open) {
    {
      std::unique_lock lock(mutex);
      cv.wait_for(lock, context.poll_interval, [&] { return !queued.empty() || cancelled; });
      if (!queued.empty()) {
        batch = std::move(queued.front());
        queued.pop_front();
        batch_position = 0;
        batch_open = true;
        break;
      }
    }
    check(context, /*caller_side_too=*/true);
  }
  return batch[batch_position++];
}

void StreamedPublish::State::complete_batch(const StreamedWorkerContext& context) {
  if (!batch_open) return;
  // Every copy out of the caller's tensors is enqueued: once they ran, the caller may free them.
  context.backend.event_record(context.copied, context.pack_stream);
  while (!context.backend.event_wait_for(context.copied, context.poll_interval)) {
    check(context, /*caller_side_too=*/false);
  }
  batch_open = false;
  batch.clear();
  {
    std::lock_guard lock(mutex);
    ++batches_copied;
  }
  cv.notify_all();
}

}  // namespace shadowsync
