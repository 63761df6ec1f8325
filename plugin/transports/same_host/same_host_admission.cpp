#include "transports/same_host/same_host_admission.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "shadowsync/error.h"
#include "transports/same_host/same_host_auth.h"
#include "transports/same_host/same_host_frame.h"

namespace shadowsync::same_host {
namespace {

// The most peers' failures a timeout names: the latest ones; a peer that connects and leaves in
// a loop must not grow the message without bound.
constexpr std::size_t kFailuresNamed = 8;

// What an accepted connection owes next.
enum class Awaiting { kProof, kReady, kHello };

const char* name_of(Awaiting awaiting) {
  switch (awaiting) {
    case Awaiting::kProof: return "its proof of the token";
    case Awaiting::kReady: return "ready (its check of this sender's proof)";
    case Awaiting::kHello: return "its hello (world size, rank and plan fingerprint)";
  }
  return "?";
}

// One accepted connection whose handshake is under way.
struct Pending {
  Fd fd;  // empty once admitted or dropped
  pid_t pid = 0;
  uid_t uid = 0;
  Clock::time_point connected;
  Clock::time_point deadline;  // connected + handshake_timeout
  Awaiting awaiting = Awaiting::kProof;
  Nonce sender_nonce{};
  std::uint32_t rank = 0;    // once its proof passed (with a hello: once admitted): the rank held
  std::uint32_t proved = 0;  // the rank its proof was made for
  std::array<std::byte, kMaxRecordBytes> record{};  // the record being read
  std::size_t filled = 0;
};

std::string who(pid_t pid, uid_t uid) { return fmt::format("peer pid {} (uid {})", pid, uid); }
std::string who(const Pending& p) { return who(p.pid, p.uid); }

long long ms_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count();
}

// Milliseconds until `at` for poll(): 0 once passed.
int poll_timeout(Clock::time_point at) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(at - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, std::numeric_limits<int>::max()));
}

class Admission {
 public:
  Admission(int listener, const std::string& path, std::string_view token, int receivers,
            std::span<const std::byte> setup_record, int shared_fd, const SameHostConfig& config,
            const AdmissionHello* hello)
      : hello_(hello),
        listener_(listener),
        path_(path),
        token_(token),
        receivers_(receivers),
        setup_record_(setup_record),
        shared_fd_(shared_fd),
        config_(config),
        taken_(static_cast<std::size_t>(receivers) + 1, false),
        peers_(static_cast<std::size_t>(receivers)) {}

  std::vector<Fd> run() {
    const auto deadline = Clock::now() + config_.connect_timeout;
    while (admitted_ < receivers_) {
      const auto now = Clock::now();
      for (Pending& p : pending_) {
        if (now >= p.deadline) {
          drop(p, fmt::format("{} sent no {} within {} ms of connecting", who(p),
                              name_of(p.awaiting), config_.handshake_timeout.count()));
        }
      }
      std::erase_if(pending_, [](const Pending& p) { return !p.fd; });
      if (now >= deadline) throw timed_out();

      // The listener and every pending handshake together: no peer waits for another's.
      std::vector<pollfd> fds;
      fds.push_back({listener_, POLLIN, 0});
      auto wake_at = deadline;
      for (const Pending& p : pending_) {
        fds.push_back({p.fd.get(), POLLIN, 0});
        wake_at = std::min(wake_at, p.deadline);
      }
      // Admitted receivers send nothing until every one is admitted: one that turns readable
      // closed its socket (its process died while the others came) and gives its seat back, so
      // that a restarted one can take it.
      const std::size_t first_admitted = fds.size();
      std::vector<std::size_t> admitted_seats;
      for (std::size_t s = 1; s <= peers_.size(); ++s) {
        if (!peers_[s - 1]) continue;
        fds.push_back({peers_[s - 1].get(), POLLIN, 0});
        admitted_seats.push_back(s);
      }
      const int n = ::poll(fds.data(), fds.size(), poll_timeout(wake_at));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw Error(ErrorCode::kTransport,
                    fmt::format("same-host serve on '{}': poll: {}", path_, std::strerror(errno)));
      }
      for (std::size_t i = 0; i < admitted_seats.size(); ++i) {
        if (fds[first_admitted + i].revents != 0) release_if_gone(admitted_seats[i]);
      }
      for (std::size_t i = 0; i < pending_.size(); ++i) {
        if (fds[i + 1].revents != 0) advance(pending_[i]);
      }
      std::erase_if(pending_, [](const Pending& p) { return !p.fd; });
      if (fds[0].revents != 0) accept_one();
    }
    return std::move(peers_);
  }

 private:
  // Remembers why a peer failed, for the timeout's message.
  void note(std::string failure) {
    failures_.push_back(std::move(failure));
    if (failures_.size() > kFailuresNamed) {
      failures_.pop_front();
      ++failures_forgotten_;
    }
  }

  // An admitted receiver's socket turned readable before every receiver was admitted: unless
  // that was spurious, it closed (or broke the protocol), and its seat is free again.
  void release_if_gone(std::size_t seat) {
    Fd& fd = peers_[seat - 1];
    char byte = 0;
    const ssize_t n = ::recv(fd.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    const std::string what = n == 0  ? std::string("closed its socket (its process died?)")
                             : n > 0 ? std::string("sent data before every receiver came")
                                     : fmt::format("failed: {}", std::strerror(errno));
    fd.reset();
    taken_[seat] = false;
    --admitted_;
    note(fmt::format("rank {}, admitted, {}; its place is free again", seat_name(seat), what));
  }

  // A seat (a rank without a hello) as messages name it.
  std::string seat_name(std::size_t seat) const {
    const auto s = static_cast<std::uint32_t>(seat);
    return hello_ != nullptr && hello_->seat_name ? hello_->seat_name(s)
                                                  : std::to_string(shown(s));
  }

  // Closes a pending connection (freeing the rank it held) and notes why.
  void drop(Pending& p, std::string why) {
    if (p.rank != 0) taken_[p.rank] = false;
    p.rank = 0;
    p.fd.reset();
    note(std::move(why));
  }

  void accept_one() {
    Fd fd(::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd) {
      if (errno != EINTR && errno != EAGAIN && errno != ECONNABORTED) {
        note(fmt::format("accepting a connection: {}", std::strerror(errno)));
      }
      return;
    }
    ucred cred{};
    socklen_t cred_size = sizeof(cred);
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_size) != 0) {
      note(fmt::format("a peer whose credentials (SO_PEERCRED) could not be read: {}",
                       std::strerror(errno)));
      return;
    }
    if (cred.uid != ::geteuid()) {
      note(fmt::format("{} is not this user (uid {}); nothing was sent to it",
                       who(cred.pid, cred.uid), ::geteuid()));
      return;
    }
    Pending p;
    p.pid = cred.pid;
    p.uid = cred.uid;
    p.connected = Clock::now();
    p.deadline = p.connected + config_.handshake_timeout;
    p.sender_nonce = make_nonce();
    // A fresh socket's buffer takes the 40 bytes at once: this does not wait on the peer.
    if (const Io io = write_all(fd.get(), encode(Challenge{p.sender_nonce}), -1, p.deadline);
        io != Io::kOk) {
      note(fmt::format("sending the challenge to {}: {}", who(p), describe(io, errno)));
      return;
    }
    p.fd = std::move(fd);
    pending_.push_back(std::move(p));
  }

  std::size_t bytes_of(Awaiting awaiting) const {
    switch (awaiting) {
      case Awaiting::kProof: return record_bytes(RecordType::kProof);
      case Awaiting::kReady: return record_bytes(RecordType::kReady);
      case Awaiting::kHello: return hello_->record_bytes;
    }
    return 0;
  }

  // A rank as messages name it (a pull transport's engine rank is its proved rank - 1).
  long long shown(std::uint32_t rank) const {
    return static_cast<long long>(rank) + (hello_ != nullptr ? hello_->shown_rank_offset : 0);
  }

  // Reads what `p` sent (no more than the record it owes) and acts on a whole record.
  void advance(Pending& p) {
    const std::size_t want = bytes_of(p.awaiting);
    const ssize_t n = ::recv(p.fd.get(), p.record.data() + p.filled, want - p.filled, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE || errno == ENOTCONN))) {
      drop(p, fmt::format("{} closed its socket {} ms after connecting, before sending {}", who(p),
                          ms_between(p.connected, Clock::now()), name_of(p.awaiting)));
      return;
    }
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) return;
      drop(p, fmt::format("reading {} from {}: {}", name_of(p.awaiting), who(p),
                          std::strerror(errno)));
      return;
    }
    p.filled += static_cast<std::size_t>(n);
    if (p.filled < want) return;
    p.filled = 0;
    const std::span<const std::byte> record(p.record.data(), want);
    if (p.awaiting == Awaiting::kProof) {
      on_proof(p, record);
    } else if (p.awaiting == Awaiting::kReady) {
      on_ready(p, record);
    } else {
      on_hello(p, record);
    }
  }

  void on_proof(Pending& p, std::span<const std::byte> record) {
    std::string why;
    Proof proof;
    if (!decode(record, proof, why)) {
      drop(p, fmt::format("{} sent a malformed proof: {}", who(p), why));
      return;
    }
    std::optional<RefuseReason> refusal;
    if (!macs_equal(proof.mac,
                    receiver_proof(token_, p.sender_nonce, proof.receiver_nonce, proof.rank))) {
      refusal = RefuseReason::kBadProof;
    } else if (hello_ != nullptr) {
      // The rank is checked once the hello says what the receiver was set up for.
    } else if (proof.rank < 1 || proof.rank > static_cast<std::uint32_t>(receivers_)) {
      refusal = RefuseReason::kBadRank;
    } else if (taken_[proof.rank]) {
      refusal = RefuseReason::kRankTaken;
    }
    if (refusal) {
      (void)write_all(p.fd.get(), encode(Refuse{*refusal}), -1, p.deadline);
      drop(p, fmt::format("refused {} asking for rank {}: {}", who(p), proof.rank,
                          to_string(*refusal)));
      return;
    }
    p.proved = proof.rank;
    // Without a hello the rank is held from here, so that a second peer proving it is refused.
    if (hello_ == nullptr) {
      p.rank = proof.rank;
      taken_[p.rank] = true;
    }
    const Accept accept{sender_proof(token_, p.sender_nonce, proof.receiver_nonce, proof.rank)};
    if (const Io io = write_all(p.fd.get(), encode(accept), -1, p.deadline); io != Io::kOk) {
      drop(p, fmt::format("sending this sender's proof to {} (rank {}): {}", who(p),
                          shown(p.proved), describe(io, errno)));
      return;
    }
    p.awaiting = Awaiting::kReady;
  }

  void on_ready(Pending& p, std::span<const std::byte> record) {
    std::string why;
    if (!decode_ready(record, why)) {
      drop(p, fmt::format("{} (rank {}) did not accept this sender's proof: {}", who(p),
                          shown(p.proved), why));
      return;
    }
    if (hello_ != nullptr) {
      p.awaiting = Awaiting::kHello;
      return;
    }
    if (const Io io = write_with_fd(p.fd.get(), setup_record_, shared_fd_, p.deadline);
        io != Io::kOk) {
      drop(p, fmt::format("sending the staging memory to {} (rank {}): {}", who(p), p.rank,
                          describe(io, errno)));
      return;
    }
    peers_[p.rank - 1] = std::move(p.fd);
    ++admitted_;
  }

  void on_hello(Pending& p, std::span<const std::byte> record) {
    const auto in_range = [this](std::uint32_t seat) {
      return seat >= 1 && seat <= static_cast<std::uint32_t>(receivers_);
    };
    const HelloAnswer answer = hello_->answer(
        p.proved, record, [&](std::uint32_t seat) { return in_range(seat) && taken_[seat]; });
    if (!answer.admit || !in_range(answer.seat) || taken_[answer.seat]) {
      if (!answer.reply.empty()) (void)write_all(p.fd.get(), answer.reply, -1, p.deadline);
      drop(p, answer.admit ? fmt::format("{}: seat {} admitted by its hello but outside 1..{} or "
                                         "taken (a bug: please report it)",
                                         who(p), answer.seat, receivers_)
                           : fmt::format("refused {}: {}", who(p), answer.why));
      return;
    }
    if (const Io io = write_with_fd(p.fd.get(), answer.reply, shared_fd_, p.deadline);
        io != Io::kOk) {
      drop(p, fmt::format("sending the staging memory to {} (rank {}): {}", who(p),
                          shown(p.proved), describe(io, errno)));
      return;
    }
    p.rank = answer.seat;
    taken_[p.rank] = true;
    peers_[p.rank - 1] = std::move(p.fd);
    ++admitted_;
  }

  Error timed_out() const {
    std::vector<std::string> missing;
    for (int r = 1; r <= receivers_; ++r) {
      if (peers_[static_cast<std::size_t>(r - 1)]) continue;
      if (missing.size() == kFailuresNamed) {
        missing.push_back("...");
        break;
      }
      missing.push_back(seat_name(static_cast<std::size_t>(r)));
    }
    std::vector<std::string> peers;
    const auto now = Clock::now();
    for (const Pending& p : pending_) {
      peers.push_back(fmt::format("{} connected {} ms ago and has not sent {}{}", who(p),
                                  ms_between(p.connected, now), name_of(p.awaiting),
                                  p.proved != 0 ? fmt::format(" (it proved rank {})",
                                                              shown(p.proved))
                                                : ""));
    }
    if (failures_forgotten_ > 0) {
      peers.push_back(fmt::format("{} earlier failed peers not listed", failures_forgotten_));
    }
    peers.insert(peers.end(), failures_.begin(), failures_.end());
    const std::string about_peers =
        peers.empty() ? std::string(
                            "no other peer connected: check that every engine connects to "
                            "this path with its own rank")
                      : fmt::format(
                            "peers that connected and did not finish: {}. A pid here that "
                            "is none of your engines is another process of this user "
                            "holding a connection to the socket",
                            fmt::join(peers, "; "));
    return Error(ErrorCode::kTimeout,
                 fmt::format("same-host serve on '{}': {} of {} {} connected within {} ms; "
                             "rank(s) {} not admitted; {}",
                             path_, admitted_, receivers_,
                             hello_ != nullptr ? hello_->receivers : std::string("receivers"),
                             config_.connect_timeout.count(), fmt::join(missing, ", "),
                             about_peers));
  }

  const AdmissionHello* const hello_;  // null: none
  const int listener_;
  const std::string& path_;
  const std::string_view token_;
  const int receivers_;
  const std::span<const std::byte> setup_record_;
  const int shared_fd_;
  const SameHostConfig& config_;
  std::vector<bool> taken_;  // by rank: admitted or proved by one under way (a hello: admitted)
  std::vector<Fd> peers_;    // rank r at r-1
  int admitted_ = 0;
  std::vector<Pending> pending_;
  std::deque<std::string> failures_;  // the latest kFailuresNamed
  std::size_t failures_forgotten_ = 0;
};

}  // namespace

std::vector<Fd> admit_receivers(int listener, const std::string& path, std::string_view token,
                                int receivers, std::span<const std::byte> setup_record,
                                int shared_fd, const SameHostConfig& config,
                                const AdmissionHello* hello) {
  return Admission(listener, path, token, receivers, setup_record, shared_fd, config, hello).run();
}

}  // namespace shadowsync::same_host
