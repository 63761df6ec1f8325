// The CPUs of the library's own threads. A thread inherits the CPU affinity of the thread that
// starts it. vLLM's CPU worker binds its threads to one core each (VLLM_CPU_OMP_THREADS_BIND) and
// spins there for a while after every message; a receiver thread started from such a worker
// would share that one core with the spinning thread and wait seconds for each bucket. So every
// thread the library starts (receiver, sender, host streams, transports, control channel) calls
// leave_inherited_single_cpu() before anything else: start_library_thread starts them so.
#pragma once

#include <thread>
#include <utility>

namespace shadowsync {

// When the calling thread may run on exactly one CPU and the process on more, moves the thread to
// every CPU it may use (the kernel keeps it within the process's cpuset), and the first such move
// in the process prints one line on stderr naming both CPU sets. Nothing with
// SHADOWSYNC_THREAD_AFFINITY=inherit, or where the thread already runs on several CPUs (GPU
// workers, most processes). Never throws; a failed call leaves the affinity as it was.
void leave_inherited_single_cpu() noexcept;

// A thread of the library's: leave_inherited_single_cpu(), then body().
template <typename Body>
std::thread start_library_thread(Body body) {
  return std::thread([body = std::move(body)]() mutable {
    leave_inherited_single_cpu();
    body();
  });
}

}  // namespace shadowsync
