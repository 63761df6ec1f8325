// The check every backend makes of the streams and events it is handed: they must be its own.
// Shared by the host and CUDA backends. Not installed.
#pragma once

#include <fmt/format.h>

#include <string_view>
#include <typeinfo>

#include "core/type_name.h"
#include "shadowsync/error.h"

namespace shadowsync {

// `object` (a Stream or Event given to `backend`'s `operation`) as the backend's own type `Own`.
// Throws Error(kInvalidArgument) naming the call and the type it got ("CudaBackend::event_record:
// the stream must come from a CudaBackend, got a shadowsync::host::HostStream"). `what` names the
// argument: "stream" or "event".
template <typename Own, typename Base>
Own& backend_cast(Base& object, std::string_view backend, std::string_view operation,
                  std::string_view what) {
  auto* own = dynamic_cast<Own*>(&object);
  if (own == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}::{}: the {} must come from a {}, got a {}", backend, operation,
                            what, backend, type_name(typeid(object))));
  }
  return *own;
}

}  // namespace shadowsync
