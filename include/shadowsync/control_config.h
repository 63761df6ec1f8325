// Settings both ends of the control channel share: the token that authenticates a connection,
// the read and write deadlines, and where log lines go.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <string_view>

namespace shadowsync {

// The environment variable read when ControlConfig::token is empty.
inline constexpr const char* kControlTokenEnv = "SHADOWSYNC_CONTROL_TOKEN";
// A shorter token could be guessed offline from one recorded handshake (nonces and proofs travel
// in the clear), so short ones are refused. 32 random bytes, hex-encoded, is a good token.
inline constexpr std::size_t kMinControlTokenBytes = 16;

struct ControlConfig {
  // The shared secret; both ends must hold the same. Empty: read SHADOWSYNC_CONTROL_TOKEN. It is
  // used as the HMAC-SHA256 key and never sent.
  std::string token;
  // From accept (engine) or connect (trainer) until both hellos were exchanged. A peer that
  // connects and sends nothing is dropped after this.
  std::chrono::milliseconds handshake_timeout{5'000};
  // Once the first byte of a frame arrived, the rest must arrive within this (a peer trickling
  // bytes cannot hold a connection half-read). An idle connection between frames has no timeout:
  // a trainer may be silent for a whole training step; TCP keepalive finds dead peers.
  std::chrono::milliseconds frame_timeout{5'000};
  // A frame must be written within this, or the connection is dropped (a peer that stops
  // reading cannot stall the writer).
  std::chrono::milliseconds send_timeout{5'000};
  // Receives one line per event worth a human's attention (a peer refused, a trainer replaced).
  // Empty: "shadowsync control: ..." on stderr. Called from the endpoint's threads, possibly
  // concurrently: it must be thread-safe.
  std::function<void(std::string_view)> log;
};

// `configured` if not empty, else the value of SHADOWSYNC_CONTROL_TOKEN. Throws
// Error(kInvalidArgument) when both are empty or the token is shorter than kMinControlTokenBytes
// (the message never contains the token). Thread-safe.
std::string resolve_control_token(const std::string& configured);

}  // namespace shadowsync
