#include "shadowsync/engine_channel.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <variant>
#include <vector>

#include "control/control_auth.h"
#include "control/control_connection.h"
#include "shadowsync/error.h"

namespace shadowsync {

using control::Clock;
using control::Connection;
using control::Fd;

namespace {

// A record on the wake-up pipe. Written whole (24 bytes < PIPE_BUF, so a write is atomic and a
// non-blocking write either writes all of it or nothing); read back whole.
struct WakeRecord {
  std::uint64_t kind = 0;  // kWake or kApplied
  std::uint64_t version = 0;
  std::uint64_t step = 0;
};
constexpr std::uint64_t kWake = 1;     // look at the outbound queue or the stop flag
constexpr std::uint64_t kApplied = 2;  // report_applied(version, step)

// A failed accept (out of file descriptors) leaves the listener readable: back off instead of
// spinning.
constexpr auto kAcceptBackoff = std::chrono::milliseconds(100);

std::string clip(std::string text) {
  if (text.size() > kMaxControlTextBytes) {
    text.resize(kMaxControlTextBytes - 3);
    text += "...";
  }
  return text;
}

std::string layout_mismatch(const TrainerHelloMessage& hello, const Layout& layout) {
  if (hello.protocol_version != kProtocolVersion) {
    return fmt::format("protocol version {} differs from the engine's {}", hello.protocol_version,
                       kProtocolVersion);
  }
  if (hello.layout_fingerprint != layout.fingerprint()) {
    return fmt::format("layout fingerprint {:#018x} differs from the engine's {:#018x}",
                       hello.layout_fingerprint, layout.fingerprint());
  }
  if (hello.groups.size() != layout.groups().size()) {
    return fmt::format("{} groups, the engine's layout has {}", hello.groups.size(),
                       layout.groups().size());
  }
  for (std::size_t g = 0; g < hello.groups.size(); ++g) {
    const GroupLayout& mine = layout.groups()[g];
    if (hello.groups[g].name != mine.name() ||
        hello.groups[g].bucket_count != mine.bucket_count()) {
      return fmt::format("group {} is '{}' with {} buckets, the engine's is '{}' with {}", g,
                         hello.groups[g].name, hello.groups[g].bucket_count, mine.name(),
                         mine.bucket_count());
    }
  }
  return {};
}

}  // namespace

struct EngineChannel::Impl {
  enum class State { kAwaitProof, kAwaitHello, kActive };

  struct Peer {
    std::unique_ptr<Connection> connection;
    State state = State::kAwaitProof;
    Clock::time_point handshake_deadline;
    ControlNonce engine_nonce{};
    std::uint64_t generation = 0;  // kActive: which trainer connection this is
    bool closed = false;
  };

  // What the trainer asked for, run by the worker thread in arrival order.
  struct Work {
    std::uint64_t generation = 0;
    std::variant<RendezvousMessage, UpdateHeader, AbortMessage> request;
  };
  struct Outbound {
    std::uint64_t generation = 0;
    ControlMessage message;
  };

  Impl(Receiver& r, TransportFactory f, EngineChannelConfig c)
      : receiver(r), factory(std::move(f)), config(std::move(c)) {}
  ~Impl() { stop(); }  // also when start() threw after a thread had started

  Receiver& receiver;
  TransportFactory factory;
  EngineChannelConfig config;
  std::string token;
  Fd listener;
  std::uint16_t port = 0;
  Fd wake_read;
  Fd wake_write;
  std::atomic<bool> stopping{false};
  std::thread io_thread;
  std::thread worker_thread;

  mutable std::mutex stats_mutex;
  EngineChannelStats stats;
  std::atomic<std::uint64_t> reports_dropped{0};

  // I/O thread only.
  std::vector<std::unique_ptr<Peer>> peers;
  Peer* active = nullptr;
  std::uint64_t next_generation = 0;
  std::uint64_t applied_version = 0;
  std::uint64_t applied_step = 0;
  Clock::time_point accept_resume{};
  Clock::time_point refusal_log_resume{};
  std::uint64_t refusals_unlogged = 0;
  std::vector<std::byte> wake_tail;  // a partial record (never expected; kept for safety)

  // The generation of the authenticated trainer (0: none): work of a trainer that is gone is
  // dropped.
  std::atomic<std::uint64_t> active_generation{0};

  std::mutex work_mutex;
  std::condition_variable work_cv;
  std::deque<Work> work;

  std::mutex outbound_mutex;
  std::deque<Outbound> outbound;

  void log(const std::string& line) const {
    if (config.control.log) {
      config.control.log(line);
    } else {
      std::fprintf(stderr, "shadowsync control: %s\n", line.c_str());
    }
  }
  template <typename F>
  void count(F&& update) {
    std::lock_guard lock(stats_mutex);
    update(stats);
  }

  void start();
  void stop();
  void wake() noexcept;
  void post(std::uint64_t generation, ControlMessage message);

  // I/O thread.
  void io_loop();
  void accept_all();
  void drain_wake_pipe();
  void drain_outbound();
  void on_readable(Peer& peer);
  void on_message(Peer& peer, ControlMessage& message);
  void on_proof(Peer& peer, const ClientProofMessage& proof);
  void on_hello(Peer& peer, const TrainerHelloMessage& hello);
  void on_request(Peer& peer, ControlMessage& message);
  bool send(Peer& peer, const ControlMessage& message);
  void close_peer(Peer& peer, const std::string& why);
  void check_deadlines();
  EngineHelloMessage make_hello() const;
  std::size_t pending_count() const;

  // Worker thread.
  void worker_loop();
  void run(Work& item);
};

EngineChannel::EngineChannel(Receiver& receiver, TransportFactory factory,
                             EngineChannelConfig config)
    : impl_(std::make_unique<Impl>(receiver, std::move(factory), std::move(config))) {
  impl_->start();
}

EngineChannel::~EngineChannel() { shutdown(); }

void EngineChannel::Impl::start() {
  if (!factory) {
    throw Error(ErrorCode::kInvalidArgument, "engine channel: the transport factory is empty");
  }
  if (config.max_pending_connections == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                "engine channel: max_pending_connections must be at least 1");
  }
  token = resolve_control_token(config.control.token);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr = control::parse_ipv4(config.bind_address, "bind address");
  address.sin_port = htons(config.port);
  const std::string where = fmt::format("{}:{}", config.bind_address, config.port);

  listener.reset(::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listener) {
    throw Error(ErrorCode::kTransport,
                fmt::format("engine channel: socket failed: {}", std::strerror(errno)));
  }
  const int one = 1;
  ::setsockopt(listener.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(listener.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
      ::listen(listener.get(), 64) != 0) {
    throw Error(ErrorCode::kTransport, fmt::format("engine channel: cannot listen on {}: {}", where,
                                                   std::strerror(errno)));
  }
  socklen_t length = sizeof address;
  ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address), &length);
  port = ntohs(address.sin_port);
  control::make_wake_pipe(wake_read, wake_write);

  io_thread = std::thread([this] { io_loop(); });
  worker_thread = std::thread([this] { worker_loop(); });
}

std::uint16_t EngineChannel::port() const { return impl_->port; }

void EngineChannel::report_applied(std::uint64_t version, std::uint64_t engine_step) noexcept {
  const WakeRecord record{kApplied, version, engine_step};
  if (::write(impl_->wake_write.get(), &record, sizeof record) != sizeof record) {
    impl_->reports_dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void EngineChannel::report_failed(std::uint64_t version, ErrorCode code, std::string_view message) {
  UpdateErrorMessage error;
  error.version = version;
  error.code = static_cast<std::uint32_t>(code);
  error.message = clip(std::string(message));
  impl_->post(impl_->active_generation.load(), std::move(error));
}

EngineChannelStats EngineChannel::stats() const {
  std::lock_guard lock(impl_->stats_mutex);
  EngineChannelStats copy = impl_->stats;
  copy.reports_dropped = impl_->reports_dropped.load(std::memory_order_relaxed);
  return copy;
}

void EngineChannel::shutdown() { impl_->stop(); }

void EngineChannel::Impl::stop() {
  stopping.store(true);
  if (wake_write) wake();
  if (io_thread.joinable()) io_thread.join();
  {
    std::lock_guard lock(work_mutex);
    work.clear();
  }
  work_cv.notify_all();
  if (worker_thread.joinable()) worker_thread.join();
}

void EngineChannel::Impl::wake() noexcept {
  const WakeRecord record{kWake, 0, 0};
  // A full pipe already wakes the I/O thread: a failed write loses nothing.
  [[maybe_unused]] const ssize_t n = ::write(wake_write.get(), &record, sizeof record);
}

void EngineChannel::Impl::post(std::uint64_t generation, ControlMessage message) {
  {
    std::lock_guard lock(outbound_mutex);
    outbound.push_back({generation, std::move(message)});
  }
  wake();
}

// --- I/O thread ----------------------------------------------------------------------------------

void EngineChannel::Impl::io_loop() {
  std::vector<pollfd> fds;
  while (!stopping.load()) {
    fds.clear();
    fds.push_back({wake_read.get(), POLLIN, 0});
    const bool listening = Clock::now() >= accept_resume;
    fds.push_back({listening ? listener.get() : -1, POLLIN, 0});
    for (const auto& peer : peers) fds.push_back({peer->connection->fd(), POLLIN, 0});

    // Sleep until the nearest read deadline (or a wake-up).
    Clock::time_point next = Clock::now() + std::chrono::seconds(60);
    if (!listening) next = std::min(next, accept_resume);
    for (const auto& peer : peers) {
      if (peer->state != State::kActive) next = std::min(next, peer->handshake_deadline);
      if (peer->connection->has_partial()) {
        next = std::min(next, peer->connection->partial_since() + config.control.frame_timeout);
      }
    }
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(next - Clock::now());
    const int timeout = static_cast<int>(std::clamp<long long>(wait.count(), 0, 60'000));
    const int ready = ::poll(fds.data(), fds.size(), timeout);
    if (ready < 0 && errno != EINTR) {
      log(fmt::format("poll failed: {}; the control channel stops", std::strerror(errno)));
      break;
    }
    if (ready > 0) {
      if (fds[0].revents != 0) drain_wake_pipe();
      if (fds[1].revents != 0) accept_all();
      // Peers accepted just now come after the polled ones.
      const std::size_t polled = fds.size() - 2;
      for (std::size_t i = 0; i < polled; ++i) {
        if (fds[i + 2].revents != 0 && !peers[i]->closed) on_readable(*peers[i]);
      }
    }
    drain_outbound();
    check_deadlines();
    std::erase_if(peers, [](const auto& peer) { return peer->closed; });
    count([&](EngineChannelStats& s) { s.connections_open = peers.size(); });
  }
  // Orderly shutdown: the trainer learns why, then every connection closes.
  if (active != nullptr) {
    send(*active, GoodbyeMessage{"the engine's control channel is shutting down"});
  }
  active = nullptr;
  active_generation.store(0);
  peers.clear();
  count([](EngineChannelStats& s) {
    s.trainer_connected = false;
    s.connections_open = 0;
  });
}

void EngineChannel::Impl::accept_all() {
  for (;;) {
    sockaddr_in address{};
    socklen_t length = sizeof address;
    Fd fd(::accept4(listener.get(), reinterpret_cast<sockaddr*>(&address), &length,
                    SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        log(fmt::format("accept failed: {}; retrying in {} ms", std::strerror(errno),
                        kAcceptBackoff.count()));
        accept_resume = Clock::now() + kAcceptBackoff;
      }
      return;
    }
    const std::string peer_name = control::format_address(address);
    if (pending_count() >= config.max_pending_connections) {
      count([](EngineChannelStats& s) {
        ++s.connections_accepted;
        ++s.connections_refused;
      });
      // A flood of connections must not flood the log: one line per second at most.
      ++refusals_unlogged;
      if (Clock::now() >= refusal_log_resume) {
        log(
            fmt::format("peer {}: refused, {} connections are already in their handshake ({} "
                        "refused since the last such line)",
                        peer_name, config.max_pending_connections, refusals_unlogged));
        refusals_unlogged = 0;
        refusal_log_resume = Clock::now() + std::chrono::seconds(1);
      }
      continue;  // fd closes here
    }
    count([](EngineChannelStats& s) { ++s.connections_accepted; });
    control::tune_socket(fd.get());
    auto peer = std::make_unique<Peer>();
    peer->connection =
        std::make_unique<Connection>(std::move(fd), peer_name, control::Role::kEngine);
    peer->handshake_deadline = Clock::now() + config.control.handshake_timeout;
    try {
      peer->engine_nonce = control::make_nonce();
    } catch (const Error& e) {
      log(fmt::format("peer {}: {}", peer_name, e.what()));
      continue;
    }
    Peer& added = *peers.emplace_back(std::move(peer));
    send(added, ChallengeMessage{added.engine_nonce});
  }
}

std::size_t EngineChannel::Impl::pending_count() const {
  std::size_t n = 0;
  for (const auto& peer : peers) n += (!peer->closed && peer->state != State::kActive) ? 1 : 0;
  return n;
}

void EngineChannel::Impl::drain_wake_pipe() {
  std::byte buffer[sizeof(WakeRecord) * 64];
  for (;;) {
    const ssize_t n = ::read(wake_read.get(), buffer, sizeof buffer);
    if (n <= 0) break;  // EAGAIN: drained
    wake_tail.insert(wake_tail.end(), buffer, buffer + n);
    std::size_t offset = 0;
    bool applied = false;
    for (; offset + sizeof(WakeRecord) <= wake_tail.size(); offset += sizeof(WakeRecord)) {
      WakeRecord record;
      std::memcpy(&record, wake_tail.data() + offset, sizeof record);
      // Reports only move forward: a late report of an older version does not roll back.
      if (record.kind == kApplied && record.version >= applied_version) {
        applied_version = record.version;
        applied_step = record.step;
        applied = true;
      }
    }
    wake_tail.erase(wake_tail.begin(), wake_tail.begin() + static_cast<std::ptrdiff_t>(offset));
    // Several reports in one read: the trainer needs the latest (acks are cumulative).
    if (applied && active != nullptr && send(*active, AckMessage{applied_version, applied_step})) {
      count([](EngineChannelStats& s) { ++s.acks_sent; });
    }
  }
}

void EngineChannel::Impl::drain_outbound() {
  std::deque<Outbound> items;
  {
    std::lock_guard lock(outbound_mutex);
    items.swap(outbound);
  }
  for (auto& item : items) {
    // Answers meant for a trainer that has gone since are dropped; the next one starts over.
    if (active != nullptr && item.generation == active->generation) send(*active, item.message);
  }
}

void EngineChannel::Impl::on_readable(Peer& peer) {
  std::string why;
  if (!peer.connection->read_available(why)) {
    close_peer(peer, why);
    return;
  }
  while (!peer.closed) {
    ControlMessage message;
    switch (peer.connection->next(message, why)) {
      case Connection::Next::kNeedMore:
        return;
      case Connection::Next::kBad:
        count([](EngineChannelStats& s) { ++s.protocol_errors; });
        close_peer(peer, why);
        return;
      case Connection::Next::kMessage:
        on_message(peer, message);
        break;
    }
  }
}

void EngineChannel::Impl::on_message(Peer& peer, ControlMessage& message) {
  const FrameType type = frame_type_of(message);
  switch (peer.state) {
    case State::kAwaitProof:
      if (auto* proof = std::get_if<ClientProofMessage>(&message)) {
        on_proof(peer, *proof);
        return;
      }
      break;
    case State::kAwaitHello:
      if (auto* hello = std::get_if<TrainerHelloMessage>(&message)) {
        on_hello(peer, *hello);
        return;
      }
      break;
    case State::kActive:
      if (type != FrameType::kClientProof && type != FrameType::kTrainerHello) {
        on_request(peer, message);
        return;
      }
      break;
  }
  count([](EngineChannelStats& s) { ++s.protocol_errors; });
  close_peer(peer,
             fmt::format("unexpected {} frame at this point of the protocol", to_string(type)));
}

void EngineChannel::Impl::on_proof(Peer& peer, const ClientProofMessage& proof) {
  const ControlMac expected = control::trainer_proof(token, peer.engine_nonce, proof.trainer_nonce);
  if (!control::macs_equal(expected, proof.proof)) {
    count([](EngineChannelStats& s) { ++s.authentication_failures; });
    close_peer(peer,
               "authentication failed (wrong token, or a replayed handshake); nothing it "
               "sent was used");
    return;
  }
  const ServerProofMessage reply{
      control::engine_proof(token, peer.engine_nonce, proof.trainer_nonce)};
  if (!send(peer, reply)) return;
  peer.connection->start_session(
      control::derive_session_keys(token, peer.engine_nonce, proof.trainer_nonce));
  peer.state = State::kAwaitHello;
  send(peer, make_hello());
}

void EngineChannel::Impl::on_hello(Peer& peer, const TrainerHelloMessage& hello) {
  const std::string mismatch = layout_mismatch(hello, receiver.layout());
  if (!mismatch.empty()) {
    count([](EngineChannelStats& s) { ++s.protocol_errors; });
    send(peer, GoodbyeMessage{clip("layout mismatch: " + mismatch)});
    close_peer(peer, fmt::format("trainer's layout differs: {}", mismatch));
    return;
  }
  if (active != nullptr) {
    // The newest authenticated trainer wins: the old connection may be half dead (its host gone
    // without a FIN), and only a peer holding the token gets this far.
    send(*active, GoodbyeMessage{fmt::format("replaced by a newer trainer connection from {}",
                                             peer.connection->peer())});
    close_peer(*active, fmt::format("replaced by a newer trainer connection from {}",
                                    peer.connection->peer()));
  }
  peer.state = State::kActive;
  peer.generation = ++next_generation;
  active = &peer;
  active_generation.store(peer.generation);
  count([](EngineChannelStats& s) {
    ++s.trainers_authenticated;
    s.trainer_connected = true;
  });
  log(fmt::format("trainer {} connected (live version {})", peer.connection->peer(),
                  applied_version));
}

void EngineChannel::Impl::on_request(Peer& peer, ControlMessage& message) {
  Work item;
  item.generation = peer.generation;
  if (auto* goodbye = std::get_if<GoodbyeMessage>(&message)) {
    close_peer(peer, fmt::format("said goodbye ({})", goodbye->reason));
    return;
  }
  if (auto* rendezvous = std::get_if<RendezvousMessage>(&message)) {
    item.request = *rendezvous;
  } else if (auto* header = std::get_if<UpdateHeaderMessage>(&message)) {
    item.request = std::move(header->header);
  } else if (auto* abort = std::get_if<AbortMessage>(&message)) {
    item.request = std::move(*abort);
  } else {
    return;  // on_message let only these through
  }
  {
    std::lock_guard lock(work_mutex);
    work.push_back(std::move(item));
  }
  work_cv.notify_one();
}

bool EngineChannel::Impl::send(Peer& peer, const ControlMessage& message) {
  if (peer.closed) return false;
  try {
    peer.connection->send(message, Clock::now() + config.control.send_timeout);
    return true;
  } catch (const Error& e) {
    close_peer(peer, e.what());
    return false;
  }
}

void EngineChannel::Impl::close_peer(Peer& peer, const std::string& why) {
  if (peer.closed) return;
  peer.closed = true;
  peer.connection->shutdown();
  if (&peer == active) {
    active = nullptr;
    active_generation.store(0);
    count([](EngineChannelStats& s) { s.trainer_connected = false; });
    log(
        fmt::format("trainer {} disconnected: {}; the engine keeps serving version {} and waits "
                    "for a trainer",
                    peer.connection->peer(), why, applied_version));
  } else {
    log(fmt::format("peer {} disconnected: {}", peer.connection->peer(), why));
  }
}

void EngineChannel::Impl::check_deadlines() {
  const auto now = Clock::now();
  for (auto& peer : peers) {
    if (peer->closed) continue;
    if (peer->state != State::kActive && now >= peer->handshake_deadline) {
      count([](EngineChannelStats& s) { ++s.protocol_errors; });
      close_peer(*peer, fmt::format("handshake not completed within {} ms",
                                    config.control.handshake_timeout.count()));
    } else if (peer->connection->has_partial() &&
               now >= peer->connection->partial_since() + config.control.frame_timeout) {
      count([](EngineChannelStats& s) { ++s.protocol_errors; });
      close_peer(*peer, fmt::format("a frame was not completed within {} ms",
                                    config.control.frame_timeout.count()));
    }
  }
}

EngineHelloMessage EngineChannel::Impl::make_hello() const {
  const Layout& layout = receiver.layout();
  EngineHelloMessage hello;
  hello.rank = config.rank;
  hello.layout_fingerprint = layout.fingerprint();
  hello.last_accepted_version = receiver.stats().last_accepted_version;
  hello.applied_version = applied_version;
  hello.applied_step = applied_step;
  for (const GroupLayout& group : layout.groups()) {
    hello.groups.push_back({group.name(), group.bucket_count()});
  }
  return hello;
}

// --- worker thread -------------------------------------------------------------------------------

void EngineChannel::Impl::worker_loop() {
  for (;;) {
    Work item;
    {
      std::unique_lock lock(work_mutex);
      work_cv.wait(lock, [&] { return stopping.load() || !work.empty(); });
      if (stopping.load()) return;
      item = std::move(work.front());
      work.pop_front();
    }
    if (item.generation != active_generation.load()) continue;  // that trainer is gone
    run(item);
  }
}

void EngineChannel::Impl::run(Work& item) {
  if (auto* rendezvous = std::get_if<RendezvousMessage>(&item.request)) {
    RendezvousRequest request;
    std::memcpy(request.unique_id.bytes.data(), rendezvous->unique_id.data(), RendezvousId::kSize);
    request.rank = static_cast<int>(rendezvous->rank);  // < world_size <= 2^16: checked
    request.world_size = static_cast<int>(rendezvous->world_size);
    RendezvousResultMessage result;
    result.rendezvous_id = rendezvous->rendezvous_id;
    try {
      std::unique_ptr<Transport> transport = factory(request);
      if (!transport) throw Error(ErrorCode::kTransport, "the transport factory returned none");
      receiver.replace_transport(std::move(transport));
      result.ok = true;
      count([](EngineChannelStats& s) { ++s.rendezvous_done; });
    } catch (const std::exception& e) {
      result.error = clip(fmt::format("rendezvous as rank {} of {} failed: {}", request.rank,
                                      request.world_size, e.what()));
      count([](EngineChannelStats& s) { ++s.rendezvous_failed; });
      log(result.error);
    }
    post(item.generation, std::move(result));
  } else if (auto* header = std::get_if<UpdateHeader>(&item.request)) {
    try {
      receiver.begin_update(*header);
      count([](EngineChannelStats& s) { ++s.headers_accepted; });
    } catch (const std::exception& e) {
      // Nothing changed in the receiver: the trainer learns why.
      const auto* error = dynamic_cast<const Error*>(&e);
      UpdateErrorMessage refused;
      refused.version = header->version;
      refused.code = static_cast<std::uint32_t>(error ? error->code() : ErrorCode::kInternal);
      refused.message = clip(e.what());
      count([](EngineChannelStats& s) { ++s.headers_refused; });
      post(item.generation, std::move(refused));
    }
  } else if (auto* abort = std::get_if<AbortMessage>(&item.request)) {
    log(fmt::format("trainer aborts update {}: {}", abort->version, abort->reason));
    receiver.abort_update();
  }
}

}  // namespace shadowsync
