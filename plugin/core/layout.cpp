#include "shadowsync/layout.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <unordered_map>

#include "core/hash64.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

std::size_t align_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The most bytes an arena may span: far above any model, and low enough that aligning an offset,
// adding a tensor and summing the groups cannot wrap a size_t.
constexpr std::size_t kMaxArenaBytes = std::size_t{1} << 56;

// Element count times dtype size, with the checks that make it meaningful.
std::size_t tensor_bytes(const TensorSpec& spec) {
  if (spec.shape.empty()) {
    // A scalar is a 1-element tensor, as in torch.
    return dtype_size(spec.dtype);
  }
  std::size_t elements = 1;
  for (const auto dim : spec.shape) {
    if (dim <= 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor '{}': shape {} has a non-positive dimension {}", spec.name,
                              format_shape(spec.shape), dim));
    }
    const auto d = static_cast<std::size_t>(dim);
    if (elements > SIZE_MAX / d) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor '{}': shape {} overflows", spec.name, format_shape(spec.shape)));
    }
    elements *= d;
  }
  const std::size_t element_bytes = dtype_size(spec.dtype);
  if (elements > kMaxArenaBytes / element_bytes) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("tensor '{}': shape {} of {} is {} elements of {} bytes, more than the "
                            "{} bytes a layout's arena may hold; check the shape",
                            spec.name, format_shape(spec.shape), dtype_name(spec.dtype), elements,
                            element_bytes, kMaxArenaBytes));
  }
  return elements * element_bytes;
}

}  // namespace

std::string format_shape(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::size_t GroupLayout::bucket_count() const {
  return (arena_bytes_ + bucket_bytes_ - 1) / bucket_bytes_;
}

Bucket GroupLayout::bucket(std::size_t k) const {
  const std::size_t count = bucket_count();
  if (k >= count) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("group '{}': bucket {} out of range (the group has {} buckets)", name_,
                            k, count));
  }
  const std::size_t begin = k * bucket_bytes_;
  return Bucket{begin, std::min(bucket_bytes_, arena_bytes_ - begin)};
}

std::optional<std::size_t> GroupLayout::find_tensor(std::string_view name) const {
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].spec.name == name) return i;
  }
  return std::nullopt;
}

Layout Layout::build(std::vector<TensorSpec> specs, LayoutOptions options) {
  if (specs.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "layout: no tensor specs given");
  }
  if (options.bucket_bytes == 0 || options.bucket_bytes % kTensorAlignment != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("layout: bucket size {} B must be a positive multiple of {} B",
                            options.bucket_bytes, kTensorAlignment));
  }

  Layout layout;
  layout.bucket_bytes_ = options.bucket_bytes;

  // "base" first, then adapters by first appearance: the order is part of the fingerprint, so it
  // must not depend on anything but the specs.
  std::vector<std::string> group_order;
  for (const auto& spec : specs) {
    if (spec.group.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor '{}': empty group name", spec.name));
    }
    bool seen = false;
    for (const auto& g : group_order) seen = seen || g == spec.group;
    if (!seen) group_order.push_back(spec.group);
  }
  std::stable_partition(group_order.begin(), group_order.end(),
                        [](const std::string& g) { return g == kBaseGroup; });

  std::unordered_map<std::string, std::size_t> group_of_name;
  for (const auto& g : group_order) {
    group_of_name.emplace(g, layout.groups_.size());
    GroupLayout group;
    group.name_ = g;
    group.bucket_bytes_ = options.bucket_bytes;
    layout.groups_.push_back(std::move(group));
  }

  std::unordered_map<std::string_view, std::size_t> index_of_tensor;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    if (spec.name.empty()) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor #{} of group '{}': empty name", i, spec.group));
    }
    if (auto [it, inserted] = index_of_tensor.emplace(spec.name, i); !inserted) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor '{}': duplicate name (specs #{} and #{})", spec.name,
                              it->second, i));
    }
  }

  for (auto& spec : specs) {
    const std::size_t bytes = tensor_bytes(spec);  // validates dtype and shape
    GroupLayout& group = layout.groups_[group_of_name.at(spec.group)];
    const std::size_t offset = align_up(group.arena_bytes_, kTensorAlignment);
    // Both below kMaxArenaBytes (2^56): the sum cannot wrap.
    if (offset + bytes > kMaxArenaBytes) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("tensor '{}' ({} bytes at offset {}) takes group '{}' past the {} "
                              "bytes a layout's arena may hold; check the shapes",
                              spec.name, bytes, offset, spec.group, kMaxArenaBytes));
    }
    group.arena_bytes_ = offset + bytes;
    group.tensors_.push_back(TensorPlacement{std::move(spec), offset, bytes});
  }

  Hash64 hash;
  hash.add(std::uint64_t{kProtocolVersion}).add(std::uint64_t{kTensorAlignment});
  hash.add(std::uint64_t{layout.bucket_bytes_}).add(std::uint64_t{layout.groups_.size()});
  for (const auto& group : layout.groups_) {
    hash.add(group.name_).add(std::uint64_t{group.tensors_.size()});
    for (const auto& t : group.tensors_) {
      hash.add(t.spec.name).add(std::uint64_t{static_cast<std::uint8_t>(t.spec.dtype)});
      hash.add(std::uint64_t{t.spec.shape.size()});
      for (const auto dim : t.spec.shape) hash.add(static_cast<std::uint64_t>(dim));
      hash.add(std::uint64_t{t.offset});
    }
  }
  layout.fingerprint_ = hash.value();
  return layout;
}

std::optional<std::size_t> Layout::find_group(std::string_view name) const {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i].name() == name) return i;
  }
  return std::nullopt;
}

std::size_t Layout::group_index(std::string_view name) const {
  if (auto index = find_group(name)) return *index;
  std::string known;
  for (const auto& g : groups_) known += (known.empty() ? "" : ", ") + g.name();
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("unknown group '{}' (the layout has: {})", name, known));
}

std::size_t Layout::total_bytes() const {
  std::size_t total = 0;
  for (const auto& g : groups_) total += g.arena_bytes();
  return total;
}

std::size_t Layout::tensor_count() const {
  std::size_t total = 0;
  for (const auto& g : groups_) total += g.tensors().size();
  return total;
}

}  // namespace shadowsync
