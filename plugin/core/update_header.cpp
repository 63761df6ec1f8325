#include "shadowsync/update_header.h"

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync {

UpdateHeader make_update_header(const Layout& layout, std::uint64_t version,
                                const std::vector<std::string>& group_names, bool checksums) {
  if (group_names.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: names no group (an update carries at least one)", version));
  }
  if (version > kMaxUpdateVersion) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: above the highest version {} (2^63 - 1), which leaves "
                            "room to count up; number updates 1, 2, 3, ...",
                            version, kMaxUpdateVersion));
  }
  std::vector<bool> chosen(layout.groups().size(), false);
  for (const auto& name : group_names) {
    const std::size_t index = layout.group_index(name);
    if (chosen[index]) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("update {}: group '{}' named twice", version, name));
    }
    chosen[index] = true;
  }
  UpdateHeader header;
  header.version = version;
  header.layout_fingerprint = layout.fingerprint();
  for (std::size_t g = 0; g < chosen.size(); ++g) {
    if (chosen[g]) header.groups.push_back(static_cast<std::uint32_t>(g));
  }
  // Plus one for the trailing checksum block.
  header.bucket_count = data_bucket_count(header, layout) + (checksums ? 1 : 0);
  return header;
}

std::uint64_t data_bucket_count(const UpdateHeader& header, const Layout& layout) {
  std::uint64_t buckets = 0;
  for (const std::uint32_t g : header.groups) {
    if (g < layout.groups().size()) buckets += layout.groups()[g].bucket_count();
  }
  return buckets;
}

bool carries_checksums(const UpdateHeader& header, const Layout& layout) {
  return header.bucket_count == data_bucket_count(header, layout) + 1;
}

void validate_update_header(const UpdateHeader& header, const Layout& layout,
                            std::uint64_t last_version) {
  validate_update_header(header, layout, last_version, 0);
}

void validate_update_header(const UpdateHeader& header, const Layout& layout,
                            std::uint64_t last_version, std::uint64_t routing_fingerprint) {
  if (header.magic != kHeaderMagic) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: magic {:#010x} is not shadowsync's {:#010x}",
                            header.magic, kHeaderMagic));
  }
  if (header.protocol_version != kProtocolVersion) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: protocol version {} differs from this receiver's {}",
                            header.protocol_version, kProtocolVersion));
  }
  if (routing_fingerprint != 0 && header.layout_fingerprint != routing_fingerprint) {
    const bool unrouted = header.layout_fingerprint == layout.fingerprint();
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("update {}: fingerprint {:#018x} of the sender differs from this "
                            "receiver's routing plan {:#018x} ({})",
                            header.version, header.layout_fingerprint, routing_fingerprint,
                            unrouted ? "the sender has no routing plan: it publishes whole "
                                       "tensors, this receiver takes the routes of trainer ranks"
                                     : "the trainer ranks' regions, the engine ranks' needs or "
                                       "the wire layout differ"));
  }
  if (routing_fingerprint == 0 && header.layout_fingerprint != layout.fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("update {}: layout fingerprint {:#018x} of the sender differs from the "
                            "receiver's {:#018x} (tensor names, dtypes, shapes, order or bucket "
                            "size differ, or the sender is a trainer rank of a routing plan and "
                            "this receiver has none: Receiver::use_routing_plan)",
                            header.version, header.layout_fingerprint, layout.fingerprint()));
  }
  if (header.version > kMaxUpdateVersion) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: above the highest version {} (2^63 - 1); versions must "
                            "leave room to count up",
                            header.version, kMaxUpdateVersion));
  }
  if (header.version <= last_version) {
    throw Error(ErrorCode::kStaleVersion,
                fmt::format("update {}: version must be greater than the last one, {}",
                            header.version, last_version));
  }
  if (header.groups.empty()) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: names no group (an update carries at least one)",
                            header.version));
  }
  std::uint64_t buckets = 0;
  for (std::size_t i = 0; i < header.groups.size(); ++i) {
    const std::uint32_t g = header.groups[i];
    if (g >= layout.groups().size()) {
      throw Error(ErrorCode::kBadHeader,
                  fmt::format("update {}: group index {} out of range (the layout has {} groups)",
                              header.version, g, layout.groups().size()));
    }
    if (i > 0 && g <= header.groups[i - 1]) {
      throw Error(ErrorCode::kBadHeader,
                  fmt::format("update {}: group indices must strictly increase, got {} after {}",
                              header.version, g, header.groups[i - 1]));
    }
    buckets += layout.groups()[g].bucket_count();
  }
  if (header.bucket_count != buckets && header.bucket_count != buckets + 1) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: bucket count {} does not match the layout's {} for {} ({} "
                            "with a checksum block)",
                            header.version, header.bucket_count, buckets,
                            describe_groups(header, layout), buckets + 1));
  }
}

namespace {

template <typename T>
void put(std::vector<std::byte>& out, T value) {
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    out.push_back(static_cast<std::byte>((static_cast<std::uint64_t>(value) >> (8 * i)) & 0xff));
  }
}

template <typename T>
T get(std::span<const std::byte> bytes, std::size_t& at) {
  std::uint64_t value = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<std::uint64_t>(bytes[at + i]) << (8 * i);
  }
  at += sizeof(T);
  return static_cast<T>(value);
}

constexpr std::size_t kFixedHeaderBytes = 4 + 4 + 8 + 8 + 4 + 8;

}  // namespace

std::vector<std::byte> serialize_update_header(const UpdateHeader& header) {
  if (header.groups.empty() || header.groups.size() > kMaxHeaderGroups) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: a header carries 1..{} groups, this one {}",
                            header.version, kMaxHeaderGroups, header.groups.size()));
  }
  std::vector<std::byte> out;
  out.reserve(kFixedHeaderBytes + 4 * header.groups.size());
  put(out, header.magic);
  put(out, header.protocol_version);
  put(out, header.version);
  put(out, header.layout_fingerprint);
  put(out, static_cast<std::uint32_t>(header.groups.size()));
  for (const std::uint32_t g : header.groups) put(out, g);
  put(out, header.bucket_count);
  return out;
}

UpdateHeader parse_update_header(std::span<const std::byte> bytes) {
  if (bytes.size() < kFixedHeaderBytes + 4) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: {} bytes, fewer than the {} of a header with one group",
                            bytes.size(), kFixedHeaderBytes + 4));
  }
  std::size_t at = 0;
  UpdateHeader header;
  header.magic = get<std::uint32_t>(bytes, at);
  if (header.magic != kHeaderMagic) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: magic {:#010x} is not shadowsync's {:#010x}",
                            header.magic, kHeaderMagic));
  }
  header.protocol_version = get<std::uint32_t>(bytes, at);
  header.version = get<std::uint64_t>(bytes, at);
  header.layout_fingerprint = get<std::uint64_t>(bytes, at);
  const auto count = get<std::uint32_t>(bytes, at);
  if (count == 0 || count > kMaxHeaderGroups) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: group count {} outside 1..{}", count,
                            kMaxHeaderGroups));
  }
  const std::size_t expected = kFixedHeaderBytes + 4 * std::size_t{count};
  if (bytes.size() != expected) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: group count {} makes {} bytes, which does not match "
                            "the {} given",
                            count, expected, bytes.size()));
  }
  header.groups.reserve(count);
  for (std::uint32_t i = 0; i < count; ++i) header.groups.push_back(get<std::uint32_t>(bytes, at));
  header.bucket_count = get<std::uint64_t>(bytes, at);
  return header;
}

std::string describe_groups(const UpdateHeader& header, const Layout& layout) {
  std::string text;
  for (const auto g : header.groups) {
    if (!text.empty()) text += '+';
    text += g < layout.groups().size() ? layout.groups()[g].name() : fmt::format("#{}", g);
  }
  return text;
}

}  // namespace shadowsync
