#include "core/abort_watchdog.h"

#include <condition_variable>
#include <mutex>
#include <thread>

namespace shadowsync {

void run_watched_abort(std::chrono::milliseconds limit, const std::function<void()>& abort,
                       const std::function<void()>& on_overdue) {
  std::mutex mutex;
  std::condition_variable cv;
  bool returned = false;
  std::thread watcher([&] {
    std::unique_lock lock(mutex);
    if (cv.wait_for(lock, limit, [&] { return returned; })) return;
    lock.unlock();  // the report may take a while (or never return: it may exit)
    on_overdue();
  });
  // Joined on every path, an exception from `abort` included (Transport::abort is noexcept, but
  // a watched call need not be).
  struct Join {
    std::mutex& mutex;
    std::condition_variable& cv;
    bool& returned;
    std::thread& watcher;
    ~Join() {
      {
        std::lock_guard lock(mutex);
        returned = true;
      }
      cv.notify_all();
      watcher.join();
    }
  } join{mutex, cv, returned, watcher};
  abort();
}

}  // namespace shadowsync
