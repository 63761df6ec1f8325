// The layout: where every weight tensor lives inside its group's contiguous arena, and how the
// arena is cut into buckets. Sender and receiver build it from the same tensor specs and must
// agree on its fingerprint before a byte moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/dtype.h"

namespace shadowsync {

inline constexpr std::string_view kBaseGroup = "base";

// Arena offsets are aligned so that every tensor starts on a boundary that vectorized kernels
// and NCCL like (256 B is what cudaMalloc guarantees for the arena base too).
inline constexpr std::size_t kTensorAlignment = 256;

// 512 MiB: the NCCL broadcast bandwidth curve on H200 is flat from 256 MiB (361 GB/s) to 4 GiB
// (370 GB/s) (measured on two H200s over NVLink); smaller buckets keep two staging buffers cheap.
inline constexpr std::size_t kDefaultBucketBytes = std::size_t{512} << 20;

// Bumped whenever the byte image or the header changes meaning; part of the fingerprint.
inline constexpr std::uint32_t kProtocolVersion = 1;

struct TensorSpec {
  std::string name;              // unique across the whole layout
  DType dtype = DType::kBFloat16;
  std::vector<std::int64_t> shape;
  std::string group = std::string(kBaseGroup);  // "base" or a LoRA adapter's name
};

// A tensor placed in its arena.
struct TensorPlacement {
  TensorSpec spec;
  std::size_t offset = 0;  // bytes from the arena start, a multiple of kTensorAlignment
  std::size_t bytes = 0;   // element count * dtype size
};

// A byte range of a group's arena: the unit of one broadcast.
struct Bucket {
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

class GroupLayout {
 public:
  const std::string& name() const { return name_; }
  const std::vector<TensorPlacement>& tensors() const { return tensors_; }
  std::size_t arena_bytes() const { return arena_bytes_; }
  std::size_t bucket_bytes() const { return bucket_bytes_; }
  std::size_t bucket_count() const;
  // Bucket k covers bytes [k*B, min((k+1)*B, arena_bytes)). Throws for k out of range.
  Bucket bucket(std::size_t k) const;
  // Index of the tensor with that name, if it is in this group.
  std::optional<std::size_t> find_tensor(std::string_view name) const;

 private:
  friend class Layout;
  std::string name_;
  std::vector<TensorPlacement> tensors_;
  std::size_t arena_bytes_ = 0;
  std::size_t bucket_bytes_ = 0;
};

struct LayoutOptions {
  std::size_t bucket_bytes = kDefaultBucketBytes;  // must be a positive multiple of kTensorAlignment
};

// Immutable once built. Groups are ordered "base" first, then adapters in order of first
// appearance in the specs; tensors keep their spec order inside a group.
class Layout {
 public:
  // Validates and places the specs. Throws Error(kInvalidArgument) for: no specs, an empty or
  // duplicate tensor name, an empty group name, a non-positive dimension, an unsupported dtype,
  // a bucket size that is zero or not a multiple of kTensorAlignment.
  static Layout build(std::vector<TensorSpec> specs, LayoutOptions options = {});

  const std::vector<GroupLayout>& groups() const { return groups_; }
  std::optional<std::size_t> find_group(std::string_view name) const;
  // Index of a group; throws Error(kInvalidArgument) naming the group and the known ones.
  std::size_t group_index(std::string_view name) const;
  std::size_t bucket_bytes() const { return bucket_bytes_; }
  std::size_t total_bytes() const;
  std::size_t tensor_count() const;

  // 64-bit hash over the canonical layout: protocol version, alignment, bucket size, and for each
  // group its name and for each tensor its name, dtype, shape and offset.
  std::uint64_t fingerprint() const { return fingerprint_; }

 private:
  std::vector<GroupLayout> groups_;
  std::size_t bucket_bytes_ = 0;
  std::uint64_t fingerprint_ = 0;
};

// "[4096, 32000]": used in error messages.
std::string format_shape(const std::vector<std::int64_t>& shape);

}  // namespace shadowsync
