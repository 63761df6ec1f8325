// The same-host transport's wire format: fixed-size little-endian records on a Unix stream
// socket. Pure functions (no I/O, no allocation from a peer's numbers), fuzzed by
// tests/fuzz/fuzz_same_host_frame.cpp.
//
// Every record starts with magic "SSHT" (4), wire version u16 and type u16. Handshake records
// (in this order; the sender S listens, a receiver R connects):
//   1 challenge  S->R  nonce nS (32)                                              40 bytes
//   2 proof      R->S  rank u32, reserved u32 (0), nonce nR (32), mac (32)         80 bytes
//   3 accept     S->R  mac (32)                                                    40 bytes
//   4 ready      R->S  (nothing)                                                    8 bytes
//   5 setup      S->R  memory u32, world size u32, slot count u32, reserved u32,
//                      slot bytes u64, handle (64); the staging fd rides along     96 bytes
//   7 refuse     S->R  reason u32, reserved u32                                    16 bytes
// Data records, 40 bytes each:
//   6 doorbell   S->R  sequence u64, slot u32, reserved u32 (0), offset u64, bytes u64
//   8 ack        R->S  the same fields, echoing the doorbell
// The pull transport (same_host_pull_transport.h: a trainer rank T serves, each engine process E
// connects) runs challenge, proof, accept and ready as above (the proof's rank: engine rank + 1),
// then, instead of setup:
//   9 pull hello  E->T  trainer count u32, engine count u32, engine rank u32, replica u32
//                       (the engine's data-parallel replica, 0..65535), routing
//                       fingerprint u64                                             32 bytes
//  10 pull setup  T->E  memory u32, trainer rank u32, trainer count u32, engine count u32,
//                       routing fingerprint u64, slot bytes u64, handle (64); the staging fd
//                       rides along                                                104 bytes
//  11 pull refuse T->E  reason u32, trainer rank u32, trainer count u32, engine count u32,
//                       routing fingerprint u64, replicas u32, reserved u32 (0) (the trainer's
//                       own, so that the engine can name both sides' values)         40 bytes
// and its data records, 40 bytes each (bytes may be 0: a trainer rank rings for every bucket):
//  12 route doorbell T->E  update version u64, bucket sequence u64, slot u32, table records
//                          u32, bytes u64. Slot kInPlaceSlot: the bytes are read where the
//                          trainer rank's shards lie (its last shard table), not from a staging
//                          slot; table records > 0 only then: that many shard records follow
//  13 route ack      E->T  the same fields, echoing the doorbell
//  14 shard record   T->E  group u32, reserved u32 (0), packing offset u64, bytes u64,
//                          allocation offset u64, allocation bytes u64, handle (64): `bytes` of
//                          the rank's packing of the group, from `packing offset`, lie at
//                          `allocation offset` of the device allocation the CUDA IPC handle
//                          names                                                       112 bytes
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace shadowsync::same_host {

inline constexpr std::uint32_t kMagic = 0x54485353;  // "SSHT" little-endian
inline constexpr std::uint16_t kWireVersion = 3;  // 3: routes read in place
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
inline constexpr std::size_t kHandleBytes = 64;
inline constexpr std::uint32_t kSlotCount = 2;
// A route doorbell's slot when its bytes are read where the trainer rank's shards lie.
inline constexpr std::uint32_t kInPlaceSlot = 0xffffffffu;

using Nonce = std::array<std::byte, kNonceBytes>;
using Mac = std::array<std::byte, kMacBytes>;

enum class RecordType : std::uint16_t {
  kChallenge = 1,
  kProof = 2,
  kAccept = 3,
  kReady = 4,
  kSetup = 5,
  kDoorbell = 6,
  kRefuse = 7,
  kAck = 8,
  kPullHello = 9,
  kPullSetup = 10,
  kPullRefuse = 11,
  kRouteDoorbell = 12,
  kRouteAck = 13,
  kShardRecord = 14,
};

// Size of each record type, header included; 0 for an unknown type.
std::size_t record_bytes(RecordType type) noexcept;
inline constexpr std::size_t kHeaderBytes = 8;
inline constexpr std::size_t kDataRecordBytes = 40;
inline constexpr std::size_t kShardRecordBytes = 112;
// The most shard records one doorbell may announce (a peer's number sizes a read).
inline constexpr std::uint32_t kMaxShardRecords = 1u << 20;
inline constexpr std::size_t kMaxRecordBytes = 112;

// Checks magic and version and returns the type of the record that `header` (8 bytes) starts;
// on failure returns false and says why in `error`.
bool parse_record_header(std::span<const std::byte> header, RecordType& type, std::string& error);

struct Challenge {
  Nonce sender_nonce{};
};
struct Proof {
  std::uint32_t rank = 0;
  Nonce receiver_nonce{};
  Mac mac{};
};
struct Accept {
  Mac mac{};
};
struct Setup {
  std::uint32_t memory = 0;  // SameHostMemory
  std::uint32_t world_size = 0;
  std::uint32_t slot_count = kSlotCount;
  std::uint64_t slot_bytes = 0;
  std::array<std::byte, kHandleBytes> handle{};  // device flavours: what the fd does not carry
};
enum class RefuseReason : std::uint32_t { kBadProof = 1, kBadRank = 2, kRankTaken = 3 };
struct Refuse {
  RefuseReason reason = RefuseReason::kBadProof;
};

// A doorbell or an ack: chunk `sequence` of the connection is `bytes` bytes at `offset` of
// staging slot `slot`.
struct DataRecord {
  RecordType type = RecordType::kDoorbell;
  std::uint64_t sequence = 0;
  std::uint32_t slot = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

// The staging memory a doorbell must stay inside.
struct SlotGeometry {
  std::uint32_t slot_count = kSlotCount;
  std::uint64_t slot_bytes = 0;
};

// The pull transport's records (see the top of this file).
struct PullHello {
  std::uint32_t trainer_count = 0;
  std::uint32_t engine_count = 0;
  std::uint32_t engine_rank = 0;
  std::uint64_t fingerprint = 0;  // RoutingPlan::fingerprint()
  std::uint32_t replica = 0;      // which data-parallel replica of the engine this process is
};
struct PullSetup {
  std::uint32_t memory = 0;  // SameHostMemory
  std::uint32_t trainer_rank = 0;
  std::uint32_t trainer_count = 0;
  std::uint32_t engine_count = 0;
  std::uint64_t fingerprint = 0;
  std::uint64_t slot_bytes = 0;                  // each of the kSlotCount slots
  std::array<std::byte, kHandleBytes> handle{};  // device flavours: what the fd does not carry
};
enum class PullRefuseReason : std::uint32_t {
  kWorldSizeDiffers = 1,  // the hello's trainer or engine count is not the trainer's plan's
  kPlanDiffers = 2,       // the routing fingerprints differ
  kRankTaken = 3,         // another engine process already took that engine rank and replica
  kReplicaOutside = 4,    // the replica is outside the replicas this trainer rank serves
};
struct PullRefuse {
  PullRefuseReason reason = PullRefuseReason::kWorldSizeDiffers;
  std::uint32_t trainer_rank = 0;  // the trainer's view, for the engine's message
  std::uint32_t trainer_count = 0;
  std::uint32_t engine_count = 0;
  std::uint64_t fingerprint = 0;
  std::uint32_t replicas = 1;  // engine processes per engine rank
};
// Trainer rank's bucket `sequence` of update `version` is `bytes` bytes at the start of staging
// slot `slot`, or where its shards lie (kInPlaceSlot; `table_records` shard records follow when
// its shard table changed) (a doorbell); or was read by the engine process (its ack, echoing the
// doorbell).
struct RouteRecord {
  RecordType type = RecordType::kRouteDoorbell;
  std::uint64_t version = 0;
  std::uint64_t sequence = 0;
  std::uint32_t slot = 0;
  std::uint64_t bytes = 0;
  std::uint32_t table_records = 0;
  friend bool operator==(const RouteRecord&, const RouteRecord&) = default;
};
// One entry of a trainer rank's shard table: bytes [packing_offset, packing_offset + bytes) of
// its packing of group `group` lie at `allocation_offset` of the device allocation `handle`
// (a cudaIpcMemHandle_t's bytes) of `allocation_bytes`.
struct ShardRecord {
  std::uint32_t group = 0;
  std::uint64_t packing_offset = 0;
  std::uint64_t bytes = 0;
  std::uint64_t allocation_offset = 0;
  std::uint64_t allocation_bytes = 0;
  std::array<std::byte, kHandleBytes> handle{};
  friend bool operator==(const ShardRecord&, const ShardRecord&) = default;
};

// Encoders write exactly record_bytes(type) bytes.
std::array<std::byte, 40> encode(const Challenge& record);
std::array<std::byte, 80> encode(const Proof& record);
std::array<std::byte, 40> encode(const Accept& record);
std::array<std::byte, 8> encode_ready();
std::array<std::byte, 96> encode(const Setup& record);
std::array<std::byte, 16> encode(const Refuse& record);
std::array<std::byte, kDataRecordBytes> encode(const DataRecord& record);
std::array<std::byte, 32> encode(const PullHello& record);
std::array<std::byte, 104> encode(const PullSetup& record);
std::array<std::byte, 40> encode(const PullRefuse& record);
std::array<std::byte, kDataRecordBytes> encode(const RouteRecord& record);
std::array<std::byte, kShardRecordBytes> encode(const ShardRecord& record);

// Decoders take a whole record (header included) of exactly its size and check every field they
// can without context; each returns false with the reason in `error` and leaves `out` unspecified.
bool decode(std::span<const std::byte> record, Challenge& out, std::string& error);
bool decode(std::span<const std::byte> record, Proof& out, std::string& error);
bool decode(std::span<const std::byte> record, Accept& out, std::string& error);
bool decode_ready(std::span<const std::byte> record, std::string& error);
// Also checks: slot count is kSlotCount, slot bytes > 0, memory is a known flavour, world size in
// 2..65536.
bool decode(std::span<const std::byte> record, Setup& out, std::string& error);
bool decode(std::span<const std::byte> record, Refuse& out, std::string& error);
// A doorbell or ack (`expected` says which). Checks slot < slot_count, bytes > 0 and
// offset + bytes <= slot_bytes (without overflow), reserved == 0.
bool decode(std::span<const std::byte> record, RecordType expected, const SlotGeometry& geometry,
            DataRecord& out, std::string& error);

// Also checks: trainer and engine counts in 1..65536, engine rank < engine count, reserved 0.
bool decode(std::span<const std::byte> record, PullHello& out, std::string& error);
// Also checks: memory a known flavour, counts in 1..65536, trainer rank < trainer count, slot
// bytes > 0.
bool decode(std::span<const std::byte> record, PullSetup& out, std::string& error);
// Also checks: a known reason, counts in 1..65536, trainer rank < trainer count.
bool decode(std::span<const std::byte> record, PullRefuse& out, std::string& error);
// A route doorbell or ack (`expected` says which). Checks slot < slot_count or kInPlaceSlot,
// bytes <= slot_bytes (0 allowed), table records 0 unless in place and at most kMaxShardRecords.
bool decode(std::span<const std::byte> record, RecordType expected, const SlotGeometry& geometry,
            RouteRecord& out, std::string& error);
// Also checks: bytes > 0, allocation_offset + bytes <= allocation_bytes (without overflow),
// reserved == 0.
bool decode(std::span<const std::byte> record, ShardRecord& out, std::string& error);

// What a receiver's call expects of its next doorbell: the sequence it has reached and the byte
// count it was asked to receive for this chunk. Returns an empty string when `doorbell` matches,
// else the reason (a sequence never announced, a byte count of another collective).
std::string check_doorbell(const DataRecord& doorbell, std::uint64_t expected_sequence,
                           std::uint64_t expected_bytes);

const char* to_string(RefuseReason reason) noexcept;
const char* to_string(PullRefuseReason reason) noexcept;

}  // namespace shadowsync::same_host
