#include "transports/same_host/same_host_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <climits>
#include <vector>

#include "shadowsync/error.h"

namespace shadowsync::same_host {
namespace {

constexpr std::string_view kReceiverLabel = "shadowsync-same-host-v1 receiver";
constexpr std::string_view kSenderLabel = "shadowsync-same-host-v1 sender";

Mac labelled(std::string_view token, std::string_view label, const Nonce& sender_nonce,
             const Nonce& receiver_nonce, std::uint32_t rank) {
  if (token.size() > INT_MAX) throw Error(ErrorCode::kInvalidArgument, "token too long");
  std::vector<unsigned char> data(label.begin(), label.end());
  for (const std::byte b : sender_nonce) data.push_back(std::to_integer<unsigned char>(b));
  for (const std::byte b : receiver_nonce) data.push_back(std::to_integer<unsigned char>(b));
  for (int i = 0; i < 4; ++i) data.push_back(static_cast<unsigned char>((rank >> (8 * i)) & 0xff));
  Mac out{};
  unsigned int length = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), data.data(), data.size(),
           reinterpret_cast<unsigned char*>(out.data()), &length) == nullptr ||
      length != out.size()) {
    throw Error(ErrorCode::kInternal, "HMAC-SHA256 failed (OpenSSL)");
  }
  return out;
}

}  // namespace

Nonce make_nonce() {
  Nonce nonce{};
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) !=
      1) {
    throw Error(ErrorCode::kInternal, "RAND_bytes failed: no fresh nonce for the handshake");
  }
  return nonce;
}

Mac receiver_proof(std::string_view token, const Nonce& sender_nonce, const Nonce& receiver_nonce,
                   std::uint32_t rank) {
  return labelled(token, kReceiverLabel, sender_nonce, receiver_nonce, rank);
}

Mac sender_proof(std::string_view token, const Nonce& sender_nonce, const Nonce& receiver_nonce,
                 std::uint32_t rank) {
  return labelled(token, kSenderLabel, sender_nonce, receiver_nonce, rank);
}

bool macs_equal(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace shadowsync::same_host
