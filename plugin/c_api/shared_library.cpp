// libshadowsync_c.so (the CMake target shadowsync_c) is the whole static library behind the C ABI
// of shadowsync.h, for ctypes and other FFIs; shadowsync_c.map exports only the shadowsync_*
// functions, so the C++ symbols inside (fmt, moodycamel, shadowsync's own) cannot clash with a
// host process's (a Python interpreter with torch loaded). The library needs a translation unit of
// its own; the entry points are compiled once, into the static library, in the other files here.
#include "shadowsync/shadowsync.h"

static_assert(SHADOWSYNC_NUM_RESULTS == 14, "a new status needs a string in status_api.cpp");
