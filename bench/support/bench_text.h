// Numbers and Markdown table heads as the benchmark programs' progress lines and tables print them.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <optional>
#include <string>

#include "bench_common.h"

namespace shadowsync::bench {

inline std::string bytes_text(double bytes) {
  if (bytes >= 1e9) return strf("%.2f GB", bytes / 1e9);
  if (bytes >= 1e6) return strf("%.1f MB", bytes / 1e6);
  if (bytes >= 1e3) return strf("%.1f kB", bytes / 1e3);
  return strf("%.0f B", bytes);
}
inline std::string mib_text(std::size_t bytes) {
  if (bytes >= kMiB) return strf("%zu MiB", bytes / kMiB);
  return strf("%zu KiB", bytes / 1024);
}
inline std::string med_p99(const std::optional<Summary>& s, const char* format = "%.1f") {
  if (!s || s->n == 0) return "—";
  return strf(format, s->median) + " / " + strf(format, s->p99);
}

// A Markdown table's first two lines, "| a | b |" and "| --- | --- |", each with its newline.
inline std::string table_head(std::initializer_list<const char*> columns) {
  std::string names = "|";
  std::string rule = "|";
  for (const char* column : columns) {
    names += cat(" ", column, " |");
    rule += " --- |";
  }
  return names + "\n" + rule + "\n";
}

}  // namespace shadowsync::bench
