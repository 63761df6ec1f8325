#include "core/routing_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/hash64.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

[[noreturn]] void refuse(std::string message) {
  throw Error(ErrorCode::kInvalidArgument, std::move(message));
}

std::vector<ByteRange> merged(std::vector<ByteRange> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    if (!out.empty() && r.begin <= out.back().end) {
      out.back().end = std::max(out.back().end, r.end);
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// "bytes 16..32 of tensor 'q' (group 'base')", or the arena's padding between tensors.
std::string describe(const GroupLayout& group, ByteRange r) {
  for (const TensorPlacement& t : group.tensors()) {
    if (r.begin >= t.offset && r.begin < t.offset + t.bytes) {
      return fmt::format("bytes {}..{} of tensor '{}' (group '{}')", r.begin - t.offset,
                         std::min(r.end, t.offset + t.bytes) - t.offset, t.spec.name,
                         group.name());
    }
  }
  return fmt::format("bytes {}..{} of group '{}' (padding between tensors)", r.begin, r.end,
                     group.name());
}

// The ranks of `lists`, which must be 0..count-1 each once: the lists by rank. One refusal names
// every rank that is missing, outside or given twice, so that a wrong world size or a rank
// numbered from 1 shows at once.
std::vector<const RankRanges*> by_rank(const std::vector<RankRanges>& lists, const char* side,
                                       std::size_t groups) {
  if (lists.empty()) refuse(fmt::format("a routing plan needs at least one {} rank", side));
  const std::size_t count = lists.size();
  std::vector<const RankRanges*> out(count, nullptr);
  std::vector<std::string> outside;
  std::vector<std::string> twice;
  for (const RankRanges& r : lists) {
    if (r.rank < 0 || static_cast<std::size_t>(r.rank) >= count) {
      outside.push_back(fmt::format("rank {} outside", r.rank));
    } else if (out[r.rank] != nullptr) {
      twice.push_back(fmt::format("rank {} given twice", r.rank));
    } else {
      out[r.rank] = &r;
    }
  }
  std::vector<std::string> problems;
  for (std::size_t rank = 0; rank < count; ++rank) {
    if (out[rank] == nullptr) problems.push_back(fmt::format("rank {} missing", rank));
  }
  problems.insert(problems.end(), outside.begin(), outside.end());
  problems.insert(problems.end(), twice.begin(), twice.end());
  if (!problems.empty()) {
    refuse(fmt::format("{} ranks 0..{} expected ({} lists given, one per rank): {}", side,
                       count - 1, count, fmt::join(problems, ", ")));
  }
  for (const RankRanges* r : out) {
    if (r->ranges.size() != groups) {
      refuse(fmt::format("{} rank {} gives ranges of {} groups; the wire layout has {}", side,
                         r->rank, r->ranges.size(), groups));
    }
  }
  return out;
}

struct Holder {
  ByteRange range;
  int trainer = 0;
  std::size_t source_offset = 0;  // of range.begin in the trainer's packing of the group
};

}  // namespace

RoutingPlan RoutingPlan::build(const Layout& wire, const std::vector<RankRanges>& trainers,
                               const std::vector<RankRanges>& engines) {
  const auto& groups = wire.groups();
  const auto trainer_lists = by_rank(trainers, "trainer", groups.size());
  const auto engine_lists = by_rank(engines, "engine", groups.size());
  RoutingPlan plan;
  plan.trainer_count_ = static_cast<int>(trainers.size());
  plan.engine_count_ = static_cast<int>(engines.size());
  plan.bytes_to_.assign(engines.size(), 0);
  plan.bytes_from_.assign(trainers.size(), 0);
  plan.routes_.resize(groups.size());
  plan.packed_.resize(groups.size());
  plan.held_.assign(trainers.size(), std::vector<std::vector<ByteRange>>(groups.size()));
  plan.max_packed_.assign(trainers.size(), 0);
  const auto check_inside = [&](const ByteRange& r, const char* side, int rank, std::size_t g) {
    if (r.begin >= r.end || r.end > groups[g].arena_bytes()) {
      refuse(fmt::format("{} rank {}: bytes {}..{} of group '{}' are empty or outside its arena "
                         "of {} bytes",
                         side, rank, r.begin, r.end, groups[g].name(), groups[g].arena_bytes()));
    }
  };
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const GroupLayout& group = groups[g];
    plan.routes_[g].resize(group.bucket_count());
    // What each trainer rank holds, packed in wire order; no byte held twice.
    std::vector<Holder> holders;
    for (const RankRanges* t : trainer_lists) {
      for (const ByteRange& r : t->ranges[g]) check_inside(r, "trainer", t->rank, g);
      std::size_t packed = 0;
      plan.held_[t->rank][g] = merged(t->ranges[g]);
      for (const ByteRange& r : plan.held_[t->rank][g]) {
        holders.push_back({r, t->rank, packed});
        packed += r.end - r.begin;
      }
    }
    std::sort(holders.begin(), holders.end(),
              [](const Holder& a, const Holder& b) { return a.range.begin < b.range.begin; });
    for (std::size_t k = 1; k < holders.size(); ++k) {
      const Holder& a = holders[k - 1];
      const Holder& b = holders[k];
      if (b.range.begin >= a.range.end) continue;
      refuse(fmt::format("trainer ranks {} and {} both hold {}; each byte is sent by one rank (a "
                         "replicated tensor by the rank the caller names)",
                         a.trainer, b.trainer,
                         describe(group, {b.range.begin, std::min(a.range.end, b.range.end)})));
    }
    // Each engine rank's needs, cut by holder and by bucket.
    for (const RankRanges* e : engine_lists) {
      for (const ByteRange& r : e->ranges[g]) check_inside(r, "engine", e->rank, g);
      for (const ByteRange& need : merged(e->ranges[g])) {
        auto h = std::upper_bound(holders.begin(), holders.end(), need.begin,
                                  [](std::size_t at, const Holder& x) {
                                    return at < x.range.end;
                                  });
        std::size_t at = need.begin;
        while (at < need.end) {
          if (h == holders.end() || h->range.begin > at) {
            const std::size_t gap_end =
                h == holders.end() ? need.end : std::min(need.end, h->range.begin);
            refuse(fmt::format("engine rank {} needs {}, which no trainer rank holds", e->rank,
                               describe(group, {at, gap_end})));
          }
          const std::size_t end = std::min(need.end, h->range.end);
          for (std::size_t piece = at; piece < end;) {
            const std::size_t bucket = piece / group.bucket_bytes();
            const std::size_t piece_end =
                std::min(end, (bucket + 1) * group.bucket_bytes());
            plan.routes_[g][bucket].push_back(
                {h->trainer, e->rank, g, bucket, piece,
                 h->source_offset + (piece - h->range.begin), piece_end - piece});
            plan.bytes_to_[e->rank] += piece_end - piece;
            plan.bytes_from_[h->trainer] += piece_end - piece;
            piece = piece_end;
          }
          at = end;
          ++h;
        }
      }
    }
    // What each trainer rank packs per bucket: from the first to the last byte its routes of
    // the bucket read (in wire order, so one slice of its packing of the group).
    plan.packed_[g].assign(group.bucket_count(), std::vector<ByteRange>(trainers.size()));
    for (std::size_t k = 0; k < group.bucket_count(); ++k) {
      auto& bucket = plan.routes_[g][k];
      std::sort(bucket.begin(), bucket.end(), [](const Route& a, const Route& b) {
        return std::tie(a.trainer, a.engine, a.wire_offset) <
               std::tie(b.trainer, b.engine, b.wire_offset);
      });
      std::vector<bool> seen(trainers.size(), false);
      for (const Route& r : bucket) {
        ByteRange& packed = plan.packed_[g][k][r.trainer];
        const ByteRange read{r.source_offset, r.source_offset + r.bytes};
        packed = seen[r.trainer] ? ByteRange{std::min(packed.begin, read.begin),
                                             std::max(packed.end, read.end)}
                                 : read;
        seen[r.trainer] = true;
      }
      for (std::size_t t = 0; t < trainers.size(); ++t) {
        const ByteRange& packed = plan.packed_[g][k][t];
        plan.max_packed_[t] = std::max(plan.max_packed_[t], packed.end - packed.begin);
      }
    }
  }
  Hash64 hash;
  hash.add(wire.fingerprint()).add(trainers.size()).add(engines.size());
  for (const auto& group : plan.routes_) {
    for (const auto& bucket : group) {
      hash.add(bucket.size());
      for (const Route& r : bucket) {
        hash.add(static_cast<std::uint64_t>(r.trainer)).add(static_cast<std::uint64_t>(r.engine));
        hash.add(r.wire_offset).add(r.source_offset).add(r.bytes);
      }
    }
  }
  plan.fingerprint_ = hash.value();
  plan.wire_fingerprint_ = wire.fingerprint();
  return plan;
}

namespace {

const TensorPlacement& wire_tensor(const Layout& wire, const std::string& tensor) {
  for (const GroupLayout& g : wire.groups()) {
    if (auto t = g.find_tensor(tensor)) return g.tensors()[*t];
  }
  throw Error(ErrorCode::kLayoutMismatch,
              fmt::format("tensor '{}' is not in the wire layout", tensor));
}

}  // namespace

std::vector<ByteRange> regions_of_box(const Layout& wire, const std::string& tensor,
                                      const std::vector<std::int64_t>& begin,
                                      const std::vector<std::int64_t>& end) {
  const TensorPlacement& t = wire_tensor(wire, tensor);
  const auto& shape = t.spec.shape;
  bool bad = begin.size() != shape.size() || end.size() != shape.size();
  for (std::size_t d = 0; !bad && d < shape.size(); ++d) {
    bad = begin[d] < 0 || begin[d] >= end[d] || end[d] > shape[d];
  }
  if (bad) {
    refuse(fmt::format("tensor '{}' of shape {}: the box {}..{} is empty or outside it", tensor,
                       format_shape(shape), format_shape(begin), format_shape(end)));
  }
  const std::size_t element = dtype_size(t.spec.dtype);
  std::vector<std::size_t> stride(shape.size(), element);
  for (std::size_t d = shape.size(); d-- > 1;) {
    stride[d - 1] = stride[d] * static_cast<std::size_t>(shape[d]);
  }
  std::vector<ByteRange> out;
  if (shape.empty()) return {{t.offset, t.offset + t.bytes}};
  const std::size_t last = shape.size() - 1;
  const std::size_t row = static_cast<std::size_t>(end[last] - begin[last]) * element;
  std::vector<std::int64_t> index(begin.begin(), begin.end());
  for (;;) {
    std::size_t at = t.offset;
    for (std::size_t d = 0; d < shape.size(); ++d) at += static_cast<std::size_t>(index[d]) * stride[d];
    out.push_back({at, at + row});
    std::size_t d = last;
    while (d > 0 && ++index[d - 1] == end[d - 1]) {
      index[d - 1] = begin[d - 1];
      --d;
    }
    if (d == 0) break;
  }
  return merged(std::move(out));
}

ByteRange regions_of_elements(const Layout& wire, const std::string& tensor, std::int64_t first,
                              std::int64_t count) {
  const TensorPlacement& t = wire_tensor(wire, tensor);
  const std::size_t element = dtype_size(t.spec.dtype);
  const auto elements = static_cast<std::int64_t>(t.bytes / element);
  if (first < 0 || count <= 0 || first + count > elements) {
    refuse(fmt::format("tensor '{}' of {} elements: elements {}..{} are empty or outside it",
                       tensor, elements, first, first + count));
  }
  return {t.offset + static_cast<std::size_t>(first) * element,
          t.offset + static_cast<std::size_t>(first + count) * element};
}

std::vector<std::vector<ByteRange>> needed_by(const ReceivePlan& plan) {
  const auto& groups = plan.wire().groups();
  std::vector<std::vector<ByteRange>> out(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::vector<ByteRange> ranges;
    for (std::size_t b = 0; b < groups[g].bucket_count(); ++b) {
      const std::size_t base = groups[g].bucket(b).offset;
      for (const PlanPiece& p : plan.pieces(g, b)) {
        for (std::size_t r = 0; r < p.rows; ++r) {
          const std::size_t at = base + p.src_offset + r * p.src_pitch;
          ranges.push_back({at, at + p.row_bytes});
        }
      }
    }
    out[g] = merged(std::move(ranges));
  }
  return out;
}

}  // namespace shadowsync
