#include "shadowsync/update_header.h"

#include <fmt/format.h>

#include "shadowsync/error.h"

namespace shadowsync {

UpdateHeader make_update_header(const Layout& layout, std::uint64_t version,
                                const std::vector<std::string>& group_names) {
  if (group_names.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("update {}: names no group (an update carries at least one)", version));
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
    if (!chosen[g]) continue;
    header.groups.push_back(static_cast<std::uint32_t>(g));
    header.bucket_count += layout.groups()[g].bucket_count();
  }
  return header;
}

void validate_update_header(const UpdateHeader& header, const Layout& layout,
                            std::uint64_t last_version) {
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
  if (header.layout_fingerprint != layout.fingerprint()) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("update {}: layout fingerprint {:#018x} of the sender differs from the "
                            "receiver's {:#018x} (tensor names, dtypes, shapes, order or bucket "
                            "size differ)",
                            header.version, header.layout_fingerprint, layout.fingerprint()));
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
  if (header.bucket_count != buckets) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update {}: bucket count {} does not match the layout's {} for {}",
                            header.version, header.bucket_count, buckets,
                            describe_groups(header, layout)));
  }
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
