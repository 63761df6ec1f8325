// Copies of routes read in place; see in_place_copies.h.
#include "core/in_place_copies.h"

#include <algorithm>

namespace shadowsync {
namespace {

// The segment holding packing byte `at`, or null.
const InPlaceSegment* segment_at(std::span<const InPlaceSegment> segments, std::size_t at) {
  auto it = std::upper_bound(
      segments.begin(), segments.end(), at,
      [](std::size_t offset, const InPlaceSegment& s) { return offset < s.packing_offset; });
  if (it == segments.begin()) return nullptr;
  --it;
  return at - it->packing_offset < it->bytes ? &*it : nullptr;
}

// Appends the pieces of the linear run [at, at + bytes) of the packing to `dst`; false when a
// byte of it lies in no segment.
bool address_run(std::span<const InPlaceSegment> segments, std::size_t at, std::size_t bytes,
                 std::byte* dst, std::vector<AddressedCopy>& out) {
  while (bytes > 0) {
    const InPlaceSegment* s = segment_at(segments, at);
    if (s == nullptr) return false;
    const std::size_t within = at - s->packing_offset;
    const std::size_t n = std::min(bytes, s->bytes - within);
    out.push_back({s->address + within, n, dst, n, n, 1});
    at += n;
    dst += n;
    bytes -= n;
  }
  return true;
}

}  // namespace

bool address_in_place(const RouteCopy& copy, std::size_t packed_begin,
                      std::span<const InPlaceSegment> segments, std::byte* dst,
                      std::vector<AddressedCopy>& out) {
  if (copy.rows == 0 || copy.row_bytes == 0) return true;
  const std::size_t first = packed_begin + copy.packed_offset;
  const std::size_t extent = (copy.rows - 1) * copy.src_pitch + copy.row_bytes;
  std::byte* target = dst + copy.dst_offset;
  const InPlaceSegment* whole = segment_at(segments, first);
  if (whole != nullptr && first - whole->packing_offset + extent <= whole->bytes) {
    out.push_back({whole->address + (first - whole->packing_offset), copy.src_pitch, target,
                   copy.dst_pitch, copy.row_bytes, copy.rows});
    return true;
  }
  const std::size_t before = out.size();
  for (std::size_t r = 0; r < copy.rows; ++r) {
    if (!address_run(segments, first + r * copy.src_pitch, copy.row_bytes,
                     target + r * copy.dst_pitch, out)) {
      out.resize(before);
      return false;
    }
  }
  return true;
}

bool address_route_copy(const RouteCopy& copy, const std::byte* packed, std::size_t packed_begin,
                        std::span<const InPlaceSegment> segments, std::byte* dst,
                        std::vector<AddressedCopy>& out) {
  if (packed == nullptr) return address_in_place(copy, packed_begin, segments, dst, out);
  if (copy.rows > 0 && copy.row_bytes > 0) {
    out.push_back({packed + copy.packed_offset, copy.src_pitch, dst + copy.dst_offset,
                   copy.dst_pitch, copy.row_bytes, copy.rows});
  }
  return true;
}

}  // namespace shadowsync
