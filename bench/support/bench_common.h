// Small pieces shared by the benchmark programs (bench_updates.cpp, bench_gpu.cu and the one-GPU
// programs): string formatting, percentiles, a JSON value, bounded waits and the two
// synchronization objects the update benchmark's baseline needs (a two-party rendezvous and a
// condition-variable "RPC"). Header-only so that the CPU programs and the CUDA programs compile it
// each with their own compiler; no fmt (nvcc parses this too) and nothing CUDA here.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "shadowsync/backend.h"

namespace shadowsync::bench {

using Clock = std::chrono::steady_clock;

// The bound on any single wait in the benchmark (a transfer, a publish, a barrier). A 14B update
// takes ~0.1 s on NVLink; anything near this bound is a hang, not a slow run.
inline constexpr std::chrono::seconds kWaitLimit{30};

class BenchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// printf into a std::string.
inline std::string strf(const char* format, ...) __attribute__((format(printf, 1, 2)));
inline std::string strf(const char* format, ...) {
  char buffer[512];
  va_list args;
  va_start(args, format);
  const int n = std::vsnprintf(buffer, sizeof buffer, format, args);
  va_end(args);
  if (n < 0) return {};
  if (static_cast<std::size_t>(n) < sizeof buffer) return std::string(buffer, static_cast<std::size_t>(n));
  std::string out(static_cast<std::size_t>(n) + 1, '\0');
  va_start(args, format);
  std::vsnprintf(out.data(), out.size(), format, args);
  va_end(args);
  out.resize(static_cast<std::size_t>(n));
  return out;
}

inline double to_ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
inline double to_us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }
inline double to_s(Clock::duration d) { return std::chrono::duration<double>(d).count(); }
inline constexpr std::size_t kMiB = std::size_t{1} << 20;
inline constexpr std::size_t kGiB = std::size_t{1} << 30;

inline double gib(double bytes) { return bytes / double(1ull << 30); }
inline double gb_per_s(double bytes, double seconds) { return seconds > 0 ? bytes / seconds / 1e9 : 0.0; }

// ---------------------------------------------------------------------------------------------
// Percentiles: nearest rank (the smallest sample with at least q of the samples at or below it),
// so p99 of fewer than 100 samples is the maximum.
// ---------------------------------------------------------------------------------------------
struct Summary {
  std::size_t n = 0;
  double median = 0, p99 = 0, min = 0, max = 0, mean = 0;
};

inline double nearest_rank(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double rank = std::ceil(q * static_cast<double>(sorted.size()));
  const std::size_t index = rank < 1 ? 0 : static_cast<std::size_t>(rank) - 1;
  return sorted[std::min(index, sorted.size() - 1)];
}

inline Summary summarize(std::vector<double> values) {
  Summary s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.n = values.size();
  s.median = nearest_rank(values, 0.5);
  s.p99 = nearest_rank(values, 0.99);
  s.min = values.front();
  s.max = values.back();
  double sum = 0;
  for (double v : values) sum += v;
  s.mean = sum / static_cast<double>(values.size());
  return s;
}

// ---------------------------------------------------------------------------------------------
// A JSON value: enough to write the results file (objects keep their insertion order).
// ---------------------------------------------------------------------------------------------
class Json {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool value) : kind_(Kind::kBool), bool_(value) {}
  template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Json(T value) : kind_(Kind::kNumber), number_(static_cast<double>(value)) {}
  Json(const char* value) : kind_(Kind::kString), string_(value) {}
  Json(std::string value) : kind_(Kind::kString), string_(std::move(value)) {}
  template <typename T>
  Json(const std::optional<T>& value) {
    if (value) *this = Json(*value);
  }

  static Json object() {
    Json j;
    j.kind_ = Kind::kObject;
    return j;
  }
  static Json array() {
    Json j;
    j.kind_ = Kind::kArray;
    return j;
  }

  Json& set(const std::string& key, Json value) {
    kind_ = Kind::kObject;
    for (std::size_t i = 0; i < keys_.size(); ++i) {
      if (keys_[i] == key) {
        items_[i] = std::move(value);
        return *this;
      }
    }
    keys_.push_back(key);
    items_.push_back(std::move(value));
    return *this;
  }
  Json& push(Json value) {
    kind_ = Kind::kArray;
    items_.push_back(std::move(value));
    return *this;
  }
  bool is_null() const { return kind_ == Kind::kNull; }

  std::string dump(int indent = 2) const {
    std::string out;
    write(out, indent, 0);
    out += '\n';
    return out;
  }

 private:
  static void escape(std::string& out, const std::string& s) {
    out += '"';
    for (const char c : s) {
      switch (c) {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\r': out += "\\r"; break;
        case '\t': out += "\\t"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            out += strf("\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          } else {
            out += c;
          }
      }
    }
    out += '"';
  }
  void write(std::string& out, int indent, int depth) const {
    const std::string pad(static_cast<std::size_t>(indent * (depth + 1)), ' ');
    const std::string pad_end(static_cast<std::size_t>(indent * depth), ' ');
    switch (kind_) {
      case Kind::kNull: out += "null"; break;
      case Kind::kBool: out += bool_ ? "true" : "false"; break;
      case Kind::kNumber:
        if (!std::isfinite(number_)) {
          out += "null";
        } else if (number_ == std::floor(number_) && std::fabs(number_) < 9e15) {
          out += strf("%.0f", number_);
        } else {
          out += strf("%.6g", number_);
        }
        break;
      case Kind::kString: escape(out, string_); break;
      case Kind::kArray:
      case Kind::kObject: {
        const bool object = kind_ == Kind::kObject;
        if (items_.empty()) {
          out += object ? "{}" : "[]";
          break;
        }
        // Arrays of plain values stay on one line.
        bool flat = !object;
        for (const Json& item : items_) {
          flat = flat && item.kind_ != Kind::kArray && item.kind_ != Kind::kObject;
        }
        out += object ? "{" : "[";
        for (std::size_t i = 0; i < items_.size(); ++i) {
          if (i > 0) out += ",";
          if (flat) {
            if (i > 0) out += ' ';
          } else {
            out += '\n';
            out += pad;
          }
          if (object) {
            escape(out, keys_[i]);
            out += ": ";
          }
          items_[i].write(out, indent, depth + 1);
        }
        if (!flat) {
          out += '\n';
          out += pad_end;
        }
        out += object ? "}" : "]";
        break;
      }
    }
  }

  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<std::string> keys_;  // objects
  std::vector<Json> items_;        // array items or object values
};

inline Json to_json(const Summary& s) {
  return Json::object()
      .set("n", s.n)
      .set("median", s.median)
      .set("p99", s.p99)
      .set("min", s.min)
      .set("max", s.max)
      .set("mean", s.mean);
}

// The median of `values` (nearest rank, as in summarize); 0 for none.
inline double median(const std::vector<double>& values) { return summarize(values).median; }

// summarize(values) as JSON.
inline Json summary_json(const std::vector<double>& values) { return to_json(summarize(values)); }

// ---------------------------------------------------------------------------------------------
// Bounded waits.
// ---------------------------------------------------------------------------------------------

// Polls `condition` (yielding) until it holds; throws BenchError naming `what` past `timeout`.
template <typename Condition>
void wait_until(Condition&& condition, const std::string& what,
                std::chrono::nanoseconds timeout = kWaitLimit) {
  const auto deadline = Clock::now() + timeout;
  while (!condition()) {
    if (Clock::now() > deadline) {
      throw BenchError(cat("timed out after ", to_s(timeout), " s waiting for ", what));
    }
    std::this_thread::yield();
  }
}

// A hot wait for an event: what cudaStreamSynchronize does by default (spin, yield), with a
// deadline. Backend::event_wait_for backs off with sleeps of up to 0.5 ms, which would charge the
// per-tensor baseline for our polling instead of its own round trips.
inline void hot_wait(Backend& backend, Event& event, const std::string& what,
                     std::chrono::nanoseconds timeout = kWaitLimit) {
  wait_until([&] { return backend.event_query(event); }, what, timeout);
}

// Record `event` on `stream` and wait for it, hot: a stream synchronize with a deadline.
inline void sync_stream(Backend& backend, Stream& stream, Event& event, const std::string& what,
                        std::chrono::nanoseconds timeout = kWaitLimit) {
  backend.event_record(event, stream);
  hot_wait(backend, event, what, timeout);
}

// ---------------------------------------------------------------------------------------------
// Two ranks in one process: rank 0 (the trainer, GPU 0) on a new thread, rank 1 (the engine,
// GPU 1) on the calling thread. Either side's exception sets `abort` (which both sides' waits
// check) and is rethrown once both returned.
// ---------------------------------------------------------------------------------------------
inline void run_two(const std::function<void(std::atomic<bool>&)>& rank0,
                    const std::function<void(std::atomic<bool>&)>& rank1) {
  std::atomic<bool> abort{false};
  std::string error0;
  std::thread t([&] {
    try {
      rank0(abort);
    } catch (const std::exception& e) {
      error0 = e.what();
      abort.store(true);
    }
  });
  std::string error1;
  try {
    rank1(abort);
  } catch (const std::exception& e) {
    error1 = e.what();
    abort.store(true);
  }
  t.join();
  if (!error1.empty()) throw BenchError(cat("rank 1: ", error1));
  if (!error0.empty()) throw BenchError(cat("rank 0: ", error0));
}

// Destroys two objects at once on two threads. NCCL may synchronize the ranks of a communicator
// while tearing it down, so the two ends of one must never be destroyed one after the other on a
// single thread.
template <typename A, typename B>
void destroy_pair(std::unique_ptr<A>& a, std::unique_ptr<B>& b) {
  std::thread t([&] { a.reset(); });
  b.reset();
  t.join();
}

// A reusable two-party barrier with a deadline and an abort flag.
class Rendezvous {
 public:
  void arrive_and_wait(const std::atomic<bool>& abort, const char* what) {
    std::unique_lock lock(mutex_);
    const std::uint64_t generation = generation_;
    if (++arrived_ == 2) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const auto deadline = Clock::now() + kWaitLimit;
    while (generation_ == generation) {
      if (abort.load()) throw BenchError(cat(what, ": the other rank failed"));
      if (cv_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(5))) ==
              std::cv_status::timeout &&
          Clock::now() > deadline) {
        throw BenchError(cat("timed out at the rendezvous: ", what));
      }
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
};

// The per-parameter baseline's "RPC": the trainer asks the engine to receive one tensor and waits
// for its answer. A condition-variable handoff between two threads, i.e. a few microseconds:
// far cheaper than a real RPC (Ray, HTTP: hundreds of microseconds to milliseconds), so the
// baseline measured here is a lower bound of the real one.
class RpcChannel {
 public:
  static constexpr int kStop = -1;

  // Trainer: post a request (tensor index, or kStop).
  void call(int request) {
    {
      std::lock_guard lock(mutex_);
      request_ = request;
      has_request_ = true;
      has_reply_ = false;
    }
    cv_.notify_all();
  }
  // Trainer: wait for the engine's answer to the last request.
  void wait_reply(const std::atomic<bool>& abort) {
    wait([&] { return has_reply_; }, abort, "the engine's reply");
  }
  // Engine: the next request.
  int wait_request(const std::atomic<bool>& abort) {
    std::unique_lock lock = wait([&] { return has_request_; }, abort, "the trainer's request");
    has_request_ = false;
    return request_;
  }
  // Engine: answer the request.
  void reply() {
    {
      std::lock_guard lock(mutex_);
      has_reply_ = true;
    }
    cv_.notify_all();
  }

 private:
  template <typename Ready>
  std::unique_lock<std::mutex> wait(Ready&& ready, const std::atomic<bool>& abort, const char* what) {
    std::unique_lock lock(mutex_);
    const auto deadline = Clock::now() + kWaitLimit;
    while (!ready()) {
      if (abort.load()) throw BenchError(cat("waiting for ", what, ": the other rank failed"));
      if (Clock::now() > deadline) throw BenchError(cat("timed out waiting for ", what));
      cv_.wait_for(lock, std::chrono::milliseconds(5));
    }
    return lock;
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  int request_ = 0;
  bool has_request_ = false;
  bool has_reply_ = false;
};

}  // namespace shadowsync::bench
