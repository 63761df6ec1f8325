#include "shadowsync/token.h"

#include <sys/random.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>

#include "shadowsync/error.h"

namespace shadowsync {
namespace {

constexpr std::size_t kMinTokenBytes = 16;
constexpr double kMinTokenBits = 64.0;
constexpr std::size_t kRunLimit = 8;  // a random 64-hex token holds such a run about once in 10^7
constexpr std::array<std::string_view, 8> kWords = {"password", "passwd",  "secret", "qwerty",
                                                    "letmein",  "changeme", "admin", "shadowsync"};

// Bits the token would hold if its characters were drawn independently with the frequencies it
// shows: length x Shannon entropy. Far above what a guessable token shows, far below a random one.
double frequency_bits(std::string_view token) {
  std::array<std::size_t, 256> count{};
  for (const char c : token) ++count[static_cast<unsigned char>(c)];
  double bits = 0;
  for (const std::size_t n : count) {
    if (n == 0) continue;
    const double p = static_cast<double>(n) / static_cast<double>(token.size());
    bits -= static_cast<double>(n) * std::log2(p);
  }
  return bits;
}

std::optional<std::string> pattern_in(std::string_view token) {
  std::size_t same = 1, up = 1, down = 1;
  for (std::size_t i = 1; i < token.size(); ++i) {
    const int step = static_cast<unsigned char>(token[i]) - static_cast<unsigned char>(token[i - 1]);
    same = step == 0 ? same + 1 : 1;
    up = step == 1 ? up + 1 : 1;
    down = step == -1 ? down + 1 : 1;
    const std::size_t longest = std::max({same, up, down});
    if (longest >= kRunLimit) {  // described, never quoted: no part of a token in a message
      return fmt::format("it holds a run of {} {} characters (such as {})", longest,
                         same >= kRunLimit ? "equal" : "consecutive",
                         same >= kRunLimit ? "'aaaaaaaa'" : "'12345678'");
    }
  }
  std::string lower(token);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const std::string_view word : kWords) {
    if (lower.find(word) != std::string::npos) {
      return std::string("it holds a common password word (such as 'password' or 'secret')");
    }
  }
  return std::nullopt;
}

}  // namespace

std::string make_token() {
  std::array<unsigned char, 32> bytes{};
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::getrandom(bytes.data() + got, bytes.size() - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(ErrorCode::kInternal,
                  fmt::format("make_token: getrandom failed: {}", std::strerror(errno)));
    }
    got += static_cast<std::size_t>(n);
  }
  std::string token(kTokenPrefix);
  for (const unsigned char b : bytes) token += fmt::format("{:02x}", b);
  return token;
}

std::optional<std::string> token_weakness(std::string_view token) {
  if (token.starts_with(kTokenPrefix)) {
    const std::string_view digits = token.substr(kTokenPrefix.size());
    const bool hex = digits.size() == 64 && std::all_of(digits.begin(), digits.end(), [](char c) {
                       return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                     });
    if (!hex) {
      return fmt::format("it starts with '{}' but is not followed by 64 lowercase hex digits",
                         kTokenPrefix);
    }
    // A random one shows about 3.8 bits per digit; a made-up one far less.
    if (frequency_bits(digits) < 3.0 * 64) return std::string("its digits are not random");
    return std::nullopt;
  }
  if (token.size() < kMinTokenBytes) {
    return fmt::format("it has {} bytes, fewer than the {} required", token.size(),
                       kMinTokenBytes);
  }
  if (auto pattern = pattern_in(token)) return pattern;
  if (const double bits = frequency_bits(token); bits < kMinTokenBits) {
    return fmt::format("its characters hold about {:.0f} bits, fewer than the {:.0f} required",
                       bits, kMinTokenBits);
  }
  return std::nullopt;
}

void check_token(std::string_view token, std::string_view what) {
  if (auto weakness = token_weakness(token)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{} is too weak to be a shared secret: {}. Make one with "
                            "`python3 -c 'import shadowsync; print(shadowsync.make_token())'` "
                            "(or shadowsync::make_token()), or `openssl rand -hex 32`",
                            what, *weakness));
  }
}

}  // namespace shadowsync
