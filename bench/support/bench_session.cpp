// Probes, the trainer's weights and Session (see bench_session.h).
#include "bench_session.h"

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace shadowsync::bench {

Probe probe(Platform& p, int rank) {
  return {p.free_bytes(rank), p.backend(rank).bytes_allocated()};
}

MemoryFigure memory_between(const Probe& before, const Probe& after, double theoretical) {
  MemoryFigure m;
  if (before.free_device && after.free_device) {
    m.device_bytes = static_cast<double>(*before.free_device) - static_cast<double>(*after.free_device);
  }
  m.backend_bytes =
      static_cast<double>(after.backend_allocated) - static_cast<double>(before.backend_allocated);
  m.theoretical = theoretical;
  return m;
}

TrainerWeights::TrainerWeights(Platform& p, const Layout& layout)
    : arena(p.backend(0), layout.groups().at(0).arena_bytes()) {
  p.fill(0, arena.data(), arena.size(), 0x5eedu);
  for (const TensorPlacement& t : layout.groups()[0].tensors()) {
    sources.push_back(SourceTensor{t.spec.name, arena.data() + t.offset, t.spec.dtype, t.spec.shape});
  }
}

Session::Session(Platform& p, const Layout& layout, int max_ctas, Construction* trace,
                 const SessionConfig& config)
    : p_(p), bytes_(layout.total_bytes()), config_(config) {
  if (trace) trace->before_transports = probe(p, 1);
  TransportPair transports = p.make_transports(max_ctas);
  if (trace) trace->after_transports = probe(p, 1);
  SenderConfig sender_config;
  sender_config.update_deadline = std::chrono::milliseconds(kWaitLimit);
  sender_config.checksums = config.checksums;
  receiver_config_.update_deadline = std::chrono::milliseconds(kWaitLimit);
  receiver_config_.bucket_deadline = config.bucket_deadline;
  receiver_config_.require_checksums = config.checksums;
  receiver_config_.reject_nonfinite = config.reject_nonfinite;
  receiver_config_.swap_strategy = config.strategy;
  // copy_in and remap exist for engines that replay CUDA graphs; say so, as such an engine would.
  receiver_config_.engine_uses_cuda_graphs = config.strategy != SwapStrategy::kRebind;
  sender_transport_ = transports.rank0.get();
  sender_ = std::make_unique<Sender>(layout, p.backend(0), std::move(transports.rank0), sender_config);
  try {
    receiver_ = std::make_unique<Receiver>(layout, p.backend(1), std::move(transports.rank1),
                                           receiver_config_);
  } catch (...) {
    sender_.reset();
    throw;
  }
  if (trace) trace->after_receiver = probe(p, 1);

  for (const GroupLayout& group : layout.groups()) bound_.emplace_back(group.tensors().size());
  // What an engine adapter does under rebind: rebind each of its tensors to the new live
  // pointers. Under copy_in and remap the live addresses never move, so there is nothing to
  // rebind and the swap costs only what the strategy itself does.
  if (config.strategy == SwapStrategy::kRebind) {
    receiver_->step_hook().set_swap_callback([this](const AppliedUpdate& update) {
      StepHook& hook = receiver_->step_hook();
      for (const GroupSwap& swap : *update.swaps) {
        std::vector<void*>& tensors = bound_[swap.group];
        for (std::size_t t = 0; t < tensors.size(); ++t) tensors[t] = hook.live_tensor(swap.group, t);
      }
    });
  }
  receiver_->set_observer([this](const UpdateReport& r) {
    Report report{r.version, r.outcome, r.bytes, to_s(r.transfer), Clock::now(), r.error, r.code};
    std::lock_guard lock(mutex_);
    const bool error = r.outcome == UpdateOutcome::kFailed && !config_.failures_expected;
    if (error && first_error_.empty()) first_error_ = cat("update ", r.version, " failed: ", r.error);
    if (r.outcome != UpdateOutcome::kSuperseded) {
      last_resolved_.store(std::max(last_resolved_.load(), r.version));
    }
    if (error) failed_.fetch_add(1);
    reports_.push_back(std::move(report));
  });
}

Session::~Session() { destroy_pair(sender_, receiver_); }

PublishHandle Session::publish(const TrainerWeights& weights, bool from_arena) {
  const std::uint64_t v = version_.fetch_add(1) + 1;
  const std::vector<std::string> groups = {std::string(kBaseGroup)};
  PublishHandle handle = from_arena ? sender_->publish_arenas(v, groups, {weights.arena.data()})
                                    : sender_->publish(v, groups, weights.sources);
  receiver_->begin_update(handle.header());
  return handle;
}

StreamedPublish Session::publish_streamed() {
  const std::uint64_t v = version_.fetch_add(1) + 1;
  StreamedPublish publish = sender_->publish_streamed(v, {std::string(kBaseGroup)});
  receiver_->begin_update(publish.header());
  return publish;
}

Session::Report Session::wait_report(std::uint64_t v, const std::string& what) {
  std::optional<Report> found;
  wait_until(
      [&] {
        std::lock_guard lock(mutex_);
        for (const Report& r : reports_) {
          if (r.version == v && r.outcome != UpdateOutcome::kSuperseded) found = r;
        }
        return found.has_value();
      },
      what);
  return *found;
}

void Session::wait_resolved(std::uint64_t v, const std::string& what) {
  wait_until([&] { return last_resolved_.load() >= v || failed_.load() > 0; }, what);
  throw_if_failed();
}

void Session::throw_if_failed() {
  if (failed_.load() == 0) return;
  std::lock_guard lock(mutex_);
  throw BenchError(first_error_);
}

void Session::settle(Stream& engine_stream) {
  wait_resolved(version_.load(), "the last update to land");
  hook().apply_pending_now(engine_stream);
}

std::size_t Session::report_count() const {
  std::lock_guard lock(mutex_);
  return reports_.size();
}

std::vector<Session::Report> Session::reports_since(std::size_t index) const {
  std::lock_guard lock(mutex_);
  return {reports_.begin() + static_cast<std::ptrdiff_t>(std::min(index, reports_.size())),
          reports_.end()};
}

std::optional<Session::Report> Session::ready_report(std::uint64_t version) const {
  std::lock_guard lock(mutex_);
  for (auto it = reports_.rbegin(); it != reports_.rend(); ++it) {
    if (it->version == version && it->outcome == UpdateOutcome::kReady) return *it;
  }
  return std::nullopt;
}

void Session::replace_transports(int max_ctas) {
  TransportPair transports = p_.make_transports(max_ctas);
  sender_transport_ = transports.rank0.get();
  sender_->replace_transport(std::move(transports.rank0));
  receiver_->replace_transport(std::move(transports.rank1));
  receiver_->drain();
}

}  // namespace shadowsync::bench
