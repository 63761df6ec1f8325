// NcclLibrary: libnccl opened at run time (dlopen), and the table of NCCL entry points that
// NcclTransport calls through. Private to plugin/transports/nccl/.
//
// Why at run time: a process that also runs torch has torch's NCCL (the nvidia-nccl-cu* Python
// package) in it. A library linked against the NCCL found at build time brings a second libnccl
// whose soname (libnccl.so.2) then satisfies torch's dependency too, and torch fails to load
// (undefined symbol) or runs on an NCCL it was not built for. Opened lazily, only when a transport
// first needs it, shadowsync uses the NCCL the process already has, or loads the one torch would.
//
// Where it looks, and why in that order: see NcclTransport::library() in nccl_transport.h, the
// contract users read; nccl_candidates() builds that list. The first candidate that loads, exports
// ncclGetVersion, reports a version >= kMinimumVersion and exports every entry point of NcclApi
// wins. Candidates that fail are closed again; the error when none wins lists every place and why
// it failed.
//
// Every library is opened RTLD_NOW | RTLD_LOCAL: its symbols do not join the global scope, so they
// cannot satisfy (or be satisfied by) anything else in the process by name.
#pragma once

#include <nccl.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shadowsync::nccl_detail {

// NCCL_VERSION(2, 14, 0): the oldest NCCL shadowsync runs on. 2.14 brought nonblocking
// communicators (ncclConfig_t::blocking, ncclCommInitRankConfig), ncclCommFinalize and the
// ncclConfig_t CTA limits (minCTAs, maxCTAs, cgaClusterSize); ncclCommAbort,
// ncclCommGetAsyncError (2.4) and ncclGetLastError (2.13) are older.
inline constexpr int kMinimumVersion = 21400;
static_assert(NCCL_VERSION_CODE >= kMinimumVersion,
              "nccl.h is older than NCCL 2.14, the oldest shadowsync's NcclTransport supports");

// "2.28.9" for ncclGetVersion's code (major * 10000 + minor * 100 + patch since 2.9;
// major * 1000 + minor * 100 + patch before).
std::string version_string(int version_code);

// The entry points NcclTransport uses. Types come from nccl.h, so a signature the header changes
// fails to compile here rather than misbehaving at run time.
struct NcclApi {
  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclGetLastError) get_last_error = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&::ncclCommFinalize) comm_finalize = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  // Point-to-point (NCCL 2.7): a sharded trainer's routes (nccl_route_mover.h).
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
};

// One place to look.
struct NcclCandidate {
  std::string place;         // which search step, for messages: "SHADOWSYNC_NCCL_LIBRARY", ...
  std::string file;          // given to dlopen: a path, or a bare file name for the loader's search
  bool loaded_only = false;  // RTLD_NOLOAD: take it only if the process already has it
  // Non-empty: this step had nothing to try, and why ("no site-packages directory found"); load()
  // lists it among the places it looked at and tries nothing.
  std::string nothing_because;
};

// The search steps in order, as they stand in the process now (reads the environment and the list
// of loaded objects). Every step contributes at least one entry, so that an error lists them all.
// Thread-safe as far as getenv is.
std::vector<NcclCandidate> nccl_candidates();

class NcclLibrary {
 public:
  // Tries `candidates` in order and returns the first usable library. Throws Error(kTransport)
  // naming every candidate and why it failed when none is usable. Prints nothing. The returned
  // library stays loaded after its destruction (see ~NcclLibrary). Thread-safe.
  static std::unique_ptr<NcclLibrary> load(const std::vector<NcclCandidate>& candidates);

  // The process's NCCL: on the first call that succeeds, load(nccl_candidates()) and one line on
  // stderr naming version, path and place (unless SHADOWSYNC_NCCL_QUIET is set to anything but
  // "" or "0"); later calls return the same library. A failed load is not remembered: the next
  // call searches again (the user may have set SHADOWSYNC_NCCL_LIBRARY or imported torch since).
  // Never unloaded. Thread-safe.
  static const NcclLibrary& process();

  // Never dlclose()s: NCCL keeps threads and CUDA state that outlive its communicators, and the
  // process's NCCL may be shared with others (dlopen counts references, so this leaks one).
  ~NcclLibrary() = default;
  NcclLibrary(const NcclLibrary&) = delete;
  NcclLibrary& operator=(const NcclLibrary&) = delete;

  const NcclApi& api() const noexcept { return api_; }
  // The file as mapped into the process (symbolic links resolved, as /proc/self/maps shows it).
  const std::string& path() const noexcept { return path_; }
  int version() const noexcept { return version_; }             // ncclGetVersion's code, e.g. 22809
  const std::string& place() const noexcept { return place_; }  // the candidate's place

 private:
  NcclLibrary(NcclApi api, std::string path, int version, std::string place)
      : api_(api), path_(std::move(path)), version_(version), place_(std::move(place)) {}

  NcclApi api_;
  std::string path_;
  int version_;
  std::string place_;
};

// NcclTransport::add_python_path: directories searched for the nvidia-nccl-cu* package before the
// library's own guesses. Thread-safe.
void add_python_path(std::string_view paths);

}  // namespace shadowsync::nccl_detail
