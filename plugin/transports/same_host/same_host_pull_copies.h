// Internal to the same-host pull transport: how an engine rank of the device flavour enqueues the
// copies of a bucket it pulls. They run on the receiver's low-priority stream while the engine
// decodes on the same GPU, so the copies that can go as flat regions go as one batch with
// CopyHint::kBesideCompute (on CUDA: cudaMemcpyFlagPreferOverlapWithCompute, the copy engines
// rather than the SMs), the others as 2-D copies. SHADOWSYNC_PULL_COPIES=plain keeps every copy a
// 2-D copy, to compare. Not installed; no CUDA (unit-tested on the CPU).
#pragma once

#include <span>

#include "core/in_place_copies.h"
#include "shadowsync/backend.h"

namespace shadowsync::same_host {

inline constexpr const char* kPullCopiesEnv = "SHADOWSYNC_PULL_COPIES";

enum class PullCopies {
  kBesideCompute,  // "beside_compute", the default: contiguous copies batched with the hint
  kPlain,          // "plain": one memcpy_2d_async per copy
};

// The mode `value` (SHADOWSYNC_PULL_COPIES's value; null or empty: unset) names. Throws
// Error(kInvalidArgument) naming the variable, the value and the accepted values for any other.
// Thread-safe.
PullCopies pull_copies_from(const char* value);

// The mode of this process's environment, read at each call (once per transport: when an engine
// rank connects). Throws as pull_copies_from. Thread-safe as far as getenv is.
PullCopies pull_copies_from_environment();

// Enqueues `copies` on `stream` through `backend`, in any order among themselves. kPlain: one
// memcpy_2d_async each. kBesideCompute: those whose rows are contiguous on both sides (one row,
// or both pitches equal to the row) as one region each of a single
// memcpy_batch_async(CopyHint::kBesideCompute), the rest one memcpy_2d_async each. Returns once
// enqueued. One thread at a time per stream.
void enqueue_pull_copies(Backend& backend, std::span<const AddressedCopy> copies, Stream& stream,
                         PullCopies mode);

}  // namespace shadowsync::same_host
