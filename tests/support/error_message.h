// What a call throws, as text: the tests that check refusals compare the message.
#pragma once

#include <functional>
#include <string>

#include "shadowsync/error.h"

namespace shadowsync::testing {

// The message of the shadowsync::Error `f` throws, or "<no error>" when it throws none.
inline std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace shadowsync::testing
