#include "transports/same_host/same_host_memory_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "transports/same_host/same_host_frame.h"

namespace shadowsync::same_host {
namespace {

constexpr int kSizeSeals = F_SEAL_SHRINK | F_SEAL_GROW;
constexpr int kWriteSeals = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE;  // either keeps receivers out

std::string missing_seals(int seals) {
  std::string missing;
  const auto add = [&](const char* name) { missing += (missing.empty() ? "" : ", ") + std::string(name); };
  if ((seals & F_SEAL_SHRINK) == 0) add("F_SEAL_SHRINK");
  if ((seals & F_SEAL_GROW) == 0) add("F_SEAL_GROW");
  if ((seals & kWriteSeals) == 0) add("F_SEAL_FUTURE_WRITE");
  return missing;
}

}  // namespace

UniqueFd make_sealed_staging(std::size_t bytes, void** mapped) {
  UniqueFd fd(::memfd_create("shadowsync-same-host-staging", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host serve: a shared memory file of {} bytes (memfd_create, "
                            "ftruncate): {}",
                            bytes, std::strerror(errno)));
  }
  void* at = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
  if (at == MAP_FAILED) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host serve: mmap of {} bytes of staging: "
                                                   "{}",
                                                   bytes, std::strerror(errno)));
  }
  // After this process's own writable mapping: F_SEAL_FUTURE_WRITE forbids only new ones.
  if (::fcntl(fd.get(), F_ADD_SEALS, kSizeSeals | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0) {
    const int saved = errno;
    ::munmap(at, bytes);
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host serve: sealing the staging memory file (F_ADD_SEALS "
                            "shrink, grow, future write; Linux 5.1 or newer): {}",
                            std::strerror(saved)));
  }
  *mapped = at;
  return fd;
}

void check_staging_seals(int fd, const std::string& path) {
  const int seals = ::fcntl(fd, F_GET_SEALS);
  const std::string missing = seals < 0 ? std::string("every seal") : missing_seals(seals);
  if (!missing.empty()) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender's staging memory file is not "
                            "sealed ({} missing{}): its size could change under this process's "
                            "mapping or it could be mapped writable; refusing it",
                            path, missing, seals < 0 ? fmt::format(": {}", std::strerror(errno))
                                                     : std::string()));
  }
}

MappedStaging map_received_staging(const UniqueFd& memory_file, std::uint64_t slot_bytes,
                                   const std::string& path, std::string_view call,
                                   std::string_view owner) {
  if (!memory_file) {
    throw Error(ErrorCode::kTransport,
                fmt::format("{} to '{}': the {}'s setup carried no memory file descriptor "
                            "(SCM_RIGHTS)",
                            call, path, owner));
  }
  check_staging_seals(memory_file.get(), path);
  const std::size_t bytes = kSlotCount * static_cast<std::size_t>(slot_bytes);
  struct stat st {};
  if (slot_bytes > (std::uint64_t{1} << 40) || ::fstat(memory_file.get(), &st) != 0 ||
      static_cast<std::uint64_t>(st.st_size) < bytes) {
    throw Error(ErrorCode::kTransport,
                fmt::format("{} to '{}': the {}'s memory file holds {} bytes, but {} slots of {} "
                            "bytes were announced",
                            call, path, owner, st.st_size, kSlotCount, slot_bytes));
  }
  void* mapped = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, memory_file.get(), 0);
  if (mapped == MAP_FAILED) {
    throw Error(ErrorCode::kTransport,
                fmt::format("{} to '{}': could not map the {}'s staging memory (memfd of {} "
                            "bytes, mmap PROT_READ MAP_SHARED): {}",
                            call, path, owner, bytes, std::strerror(errno)));
  }
  return {static_cast<std::byte*>(mapped), bytes};
}

}  // namespace shadowsync::same_host
