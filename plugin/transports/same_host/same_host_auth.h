// The same-host handshake's proofs (K: the shared token; nS, nR: 32 fresh random bytes from the
// sender and the receiver of one connection; rank: the rank the receiver asks for, 4 bytes LE):
//   receiver proof  HMAC-SHA256(K, "shadowsync-same-host-v1 receiver" | nS | nR | rank)
//   sender proof    HMAC-SHA256(K, "shadowsync-same-host-v1 sender"   | nS | nR | rank)
// Each side proves the token over the other's fresh nonce (a recorded handshake replays against
// nothing); the labels differ per role, and from the control channel's, so no proof is valid as
// another. The rank is bound into both proofs, so a relay cannot change it. OpenSSL's libcrypto:
// HMAC, RAND_bytes, CRYPTO_memcmp. Thread-safe, stateless.
#pragma once

#include <cstdint>
#include <string_view>

#include "transports/same_host/same_host_frame.h"

namespace shadowsync::same_host {

// Throws Error(kInternal) if the generator fails.
Nonce make_nonce();
// Throw Error(kInternal) if OpenSSL fails, Error(kInvalidArgument) for a token over INT_MAX bytes.
Mac receiver_proof(std::string_view token, const Nonce& sender_nonce, const Nonce& receiver_nonce,
                   std::uint32_t rank);
Mac sender_proof(std::string_view token, const Nonce& sender_nonce, const Nonce& receiver_nonce,
                 std::uint32_t rank);
// Constant time in the contents.
bool macs_equal(const Mac& a, const Mac& b);

}  // namespace shadowsync::same_host
