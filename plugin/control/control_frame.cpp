#include "control/control_frame.h"

#include <fmt/format.h>

#include <cstring>
#include <type_traits>

#include "shadowsync/error.h"
#include "shadowsync/update_header.h"

namespace shadowsync {
namespace {

// --- writing ---------------------------------------------------------------------------------

class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  void u8(std::uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  void raw(std::span<const std::byte> v) { out_.insert(out_.end(), v.begin(), v.end()); }
  template <std::size_t N>
  void bytes(const std::array<std::byte, N>& v) {
    out_.insert(out_.end(), v.begin(), v.end());
  }
  void text(std::string_view v, std::size_t max, const char* what) {
    if (v.size() > max) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("control frame: {} of {} bytes exceeds the limit of {}", what,
                              v.size(), max));
    }
    u16(static_cast<std::uint16_t>(v.size()));
    const auto* p = reinterpret_cast<const std::byte*>(v.data());
    out_.insert(out_.end(), p, p + v.size());
  }

 private:
  void put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  }
  std::vector<std::byte>& out_;
};

bool printable(std::string_view name) {
  for (const char c : name) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

void write_groups(Writer& w, const std::vector<ControlGroupInfo>& groups) {
  if (groups.empty() || groups.size() > kMaxControlGroups) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("control frame: a hello carries 1..{} groups, not {}",
                            kMaxControlGroups, groups.size()));
  }
  w.u32(static_cast<std::uint32_t>(groups.size()));
  for (const auto& group : groups) {
    if (group.name.empty() || !printable(group.name)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("control frame: group name '{}' must be 1..{} printable ASCII bytes",
                              group.name, kMaxGroupNameBytes));
    }
    w.text(group.name, kMaxGroupNameBytes, "group name");
    w.u64(group.bucket_count);
  }
}

void write_payload(Writer& w, const ChallengeMessage& m) { w.bytes(m.engine_nonce); }
void write_payload(Writer& w, const ClientProofMessage& m) {
  w.bytes(m.trainer_nonce);
  w.bytes(m.proof);
}
void write_payload(Writer& w, const ServerProofMessage& m) { w.bytes(m.proof); }
void write_payload(Writer& w, const EngineHelloMessage& m) {
  w.u32(m.protocol_version);
  w.u32(m.rank);
  w.u64(m.layout_fingerprint);
  w.u64(m.last_accepted_version);
  w.u64(m.applied_version);
  w.u64(m.applied_step);
  write_groups(w, m.groups);
}
void write_payload(Writer& w, const TrainerHelloMessage& m) {
  w.u32(m.protocol_version);
  w.u64(m.layout_fingerprint);
  write_groups(w, m.groups);
}
// A same-host socket path as the decoder accepts it: 1..kMaxSameHostPathBytes bytes, no NUL (the
// path becomes a C string). The reason it is refused, or nothing.
std::optional<std::string> check_socket_path(std::string_view path) {
  if (path.empty() || path.size() > kMaxSameHostPathBytes) {
    return fmt::format("same-host socket path of {} bytes is not 1..{} bytes long", path.size(),
                       kMaxSameHostPathBytes);
  }
  if (path.find('\0') != std::string_view::npos) {
    return fmt::format("same-host socket path has a NUL byte at offset {}", path.find('\0'));
  }
  return std::nullopt;
}

void write_payload(Writer& w, const RendezvousMessage& m) {
  w.u64(m.rendezvous_id);
  w.u32(m.rank);
  w.u32(m.world_size);
  w.u16(static_cast<std::uint16_t>(m.transport));
  switch (m.transport) {
    case TransportKind::kNccl:
      w.bytes(m.unique_id);
      return;
    case TransportKind::kSameHost:
      if (auto error = check_socket_path(m.path)) {
        throw Error(ErrorCode::kInvalidArgument, "control frame: " + *error);
      }
      w.text(m.path, kMaxSameHostPathBytes, "same-host socket path");
      return;
  }
  throw Error(ErrorCode::kInvalidArgument,
              fmt::format("control frame: rendezvous transport kind {} is not one of 1 (nccl), "
                          "2 (same_host)",
                          static_cast<unsigned>(m.transport)));
}
void write_payload(Writer& w, const RendezvousResultMessage& m) {
  w.u64(m.rendezvous_id);
  w.u8(m.ok ? 1 : 0);
  w.text(m.error, kMaxControlTextBytes, "rendezvous error");
}
// The payload is the header's own byte form (update_header.h): one codec for every control plane.
void write_payload(Writer& w, const UpdateHeaderMessage& m) {
  w.raw(serialize_update_header(m.header));
}
void write_payload(Writer& w, const AckMessage& m) {
  w.u64(m.version);
  w.u64(m.engine_step);
}
void write_payload(Writer& w, const UpdateErrorMessage& m) {
  w.u64(m.version);
  w.u32(m.code);
  w.text(m.message, kMaxControlTextBytes, "error message");
}
void write_payload(Writer& w, const AbortMessage& m) {
  w.u64(m.version);
  w.text(m.reason, kMaxControlTextBytes, "abort reason");
}
void write_payload(Writer& w, const GoodbyeMessage& m) {
  w.text(m.reason, kMaxControlTextBytes, "goodbye reason");
}

// --- reading ---------------------------------------------------------------------------------

// Reads fields from a payload; the first failure is kept and every later read returns zeros, so a
// decoder reads straight through and checks ok() once per decision.
class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  void fail(std::string why) {
    if (error_.empty()) error_ = std::move(why);
  }
  std::uint8_t u8(const char* what) { return static_cast<std::uint8_t>(get(1, what)); }
  std::uint16_t u16(const char* what) { return static_cast<std::uint16_t>(get(2, what)); }
  std::uint32_t u32(const char* what) { return static_cast<std::uint32_t>(get(4, what)); }
  std::uint64_t u64(const char* what) { return get(8, what); }
  template <std::size_t N>
  void bytes(std::array<std::byte, N>& out, const char* what) {
    if (!take(N, what)) return;
    std::memcpy(out.data(), in_.data() + pos_ - N, N);
  }
  // A u16 length then that many bytes, at most `max`.
  std::string text(std::size_t max, const char* what) {
    const std::uint16_t length = u16(what);
    if (!ok()) return {};
    if (length > max) {
      fail(fmt::format("{} length {} exceeds the limit of {}", what, length, max));
      return {};
    }
    if (!take(length, what)) return {};
    return std::string(reinterpret_cast<const char*>(in_.data() + pos_ - length), length);
  }
  std::size_t remaining() const { return in_.size() - pos_; }
  // Everything not read yet, consumed.
  std::span<const std::byte> rest() {
    const auto tail = in_.subspan(pos_);
    pos_ = in_.size();
    return tail;
  }
  void finish() {
    if (ok() && pos_ != in_.size()) {
      fail(fmt::format("{} trailing bytes after the last field", in_.size() - pos_));
    }
  }

 private:
  bool take(std::size_t n, const char* what) {
    if (!ok()) return false;
    if (in_.size() - pos_ < n) {
      fail(fmt::format("truncated at {}: needs {} bytes, {} left", what, n, in_.size() - pos_));
      return false;
    }
    pos_ += n;
    return true;
  }
  std::uint64_t get(std::size_t n, const char* what) {
    if (!take(n, what)) return 0;
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < n; ++i) {
      v |= static_cast<std::uint64_t>(in_[pos_ - n + i]) << (8 * i);
    }
    return v;
  }

  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
  std::string error_;
};

std::vector<ControlGroupInfo> read_groups(Reader& r) {
  std::vector<ControlGroupInfo> groups;
  const std::uint32_t count = r.u32("group count");
  if (!r.ok()) return groups;
  // Each group takes at least 2 (length) + 1 (name) + 8 (bucket count) bytes: a count the payload
  // cannot hold is refused before anything is reserved.
  if (count == 0 || count > kMaxControlGroups || count > r.remaining() / 11) {
    r.fail(fmt::format("group count {} is not in 1..{} or exceeds what {} payload bytes hold",
                       count, kMaxControlGroups, r.remaining()));
    return groups;
  }
  groups.reserve(count);
  for (std::uint32_t i = 0; i < count && r.ok(); ++i) {
    ControlGroupInfo group;
    group.name = r.text(kMaxGroupNameBytes, "group name");
    group.bucket_count = r.u64("bucket count");
    if (!r.ok()) break;
    if (group.name.empty() || !printable(group.name)) {
      r.fail(
          fmt::format("group {}: name must be 1..{} printable ASCII bytes", i, kMaxGroupNameBytes));
      break;
    }
    groups.push_back(std::move(group));
  }
  return groups;
}

std::optional<std::string> decode(Reader& r, ChallengeMessage& m) {
  r.bytes(m.engine_nonce, "engine nonce");
  return {};
}
std::optional<std::string> decode(Reader& r, ClientProofMessage& m) {
  r.bytes(m.trainer_nonce, "trainer nonce");
  r.bytes(m.proof, "trainer proof");
  return {};
}
std::optional<std::string> decode(Reader& r, ServerProofMessage& m) {
  r.bytes(m.proof, "engine proof");
  return {};
}
std::optional<std::string> decode(Reader& r, EngineHelloMessage& m) {
  m.protocol_version = r.u32("protocol version");
  m.rank = r.u32("rank");
  m.layout_fingerprint = r.u64("layout fingerprint");
  m.last_accepted_version = r.u64("last accepted version");
  m.applied_version = r.u64("applied version");
  m.applied_step = r.u64("applied step");
  m.groups = read_groups(r);
  if (r.ok() && m.rank >= kMaxControlWorldSize) {
    return fmt::format("rank {} is not below the limit of {}", m.rank, kMaxControlWorldSize);
  }
  return {};
}
std::optional<std::string> decode(Reader& r, TrainerHelloMessage& m) {
  m.protocol_version = r.u32("protocol version");
  m.layout_fingerprint = r.u64("layout fingerprint");
  m.groups = read_groups(r);
  return {};
}
std::optional<std::string> decode(Reader& r, RendezvousMessage& m) {
  m.rendezvous_id = r.u64("rendezvous id");
  m.rank = r.u32("rank");
  m.world_size = r.u32("world size");
  const std::uint16_t kind = r.u16("transport kind");
  if (!r.ok()) return {};
  m.transport = static_cast<TransportKind>(kind);
  switch (m.transport) {
    case TransportKind::kNccl:
      r.bytes(m.unique_id, "unique id");
      break;
    case TransportKind::kSameHost:
      m.path = r.text(kMaxSameHostPathBytes, "same-host socket path");
      if (!r.ok()) return {};
      if (auto error = check_socket_path(m.path)) return error;
      break;
    default:
      return fmt::format("transport kind {} is not one of 1 (nccl), 2 (same_host)", kind);
  }
  if (!r.ok()) return {};
  // Both become `int` for NCCL: the bounds also keep them non-negative there.
  if (m.world_size < 2 || m.world_size > kMaxControlWorldSize) {
    return fmt::format("world size {} is not in 2..{}", m.world_size, kMaxControlWorldSize);
  }
  if (m.rank >= m.world_size) {
    return fmt::format("rank {} is not below the world size {}", m.rank, m.world_size);
  }
  return {};
}
std::optional<std::string> decode(Reader& r, RendezvousResultMessage& m) {
  m.rendezvous_id = r.u64("rendezvous id");
  const std::uint8_t ok = r.u8("ok flag");
  m.error = r.text(kMaxControlTextBytes, "rendezvous error");
  if (!r.ok()) return {};
  if (ok > 1) return fmt::format("ok flag {} is neither 0 nor 1", ok);
  m.ok = ok == 1;
  if (m.ok != m.error.empty()) return std::string("ok flag and error text disagree");
  return {};
}
std::optional<std::string> decode(Reader& r, UpdateHeaderMessage& m) {
  try {
    m.header = parse_update_header(r.rest());
  } catch (const Error& e) {
    return std::string(e.what());
  }
  for (const auto g : m.header.groups) {
    if (g >= kMaxControlGroups) {
      return fmt::format("group index {} is not below the limit of {}", g, kMaxControlGroups);
    }
  }
  return {};
}
std::optional<std::string> decode(Reader& r, AckMessage& m) {
  m.version = r.u64("version");
  m.engine_step = r.u64("engine step");
  return {};
}
std::optional<std::string> decode(Reader& r, UpdateErrorMessage& m) {
  m.version = r.u64("version");
  m.code = r.u32("error code");
  m.message = r.text(kMaxControlTextBytes, "error message");
  if (!r.ok()) return {};
  if (m.code < static_cast<std::uint32_t>(ErrorCode::kInvalidArgument) ||
      m.code > static_cast<std::uint32_t>(ErrorCode::kInternal)) {
    return fmt::format("error code {} is not a shadowsync ErrorCode", m.code);
  }
  return {};
}
std::optional<std::string> decode(Reader& r, AbortMessage& m) {
  m.version = r.u64("version");
  m.reason = r.text(kMaxControlTextBytes, "abort reason");
  return {};
}
std::optional<std::string> decode(Reader& r, GoodbyeMessage& m) {
  m.reason = r.text(kMaxControlTextBytes, "goodbye reason");
  return {};
}

template <typename Message>
std::optional<std::string> decode_as(std::span<const std::byte> payload, ControlMessage& out) {
  Reader reader(payload);
  Message message;
  const std::optional<std::string> error = decode(reader, message);
  if (!reader.ok()) return reader.error();  // truncation or a bad length comes first
  if (error) return error;
  reader.finish();
  if (!reader.ok()) return reader.error();
  out = std::move(message);
  return std::nullopt;
}

// Exact payload sizes of the handshake frames.
constexpr std::size_t kChallengeBytes = kControlNonceBytes;
constexpr std::size_t kClientProofBytes = kControlNonceBytes + kControlMacBytes;
constexpr std::size_t kServerProofBytes = kControlMacBytes;

std::uint32_t read_le(std::span<const std::byte> bytes, std::size_t offset, int n) {
  std::uint32_t v = 0;
  for (int i = 0; i < n; ++i) {
    v |= static_cast<std::uint32_t>(bytes[offset + i]) << (8 * i);
  }
  return v;
}

}  // namespace

std::string clip_control_text(std::string text) {
  if (text.size() > kMaxControlTextBytes) {
    text.resize(kMaxControlTextBytes - 3);
    text += "...";
  }
  return text;
}

std::string_view to_string(FrameType type) noexcept {
  switch (type) {
    case FrameType::kChallenge:
      return "challenge";
    case FrameType::kClientProof:
      return "client_proof";
    case FrameType::kServerProof:
      return "server_proof";
    case FrameType::kEngineHello:
      return "engine_hello";
    case FrameType::kTrainerHello:
      return "trainer_hello";
    case FrameType::kRendezvous:
      return "rendezvous";
    case FrameType::kRendezvousResult:
      return "rendezvous_result";
    case FrameType::kUpdateHeader:
      return "update_header";
    case FrameType::kAck:
      return "ack";
    case FrameType::kUpdateError:
      return "update_error";
    case FrameType::kAbort:
      return "abort";
    case FrameType::kGoodbye:
      return "goodbye";
  }
  return "unknown";
}

bool is_tagged(FrameType type) noexcept {
  return static_cast<std::uint16_t>(type) >= static_cast<std::uint16_t>(FrameType::kEngineHello);
}

bool is_trainer_to_engine(FrameType type) noexcept {
  switch (type) {
    case FrameType::kClientProof:
    case FrameType::kTrainerHello:
    case FrameType::kRendezvous:
    case FrameType::kUpdateHeader:
    case FrameType::kAbort:
    case FrameType::kGoodbye:
      return true;
    default:
      return false;
  }
}

// The variant's alternatives are in FrameType order, starting at 1.
static_assert(std::is_same_v<std::variant_alternative_t<0, ControlMessage>, ChallengeMessage>);
static_assert(std::is_same_v<std::variant_alternative_t<7, ControlMessage>, UpdateHeaderMessage>);
static_assert(std::variant_size_v<ControlMessage> == static_cast<std::size_t>(FrameType::kGoodbye));

FrameType frame_type_of(const ControlMessage& message) noexcept {
  return static_cast<FrameType>(message.index() + 1);
}

std::vector<std::byte> encode_frame(const ControlMessage& message) {
  std::vector<std::byte> frame;
  frame.reserve(64);
  Writer w(frame);
  const FrameType type = frame_type_of(message);
  w.u32(kControlMagic);
  w.u16(kControlWireVersion);
  w.u16(static_cast<std::uint16_t>(type));
  w.u32(0);  // body length, patched below
  std::visit([&](const auto& m) { write_payload(w, m); }, message);
  std::size_t body = frame.size() - kFrameHeaderBytes;
  if (is_tagged(type)) body += kControlMacBytes;
  if (body > kMaxFrameBodyBytes) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("control frame {}: body of {} bytes exceeds the limit of {}",
                            to_string(type), body, kMaxFrameBodyBytes));
  }
  for (int i = 0; i < 4; ++i) {
    frame[8 + i] = static_cast<std::byte>((body >> (8 * i)) & 0xff);
  }
  return frame;
}

std::optional<std::string> parse_frame_header(std::span<const std::byte> bytes, FrameHeader& out) {
  if (bytes.size() < kFrameHeaderBytes) {
    return fmt::format("frame header truncated: {} of {} bytes", bytes.size(), kFrameHeaderBytes);
  }
  const std::uint32_t magic = read_le(bytes, 0, 4);
  const std::uint32_t wire_version = read_le(bytes, 4, 2);
  const std::uint32_t type = read_le(bytes, 6, 2);
  const std::uint32_t body = read_le(bytes, 8, 4);
  if (magic != kControlMagic) {
    return fmt::format("bad magic {:#010x} (expected {:#010x}: not a shadowsync control peer)",
                       magic, kControlMagic);
  }
  if (wire_version != kControlWireVersion) {
    return fmt::format("wire version {} differs from this side's {}: the peer runs a shadowsync "
                       "release with another control frame layout (version 2 added the transport "
                       "kind and its address to the rendezvous); run the same release on both ends",
                       wire_version, kControlWireVersion);
  }
  if (type < static_cast<std::uint32_t>(FrameType::kChallenge) ||
      type > static_cast<std::uint32_t>(FrameType::kGoodbye)) {
    return fmt::format("unknown frame type {}", type);
  }
  const auto frame_type = static_cast<FrameType>(type);
  std::size_t exact = 0;
  switch (frame_type) {
    case FrameType::kChallenge:
      exact = kChallengeBytes;
      break;
    case FrameType::kClientProof:
      exact = kClientProofBytes;
      break;
    case FrameType::kServerProof:
      exact = kServerProofBytes;
      break;
    default:
      break;
  }
  if (exact != 0 && body != exact) {
    return fmt::format("{} frame: body length {} is not {}", to_string(frame_type), body, exact);
  }
  if (exact == 0 && (body < kControlMacBytes || body > kMaxFrameBodyBytes)) {
    return fmt::format("{} frame: body length {} is not in {}..{}", to_string(frame_type), body,
                       kControlMacBytes, kMaxFrameBodyBytes);
  }
  out.type = frame_type;
  out.body_bytes = body;
  return std::nullopt;
}

std::optional<std::string> decode_payload(FrameType type, std::span<const std::byte> payload,
                                          ControlMessage& out) {
  if (payload.size() > kMaxFrameBodyBytes) {
    return fmt::format("payload of {} bytes exceeds the limit of {}", payload.size(),
                       kMaxFrameBodyBytes);
  }
  switch (type) {
    case FrameType::kChallenge:
      return decode_as<ChallengeMessage>(payload, out);
    case FrameType::kClientProof:
      return decode_as<ClientProofMessage>(payload, out);
    case FrameType::kServerProof:
      return decode_as<ServerProofMessage>(payload, out);
    case FrameType::kEngineHello:
      return decode_as<EngineHelloMessage>(payload, out);
    case FrameType::kTrainerHello:
      return decode_as<TrainerHelloMessage>(payload, out);
    case FrameType::kRendezvous:
      return decode_as<RendezvousMessage>(payload, out);
    case FrameType::kRendezvousResult:
      return decode_as<RendezvousResultMessage>(payload, out);
    case FrameType::kUpdateHeader:
      return decode_as<UpdateHeaderMessage>(payload, out);
    case FrameType::kAck:
      return decode_as<AckMessage>(payload, out);
    case FrameType::kUpdateError:
      return decode_as<UpdateErrorMessage>(payload, out);
    case FrameType::kAbort:
      return decode_as<AbortMessage>(payload, out);
    case FrameType::kGoodbye:
      return decode_as<GoodbyeMessage>(payload, out);
  }
  return fmt::format("unknown frame type {}", static_cast<unsigned>(type));
}

}  // namespace shadowsync
