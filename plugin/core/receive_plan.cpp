#include "shadowsync/receive_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "shadowsync/backend.h"
#include "shadowsync/error.h"

namespace shadowsync {
namespace {

struct Located {
  std::size_t group = 0;
  std::size_t tensor = 0;
  const TensorPlacement* placement = nullptr;
};

std::map<std::string, Located, std::less<>> index_tensors(const Layout& layout) {
  std::map<std::string, Located, std::less<>> index;
  for (std::size_t g = 0; g < layout.groups().size(); ++g) {
    const auto& tensors = layout.groups()[g].tensors();
    for (std::size_t t = 0; t < tensors.size(); ++t) index[tensors[t].spec.name] = {g, t, &tensors[t]};
  }
  return index;
}

std::string format_dims(const std::vector<std::int64_t>& dims) { return format_shape(dims); }

// One dimension of a copy: its extent and its strides on both sides, in bytes for the strides.
struct Dim {
  std::size_t size = 1;
  std::size_t src_stride = 0;
  std::size_t dst_stride = 0;
};

// A copy in bytes, reduced to rows: the outer dimensions (outermost first) around one 2-D block of
// `rows` rows of `row_bytes` contiguous bytes on both sides.
struct Normalized {
  std::vector<Dim> outer;  // iterated by the splitter, each yields one 2-D block
  std::size_t rows = 1;
  std::size_t src_pitch = 0;
  std::size_t dst_pitch = 0;
  std::size_t row_bytes = 0;
  std::size_t src_start = 0;  // bytes from the wire arena's start
  std::size_t dst_start = 0;  // bytes from the engine arena's start
};

class PlanBuilder {
 public:
  PlanBuilder(const Layout& wire, const Layout& engine) : wire_(wire), engine_(engine) {
    check_groups();
    wire_index_ = index_tensors(wire);
    engine_index_ = index_tensors(engine);
    pieces_.resize(wire.groups().size());
    intervals_.resize(engine.groups().size());
    for (std::size_t g = 0; g < wire.groups().size(); ++g) {
      pieces_[g].resize(wire.groups()[g].bucket_count());
    }
  }

  void add(std::size_t i, const PlanCopy& copy) {
    const Located& src = find(wire_index_, copy.wire, "wire", i, copy);
    const auto staged = staged_.find(copy.engine);
    if (staged != staged_.end()) {
      add_staged(i, copy, src, staged->second);
      return;
    }
    const Located& dst = find(engine_index_, copy.engine, "engine", i, copy);
    const TensorSpec& s = src.placement->spec;
    const TensorSpec& d = dst.placement->spec;
    if (scales_.count({dst.group, dst.tensor}) > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{}: engine tensor '{}' holds the scales of a quantized tensor, "
                              "which the receiver computes; no copy may write it",
                              name(i, copy), d.name));
    }
    if (src.group != dst.group) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: wire tensor '{}' is in group '{}' but engine tensor '{}' in "
                              "group '{}'; a copy stays inside one group",
                              name(i, copy), s.name, s.group, d.name, d.group));
    }
    if (s.dtype != d.dtype) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: wire tensor '{}' is {} but engine tensor '{}' is {}; a receive "
                              "plan copies bytes, it does not convert",
                              name(i, copy), s.name, dtype_name(s.dtype), d.name,
                              dtype_name(d.dtype)));
    }
    const Normalized n = normalize(i, copy, *src.placement, *dst.placement);
    record_destination(i, dst, n);
    split(src.group, n);
  }

  // The engine tensors no copy may write: by (group, tensor index), checked against the layout.
  void keep(const std::vector<std::string>& names) {
    kept_.assign(engine_.groups().size(), {});
    for (const std::string& name : names) {
      const auto it = engine_index_.find(name);
      if (it == engine_index_.end()) {
        throw Error(ErrorCode::kLayoutMismatch,
                    fmt::format("kept tensor '{}' is not a tensor of the engine layout ({} "
                                "tensors)",
                                name, engine_index_.size()));
      }
      auto& group = kept_[it->second.group];
      if (std::find(group.begin(), group.end(), it->second.tensor) != group.end()) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("kept tensor '{}' is named twice", name));
      }
      group.push_back(it->second.tensor);
    }
  }

  // The quantized tensors, checked against the engine layout and the kept ones (keep() first).
  void quantize(const std::vector<PlanQuantization>& quantized) {
    for (const PlanQuantization& q : quantized) {
      const std::string what = fmt::format("quantized tensor '{}'", q.engine);
      const Located& engine = engine_tensor(q.engine, what);
      const Located& scale = engine_tensor(q.scale, what + ": its scale tensor");
      const TensorSpec& e = engine.placement->spec;
      const TensorSpec& sc = scale.placement->spec;
      if (e.dtype != DType::kFloat8E4M3) {
        throw Error(ErrorCode::kLayoutMismatch,
                    fmt::format("{} is {}; a quantized tensor is fp8_e4m3", what,
                                dtype_name(e.dtype)));
      }
      const std::size_t elements = engine.placement->bytes;
      if (q.parts <= 0 || elements % static_cast<std::size_t>(q.parts) != 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("{}: its {} elements do not split into {} equal parts", what,
                                elements, q.parts));
      }
      const auto parts = static_cast<std::size_t>(q.parts);
      if (sc.dtype != DType::kFloat32 || scale.placement->bytes != parts * 4 ||
          scale.group != engine.group) {
        throw Error(ErrorCode::kLayoutMismatch,
                    fmt::format("{}: scale tensor '{}' is {} of {} elements in group '{}'; it "
                                "needs fp32 of {} elements (one per part) in group '{}'",
                                what, q.scale, dtype_name(sc.dtype),
                                scale.placement->bytes / dtype_size(sc.dtype), sc.group, parts,
                                e.group));
      }
      for (const Located* t : {&engine, &scale}) {
        const auto& kept = kept_[t->group];
        const bool named = staged_.count(t->placement->spec.name) > 0 ||
                           scales_.count({t->group, t->tensor}) > 0;
        if (named || std::find(kept.begin(), kept.end(), t->tensor) != kept.end()) {
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("{}: '{}' is {}; a quantized tensor and its scales are "
                                  "written by the receiver alone, once",
                                  what, t->placement->spec.name,
                                  named ? "named by another quantization" : "kept"));
        }
      }
      Staged& staged = staged_[q.engine];
      staged.engine = &engine;
      staged.scale = &scale;
      staged.parts = parts;
      staged.placement.spec = e;  // its dtype is the copies' (add_staged), its offset 0
      scales_.insert({scale.group, scale.tensor});
    }
  }

  // Every engine tensor written exactly once, or kept and not written at all: no byte twice
  // (record_destination collected the ranges), and as many bytes as it has.
  void check_coverage(const std::vector<PlanCopy>& copies) {
    for (std::size_t g = 0; g < intervals_.size(); ++g) {
      auto& ranges = intervals_[g];
      std::sort(ranges.begin(), ranges.end());
      for (std::size_t k = 1; k < ranges.size(); ++k) {
        if (ranges[k].begin >= ranges[k - 1].end) continue;
        const Located& t = owner(g, ranges[k].begin);
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("engine tensor '{}': bytes {}..{} of it are written twice (by the "
                                "copies from '{}' and from '{}'); a receive plan writes each byte "
                                "once",
                                t.placement->spec.name, ranges[k].begin - t.placement->offset,
                                std::min(ranges[k].end, ranges[k - 1].end) - t.placement->offset,
                                copies[ranges[k - 1].copy].wire, copies[ranges[k].copy].wire));
      }
    }
    std::vector<std::string> missing;
    std::size_t missing_count = 0;
    for (std::size_t g = 0; g < engine_.groups().size(); ++g) {
      const auto& tensors = engine_.groups()[g].tensors();
      for (std::size_t t = 0; t < tensors.size(); ++t) {
        const auto it = written_.find({g, t});
        const std::size_t written = it == written_.end() ? 0 : it->second;
        const auto& kept = kept_[g];
        if (std::find(kept.begin(), kept.end(), t) != kept.end()) {
          if (written == 0) continue;
          throw Error(ErrorCode::kInvalidArgument,
                      fmt::format("engine tensor '{}' is kept, but the plan writes {} of its {} "
                                  "bytes; a kept tensor is written by no copy",
                                  tensors[t].spec.name, written, tensors[t].bytes));
        }
        if (written == tensors[t].bytes) continue;
        if (scales_.count({g, t}) > 0 || staged_.count(tensors[t].spec.name) > 0) {
          continue;  // written by the quantization (the staged bytes are checked below)
        }
        ++missing_count;
        if (missing.size() < 8) {
          missing.push_back(fmt::format("'{}' ({} of {} bytes)", tensors[t].spec.name, written,
                                        tensors[t].bytes));
        }
      }
    }
    for (auto& [name, staged] : staged_) {
      auto& ranges = staged.ranges;
      std::sort(ranges.begin(), ranges.end());
      for (std::size_t k = 1; k < ranges.size(); ++k) {
        if (ranges[k].begin >= ranges[k - 1].end) continue;
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("quantized tensor '{}': staged bytes {}..{} of it are written "
                                "twice (by the copies from '{}' and from '{}'); a receive plan "
                                "writes each byte once",
                                name, ranges[k].begin, std::min(ranges[k].end, ranges[k - 1].end),
                                copies[ranges[k - 1].copy].wire, copies[ranges[k].copy].wire));
      }
      if (staged.written == staged.placement.bytes && staged.dtype_known) continue;
      ++missing_count;
      if (missing.size() < 8) {
        missing.push_back(fmt::format("'{}' (quantized: {} of {} staged bytes)", name,
                                      staged.written, staged.placement.bytes));
      }
    }
    if (missing_count > 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{} engine tensor(s) not written completely by the plan: {}{}; "
                              "their bytes would keep an older version's values",
                              missing_count, fmt::join(missing, ", "),
                              missing_count > missing.size() ? ", ..." : ""));
    }
  }

  // Places each staged tensor in the staging memory from the bucket of its first piece to the
  // bucket of its last, after which its quantization runs (stream order: a tensor whose first
  // piece comes in a later bucket may reuse the bytes), and lists the quantizations per bucket.
  // Returns the staging memory's size.
  std::size_t place_staged() {
    steps_.resize(pieces_.size());
    for (std::size_t g = 0; g < pieces_.size(); ++g) steps_[g].resize(pieces_[g].size());
    std::vector<Staged*> order;
    for (auto& [name, staged] : staged_) order.push_back(&staged);
    std::sort(order.begin(), order.end(),
              [](const Staged* a, const Staged* b) { return a->first < b->first; });
    struct Live {
      std::size_t begin, end;
      std::pair<std::size_t, std::size_t> last;
    };
    std::vector<Live> live;
    std::size_t staging = 0;
    for (Staged* t : order) {
      live.erase(std::remove_if(live.begin(), live.end(),
                                [&](const Live& l) { return l.last < t->first; }),
                 live.end());
      std::sort(live.begin(), live.end(),
                [](const Live& a, const Live& b) { return a.begin < b.begin; });
      const std::size_t bytes = align_up(t->placement.bytes);
      std::size_t at = 0;
      for (const Live& l : live) {
        if (at + bytes <= l.begin) break;
        at = std::max(at, l.end);
      }
      live.push_back({at, at + bytes, t->last});
      staging = std::max(staging, at + bytes);
      for (const auto& [g, b, index] : t->pieces) pieces_[g][b][index].dst_offset += at;
      const TensorPlacement& e = *t->engine->placement;
      steps_[t->last.first][t->last.second].push_back(
          {at, e.bytes, t->placement.spec.dtype, t->parts, e.offset,
           t->scale->placement->offset});
    }
    return staging;
  }

  std::vector<std::vector<std::vector<PlanQuantizeStep>>> take_steps() { return std::move(steps_); }
  std::vector<std::vector<std::vector<PlanPiece>>> take_pieces() { return std::move(pieces_); }
  std::vector<std::vector<std::size_t>> take_kept() { return std::move(kept_); }
  std::size_t piece_count() const { return piece_count_; }

 private:
  struct Interval {
    std::size_t begin = 0;
    std::size_t end = 0;
    std::size_t copy = 0;
    bool operator<(const Interval& other) const { return begin < other.begin; }
  };

  // A quantized tensor as the copies write it: staged in their wire dtype, then quantized.
  struct Staged {
    const Located* engine = nullptr;  // the fp8 tensor
    const Located* scale = nullptr;
    std::size_t parts = 1;
    TensorPlacement placement;  // its shape in the copies' dtype, from the staging offset 0
    bool dtype_known = false;
    std::size_t written = 0;
    std::vector<Interval> ranges;
    std::vector<std::tuple<std::size_t, std::size_t, std::size_t>> pieces;  // (group, bucket, i)
    std::pair<std::size_t, std::size_t> first{SIZE_MAX, SIZE_MAX};  // (group, bucket)
    std::pair<std::size_t, std::size_t> last{0, 0};
  };

  static std::size_t align_up(std::size_t bytes) {
    return (bytes + kTensorAlignment - 1) / kTensorAlignment * kTensorAlignment;
  }

  const Located& engine_tensor(const std::string& tensor, const std::string& what) const {
    const auto it = engine_index_.find(tensor);
    if (it == engine_index_.end()) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: '{}' is not a tensor of the engine layout ({} tensors)", what,
                              tensor, engine_index_.size()));
    }
    return it->second;
  }

  void add_staged(std::size_t i, const PlanCopy& copy, const Located& src, Staged& staged) {
    const TensorSpec& s = src.placement->spec;
    const TensorSpec& e = staged.engine->placement->spec;
    if (src.group != staged.engine->group) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: wire tensor '{}' is in group '{}' but engine tensor '{}' in "
                              "group '{}'; a copy stays inside one group",
                              name(i, copy), s.name, s.group, e.name, e.group));
    }
    if (!staged.dtype_known) {
      if (!dtype_has_nonfinite_check(s.dtype)) {
        throw Error(ErrorCode::kLayoutMismatch,
                    fmt::format("{}: wire tensor '{}' is {}; a quantized tensor is quantized "
                                "from fp32, fp16 or bf16",
                                name(i, copy), s.name, dtype_name(s.dtype)));
      }
      staged.placement.spec.dtype = s.dtype;
      staged.placement.bytes = staged.engine->placement->bytes * dtype_size(s.dtype);
      staged.dtype_known = true;
    } else if (s.dtype != staged.placement.spec.dtype) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: wire tensor '{}' is {} but the copies before it into "
                              "quantized tensor '{}' are {}; one tensor is quantized from one "
                              "dtype",
                              name(i, copy), s.name, dtype_name(s.dtype), e.name,
                              dtype_name(staged.placement.spec.dtype)));
    }
    const Normalized n = normalize(i, copy, *src.placement, staged.placement);
    for_each_block(n, [&](std::size_t, std::size_t start) {
      staged.written += n.rows * n.row_bytes;
      for (std::size_t r = 0; r < n.rows; ++r) {
        staged.ranges.push_back(
            {start + r * n.dst_pitch, start + r * n.dst_pitch + n.row_bytes, i});
      }
    });
    split(src.group, n, &staged);
  }

  static std::string name(std::size_t i, const PlanCopy& copy) {
    return fmt::format("plan copy {} ('{}' -> '{}')", i, copy.wire, copy.engine);
  }

  void check_groups() const {
    const auto& w = wire_.groups();
    const auto& e = engine_.groups();
    for (std::size_t g = 0; g < std::max(w.size(), e.size()); ++g) {
      const std::string wn = g < w.size() ? "'" + w[g].name() + "'" : "none";
      const std::string en = g < e.size() ? "'" + e[g].name() + "'" : "none";
      if (wn == en) continue;
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("group {} of the wire layout is {} but of the engine layout {}; "
                              "both layouts need the same groups in the same order",
                              g, wn, en));
    }
  }

  const Located& find(const std::map<std::string, Located, std::less<>>& index,
                      const std::string& tensor, const char* which, std::size_t i,
                      const PlanCopy& copy) const {
    const auto it = index.find(tensor);
    if (it == index.end()) {
      throw Error(ErrorCode::kLayoutMismatch,
                  fmt::format("{}: '{}' is not a tensor of the {} layout ({} tensors)",
                              name(i, copy), tensor, which, index.size()));
    }
    return it->second;
  }

  Normalized normalize(std::size_t i, const PlanCopy& copy, const TensorPlacement& src,
                       const TensorPlacement& dst) const {
    const std::size_t rank = copy.shape.size();
    if (copy.src_strides.size() != rank || copy.dst_strides.size() != rank) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{}: shape {} has {} dimensions but the source strides {} and the "
                              "destination strides {}",
                              name(i, copy), format_dims(copy.shape), rank,
                              format_dims(copy.src_strides), format_dims(copy.dst_strides)));
    }
    check_extent(i, copy, "source", copy.src_offset, copy.src_strides, src);
    check_extent(i, copy, "destination", copy.dst_offset, copy.dst_strides, dst);

    const std::size_t element = dtype_size(src.spec.dtype);
    std::vector<Dim> dims;
    for (std::size_t k = 0; k < rank; ++k) {
      if (copy.shape[k] == 1) continue;  // no extent: its strides never matter
      dims.push_back({static_cast<std::size_t>(copy.shape[k]),
                      static_cast<std::size_t>(copy.src_strides[k]) * element,
                      static_cast<std::size_t>(copy.dst_strides[k]) * element});
    }
    // A plan copies rows of contiguous bytes. A last dimension of one element (a column), or one
    // that is not contiguous on both sides (a transposing copy: vLLM's loaders transpose Hugging
    // Face's Conv1D weights), is copied as rows of one element each.
    if (rank == 0 || dims.empty() || dims.back().src_stride != element ||
        dims.back().dst_stride != element) {
      dims.push_back({1, element, element});
    }
    // Merge each dimension into the one inside it where both sides are contiguous across them.
    std::vector<Dim> merged{dims.back()};
    merged.back().size *= element;  // the innermost one counts bytes from here on
    merged.back().src_stride = merged.back().dst_stride = 1;
    for (std::size_t k = dims.size() - 1; k-- > 0;) {
      Dim& inner = merged.front();
      const Dim& outer = dims[k];
      if (outer.src_stride == inner.size * inner.src_stride &&
          outer.dst_stride == inner.size * inner.dst_stride && inner.src_stride == 1 &&
          merged.size() == 1) {
        inner.size *= outer.size;
      } else {
        merged.insert(merged.begin(), outer);
      }
    }
    Normalized n;
    n.row_bytes = merged.back().size;
    merged.pop_back();
    if (!merged.empty()) {
      n.rows = merged.back().size;
      n.src_pitch = merged.back().src_stride;
      n.dst_pitch = merged.back().dst_stride;
      merged.pop_back();
      if (n.src_pitch < n.row_bytes || n.dst_pitch < n.row_bytes) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("{}: rows of {} bytes overlap (source pitch {}, destination pitch "
                                "{} bytes); a receive plan reads and writes whole rows once",
                                name(i, copy), n.row_bytes, n.src_pitch, n.dst_pitch));
      }
    } else {
      n.src_pitch = n.dst_pitch = n.row_bytes;
    }
    n.outer = std::move(merged);
    n.src_start = src.offset + static_cast<std::size_t>(copy.src_offset) * element;
    n.dst_start = dst.offset + static_cast<std::size_t>(copy.dst_offset) * element;
    return n;
  }

  static void check_extent(std::size_t i, const PlanCopy& copy, const char* side,
                           std::int64_t offset, const std::vector<std::int64_t>& strides,
                           const TensorPlacement& tensor) {
    const std::int64_t elements =
        static_cast<std::int64_t>(tensor.bytes / dtype_size(tensor.spec.dtype));
    std::int64_t last = offset;
    bool bad = offset < 0;
    for (std::size_t k = 0; k < copy.shape.size(); ++k) {
      if (copy.shape[k] <= 0 || strides[k] < 0) bad = true;
      last += (copy.shape[k] - 1) * strides[k];
    }
    if (!bad && last < elements) return;
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: the {} view (offset {}, shape {}, strides {}) reaches element "
                            "{}, outside tensor '{}' of {} elements {} (positive shape, "
                            "non-negative offset and strides expected)",
                            name(i, copy), side, offset, format_dims(copy.shape),
                            format_dims(strides), last, tensor.spec.name, elements,
                            format_dims(tensor.spec.shape)));
  }

  // Visits each 2-D block of `n` (one per index of its outer dimensions) with its start offsets.
  template <typename F>
  static void for_each_block(const Normalized& n, F&& visit) {
    std::vector<std::size_t> index(n.outer.size(), 0);
    for (;;) {
      std::size_t src = n.src_start;
      std::size_t dst = n.dst_start;
      for (std::size_t k = 0; k < index.size(); ++k) {
        src += index[k] * n.outer[k].src_stride;
        dst += index[k] * n.outer[k].dst_stride;
      }
      visit(src, dst);
      std::size_t k = index.size();
      while (k > 0 && ++index[k - 1] == n.outer[k - 1].size) index[--k] = 0;
      if (k == 0) return;
    }
  }

  void record_destination(std::size_t i, const Located& dst, const Normalized& n) {
    std::size_t& written = written_[{dst.group, dst.tensor}];
    auto& ranges = intervals_[dst.group];
    for_each_block(n, [&](std::size_t, std::size_t start) {
      written += n.rows * n.row_bytes;
      if (n.dst_pitch == n.row_bytes) {
        ranges.push_back({start, start + n.rows * n.row_bytes, i});
        return;
      }
      for (std::size_t r = 0; r < n.rows; ++r) {
        ranges.push_back({start + r * n.dst_pitch, start + r * n.dst_pitch + n.row_bytes, i});
      }
    });
  }

  // Cuts each 2-D block at the wire's bucket boundaries: runs of whole rows inside one bucket
  // become one piece; a row that crosses a boundary becomes one piece per bucket it touches.
  void split(std::size_t group, const Normalized& n, Staged* staged = nullptr) {
    const std::size_t bucket = wire_.groups()[group].bucket_bytes();
    auto& out = pieces_[group];
    const auto emit = [&](std::size_t src, std::size_t src_pitch, std::size_t dst,
                          std::size_t dst_pitch, std::size_t row_bytes, std::size_t rows) {
      const std::size_t b = src / bucket;
      out[b].push_back({src - b * bucket, src_pitch, dst, dst_pitch, row_bytes, rows,
                        staged != nullptr});
      ++piece_count_;
      if (staged == nullptr) return;
      staged->pieces.emplace_back(group, b, out[b].size() - 1);
      staged->first = std::min(staged->first, std::pair{group, b});
      staged->last = std::max(staged->last, std::pair{group, b});
    };
    for_each_block(n, [&](std::size_t src_start, std::size_t dst_start) {
      std::size_t r = 0;
      while (r < n.rows) {
        const std::size_t src = src_start + r * n.src_pitch;
        const std::size_t dst = dst_start + r * n.dst_pitch;
        const std::size_t bucket_end = (src / bucket + 1) * bucket;
        if (src + n.row_bytes <= bucket_end) {
          const std::size_t fit = (bucket_end - n.row_bytes - src) / n.src_pitch + 1;
          const std::size_t rows = std::min(n.rows - r, fit);
          emit(src, n.src_pitch, dst, n.dst_pitch, n.row_bytes, rows);
          r += rows;
          continue;
        }
        for (std::size_t off = 0; off < n.row_bytes;) {
          const std::size_t at = src + off;
          const std::size_t length = std::min(n.row_bytes - off, (at / bucket + 1) * bucket - at);
          emit(at, length, dst + off, length, length, 1);
          off += length;
        }
        ++r;
      }
    });
  }

  const Located& owner(std::size_t group, std::size_t byte) const {
    for (const auto& [name, located] : engine_index_) {
      const TensorPlacement& t = *located.placement;
      if (located.group == group && byte >= t.offset && byte < t.offset + t.bytes) return located;
    }
    throw Error(ErrorCode::kInternal, fmt::format("no engine tensor holds byte {}", byte));
  }

  const Layout& wire_;
  const Layout& engine_;
  std::map<std::string, Located, std::less<>> wire_index_;
  std::map<std::string, Located, std::less<>> engine_index_;
  std::vector<std::vector<std::vector<PlanPiece>>> pieces_;
  std::vector<std::vector<Interval>> intervals_;                       // per engine group
  std::map<std::pair<std::size_t, std::size_t>, std::size_t> written_;  // (group, tensor) -> bytes
  std::vector<std::vector<std::size_t>> kept_;                          // per engine group
  std::map<std::string, Staged, std::less<>> staged_;                   // by engine tensor name
  std::set<std::pair<std::size_t, std::size_t>> scales_;                // (group, tensor)
  std::vector<std::vector<std::vector<PlanQuantizeStep>>> steps_;       // [group][bucket]
  std::size_t piece_count_ = 0;
};

}  // namespace

ReceivePlan ReceivePlan::build(Layout wire, const Layout& engine,
                               const std::vector<PlanCopy>& copies,
                               const std::vector<std::string>& kept,
                               const std::vector<PlanQuantization>& quantized) {
  PlanBuilder builder(wire, engine);
  builder.keep(kept);
  builder.quantize(quantized);
  for (std::size_t i = 0; i < copies.size(); ++i) builder.add(i, copies[i]);
  builder.check_coverage(copies);
  ReceivePlan plan(std::move(wire));
  plan.engine_fingerprint_ = engine.fingerprint();
  plan.staging_bytes_ = builder.place_staged();
  plan.steps_ = builder.take_steps();
  plan.pieces_ = builder.take_pieces();
  plan.kept_ = builder.take_kept();
  plan.piece_count_ = builder.piece_count();
  for (const auto& g : plan.wire_.groups()) {
    if (g.bucket_count() > 0) plan.max_bucket_bytes_ = std::max(plan.max_bucket_bytes_, g.bucket(0).bytes);
  }
  return plan;
}

}  // namespace shadowsync
