// The line protocol between bench_same_host_one_gpu's two processes: the engine writes one
// command line to the trainer's command pipe and reads one reply line from its reply pipe,
// "ok key=value ..." or "error message". The commands: same_host_trainer.h. Also the token both
// sides of the transport present, and how long they wait for each other.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace shadowsync::bench::same_host {

// The environment variable that holds the transport's token (else the engine writes a fresh one
// to a 0600 file and passes it to the trainer as --token-file).
inline constexpr const char* kTokenEnv = "SHADOWSYNC_CONTROL_TOKEN";

// The trainer's serve() and the engine's connect() wait this long for each other.
inline constexpr auto kConnectTimeout = std::chrono::seconds(60);

// `text` with its newlines replaced by spaces: one line of the protocol, or of a report.
std::string one_line(std::string text);

// Writes `text` (made one line) and a newline to `fd`; throws BenchError if it cannot.
void write_line(int fd, const std::string& text);

// Reads lines from a pipe, each within a deadline.
class LineReader {
 public:
  explicit LineReader(int fd) : fd_(fd) {}

  // The next line, without its newline; nothing at end of file. Throws BenchError naming `what`
  // once `timeout` passes.
  std::optional<std::string> next(std::chrono::milliseconds timeout, const std::string& what);

  // Whether a line (or the end of the file) may be read now: a line is buffered, or the fd
  // becomes readable within `wait`.
  bool readable(std::chrono::milliseconds wait);

 private:
  int fd_;
  std::string buffer_;
};

// A trainer's "ok ..." reply.
struct Reply {
  std::map<std::string, std::string> fields;
  std::string line;  // the whole reply, "ok ..." (for replies that are not key=value words)

  // The field `key` as a number; throws BenchError if the reply has none.
  double number(const std::string& key) const;
  std::int64_t integer(const std::string& key) const;
};

// The reply `line` to `command`; throws BenchError with the trainer's message for "error ...",
// or naming the line for anything but "ok ...".
Reply parse_reply(const std::string& command, const std::string& line);

// The token: $SHADOWSYNC_CONTROL_TOKEN, else the first word of `token_file`; throws BenchError
// if neither gives one.
std::string load_token(const std::string& token_file);

}  // namespace shadowsync::bench::same_host
