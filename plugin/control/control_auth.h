// The control channel's cryptography, all of it from OpenSSL's libcrypto: fresh nonces
// (RAND_bytes), HMAC-SHA256 proofs and frame tags, constant-time comparison (CRYPTO_memcmp).
//
// Handshake (engine E listens, trainer T connects; K is the shared token):
//   E -> T  challenge     nE                         (32 fresh random bytes)
//   T -> E  client_proof  nT, HMAC(K, "shadowsync-control-v1 trainer" | nE | nT)
//   E -> T  server_proof  HMAC(K, "shadowsync-control-v1 engine" | nE | nT)
// Each side proves the token over the other side's fresh nonce, so a recorded handshake replays
// against nothing; the labels differ, so one side's proof is never valid as the other's. After it
// every frame carries HMAC(key_dir, seq | frame header | payload) with per-direction keys
// HMAC(K, "shadowsync-control-v1 key <dir>" | nE | nT) and a per-direction sequence number, so
// frames cannot be forged, replayed, reordered or dropped by anyone without the token.
// (control_handshake.h runs these steps; control_connection.h tags and verifies the frames.)
//
// Every function is thread-safe and keeps no state. Those that compute an HMAC throw
// Error(kInternal) if OpenSSL fails (or Error(kInvalidArgument) for a token over INT_MAX bytes).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "control/control_frame.h"

namespace shadowsync::control {

// 32 bytes from RAND_bytes. Throws Error(kInternal) if the generator fails.
ControlNonce make_nonce();

ControlMac trainer_proof(std::string_view token, const ControlNonce& engine_nonce,
                         const ControlNonce& trainer_nonce);
ControlMac engine_proof(std::string_view token, const ControlNonce& engine_nonce,
                        const ControlNonce& trainer_nonce);

struct SessionKeys {
  ControlMac trainer_to_engine{};
  ControlMac engine_to_trainer{};
};
SessionKeys derive_session_keys(std::string_view token, const ControlNonce& engine_nonce,
                                const ControlNonce& trainer_nonce);

// Tag of one frame: `frame` is its header and payload (without the tag).
ControlMac frame_tag(const ControlMac& key, std::uint64_t sequence,
                     std::span<const std::byte> frame);

// Constant time in the contents (CRYPTO_memcmp).
bool macs_equal(const ControlMac& a, std::span<const std::byte> b);

}  // namespace shadowsync::control
