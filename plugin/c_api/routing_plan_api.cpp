// Routing plans of sharded trainers through the C ABI: regions to wire ranges, an engine rank's
// needs (a receiver's, or a receive plan's without a receiver), and the plan's routes
// (core/routing_plan.h).
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "c_api/c_api_internal.h"
#include "core/routing_plan.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

// The capacity-and-count convention of the header: *count is always the number there is; a
// smaller capacity writes nothing and is refused naming both.
template <typename C, typename Cpp, typename Convert>
void write_array(const std::vector<Cpp>& items, C* out, std::size_t capacity, std::size_t* count,
                 const char* argument, Convert convert) {
  out_arg(count, "count") = items.size();
  if (capacity < items.size()) {
    throw_invalid(
        fmt::format("'{}' holds {} entries (capacity), {} are needed: call again with "
                    "a capacity of *count",
                    argument, capacity, items.size()));
  }
  if (!items.empty() && out == nullptr) {
    throw_invalid(fmt::format("'{}' is NULL but the capacity is {}", argument, capacity));
  }
  for (std::size_t i = 0; i < items.size(); ++i) out[i] = convert(items[i]);
}

struct GroupRange {
  std::size_t group;
  ByteRange range;
};

void write_ranges(const std::vector<GroupRange>& ranges, shadowsync_wire_range_t* out,
                  std::size_t capacity, std::size_t* count) {
  write_array(ranges, out, capacity, count, "ranges", [](const GroupRange& r) {
    return shadowsync_wire_range_t{static_cast<std::uint32_t>(r.group), 0, r.range.begin,
                                   r.range.end};
  });
}

// Per-group ranges (needed_by, every_tensor) as the header's array of wire ranges.
void write_needed(const std::vector<std::vector<ByteRange>>& needed, shadowsync_wire_range_t* out,
                  std::size_t capacity, std::size_t* count) {
  std::vector<GroupRange> ranges;
  for (std::size_t g = 0; g < needed.size(); ++g) {
    for (const ByteRange& r : needed[g]) ranges.push_back({g, r});
  }
  write_ranges(ranges, out, capacity, count);
}

// `lists[i]` as RankRanges over the groups of `wire`; `side` ("trainers", "engines") names the
// argument in refusals. Ranks are checked by RoutingPlan::build.
std::vector<RankRanges> rank_ranges_arg(const Layout& wire, const shadowsync_rank_ranges_t* lists,
                                        std::size_t count, const char* side) {
  if (count > 0 && lists == nullptr) {
    throw_invalid(fmt::format("'{}' is NULL but the count is {}", side, count));
  }
  const std::size_t groups = wire.groups().size();
  std::vector<RankRanges> out;
  out.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const shadowsync_rank_ranges_t& list = lists[i];
    if (list.count > 0 && list.ranges == nullptr) {
      throw_invalid(
          fmt::format("'{}[{}].ranges' is NULL but its count is {}", side, i, list.count));
    }
    RankRanges ranks{list.rank, std::vector<std::vector<ByteRange>>(groups)};
    for (std::size_t j = 0; j < list.count; ++j) {
      const shadowsync_wire_range_t& r = list.ranges[j];
      if (r.group >= groups || r.reserved != 0) {
        throw_invalid(
            fmt::format("'{}[{}].ranges[{}]' (rank {}): group {} with reserved {}; the "
                        "wire layout has groups 0..{} and reserved must be 0",
                        side, i, j, list.rank, r.group, r.reserved, groups - 1));
      }
      ranks.ranges[r.group].push_back({r.begin, r.end});
    }
    out.push_back(std::move(ranks));
  }
  return out;
}

// `ndim` indices at `values` (a box's corner).
std::vector<std::int64_t> index_arg(const std::int64_t* values, std::size_t ndim,
                                    const char* argument) {
  if (ndim > 0 && values == nullptr) {
    throw_invalid(fmt::format("'{}' is NULL but region->ndim is {}", argument, ndim));
  }
  constexpr std::size_t kMaxDims = 64;  // a corrupt ndim must not allocate gigabytes
  if (ndim > kMaxDims)
    throw_invalid(fmt::format("region->ndim is {}, more than {}", ndim, kMaxDims));
  return std::vector<std::int64_t>(values, values + ndim);
}

// The index of the group that holds `tensor` (regions_of_box and regions_of_elements have
// refused a tensor the layout does not have).
std::size_t group_of(const Layout& layout, const std::string& tensor) {
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    if (layout.groups()[g].find_tensor(tensor)) return g;
  }
  return 0;
}

// Every tensor of `layout`, per group: what an engine rank without a receive plan reads.
std::vector<std::vector<ByteRange>> every_tensor(const Layout& layout) {
  std::vector<std::vector<ByteRange>> out;
  for (const GroupLayout& g : layout.groups()) {
    auto& ranges = out.emplace_back();
    for (const TensorPlacement& t : g.tensors()) ranges.push_back({t.offset, t.offset + t.bytes});
  }
  return out;
}

void check_rank(const RoutingPlanObject& object, std::int32_t rank, bool trainer) {
  const int count = trainer ? object.plan.trainer_count() : object.plan.engine_count();
  if (rank < 0 || rank >= count) {
    throw_invalid(fmt::format("{} rank {} is outside the routing plan's ranks 0..{}",
                              trainer ? "trainer" : "engine", rank, count - 1));
  }
}

void check_bucket(const RoutingPlanObject& object, std::size_t group, std::size_t bucket) {
  const auto& groups = object.wire.groups();
  if (group >= groups.size()) {
    throw_invalid(fmt::format("group index {} out of range (the wire layout has {} groups)", group,
                              groups.size()));
  }
  if (bucket >= groups[group].bucket_count()) {
    throw_invalid(fmt::format("bucket {} out of range (group '{}' has {} buckets)", bucket,
                              groups[group].name(), groups[group].bucket_count()));
  }
}

}  // namespace

extern "C" {

shadowsync_status_t shadowsync_layout_region_ranges(shadowsync_layout_t layout,
                                                    const shadowsync_tensor_region_t* region,
                                                    shadowsync_wire_range_t* ranges,
                                                    size_t capacity, size_t* count) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    if (region == nullptr) throw_invalid("'region' is NULL");
    const std::string tensor = string_arg(region->tensor, "region->tensor");
    std::vector<ByteRange> found;
    switch (region->kind) {
      case SHADOWSYNC_REGION_BOX:
        found = regions_of_box(object->layout, tensor,
                               index_arg(region->begin, region->ndim, "region->begin"),
                               index_arg(region->end, region->ndim, "region->end"));
        break;
      case SHADOWSYNC_REGION_ELEMENTS:
        found = {regions_of_elements(object->layout, tensor, region->first, region->count)};
        break;
      default:
        throw_invalid(
            fmt::format("region of tensor '{}': kind {} is not SHADOWSYNC_REGION_BOX "
                        "(0) or SHADOWSYNC_REGION_ELEMENTS (1)",
                        tensor, region->kind));
    }
    const std::size_t group = group_of(object->layout, tensor);
    std::vector<GroupRange> out;
    for (const ByteRange& r : found) out.push_back({group, r});
    write_ranges(out, ranges, capacity, count);
  });
}

shadowsync_status_t shadowsync_receiver_needed_ranges(shadowsync_receiver_t receiver,
                                                      shadowsync_wire_range_t* ranges,
                                                      size_t capacity, size_t* count) {
  return guard(__func__, [&] {
    auto object = lookup<ReceiverObject>(receiver, "receiver");
    const ReceivePlan* plan = object->receiver->plan();
    write_needed(plan != nullptr ? needed_by(*plan) : every_tensor(object->receiver->layout()),
                 ranges, capacity, count);
  });
}

shadowsync_status_t shadowsync_receive_plan_needed_ranges(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_plan_quantization_t* quantized, size_t quantized_count,
    shadowsync_wire_range_t* ranges, size_t capacity, size_t* count) {
  return guard(__func__, [&] {
    auto engine = lookup<LayoutObject>(layout, "layout");
    if (wire_layout == nullptr) {
      write_needed(every_tensor(engine->layout), ranges, capacity, count);
      return;
    }
    auto wire = lookup<LayoutObject>(wire_layout, "wire_layout");
    write_needed(needed_by(plan_arg(wire->layout, engine->layout, copies, copy_count, quantized,
                                    quantized_count)),
                 ranges, capacity, count);
  });
}

shadowsync_status_t shadowsync_routing_plan_create(
    shadowsync_layout_t wire_layout, const shadowsync_rank_ranges_t* trainers, size_t trainer_count,
    const shadowsync_rank_ranges_t* engines, size_t engine_count, shadowsync_routing_plan_t* plan) {
  return guard(__func__, [&] {
    auto& out = out_arg(plan, "plan");
    auto wire = lookup<LayoutObject>(wire_layout, "wire_layout");
    const Layout& layout = wire->layout;
    const auto held = rank_ranges_arg(layout, trainers, trainer_count, "trainers");
    std::vector<RankRanges> needed;
    if (engines == nullptr && engine_count == 0) {
      needed.push_back({0, every_tensor(layout)});  // one engine rank needing every byte
    } else {
      needed = rank_ranges_arg(layout, engines, engine_count, "engines");
    }
    auto object =
        std::make_shared<RoutingPlanObject>(layout, RoutingPlan::build(layout, held, needed));
    out = to_handle<shadowsync_routing_plan_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_routing_plan_destroy(shadowsync_routing_plan_t plan) {
  return guard(__func__, [&] { Registry::instance().remove<RoutingPlanObject>(plan, "plan"); });
}

shadowsync_status_t shadowsync_routing_plan_info(shadowsync_routing_plan_t plan,
                                                 shadowsync_routing_plan_info_t* info) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    auto& out = out_arg(info, "info");
    if (out.size < sizeof(out.size)) {
      throw_invalid(
          fmt::format("info->size is {}: set it to sizeof(shadowsync_routing_plan_info_t) "
                      "({}), e.g. with SHADOWSYNC_ROUTING_PLAN_INFO_INITIALIZER",
                      out.size, sizeof(shadowsync_routing_plan_info_t)));
    }
    shadowsync_routing_plan_info_t full{};
    full.size = out.size;
    full.trainer_count = object->plan.trainer_count();
    full.engine_count = object->plan.engine_count();
    full.fingerprint = object->plan.fingerprint();
    const auto& groups = object->wire.groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (std::size_t k = 0; k < groups[g].bucket_count(); ++k) {
        full.route_count += object->plan.routes(g, k).size();
      }
    }
    std::memcpy(static_cast<void*>(&out), &full, std::min(out.size, sizeof(full)));
  });
}

shadowsync_status_t shadowsync_routing_plan_bytes_to_engine(shadowsync_routing_plan_t plan,
                                                            int32_t engine, uint64_t* bytes) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    auto& out = out_arg(bytes, "bytes");
    check_rank(*object, engine, false);
    out = object->plan.bytes_to(engine);
  });
}

shadowsync_status_t shadowsync_routing_plan_bytes_from_trainer(shadowsync_routing_plan_t plan,
                                                               int32_t trainer, uint64_t* bytes) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    auto& out = out_arg(bytes, "bytes");
    check_rank(*object, trainer, true);
    out = object->plan.bytes_from(trainer);
  });
}

shadowsync_status_t shadowsync_routing_plan_packed_range(shadowsync_routing_plan_t plan,
                                                         int32_t trainer, size_t group,
                                                         size_t bucket, uint64_t* begin,
                                                         uint64_t* end) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    auto& out_begin = out_arg(begin, "begin");
    auto& out_end = out_arg(end, "end");
    check_rank(*object, trainer, true);
    check_bucket(*object, group, bucket);
    const ByteRange packed = object->plan.packed_range(trainer, group, bucket);
    out_begin = packed.begin;
    out_end = packed.end;
  });
}

shadowsync_status_t shadowsync_routing_plan_max_packed_bytes(shadowsync_routing_plan_t plan,
                                                             int32_t trainer, uint64_t* bytes) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    auto& out = out_arg(bytes, "bytes");
    check_rank(*object, trainer, true);
    out = object->plan.max_packed_bytes(trainer);
  });
}

shadowsync_status_t shadowsync_routing_plan_routes(shadowsync_routing_plan_t plan, size_t group,
                                                   size_t bucket, shadowsync_route_t* routes,
                                                   size_t capacity, size_t* count) {
  return guard(__func__, [&] {
    auto object = lookup<RoutingPlanObject>(plan, "plan");
    check_bucket(*object, group, bucket);
    write_array(object->plan.routes(group, bucket), routes, capacity, count, "routes",
                [](const Route& r) {
                  return shadowsync_route_t{r.trainer,
                                            r.engine,
                                            static_cast<std::uint32_t>(r.group),
                                            0,
                                            r.bucket,
                                            r.wire_offset,
                                            r.source_offset,
                                            r.bytes};
                });
  });
}

}  // extern "C"
