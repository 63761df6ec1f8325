#include "shadowsync/control_channel.h"

#include <fmt/format.h>

#include <cstdlib>

#include "shadowsync/error.h"
#include "shadowsync/token.h"

namespace shadowsync {

std::string resolve_control_token(const std::string& configured) {
  std::string token = configured;
  const char* source = "ControlConfig::token";
  if (token.empty()) {
    const char* env = std::getenv(kControlTokenEnv);  // NOLINT(concurrency-mt-unsafe): read once
    if (env != nullptr) token = env;
    source = kControlTokenEnv;
  }
  if (token.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("control channel: no token (set ControlConfig::token or {}); every "
                            "connection must prove it holds the shared token",
                            kControlTokenEnv));
  }
  check_token(token, fmt::format("control channel: the token from {}", source));
  return token;
}

}  // namespace shadowsync
