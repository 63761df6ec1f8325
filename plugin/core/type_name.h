// The readable name of a dynamic type, for error messages that say which backend's stream or event
// a call was given. Not installed.
#pragma once

#include <string>
#include <typeinfo>

namespace shadowsync {

// Demangled where the toolchain can demangle; the implementation's name otherwise. Thread-safe.
std::string type_name(const std::type_info& type);

}  // namespace shadowsync
