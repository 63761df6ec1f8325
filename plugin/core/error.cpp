#include "shadowsync/error.h"

namespace shadowsync {

const char* to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kLayoutMismatch: return "layout mismatch";
    case ErrorCode::kBadHeader: return "bad update header";
    case ErrorCode::kStaleVersion: return "stale version";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kTransport: return "transport error";
    case ErrorCode::kBackend: return "backend error";
    case ErrorCode::kShutdown: return "shut down";
    case ErrorCode::kSuperseded: return "superseded";
    case ErrorCode::kInternal: return "internal error";
  }
  return "unknown error";
}

}  // namespace shadowsync
