// The CPU platform: two HostBackends and a loopback transport. Its figures are CPU smoke figures,
// nothing a GPU would show; it is there so that every scenario runs in CI (bench_updates --cpu,
// and bench_gpu --cpu).
#pragma once

#include <memory>

#include "bench_platform.h"

namespace shadowsync::bench {

// A new host platform. Its streams are CPU threads and have no priority; it has no free-memory
// probe and no stream-ordered clock other than the host's.
std::unique_ptr<Platform> make_host_platform();

}  // namespace shadowsync::bench
