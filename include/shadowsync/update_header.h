// The update header: what the trainer announces before a byte of an update moves. The control
// plane carries it; the receiver checks it against its layout before it posts a receive.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shadowsync/layout.h"

namespace shadowsync {

inline constexpr std::uint32_t kHeaderMagic = 0x59534853;  // "SHSY" little-endian

struct UpdateHeader {
  std::uint32_t magic = kHeaderMagic;
  std::uint32_t protocol_version = kProtocolVersion;
  std::uint64_t version = 0;             // strictly increasing per sender
  std::uint64_t layout_fingerprint = 0;  // Layout::fingerprint() of the sender
  std::vector<std::uint32_t> groups;     // group indices, strictly increasing, at least one
  // The broadcasts to expect: the sum of the groups' bucket counts, plus one when a checksum
  // block follows the buckets (see carries_checksums).
  std::uint64_t bucket_count = 0;
};

// Builds the header of an update of `group_names` at `version`, with a trailing checksum block
// when `checksums`. Throws Error(kInvalidArgument) for an empty list, an unknown or repeated group.
UpdateHeader make_update_header(const Layout& layout, std::uint64_t version,
                                const std::vector<std::string>& group_names,
                                bool checksums = false);

// Per-bucket checksums travel as one more broadcast after the update's last bucket: a block of
// one 8-byte checksum per bucket, in broadcast order (SenderConfig::checksums). The header says
// so by counting that broadcast: bucket_count is the groups' bucket count plus one. Why not a flag
// field: the count is what both ends must agree on anyway (every rank makes the same collectives),
// and the header's wire form, the control channel's frame and the C ABI's struct stay as they
// are; a receiver that predates checksums refuses such a header with a clear bucket-count error
// instead of joining a collective it does not expect. For a header that passed
// validate_update_header.
bool carries_checksums(const UpdateHeader& header, const Layout& layout);

// The groups' buckets alone (the header's bucket_count without the checksum block).
std::uint64_t data_bucket_count(const UpdateHeader& header, const Layout& layout);

// Checks a received header against the local layout and the last version accepted. Throws
// Error (kBadHeader, kLayoutMismatch, kStaleVersion) naming the field and both values.
void validate_update_header(const UpdateHeader& header, const Layout& layout,
                            std::uint64_t last_version);
// The same for the receiver of a sharded trainer's routes (DESIGN §14; `routing_fingerprint`
// nonzero): a routed update's header carries the routing plan's fingerprint (which covers the
// wire layout and every route) in place of the layout's, so that routed and unrouted ends refuse
// each other's updates (kLayoutMismatch, naming the routing plan). 0: no routing plan, as above.
void validate_update_header(const UpdateHeader& header, const Layout& layout,
                            std::uint64_t last_version, std::uint64_t routing_fingerprint);

// The header as bytes, for control planes that carry opaque bytes (vLLM's collective_rpc, the C
// ABI, Python). Little-endian: magic u32, protocol version u32, version u64, fingerprint u64,
// group count u32, the group indices u32 each, bucket count u64 (the field order of the control
// channel's update_header frame). At most kMaxHeaderGroups groups.
inline constexpr std::size_t kMaxHeaderGroups = 256;
// The highest version an update may carry: versions only grow, so one near 2^64 would leave no
// room for the next (a trainer's "last + 1" would wrap to 0 and be refused as stale forever).
inline constexpr std::uint64_t kMaxUpdateVersion = (std::uint64_t{1} << 63) - 1;
inline constexpr std::size_t kMaxHeaderBytes = 4 + 4 + 8 + 8 + 4 + 4 * kMaxHeaderGroups + 8;

// Throws Error(kInvalidArgument) for no group or more than kMaxHeaderGroups. Thread-safe.
std::vector<std::byte> serialize_update_header(const UpdateHeader& header);

// Checks the structure only (length, group count, magic): throws Error(kBadHeader) naming the
// field and both values. The fields are checked against a layout by validate_update_header.
// Thread-safe.
UpdateHeader parse_update_header(std::span<const std::byte> bytes);

// "base+lora_a": for logs.
std::string describe_groups(const UpdateHeader& header, const Layout& layout);

}  // namespace shadowsync
