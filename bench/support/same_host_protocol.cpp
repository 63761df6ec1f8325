// The line protocol between bench_same_host_one_gpu's two processes (see same_host_protocol.h).
#include "same_host_protocol.h"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "bench_common.h"

namespace shadowsync::bench::same_host {

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

void write_line(int fd, const std::string& text) {
  const std::string line = one_line(text) + '\n';
  std::size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw BenchError(cat("writing '", text, "' to the other process: ", std::strerror(errno)));
    done += static_cast<std::size_t>(n);
  }
}

std::optional<std::string> LineReader::next(std::chrono::milliseconds timeout,
                                            const std::string& what) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      throw BenchError(cat("timed out after ", timeout.count(), " ms waiting for ", what));
    }
    pollfd pfd{fd_, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) throw BenchError(cat("poll: ", std::strerror(errno)));
    if (ready <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(fd_, chunk, sizeof chunk);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) throw BenchError(cat("reading ", what, ": ", std::strerror(errno)));
    if (n == 0) return std::nullopt;
    buffer_.append(chunk, static_cast<std::size_t>(n));
  }
}

bool LineReader::readable(std::chrono::milliseconds wait) {
  if (buffer_.find('\n') != std::string::npos) return true;
  pollfd pfd{fd_, POLLIN, 0};
  return ::poll(&pfd, 1, static_cast<int>(wait.count())) > 0;
}

double Reply::number(const std::string& key) const {
  const auto it = fields.find(key);
  if (it == fields.end()) throw BenchError(cat("the trainer's reply has no '", key, "'"));
  return std::strtod(it->second.c_str(), nullptr);
}

std::int64_t Reply::integer(const std::string& key) const {
  const auto it = fields.find(key);
  if (it == fields.end()) throw BenchError(cat("the trainer's reply has no '", key, "'"));
  return std::strtoll(it->second.c_str(), nullptr, 10);
}

Reply parse_reply(const std::string& command, const std::string& line) {
  if (line.rfind("error ", 0) == 0) {
    throw BenchError(cat("trainer process, '", command, "': ", line.substr(6)));
  }
  if (line != "ok" && line.rfind("ok ", 0) != 0) {
    throw BenchError(cat("trainer process, '", command, "': unexpected reply '", line, "'"));
  }
  Reply reply;
  reply.line = line;
  std::istringstream words(line.substr(2));
  std::string word;
  while (words >> word) {
    const auto eq = word.find('=');
    if (eq != std::string::npos) reply.fields[word.substr(0, eq)] = word.substr(eq + 1);
  }
  return reply;
}

std::string load_token(const std::string& token_file) {
  if (const char* env = std::getenv(kTokenEnv); env != nullptr && *env != '\0') return env;
  if (token_file.empty()) {
    throw BenchError(cat("no token: set ", kTokenEnv, " or pass --token-file"));
  }
  std::ifstream in(token_file);
  std::string token;
  if (!(in >> token)) throw BenchError(cat("cannot read the token from '", token_file, "'"));
  return token;
}

}  // namespace shadowsync::bench::same_host
