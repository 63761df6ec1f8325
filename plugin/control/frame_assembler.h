// Splits the byte stream of one control connection into frames, checking each frame's header
// (parse_frame_header) before its body is buffered. Holds at most one incomplete frame plus one
// read's worth of bytes: a header announcing more than kMaxFrameBodyBytes is refused before its
// body is read. Not thread-safe: one per connection, used by the thread that reads it.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

#include "control/control_frame.h"

namespace shadowsync {

class FrameAssembler {
 public:
  enum class Status { kFrame, kNeedMore, kMalformed };

  // Appends bytes read from the peer. Invalidates frame().
  void feed(std::span<const std::byte> bytes);
  // The next complete frame (header and body) is then `frame()`, valid until the next call.
  // kMalformed: `error()` says why; the stream cannot be resynchronized, close it.
  Status next();
  std::span<const std::byte> frame() const { return frame_; }
  const FrameHeader& header() const { return header_; }
  const std::string& error() const { return error_; }
  // Bytes of an incomplete frame are waiting (for a per-frame read deadline).
  bool has_partial() const { return consumed_ < buffer_.size(); }

 private:
  std::vector<std::byte> buffer_;
  std::size_t consumed_ = 0;  // bytes of buffer_ already handed out as frames
  std::span<const std::byte> frame_;
  FrameHeader header_;
  std::string error_;
};

}  // namespace shadowsync
