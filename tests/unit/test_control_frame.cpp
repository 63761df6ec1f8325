// The control channel's wire format: every frame type round-trips, and every length, count and
// range field that is too big, too small, or "negative" (all-ones, where the value becomes an
// int on the other side) is refused with a reason, as is every truncation. The rendezvous names
// its transport (NCCL: the unique id; same host: the socket path), and a peer of the previous wire
// version is told apart by its frame header.
#include <catch2/catch.hpp>

#include <fmt/format.h>

#include <cstring>

#include "control/control_frame.h"
#include "control/frame_assembler.h"
#include "shadowsync/error.h"

using namespace shadowsync;

namespace {

std::vector<ControlMessage> samples() {
  ControlNonce nonce{};
  ControlMac mac{};
  for (std::size_t i = 0; i < nonce.size(); ++i) nonce[i] = static_cast<std::byte>(i);
  for (std::size_t i = 0; i < mac.size(); ++i) mac[i] = static_cast<std::byte>(255 - i);
  RendezvousMessage rendezvous;
  rendezvous.rendezvous_id = 7;
  rendezvous.rank = 1;
  rendezvous.world_size = 2;
  rendezvous.unique_id[0] = std::byte{0x42};
  UpdateHeader header;
  header.version = 9;
  header.layout_fingerprint = 0x1234;
  header.groups = {0, 2};
  header.bucket_count = 5;
  return {
      ChallengeMessage{nonce},
      ClientProofMessage{nonce, mac},
      ServerProofMessage{mac},
      EngineHelloMessage{kProtocolVersion, 3, 0xabc, 10, 9, 1000, {{"base", 4}, {"lora", 1}}},
      TrainerHelloMessage{kProtocolVersion, 0xabc, {{"base", 4}, {"lora", 1}}},
      rendezvous,
      RendezvousResultMessage{7, false, "nccl init failed"},
      UpdateHeaderMessage{header},
      AckMessage{9, 1234},
      UpdateErrorMessage{9, static_cast<std::uint32_t>(ErrorCode::kStaleVersion), "stale"},
      AbortMessage{9, "optimizer diverged"},
      GoodbyeMessage{"done"},
  };
}

// The payload of an encoded frame (without header; tagged frames get no tag from encode_frame).
std::vector<std::byte> payload_of(const ControlMessage& message) {
  const std::vector<std::byte> frame = encode_frame(message);
  return {frame.begin() + kFrameHeaderBytes, frame.end()};
}

std::optional<std::string> decode(FrameType type, const std::vector<std::byte>& payload) {
  ControlMessage out;
  return decode_payload(type, payload, out);
}

void put(std::vector<std::byte>& bytes, std::size_t offset, std::uint64_t value, int width) {
  REQUIRE(offset + static_cast<std::size_t>(width) <= bytes.size());
  for (int i = 0; i < width; ++i) {
    bytes[offset + i] = static_cast<std::byte>((value >> (8 * i)) & 0xff);
  }
}

// The payload with the field at `offset` (`width` bytes) set to `value`.
std::vector<std::byte> patched(const ControlMessage& message, std::size_t offset,
                               std::uint64_t value, int width) {
  std::vector<std::byte> payload = payload_of(message);
  put(payload, offset, value, width);
  return payload;
}

// A field and the values it must refuse.
struct BadField {
  const char* name;
  std::size_t offset;
  int width;
  std::vector<std::uint64_t> values;
};

}  // namespace

TEST_CASE("every frame type round-trips through encode, header parse and decode") {
  for (const ControlMessage& message : samples()) {
    const FrameType type = frame_type_of(message);
    INFO(to_string(type));
    std::vector<std::byte> frame = encode_frame(message);
    if (is_tagged(type)) frame.resize(frame.size() + kControlMacBytes);  // the tag's place
    FrameHeader header;
    REQUIRE_FALSE(parse_frame_header(frame, header));
    CHECK(header.type == type);
    CHECK(header.body_bytes == frame.size() - kFrameHeaderBytes);
    const std::size_t payload_end = frame.size() - (is_tagged(type) ? kControlMacBytes : 0);
    ControlMessage decoded;
    const std::span<const std::byte> payload(frame.data() + kFrameHeaderBytes,
                                             payload_end - kFrameHeaderBytes);
    REQUIRE_FALSE(decode_payload(type, payload, decoded));
    CHECK(encode_frame(decoded) == encode_frame(message));
  }
}

TEST_CASE("a frame header is refused for a bad magic, version, type or body length") {
  for (const ControlMessage& message : samples()) {
    const FrameType type = frame_type_of(message);
    INFO(to_string(type));
    const std::vector<std::byte> good = encode_frame(message);
    const std::uint32_t body = static_cast<std::uint32_t>(good.size() - kFrameHeaderBytes +
                                                          (is_tagged(type) ? kControlMacBytes : 0));
    FrameHeader header;
    auto refused = [&](std::size_t offset, std::uint64_t value, int width) {
      std::vector<std::byte> frame(good.begin(), good.begin() + kFrameHeaderBytes);
      put(frame, offset, value, width);
      return parse_frame_header(frame, header);
    };
    // Length field: too big, "negative", too small.
    CHECK(refused(8, kMaxFrameBodyBytes + 1, 4));
    CHECK(refused(8, 0xffffffffu, 4));
    CHECK(refused(8, 0x80000000u, 4));
    CHECK(refused(8, 0, 4));
    if (is_tagged(type)) {
      CHECK(refused(8, kControlMacBytes - 1, 4));  // cannot even hold the tag
    } else {
      CHECK(refused(8, body - 1, 4));  // handshake frames have one exact size
      CHECK(refused(8, body + 1, 4));
    }
    CHECK_FALSE(refused(8, body, 4));
    CHECK(refused(0, kControlMagic ^ 1, 4));
    CHECK(refused(4, kControlWireVersion + 1, 2));
    CHECK(refused(4, 0xffff, 2));
  }
  FrameHeader header;
  std::vector<std::byte> frame = encode_frame(GoodbyeMessage{});
  for (const std::uint64_t type : {0ull, 13ull, 0x7fffull, 0xffffull}) {
    put(frame, 6, type, 2);
    const auto error = parse_frame_header(std::span(frame).first(kFrameHeaderBytes), header);
    REQUIRE(error);
    CHECK_THAT(*error, Catch::Contains("unknown frame type"));
  }
  CHECK(parse_frame_header(std::span(frame).first(kFrameHeaderBytes - 1), header));
}

TEST_CASE("every truncation and every extra byte of a payload is refused") {
  for (const ControlMessage& message : samples()) {
    const FrameType type = frame_type_of(message);
    INFO(to_string(type));
    const std::vector<std::byte> payload = payload_of(message);
    for (std::size_t size = 0; size < payload.size(); ++size) {
      INFO("truncated to " << size);
      CHECK(decode(type, {payload.begin(), payload.begin() + size}));
    }
    std::vector<std::byte> longer = payload;
    longer.push_back(std::byte{0});
    const auto error = decode(type, longer);
    REQUIRE(error);
    CHECK_THAT(*error, Catch::Contains("trailing") || Catch::Contains("does not match"));
  }
}

TEST_CASE("every length, count and range field inside a payload is range-checked") {
  const auto all = samples();
  auto sample = [&](FrameType type) { return all[static_cast<std::size_t>(type) - 1]; };
  // Offsets follow the field order of control_frame.h (all little-endian).
  const std::vector<std::pair<FrameType, BadField>> cases = {
      // Hellos: group count too big, zero, "negative", one more or one less than present; name
      // length too big, zero, beyond the payload.
      {FrameType::kEngineHello, {"rank", 4, 4, {kMaxControlWorldSize, 0xffffffffu}}},
      {FrameType::kEngineHello, {"group count", 40, 4, {0, 1, 3, 257, 0xffffffffu, 0x80000000u}}},
      {FrameType::kEngineHello, {"group name length", 44, 2, {0, 5, 129, 0xffff, 0x8000}}},
      {FrameType::kEngineHello, {"group name length (short)", 44, 2, {3}}},
      {FrameType::kTrainerHello, {"group count", 12, 4, {0, 1, 3, 257, 0xffffffffu}}},
      {FrameType::kTrainerHello, {"group name length", 16, 2, {0, 3, 5, 129, 0xffff}}},
      // Rendezvous: world size and rank become ints for NCCL.
      {FrameType::kRendezvous,
       {"rank", 8, 4, {2, 3, kMaxControlWorldSize, 0x7fffffffu, 0x80000000u, 0xffffffffu}}},
      {FrameType::kRendezvous,
       {"world size", 12, 4, {0, 1, kMaxControlWorldSize + 1, 0x80000000u, 0xffffffffu}}},
      {FrameType::kRendezvous, {"transport kind", 16, 2, {0, 3, 0x7fff, 0xffff}}},
      {FrameType::kRendezvousResult, {"ok flag", 8, 1, {1, 2, 0xff}}},
      {FrameType::kRendezvousResult, {"error length", 9, 2, {0, 15, 17, 1025, 0xffff}}},
      // Update header: group count against what follows and the limit; group indices.
      {FrameType::kUpdateHeader, {"group count", 24, 4, {0, 1, 3, 257, 0xffffffffu, 0x80000000u}}},
      {FrameType::kUpdateHeader, {"group index", 28, 4, {256, 0xffffffffu, 0x80000000u}}},
      {FrameType::kUpdateError, {"error code", 8, 4, {0, 11, 0xffffffffu}}},
      {FrameType::kUpdateError, {"message length", 12, 2, {0, 4, 6, 1025, 0xffff}}},
      {FrameType::kAbort, {"reason length", 8, 2, {0, 17, 19, 1025, 0xffff}}},
      {FrameType::kGoodbye, {"reason length", 0, 2, {0, 3, 5, 1025, 0xffff}}},
  };
  for (const auto& [type, field] : cases) {
    for (const std::uint64_t value : field.values) {
      INFO(fmt::format("{} {} = {:#x}", to_string(type), field.name, value));
      CHECK(decode(type, patched(sample(type), field.offset, value, field.width)));
    }
  }
}

TEST_CASE("the encoder refuses what the decoder would refuse") {
  std::string long_text(kMaxControlTextBytes + 1, 'x');
  CHECK_THROWS_AS(encode_frame(GoodbyeMessage{long_text}), Error);
  CHECK_THROWS_AS(encode_frame(TrainerHelloMessage{1, 2, {}}), Error);
  CHECK_THROWS_AS(encode_frame(TrainerHelloMessage{1, 2, {{"bad\nname", 1}}}), Error);
  CHECK_THROWS_AS(
      encode_frame(TrainerHelloMessage{1, 2, {{std::string(kMaxGroupNameBytes + 1, 'g'), 1}}}),
      Error);
  UpdateHeader header;
  header.groups.resize(kMaxControlGroups + 1);
  CHECK_THROWS_AS(encode_frame(UpdateHeaderMessage{header}), Error);
  // The largest legal hello still fits a frame.
  TrainerHelloMessage big;
  for (std::size_t g = 0; g < kMaxControlGroups; ++g) {
    big.groups.push_back({std::string(kMaxGroupNameBytes, static_cast<char>('a' + g % 26)), g});
  }
  CHECK(encode_frame(big).size() <= kFrameHeaderBytes + kMaxFrameBodyBytes);
}

TEST_CASE("the assembler splits a byte stream into frames whatever the chunking") {
  std::vector<std::byte> stream;
  std::vector<FrameType> types;
  for (const ControlMessage& message : samples()) {
    std::vector<std::byte> frame = encode_frame(message);
    if (is_tagged(frame_type_of(message))) frame.resize(frame.size() + kControlMacBytes);
    stream.insert(stream.end(), frame.begin(), frame.end());
    types.push_back(frame_type_of(message));
  }
  for (const std::size_t chunk : {std::size_t{1}, std::size_t{5}, std::size_t{64}, stream.size()}) {
    INFO("chunk " << chunk);
    FrameAssembler assembler;
    std::vector<FrameType> seen;
    for (std::size_t offset = 0; offset < stream.size(); offset += chunk) {
      const std::size_t n = std::min(chunk, stream.size() - offset);
      assembler.feed(std::span(stream).subspan(offset, n));
      for (;;) {
        const auto status = assembler.next();
        REQUIRE(status != FrameAssembler::Status::kMalformed);
        if (status == FrameAssembler::Status::kNeedMore) break;
        seen.push_back(assembler.header().type);
      }
    }
    CHECK(seen == types);
    CHECK_FALSE(assembler.has_partial());
  }
}

TEST_CASE("the assembler refuses an oversized frame before buffering its body") {
  std::vector<std::byte> frame = encode_frame(GoodbyeMessage{"x"});
  put(frame, 8, 0xffffffffu, 4);
  FrameAssembler assembler;
  assembler.feed(std::span(frame).first(kFrameHeaderBytes));
  CHECK(assembler.next() == FrameAssembler::Status::kMalformed);
  CHECK_THAT(assembler.error(), Catch::Contains("body length 4294967295"));
  // Once malformed, it stays so: the stream cannot be resynchronized.
  assembler.feed(encode_frame(GoodbyeMessage{}));
  CHECK(assembler.next() == FrameAssembler::Status::kMalformed);
}

namespace {

RendezvousMessage same_host_rendezvous(std::string path) {
  RendezvousMessage message;
  message.rendezvous_id = 3;
  message.rank = 2;
  message.world_size = 3;
  message.transport = TransportKind::kSameHost;
  message.path = std::move(path);
  return message;
}

}  // namespace

TEST_CASE("a same-host rendezvous carries its socket path; bad kinds and paths are refused") {
  const std::string path = "/run/user/1000/shadowsync/trainer.sock";
  const std::vector<std::byte> payload = payload_of(same_host_rendezvous(path));
  // id u64, rank u32, world size u32, kind u16 = 2, then the path as a u16-length text.
  REQUIRE(payload.size() == 18 + 2 + path.size());
  CHECK(payload[16] == std::byte{2});
  ControlMessage decoded;
  REQUIRE_FALSE(decode_payload(FrameType::kRendezvous, payload, decoded));
  const auto& message = std::get<RendezvousMessage>(decoded);
  CHECK(message.transport == TransportKind::kSameHost);
  CHECK(message.path == path);
  CHECK(message.rank == 2);
  CHECK(message.world_size == 3);
  CHECK(message.unique_id == std::array<std::byte, kRendezvousIdBytes>{});
  CHECK(payload_of(decoded) == payload);  // canonical

  // The NCCL rendezvous: kind 1, then the 128-byte unique id, no path.
  RendezvousMessage nccl;
  nccl.rank = 1;
  nccl.world_size = 2;
  nccl.unique_id[5] = std::byte{9};
  const std::vector<std::byte> nccl_payload = payload_of(nccl);
  CHECK(nccl_payload.size() == 18 + kRendezvousIdBytes);
  CHECK(nccl_payload[16] == std::byte{1});
  // Both kinds' bodies under the other kind's tag: refused, not misread.
  std::vector<std::byte> swapped = payload;
  put(swapped, 16, 1, 2);
  CHECK(decode(FrameType::kRendezvous, swapped));
  swapped = nccl_payload;
  put(swapped, 16, 2, 2);
  CHECK(decode(FrameType::kRendezvous, swapped));

  // Unknown kinds are named.
  for (const std::uint64_t kind : {0ull, 3ull, 0xffffull}) {
    const auto error = decode(FrameType::kRendezvous, patched(nccl, 16, kind, 2));
    REQUIRE(error);
    CHECK_THAT(*error, Catch::Contains(fmt::format("transport kind {} is not one of", kind)));
  }
  // The path's length: empty, beyond the limit, or beyond what is present.
  for (const std::uint64_t length :
       {std::uint64_t{0}, std::uint64_t{kMaxSameHostPathBytes + 1}, std::uint64_t{0xffff},
        std::uint64_t{path.size() - 1}, std::uint64_t{path.size() + 1}}) {
    INFO("path length " << length);
    CHECK(decode(FrameType::kRendezvous,
                 patched(same_host_rendezvous(path), 18, length, 2)));
  }
  // A NUL byte inside the path (it becomes a C string on the engine).
  std::vector<std::byte> nul = payload;
  nul[20 + 4] = std::byte{0};
  const auto nul_error = decode(FrameType::kRendezvous, nul);
  REQUIRE(nul_error);
  CHECK_THAT(*nul_error, Catch::Contains("NUL byte at offset 4"));
  // The longest path fits.
  CHECK_FALSE(decode(FrameType::kRendezvous,
                     payload_of(same_host_rendezvous(std::string(kMaxSameHostPathBytes, 'p')))));

  // The encoder refuses the same, so nothing undecodable is sent.
  CHECK_THROWS_AS(encode_frame(same_host_rendezvous("")), Error);
  CHECK_THROWS_AS(encode_frame(same_host_rendezvous(std::string(kMaxSameHostPathBytes + 1, 'p'))),
                  Error);
  CHECK_THROWS_AS(encode_frame(same_host_rendezvous(std::string("a\0b", 3))), Error);
  RendezvousMessage unknown = nccl;
  unknown.transport = static_cast<TransportKind>(7);
  CHECK_THROWS_WITH(encode_frame(unknown), Catch::Contains("transport kind 7 is not one of"));
}

TEST_CASE("a frame of the previous wire version (an NCCL-only rendezvous) is told apart") {
  // Version 1's rendezvous had no transport kind: its frames are refused at the header, with
  // both versions named, before any field of the body is read.
  for (const ControlMessage& message : samples()) {
    std::vector<std::byte> frame = encode_frame(message);
    put(frame, 4, 1, 2);
    FrameHeader header;
    const auto error = parse_frame_header(std::span(frame).first(kFrameHeaderBytes), header);
    REQUIRE(error);
    CHECK_THAT(*error, Catch::Contains("wire version 1 differs from this side's 2") &&
                           Catch::Contains("run the same release on both ends"));
  }
}
