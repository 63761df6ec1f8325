// libFuzzer target for the same-host transport's record codec
// (plugin/transports/same_host/same_host_frame.h): what a peer's bytes reach before the handshake
// is verified (challenge, proof, accept, refuse, setup; the pull transport's hello, setup and
// refusal), and every doorbell and ack after it (the pull transport's route records and shard
// table records too).
// Built and run by scripts/fuzz.sh.
//
// The input's first byte picks the record type and slot geometry; the rest is the record.
// Properties beyond "no crash, no sanitizer report": a record that decodes re-encodes to exactly
// the same bytes (the codec is canonical), and a doorbell that decodes lies inside the staging
// memory (slot < slot count, offset + bytes <= slot bytes, no overflow).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "transports/same_host/same_host_frame.h"

using namespace shadowsync::same_host;

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

template <typename Array>
void check_same(const Array& encoded, std::span<const std::byte> record) {
  check(encoded.size() == record.size());
  check(std::equal(record.begin(), record.end(), encoded.begin()));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const std::uint8_t selector = data[0];
  const std::span<const std::byte> record(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  std::string error;
  RecordType header_type{};
  (void)parse_record_header(record, header_type, error);
  const SlotGeometry geometry{kSlotCount, std::uint64_t{1} << (selector >> 3)};
  switch (selector & 7) {
    case 0: {
      DataRecord out;
      const RecordType type = (selector & 8) ? RecordType::kAck : RecordType::kDoorbell;
      if (decode(record, type, geometry, out, error)) {
        check(out.slot < geometry.slot_count && out.bytes > 0);
        check(out.offset <= geometry.slot_bytes && out.bytes <= geometry.slot_bytes - out.offset);
        check_same(encode(out), record);
        (void)check_doorbell(out, out.sequence, out.bytes);
      }
      break;
    }
    case 1: {
      Challenge out;
      if (decode(record, out, error)) check_same(encode(out), record);
      break;
    }
    case 2: {
      Proof out;
      if (decode(record, out, error)) check_same(encode(out), record);
      break;
    }
    case 3: {
      Accept out;
      if (decode(record, out, error)) check_same(encode(out), record);
      break;
    }
    case 4: {
      Setup out;
      if (decode(record, out, error)) check_same(encode(out), record);
      break;
    }
    case 5: {
      Refuse out;
      if (decode(record, out, error)) check_same(encode(out), record);
      break;
    }
    case 7:  // the pull transport's records, by the selector's bits 3-4 (bit 5: ack or doorbell)
      switch ((selector >> 3) & 3) {
        case 0: {
          PullHello out;
          if (decode(record, out, error)) {
            check(out.engine_rank < out.engine_count);
            check_same(encode(out), record);
          }
          break;
        }
        case 1: {
          PullSetup out;
          if (decode(record, out, error)) {
            check(out.trainer_rank < out.trainer_count && out.slot_bytes > 0);
            check_same(encode(out), record);
          }
          break;
        }
        case 2: {
          PullRefuse out;
          if (decode(record, out, error)) check_same(encode(out), record);
          break;
        }
        default: {
          RouteRecord out;
          const RecordType type =
              (selector & 32) ? RecordType::kRouteAck : RecordType::kRouteDoorbell;
          if (decode(record, type, geometry, out, error)) {
            check((out.slot < geometry.slot_count || out.slot == kInPlaceSlot) &&
                  out.bytes <= geometry.slot_bytes);
            check(out.table_records <= kMaxShardRecords &&
                  (out.table_records == 0 || out.slot == kInPlaceSlot));
            check_same(encode(out), record);
          }
          break;
        }
      }
      break;
    case 6: {  // by bit 3: a shard table's record (routes read in place), or ready
      if ((selector & 8) == 0) {
        if (decode_ready(record, error)) check_same(encode_ready(), record);
        break;
      }
      ShardRecord out;
      if (decode(record, out, error)) {
        check(out.bytes > 0 && out.allocation_offset <= out.allocation_bytes &&
              out.bytes <= out.allocation_bytes - out.allocation_offset);
        check_same(encode(out), record);
      }
      break;
    }
  }
  return 0;
}
