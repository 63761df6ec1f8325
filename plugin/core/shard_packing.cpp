// A trainer rank's pack runs and the checks of its shards; see shard_packing.h.
#include "core/shard_packing.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string_view>
#include <unordered_map>

#include "shadowsync/error.h"

namespace shadowsync {
namespace {

// A piece of the rank's packing: `bytes` of tensor `tensor` from `local` of its shard at
// `packed` of the group's packing.
struct Segment {
  std::size_t tensor = 0;
  std::size_t local = 0;
  std::size_t packed = 0;
  std::size_t bytes = 0;
};

std::string describe_ranges(const std::vector<ByteRange>& ranges, std::size_t base) {
  if (ranges.empty()) return "nothing";
  std::string out = "bytes ";
  const std::size_t shown = std::min<std::size_t>(ranges.size(), 4);
  for (std::size_t i = 0; i < shown; ++i) {
    out += fmt::format("{}{}..{}", i == 0 ? "" : ", ", ranges[i].begin - base,
                       ranges[i].end - base);
  }
  if (ranges.size() > shown) out += fmt::format(" and {} more ranges", ranges.size() - shown);
  return out;
}

std::string describe_region(const TensorRegion& region) {
  if (region.kind == TensorRegion::Kind::kElements) {
    return fmt::format("elements {}..{}", region.first, region.first + region.count);
  }
  return fmt::format("box [{}]..[{}]", fmt::join(region.begin, ", "), fmt::join(region.end, ", "));
}

}  // namespace

ShardPacking::ShardPacking(const Layout& wire, const RoutingPlan& plan, int trainer)
    : wire_(wire), trainer_(trainer) {
  const auto& groups = wire.groups();
  runs_.resize(groups.size());
  slices_.resize(groups.size());
  held_.resize(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const GroupLayout& group = groups[g];
    const auto& tensors = group.tensors();
    held_[g].resize(tensors.size());
    // The packing, cut at tensor boundaries, with each tensor's bytes counted in wire order.
    std::vector<Segment> segments;
    std::vector<std::size_t> local(tensors.size(), 0);
    std::size_t packed = 0;
    std::size_t t = 0;  // tensors are in offset order, and so are the held ranges
    for (const ByteRange& range : plan.held(trainer, g)) {
      for (std::size_t at = range.begin; at < range.end;) {
        while (t < tensors.size() && tensors[t].offset + tensors[t].bytes <= at) ++t;
        if (t == tensors.size() || tensors[t].offset > at) {
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("the routing plan has trainer rank {} hold bytes {}..{} of "
                                  "group '{}', and byte {} is no tensor's (alignment padding); "
                                  "give the ranks regions of tensors",
                                  trainer, range.begin, range.end, group.name(), at));
        }
        const std::size_t end = std::min(range.end, tensors[t].offset + tensors[t].bytes);
        segments.push_back({t, local[t], packed, end - at});
        held_[g][t].push_back({at, end});
        local[t] += end - at;
        packed += end - at;
        at = end;
      }
    }
    runs_[g].resize(group.bucket_count());
    slices_[g].resize(group.bucket_count());
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      const ByteRange slice = plan.packed_range(trainer, g, k);
      slices_[g][k] = slice;
      auto& runs = runs_[g][k];
      for (const Segment& s : segments) {
        const std::size_t begin = std::max(s.packed, slice.begin);
        const std::size_t end = std::min(s.packed + s.bytes, slice.end);
        if (begin >= end) continue;
        const std::size_t local_offset = s.local + (begin - s.packed);
        // A tensor's segments in one slice follow each other in the shard and the packing alike
        // (a Shard(1) box's rows): one run.
        if (!runs.empty() && runs.back().tensor == s.tensor &&
            runs.back().packed_offset + runs.back().bytes == begin - slice.begin &&
            runs.back().local_offset + runs.back().bytes == local_offset) {
          runs.back().bytes += end - begin;
          continue;
        }
        runs.push_back({s.tensor, local_offset, begin - slice.begin, end - begin});
      }
    }
  }
}

void ShardPacking::append_in_place_segments(std::size_t group,
                                            const std::vector<const std::byte*>& tensors,
                                            std::vector<InPlaceSegment>& out) const {
  std::size_t last_tensor = 0;
  const std::size_t first = out.size();
  for (std::size_t k = 0; k < runs_[group].size(); ++k) {
    for (const PackRun& run : runs_[group][k]) {
      const std::size_t packing = slices_[group][k].begin + run.packed_offset;
      // A tensor cut by a bucket boundary continues in the next bucket's first run.
      if (out.size() > first && last_tensor == run.tensor &&
          out.back().packing_offset + out.back().bytes == packing) {
        out.back().bytes += run.bytes;
        continue;
      }
      out.push_back({group, packing, run.bytes, tensors[run.tensor] + run.local_offset});
      last_tensor = run.tensor;
    }
  }
}

std::vector<std::vector<const std::byte*>> ShardPacking::check(
    std::uint64_t version, const std::vector<std::uint32_t>& groups,
    const std::vector<SourceShard>& shards) const {
  std::unordered_map<std::string_view, const SourceShard*> by_name;
  for (const SourceShard& shard : shards) {
    if (!by_name.emplace(shard.name, &shard).second) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: trainer rank {}: a shard of tensor '{}' given twice",
                              version, trainer_, shard.name));
    }
    bool known = false;
    for (const auto& group : wire_.groups()) known = known || group.find_tensor(shard.name);
    if (!known) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: trainer rank {}: tensor '{}' is not in the layout",
                              version, trainer_, shard.name));
    }
  }
  std::vector<std::vector<const std::byte*>> data;
  for (const std::uint32_t g : groups) {
    const GroupLayout& group = wire_.groups()[g];
    auto& group_data = data.emplace_back(group.tensors().size(), nullptr);
    for (std::size_t t = 0; t < group.tensors().size(); ++t) {
      const TensorPlacement& placement = group.tensors()[t];
      const TensorSpec& spec = placement.spec;
      const std::vector<ByteRange>& held = held_[g][t];
      if (held.empty()) continue;  // another rank sends it, or no engine rank needs it
      const auto it = by_name.find(spec.name);
      if (it == by_name.end()) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("update {}: trainer rank {} holds {} of tensor '{}' (group '{}') "
                                "in the routing plan, but no shard of it was given",
                                version, trainer_, describe_ranges(held, placement.offset),
                                spec.name, group.name()));
      }
      const SourceShard& shard = *it->second;
      if (shard.dtype != spec.dtype) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("update {}: trainer rank {}: the shard of tensor '{}' has dtype "
                                "{}, the layout {}",
                                version, trainer_, spec.name, dtype_name(shard.dtype),
                                dtype_name(spec.dtype)));
      }
      std::vector<ByteRange> given =
          shard.region.kind == TensorRegion::Kind::kBox
              ? regions_of_box(wire_, spec.name, shard.region.begin, shard.region.end)
              : std::vector<ByteRange>{regions_of_elements(wire_, spec.name, shard.region.first,
                                                           shard.region.count)};
      if (given != held) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("update {}: trainer rank {}: the shard of tensor '{}' is {} "
                                "({} of the tensor), but the routing plan has this rank hold {}; "
                                "give the region the plan was built with",
                                version, trainer_, spec.name, describe_region(shard.region),
                                describe_ranges(given, placement.offset),
                                describe_ranges(held, placement.offset)));
      }
      if (shard.data == nullptr) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("update {}: trainer rank {}: the shard of tensor '{}' has a null "
                                "data pointer",
                                version, trainer_, spec.name));
      }
      group_data[t] = static_cast<const std::byte*>(shard.data);
    }
  }
  return data;
}

}  // namespace shadowsync
