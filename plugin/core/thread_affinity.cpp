// leave_inherited_single_cpu: see thread_affinity.h.
#include "core/thread_affinity.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <string_view>

namespace shadowsync {
namespace {

// "0-3,6" for the CPUs of `set`.
std::string cpu_list(const cpu_set_t& set) {
  std::string out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    int last = cpu;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    out += fmt::format("{}{}", out.empty() ? "" : ",", cpu);
    if (last > cpu) out += fmt::format("-{}", last);
    cpu = last;
  }
  return out;
}

bool keep_inherited() {
  const char* value = std::getenv("SHADOWSYNC_THREAD_AFFINITY");
  return value != nullptr && std::string_view(value) == "inherit";
}

}  // namespace

void leave_inherited_single_cpu() noexcept {
  static const bool keep = keep_inherited();
  if (keep) return;
  cpu_set_t inherited;
  CPU_ZERO(&inherited);
  if (::sched_getaffinity(0, sizeof inherited, &inherited) != 0 || CPU_COUNT(&inherited) != 1) {
    return;
  }
  const long configured = ::sysconf(_SC_NPROCESSORS_CONF);
  if (configured <= 1) return;
  cpu_set_t every;
  CPU_ZERO(&every);
  for (long cpu = 0; cpu < configured && cpu < CPU_SETSIZE; ++cpu) CPU_SET(cpu, &every);
  // The kernel intersects the set with the process's cpuset; EINVAL only when nothing is left.
  if (::sched_setaffinity(0, sizeof every, &every) != 0) return;
  cpu_set_t now;
  CPU_ZERO(&now);
  if (::sched_getaffinity(0, sizeof now, &now) != 0 || CPU_COUNT(&now) <= 1) return;
  static std::once_flag told;
  try {
    std::call_once(told, [&] {
      std::fprintf(stderr,
                   "shadowsync: this process binds its threads to one CPU each (CPU %s here; "
                   "vLLM's CPU workers do); the library's threads run on CPUs %s instead, so "
                   "that a transfer does not wait behind the engine's thread. "
                   "SHADOWSYNC_THREAD_AFFINITY=inherit keeps the binding.\n",
                   cpu_list(inherited).c_str(), cpu_list(now).c_str());
    });
  } catch (...) {  // the line only: the move itself is done
  }
}

}  // namespace shadowsync
