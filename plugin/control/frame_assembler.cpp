#include "control/frame_assembler.h"

#include <utility>

namespace shadowsync {

void FrameAssembler::feed(std::span<const std::byte> bytes) {
  if (consumed_ > 0) {  // drop frames already handed out before growing
    buffer_.erase(buffer_.begin(), buffer_.begin() + static_cast<std::ptrdiff_t>(consumed_));
    consumed_ = 0;
  }
  frame_ = {};
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
}

FrameAssembler::Status FrameAssembler::next() {
  frame_ = {};
  if (!error_.empty()) return Status::kMalformed;
  const std::span<const std::byte> pending(buffer_.data() + consumed_, buffer_.size() - consumed_);
  if (pending.size() < kFrameHeaderBytes) return Status::kNeedMore;
  FrameHeader header;
  if (auto error = parse_frame_header(pending.first(kFrameHeaderBytes), header)) {
    error_ = std::move(*error);
    return Status::kMalformed;
  }
  const std::size_t total = kFrameHeaderBytes + header.body_bytes;
  if (pending.size() < total) return Status::kNeedMore;
  header_ = header;
  frame_ = pending.first(total);
  consumed_ += total;
  return Status::kFrame;
}

}  // namespace shadowsync
