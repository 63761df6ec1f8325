// The receiver's checks of the bytes it received, before an update is offered: every bucket's
// checksum against the sender's (when the header announced the sender's checksum block) and, with
// ReceiverConfig::reject_nonfinite, a count of NaN and infinite values per floating tensor, and,
// for an update begun with UpdateChecks::verify_matches_live (the self-check), the checksum of
// every tensor it wrote beside that of its live copy, which must agree. The
// checks of bucket k are enqueued, on a low-priority stream of their own, behind bucket k's
// event, so they overlap the later buckets' transfer: what they add to an update is about one
// bucket's worth, not a pass over every byte.
//
// Threads: the receiver thread only. Streams: the checks run on stream(); everything they read
// is ordered behind the receive stream's bucket events. Ownership: owns its stream, event and
// scratch (CheckScratch); the layout and the backend must outlive it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/refusal.h"
#include "core/slot_planner.h"
#include "core/slot_table.h"
#include "shadowsync/backend.h"
#include "shadowsync/layout.h"

namespace shadowsync {

// What the checks of one update write, one 8-byte word each, in one device allocation so that a
// single copy brings every result to the host: the sender's checksums as received, the checksums
// computed here (both in broadcast order, at most one per bucket of an update that carries every
// group), and one non-finite count per checked tensor (at most one per fp32/fp16/bf16 tensor of
// the layout), then two per tensor of the engine's layout for the self-check (the slot's checksum
// and the live copy's).
class CheckScratch {
 public:
  CheckScratch() = default;
  CheckScratch(Backend& backend, std::size_t max_buckets, std::size_t max_tensors,
               std::size_t engine_tensors);

  // Device memory, written on the streams.
  std::uint64_t* sent_checksums() const { return word(0); }  // the received block
  std::uint64_t* computed_checksum(std::size_t i) const { return word(max_buckets_ + i); }
  std::uint64_t* nonfinite_count(std::size_t i) const { return word(2 * max_buckets_ + i); }
  // Self-check pair i: `live` false for the slot's checksum, true for the live copy's.
  std::uint64_t* match_checksum(std::size_t i, bool live) const {
    return word(2 * max_buckets_ + max_tensors_ + 2 * i + (live ? 1 : 0));
  }

  // Enqueues on `stream` the copy of every word to the host copy below.
  void enqueue_download(Backend& backend, Stream& stream);
  // The host copy, once the download ran.
  std::uint64_t sent_checksum_on_host(std::size_t i) const { return host_[i]; }
  std::uint64_t computed_checksum_on_host(std::size_t i) const { return host_[max_buckets_ + i]; }
  std::uint64_t nonfinite_count_on_host(std::size_t i) const {
    return host_[2 * max_buckets_ + i];
  }
  std::uint64_t match_checksum_on_host(std::size_t i, bool live) const {
    return host_[2 * max_buckets_ + max_tensors_ + 2 * i + (live ? 1 : 0)];
  }

 private:
  std::uint64_t* word(std::size_t i) const {
    return reinterpret_cast<std::uint64_t*>(device_.data()) + i;
  }

  DeviceBuffer device_;
  std::vector<std::uint64_t> host_;
  std::size_t max_buckets_ = 0;
  std::size_t max_tensors_ = 0;
};

class ReceiveChecks {
 public:
  // Creates the check stream and the scratch only when the backend has the checks
  // (supports_integrity()); otherwise nothing, and every update must come without any (the
  // receiver's config and header checks make sure of that).
  // `layout`: the wire layout (the buckets); `engine_layout`: the slots' (the same without a
  // receive plan).
  ReceiveChecks(const Layout& layout, const Layout& engine_layout, Backend& backend,
                bool reject_nonfinite);

  // Starts the checks of one update. `checksums`: its header announces the sender's checksum
  // block (carries_checksums). `match_live`: UpdateChecks::verify_matches_live.
  void begin(bool checksums, bool match_live = false);
  // Whether the update begun last has anything to check.
  bool active() const { return checksums_ || reject_nonfinite_ || match_live_; }
  bool checksums() const { return checksums_; }

  // Enqueues on stream(), behind `bucket_done` (bucket k of `group` received into `arena`), the
  // checks of what bucket k completes: its checksum (when the header announced them) and the
  // non-finite count of every floating tensor whose last byte is in it. `group_index` is the
  // group's index in the layout. Buckets must come in broadcast order.
  void enqueue_bucket(const GroupLayout& group, std::size_t group_index, const std::byte* arena,
                      std::size_t k, Event& bucket_done);

  // Enqueues on `on` (the receive stream, right behind the bucket's receive and before the buffer
  // is reused) the checksum of the next bucket in broadcast order, `bytes` at `data`. For a
  // receive plan's bucket buffer, which the check stream could not read in time.
  void enqueue_bucket_checksum(const std::byte* data, std::size_t bytes, Stream& on);

  // The self-check: enqueues on stream() the checksum of every tensor of `targets` in its slot
  // and of its live copy (slots.live_tensor). Only once every bucket of the update completed (the
  // host saw their events), and while no swap can run.
  void enqueue_match_live(const std::vector<ReceiveTarget>& targets, const Layout& engine_layout,
                          const SlotTable& slots);

  // Where the sender's checksum block is received (device memory, one word per bucket).
  void* sent_checksums() const { return scratch_.sent_checksums(); }

  // Enqueues, behind every check and behind `sent_block_done` (the event of the sent block's
  // receive; only when the header announced checksums), the copy of the results to the host.
  // Then poll results_ready(); compare() once it returned true.
  void enqueue_results(Event* sent_block_done);
  // Waits up to `timeout` for the results of enqueue_results(); true once they are on the host.
  bool results_ready(std::chrono::nanoseconds timeout);
  // Compares the results: nothing when every check passed, else the first refusal. `targets` are
  // the update's groups in broadcast order (the receive's).
  std::optional<Refusal> compare(const std::vector<ReceiveTarget>& targets) const;
  // The self-check: the first byte at which matched tensor i differs from its live copy, both
  // read back to the host (only on a failure path, or for a tensor too unaligned for the device
  // checksum); nothing when they agree.
  std::optional<std::size_t> first_difference(std::size_t i) const;
  // Its refusal, naming the first differing element (`at`: none when the checksums differed but
  // the bytes agree when read back).
  Refusal match_refusal(std::size_t i, std::optional<std::size_t> at) const;

  // The check stream, or null when the backend has no checks.
  Stream* stream() const { return stream_.get(); }

 private:
  const Layout& layout_;
  Backend& backend_;
  const bool reject_nonfinite_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> results_event_;
  CheckScratch scratch_;

  // The update begun last.
  bool checksums_ = false;
  std::size_t buckets_ = 0;  // checksums computed so far, in broadcast order
  std::vector<std::pair<std::size_t, std::size_t>> tensors_;  // (group, tensor) counted, in order
  // The self-check of the update begun last.
  struct Matched {
    std::string group;
    const TensorPlacement* tensor;
    const std::byte* slot;
    const std::byte* live;
    bool on_host;  // not 8-byte aligned for the device checksum: compared on the host instead
  };
  const Layout& engine_layout_;
  bool match_live_ = false;
  std::vector<Matched> matched_;
};

}  // namespace shadowsync
