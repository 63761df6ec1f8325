// The pull transport's records (plugin/transports/same_host/same_host_frame.h, types 9-14): each
// round-trips, and every field a peer could get wrong is refused with a reason.
#include <catch2/catch.hpp>

#include <cstring>

#include "record_fields.h"
#include "transports/same_host/same_host_frame.h"

using namespace shadowsync::same_host;
using shadowsync::testing::put_u32;
using shadowsync::testing::put_u64;

namespace {

const SlotGeometry kGeometry{kSlotCount, 4096};

template <typename Record, std::size_t N>
std::string error_of(const std::array<std::byte, N>& bytes) {
  Record out;
  std::string error;
  if (decode(bytes, out, error)) return "";
  return error;
}

std::string route_error(const std::array<std::byte, kDataRecordBytes>& bytes,
                        RecordType expected = RecordType::kRouteDoorbell) {
  RouteRecord out;
  std::string error;
  if (decode(bytes, expected, kGeometry, out, error)) return "";
  return error;
}

}  // namespace

TEST_CASE("pull records round-trip") {
  std::string error;

  const PullHello hello{2, 3, 1, 0x0123456789abcdefULL, 4};
  PullHello hello_out;
  REQUIRE(decode(encode(hello), hello_out, error));
  CHECK(hello_out.trainer_count == 2);
  CHECK(hello_out.engine_count == 3);
  CHECK(hello_out.engine_rank == 1);
  CHECK(hello_out.fingerprint == 0x0123456789abcdefULL);
  CHECK(hello_out.replica == 4);

  PullSetup setup;
  setup.trainer_rank = 3;
  setup.trainer_count = 4;
  setup.engine_count = 2;
  setup.fingerprint = 77;
  setup.slot_bytes = 1 << 20;
  setup.handle[63] = std::byte{5};
  PullSetup setup_out;
  REQUIRE(decode(encode(setup), setup_out, error));
  CHECK(setup_out.memory == 0);
  CHECK(setup_out.trainer_rank == 3);
  CHECK(setup_out.trainer_count == 4);
  CHECK(setup_out.engine_count == 2);
  CHECK(setup_out.fingerprint == 77);
  CHECK(setup_out.slot_bytes == 1 << 20);
  CHECK(setup_out.handle == setup.handle);

  const PullRefuse refuse{PullRefuseReason::kReplicaOutside, 1, 2, 2, 99, 3};
  PullRefuse refuse_out;
  REQUIRE(decode(encode(refuse), refuse_out, error));
  CHECK(refuse_out.reason == PullRefuseReason::kReplicaOutside);
  CHECK(refuse_out.trainer_rank == 1);
  CHECK(refuse_out.trainer_count == 2);
  CHECK(refuse_out.engine_count == 2);
  CHECK(refuse_out.fingerprint == 99);
  CHECK(refuse_out.replicas == 3);

  for (const RecordType type : {RecordType::kRouteDoorbell, RecordType::kRouteAck}) {
    for (const std::uint64_t bytes : {std::uint64_t{0}, std::uint64_t{4096}}) {
      const RouteRecord record{type, 7, 12, 1, bytes};  // 0 bytes: a rank with nothing to send
      RouteRecord out;
      REQUIRE(decode(encode(record), type, kGeometry, out, error));
      CHECK(out == record);
      // Read in place, a shard table following.
      const RouteRecord in_place{type, 7, 12, kInPlaceSlot, bytes, 291};
      REQUIRE(decode(encode(in_place), type, kGeometry, out, error));
      CHECK(out == in_place);
    }
  }

  ShardRecord shard;
  shard.group = 2;
  shard.packing_offset = 1ULL << 40;
  shard.bytes = 4096;
  shard.allocation_offset = 512;
  shard.allocation_bytes = 4608;
  shard.handle[0] = std::byte{9};
  shard.handle[63] = std::byte{7};
  ShardRecord shard_out;
  REQUIRE(decode(encode(shard), shard_out, error));
  CHECK(shard_out == shard);
}

TEST_CASE("a shard record or an in-place doorbell with impossible fields is refused") {
  auto doorbell = encode(RouteRecord{RecordType::kRouteDoorbell, 3, 4, 0, 16, 0});
  SECTION("shard records after a bucket in a staging slot") {
    put_u32(doorbell, 28, 5);
    CHECK_THAT(route_error(doorbell),
               Catch::Contains("5 shard records follow a bucket in staging slot 0; only a "
                               "bucket read in place has them"));
  }
  SECTION("more shard records than a table may have") {
    doorbell = encode(RouteRecord{RecordType::kRouteDoorbell, 3, 4, kInPlaceSlot, 16,
                                  kMaxShardRecords + 1});
    CHECK_THAT(route_error(doorbell), Catch::Contains("more than the 1048576 a table may have"));
  }
  ShardRecord shard;
  shard.bytes = 64;
  shard.allocation_offset = 64;
  shard.allocation_bytes = 128;
  auto record = encode(shard);
  CHECK(error_of<ShardRecord>(record).empty());
  SECTION("bytes past the allocation's end") {
    put_u64(record, 32, 65);  // allocation offset
    CHECK_THAT(error_of<ShardRecord>(record),
               Catch::Contains("64 bytes at offset 65 of an allocation of 128 bytes"));
  }
  SECTION("an offset past the allocation, which a subtraction would wrap") {
    put_u64(record, 32, 129);
    CHECK_THAT(error_of<ShardRecord>(record), Catch::Contains("of an allocation of 128 bytes"));
  }
  SECTION("no bytes") {
    put_u64(record, 24, 0);
    CHECK_THAT(error_of<ShardRecord>(record), Catch::Contains("0 bytes"));
  }
  SECTION("reserved field set") {
    put_u32(record, 12, 1);
    CHECK_THAT(error_of<ShardRecord>(record), Catch::Contains("reserved field is 1"));
  }
  SECTION("a packing range that overflows") {
    put_u64(record, 16, ~std::uint64_t{0} - 10);
    CHECK_THAT(error_of<ShardRecord>(record), Catch::Contains("overflows"));
  }
}

TEST_CASE("a pull hello with impossible fields is refused") {
  auto record = encode(PullHello{2, 2, 1, 5});
  CHECK(error_of<PullHello>(record).empty());
  SECTION("no trainer ranks") {
    put_u32(record, 8, 0);
    CHECK_THAT(error_of<PullHello>(record), Catch::Contains("0 trainer ranks and 2 engine ranks"));
  }
  SECTION("too many engine ranks") {
    put_u32(record, 12, 65537);
    CHECK_THAT(error_of<PullHello>(record), Catch::Contains("65537 engine ranks"));
  }
  SECTION("engine rank outside the engine count") {
    put_u32(record, 16, 2);
    CHECK_THAT(error_of<PullHello>(record), Catch::Contains("engine rank 2 is outside 0..1"));
  }
  SECTION("replica beyond 16 bits") {
    put_u32(record, 20, 65536);
    CHECK_THAT(error_of<PullHello>(record), Catch::Contains("replica 65536 is outside 0..65535"));
  }
  SECTION("another record type") {
    const auto setup = encode(PullSetup{0, 0, 1, 1, 0, 64, {}});
    PullHello out;
    std::string error;
    CHECK_FALSE(decode(std::span<const std::byte>(setup.data(), 32), out, error));
    CHECK_THAT(error, Catch::Contains("type 10 where type 9 was expected"));
  }
}

TEST_CASE("a pull setup with impossible fields is refused") {
  auto record = encode(PullSetup{0, 1, 2, 2, 5, 64, {}});
  CHECK(error_of<PullSetup>(record).empty());
  SECTION("unknown memory flavour") {
    put_u32(record, 8, 2);
    CHECK_THAT(error_of<PullSetup>(record), Catch::Contains("unknown memory flavour 2"));
  }
  SECTION("trainer rank outside the trainer count") {
    put_u32(record, 12, 2);
    CHECK_THAT(error_of<PullSetup>(record), Catch::Contains("trainer rank 2 is outside 0..1"));
  }
  SECTION("no engine ranks") {
    put_u32(record, 20, 0);
    CHECK_THAT(error_of<PullSetup>(record), Catch::Contains("2 trainer ranks and 0 engine ranks"));
  }
  SECTION("zero-byte slots") {
    put_u64(record, 32, 0);
    CHECK_THAT(error_of<PullSetup>(record), Catch::Contains("staging slots of 0 bytes"));
  }
  SECTION("a short record") {
    PullSetup out;
    std::string error;
    CHECK_FALSE(decode(std::span<const std::byte>(record.data(), 96), out, error));
    CHECK_THAT(error, Catch::Contains("96 bytes, expected 104"));
  }
}

TEST_CASE("a pull refusal with impossible fields is refused") {
  auto record = encode(PullRefuse{PullRefuseReason::kRankTaken, 0, 2, 2, 5});
  CHECK(error_of<PullRefuse>(record).empty());
  SECTION("unknown reason") {
    put_u32(record, 8, 5);
    CHECK_THAT(error_of<PullRefuse>(record), Catch::Contains("unknown reason 5"));
  }
  SECTION("trainer rank outside the trainer count") {
    put_u32(record, 12, 9);
    CHECK_THAT(error_of<PullRefuse>(record), Catch::Contains("trainer rank 9 is outside 0..1"));
  }
  SECTION("no trainer ranks") {
    put_u32(record, 16, 0);
    CHECK_THAT(error_of<PullRefuse>(record), Catch::Contains("0 trainer ranks"));
  }
  SECTION("no replicas") {
    put_u32(record, 32, 0);
    CHECK_THAT(error_of<PullRefuse>(record), Catch::Contains("2 engine ranks and 0 replicas"));
  }
  SECTION("reserved field set") {
    put_u32(record, 36, 7);
    CHECK_THAT(error_of<PullRefuse>(record), Catch::Contains("reserved field is 7"));
  }
}

TEST_CASE("a route doorbell outside the staging or malformed is refused") {
  auto record = encode(RouteRecord{RecordType::kRouteDoorbell, 3, 4, 0, 4096});
  CHECK(route_error(record).empty());
  SECTION("slot outside the two slots") {
    put_u32(record, 24, 2);
    CHECK_THAT(route_error(record),
               Catch::Contains("route doorbell of bucket 4 of update 3: slot 2 is outside the 2 "
                               "staging slots"));
  }
  SECTION("more bytes than a slot") {
    put_u64(record, 32, 4097);
    CHECK_THAT(route_error(record), Catch::Contains("4097 bytes, more than a slot's 4096"));
  }
  SECTION("an ack where a doorbell is due") {
    record = encode(RouteRecord{RecordType::kRouteAck, 3, 4, 0, 16});
    CHECK_THAT(route_error(record), Catch::Contains("type 13 where type 12 was expected"));
  }
  SECTION("a broadcast doorbell where a route doorbell is due") {
    const auto broadcast = encode(DataRecord{RecordType::kDoorbell, 0, 0, 0, 16});
    CHECK_THAT(route_error(broadcast), Catch::Contains("type 6 where type 12 was expected"));
  }
  SECTION("an expected type that is no route record") {
    CHECK_THAT(route_error(record, RecordType::kDoorbell),
               Catch::Contains("must be route doorbell or route ack"));
  }
}

TEST_CASE("pull garbage of every length decodes to nothing and never crashes") {
  std::array<std::byte, kMaxRecordBytes> garbage{};
  for (std::size_t i = 0; i < garbage.size(); ++i) garbage[i] = static_cast<std::byte>(i * 41);
  for (std::size_t n = 0; n <= garbage.size(); ++n) {
    const std::span<const std::byte> bytes(garbage.data(), n);
    PullHello hello;
    PullSetup setup;
    PullRefuse refuse;
    RouteRecord route;
    ShardRecord shard;
    std::string error;
    CHECK_FALSE(decode(bytes, shard, error));
    CHECK_FALSE(decode(bytes, hello, error));
    CHECK_FALSE(decode(bytes, setup, error));
    CHECK_FALSE(decode(bytes, refuse, error));
    CHECK_FALSE(decode(bytes, RecordType::kRouteAck, kGeometry, route, error));
    CHECK_FALSE(error.empty());
  }
}
