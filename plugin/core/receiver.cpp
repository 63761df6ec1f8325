// Receiver's public methods (receiver.h): they check what they are given and hand the work to
// the receiver thread (receiver_thread.cpp) through the state of receiver_impl.h.
#include "shadowsync/receiver.h"

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "core/check_receiver_config.h"
#include "core/check_root_rank.h"
#include "core/receive_checks.h"
#include "core/receiver_impl.h"
#include "core/slot_table.h"
#include "core/thread_affinity.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

// The plan's checks that need the receiver's config and layout; before anything is allocated.
std::unique_ptr<const ReceivePlan> checked_plan(std::unique_ptr<const ReceivePlan> plan,
                                                const Layout& layout,
                                                const ReceiverConfig& config) {
  if (!plan) return plan;
  if (plan->engine_fingerprint() != layout.fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("the receive plan was built for engine layout {:#018x}, but the "
                            "receiver's layout is {:#018x}",
                            plan->engine_fingerprint(), layout.fingerprint()));
  }
  if (config.reject_nonfinite) {
    throw Error(ErrorCode::kInvalidArgument,
                "ReceiverConfig::reject_nonfinite is not available with a receive plan (it counts "
                "per trainer tensor, which a plan spreads over buckets and engine tensors); "
                "checksums are");
  }
  return plan;
}

// The engine's remap arenas against the config and the layout; before anything is allocated.
void check_engine_arenas(const EngineArenas& arenas, const Layout& layout,
                         const ReceiverConfig& config) {
  const auto given = std::count_if(arenas.begin(), arenas.end(),
                                   [](const auto& arena) { return arena != nullptr; });
  if (given == 0) return;
  if (config.swap_strategy == SwapStrategy::kCopyIn) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("engine arenas were given for {} group(s), but swap_strategy is {}: "
                            "an engine arena is swapped by remapping it (swap_strategy remap) or "
                            "by flipping between its two slots (swap_strategy rebind)",
                            given, swap_strategy_name(config.swap_strategy)));
  }
  if (arenas.size() > layout.groups().size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} engine arena entries were given, but the layout has {} groups",
                            arenas.size(), layout.groups().size()));
  }
  for (std::size_t g = 0; g < arenas.size(); ++g) {
    if (!arenas[g]) continue;
    const GroupLayout& group = layout.groups()[g];
    if (arenas[g]->bytes() != group.arena_bytes()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("the engine arena of group '{}' holds {} bytes, but the layout's "
                              "group needs {}: the arena must be laid out as the group is",
                              group.name(), arenas[g]->bytes(), group.arena_bytes()));
    }
  }
}

}  // namespace

Receiver::Receiver(Layout layout, Backend& backend, std::unique_ptr<Transport> transport,
                   ReceiverConfig config, EngineArenas engine_arenas)
    : Receiver(std::move(layout), nullptr, backend, std::move(transport), config,
               std::move(engine_arenas)) {}

Receiver::Receiver(Layout layout, ReceivePlan plan, Backend& backend,
                   std::unique_ptr<Transport> transport, ReceiverConfig config,
                   EngineArenas engine_arenas)
    : Receiver(std::move(layout), std::make_unique<const ReceivePlan>(std::move(plan)), backend,
               std::move(transport), config, std::move(engine_arenas)) {}

Receiver::Receiver(Layout layout, std::unique_ptr<const ReceivePlan> plan, Backend& backend,
                   std::unique_ptr<Transport> transport, ReceiverConfig config,
                   EngineArenas engine_arenas)
    // The config and the engine's arenas are checked first, before the slots are allocated.
    : layout_((check_receiver_config(config, transport.get(), backend),
               check_engine_arenas(engine_arenas, layout, config), std::move(layout))),
      plan_(checked_plan(std::move(plan), layout_, config)),
      slots_(std::make_unique<SlotTable>(layout_, backend, config.swap_strategy, engine_arenas)),
      hook_(std::make_unique<StepHook>(
          layout_, *slots_,
          config.decode_slowdown_budget.has_value() || config.max_receive_bytes_per_second != 0 ||
              config.offer_after_clean_step,
          config.gated_swaps ? backend.create_stream_gate() : nullptr, config.gate_deadline)),
      impl_(std::make_unique<Impl>(*this, backend, std::move(transport), config)) {
  impl_->thread = start_library_thread([this] { impl_->run(); });
}

Receiver::~Receiver() { shutdown(); }

void Receiver::begin_update(const UpdateHeader& header, const UpdateChecks& checks) {
  if (impl_->stopping.load()) {
    throw Error(ErrorCode::kShutdown,
                fmt::format("update {}: the receiver is shut down", header.version));
  }
  std::lock_guard lock(impl_->accept_mutex);
  validate_update_header(header, wire_layout(), impl_->last_accepted_version,
                         impl_->routing_fingerprint);
  const bool checksums = carries_checksums(header, wire_layout());
  if (checksums && impl_->routing_fingerprint != 0) {
    // A follow-up: a checksum per route (a bucket's cannot be: no trainer rank holds a whole one).
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: announces a checksum block (bucket count {}), but this "
                            "receiver takes the routes of a routing plan, which carry no "
                            "checksums yet; publish with SenderConfig::checksums off",
                            header.version, header.bucket_count));
  }
  if (!checksums && impl_->config.require_checksums) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: carries no checksums (bucket count {}, the layout's), but "
                            "ReceiverConfig::require_checksums is set; set SenderConfig::checksums "
                            "on the sender",
                            header.version, header.bucket_count));
  }
  if (checksums && !impl_->backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: carries checksums, but backend '{}' cannot verify them "
                            "(supports_integrity() is false)",
                            header.version, impl_->backend.name()));
  }
  if (checks.verify_matches_live && !impl_->backend.supports_integrity()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: verify_matches_live asked, but backend '{}' cannot compare "
                            "bytes (supports_integrity() is false); send it without the self-check",
                            header.version, impl_->backend.name()));
  }
  impl_->last_accepted_version = header.version;
  {
    std::lock_guard stats_lock(impl_->stats_mutex);
    impl_->stats.last_accepted_version = header.version;
  }
  Impl::Command command;
  command.kind = Impl::Command::Kind::kBegin;
  command.header = header;
  command.checks = checks;
  impl_->commands.enqueue(std::move(command));
}

void Receiver::use_engine_storage(std::size_t group, const std::vector<void*>& tensors) {
  std::lock_guard lock(impl_->accept_mutex);  // no update may be accepted meanwhile
  const auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("use_engine_storage: {}", why));
  };
  const SwapStrategy strategy = impl_->config.swap_strategy;
  if (strategy == SwapStrategy::kRebind) {
    refuse("swap_strategy is rebind; copy_in (or remap, for a group without an engine arena) "
           "copies into the engine's storage");
  }
  if (group >= layout_.groups().size()) {
    refuse(fmt::format("group index {} out of range (the layout has {} groups)", group,
                       layout_.groups().size()));
  }
  const GroupLayout& g = layout_.groups()[group];
  if (slots_->group(group).engine_arena) {
    refuse(fmt::format("group '{}' is swapped by remapping the engine arena it was given; its "
                       "live memory is that arena, not tensors of the engine",
                       g.name()));
  }
  if (tensors.size() != g.tensors().size()) {
    refuse(fmt::format("group '{}' has {} tensors but {} addresses were given", g.name(),
                       g.tensors().size(), tensors.size()));
  }
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    if (tensors[t] == nullptr) refuse(fmt::format("the address of tensor '{}' is null", g.tensors()[t].spec.name));
  }
  if (impl_->last_accepted_version != 0) {
    refuse(fmt::format("update {} was already accepted; give the engine's storage before the "
                       "first update",
                       impl_->last_accepted_version));
  }
  slots_->use_engine_storage(group, layout_, tensors);
}

void Receiver::abort_update() { impl_->abort_requested.store(true); }

void Receiver::use_routing_plan(std::shared_ptr<const RoutingPlan> routing, int engine_rank) {
  const auto refuse = [](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("use_routing_plan: {}", why));
  };
  if (!routing) refuse("the routing plan is null");
  std::lock_guard lock(impl_->accept_mutex);  // no update may be accepted meanwhile
  if (impl_->last_accepted_version != 0) {
    refuse(fmt::format("update {} was already accepted; give the routing plan before the first "
                       "update",
                       impl_->last_accepted_version));
  }
  if (routing->wire_fingerprint() != wire_layout().fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("use_routing_plan: the routing plan was built on wire layout "
                            "{:#018x}, but this receiver's updates come in {:#018x}",
                            routing->wire_fingerprint(), wire_layout().fingerprint()));
  }
  if (engine_rank < 0 || engine_rank >= routing->engine_count()) {
    refuse(fmt::format("engine rank {} is outside 0..{} (the routing plan has {} engine ranks)",
                       engine_rank, routing->engine_count() - 1, routing->engine_count()));
  }
  if (impl_->config.require_checksums) {
    // A follow-up: a checksum per route, computed over its packed slice by the trainer rank and
    // over where it landed by the engine rank.
    refuse("ReceiverConfig::require_checksums is set, but routed updates carry no checksums yet; "
           "unset it to take a routing plan");
  }
  auto prepared = std::make_shared<Impl::Routing>();
  prepared->engine_rank = engine_rank;
  prepared->copies = compose_route_copies(*routing, engine_rank, wire_layout(), plan_.get());
  prepared->plan = std::move(routing);
  impl_->routing_fingerprint = prepared->plan->fingerprint();
  Impl::Command command;
  command.kind = Impl::Command::Kind::kUseRoutingPlan;
  command.routing = std::move(prepared);
  impl_->commands.enqueue(std::move(command));
}

void Receiver::replace_transport(std::unique_ptr<Transport> transport) {
  if (!transport) throw Error(ErrorCode::kInvalidArgument, "replace_transport: transport is null");
  check_root_rank(impl_->config.root_rank, transport.get(), "ReceiverConfig::root_rank");
  Impl::Command command;
  command.kind = Impl::Command::Kind::kReplaceTransport;
  command.transport = std::move(transport);
  impl_->commands.enqueue(std::move(command));
}

void Receiver::release_transport(std::string why) {
  Impl::Command command;
  command.kind = Impl::Command::Kind::kReleaseTransport;
  command.why = std::move(why);
  impl_->commands.enqueue(std::move(command));
}

void Receiver::set_observer(std::function<void(const UpdateReport&)> observer) {
  std::lock_guard lock(impl_->stats_mutex);
  impl_->observer = std::move(observer);
}

ReceiverStats Receiver::stats() const {
  std::lock_guard lock(impl_->stats_mutex);
  return impl_->stats;
}

void Receiver::drain() {
  if (!impl_->thread.joinable()) return;
  Impl::Command command;
  command.kind = Impl::Command::Kind::kDrain;
  command.drained = std::make_shared<std::promise<void>>();
  auto done = command.drained->get_future();
  impl_->commands.enqueue(std::move(command));
  done.wait();
}

void Receiver::shutdown() {
  if (impl_->stopping.exchange(true)) {
    if (impl_->thread.joinable()) impl_->thread.join();
    return;
  }
  Impl::Command command;
  command.kind = Impl::Command::Kind::kShutdown;
  impl_->commands.enqueue(std::move(command));
  if (impl_->thread.joinable()) impl_->thread.join();
  // Nothing may still write (or read) the slots when they are freed.
  impl_->backend.stream_synchronize(*impl_->stream);
  if (Stream* checks = impl_->checks.stream()) impl_->backend.stream_synchronize(*checks);
}

std::uint64_t Receiver::commit(std::uint64_t version, Stream& engine_stream) {
  if (impl_->config.commit_mode != CommitMode::kCoordinated) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("commit({}): the receiver's commit_mode is auto, where updates go live "
                            "at the next step by themselves; set ReceiverConfig::commit_mode to "
                            "coordinated",
                            version));
  }
  std::lock_guard lock(impl_->commit_mutex);
  if (impl_->held_ready == nullptr || impl_->held_version != version) {
    const std::string ready = impl_->held_ready == nullptr
                                  ? std::string("none is")
                                  : fmt::format("update {} is", impl_->held_version.load());
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("commit({}): {} ready on this rank (applied version {}); commit a "
                            "version every rank reported ready",
                            version, ready, hook_->applied_version()));
  }
  hook_->publish(impl_->held_ready);
  const std::optional<std::uint64_t> applied = hook_->apply_pending_now(engine_stream);
  impl_->held_ready = nullptr;
  impl_->held_version = 0;
  {
    std::lock_guard stats_lock(impl_->stats_mutex);
    impl_->stats.ready_version = 0;
  }
  impl_->committed.notify_all();
  return applied.value_or(version);
}

bool Receiver::discard(std::uint64_t version) {
  if (impl_->config.commit_mode != CommitMode::kCoordinated) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("discard({}): the receiver's commit_mode is auto, where no update is "
                            "held ready; set ReceiverConfig::commit_mode to coordinated",
                            version));
  }
  std::lock_guard lock(impl_->commit_mutex);
  if (impl_->held_ready == nullptr || impl_->held_version != version) {
    impl_->discard_when_ready = version;  // still arriving, or never will: a newer one clears it
    return false;
  }
  impl_->held_ready = nullptr;
  impl_->held_version = 0;
  impl_->held_discarded = true;
  {
    std::lock_guard stats_lock(impl_->stats_mutex);
    impl_->stats.ready_version = 0;
  }
  impl_->committed.notify_all();  // a receive waiting for the commit may go on
  return true;
}

std::uint64_t Receiver::ready_version() const {
  return impl_->held_version.load(std::memory_order_acquire);
}

}  // namespace shadowsync
