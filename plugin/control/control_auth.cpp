#include "control/control_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <vector>

#include "shadowsync/error.h"

namespace shadowsync::control {
namespace {

constexpr std::string_view kTrainerLabel = "shadowsync-control-v1 trainer";
constexpr std::string_view kEngineLabel = "shadowsync-control-v1 engine";
constexpr std::string_view kTrainerKeyLabel = "shadowsync-control-v1 key trainer->engine";
constexpr std::string_view kEngineKeyLabel = "shadowsync-control-v1 key engine->trainer";

ControlMac hmac(std::span<const std::byte> key, std::span<const std::byte> data) {
  if (key.size() > INT_MAX) throw Error(ErrorCode::kInvalidArgument, "control token too long");
  ControlMac out{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(),
           reinterpret_cast<unsigned char*>(out.data()), &length) == nullptr ||
      length != out.size()) {
    throw Error(ErrorCode::kInternal, "HMAC-SHA256 failed (OpenSSL)");
  }
  return out;
}

std::span<const std::byte> as_bytes(std::string_view text) {
  return {reinterpret_cast<const std::byte*>(text.data()), text.size()};
}

// label | nE | nT
ControlMac labelled(std::span<const std::byte> key, std::string_view label,
                    const ControlNonce& engine_nonce, const ControlNonce& trainer_nonce) {
  std::vector<std::byte> data;
  data.reserve(label.size() + 2 * kControlNonceBytes);
  const auto l = as_bytes(label);
  data.insert(data.end(), l.begin(), l.end());
  data.insert(data.end(), engine_nonce.begin(), engine_nonce.end());
  data.insert(data.end(), trainer_nonce.begin(), trainer_nonce.end());
  return hmac(key, data);
}

}  // namespace

ControlNonce make_nonce() {
  ControlNonce nonce{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1) {
    throw Error(ErrorCode::kInternal, "RAND_bytes failed: no fresh nonce for the handshake");
  }
  return nonce;
}

ControlMac trainer_proof(std::string_view token, const ControlNonce& engine_nonce,
                         const ControlNonce& trainer_nonce) {
  return labelled(as_bytes(token), kTrainerLabel, engine_nonce, trainer_nonce);
}

ControlMac engine_proof(std::string_view token, const ControlNonce& engine_nonce,
                        const ControlNonce& trainer_nonce) {
  return labelled(as_bytes(token), kEngineLabel, engine_nonce, trainer_nonce);
}

SessionKeys derive_session_keys(std::string_view token, const ControlNonce& engine_nonce,
                                const ControlNonce& trainer_nonce) {
  SessionKeys keys;
  keys.trainer_to_engine = labelled(as_bytes(token), kTrainerKeyLabel, engine_nonce, trainer_nonce);
  keys.engine_to_trainer = labelled(as_bytes(token), kEngineKeyLabel, engine_nonce, trainer_nonce);
  return keys;
}

ControlMac frame_tag(const ControlMac& key, std::uint64_t sequence,
                     std::span<const std::byte> frame) {
  std::vector<std::byte> data(8 + frame.size());
  for (int i = 0; i < 8; ++i) data[i] = static_cast<std::byte>((sequence >> (8 * i)) & 0xff);
  std::copy(frame.begin(), frame.end(), data.begin() + 8);
  return hmac(key, data);
}

bool macs_equal(const ControlMac& a, std::span<const std::byte> b) {
  return b.size() == a.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace shadowsync::control
