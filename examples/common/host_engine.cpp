#include "host_engine.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <thread>

#include "weights.h"

namespace shadowsync::examples {

HostEngine::HostEngine(HostBackend& backend, Receiver& receiver, HostEngineOptions options)
    : backend_(backend),
      receiver_(receiver),
      options_(options),
      stream_(backend.create_stream(StreamPriority::kNormal)) {}

HostEngine::~HostEngine() { synchronize(); }

std::optional<std::uint64_t> HostEngine::step() {
  const std::optional<std::uint64_t> applied = receiver_.step_hook().before_step(*stream_);
  // What the step reads is fixed when it is enqueued: the live pointer table and the version each
  // group's live slot holds. The library keeps those bytes in place until the step is done.
  const StepHook& hook = receiver_.step_hook();
  const std::size_t groups = receiver_.layout().groups().size();
  std::vector<const std::byte*> arenas(groups);
  std::vector<std::uint64_t> versions(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    arenas[g] = hook.live_arena(g);
    versions[g] = hook.live_content_version(g);
  }
  const std::uint64_t index = steps_enqueued_++;
  const bool full = options_.full_read_every != 0 && index % options_.full_read_every == 0;
  backend_.launch_async(*stream_, [this, index, arenas = std::move(arenas),
                                   versions = std::move(versions), full] {
    run_step(index, arenas, versions, full);
  });
  return applied;
}

void HostEngine::synchronize() { backend_.stream_synchronize(*stream_); }

std::string HostEngine::first_torn() const {
  std::lock_guard lock(mutex_);
  return first_torn_;
}

std::size_t HostEngine::read_half(const std::vector<const std::byte*>& arenas,
                                  const std::vector<std::uint64_t>& versions, std::size_t first,
                                  bool full) const {
  std::size_t wrong = 0;
  for (std::size_t g = 0; g < arenas.size(); ++g) {
    const auto& tensors = receiver_.layout().groups()[g].tensors();
    for (std::size_t t = first; t < tensors.size(); t += 2) {
      wrong += count_wrong_words(arenas[g] + tensors[t].offset, tensors[t].bytes, g, t,
                                 versions[g], !full);
    }
  }
  return wrong;
}

void HostEngine::run_step(std::uint64_t index, const std::vector<const std::byte*>& arenas,
                          const std::vector<std::uint64_t>& versions, bool full) {
  std::size_t wrong = read_half(arenas, versions, 0, full);
  if (options_.compute_time.count() > 0) std::this_thread::sleep_for(options_.compute_time);
  wrong += read_half(arenas, versions, 1, full);
  ++steps_done_;
  if (wrong == 0) return;
  ++torn_steps_;
  std::lock_guard lock(mutex_);
  if (first_torn_.empty()) {
    first_torn_ = fmt::format("step {}: {} words were not the live versions' ({})", index, wrong,
                              fmt::join(versions, ", "));
  }
}

}  // namespace shadowsync::examples
