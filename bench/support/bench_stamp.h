// Who ran what, when and from which commit: the stamp every benchmark's artefacts carry (the
// machine is each program's own: the GPUs' names or --machine). Header-only, nothing CUDA, as
// bench_common.h.
#pragma once

#include <cstdlib>
#include <ctime>
#include <string>

namespace shadowsync::bench {

// `when` in UTC, formatted by strftime's `format`.
inline std::string utc_time(std::time_t when, const char* format) {
  std::tm tm{};
  gmtime_r(&when, &tm);
  char text[64];
  std::strftime(text, sizeof text, format, &tm);
  return text;
}

inline std::string utc_now(const char* format) { return utc_time(std::time(nullptr), format); }

// One instant, written for people and for file names.
struct RunDate {
  std::string date;        // 2026-11-21T10:00:00Z
  std::string file_stamp;  // 20261121T100000Z
};

inline RunDate run_date_now() {
  const std::time_t now = std::time(nullptr);
  return {utc_time(now, "%Y-%m-%dT%H:%M:%SZ"), utc_time(now, "%Y%m%dT%H%M%SZ")};
}

// `given` (--commit), else $SHADOWSYNC_COMMIT, else $GIT_COMMIT, else "unknown". A device
// machine's copy of the checkout has no .git, so the scripts pass the commit down.
inline std::string commit_or_environment(const std::string& given) {
  if (!given.empty()) return given;
  for (const char* name : {"SHADOWSYNC_COMMIT", "GIT_COMMIT"}) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return value;
  }
  return "unknown";
}

// argv as one shell-quotable line.
inline std::string command_line(int argc, char** argv) {
  std::string line;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    const bool plain = !arg.empty() && arg.find_first_not_of(
                                           "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                           "0123456789-_./=,:+@%") == std::string::npos;
    if (i > 0) line += ' ';
    if (plain) {
      line += arg;
    } else {
      line += '\'';
      for (char c : arg) {
        if (c == '\'') {
          line += "'\\''";
        } else {
          line += c;
        }
      }
      line += '\'';
    }
  }
  return line;
}

}  // namespace shadowsync::bench
