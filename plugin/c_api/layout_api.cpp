// Layouts and update headers through the C ABI.
#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>

#include "c_api/c_api_internal.h"
#include "shadowsync/update_header.h"

using namespace shadowsync;
using namespace shadowsync::c_api;

namespace {

const GroupLayout& group_at(const Layout& layout, std::size_t group) {
  if (group >= layout.groups().size()) {
    throw_invalid(fmt::format("group index {} out of range (the layout has {} groups)", group,
                              layout.groups().size()));
  }
  return layout.groups()[group];
}

// Struct version 1 ends with bucket_count; a caller's struct must hold at least that much.
constexpr std::size_t kHeaderVersion1Bytes =
    offsetof(shadowsync_update_header_t, bucket_count) + sizeof(std::uint64_t);

// The caller's size/struct_magic/struct_version prefix, checked: the bytes of its struct the
// library may read or write.
std::size_t checked_struct_bytes(const shadowsync_update_header_t& c, const char* argument) {
  if (c.struct_magic != SHADOWSYNC_CONFIG_MAGIC) {
    throw_invalid(fmt::format("'{}' (shadowsync_update_header_t): struct_magic {:#010x} is not "
                              "SHADOWSYNC_CONFIG_MAGIC {:#010x}: initialize it with "
                              "SHADOWSYNC_UPDATE_HEADER_INITIALIZER",
                              argument, c.struct_magic, SHADOWSYNC_CONFIG_MAGIC));
  }
  if (c.struct_version == 0) {
    throw_invalid(fmt::format("'{}' (shadowsync_update_header_t): struct_version 0", argument));
  }
  if (c.size < kHeaderVersion1Bytes) {
    throw_invalid(fmt::format("'{}' (shadowsync_update_header_t): size {} is smaller than struct "
                              "version 1 ({} bytes)",
                              argument, c.size, kHeaderVersion1Bytes));
  }
  return std::min(c.size, sizeof(shadowsync_update_header_t));
}

}  // namespace

namespace shadowsync::c_api {

UpdateHeader header_from_c(const shadowsync_update_header_t* header, const char* argument) {
  if (header == nullptr) throw_invalid(fmt::format("'{}' is NULL", argument));
  shadowsync_update_header_t c = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  std::memcpy(static_cast<void*>(&c), header, checked_struct_bytes(*header, argument));
  if (c.group_count == 0 || c.group_count > SHADOWSYNC_MAX_HEADER_GROUPS) {
    throw Error(ErrorCode::kBadHeader,
                fmt::format("update header: group_count {} outside 1..{}", c.group_count,
                            SHADOWSYNC_MAX_HEADER_GROUPS));
  }
  UpdateHeader cpp;
  cpp.magic = c.magic;
  cpp.protocol_version = c.protocol_version;
  cpp.version = c.version;
  cpp.layout_fingerprint = c.layout_fingerprint;
  cpp.groups.assign(c.groups, c.groups + c.group_count);
  cpp.bucket_count = c.bucket_count;
  return cpp;
}

void header_to_c(const UpdateHeader& header, shadowsync_update_header_t* out,
                 const char* argument) {
  if (out == nullptr) throw_invalid(fmt::format("output argument '{}' is NULL", argument));
  const std::size_t bytes = checked_struct_bytes(*out, argument);
  if (header.groups.size() > SHADOWSYNC_MAX_HEADER_GROUPS) {
    throw_invalid(fmt::format("update {}: {} groups, more than the C header holds ({})",
                              header.version, header.groups.size(),
                              SHADOWSYNC_MAX_HEADER_GROUPS));
  }
  shadowsync_update_header_t c = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  c.magic = header.magic;
  c.protocol_version = header.protocol_version;
  c.version = header.version;
  c.layout_fingerprint = header.layout_fingerprint;
  c.group_count = static_cast<std::uint32_t>(header.groups.size());
  std::copy(header.groups.begin(), header.groups.end(), c.groups);
  c.bucket_count = header.bucket_count;
  // The caller's size, struct_magic and struct_version stay as they are.
  constexpr std::size_t kPrefix = offsetof(shadowsync_update_header_t, magic);
  std::memcpy(reinterpret_cast<unsigned char*>(out) + kPrefix,
              reinterpret_cast<const unsigned char*>(&c) + kPrefix, bytes - kPrefix);
}

void header_bytes_to_c(const UpdateHeader& header, void* buffer, std::size_t capacity,
                       std::size_t* written) {
  const std::vector<std::byte> bytes = serialize_update_header(header);
  if (written != nullptr) *written = bytes.size();
  if (buffer == nullptr || capacity < bytes.size()) {
    throw_invalid(fmt::format("header buffer of {} bytes{} is too small for {} bytes", capacity,
                              buffer == nullptr ? " (NULL)" : "", bytes.size()));
  }
  std::memcpy(buffer, bytes.data(), bytes.size());
}

}  // namespace shadowsync::c_api

extern "C" {

shadowsync_status_t shadowsync_layout_create(const shadowsync_tensor_spec_t* specs, size_t count,
                                             size_t bucket_bytes, shadowsync_layout_t* layout) {
  return guard(__func__, [&] {
    auto& out = out_arg(layout, "layout");
    if (count > 0 && specs == nullptr) {
      throw_invalid(fmt::format("'specs' is NULL but the count is {}", count));
    }
    std::vector<TensorSpec> tensor_specs;
    tensor_specs.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
      const std::string argument = fmt::format("specs[{}]", i);
      TensorSpec spec;
      spec.name = string_arg(specs[i].name, argument + ".name");
      try {
        spec.dtype = dtype_from_string(string_arg(specs[i].dtype, argument + ".dtype"));
      } catch (const Error& e) {
        throw_invalid(fmt::format("tensor '{}': {}", spec.name, e.what()));
      }
      spec.shape = shape_arg(specs[i].shape, specs[i].ndim, argument);
      if (specs[i].group != nullptr) spec.group = specs[i].group;
      tensor_specs.push_back(std::move(spec));
    }
    LayoutOptions options;
    if (bucket_bytes != 0) options.bucket_bytes = bucket_bytes;
    auto object = std::make_shared<LayoutObject>(Layout::build(std::move(tensor_specs), options));
    out = to_handle<shadowsync_layout_t>(std::move(object));
  });
}

shadowsync_status_t shadowsync_layout_destroy(shadowsync_layout_t layout) {
  return guard(__func__, [&] { Registry::instance().remove<LayoutObject>(layout, "layout"); });
}

shadowsync_status_t shadowsync_layout_fingerprint(shadowsync_layout_t layout,
                                                  uint64_t* fingerprint) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    out_arg(fingerprint, "fingerprint") = object->layout.fingerprint();
  });
}

shadowsync_status_t shadowsync_layout_group_count(shadowsync_layout_t layout, size_t* count) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    out_arg(count, "count") = object->layout.groups().size();
  });
}

shadowsync_status_t shadowsync_layout_group_info(shadowsync_layout_t layout, size_t group,
                                                 shadowsync_group_info_t* info) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    auto& out = out_arg(info, "info");
    const GroupLayout& g = group_at(object->layout, group);
    out.name = g.name().c_str();
    out.tensor_count = g.tensors().size();
    out.arena_bytes = g.arena_bytes();
    out.bucket_bytes = g.bucket_bytes();
    out.bucket_count = g.bucket_count();
  });
}

shadowsync_status_t shadowsync_layout_tensor_info(shadowsync_layout_t layout, size_t group,
                                                  size_t tensor, shadowsync_tensor_info_t* info) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    auto& out = out_arg(info, "info");
    const GroupLayout& g = group_at(object->layout, group);
    if (tensor >= g.tensors().size()) {
      throw_invalid(fmt::format("tensor index {} out of range (group '{}' has {} tensors)", tensor,
                                g.name(), g.tensors().size()));
    }
    const TensorPlacement& placement = g.tensors()[tensor];
    out.name = placement.spec.name.c_str();
    out.dtype = dtype_name(placement.spec.dtype).data();
    out.shape = placement.spec.shape.data();
    out.ndim = placement.spec.shape.size();
    out.offset = placement.offset;
    out.bytes = placement.bytes;
  });
}

shadowsync_status_t shadowsync_layout_find_tensor(shadowsync_layout_t layout, const char* name,
                                                  size_t* group, size_t* tensor) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    const std::string_view wanted = string_arg(name, "name");
    const auto& groups = object->layout.groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      if (auto t = groups[g].find_tensor(wanted)) {
        out_arg(group, "group") = g;
        out_arg(tensor, "tensor") = *t;
        return;
      }
    }
    throw_invalid(fmt::format("tensor '{}' is not in the layout", wanted));
  });
}

shadowsync_status_t shadowsync_layout_find_group(shadowsync_layout_t layout, const char* name,
                                                 size_t* group) {
  return guard(__func__, [&] {
    auto object = lookup<LayoutObject>(layout, "layout");
    out_arg(group, "group") = object->layout.group_index(string_arg(name, "name"));
  });
}

shadowsync_status_t shadowsync_header_serialize(const shadowsync_update_header_t* header,
                                                void* buffer, size_t capacity, size_t* written) {
  return guard(__func__, [&] {
    header_bytes_to_c(header_from_c(header, "header"), buffer, capacity, written);
  });
}

shadowsync_status_t shadowsync_header_parse(const void* bytes, size_t size,
                                            shadowsync_update_header_t* header) {
  return guard(__func__, [&] {
    if (header == nullptr) throw_invalid("output argument 'header' is NULL");
    if (bytes == nullptr && size > 0) throw_invalid("'bytes' is NULL");
    header_to_c(parse_update_header({static_cast<const std::byte*>(bytes), size}), header,
                "header");
  });
}

}  // extern "C"
