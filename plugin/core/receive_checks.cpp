#include "core/receive_checks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shadowsync {

CheckScratch::CheckScratch(Backend& backend, std::size_t max_buckets, std::size_t max_tensors,
                           std::size_t engine_tensors)
    : host_(2 * max_buckets + max_tensors + 2 * engine_tensors),
      max_buckets_(max_buckets),
      max_tensors_(max_tensors) {
  device_ = DeviceBuffer(backend, host_.size() * sizeof(std::uint64_t));
}

void CheckScratch::enqueue_download(Backend& backend, Stream& stream) {
  backend.memcpy_async(host_.data(), device_.data(), host_.size() * sizeof(std::uint64_t), stream);
}

ReceiveChecks::ReceiveChecks(const Layout& layout, const Layout& engine_layout, Backend& backend,
                             bool reject_nonfinite)
    : layout_(layout),
      backend_(backend),
      reject_nonfinite_(reject_nonfinite),
      engine_layout_(engine_layout) {
  if (!backend.supports_integrity()) return;
  stream_ = backend.create_stream(StreamPriority::kLow);
  results_event_ = backend.create_event();
  std::size_t max_buckets = 0;
  std::size_t checked_tensors = 0;
  for (const auto& g : layout.groups()) {
    max_buckets += g.bucket_count();
    for (const auto& t : g.tensors()) checked_tensors += dtype_has_nonfinite_check(t.spec.dtype);
  }
  std::size_t engine_tensors = 0;
  for (const auto& g : engine_layout.groups()) engine_tensors += g.tensors().size();
  scratch_ = CheckScratch(backend, max_buckets, checked_tensors, engine_tensors);
}

void ReceiveChecks::begin(bool checksums, bool match_live) {
  checksums_ = checksums;
  match_live_ = match_live;
  buckets_ = 0;
  tensors_.clear();
  matched_.clear();
}

void ReceiveChecks::enqueue_match_live(const std::vector<ReceiveTarget>& targets,
                                       const Layout& engine_layout, const SlotTable& slots) {
  for (const ReceiveTarget& target : targets) {
    const GroupLayout& group = engine_layout.groups()[target.group];
    const std::byte* slot = slots.slot_data(target.group, target.slot);
    for (std::size_t t = 0; t < group.tensors().size(); ++t) {
      const TensorPlacement& tensor = group.tensors()[t];
      if (tensor.bytes == 0) continue;
      const auto* live =
          static_cast<const std::byte*>(slots.live_tensor(target.group, t, tensor.offset));
      const std::byte* mine = slot + tensor.offset;
      const bool on_host = (reinterpret_cast<std::uintptr_t>(live) % 8) != 0 ||
                           (reinterpret_cast<std::uintptr_t>(mine) % 8) != 0;
      const std::size_t i = matched_.size();
      matched_.push_back({group.name(), &tensor, mine, live, on_host});
      if (on_host) continue;
      backend_.checksum_async(mine, tensor.bytes, scratch_.match_checksum(i, false), *stream_);
      backend_.checksum_async(live, tensor.bytes, scratch_.match_checksum(i, true), *stream_);
    }
  }
}

std::optional<std::size_t> ReceiveChecks::first_difference(std::size_t i) const {
  const Matched& m = matched_[i];
  const std::size_t bytes = m.tensor->bytes;
  std::vector<std::byte> mine(bytes), live(bytes);
  backend_.memcpy_async(mine.data(), m.slot, bytes, *stream_);
  backend_.memcpy_async(live.data(), m.live, bytes, *stream_);
  backend_.stream_synchronize(*stream_);
  const auto at = std::mismatch(mine.begin(), mine.end(), live.begin()).first - mine.begin();
  if (static_cast<std::size_t>(at) == bytes) return std::nullopt;
  return static_cast<std::size_t>(at);
}

Refusal ReceiveChecks::match_refusal(std::size_t i, std::optional<std::size_t> at) const {
  const Matched& m = matched_[i];
  const TensorPlacement& tensor = *m.tensor;
  const std::size_t element = dtype_size(tensor.spec.dtype);
  Refusal refusal;
  refusal.transport_failed = false;
  refusal.code = ErrorCode::kLayoutMismatch;
  refusal.group = m.group;
  refusal.tensor = tensor.spec.name;
  if (!at) {  // the checksums differed while the bytes agree: read again, racing
    refusal.why = fmt::format(
        "self-check (verify_matches_live): tensor '{}' of group '{}' had another checksum than its "
        "live copy, but its bytes now agree: the live copy changed while it was compared",
        tensor.spec.name, m.group);
    return refusal;
  }
  refusal.why = fmt::format(
      "self-check (verify_matches_live): tensor '{}' of group '{}' ({}, {} elements) differs from "
      "the engine's live copy first at element {} (byte {}): the update was to reproduce the live "
      "weights, so the receive plan or a transform after loading puts bytes where the engine does "
      "not read them; nothing went live",
      tensor.spec.name, m.group, dtype_name(tensor.spec.dtype), tensor.bytes / element,
      *at / element, *at);
  return refusal;
}

void ReceiveChecks::enqueue_bucket(const GroupLayout& group, std::size_t group_index,
                                   const std::byte* arena, std::size_t k, Event& bucket_done) {
  const Bucket bucket = group.bucket(k);
  backend_.stream_wait_event(*stream_, bucket_done);
  if (checksums_) {
    backend_.checksum_async(arena + bucket.offset, bucket.bytes,
                            scratch_.computed_checksum(buckets_++), *stream_);
  }
  if (!reject_nonfinite_) return;
  // Buckets complete in order on the receiver's stream, so a tensor is whole once the bucket
  // holding its last byte is: count it then.
  const std::size_t bucket_end = bucket.offset + bucket.bytes;
  for (std::size_t t = 0; t < group.tensors().size(); ++t) {
    const TensorPlacement& tensor = group.tensors()[t];
    const std::size_t end = tensor.offset + tensor.bytes;
    if (tensor.bytes == 0 || end <= bucket.offset || end > bucket_end) continue;
    if (!dtype_has_nonfinite_check(tensor.spec.dtype)) continue;
    backend_.count_nonfinite_async(arena + tensor.offset,
                                   tensor.bytes / dtype_size(tensor.spec.dtype), tensor.spec.dtype,
                                   scratch_.nonfinite_count(tensors_.size()), *stream_);
    tensors_.emplace_back(group_index, t);
  }
}

void ReceiveChecks::enqueue_bucket_checksum(const std::byte* data, std::size_t bytes,
                                            Stream& on) {
  backend_.checksum_async(data, bytes, scratch_.computed_checksum(buckets_++), on);
}

void ReceiveChecks::enqueue_results(Event* sent_block_done) {
  // The stream already waited for every data bucket (enqueue_bucket); the sender's checksum block
  // is the one event after them.
  if (checksums_) backend_.stream_wait_event(*stream_, *sent_block_done);
  scratch_.enqueue_download(backend_, *stream_);
  backend_.event_record(*results_event_, *stream_);
}

bool ReceiveChecks::results_ready(std::chrono::nanoseconds timeout) {
  return backend_.event_wait_for(*results_event_, timeout);
}

std::optional<Refusal> ReceiveChecks::compare(const std::vector<ReceiveTarget>& targets) const {
  Refusal refusal;
  refusal.transport_failed = false;  // every collective completed: the transport is healthy
  std::size_t n = 0;
  for (const ReceiveTarget& target : targets) {
    const GroupLayout& group = layout_.groups()[target.group];
    for (std::size_t k = 0; checksums_ && k < group.bucket_count(); ++k, ++n) {
      const std::uint64_t sent = scratch_.sent_checksum_on_host(n);
      const std::uint64_t got = scratch_.computed_checksum_on_host(n);
      if (sent == got) continue;
      const Bucket bucket = group.bucket(k);
      refusal.code = ErrorCode::kTransport;  // corrupted on the way
      refusal.group = group.name();
      refusal.bucket = k;
      refusal.why = fmt::format(
          "bucket {} of {} of group '{}' (bytes {}..{} of its arena) has checksum {:#018x}, but "
          "the sender's is {:#018x}: corrupted in transit",
          k, group.bucket_count(), group.name(), bucket.offset, bucket.offset + bucket.bytes, got,
          sent);
      return refusal;
    }
  }
  for (std::size_t i = 0; i < matched_.size(); ++i) {
    // An unaligned tensor is compared on the host; a checksum pair that differs is read back
    // to name the first element that differs. Both copies cross to the host once either way.
    const bool on_host = matched_[i].on_host;  // no checksums were computed for it
    const bool sums_differ = !on_host && scratch_.match_checksum_on_host(i, false) !=
                                             scratch_.match_checksum_on_host(i, true);
    if (!on_host && !sums_differ) continue;
    const std::optional<std::size_t> at = first_difference(i);
    if (at || sums_differ) return match_refusal(i, at);
  }
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const std::uint64_t count = scratch_.nonfinite_count_on_host(i);
    if (count == 0) continue;
    const auto [g, t] = tensors_[i];
    const GroupLayout& group = layout_.groups()[g];
    const TensorPlacement& tensor = group.tensors()[t];
    refusal.code = ErrorCode::kInvalidArgument;  // the trainer sent it: bad input
    refusal.group = group.name();
    refusal.tensor = tensor.spec.name;
    refusal.why = fmt::format(
        "tensor '{}' of group '{}' ({}, {} elements) holds {} NaN or infinite values "
        "(ReceiverConfig::reject_nonfinite)",
        tensor.spec.name, group.name(), dtype_name(tensor.spec.dtype),
        tensor.bytes / dtype_size(tensor.spec.dtype), count);
    return refusal;
  }
  return std::nullopt;
}

}  // namespace shadowsync
