// libFuzzer target for the control channel's frame parser: what an unauthenticated peer's bytes
// reach first (the handshake frames are parsed before anything is verified), and what every
// authenticated frame goes through after its tag. Built and run by scripts/fuzz.sh.
//
// The input is a byte stream, fed to a FrameAssembler in chunks whose sizes come from the input's
// first byte; every complete frame's payload is decoded. Properties checked beyond "no crash, no
// sanitizer report, no runaway allocation":
// * a decoded payload re-encodes to exactly the same bytes (the encoding is canonical, so the
//   decoder accepted nothing it would not itself have written);
// * the assembler never holds more than one maximal frame plus one chunk.
// The seed corpus (tests/fuzz/corpus/) holds one valid frame of every type, as encode_frame writes
// them (tagged frames with a zero tag; the rendezvous once per transport kind: rendezvous is
// NCCL's, rendezvous_same_host the same-host one), and one stream of all of them.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "control/control_frame.h"
#include "control/frame_assembler.h"

using namespace shadowsync;

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

void decode_frame(const FrameHeader& header, std::span<const std::byte> frame) {
  std::span<const std::byte> payload = frame.subspan(kFrameHeaderBytes);
  if (is_tagged(header.type)) {
    check(payload.size() >= kControlMacBytes);  // parse_frame_header guarantees it
    payload = payload.first(payload.size() - kControlMacBytes);
  }
  ControlMessage message;
  if (decode_payload(header.type, payload, message)) return;  // refused, with a reason
  check(frame_type_of(message) == header.type);
  const std::vector<std::byte> again = encode_frame(message);
  check(again.size() == kFrameHeaderBytes + payload.size());
  check(std::equal(payload.begin(), payload.end(), again.begin() + kFrameHeaderBytes));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t chunk = 1 + data[0] % 64 * 37;  // 1..2332 bytes per read
  const std::span<const std::byte> stream(reinterpret_cast<const std::byte*>(data) + 1, size - 1);

  // Every type's decoder on the raw input too, so that payload decoding is fuzzed directly.
  for (std::uint16_t t = 1; t <= static_cast<std::uint16_t>(FrameType::kGoodbye); ++t) {
    ControlMessage message;
    if (!decode_payload(static_cast<FrameType>(t), stream, message)) {
      const std::vector<std::byte> again = encode_frame(message);
      check(again.size() - kFrameHeaderBytes == stream.size());
    }
  }

  FrameAssembler assembler;
  for (std::size_t offset = 0; offset < stream.size(); offset += chunk) {
    assembler.feed(stream.subspan(offset, std::min(chunk, stream.size() - offset)));
    for (;;) {
      const auto status = assembler.next();
      if (status == FrameAssembler::Status::kMalformed) return 0;  // the connection would close
      if (status == FrameAssembler::Status::kNeedMore) break;
      check(assembler.frame().size() == kFrameHeaderBytes + assembler.header().body_bytes);
      check(assembler.frame().size() <= kFrameHeaderBytes + kMaxFrameBodyBytes);
      decode_frame(assembler.header(), assembler.frame());
    }
  }
  return 0;
}
