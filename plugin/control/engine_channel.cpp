// The engine's end of the control channel: which connection is the trainer, what is acked and
// answered to it, and which of its frames become requests (run by EngineRequests on the worker
// thread). The sockets, the poll loop, the framing and the deadlines are ChannelLoop's; the
// handshake is Handshake's.
#include "shadowsync/control_channel.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "control/channel_loop.h"
#include "control/control_connection.h"
#include "control/control_frame.h"
#include "control/control_handshake.h"
#include "control/engine_requests.h"
#include "core/thread_affinity.h"
#include "shadowsync/error.h"

namespace shadowsync {

using control::Clock;
using control::Connection;
using control::Fd;
using control::Handshake;
using control::Link;
using control::LinkFailure;

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

std::span<const std::byte> as_bytes(const WakeRecord& record) {
  return std::as_bytes(std::span<const WakeRecord, 1>(&record, 1));
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

struct EngineChannel::Impl final : control::LoopHandler {
  struct Peer : Link {
    // Until the trainer's hello was accepted; then null and the peer is the trainer.
    std::unique_ptr<Handshake> handshake;
    std::uint64_t generation = 0;  // once it is the trainer: which trainer connection this is
    bool closed = false;
  };

  struct Outbound {
    std::uint64_t generation = 0;
    ControlMessage message;
  };

  Impl(Receiver& r, TransportFactory f, EngineChannelConfig c)
      : receiver(r),
        factory(std::move(f)),
        config(std::move(c)),
        loop(config.control, "the control channel stops") {}
  ~Impl() override { stop(); }  // also when start() threw after a thread had started

  Receiver& receiver;
  TransportFactory factory;
  EngineChannelConfig config;
  control::ChannelLoop loop;
  std::string token;
  std::uint16_t port = 0;
  control::EngineCounters counters;
  std::atomic<std::uint64_t> reports_dropped{0};

  // I/O thread only.
  std::vector<std::unique_ptr<Peer>> peers;
  Peer* active = nullptr;
  std::uint64_t next_generation = 0;
  std::uint64_t applied_version = 0;
  std::uint64_t applied_step = 0;
  Clock::time_point refusal_log_resume{};
  std::uint64_t refusals_unlogged = 0;
  std::vector<std::byte> wake_tail;  // a partial record (never expected; kept for safety)

  // The generation of the authenticated trainer (0: none): requests and answers of a trainer
  // that is gone are dropped.
  std::atomic<std::uint64_t> active_generation{0};

  // Answers from the worker thread, sent by the I/O thread.
  std::mutex outbound_mutex;
  std::deque<Outbound> outbound;

  // Both threads; created by start(), the I/O thread last.
  std::unique_ptr<control::EngineRequests> requests;
  std::thread io_thread;

  void log(const std::string& line) const { control::log_line(config.control, line); }
  template <typename F>
  void count(F&& update) {
    counters.update(std::forward<F>(update));
  }

  void start();
  void stop();
  void wake() noexcept { loop.notify(as_bytes(WakeRecord{kWake, 0, 0})); }
  void post(std::uint64_t generation, ControlMessage message);

  // I/O thread: the loop's callbacks.
  void collect(std::vector<Link*>& links) override;
  bool is_open(const Link& link) const override { return !static_cast<const Peer&>(link).closed; }
  void on_accept(Fd fd, const std::string& peer_name) override;
  void on_wake(std::span<const std::byte> bytes) override;
  void on_message(Link& link, ControlMessage& message) override;
  void on_failure(Link& link, LinkFailure failure, const std::string& why) override;
  void after_reads() override { drain_outbound(); }
  void end_turn() override;

  // I/O thread.
  void run_io();
  void drain_outbound();
  void on_handshake(Peer& peer, const ControlMessage& message);
  void on_hello(Peer& peer, const TrainerHelloMessage& hello);
  void on_request(Peer& peer, ControlMessage& message);
  bool send(Peer& peer, const ControlMessage& message);
  void close_peer(Peer& peer, const std::string& why);
  EngineHelloMessage make_hello() const;
  // Peers still in their handshake that have not proved the token: they hold the pending slots.
  static bool unproved(const Peer& peer);
  std::size_t pending_count() const;
  Peer* oldest_unproved() const;
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
  loop.listen(control::listen_tcp(config.bind_address, config.port, port));
  requests = std::make_unique<control::EngineRequests>(
      receiver, factory, config.control, active_generation, counters,
      [this](std::uint64_t generation, ControlMessage answer) {
        post(generation, std::move(answer));
      });
  io_thread = start_library_thread([this] { run_io(); });
}

std::uint16_t EngineChannel::port() const { return impl_->port; }

void EngineChannel::report_applied(std::uint64_t version, std::uint64_t engine_step) noexcept {
  if (!impl_->loop.notify(as_bytes(WakeRecord{kApplied, version, engine_step}))) {
    impl_->reports_dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void EngineChannel::report_failed(std::uint64_t version, ErrorCode code, std::string_view message) {
  UpdateErrorMessage error;
  error.version = version;
  error.code = static_cast<std::uint32_t>(code);
  error.message = clip_control_text(std::string(message));
  impl_->post(impl_->active_generation.load(), std::move(error));
}

EngineChannelStats EngineChannel::stats() const {
  EngineChannelStats copy = impl_->counters.snapshot();
  copy.reports_dropped = impl_->reports_dropped.load(std::memory_order_relaxed);
  return copy;
}

void EngineChannel::shutdown() { impl_->stop(); }

void EngineChannel::Impl::stop() {
  if (requests) requests->close();  // no request starts from now on
  loop.stop(as_bytes(WakeRecord{kWake, 0, 0}));
  if (io_thread.joinable()) io_thread.join();
  if (requests) {
    requests->join();  // a transport factory still running is waited for
    // No trainer can reach this engine any more, and the one told goodbye tears its end down:
    // so does the receiver (TrainerLeft's release, which close() may have dropped).
    receiver.release_transport("the engine's control channel shut down");
    // Once only: a second stop() (the destructor's) must not release a transport the
    // application installed with replace_transport after the first.
    requests.reset();
  }
}

void EngineChannel::Impl::post(std::uint64_t generation, ControlMessage message) {
  {
    std::lock_guard lock(outbound_mutex);
    outbound.push_back({generation, std::move(message)});
  }
  wake();
}

// --- I/O thread ----------------------------------------------------------------------------------

void EngineChannel::Impl::run_io() {
  loop.run(*this);
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

void EngineChannel::Impl::collect(std::vector<Link*>& links) {
  for (const auto& peer : peers) {
    if (!peer->closed) links.push_back(peer.get());
  }
}

void EngineChannel::Impl::end_turn() {
  std::erase_if(peers, [](const auto& peer) { return peer->closed; });
  count([&](EngineChannelStats& s) { s.connections_open = peers.size(); });
}

void EngineChannel::Impl::on_accept(Fd fd, const std::string& peer_name) {
  if (Peer* oldest = oldest_unproved();
      oldest != nullptr && pending_count() >= config.max_pending_connections) {
    // Every slot is held by a peer that has not proved the token: the oldest gives way, so that
    // silent connections cannot lock a trainer out (a trainer proves the token within a round
    // trip of connecting; a silent peer would hold its slot for the whole handshake timeout).
    count([](EngineChannelStats& s) { ++s.connections_refused; });
    // A flood of connections must not flood the log: one line per second at most.
    ++refusals_unlogged;
    if (Clock::now() >= refusal_log_resume) {
      log(
          fmt::format("peer {}: closed to make room for {}: {} connections had not proved the "
                      "token ({} closed so since the last such line)",
                      oldest->connection->peer(), peer_name, config.max_pending_connections,
                      refusals_unlogged));
      refusals_unlogged = 0;
      refusal_log_resume = Clock::now() + std::chrono::seconds(1);
    }
    oldest->closed = true;  // quietly: the line above says why
    oldest->connection->shutdown();
  }
  count([](EngineChannelStats& s) { ++s.connections_accepted; });
  control::tune_socket(fd.get());
  auto peer = std::make_unique<Peer>();
  peer->connection = std::make_unique<Connection>(std::move(fd), peer_name, control::Role::kEngine);
  peer->handshake_deadline = Clock::now() + config.control.handshake_timeout;
  try {
    peer->handshake = std::make_unique<Handshake>(*peer->connection, token,
                                                  [this] { return ControlMessage(make_hello()); });
  } catch (const Error& e) {
    log(fmt::format("peer {}: {}", peer_name, e.what()));
    return;
  }
  Peer& added = *peers.emplace_back(std::move(peer));
  try {
    added.handshake->start(Clock::now() + config.control.send_timeout);
  } catch (const Error& e) {
    close_peer(added, e.what());
  }
}

bool EngineChannel::Impl::unproved(const Peer& peer) {
  return !peer.closed && peer.handshake != nullptr && !peer.handshake->peer_proved();
}

std::size_t EngineChannel::Impl::pending_count() const {
  return static_cast<std::size_t>(
      std::ranges::count_if(peers, [](const auto& peer) { return unproved(*peer); }));
}

EngineChannel::Impl::Peer* EngineChannel::Impl::oldest_unproved() const {
  // `peers` is in accept order (end_turn erases in place).
  for (const auto& peer : peers) {
    if (unproved(*peer)) return peer.get();
  }
  return nullptr;
}

void EngineChannel::Impl::on_wake(std::span<const std::byte> bytes) {
  wake_tail.insert(wake_tail.end(), bytes.begin(), bytes.end());
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

void EngineChannel::Impl::on_failure(Link& link, LinkFailure failure, const std::string& why) {
  if (failure == LinkFailure::kProtocol) count([](EngineChannelStats& s) { ++s.protocol_errors; });
  close_peer(static_cast<Peer&>(link), why);
}

void EngineChannel::Impl::on_message(Link& link, ControlMessage& message) {
  Peer& peer = static_cast<Peer&>(link);
  if (peer.handshake != nullptr) {
    on_handshake(peer, message);
  } else if (std::holds_alternative<TrainerHelloMessage>(message)) {
    // The handshake frames are untagged, so only a second hello can come out of place here.
    count([](EngineChannelStats& s) { ++s.protocol_errors; });
    close_peer(peer, fmt::format("unexpected {} frame at this point of the protocol",
                                 to_string(frame_type_of(message))));
  } else {
    on_request(peer, message);
  }
}

void EngineChannel::Impl::on_handshake(Peer& peer, const ControlMessage& message) {
  Handshake::Step step;
  try {
    step = peer.handshake->on_message(message, Clock::now() + config.control.send_timeout);
  } catch (const Error& e) {
    close_peer(peer, e.what());
    return;
  }
  switch (step) {
    case Handshake::Step::kContinue:
      return;
    case Handshake::Step::kPeerHello:
      on_hello(peer, std::get<TrainerHelloMessage>(message));
      return;
    case Handshake::Step::kRefused:
      count([](EngineChannelStats& s) { ++s.authentication_failures; });
      close_peer(peer,
                 "authentication failed (wrong token, or a replayed handshake); nothing it "
                 "sent was used");
      return;
    case Handshake::Step::kUnexpected:
      count([](EngineChannelStats& s) { ++s.protocol_errors; });
      close_peer(peer, fmt::format("unexpected {} frame at this point of the protocol",
                                   to_string(frame_type_of(message))));
      return;
  }
}

void EngineChannel::Impl::on_hello(Peer& peer, const TrainerHelloMessage& hello) {
  const std::string mismatch = layout_mismatch(hello, receiver.layout());
  if (!mismatch.empty()) {
    count([](EngineChannelStats& s) { ++s.protocol_errors; });
    send(peer, GoodbyeMessage{clip_control_text("layout mismatch: " + mismatch)});
    close_peer(peer, fmt::format("trainer's layout differs: {}", mismatch));
    return;
  }
  if (active != nullptr) {
    // The newest authenticated trainer wins: the old connection may be half dead (its host gone
    // without a FIN), and only a peer holding the token gets this far.
    // A failed send closes the peer itself (and clears `active`): hold on to it.
    Peer& replaced = *active;
    const std::string why =
        fmt::format("replaced by a newer trainer connection from {}", peer.connection->peer());
    send(replaced, GoodbyeMessage{why});
    close_peer(replaced, why);  // a no-op if the send closed it
  }
  peer.handshake->accept(Clock::now() + config.control.send_timeout);  // the engine sends nothing
  peer.handshake.reset();
  peer.handshake_deadline = Clock::time_point::max();
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
  if (auto* goodbye = std::get_if<GoodbyeMessage>(&message)) {
    close_peer(peer, fmt::format("said goodbye ({})", goodbye->reason));
  } else if (auto* rendezvous = std::get_if<RendezvousMessage>(&message)) {
    requests->push(peer.generation, *rendezvous);
  } else if (auto* header = std::get_if<UpdateHeaderMessage>(&message)) {
    requests->push(peer.generation, std::move(header->header));
  } else if (auto* abort = std::get_if<AbortMessage>(&message)) {
    requests->push(peer.generation, std::move(*abort));
  }
  // Connection::next lets through only frames a trainer sends: nothing else reaches here.
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
    // Its transport goes with it: NCCL's teardown waits for both ends (receiver.h).
    requests->push(peer.generation, control::TrainerLeft{fmt::format(
                                        "trainer {} left: {}", peer.connection->peer(), why)});
    log(
        fmt::format("trainer {} disconnected: {}; the engine keeps serving version {} and waits "
                    "for a trainer",
                    peer.connection->peer(), why, applied_version));
  } else {
    log(fmt::format("peer {} disconnected: {}", peer.connection->peer(), why));
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

}  // namespace shadowsync
