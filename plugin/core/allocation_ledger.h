// The book of a backend's live allocations: which pointers it handed out and how many bytes each,
// so that deallocate frees only its own memory and bytes_allocated is exact. Shared by the host
// and CUDA backends, which differ only in how they get and free the memory. Not installed.
#pragma once

#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace shadowsync {

// Thread-safe: every call may come from any thread.
class AllocationLedger {
 public:
  // Notes `bytes` (the size requested) live at `ptr`. Throws std::bad_alloc when the book cannot
  // grow; then nothing is noted and the caller still owns `ptr`.
  void record(void* ptr, std::size_t bytes);

  // Takes `ptr` out of the book and returns its size; 0 when it was not in the book (not from
  // this backend, or freed already). Then the caller must not free it: freeing memory the backend
  // does not own would free someone else's. The first such pointer is reported on stderr, naming
  // `owner` ("HostBackend::deallocate"); later ones are ignored silently.
  std::size_t release(void* ptr, const char* owner) noexcept;

  // The bytes live now, by the sizes requested.
  std::size_t bytes_allocated() const noexcept {
    return bytes_allocated_.load(std::memory_order_relaxed);
  }

  // Calls `free(ptr)` for every pointer still in the book, for a backend's destructor (which frees
  // what callers leaked, as destroying a CUDA context does). Not concurrent with other calls.
  template <typename Free>
  void free_all(Free&& free) {
    for (const auto& entry : allocations_) free(entry.first);
  }

 private:
  std::mutex mutex_;
  std::unordered_map<void*, std::size_t> allocations_;  // ptr -> requested bytes
  std::atomic<std::size_t> bytes_allocated_{0};
  std::atomic<bool> warned_unknown_pointer_{false};
};

}  // namespace shadowsync
