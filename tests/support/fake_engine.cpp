#include "fake_engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "pattern.h"

namespace shadowsync::testing {

HostFakeEngine::HostFakeEngine(HostBackend& backend, Receiver& receiver, FakeEngineOptions options)
    : backend_(backend),
      receiver_(receiver),
      options_(options),
      stream_(backend.create_stream(StreamPriority::kNormal)) {
  const Layout& layout = receiver.layout();
  for (const GroupLayout& group : layout.groups()) {
    std::vector<Sample> samples;
    for (std::size_t t = 0; t < group.tensors().size(); ++t) {
      const TensorPlacement& placement = group.tensors()[t];
      const std::size_t words = (placement.bytes + 7) / 8;
      samples.push_back({t, 0});
      samples.push_back({t, words / 2});
      samples.push_back({t, words - 1});
      // The words on both sides of every bucket boundary inside the tensor.
      const std::size_t end = placement.offset + placement.bytes;
      for (std::size_t b = (placement.offset / group.bucket_bytes() + 1) * group.bucket_bytes();
           b < end; b += group.bucket_bytes()) {
        const std::size_t word = (b - placement.offset) / 8;
        samples.push_back({t, word});
        if (word > 0) samples.push_back({t, word - 1});
      }
    }
    samples_.push_back(std::move(samples));
  }
}

HostFakeEngine::~HostFakeEngine() { synchronize(); }

std::optional<std::uint64_t> HostFakeEngine::step() {
  const std::optional<std::uint64_t> applied = receiver_.step_hook().before_step(*stream_);
  // The engine reads the live pointer table when it enqueues the step (rebind).
  const StepHook& hook = receiver_.step_hook();
  const std::size_t groups = receiver_.layout().groups().size();
  std::vector<const std::byte*> arenas(groups);
  std::vector<std::uint64_t> expected(groups);
  for (std::size_t g = 0; g < groups; ++g) {
    arenas[g] = hook.live_arena(g);
    if (arenas[g] == nullptr) {
      // The group lives in the engine's own storage (Receiver::use_engine_storage): the tests
      // give it one buffer laid out as the group's arena, so its first tensor locates it.
      const std::size_t offset = receiver_.layout().groups()[g].tensors()[0].offset;
      arenas[g] = static_cast<const std::byte*>(hook.live_tensor(g, 0)) - offset;
    }
    expected[g] = hook.live_content_version(g);
  }
  const bool full = options_.full_check_every != 0 && steps_enqueued_ % options_.full_check_every == 0;
  ++steps_enqueued_;
  backend_.launch_async(*stream_, [this, arenas = std::move(arenas),
                                   expected = std::move(expected),
                                   applied = hook.applied_version(), full]() mutable {
    run_step(std::move(arenas), std::move(expected), applied, full);
  });
  return applied;
}

void HostFakeEngine::synchronize() { backend_.stream_synchronize(*stream_); }

bool HostFakeEngine::step_until_applied(
    std::uint64_t version, std::chrono::steady_clock::time_point deadline,
    const std::function<void(std::optional<std::uint64_t>)>& after_step) {
  const StepHook& hook = receiver_.step_hook();
  while (hook.applied_version() < version) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    after_step(step());
  }
  return true;
}

void HostFakeEngine::run_step(std::vector<const std::byte*> arenas,
                              std::vector<std::uint64_t> expected, std::uint64_t applied,
                              bool full) {
  StepRecord record;
  record.applied_version = applied;
  record.seen.assign(arenas.size(), 0);
  std::vector<std::uint64_t> first_half(arenas.size());
  for (std::size_t g = 0; g < arenas.size(); ++g) {
    first_half[g] = read_group(g, arenas[g], expected[g], full, 0);
  }
  if (options_.compute_time.count() > 0) std::this_thread::sleep_for(options_.compute_time);
  bool torn = false;
  std::string why;
  for (std::size_t g = 0; g < arenas.size(); ++g) {
    const std::uint64_t second_half = read_group(g, arenas[g], expected[g], full, 1);
    record.seen[g] = first_half[g] == second_half ? first_half[g] : kTornVersion;
    if (record.seen[g] != expected[g]) {
      torn = true;
      if (why.empty()) {
        why = fmt::format("step at applied version {}: group {} expected version {}, read {} then {}",
                          applied, receiver_.layout().groups()[g].name(), expected[g],
                          first_half[g], second_half);
      }
    }
  }
  ++steps_done_;
  if (torn) ++torn_steps_;
  std::lock_guard lock(mutex_);
  if (torn && first_torn_.empty()) first_torn_ = why;
  if (options_.record_steps) records_.push_back(std::move(record));
}

// Reads half of a group's samples (or of all its words) and returns the single version seen,
// or kTornVersion if the words disagree.
std::uint64_t HostFakeEngine::read_group(std::size_t group, const std::byte* arena,
                                         std::uint64_t expected, bool full,
                                         std::size_t half) const {
  const GroupLayout& layout = receiver_.layout().groups()[group];
  std::optional<std::uint64_t> seen;
  auto visit = [&](std::size_t tensor, std::size_t word) {
    const TensorPlacement& placement = layout.tensors()[tensor];
    const std::uint64_t version =
        read_version(arena + placement.offset, placement.bytes, group, tensor, word, expected);
    if (!seen) seen = version;
    return *seen == version;
  };
  if (full) {
    for (std::size_t t = half; t < layout.tensors().size(); t += 2) {
      const std::size_t words = (layout.tensors()[t].bytes + 7) / 8;
      for (std::size_t w = 0; w < words; ++w) {
        if (!visit(t, w)) return kTornVersion;
      }
    }
  } else {
    const auto& samples = samples_[group];
    for (std::size_t i = half; i < samples.size(); i += 2) {
      if (!visit(samples[i].tensor, samples[i].word)) return kTornVersion;
    }
  }
  return seen.value_or(expected);
}

std::string HostFakeEngine::first_torn() const {
  std::lock_guard lock(mutex_);
  return first_torn_;
}

std::vector<StepRecord> HostFakeEngine::records() const {
  std::lock_guard lock(mutex_);
  return records_;
}

void UpdateHistory::add(std::uint64_t version, std::vector<std::size_t> groups) {
  entries_.push_back(Entry{version, std::move(groups)});
}

void UpdateHistory::mark_failed(std::uint64_t version) {
  for (auto& entry : entries_) {
    if (entry.version == version) entry.failed = true;
  }
}

std::uint64_t UpdateHistory::expected(std::size_t group, std::uint64_t applied) const {
  std::uint64_t version = 0;
  for (const auto& entry : entries_) {
    if (entry.version > applied) break;
    if (entry.failed) continue;
    if (std::find(entry.groups.begin(), entry.groups.end(), group) != entry.groups.end()) {
      version = entry.version;
    }
  }
  return version;
}

std::string UpdateHistory::check(const std::vector<StepRecord>& records) const {
  std::uint64_t previous_applied = 0;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const StepRecord& record = records[i];
    if (record.applied_version < previous_applied) {
      return fmt::format("step {}: applied version went back from {} to {}", i, previous_applied,
                         record.applied_version);
    }
    previous_applied = record.applied_version;
    for (std::size_t g = 0; g < record.seen.size(); ++g) {
      const std::uint64_t want = expected(g, record.applied_version);
      if (record.seen[g] != want) {
        return fmt::format("step {}: at applied version {} group #{} read version {}, the history "
                           "says {}",
                           i, record.applied_version, g, record.seen[g], want);
      }
    }
  }
  return {};
}

}  // namespace shadowsync::testing
