// The receive plan: its checks, and its pieces against a reference strided copy, alone and run by
// a receiver that takes an update from a sender of the wire layout.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <functional>
#include <random>

#include "error_message.h"
#include "shadowsync/error.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/loopback_transport.h"
#include "shadowsync/receive_plan.h"
#include "shadowsync/receiver.h"
#include "shadowsync/sender.h"

using namespace shadowsync;
using shadowsync::testing::message_of;

namespace {

// What vLLM does with a Llama attention block at tensor-parallel rank 1 of 2: q, k and v (HF
// names, full shapes) go into rows of one fused qkv_proj shard; o_proj is split by columns, so its
// shard is every row's second half; the norm is replicated whole.
struct FusedModel {
  static constexpr std::int64_t kHidden = 16, kQ = 16, kKv = 8;
  Layout wire = Layout::build({{"q_proj", DType::kBFloat16, {kQ, kHidden}, "base"},
                               {"k_proj", DType::kBFloat16, {kKv, kHidden}, "base"},
                               {"v_proj", DType::kBFloat16, {kKv, kHidden}, "base"},
                               {"o_proj", DType::kBFloat16, {kHidden, kQ}, "base"},
                               {"norm", DType::kFloat32, {kHidden}, "base"}},
                              {.bucket_bytes = 256});
  Layout engine = Layout::build({{"qkv_proj", DType::kBFloat16, {(kQ + 2 * kKv) / 2, kHidden}, "base"},
                                 {"o_proj", DType::kBFloat16, {kHidden, kQ / 2}, "base"},
                                 {"norm", DType::kFloat32, {kHidden}, "base"}});
  std::vector<PlanCopy> copies() const {
    const std::int64_t h = kHidden;
    return {
        // Rank 1's halves of q, k and v, one after the other in qkv_proj.
        {"q_proj", "qkv_proj", {kQ / 2, h}, kQ / 2 * h, {h, 1}, 0, {h, 1}},
        {"k_proj", "qkv_proj", {kKv / 2, h}, kKv / 2 * h, {h, 1}, kQ / 2 * h, {h, 1}},
        {"v_proj", "qkv_proj", {kKv / 2, h}, kKv / 2 * h, {h, 1}, (kQ + kKv) / 2 * h, {h, 1}},
        // Columns kQ/2.. of every row of o_proj.
        {"o_proj", "o_proj", {h, kQ / 2}, kQ / 2, {kQ, 1}, 0, {kQ / 2, 1}},
        {"norm", "norm", {h}, 0, {1}, 0, {1}},
    };
  }
};

const TensorPlacement& placement(const Layout& layout, const std::string& name) {
  for (const auto& g : layout.groups()) {
    if (auto t = g.find_tensor(name)) return g.tensors()[*t];
  }
  throw std::runtime_error("no tensor " + name);
}

// The reference: each copy element by element, straight from the definition of PlanCopy.
std::vector<std::byte> reference(const Layout& wire, const Layout& engine,
                                 const std::vector<PlanCopy>& copies,
                                 const std::vector<std::byte>& wire_arena) {
  std::vector<std::byte> out(engine.groups()[0].arena_bytes());
  for (const PlanCopy& c : copies) {
    const TensorPlacement& s = placement(wire, c.wire);
    const TensorPlacement& d = placement(engine, c.engine);
    const std::size_t e = dtype_size(s.spec.dtype);
    std::vector<std::int64_t> index(c.shape.size(), 0);
    for (;;) {
      std::int64_t so = c.src_offset, dof = c.dst_offset;
      for (std::size_t k = 0; k < index.size(); ++k) {
        so += index[k] * c.src_strides[k];
        dof += index[k] * c.dst_strides[k];
      }
      std::memcpy(out.data() + d.offset + dof * e, wire_arena.data() + s.offset + so * e, e);
      std::size_t k = index.size();
      while (k > 0 && ++index[k - 1] == c.shape[k - 1]) index[--k] = 0;
      if (k == 0) break;
    }
  }
  return out;
}

// What the receiver does: each wire bucket into a buffer of its own, then its pieces.
std::vector<std::byte> run_pieces(const ReceivePlan& plan, const Layout& engine,
                                  const std::vector<std::byte>& wire_arena) {
  std::vector<std::byte> out(engine.groups()[0].arena_bytes());
  const GroupLayout& group = plan.wire().groups()[0];
  std::vector<std::byte> buffer(plan.max_bucket_bytes());
  for (std::size_t k = 0; k < group.bucket_count(); ++k) {
    const Bucket b = group.bucket(k);
    std::fill(buffer.begin(), buffer.end(), std::byte{0xEE});  // stale bytes must not leak
    std::memcpy(buffer.data(), wire_arena.data() + b.offset, b.bytes);
    for (const PlanPiece& p : plan.pieces(0, k)) {
      REQUIRE(p.src_offset + (p.rows - 1) * p.src_pitch + p.row_bytes <= b.bytes);
      for (std::size_t r = 0; r < p.rows; ++r) {
        std::memcpy(out.data() + p.dst_offset + r * p.dst_pitch,
                    buffer.data() + p.src_offset + r * p.src_pitch, p.row_bytes);
      }
    }
  }
  return out;
}

std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> bytes(n);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  return bytes;
}

// Publishes random bytes (`seed`) of every tensor of `wire`'s one group at `version` and waits
// until the engine applied the update on `engine_stream`; returns the bytes sent, as one arena.
std::vector<std::byte> send_and_apply(Sender& sender, Receiver& receiver, HostBackend& backend,
                                      Stream& engine_stream, const Layout& wire,
                                      std::uint64_t version, unsigned seed) {
  auto wire_arena = random_bytes(wire.groups()[0].arena_bytes(), seed);
  std::vector<SourceTensor> tensors;
  for (const auto& t : wire.groups()[0].tensors()) {
    tensors.push_back({t.spec.name, wire_arena.data() + t.offset, t.spec.dtype, t.spec.shape});
  }
  const PublishHandle handle = sender.publish(version, {"base"}, tensors);
  receiver.begin_update(handle.header());
  REQUIRE(handle.wait_for(std::chrono::seconds(20)));
  REQUIRE(receiver.step_hook().wait_applied(
      version, std::chrono::steady_clock::now() + std::chrono::seconds(20), engine_stream));
  backend.stream_synchronize(engine_stream);
  return wire_arena;
}

// The plan of `copies`, run bucket by bucket over random wire bytes (`seed`), equals the
// reference.
bool pieces_match_reference(const Layout& wire, const Layout& engine,
                            const std::vector<PlanCopy>& copies, unsigned seed) {
  const ReceivePlan plan = ReceivePlan::build(wire, engine, copies);
  const auto wire_arena = random_bytes(wire.groups()[0].arena_bytes(), seed);
  return run_pieces(plan, engine, wire_arena) == reference(wire, engine, copies, wire_arena);
}

}  // namespace

TEST_CASE("a plan's pieces, bucket by bucket, give what the copies define") {
  FusedModel m;
  const ReceivePlan plan = ReceivePlan::build(m.wire, m.engine, m.copies());
  CHECK(plan.max_bucket_bytes() == 256);
  CHECK(m.wire.groups()[0].bucket_count() > 5);  // rows cross bucket boundaries
  for (unsigned seed = 1; seed <= 5; ++seed) {
    const auto wire_arena = random_bytes(m.wire.groups()[0].arena_bytes(), seed);
    CHECK(run_pieces(plan, m.engine, wire_arena) ==
          reference(m.wire, m.engine, m.copies(), wire_arena));
  }
}

TEST_CASE("random copies of sub-blocks split at any bucket size match the reference") {
  // One wire tensor [R, C]; the engine tensor is its transpose-free sub-block [r0.., c0..] of
  // random size, so rows start at odd offsets and cross boundaries in every way.
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::int64_t R = 1 + rng() % 9, C = 1 + rng() % 40;
    const std::int64_t r0 = rng() % R, c0 = rng() % C;
    const std::int64_t rows = 1 + rng() % (R - r0), cols = 1 + rng() % (C - c0);
    const std::size_t bucket = 256 * (1 + rng() % 3);
    const Layout wire = Layout::build({{"pad", DType::kInt8, {static_cast<std::int64_t>(rng() % 300) + 1}},
                                       {"w", DType::kFloat16, {R, C}}},
                                      {.bucket_bytes = bucket});
    const Layout engine = Layout::build({{"e", DType::kFloat16, {rows, cols}},
                                         {"p", DType::kInt8, {1}}});
    const std::vector<PlanCopy> copies = {
        {"w", "e", {rows, cols}, r0 * C + c0, {C, 1}, 0, {cols, 1}},
        {"pad", "p", {1}, 0, {1}, 0, {1}}};
    INFO("R=" << R << " C=" << C << " r0=" << r0 << " c0=" << c0 << " rows=" << rows
              << " cols=" << cols << " bucket=" << bucket);
    REQUIRE(pieces_match_reference(wire, engine, copies, trial));
  }
}

// vLLM's GPT-2 loader transposes each of Hugging Face's Conv1D weights ([in, out] on the wire)
// into its linear layer's [out, in]: a copy whose last dimension is strided on one side. The
// plan copies it a row of one element at a time, bucket boundaries anywhere.
TEST_CASE("a transposing copy (a Conv1D weight into a linear layer) matches the reference") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 100; ++trial) {
    const std::int64_t in = 1 + rng() % 40, out = 1 + rng() % 40;
    const std::size_t bucket = 256 * (1 + rng() % 3);
    const Layout wire = Layout::build({{"pad", DType::kInt8, {static_cast<std::int64_t>(rng() % 200) + 1}},
                                       {"c_attn", DType::kFloat32, {in, out}}},
                                      {.bucket_bytes = bucket});
    const Layout engine = Layout::build({{"qkv", DType::kFloat32, {out, in}},
                                         {"p", DType::kInt8, {1}}});
    // engine[o][i] = wire[i][o]
    const std::vector<PlanCopy> copies = {{"c_attn", "qkv", {out, in}, 0, {1, out}, 0, {in, 1}},
                                          {"pad", "p", {1}, 0, {1}, 0, {1}}};
    INFO("in=" << in << " out=" << out << " bucket=" << bucket);
    REQUIRE(pieces_match_reference(wire, engine, copies, trial));
  }
}

TEST_CASE("a plan refuses copies that do not fit, naming the tensors and the values") {
  FusedModel m;
  const auto refused = [&](std::vector<PlanCopy> copies) {
    return message_of([&] { ReceivePlan::build(m.wire, m.engine, copies); });
  };
  auto copies = m.copies();

  SECTION("an engine tensor not written completely") {
    copies.erase(copies.begin() + 1);  // k_proj's rows of qkv_proj stay unwritten
    const std::string why = refused(copies);
    CHECK_THAT(why, Catch::Contains("'qkv_proj' (384 of 512 bytes)"));
    CHECK_THAT(why, Catch::Contains("older version"));
  }
  SECTION("a byte written twice") {
    copies[1].dst_offset = 0;  // k over q's first rows
    CHECK_THAT(refused(copies), Catch::Contains("engine tensor 'qkv_proj': bytes 0..128 of it are "
                                                "written twice (by the copies from 'q_proj' and "
                                                "from 'k_proj')"));
  }
  SECTION("a tensor that is not in its layout") {
    copies[0].wire = "model.q_proj";
    CHECK_THAT(refused(copies), Catch::Contains("'model.q_proj' is not a tensor of the wire layout"));
  }
  SECTION("a view outside its tensor") {
    copies[0].src_offset = 9 * 16;  // rows 9..16 of a 16-row q_proj
    CHECK_THAT(refused(copies),
               Catch::Contains("the source view (offset 144, shape [8, 16], strides [16, 1]) "
                               "reaches element 271, outside tensor 'q_proj' of 256 elements"));
  }
  SECTION("shape and strides of different ranks") {
    copies[4].src_strides = {16, 1};
    CHECK_THAT(refused(copies), Catch::Contains("shape [16] has 1 dimensions but the source "
                                                "strides [16, 1]"));
  }
  SECTION("dtypes that differ") {
    const Layout wire = Layout::build({{"norm", DType::kBFloat16, {16}}});
    const Layout engine = Layout::build({{"norm", DType::kFloat32, {16}}});
    CHECK_THAT(message_of([&] { ReceivePlan::build(wire, engine, {{"norm", "norm", {16}, 0, {1}, 0, {1}}}); }),
               Catch::Contains("wire tensor 'norm' is bf16 but engine tensor 'norm' is fp32"));
  }
  SECTION("groups that differ") {
    const Layout wire = Layout::build({{"a", DType::kInt8, {4}, "base"}, {"l", DType::kInt8, {4}, "lora"}});
    const Layout engine = Layout::build({{"a", DType::kInt8, {4}, "base"}});
    CHECK_THAT(message_of([&] { ReceivePlan::build(wire, engine, {}); }),
               Catch::Contains("group 1 of the wire layout is 'lora' but of the engine layout none"));
  }
}

TEST_CASE("a receiver with a plan takes the wire layout's updates into the engine's layout") {
  FusedModel m;
  HostBackend backend;
  LoopbackCommunicator world(2);
  Sender sender(m.wire, backend, world.transport(0));
  ReceiverConfig config;
  config.update_deadline = std::chrono::seconds(20);
  Receiver receiver(m.engine, ReceivePlan::build(m.wire, m.engine, m.copies()), backend,
                    world.transport(1), config);
  CHECK(receiver.wire_layout().fingerprint() == m.wire.fingerprint());
  auto engine_stream = backend.create_stream(StreamPriority::kNormal);

  for (unsigned version = 1; version <= 3; ++version) {
    const auto wire_arena =
        send_and_apply(sender, receiver, backend, *engine_stream, m.wire, version, 100 + version);
    const std::byte* live = receiver.step_hook().live_arena(0);
    const auto expected = reference(m.wire, m.engine, m.copies(), wire_arena);
    for (const auto& t : m.engine.groups()[0].tensors()) {
      INFO("version " << version << " tensor " << t.spec.name);
      CHECK(std::memcmp(live + t.offset, expected.data() + t.offset, t.bytes) == 0);
    }
  }
  CHECK(receiver.stats().updates_ready == 3);
}

TEST_CASE("a receiver refuses a plan of another engine layout and the non-finite guard with one") {
  FusedModel m;
  HostBackend backend;
  const Layout other = Layout::build({{"qkv_proj", DType::kBFloat16, {16, 16}}});
  CHECK_THAT(message_of([&] {
               Receiver(other, ReceivePlan::build(m.wire, m.engine, m.copies()), backend, nullptr);
             }),
             Catch::Contains("the receive plan was built for engine layout"));
  ReceiverConfig config;
  config.reject_nonfinite = true;
  CHECK_THAT(message_of([&] {
               Receiver(m.engine, ReceivePlan::build(m.wire, m.engine, m.copies()), backend,
                        nullptr, config);
             }),
             Catch::Contains("reject_nonfinite is not available with a receive plan"));
  CHECK(backend.bytes_allocated() == 0);
}

TEST_CASE("a plan refuses kept tensors it cannot keep, naming them") {
  FusedModel m;
  auto copies = m.copies();
  const auto refused = [&](const std::vector<PlanCopy>& c, const std::vector<std::string>& kept) {
    return message_of([&] { ReceivePlan::build(m.wire, m.engine, c, kept); });
  };
  SECTION("a kept tensor the engine layout does not have") {
    CHECK_THAT(refused(copies, {"model.norm"}),
               Catch::Contains("kept tensor 'model.norm' is not a tensor of the engine layout (3 "
                               "tensors)"));
  }
  SECTION("a kept tensor named twice") {
    copies.pop_back();  // nothing writes the norm
    CHECK_THAT(refused(copies, {"norm", "norm"}), Catch::Contains("kept tensor 'norm' is named "
                                                                  "twice"));
  }
  SECTION("a kept tensor a copy writes") {
    CHECK_THAT(refused(copies, {"norm"}),
               Catch::Contains("engine tensor 'norm' is kept, but the plan writes 64 of its 64 "
                               "bytes"));
  }
  SECTION("a tensor neither written nor kept") {
    copies.pop_back();
    CHECK_THAT(refused(copies, {}), Catch::Contains("'norm' (0 of 64 bytes)"));
    CHECK_NOTHROW(ReceivePlan::build(m.wire, m.engine, copies, {"norm"}));
  }
}

TEST_CASE("a kept tensor keeps the engine's bytes through every swap, under each strategy") {
  // The trainer does not send the norm (frozen); the engine's layout holds it. Updates land in
  // both slots in turn (rebind) or in the shadow that is copied into the live storage (copy_in,
  // the receiver's arena or the engine's own tensors): the norm must read as the engine had it
  // after every swap, while the rest follows the updates.
  FusedModel m;
  const Layout wire = Layout::build({{"q_proj", DType::kBFloat16, {16, 16}, "base"},
                                     {"k_proj", DType::kBFloat16, {8, 16}, "base"},
                                     {"v_proj", DType::kBFloat16, {8, 16}, "base"},
                                     {"o_proj", DType::kBFloat16, {16, 16}, "base"}},
                                    {.bucket_bytes = 256});
  std::vector<PlanCopy> copies = m.copies();
  copies.pop_back();  // the norm's
  struct Strategy {
    const char* name;
    SwapStrategy swap;
    bool engine_storage;
  };
  const Strategy strategy =
      GENERATE(Strategy{"rebind", SwapStrategy::kRebind, false},
               Strategy{"copy_in", SwapStrategy::kCopyIn, false},
               Strategy{"copy_in, engine storage", SwapStrategy::kCopyIn, true});
  INFO("strategy " << strategy.name);
  HostBackend backend;
  LoopbackCommunicator world(2);
  Sender sender(wire, backend, world.transport(0));
  ReceiverConfig config;
  config.update_deadline = std::chrono::seconds(20);
  config.swap_strategy = strategy.swap;
  Receiver receiver(m.engine, ReceivePlan::build(wire, m.engine, copies, {"norm"}), backend,
                    world.transport(1), config);
  auto engine_stream = backend.create_stream(StreamPriority::kNormal);
  const GroupLayout& group = m.engine.groups()[0];
  std::vector<std::byte> engine_tensors(group.arena_bytes());
  if (strategy.engine_storage) {
    std::vector<void*> addresses;
    for (const auto& t : group.tensors()) addresses.push_back(engine_tensors.data() + t.offset);
    receiver.use_engine_storage(0, addresses);
  }
  // The engine's weights, the norm among them, in the live storage before the first update.
  const std::size_t norm = *group.find_tensor("norm");
  const TensorPlacement& norm_place = group.tensors()[norm];
  const auto norm_bytes = random_bytes(norm_place.bytes, 7);
  std::memcpy(receiver.step_hook().live_tensor(0, norm), norm_bytes.data(), norm_place.bytes);

  for (unsigned version = 1; version <= 4; ++version) {
    const auto wire_arena =
        send_and_apply(sender, receiver, backend, *engine_stream, wire, version, 200 + version);
    const auto expected = reference(wire, m.engine, copies, wire_arena);
    for (std::size_t t = 0; t < group.tensors().size(); ++t) {
      const TensorPlacement& p = group.tensors()[t];
      INFO("version " << version << " tensor " << p.spec.name);
      const auto* live = static_cast<const std::byte*>(receiver.step_hook().live_tensor(0, t));
      const std::byte* want = t == norm ? norm_bytes.data() : expected.data() + p.offset;
      CHECK(std::memcmp(live, want, p.bytes) == 0);
    }
  }
}

TEST_CASE("quantized tensors share staging memory once quantized, each step after its last bucket") {
  // Three fp8 tensors, each from one bf16 wire tensor of 512 bytes; buckets of 512 bytes: tensor
  // t lands in bucket t alone, so its quantization runs after bucket t and the next one can use
  // the same staging bytes (stream order). A fourth, cut across two buckets, runs after the second.
  const auto spec = [](const std::string& name, DType dtype, std::vector<std::int64_t> shape) {
    return TensorSpec{name, dtype, std::move(shape), "base"};
  };
  std::vector<TensorSpec> wire_specs;
  std::vector<TensorSpec> engine_specs;
  std::vector<PlanCopy> copies;
  std::vector<PlanQuantization> quantized;
  for (int t = 0; t < 3; ++t) {
    const std::string w = "w" + std::to_string(t);
    const std::string e = "e" + std::to_string(t);
    wire_specs.push_back(spec(w, DType::kBFloat16, {16, 16}));
    engine_specs.push_back(spec(e, DType::kFloat8E4M3, {16, 16}));
    engine_specs.push_back(spec(e + "_scale", DType::kFloat32, {1}));
    copies.push_back({w, e, {16, 16}, 0, {16, 1}, 0, {16, 1}});
    quantized.push_back({e, e + "_scale", 1});
  }
  wire_specs.push_back(spec("cut", DType::kFloat32, {4, 64}));  // 1024 bytes: buckets 3 and 4
  engine_specs.push_back(spec("cut_fp8", DType::kFloat8E4M3, {4, 64}));
  engine_specs.push_back(spec("cut_scales", DType::kFloat32, {4}));
  copies.push_back({"cut", "cut_fp8", {4, 64}, 0, {64, 1}, 0, {64, 1}});
  quantized.push_back({"cut_fp8", "cut_scales", 4});
  const Layout wire = Layout::build(wire_specs, {.bucket_bytes = 512});
  const Layout engine = Layout::build(engine_specs);
  const ReceivePlan plan = ReceivePlan::build(wire, engine, copies, {}, quantized);
  REQUIRE(wire.groups()[0].bucket_count() == 5);
  // The largest staged tensor, not the sum (3 x 512 + 1024 bytes).
  CHECK(plan.staging_bytes() == 1024);
  for (std::size_t b = 0; b < 3; ++b) {
    REQUIRE(plan.quantize_steps(0, b).size() == 1);
    const PlanQuantizeStep& step = plan.quantize_steps(0, b)[0];
    CHECK(step.staging_offset == 0);
    CHECK(step.elements == 256);
    CHECK(step.source == DType::kBFloat16);
    CHECK(step.dst_offset == placement(engine, "e" + std::to_string(b)).offset);
    CHECK(step.scale_offset == placement(engine, "e" + std::to_string(b) + "_scale").offset);
    for (const PlanPiece& p : plan.pieces(0, b)) CHECK(p.to_staging);
  }
  CHECK(plan.quantize_steps(0, 3).empty());
  REQUIRE(plan.quantize_steps(0, 4).size() == 1);
  CHECK(plan.quantize_steps(0, 4)[0].parts == 4);
  CHECK(plan.quantize_steps(0, 4)[0].source == DType::kFloat32);
}
