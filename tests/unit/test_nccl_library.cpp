// The NCCL transport's run-time loading of libnccl (plugin/transports/nccl/nccl_library.h): the
// search order, the checks on what it finds, the errors, and the C ABI's report of the library.
// Loading NCCL and calling ncclGetVersion need no GPU, so in a CUDA build all of this runs on a
// CPU-only machine with NCCL installed. In a build without CUDA only the C ABI's
// SHADOWSYNC_NOT_SUPPORTED is checked.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>

#include "shadowsync/shadowsync.h"

#if defined(SHADOWSYNC_WITH_CUDA)

#include <dlfcn.h>
#include <link.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "shadowsync/error.h"
#include "shadowsync/nccl_transport.h"
#include "transports/nccl/nccl_library.h"

using shadowsync::Error;
using shadowsync::ErrorCode;
using shadowsync::NcclTransport;
using shadowsync::nccl_detail::kMinimumVersion;
using shadowsync::nccl_detail::nccl_candidates;
using shadowsync::nccl_detail::NcclCandidate;
using shadowsync::nccl_detail::NcclLibrary;
using shadowsync::nccl_detail::version_string;

namespace {

namespace fs = std::filesystem;

// Every libnccl* object mapped into the process.
std::vector<std::string> loaded_nccls() {
  std::vector<std::string> names;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const std::string name = info->dlpi_name != nullptr ? info->dlpi_name : "";
        if (fs::path(name).filename().string().starts_with("libnccl")) {
          static_cast<std::vector<std::string>*>(data)->push_back(name);
        }
        return 0;
      },
      &names);
  return names;
}

// Taken while static objects are constructed, i.e. after the loader mapped every library the
// executable needs and before any test loaded NCCL: nothing may have brought libnccl in by then.
const std::vector<std::string> g_nccls_at_startup = loaded_nccls();

bool maps_contain(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    // "<range> <perms> <offset> <dev> <inode>   <path>": the path is the line's tail.
    if (line.size() >= path.size() &&
        line.compare(line.size() - path.size(), path.size(), path) == 0 &&
        line[line.size() - path.size() - 1] == ' ') {
      return true;
    }
  }
  return false;
}

// Sets (or unsets, for nullopt) an environment variable for the scope; restores it after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// The message of the Error(kTransport) that load(candidates) throws; fails the test if it loads.
std::string load_error(const std::vector<NcclCandidate>& candidates) {
  try {
    NcclLibrary::load(candidates);
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kTransport);
    return e.what();
  }
  FAIL("NcclLibrary::load succeeded where it should have failed");
  return {};
}

// The process's NCCL, with the SHADOWSYNC_NCCL_LIBRARY of the test's environment ignored.
const NcclLibrary& process_library() {
  static const NcclLibrary& library = []() -> const NcclLibrary& {
    const ScopedEnv no_override("SHADOWSYNC_NCCL_LIBRARY", std::nullopt);
    return NcclLibrary::process();
  }();
  return library;
}

// Checks that `text` holds each of `parts`, in that order.
void check_in_order(const std::string& text, const std::vector<std::string>& parts) {
  std::size_t from = 0;
  for (const std::string& part : parts) {
    INFO("looking for '" << part << "' after offset " << from << " in:\n" << text);
    const std::size_t at = text.find(part, from);
    REQUIRE(at != std::string::npos);
    from = at + part.size();
  }
}

}  // namespace

TEST_CASE("NCCL library: nothing links libnccl; it is loaded only when first needed") {
  INFO("libnccl was in the process before any test loaded it: "
       << (g_nccls_at_startup.empty() ? std::string() : g_nccls_at_startup.front()));
  CHECK(g_nccls_at_startup.empty());
}

TEST_CASE("NCCL library: version codes read as NCCL prints them") {
  CHECK(version_string(22809) == "2.28.9");
  CHECK(version_string(21400) == "2.14.0");
  CHECK(version_string(21000) == "2.10.0");
  CHECK(version_string(2804) == "2.8.4");  // before 2.9: major * 1000 + minor * 100 + patch
  CHECK(version_string(kMinimumVersion) == "2.14.0");
}

TEST_CASE("NCCL library: the process finds a real NCCL, new enough, and reports the one it maps") {
  const NcclLibrary& library = process_library();
  INFO("loaded " << library.path() << " (" << library.place() << "), version "
                 << library.version());
  CHECK(library.version() >= kMinimumVersion);
  REQUIRE(fs::path(library.path()).is_absolute());
  CHECK(fs::path(library.path()).filename().string().starts_with("libnccl"));
  // The file reported is the one in the address space, and its ncclGetVersion is the one called.
  CHECK(maps_contain(library.path()));
  Dl_info info{};
  REQUIRE(dladdr(reinterpret_cast<void*>(library.api().get_version), &info) != 0);
  REQUIRE(info.dli_fname != nullptr);
  CHECK(fs::canonical(info.dli_fname).string() == library.path());
  int version = 0;
  REQUIRE(library.api().get_version(&version) == ncclSuccess);
  CHECK(version == library.version());
  // Every entry point is resolved.
  const auto& api = library.api();
  CHECK(api.get_error_string != nullptr);
  CHECK(api.get_last_error != nullptr);
  CHECK(api.get_unique_id != nullptr);
  CHECK(api.comm_init_rank_config != nullptr);
  CHECK(api.comm_get_async_error != nullptr);
  CHECK(api.comm_finalize != nullptr);
  CHECK(api.comm_destroy != nullptr);
  CHECK(api.comm_abort != nullptr);
  CHECK(api.broadcast != nullptr);
  CHECK(api.group_start != nullptr);
  CHECK(api.group_end != nullptr);
  CHECK(std::string(api.get_error_string(ncclInvalidArgument)).find("invalid") !=
        std::string::npos);

  // The same library, through the C++ accessor and the C ABI.
  const shadowsync::NcclLibraryInfo cpp = NcclTransport::library();
  CHECK(cpp.path == library.path());
  CHECK(cpp.version == library.version());
  CHECK(cpp.place == library.place());
  char path[4096];
  std::int32_t c_version = 0;
  REQUIRE(shadowsync_nccl_library(path, sizeof(path), &c_version) == SHADOWSYNC_SUCCESS);
  CHECK(std::string(path) == library.path());
  CHECK(c_version == library.version());
  CHECK(shadowsync_nccl_library(nullptr, 0, nullptr) == SHADOWSYNC_SUCCESS);
  // Too small a buffer: refused, untouched, and the error says what it needs.
  char small[4] = {'x', 'x', 'x', 'x'};
  CHECK(shadowsync_nccl_library(small, sizeof(small), &c_version) == SHADOWSYNC_INVALID_ARGUMENT);
  CHECK(std::memcmp(small, "xxxx", 4) == 0);
  CHECK(std::string(shadowsync_get_last_error()).find(library.path()) != std::string::npos);
}

TEST_CASE("NCCL library: once NCCL is in the process, the search takes that one first") {
  const NcclLibrary& library = process_library();
  const ScopedEnv no_override("SHADOWSYNC_NCCL_LIBRARY", std::nullopt);
  const std::vector<NcclCandidate> candidates = nccl_candidates();
  REQUIRE(candidates.size() >= 3);
  CHECK(candidates.front().place == "already loaded by the process");
  CHECK(candidates.front().loaded_only);
  CHECK(fs::canonical(candidates.front().file).string() == library.path());
  // The last step is the system's loader search.
  CHECK(candidates.back().file == "libnccl.so.2");
  CHECK_FALSE(candidates.back().loaded_only);

  const auto again = NcclLibrary::load(candidates);
  CHECK(again->path() == library.path());
  CHECK(again->place() == "already loaded by the process");
  CHECK(loaded_nccls().size() == 1);  // the search loaded no second NCCL
}

TEST_CASE("NCCL library: with no NCCL anywhere the error lists every place and why it failed") {
  const std::vector<NcclCandidate> nowhere = {
      {"already loaded by the process", "/nonexistent/shadowsync-test/libnccl.so.2", true, {}},
      {"Python package nvidia-nccl-cu*",
       "/nonexistent/shadowsync-test/site-packages/nvidia/nccl/lib/libnccl.so.2",
       false,
       {}},
      {"Python package nvidia-nccl-cu* (again)", "", false, "no site-packages directory found"},
      {"the dynamic loader's search path", "libnccl-shadowsync-test-absent.so.2", false, {}},
  };
  const std::string message = load_error(nowhere);
  check_in_order(message,
                 {
                     "no usable NCCL library",
                     "2.14.0",
                     "already loaded by the process: ",
                     "/nonexistent/shadowsync-test/libnccl.so.2: not loaded in this process",
                     "Python package nvidia-nccl-cu*: ",
                     "site-packages/nvidia/nccl/lib/libnccl.so.2: no such file",
                     "(again): no site-packages directory found",
                     "the dynamic loader's search path: ",
                     "libnccl-shadowsync-test-absent.so.2: cannot be loaded: ",
                     "SHADOWSYNC_NCCL_LIBRARY",
                 });
  CHECK(load_error({}).find("no place to look was given") != std::string::npos);
}

TEST_CASE("NCCL library: SHADOWSYNC_NCCL_LIBRARY wins, and is then the only place looked at") {
  const NcclLibrary& library = process_library();  // a usable NCCL is in the process already
  {
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", library.path());
    const std::vector<NcclCandidate> candidates = nccl_candidates();
    REQUIRE(candidates.size() == 1);
    CHECK(candidates[0].place == "SHADOWSYNC_NCCL_LIBRARY");
    CHECK(candidates[0].file == library.path());
    const auto loaded = NcclLibrary::load(candidates);
    CHECK(loaded->path() == library.path());
    CHECK(loaded->place() == "SHADOWSYNC_NCCL_LIBRARY");
  }
  {
    // Too old: refused with both versions, although a good NCCL is loaded and on the system.
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", SHADOWSYNC_FAKE_NCCL_OLD);
    const std::vector<NcclCandidate> candidates = nccl_candidates();
    REQUIRE(candidates.size() == 1);
    const std::string message = load_error(candidates);
    check_in_order(message,
                   {"SHADOWSYNC_NCCL_LIBRARY: ", fs::canonical(SHADOWSYNC_FAKE_NCCL_OLD).string(),
                    "NCCL 2.10.0 (version code 21000) is older than NCCL 2.14.0 (version "
                    "code 21400)"});
    CHECK(message.find(library.path()) == std::string::npos);  // it did not go on searching
  }
  {
    // An empty value is no choice: the search proper runs.
    const ScopedEnv empty("SHADOWSYNC_NCCL_LIBRARY", std::string());
    CHECK(nccl_candidates().size() >= 3);
  }
}

TEST_CASE("NCCL library: a file that is not NCCL is refused by name") {
  SECTION("a shared library without ncclGetVersion") {
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", SHADOWSYNC_FAKE_NCCL_NOT_NCCL);
    check_in_order(
        load_error(nccl_candidates()),
        {"SHADOWSYNC_NCCL_LIBRARY: ", fs::canonical(SHADOWSYNC_FAKE_NCCL_NOT_NCCL).string(),
         ": not an NCCL library (it exports no ncclGetVersion)"});
  }
  SECTION("a text file") {
    const fs::path text = fs::temp_directory_path() /
                          ("shadowsync-test-not-nccl-" + std::to_string(::getpid()) + ".so");
    std::ofstream(text) << "not a shared library\n";
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", text.string());
    const std::string message = load_error(nccl_candidates());
    fs::remove(text);
    check_in_order(message, {"SHADOWSYNC_NCCL_LIBRARY: ", text.string() + ": cannot be loaded: "});
  }
  SECTION("a path that does not exist") {
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", "/nonexistent/shadowsync-test/libnccl.so.2");
    check_in_order(
        load_error(nccl_candidates()),
        {"SHADOWSYNC_NCCL_LIBRARY: ", "/nonexistent/shadowsync-test/libnccl.so.2: no such file"});
  }
  SECTION("an NCCL without the functions the transport calls") {
    const ScopedEnv chosen("SHADOWSYNC_NCCL_LIBRARY", SHADOWSYNC_FAKE_NCCL_INCOMPLETE);
    check_in_order(load_error(nccl_candidates()),
                   {fs::canonical(SHADOWSYNC_FAKE_NCCL_INCOMPLETE).string(),
                    ": NCCL 2.28.9 but it lacks ncclGetErrorString, ", "ncclCommInitRankConfig",
                    "ncclCommFinalize", "ncclGroupEnd"});
  }
}

TEST_CASE("NCCL library: the Python package is looked for before the system's NCCL") {
  const ScopedEnv no_override("SHADOWSYNC_NCCL_LIBRARY", std::nullopt);
  const ScopedEnv no_conda("CONDA_PREFIX", std::nullopt);
  const fs::path root =
      fs::temp_directory_path() / ("shadowsync-test-python-" + std::to_string(::getpid()));
  const fs::path on_path = root / "pythonpath";
  const fs::path venv = root / "venv";
  const fs::path venv_site = venv / "lib" / "python3.12" / "site-packages";
  fs::create_directories(on_path / "nvidia" / "nccl" / "lib");
  fs::create_directories(venv_site / "nvidia" / "nccl" / "lib");
  // A too-old stand-in where the package puts libnccl.so.2: what load() then says shows it tried.
  fs::copy_file(SHADOWSYNC_FAKE_NCCL_OLD, venv_site / "nvidia" / "nccl" / "lib" / "libnccl.so.2");
  std::vector<NcclCandidate> candidates;
  {
    const ScopedEnv python_path("PYTHONPATH", "/nonexistent/shadowsync-test:" + on_path.string());
    const ScopedEnv virtual_env("VIRTUAL_ENV", venv.string());
    candidates = nccl_candidates();
  }
  std::vector<std::string> python;
  for (const NcclCandidate& candidate : candidates) {
    if (candidate.place == "Python package nvidia-nccl-cu*") python.push_back(candidate.file);
  }
  CHECK(python == std::vector<std::string>{
                      "/nonexistent/shadowsync-test/nvidia/nccl/lib/libnccl.so.2",
                      (on_path / "nvidia" / "nccl" / "lib" / "libnccl.so.2").string(),
                      (venv_site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").string()});
  CHECK(candidates.back().place == "the dynamic loader's search path");

  const std::vector<NcclCandidate> package(candidates.end() - 4, candidates.end() - 1);
  const std::string message = load_error(package);
  fs::remove_all(root);
  check_in_order(message, {"nvidia-nccl-cu*: /nonexistent/shadowsync-test/", ": no such file",
                           "nvidia-nccl-cu*: ", ": no such file", "nvidia-nccl-cu*: ",
                           "venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2: NCCL "
                           "2.10.0 (version code 21000) is older"});

  // Without any of those, the step says why it had nothing to try.
  const ScopedEnv no_python_path("PYTHONPATH", std::nullopt);
  const ScopedEnv no_virtual_env("VIRTUAL_ENV", std::nullopt);
  bool said_why = false;
  for (const NcclCandidate& candidate : nccl_candidates()) {
    if (candidate.place == "Python package nvidia-nccl-cu*") {
      CHECK(candidate.file.empty());
      said_why = candidate.nothing_because.find("no site-packages directory") != std::string::npos;
    }
  }
  CHECK(said_why);
}

TEST_CASE("NCCL library: the search goes on past an unusable library to the next place") {
  const NcclLibrary& library = process_library();
  const std::vector<NcclCandidate> candidates = {
      {"first", SHADOWSYNC_FAKE_NCCL_OLD, false, {}},
      {"second", SHADOWSYNC_FAKE_NCCL_NOT_NCCL, false, {}},
      {"third", library.path(), false, {}},
  };
  const auto loaded = NcclLibrary::load(candidates);
  CHECK(loaded->path() == library.path());
  CHECK(loaded->place() == "third");
  CHECK(loaded_nccls().size() == 1);  // the fakes' names are not libnccl*; no second NCCL
}

// Last of the CUDA cases: the directories a Python names stay for the rest of the process.
TEST_CASE("NCCL library: the directories a Python names are searched first in the package step") {
  const ScopedEnv no_override("SHADOWSYNC_NCCL_LIBRARY", std::nullopt);
  const ScopedEnv python_path("PYTHONPATH", "/nonexistent/shadowsync-test-pythonpath");
  REQUIRE(shadowsync_nccl_add_python_path(nullptr) == SHADOWSYNC_INVALID_ARGUMENT);
  REQUIRE(shadowsync_nccl_add_python_path(
              "/nonexistent/shadowsync-test-sys-path-a::/nonexistent/shadowsync-test-sys-path-b") ==
          SHADOWSYNC_SUCCESS);
  std::vector<std::string> python;
  for (const NcclCandidate& candidate : nccl_candidates()) {
    if (candidate.place == "Python package nvidia-nccl-cu*") python.push_back(candidate.file);
  }
  REQUIRE(python.size() >= 3);
  CHECK(python[0] == "/nonexistent/shadowsync-test-sys-path-a/nvidia/nccl/lib/libnccl.so.2");
  CHECK(python[1] == "/nonexistent/shadowsync-test-sys-path-b/nvidia/nccl/lib/libnccl.so.2");
  CHECK(python[2] == "/nonexistent/shadowsync-test-pythonpath/nvidia/nccl/lib/libnccl.so.2");
}

#else  // !SHADOWSYNC_WITH_CUDA

TEST_CASE("NCCL library: not in a build without CUDA") {
  char path[64] = "unchanged";
  std::int32_t version = -1;
  CHECK(shadowsync_nccl_library(path, sizeof(path), &version) == SHADOWSYNC_NOT_SUPPORTED);
  CHECK(std::string(path) == "unchanged");
  CHECK(version == -1);
  CHECK(std::string(shadowsync_get_last_error()).find("without CUDA") != std::string::npos);
}

#endif
