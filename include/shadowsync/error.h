// Errors thrown by the C++ API. Every message names the offending thing and both values.
#pragma once

#include <stdexcept>
#include <string>

namespace shadowsync {

// Why an operation failed. Stable: the C ABI maps these one to one.
enum class ErrorCode : int {
  kInvalidArgument = 1,   // bad input from the caller; nothing was changed
  kLayoutMismatch = 2,    // fingerprints or tensor specs disagree between sender and receiver
  kBadHeader = 3,         // an update header failed validation (magic, protocol, counts)
  kStaleVersion = 4,      // a version not greater than the last one
  kTimeout = 5,           // a deadline passed
  kTransport = 6,         // the transport failed (peer lost, aborted communicator)
  kBackend = 7,           // the device backend failed
  kShutdown = 8,          // the object is shutting down
  kSuperseded = 9,        // a newer update replaced this one before it was applied
  kInternal = 10,         // a bug: please report it
};

const char* to_string(ErrorCode code) noexcept;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace shadowsync
