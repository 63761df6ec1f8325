// The control channel's wire format: length-prefixed frames that carry the handshake, hellos, the
// rendezvous, update headers, acks, aborts and goodbyes between a trainer and its engines. Pure
// encoding and decoding, no I/O and no crypto: every field of a frame from the network is
// range-checked here before anything else looks at it (this is the code the fuzz target runs).
// Internal to the control component: the wire format is no part of the public API.
//
// A frame is a 12-byte header followed by its body (all integers little-endian):
//
//   u32 magic (kControlMagic)  u16 wire version  u16 type  u32 body length
//
// The body of the three handshake frames is their payload; every later frame's body is its
// payload followed by a 32-byte HMAC-SHA256 tag (docs/architecture.md, "Control channel").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shadowsync/control_channel.h"
#include "shadowsync/update_header.h"

namespace shadowsync {

inline constexpr std::uint32_t kControlMagic = 0x4C435353;  // "SSCL" little-endian
// Bumped whenever a frame changes meaning; a peer speaking another version is refused at its
// first frame, with both versions named. 1: the rendezvous carried an NCCL unique id only.
// 2: the rendezvous names its transport kind and carries that kind's address.
inline constexpr std::uint16_t kControlWireVersion = 2;
inline constexpr std::size_t kFrameHeaderBytes = 12;
// Control messages are small (the largest is a hello with every group's name); a small cap bounds
// what one peer can make an endpoint buffer. 64 KiB holds 256 groups of 128-byte names.
inline constexpr std::size_t kMaxFrameBodyBytes = 64 * 1024;
inline constexpr std::size_t kControlNonceBytes = 32;
inline constexpr std::size_t kControlMacBytes = 32;     // HMAC-SHA256
inline constexpr std::size_t kRendezvousIdBytes = 128;  // ncclUniqueId
inline constexpr std::size_t kMaxControlGroups = kMaxHeaderGroups;  // update_header.h
inline constexpr std::size_t kMaxGroupNameBytes = 128;
inline constexpr std::size_t kMaxControlTextBytes = 1024;  // error strings, reasons
inline constexpr std::uint32_t kMaxControlWorldSize = 1u << 16;

using ControlNonce = std::array<std::byte, kControlNonceBytes>;
using ControlMac = std::array<std::byte, kControlMacBytes>;

enum class FrameType : std::uint16_t {
  // Handshake, untagged, in this order.
  kChallenge = 1,    // engine -> trainer: the engine's fresh nonce
  kClientProof = 2,  // trainer -> engine: the trainer's nonce and its proof
  kServerProof = 3,  // engine -> trainer: the engine's proof
  // Tagged (HMAC over sequence number, frame header and payload).
  kEngineHello = 4,       // engine -> trainer
  kTrainerHello = 5,      // trainer -> engine
  kRendezvous = 6,        // trainer -> engine
  kRendezvousResult = 7,  // engine -> trainer
  kUpdateHeader = 8,      // trainer -> engine
  kAck = 9,               // engine -> trainer: applied version v at engine step s
  kUpdateError = 10,      // engine -> trainer: update v was refused or failed
  kAbort = 11,            // trainer -> engine
  kGoodbye = 12,          // either way, then the sender closes
};

// `text` cut to kMaxControlTextBytes (ending in "...") so that it fits a frame's text field.
std::string clip_control_text(std::string text);

// "update_header": for log lines.
std::string_view to_string(FrameType type) noexcept;
// True for every frame after the handshake: its body ends with a kControlMacBytes tag.
bool is_tagged(FrameType type) noexcept;
// True for the frames an engine may receive (sent by a trainer). kGoodbye goes both ways.
bool is_trainer_to_engine(FrameType type) noexcept;

// One group as a hello describes it; checked against the receiving side's layout.
struct ControlGroupInfo {
  std::string name;  // 1..kMaxGroupNameBytes printable ASCII bytes
  std::uint64_t bucket_count = 0;
  friend bool operator==(const ControlGroupInfo&, const ControlGroupInfo&) = default;
};

struct ChallengeMessage {
  ControlNonce engine_nonce{};
};
struct ClientProofMessage {
  ControlNonce trainer_nonce{};
  ControlMac proof{};
};
struct ServerProofMessage {
  ControlMac proof{};
};
struct EngineHelloMessage {
  std::uint32_t protocol_version = kProtocolVersion;
  std::uint32_t rank = 0;  // the engine's own rank (config), for logs and the trainer's bookkeeping
  std::uint64_t layout_fingerprint = 0;
  std::uint64_t last_accepted_version = 0;  // a new trainer continues above it
  std::uint64_t applied_version = 0;        // live now (0: never updated)
  std::uint64_t applied_step = 0;           // engine step at which it became live
  std::vector<ControlGroupInfo> groups;
};
struct TrainerHelloMessage {
  std::uint32_t protocol_version = kProtocolVersion;
  std::uint64_t layout_fingerprint = 0;
  std::vector<ControlGroupInfo> groups;
};
// On the wire: id u64, rank u32, world size u32, transport kind u16, then the kind's address:
// kNccl the unique id (128 bytes), kSameHost the socket path (u16 length, then 1..
// kMaxSameHostPathBytes bytes, none of them NUL). Only the kind's own field is sent; the other
// stays empty.
struct RendezvousMessage {
  std::uint64_t rendezvous_id = 0;  // echoed in the result
  std::uint32_t rank = 0;           // the engine's rank in the new communicator, < world_size
  std::uint32_t world_size = 0;     // 2..kMaxControlWorldSize
  TransportKind transport = TransportKind::kNccl;
  std::array<std::byte, kRendezvousIdBytes> unique_id{};  // kNccl: opaque (ncclUniqueId)
  std::string path;                                       // kSameHost
};
struct RendezvousResultMessage {
  std::uint64_t rendezvous_id = 0;
  bool ok = false;
  std::string error;  // empty when ok
};
struct UpdateHeaderMessage {
  UpdateHeader header;  // every field; groups at most kMaxControlGroups
};
struct AckMessage {
  std::uint64_t version = 0;
  std::uint64_t engine_step = 0;
};
struct UpdateErrorMessage {
  std::uint64_t version = 0;
  std::uint32_t code = 0;  // ErrorCode
  std::string message;
};
struct AbortMessage {
  std::uint64_t version = 0;  // the update to abort; 0: whatever is in flight
  std::string reason;
};
struct GoodbyeMessage {
  std::string reason;
};

using ControlMessage =
    std::variant<ChallengeMessage, ClientProofMessage, ServerProofMessage, EngineHelloMessage,
                 TrainerHelloMessage, RendezvousMessage, RendezvousResultMessage,
                 UpdateHeaderMessage, AckMessage, UpdateErrorMessage, AbortMessage, GoodbyeMessage>;

FrameType frame_type_of(const ControlMessage& message) noexcept;

struct FrameHeader {
  FrameType type = FrameType::kGoodbye;
  std::uint32_t body_bytes = 0;  // payload, plus the tag for tagged frames
};

// Encodes `message` as a frame: header and payload. For a tagged type the header's body length
// already counts the tag, which the caller appends. Throws Error(kInvalidArgument) for a field
// the decoder would refuse (an over-long string, too many groups), so nothing undecodable is sent.
// Thread-safe.
std::vector<std::byte> encode_frame(const ControlMessage& message);

// Checks a frame header: magic, wire version, a known type, and a body length that fits the type
// (exact for the handshake frames, at least the tag for tagged ones, at most kMaxFrameBodyBytes).
// Returns the reason it is refused, or nothing. Thread-safe.
std::optional<std::string> parse_frame_header(std::span<const std::byte> bytes, FrameHeader& out);

// Decodes a payload (the body without its tag) of a frame of `type`: every length, count and
// range is checked, the payload must be consumed exactly. Returns the reason it is refused, or
// nothing. Does not check anything against a layout. Thread-safe.
std::optional<std::string> decode_payload(FrameType type, std::span<const std::byte> payload,
                                          ControlMessage& out);

}  // namespace shadowsync
