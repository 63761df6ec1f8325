// The same-host transport's staging memory in host memory: one memfd the sender maps writable and
// hands to every receiver (SCM_RIGHTS). Sealed before it is shared, so that no receiver can write
// into the sender's slots and no one can shrink the file under a receiver's mapping (a read past
// the end of a shrunk file would end the engine process with SIGBUS).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/unique_fd.h"

namespace shadowsync::same_host {

// A memory file of `bytes` (memfd, sealable), mapped read-write into this process at `*mapped`,
// then sealed: its size can no longer change (F_SEAL_SHRINK, F_SEAL_GROW), no new writable
// mapping can be made of it (F_SEAL_FUTURE_WRITE: this process's mapping stays writable), and the
// seals are final (F_SEAL_SEAL). Throws Error(kTransport) naming the step that failed.
UniqueFd make_sealed_staging(std::size_t bytes, void** mapped);

// On the receiver: refuses (Error(kTransport), naming `path` and the seals missing) a memory file
// whose size could change or that could be mapped writable.
void check_staging_seals(int fd, const std::string& path);

// On the receiver: the staging memory as this process maps it, read-only.
struct MappedStaging {
  std::byte* base = nullptr;
  std::size_t bytes = 0;  // kSlotCount slots; munmap(base, bytes) when done
};

// On the receiver: maps `memory_file` (the setup's SCM_RIGHTS passenger, kSlotCount slots of
// `slot_bytes` as the setup announced) read-only, once check_staging_seals passed. Throws
// Error(kTransport) for a missing file, one smaller than announced, or a failed mmap; each message
// starts "<call> to '<path>'" and names the other end as `owner` ("sender", "trainer").
MappedStaging map_received_staging(const UniqueFd& memory_file, std::uint64_t slot_bytes,
                                   const std::string& path, std::string_view call,
                                   std::string_view owner);

}  // namespace shadowsync::same_host
