#include "transports/same_host/same_host_frame.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace shadowsync::same_host {
namespace {

class Writer {
 public:
  // Every record starts with its header: magic, wire version, type.
  Writer(std::span<std::byte> out, RecordType type) : out_(out) {
    u32(kMagic);
    u16(kWireVersion);
    u16(static_cast<std::uint16_t>(type));
  }
  void u16(std::uint16_t v) { put(v, 2); }
  void u32(std::uint32_t v) { put(v, 4); }
  void u64(std::uint64_t v) { put(v, 8); }
  void bytes(std::span<const std::byte> b) {
    std::copy(b.begin(), b.end(), out_.begin() + static_cast<std::ptrdiff_t>(at_));
    at_ += b.size();
  }

 private:
  void put(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_[at_++] = static_cast<std::byte>((v >> (8 * i)) & 0xff);
  }
  std::span<std::byte> out_;
  std::size_t at_ = 0;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  std::uint16_t u16() { return static_cast<std::uint16_t>(get(2)); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(get(4)); }
  std::uint64_t u64() { return get(8); }
  template <std::size_t N>
  void bytes(std::array<std::byte, N>& out) {
    std::copy_n(in_.begin() + static_cast<std::ptrdiff_t>(at_), N, out.begin());
    at_ += N;
  }

 private:
  std::uint64_t get(int n) {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(in_[at_++])) << (8 * i);
    return v;
  }
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
};

// Checks size, magic, version and type; on success `reader` is past the header.
bool open_record(std::span<const std::byte> record, RecordType expected, std::string& error) {
  const std::size_t size = record_bytes(expected);
  if (record.size() != size) {
    error = fmt::format("same-host record of type {}: {} bytes, expected {}",
                        static_cast<int>(expected), record.size(), size);
    return false;
  }
  RecordType type{};
  if (!parse_record_header(record.first(kHeaderBytes), type, error)) return false;
  if (type != expected) {
    error = fmt::format("same-host record: type {} where type {} was expected",
                        static_cast<int>(type), static_cast<int>(expected));
    return false;
  }
  return true;
}

// A trainer or engine count a peer announces: a rank is a u32 on the wire, and no job has more
// than 65536 ranks on one host (the bound keeps a peer's number from sizing anything large).
bool count_ok(std::uint32_t count) { return count >= 1 && count <= 65536; }

}  // namespace

std::size_t record_bytes(RecordType type) noexcept {
  switch (type) {
    case RecordType::kChallenge: return 40;
    case RecordType::kProof: return 80;
    case RecordType::kAccept: return 40;
    case RecordType::kReady: return 8;
    case RecordType::kSetup: return 96;
    case RecordType::kRefuse: return 16;
    case RecordType::kDoorbell:
    case RecordType::kAck: return kDataRecordBytes;
    case RecordType::kPullHello: return 32;
    case RecordType::kPullSetup: return 104;
    case RecordType::kPullRefuse: return 40;
    case RecordType::kRouteDoorbell:
    case RecordType::kRouteAck: return kDataRecordBytes;
    case RecordType::kShardRecord: return kShardRecordBytes;
  }
  return 0;
}

bool parse_record_header(std::span<const std::byte> header, RecordType& type, std::string& error) {
  if (header.size() < kHeaderBytes) {
    error = fmt::format("same-host record header: {} bytes, expected {}", header.size(),
                        kHeaderBytes);
    return false;
  }
  Reader r(header);
  const std::uint32_t magic = r.u32();
  if (magic != kMagic) {
    error = fmt::format("not a shadowsync same-host peer (magic {:#010x}, expected {:#010x})",
                        magic, kMagic);
    return false;
  }
  const std::uint16_t version = r.u16();
  if (version != kWireVersion) {
    error = fmt::format("same-host wire version {}, this build speaks {}", version, kWireVersion);
    return false;
  }
  const std::uint16_t raw = r.u16();
  if (record_bytes(static_cast<RecordType>(raw)) == 0) {
    error = fmt::format("same-host record of unknown type {}", raw);
    return false;
  }
  type = static_cast<RecordType>(raw);
  return true;
}

std::array<std::byte, 40> encode(const Challenge& record) {
  std::array<std::byte, 40> out{};
  Writer w(out, RecordType::kChallenge);
  w.bytes(record.sender_nonce);
  return out;
}

std::array<std::byte, 80> encode(const Proof& record) {
  std::array<std::byte, 80> out{};
  Writer w(out, RecordType::kProof);
  w.u32(record.rank);
  w.u32(0);
  w.bytes(record.receiver_nonce);
  w.bytes(record.mac);
  return out;
}

std::array<std::byte, 40> encode(const Accept& record) {
  std::array<std::byte, 40> out{};
  Writer w(out, RecordType::kAccept);
  w.bytes(record.mac);
  return out;
}

std::array<std::byte, 8> encode_ready() {
  std::array<std::byte, 8> out{};
  Writer w(out, RecordType::kReady);
  return out;
}

std::array<std::byte, 96> encode(const Setup& record) {
  std::array<std::byte, 96> out{};
  Writer w(out, RecordType::kSetup);
  w.u32(record.memory);
  w.u32(record.world_size);
  w.u32(record.slot_count);
  w.u32(0);
  w.u64(record.slot_bytes);
  w.bytes(record.handle);
  return out;
}

std::array<std::byte, 16> encode(const Refuse& record) {
  std::array<std::byte, 16> out{};
  Writer w(out, RecordType::kRefuse);
  w.u32(static_cast<std::uint32_t>(record.reason));
  w.u32(0);
  return out;
}

std::array<std::byte, kDataRecordBytes> encode(const DataRecord& record) {
  std::array<std::byte, kDataRecordBytes> out{};
  Writer w(out, record.type);
  w.u64(record.sequence);
  w.u32(record.slot);
  w.u32(0);
  w.u64(record.offset);
  w.u64(record.bytes);
  return out;
}

bool decode(std::span<const std::byte> record, Challenge& out, std::string& error) {
  if (!open_record(record, RecordType::kChallenge, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  r.bytes(out.sender_nonce);
  return true;
}

bool decode(std::span<const std::byte> record, Proof& out, std::string& error) {
  if (!open_record(record, RecordType::kProof, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.rank = r.u32();
  if (const std::uint32_t reserved = r.u32(); reserved != 0) {
    error = fmt::format("same-host proof: reserved field is {}, expected 0", reserved);
    return false;
  }
  r.bytes(out.receiver_nonce);
  r.bytes(out.mac);
  return true;
}

bool decode(std::span<const std::byte> record, Accept& out, std::string& error) {
  if (!open_record(record, RecordType::kAccept, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  r.bytes(out.mac);
  return true;
}

bool decode_ready(std::span<const std::byte> record, std::string& error) {
  return open_record(record, RecordType::kReady, error);
}

bool decode(std::span<const std::byte> record, Setup& out, std::string& error) {
  if (!open_record(record, RecordType::kSetup, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.memory = r.u32();
  out.world_size = r.u32();
  out.slot_count = r.u32();
  const std::uint32_t reserved = r.u32();
  out.slot_bytes = r.u64();
  r.bytes(out.handle);
  if (out.memory > 1) {
    error = fmt::format("same-host setup: unknown memory flavour {}", out.memory);
  } else if (out.world_size < 2 || out.world_size > 65536) {
    error = fmt::format("same-host setup: world size {} is outside 2..65536", out.world_size);
  } else if (out.slot_count != kSlotCount) {
    error = fmt::format("same-host setup: {} staging slots, expected {}", out.slot_count,
                        kSlotCount);
  } else if (reserved != 0) {
    error = fmt::format("same-host setup: reserved field is {}, expected 0", reserved);
  } else if (out.slot_bytes == 0) {
    error = "same-host setup: staging slots of 0 bytes";
  } else {
    return true;
  }
  return false;
}

bool decode(std::span<const std::byte> record, Refuse& out, std::string& error) {
  if (!open_record(record, RecordType::kRefuse, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  const std::uint32_t reason = r.u32();
  if (const std::uint32_t reserved = r.u32(); reserved != 0) {
    error = fmt::format("same-host refusal: reserved field is {}, expected 0", reserved);
    return false;
  }
  if (reason < 1 || reason > 3) {
    error = fmt::format("same-host refusal with unknown reason {}", reason);
    return false;
  }
  out.reason = static_cast<RefuseReason>(reason);
  return true;
}

bool decode(std::span<const std::byte> record, RecordType expected, const SlotGeometry& geometry,
            DataRecord& out, std::string& error) {
  if (expected != RecordType::kDoorbell && expected != RecordType::kAck) {
    error = "same-host data record: expected type must be doorbell or ack";
    return false;
  }
  if (!open_record(record, expected, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.type = expected;
  out.sequence = r.u64();
  out.slot = r.u32();
  const std::uint32_t reserved = r.u32();
  out.offset = r.u64();
  out.bytes = r.u64();
  const char* what = expected == RecordType::kDoorbell ? "doorbell" : "ack";
  if (reserved != 0) {
    error = fmt::format("same-host {} {}: reserved field is {}, expected 0", what, out.sequence,
                        reserved);
  } else if (out.slot >= geometry.slot_count) {
    error = fmt::format("same-host {} {}: slot {} is outside the {} staging slots", what,
                        out.sequence, out.slot, geometry.slot_count);
  } else if (out.bytes == 0) {
    error = fmt::format("same-host {} {}: 0 bytes", what, out.sequence);
  } else if (out.offset > geometry.slot_bytes || out.bytes > geometry.slot_bytes - out.offset) {
    error = fmt::format("same-host {} {}: bytes [{}, {}+{}) of slot {} are outside its {} bytes",
                        what, out.sequence, out.offset, out.offset, out.bytes, out.slot,
                        geometry.slot_bytes);
  } else {
    return true;
  }
  return false;
}

std::string check_doorbell(const DataRecord& doorbell, std::uint64_t expected_sequence,
                           std::uint64_t expected_bytes) {
  if (doorbell.sequence != expected_sequence) {
    return fmt::format("same-host doorbell for chunk {} where chunk {} was expected (a sequence "
                       "that was not announced)",
                       doorbell.sequence, expected_sequence);
  }
  if (doorbell.bytes != expected_bytes) {
    return fmt::format("same-host doorbell {}: {} bytes, but this rank's broadcast expects {} "
                       "(mismatched collective)",
                       doorbell.sequence, doorbell.bytes, expected_bytes);
  }
  return {};
}

std::array<std::byte, 32> encode(const PullHello& record) {
  std::array<std::byte, 32> out{};
  Writer w(out, RecordType::kPullHello);
  w.u32(record.trainer_count);
  w.u32(record.engine_count);
  w.u32(record.engine_rank);
  w.u32(record.replica);
  w.u64(record.fingerprint);
  return out;
}

std::array<std::byte, 104> encode(const PullSetup& record) {
  std::array<std::byte, 104> out{};
  Writer w(out, RecordType::kPullSetup);
  w.u32(record.memory);
  w.u32(record.trainer_rank);
  w.u32(record.trainer_count);
  w.u32(record.engine_count);
  w.u64(record.fingerprint);
  w.u64(record.slot_bytes);
  w.bytes(record.handle);
  return out;
}

std::array<std::byte, 40> encode(const PullRefuse& record) {
  std::array<std::byte, 40> out{};
  Writer w(out, RecordType::kPullRefuse);
  w.u32(static_cast<std::uint32_t>(record.reason));
  w.u32(record.trainer_rank);
  w.u32(record.trainer_count);
  w.u32(record.engine_count);
  w.u64(record.fingerprint);
  w.u32(record.replicas);
  w.u32(0);
  return out;
}

std::array<std::byte, kDataRecordBytes> encode(const RouteRecord& record) {
  std::array<std::byte, kDataRecordBytes> out{};
  Writer w(out, record.type);
  w.u64(record.version);
  w.u64(record.sequence);
  w.u32(record.slot);
  w.u32(record.table_records);
  w.u64(record.bytes);
  return out;
}

std::array<std::byte, kShardRecordBytes> encode(const ShardRecord& record) {
  std::array<std::byte, kShardRecordBytes> out{};
  Writer w(out, RecordType::kShardRecord);
  w.u32(record.group);
  w.u32(0);
  w.u64(record.packing_offset);
  w.u64(record.bytes);
  w.u64(record.allocation_offset);
  w.u64(record.allocation_bytes);
  w.bytes(record.handle);
  return out;
}

bool decode(std::span<const std::byte> record, PullHello& out, std::string& error) {
  if (!open_record(record, RecordType::kPullHello, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.trainer_count = r.u32();
  out.engine_count = r.u32();
  out.engine_rank = r.u32();
  out.replica = r.u32();
  out.fingerprint = r.u64();
  if (!count_ok(out.trainer_count) || !count_ok(out.engine_count)) {
    error = fmt::format("same-host pull hello: {} trainer ranks and {} engine ranks; each must be "
                        "in 1..65536",
                        out.trainer_count, out.engine_count);
  } else if (out.engine_rank >= out.engine_count) {
    error = fmt::format("same-host pull hello: engine rank {} is outside 0..{}", out.engine_rank,
                        out.engine_count - 1);
  } else if (out.replica >= 65536) {
    error = fmt::format("same-host pull hello: replica {} is outside 0..65535", out.replica);
  } else {
    return true;
  }
  return false;
}

bool decode(std::span<const std::byte> record, PullSetup& out, std::string& error) {
  if (!open_record(record, RecordType::kPullSetup, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.memory = r.u32();
  out.trainer_rank = r.u32();
  out.trainer_count = r.u32();
  out.engine_count = r.u32();
  out.fingerprint = r.u64();
  out.slot_bytes = r.u64();
  r.bytes(out.handle);
  if (out.memory > 1) {
    error = fmt::format("same-host pull setup: unknown memory flavour {}", out.memory);
  } else if (!count_ok(out.trainer_count) || !count_ok(out.engine_count)) {
    error = fmt::format("same-host pull setup: {} trainer ranks and {} engine ranks; each must be "
                        "in 1..65536",
                        out.trainer_count, out.engine_count);
  } else if (out.trainer_rank >= out.trainer_count) {
    error = fmt::format("same-host pull setup: trainer rank {} is outside 0..{}", out.trainer_rank,
                        out.trainer_count - 1);
  } else if (out.slot_bytes == 0) {
    error = "same-host pull setup: staging slots of 0 bytes";
  } else {
    return true;
  }
  return false;
}

bool decode(std::span<const std::byte> record, PullRefuse& out, std::string& error) {
  if (!open_record(record, RecordType::kPullRefuse, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  const std::uint32_t reason = r.u32();
  out.trainer_rank = r.u32();
  out.trainer_count = r.u32();
  out.engine_count = r.u32();
  out.fingerprint = r.u64();
  out.replicas = r.u32();
  const std::uint32_t reserved = r.u32();
  if (reason < 1 || reason > 4) {
    error = fmt::format("same-host pull refusal with unknown reason {}", reason);
  } else if (reserved != 0) {
    error = fmt::format("same-host pull refusal: reserved field is {}, expected 0", reserved);
  } else if (!count_ok(out.trainer_count) || !count_ok(out.engine_count) ||
             !count_ok(out.replicas)) {
    error = fmt::format("same-host pull refusal: {} trainer ranks, {} engine ranks and {} "
                        "replicas; each must be in 1..65536",
                        out.trainer_count, out.engine_count, out.replicas);
  } else if (out.trainer_rank >= out.trainer_count) {
    error = fmt::format("same-host pull refusal: trainer rank {} is outside 0..{}",
                        out.trainer_rank, out.trainer_count - 1);
  } else {
    out.reason = static_cast<PullRefuseReason>(reason);
    return true;
  }
  return false;
}

bool decode(std::span<const std::byte> record, RecordType expected, const SlotGeometry& geometry,
            RouteRecord& out, std::string& error) {
  if (expected != RecordType::kRouteDoorbell && expected != RecordType::kRouteAck) {
    error = "same-host route record: expected type must be route doorbell or route ack";
    return false;
  }
  if (!open_record(record, expected, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.type = expected;
  out.version = r.u64();
  out.sequence = r.u64();
  out.slot = r.u32();
  out.table_records = r.u32();
  out.bytes = r.u64();
  const char* what = expected == RecordType::kRouteDoorbell ? "route doorbell" : "route ack";
  const bool in_place = out.slot == kInPlaceSlot;
  if (out.table_records != 0 && !in_place) {
    error = fmt::format("same-host {} of bucket {} of update {}: {} shard records follow a "
                        "bucket in staging slot {}; only a bucket read in place has them",
                        what, out.sequence, out.version, out.table_records, out.slot);
  } else if (out.table_records > kMaxShardRecords) {
    error = fmt::format("same-host {} of bucket {} of update {}: {} shard records, more than "
                        "the {} a table may have",
                        what, out.sequence, out.version, out.table_records, kMaxShardRecords);
  } else if (!in_place && out.slot >= geometry.slot_count) {
    error = fmt::format("same-host {} of bucket {} of update {}: slot {} is outside the {} "
                        "staging slots",
                        what, out.sequence, out.version, out.slot, geometry.slot_count);
  } else if (out.bytes > geometry.slot_bytes) {
    error = fmt::format("same-host {} of bucket {} of update {}: {} bytes, more than a slot's {}",
                        what, out.sequence, out.version, out.bytes, geometry.slot_bytes);
  } else {
    return true;
  }
  return false;
}

bool decode(std::span<const std::byte> record, ShardRecord& out, std::string& error) {
  if (!open_record(record, RecordType::kShardRecord, error)) return false;
  Reader r(record.subspan(kHeaderBytes));
  out.group = r.u32();
  const std::uint32_t reserved = r.u32();
  out.packing_offset = r.u64();
  out.bytes = r.u64();
  out.allocation_offset = r.u64();
  out.allocation_bytes = r.u64();
  r.bytes(out.handle);
  if (reserved != 0) {
    error = fmt::format("same-host shard record: reserved field is {}, expected 0", reserved);
  } else if (out.bytes == 0) {
    error = fmt::format("same-host shard record of group {}: 0 bytes", out.group);
  } else if (out.allocation_offset > out.allocation_bytes ||
             out.bytes > out.allocation_bytes - out.allocation_offset) {
    error = fmt::format("same-host shard record of group {}: {} bytes at offset {} of an "
                        "allocation of {} bytes",
                        out.group, out.bytes, out.allocation_offset, out.allocation_bytes);
  } else if (out.packing_offset > UINT64_MAX - out.bytes) {
    error = fmt::format("same-host shard record of group {}: packing offset {} + {} bytes "
                        "overflows",
                        out.group, out.packing_offset, out.bytes);
  } else {
    return true;
  }
  return false;
}

const char* to_string(PullRefuseReason reason) noexcept {
  switch (reason) {
    case PullRefuseReason::kWorldSizeDiffers: return "the trainer and engine counts differ";
    case PullRefuseReason::kPlanDiffers: return "the routing plans differ";
    case PullRefuseReason::kRankTaken: return "another engine process already took that rank";
    case PullRefuseReason::kReplicaOutside: return "the replica is outside those served";
  }
  return "unknown reason";
}

const char* to_string(RefuseReason reason) noexcept {
  switch (reason) {
    case RefuseReason::kBadProof: return "the receiver's token proof did not verify (wrong token)";
    case RefuseReason::kBadRank: return "the rank is outside 1..receivers";
    case RefuseReason::kRankTaken: return "another receiver already took that rank";
  }
  return "unknown reason";
}

}  // namespace shadowsync::same_host
