// The receive plan: how the trainer's tensors (the *wire* layout: its names, unfused, unsharded)
// land in the engine's own parameters (the *engine* layout: fused, sharded, renamed) while the
// engine keeps generating.
//
// A plan is built once, at set-up, from a list of PlanCopy (one strided copy from a view of a
// wire tensor into a view of an engine tensor; the Python adapter derives them from the engine's
// own weight loaders). build() checks every copy against both layouts, checks that every byte of
// every engine tensor is written exactly once (a byte no copy writes would keep the value of the
// update before the last one: silently wrong weights), and splits the copies into pieces per wire
// bucket, so that the receiver runs a bucket's pieces on its stream as soon as the bucket landed.
//
// An engine tensor may hold the FP8 quantization of what the copies into it write (vLLM's
// quantization="fp8" computes it after loading): a PlanQuantization. Its copies land in the
// receiver's staging memory in their wire dtype, and right after the bucket with the last of them
// the receiver quantizes them into the tensor and their scales into the scale tensor
// (Backend::quantize_fp8_async), before the update is offered. Staging memory is reused once a
// tensor was quantized: it holds the tensors whose bytes are in flight at once (about a bucket's
// worth, plus the tensors a bucket boundary cuts), not all of them (staging_bytes()).
//
// An engine tensor no trainer tensor describes (frozen weights) may be declared *kept*: no copy
// writes it, and the receiver copies its live bytes into each slot once, before that slot's first
// receive, so that every swap shows it unchanged. Needed where the engine's memory is one arena of
// every parameter (vLLM's live arena), which a layout of the written tensors alone cannot match.
//
// Immutable once built; thread-safe to read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "shadowsync/layout.h"

namespace shadowsync {

// Copy `shape` elements from wire tensor `wire` (element offset `src_offset`, element strides
// `src_strides`) into engine tensor `engine` (`dst_offset`, `dst_strides`). Both tensors have the
// same dtype and belong to groups of the same name; offsets and strides count elements from the
// tensor's first one.
struct PlanCopy {
  std::string wire;
  std::string engine;
  std::vector<std::int64_t> shape;
  std::int64_t src_offset = 0;
  std::vector<std::int64_t> src_strides;
  std::int64_t dst_offset = 0;
  std::vector<std::int64_t> dst_strides;
};

// Engine tensor `engine` (kFloat8E4M3) holds the FP8 quantization of what the copies into it
// write, in `parts` equal consecutive parts (1: a layer; a MoE layer's experts: one each), with
// their float32 scales in engine tensor `scale` (`parts` elements, same group). The copies into
// `engine` are checked against it as a tensor of its shape in their wire dtype (fp32, fp16 or
// bf16).
struct PlanQuantization {
  std::string engine;
  std::string scale;
  std::int64_t parts = 1;
};

// What the receiver runs for one wire bucket: `rows` rows of `row_bytes` each, from the bucket as
// received (offsets from its first byte) into the engine group's arena (offsets from the arena's
// first byte), or with `to_staging` into the receiver's staging memory (offsets from its first
// byte). One Backend::memcpy_2d_async.
struct PlanPiece {
  std::size_t src_offset = 0;
  std::size_t src_pitch = 0;
  std::size_t dst_offset = 0;
  std::size_t dst_pitch = 0;
  std::size_t row_bytes = 0;
  std::size_t rows = 0;
  bool to_staging = false;
};

// What the receiver runs after a bucket's pieces: a staged tensor whose last bytes that bucket
// brought, quantized into the arena (Backend::quantize_fp8_async).
struct PlanQuantizeStep {
  std::size_t staging_offset = 0;  // bytes from the staging memory's first byte
  std::size_t elements = 0;
  DType source = DType::kBFloat16;
  std::size_t parts = 1;
  std::size_t dst_offset = 0;    // the fp8 tensor: bytes from the engine group's arena start
  std::size_t scale_offset = 0;  // its scales (float32), likewise
};

class ReceivePlan {
 public:
  // Checks and splits the copies. Throws Error(kLayoutMismatch) when the two layouts do not have
  // the same groups in the same order, or a copy names a tensor that is not in its layout, joins
  // tensors of different groups or dtypes; Error(kInvalidArgument) for a copy whose shape and
  // strides disagree in rank, that reaches outside either tensor, whose last dimension is not
  // contiguous on both sides (the plan copies rows), or when an engine tensor is not written
  // exactly once (each message names the tensors and the counts). `kept` names engine tensors
  // that no copy writes (see above); a kept tensor that is not in the engine layout, named twice,
  // or also written by a copy is refused (kLayoutMismatch / kInvalidArgument), named.
  //
  // `quantized` (PlanQuantization above): a tensor that is not kFloat8E4M3, a scale tensor that
  // is not float32 of `parts` elements in the same group, parts that do not divide the
  // elements, a tensor named twice, kept, or a scale a copy writes are refused, named; so are
  // copies into one quantized tensor from wire tensors of two dtypes, or of a dtype that cannot
  // be quantized.
  static ReceivePlan build(Layout wire, const Layout& engine, const std::vector<PlanCopy>& copies,
                           const std::vector<std::string>& kept = {},
                           const std::vector<PlanQuantization>& quantized = {});

  const Layout& wire() const { return wire_; }
  std::uint64_t engine_fingerprint() const { return engine_fingerprint_; }
  // The pieces of wire bucket `bucket` of group `group` (indices of the wire layout, which has
  // the engine's groups in the same order).
  const std::vector<PlanPiece>& pieces(std::size_t group, std::size_t bucket) const {
    return pieces_[group][bucket];
  }
  // The largest wire bucket: the size of the receiver's bucket buffer.
  std::size_t max_bucket_bytes() const { return max_bucket_bytes_; }
  std::size_t piece_count() const { return piece_count_; }
  // The kept tensors of engine group `group`, as indices into its tensors (layout order).
  const std::vector<std::size_t>& kept(std::size_t group) const { return kept_[group]; }
  // The quantizations to run once bucket `bucket` of group `group` landed, after its pieces.
  const std::vector<PlanQuantizeStep>& quantize_steps(std::size_t group, std::size_t bucket) const {
    return steps_[group][bucket];
  }
  // The receiver's staging memory for quantized tensors (0 without any).
  std::size_t staging_bytes() const { return staging_bytes_; }

 private:
  ReceivePlan(Layout wire) : wire_(std::move(wire)) {}

  Layout wire_;
  std::uint64_t engine_fingerprint_ = 0;
  std::vector<std::vector<std::vector<PlanPiece>>> pieces_;  // [group][bucket]
  std::vector<std::vector<std::size_t>> kept_;               // [engine group] -> tensor indices
  std::vector<std::vector<std::vector<PlanQuantizeStep>>> steps_;  // [group][bucket]
  std::size_t staging_bytes_ = 0;
  std::size_t max_bucket_bytes_ = 0;
  std::size_t piece_count_ = 0;
};

}  // namespace shadowsync
