// The same-host transport's record codec (plugin/transports/same_host/same_host_frame.h): every
// record round-trips, and every field a peer could get wrong is refused with a reason.
#include <catch2/catch.hpp>

#include <cstring>

#include "record_fields.h"
#include "transports/same_host/same_host_frame.h"

using namespace shadowsync::same_host;
using shadowsync::testing::put_u32;
using shadowsync::testing::put_u64;

namespace {

const SlotGeometry kGeometry{kSlotCount, 4096};

std::string doorbell_error(const std::array<std::byte, kDataRecordBytes>& record) {
  DataRecord out;
  std::string error;
  if (decode(record, RecordType::kDoorbell, kGeometry, out, error)) return "";
  return error;
}

}  // namespace

TEST_CASE("same-host records round-trip") {
  const DataRecord doorbell{RecordType::kDoorbell, 7, 1, 16, 4080};
  DataRecord out;
  std::string error;
  REQUIRE(decode(encode(doorbell), RecordType::kDoorbell, kGeometry, out, error));
  CHECK(out.sequence == 7);
  CHECK(out.slot == 1);
  CHECK(out.offset == 16);
  CHECK(out.bytes == 4080);

  Proof proof;
  proof.rank = 3;
  proof.receiver_nonce[5] = std::byte{9};
  proof.mac[31] = std::byte{1};
  Proof proof_out;
  REQUIRE(decode(encode(proof), proof_out, error));
  CHECK(proof_out.rank == 3);
  CHECK(proof_out.receiver_nonce == proof.receiver_nonce);
  CHECK(proof_out.mac == proof.mac);

  Setup setup;
  setup.world_size = 4;
  setup.slot_bytes = 1 << 20;
  setup.handle[0] = std::byte{0x42};
  Setup setup_out;
  REQUIRE(decode(encode(setup), setup_out, error));
  CHECK(setup_out.world_size == 4);
  CHECK(setup_out.slot_bytes == 1 << 20);
  CHECK(setup_out.handle == setup.handle);
  CHECK(decode_ready(encode_ready(), error));
}

TEST_CASE("a doorbell outside the staging memory or malformed is refused") {
  auto record = encode(DataRecord{RecordType::kDoorbell, 0, 0, 0, 4096});
  CHECK(doorbell_error(record).empty());

  SECTION("slot outside the two slots") {
    put_u32(record, 16, 2);
    CHECK_THAT(doorbell_error(record), Catch::Contains("slot 2 is outside the 2 staging slots"));
  }
  SECTION("byte range past the slot's end") {
    put_u64(record, 24, 1);
    CHECK_THAT(doorbell_error(record), Catch::Contains("outside its 4096 bytes"));
  }
  SECTION("offset + bytes overflowing 64 bits") {
    put_u64(record, 24, ~std::uint64_t{0});
    put_u64(record, 32, 2);
    CHECK_THAT(doorbell_error(record), Catch::Contains("outside its 4096 bytes"));
  }
  SECTION("zero bytes") {
    put_u64(record, 32, 0);
    CHECK_THAT(doorbell_error(record), Catch::Contains("0 bytes"));
  }
  SECTION("reserved field set") {
    put_u32(record, 20, 1);
    CHECK_THAT(doorbell_error(record), Catch::Contains("reserved field is 1"));
  }
  SECTION("wrong magic") {
    record[0] = std::byte{'X'};
    CHECK_THAT(doorbell_error(record), Catch::Contains("not a shadowsync same-host peer"));
  }
  SECTION("wrong wire version") {
    record[4] = std::byte{9};
    CHECK_THAT(doorbell_error(record), Catch::Contains("wire version 9"));
  }
  SECTION("unknown type") {
    record[6] = std::byte{99};
    CHECK_THAT(doorbell_error(record), Catch::Contains("unknown type 99"));
  }
  SECTION("an ack where a doorbell is due") {
    record = encode(DataRecord{RecordType::kAck, 0, 0, 0, 4096});
    CHECK_THAT(doorbell_error(record), Catch::Contains("type 8 where type 6 was expected"));
  }
  SECTION("a short record") {
    DataRecord out;
    std::string error;
    CHECK_FALSE(decode(std::span<const std::byte>(record.data(), 39), RecordType::kDoorbell,
                       kGeometry, out, error));
    CHECK_THAT(error, Catch::Contains("39 bytes, expected 40"));
  }
}

TEST_CASE("a doorbell of a sequence that was not announced, or of another size, is refused") {
  const DataRecord doorbell{RecordType::kDoorbell, 5, 0, 0, 100};
  CHECK(check_doorbell(doorbell, 5, 100).empty());
  CHECK_THAT(check_doorbell(doorbell, 4, 100),
             Catch::Contains("chunk 5 where chunk 4 was expected"));
  CHECK_THAT(check_doorbell(doorbell, 5, 99), Catch::Contains("mismatched collective"));
}

TEST_CASE("a setup with impossible fields is refused") {
  Setup setup;
  setup.world_size = 2;
  setup.slot_bytes = 64;
  std::string error;
  Setup out;
  SECTION("zero-byte slots") {
    setup.slot_bytes = 0;
    CHECK_FALSE(decode(encode(setup), out, error));
    CHECK_THAT(error, Catch::Contains("0 bytes"));
  }
  SECTION("world size 1") {
    setup.world_size = 1;
    CHECK_FALSE(decode(encode(setup), out, error));
    CHECK_THAT(error, Catch::Contains("world size 1"));
  }
  SECTION("three slots") {
    setup.slot_count = 3;
    CHECK_FALSE(decode(encode(setup), out, error));
    CHECK_THAT(error, Catch::Contains("3 staging slots"));
  }
  SECTION("unknown memory flavour") {
    setup.memory = 7;
    CHECK_FALSE(decode(encode(setup), out, error));
    CHECK_THAT(error, Catch::Contains("unknown memory flavour 7"));
  }
}

TEST_CASE("garbage of every length decodes to nothing and never crashes") {
  std::array<std::byte, kMaxRecordBytes> garbage{};
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<std::byte>(i * 37);
  for (std::size_t n = 0; n <= garbage.size(); ++n) {
    const std::span<const std::byte> bytes(garbage.data(), n);
    DataRecord data;
    Proof proof;
    Setup setup;
    std::string error;
    CHECK_FALSE(decode(bytes, RecordType::kDoorbell, kGeometry, data, error));
    CHECK_FALSE(decode(bytes, proof, error));
    CHECK_FALSE(decode(bytes, setup, error));
    CHECK_FALSE(error.empty());
  }
}
