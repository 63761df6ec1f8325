// The shared token that authenticates the control channel and the same-host transport: how to
// make a good one, and the check that refuses one that is plainly not random.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace shadowsync {

// What make_token() returns starts with this; the rest is 64 lowercase hex digits (256 bits).
inline constexpr std::string_view kTokenPrefix = "ssk1-";

// A new token: kTokenPrefix and 256 bits from the kernel's random source (getrandom), as 64 hex
// digits. Throws Error(kInternal) if the kernel gives no randomness. Thread-safe.
std::string make_token();

// Why `token` is too weak to be a shared secret, or nothing when it is acceptable (the reason
// describes, never quotes, the token). A token of
// make_token()'s form is checked for its form and for plain non-randomness; any other must be at
// least 16 bytes, hold at least 64 bits by its character frequencies, and have no run of 8 equal
// or 8 consecutive characters ("aaaaaaaa", "12345678", "hgfedcba") and no common password word.
std::optional<std::string> token_weakness(std::string_view token);

// Throws Error(kInvalidArgument) naming `what` (e.g. "control channel: the token from
// SHADOWSYNC_CONTROL_TOKEN") and the weakness, and saying how to make a token.
void check_token(std::string_view token, std::string_view what);

}  // namespace shadowsync
