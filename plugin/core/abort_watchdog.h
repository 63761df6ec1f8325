// The second-level watchdog: the receiver aborts a failed transport (ncclCommAbort) on its own
// thread, and an abort that never returns would leave that thread, and with it every later
// update, stuck without a word. This runs the abort under a watch: once it has taken longer than
// its bound, a watcher thread says so (the caller's `on_overdue`, which may end the process) while
// the abort itself keeps going. Not installed.
#pragma once

#include <chrono>
#include <functional>

namespace shadowsync {

// Runs `abort` on the calling thread and returns when it returns. If it has not returned after
// `limit`, `on_overdue` runs once, on a watcher thread, while `abort` is still running; it must
// not wait for `abort`. The watcher thread exists only during the call (aborts are rare: no
// thread is kept while idle) and is joined before the call returns.
void run_watched_abort(std::chrono::milliseconds limit, const std::function<void()>& abort,
                       const std::function<void()>& on_overdue);

}  // namespace shadowsync
