// NcclLibrary: finding, loading and checking libnccl at run time. See nccl_library.h.
#include "transports/nccl/nccl_library.h"

#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "shadowsync/error.h"

namespace shadowsync::nccl_detail {

namespace {

namespace fs = std::filesystem;

constexpr const char* kLibraryEnv = "SHADOWSYNC_NCCL_LIBRARY";
constexpr const char* kQuietEnv = "SHADOWSYNC_NCCL_QUIET";
constexpr const char* kSoname = "libnccl.so.2";

constexpr const char* kPlaceEnv = "SHADOWSYNC_NCCL_LIBRARY";
constexpr const char* kPlaceLoaded = "already loaded by the process";
constexpr const char* kPlacePython = "Python package nvidia-nccl-cu*";
constexpr const char* kPlaceSystem = "the dynamic loader's search path";

std::string env_or_empty(const char* name) {
  const char* value = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): nothing here sets it
  return value != nullptr ? std::string(value) : std::string();
}

// Canonical form of an existing path (symbolic links resolved); the path itself otherwise.
std::string canonical_or_same(const std::string& path) {
  std::error_code ec;
  fs::path canonical = fs::canonical(path, ec);
  return ec ? path : canonical.string();
}

// Paths of every object loaded in the process (the main program, whose name is empty, left out).
std::vector<std::string> loaded_objects() {
  std::vector<std::string> names;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        if (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0') {
          static_cast<std::vector<std::string>*>(data)->emplace_back(info->dlpi_name);
        }
        return 0;
      },
      &names);
  return names;
}

bool is_nccl_file_name(const std::string& path) {
  return fs::path(path).filename().string().starts_with("libnccl.so");
}

// The site-packages directory `path` lies in ("/x/lib/python3.12/site-packages/torch/lib/a.so" ->
// "/x/lib/python3.12/site-packages"), or "" when it lies in none.
std::string enclosing_site_packages(const std::string& path) {
  for (const std::string_view marker : {"/site-packages/", "/dist-packages/"}) {
    const std::size_t at = path.rfind(marker);
    if (at != std::string::npos) return path.substr(0, at + marker.size() - 1);
  }
  return {};
}

// <prefix>/lib/python3*/{site,dist}-packages and <prefix>/lib/python3/dist-packages (Debian).
void add_prefix_site_packages(const std::string& prefix, std::vector<std::string>& dirs) {
  if (prefix.empty()) return;
  std::error_code ec;
  const fs::path lib = fs::path(prefix) / "lib";
  std::vector<std::string> found;
  for (fs::directory_iterator it(lib, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("python3")) continue;
    for (const char* leaf : {"site-packages", "dist-packages"}) {
      std::error_code exists_ec;
      if (fs::is_directory(it->path() / leaf, exists_ec)) {
        found.push_back((it->path() / leaf).string());
      }
    }
  }
  std::sort(found.begin(), found.end());  // directory order is arbitrary; messages should not be
  dirs.insert(dirs.end(), found.begin(), found.end());
}

void split_path_list(std::string_view list, std::vector<std::string>& out) {
  for (std::size_t begin = 0; begin <= list.size();) {
    const std::size_t end = std::min(list.find(':', begin), list.size());
    if (end > begin) out.emplace_back(list.substr(begin, end - begin));
    begin = end + 1;
  }
}

std::mutex python_path_mutex;
std::vector<std::string> python_path_dirs;  // from add_python_path, in order

// Where an nvidia-nccl-cu* package may be installed for the Python this process runs (if any).
std::vector<std::string> site_packages_dirs(const std::vector<std::string>& loaded) {
  std::vector<std::string> dirs;
  {
    const std::lock_guard lock(python_path_mutex);
    dirs = python_path_dirs;
  }
  for (const std::string& object : loaded) {
    std::string dir = enclosing_site_packages(object);
    if (!dir.empty()) dirs.push_back(std::move(dir));
  }
  split_path_list(env_or_empty("PYTHONPATH"), dirs);
  add_prefix_site_packages(env_or_empty("VIRTUAL_ENV"), dirs);
  add_prefix_site_packages(env_or_empty("CONDA_PREFIX"), dirs);
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && exe.filename().string().starts_with("python")) {
    add_prefix_site_packages(exe.parent_path().parent_path().string(), dirs);
    add_prefix_site_packages((fs::path(env_or_empty("HOME")) / ".local").string(), dirs);
  }
  return dirs;
}

template <typename Pointer>
bool resolve(void* handle, const char* symbol, Pointer& out) {
  out = reinterpret_cast<Pointer>(dlsym(handle, symbol));
  return out != nullptr;
}

// The file `handle` was loaded from, as the process maps it.
std::string loaded_path(void* handle, const std::string& fallback) {
  link_map* map = nullptr;
  if (dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != nullptr && map->l_name != nullptr &&
      map->l_name[0] != '\0') {
    return canonical_or_same(map->l_name);
  }
  return canonical_or_same(fallback);
}

std::string dl_error_or(const char* fallback) {
  const char* error = dlerror();
  return error != nullptr ? std::string(error) : std::string(fallback);
}

// A candidate that passed every check.
struct Usable {
  NcclApi api;
  std::string path;
  int version = 0;
};

// dlopen()s one candidate and checks it. Returns it, or nullopt with `why` set.
std::optional<Usable> try_candidate(const NcclCandidate& candidate, std::string& why) {
  if (!candidate.nothing_because.empty()) {
    why = candidate.nothing_because;
    return std::nullopt;
  }
  std::error_code ec;
  const bool is_path = candidate.file.find('/') != std::string::npos;
  if (is_path && !candidate.loaded_only && !fs::exists(candidate.file, ec)) {
    why = fmt::format("{}: no such file", candidate.file);
    return std::nullopt;
  }
  (void)dlerror();
  void* handle = dlopen(candidate.file.c_str(),
                        RTLD_NOW | RTLD_LOCAL | (candidate.loaded_only ? RTLD_NOLOAD : 0));
  if (handle == nullptr) {
    why = candidate.loaded_only ? fmt::format("{}: not loaded in this process", candidate.file)
                                : fmt::format("{}: cannot be loaded: {}", candidate.file,
                                              dl_error_or("dlopen failed without a message"));
    return std::nullopt;
  }
  // Closed again unless it is the one: only our reference goes, a loaded_only library stays.
  struct CloseUnlessKept {
    void* handle;
    bool keep = false;
    ~CloseUnlessKept() {
      if (!keep) (void)dlclose(handle);
    }
  } guard{handle};

  const std::string path = loaded_path(handle, candidate.file);
  NcclApi api;
  if (!resolve(handle, "ncclGetVersion", api.get_version)) {
    why = fmt::format("{}: not an NCCL library (it exports no ncclGetVersion)", path);
    return std::nullopt;
  }
  int version = 0;
  const ncclResult_t result = api.get_version(&version);
  if (result != ncclSuccess) {
    why = fmt::format("{}: ncclGetVersion failed (ncclResult {})", path, static_cast<int>(result));
    return std::nullopt;
  }
  if (version < kMinimumVersion) {
    why = fmt::format(
        "{}: NCCL {} (version code {}) is older than NCCL {} (version code {}), the oldest "
        "shadowsync supports (nonblocking communicators, ncclCommFinalize, CTA limits)",
        path, version_string(version), version, version_string(kMinimumVersion), kMinimumVersion);
    return std::nullopt;
  }
  std::vector<std::string_view> missing;
  const auto need = [&](const char* symbol, auto& out) {
    if (!resolve(handle, symbol, out)) missing.emplace_back(symbol);
  };
  need("ncclGetErrorString", api.get_error_string);
  need("ncclGetLastError", api.get_last_error);
  need("ncclGetUniqueId", api.get_unique_id);
  need("ncclCommInitRankConfig", api.comm_init_rank_config);
  need("ncclCommGetAsyncError", api.comm_get_async_error);
  need("ncclCommFinalize", api.comm_finalize);
  need("ncclCommDestroy", api.comm_destroy);
  need("ncclCommAbort", api.comm_abort);
  need("ncclBroadcast", api.broadcast);
  need("ncclGroupStart", api.group_start);
  need("ncclGroupEnd", api.group_end);
  need("ncclSend", api.send);
  need("ncclRecv", api.recv);
  if (!missing.empty()) {
    why = fmt::format("{}: NCCL {} but it lacks {}", path, version_string(version),
                      fmt::join(missing, ", "));
    return std::nullopt;
  }
  guard.keep = true;
  return Usable{api, path, version};
}

// Other NCCLs the process has mapped besides `path` (a warning for the first-load line).
std::vector<std::string> other_loaded_nccls(const std::string& path) {
  std::vector<std::string> others;
  for (const std::string& object : loaded_objects()) {
    if (!is_nccl_file_name(object)) continue;
    std::string canonical = canonical_or_same(object);
    if (canonical != path && std::find(others.begin(), others.end(), canonical) == others.end()) {
      others.push_back(std::move(canonical));
    }
  }
  return others;
}

bool quiet() {
  const std::string value = env_or_empty(kQuietEnv);
  return !value.empty() && value != "0";
}

}  // namespace

std::string version_string(int code) {
  if (code >= 10000) {
    return fmt::format("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
  }
  return fmt::format("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100);
}

std::vector<NcclCandidate> nccl_candidates() {
  std::vector<NcclCandidate> candidates;
  const std::string explicit_path = env_or_empty(kLibraryEnv);
  if (!explicit_path.empty()) {
    candidates.push_back({kPlaceEnv, explicit_path, false, {}});
    return candidates;  // an explicit choice is the only one: see nccl_transport.h
  }

  const std::vector<std::string> loaded = loaded_objects();
  std::vector<std::string> seen;  // canonical paths already listed
  const auto add_file = [&](const char* place, const std::string& file, bool loaded_only) {
    std::string canonical = canonical_or_same(file);
    if (std::find(seen.begin(), seen.end(), canonical) != seen.end()) return;
    seen.push_back(std::move(canonical));
    candidates.push_back({place, file, loaded_only, {}});
  };

  for (const std::string& object : loaded) {
    if (is_nccl_file_name(object)) add_file(kPlaceLoaded, object, /*loaded_only=*/true);
  }
  if (candidates.empty()) {
    // Loaded under another file name but with NCCL's soname.
    candidates.push_back({kPlaceLoaded, kSoname, /*loaded_only=*/true, {}});
  }

  const std::size_t before_python = candidates.size();
  for (const std::string& dir : site_packages_dirs(loaded)) {
    add_file(kPlacePython, (fs::path(dir) / "nvidia" / "nccl" / "lib" / kSoname).string(),
             /*loaded_only=*/false);
  }
  if (candidates.size() == before_python) {
    candidates.push_back({kPlacePython, "", false,
                          "no site-packages directory found (no loaded library lies in one; "
                          "no Python named its path; PYTHONPATH, VIRTUAL_ENV and CONDA_PREFIX "
                          "name none; the program is not a python interpreter)"});
  }

  candidates.push_back({kPlaceSystem, kSoname, /*loaded_only=*/false, {}});
  return candidates;
}

std::unique_ptr<NcclLibrary> NcclLibrary::load(const std::vector<NcclCandidate>& candidates) {
  std::string failures;
  for (const NcclCandidate& candidate : candidates) {
    std::string why;
    if (std::optional<Usable> usable = try_candidate(candidate, why)) {
      return std::unique_ptr<NcclLibrary>(
          new NcclLibrary(usable->api, std::move(usable->path), usable->version, candidate.place));
    }
    failures += fmt::format("\n  {}: {}", candidate.place, why);
  }
  if (candidates.empty()) failures = "\n  (no place to look was given)";
  throw Error(ErrorCode::kTransport,
              fmt::format("no usable NCCL library (shadowsync needs NCCL {} or newer; it was built "
                          "against nccl.h {}). Looked at, in order:{}\nInstall NCCL (the "
                          "nvidia-nccl-cu12 or -cu13 Python package, or the system's libnccl2), or "
                          "set {} to the path of a libnccl.so.2.",
                          version_string(kMinimumVersion), version_string(NCCL_VERSION_CODE),
                          failures, kLibraryEnv));
}

const NcclLibrary& NcclLibrary::process() {
  // Never destroyed: transports may still call NCCL from static destructors at exit.
  static constinit std::atomic<const NcclLibrary*> library{nullptr};
  if (const NcclLibrary* loaded = library.load(std::memory_order_acquire)) return *loaded;
  static std::mutex mutex;
  std::lock_guard lock(mutex);
  if (const NcclLibrary* loaded = library.load(std::memory_order_relaxed)) return *loaded;

  std::unique_ptr<NcclLibrary> loaded = load(nccl_candidates());
  if (!quiet()) {
    std::string also;
    for (const std::string& other : other_loaded_nccls(loaded->path())) {
      also += fmt::format("; note: {} is loaded too, so the process now has two NCCLs", other);
    }
    std::fprintf(stderr, "shadowsync: NCCL %s from %s (%s)%s\n",
                 version_string(loaded->version()).c_str(), loaded->path().c_str(),
                 loaded->place().c_str(), also.c_str());
  }
  const NcclLibrary* result = loaded.release();
  library.store(result, std::memory_order_release);
  return *result;
}

void add_python_path(std::string_view paths) {
  std::vector<std::string> dirs;
  split_path_list(paths, dirs);
  const std::lock_guard lock(python_path_mutex);
  for (std::string& dir : dirs) {
    if (std::find(python_path_dirs.begin(), python_path_dirs.end(), dir) == python_path_dirs.end()) {
      python_path_dirs.push_back(std::move(dir));
    }
  }
}

}  // namespace shadowsync::nccl_detail
