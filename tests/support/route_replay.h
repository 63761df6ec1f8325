// Routes replayed by hand, for tests of routing plans and of what moves routes: a random wire
// image, each trainer rank's packing of it, and what an engine rank's copies leave in its slot
// and staging memory (with how often each byte was written).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/routing_plan.h"
#include "shadowsync/receive_plan.h"

namespace shadowsync::testing {

inline std::vector<unsigned char> random_image(std::size_t bytes, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> image(bytes);
  for (auto& b : image) b = static_cast<unsigned char>(rng());
  return image;
}

// Each tensor of group 0 of `wire`, whole: what an engine rank with no receive plan needs.
inline std::vector<ByteRange> every_tensor(const Layout& wire) {
  std::vector<ByteRange> out;
  for (const TensorPlacement& t : wire.groups()[0].tensors()) {
    out.push_back({t.offset, t.offset + t.bytes});
  }
  return out;
}

// Each trainer rank's packing of group 0: what it holds of `image`, in wire order.
inline std::vector<std::vector<unsigned char>> packings(const std::vector<RankRanges>& trainers,
                                                        const std::vector<unsigned char>& image) {
  std::vector<std::vector<unsigned char>> packed(trainers.size());
  for (const RankRanges& t : trainers) {
    std::vector<ByteRange> held = t.ranges[0];
    std::sort(held.begin(), held.end(),
              [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
    for (const ByteRange& r : held) {
      packed[t.rank].insert(packed[t.rank].end(), image.begin() + r.begin, image.begin() + r.end);
    }
  }
  return packed;
}

// What an engine rank's receive leaves: its slot arena and its staging memory (0xEE where nothing
// was written), and how often each of their bytes was written.
struct Landed {
  std::vector<unsigned char> slot;
  std::vector<unsigned char> staging;
  std::vector<int> slot_writes;
  std::vector<int> staging_writes;
  std::size_t bytes = 0;  // written in all

  Landed(std::size_t slot_bytes, std::size_t staging_bytes)
      : slot(slot_bytes, 0xEE),
        staging(staging_bytes, 0xEE),
        slot_writes(slot_bytes, 0),
        staging_writes(staging_bytes, 0) {}

  void copy_2d(bool to_staging, std::size_t dst, std::size_t dst_pitch, const unsigned char* src,
               std::size_t src_pitch, std::size_t row_bytes, std::size_t rows) {
    auto& to = to_staging ? staging : slot;
    auto& writes = to_staging ? staging_writes : slot_writes;
    for (std::size_t r = 0; r < rows; ++r) {
      const std::size_t at = dst + r * dst_pitch;
      REQUIRE(at + row_bytes <= to.size());
      std::memcpy(to.data() + at, src + r * src_pitch, row_bytes);
      for (std::size_t i = 0; i < row_bytes; ++i) ++writes[at + i];
    }
    bytes += rows * row_bytes;
  }
};

// An engine rank's slot: as large as the furthest byte a piece of its plan writes in group 0.
inline std::size_t slot_bytes_of(const ReceivePlan& plan, std::size_t buckets) {
  std::size_t bytes = 0;
  for (std::size_t k = 0; k < buckets; ++k) {
    for (const PlanPiece& p : plan.pieces(0, k)) {
      if (!p.to_staging)
        bytes = std::max(bytes, p.dst_offset + (p.rows - 1) * p.dst_pitch + p.row_bytes);
    }
  }
  return bytes;
}

}  // namespace shadowsync::testing
