// The trainer's end of the control channel: the handshake with each engine in turn, then what
// each engine reports (acks, errors, rendezvous results) and what the trainer sends to all of
// them. The sockets, the poll loop, the framing and the deadlines are ChannelLoop's; the
// handshake is Handshake's.
#include "shadowsync/control_channel.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "control/channel_loop.h"
#include "control/control_connection.h"
#include "control/control_frame.h"
#include "control/control_handshake.h"
#include "core/thread_affinity.h"
#include "shadowsync/error.h"

namespace shadowsync {

using control::Clock;
using control::Connection;
using control::Handshake;
using control::Link;
using control::LinkFailure;

namespace {

// Errors kept per engine, so that waiting for an older version still finds its error after a
// newer one failed too.
constexpr std::size_t kErrorsKept = 64;

// `text` for a message: bytes outside printable ASCII as \xNN (a NUL would end the message).
std::string printable(std::string_view text) {
  std::string out;
  for (const char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += c;
    } else {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    }
  }
  return out;
}

std::string describe(const EngineStatus& status) {
  return fmt::format("engine rank {} ({}:{})", status.rank, status.address.host,
                     status.address.port);
}

// What a failed read while the handshake waited for `stage` may mean (`stage` is
// Handshake::awaiting()).
std::string_view failure_hint(std::string_view stage) {
  if (stage == "the challenge") {
    // Nothing was proved yet, so the token cannot be the reason.
    return "before the handshake started, so no token was checked yet: the engine may be busy "
           "with other peers that have not proved the token (max_pending_connections), or "
           "shutting down; try again";
  }
  if (stage == "the engine's proof") {
    return "a wrong token makes the engine close the connection here; so does a flood of newer "
           "connections that have not proved the token (max_pending_connections)";
  }
  return "after the token was proved both ways";
}

// The next frame of the handshake with `connection`, which waits for `stage`. A goodbye (the
// engine refusing this trainer) and a failed read both throw, naming the engine and the stage.
ControlMessage receive_handshake(Connection& connection, Clock::time_point deadline,
                                 std::string_view stage) {
  ControlMessage message;
  try {
    message = connection.receive(deadline);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("control channel: handshake with engine {} failed at {}: {} "
                                      "({}; the engine logs why)",
                                      connection.peer(), stage, e.what(), failure_hint(stage)));
  }
  if (auto* goodbye = std::get_if<GoodbyeMessage>(&message)) {
    throw Error(ErrorCode::kTransport,
                fmt::format("control channel: engine {} closed the connection at {}: {}",
                            connection.peer(), stage, goodbye->reason));
  }
  return message;
}

}  // namespace

struct TrainerChannel::Impl final : control::LoopHandler {
  struct Engine : Link {
    EngineStatus status;    // state_mutex
    std::mutex send_mutex;  // one writer at a time (sequence numbers)
    // state_mutex:
    std::uint64_t rendezvous_answered = 0;  // id of the last rendezvous the engine answered
    std::string rendezvous_error;
    std::map<std::uint64_t, std::pair<ErrorCode, std::string>> errors;
  };

  explicit Impl(TrainerChannelConfig c)
      : config(std::move(c)), loop(config.control, "the trainer channel stops reading") {}

  TrainerChannelConfig config;
  control::ChannelLoop loop;
  std::string token;
  TrainerHelloMessage hello;
  std::vector<std::unique_ptr<Engine>> engines;

  mutable std::mutex state_mutex;
  std::condition_variable state_cv;
  std::uint64_t rendezvous_id = 0;  // state_mutex

  std::thread io_thread;

  void log(const std::string& line) const { control::log_line(config.control, line); }

  // Calling thread, before the I/O thread starts.
  void handshake(Engine& engine, const Layout& layout);

  // I/O thread: the loop's callbacks.
  void collect(std::vector<Link*>& links) override;
  bool is_open(const Link& link) const override;
  void on_message(Link& link, ControlMessage& message) override;
  void on_failure(Link& link, LinkFailure failure, const std::string& why) override;

  // state_mutex held.
  void disconnect_locked(Engine& engine, const std::string& why);
  void disconnect(Engine& engine, const std::string& why) {
    std::lock_guard lock(state_mutex);
    disconnect_locked(engine, why);
  }
  // Sends to one engine; on failure marks it disconnected and returns the reason.
  std::optional<std::string> send(Engine& engine, const ControlMessage& message);
  // Sends `make(i)` to every engine; throws naming those it could not reach.
  template <typename Make>
  void send_all(const char* what, Make&& make);
};

TrainerChannel::TrainerChannel(const Layout& layout, TrainerChannelConfig config)
    : impl_(std::make_unique<Impl>(std::move(config))) {
  Impl& impl = *impl_;
  if (impl.config.engines.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "trainer channel: no engine addresses");
  }
  impl.token = resolve_control_token(impl.config.control.token);
  impl.hello.layout_fingerprint = layout.fingerprint();
  for (const GroupLayout& group : layout.groups()) {
    impl.hello.groups.push_back({group.name(), group.bucket_count()});
  }
  for (const EngineAddress& address : impl.config.engines) {
    auto engine = std::make_unique<Impl::Engine>();
    engine->status.address = address;
    impl.handshake(*engine, layout);
    impl.engines.push_back(std::move(engine));
  }
  impl.io_thread = start_library_thread([&impl] { impl.loop.run(impl); });
}

void TrainerChannel::Impl::handshake(Engine& engine, const Layout& layout) {
  const auto deadline = Clock::now() + config.connect_timeout;
  const EngineAddress& address = engine.status.address;
  engine.connection = std::make_unique<Connection>(
      control::connect_tcp(address.host, address.port, deadline),
      fmt::format("{}:{}", address.host, address.port), control::Role::kTrainer);
  Connection& connection = *engine.connection;
  Handshake handshake(connection, token, [this] { return ControlMessage(hello); });

  ControlMessage message;
  for (bool hello_arrived = false; !hello_arrived;) {
    const std::string_view stage = handshake.awaiting();
    message = receive_handshake(connection, deadline, stage);
    switch (handshake.on_message(message, deadline)) {
      case Handshake::Step::kContinue:
        break;
      case Handshake::Step::kPeerHello:
        hello_arrived = true;
        break;
      case Handshake::Step::kRefused:
        throw Error(ErrorCode::kTransport,
                    fmt::format("control channel: engine {} failed to prove it holds the token "
                                "(different tokens, or not a shadowsync engine)",
                                connection.peer()));
      case Handshake::Step::kUnexpected:
        throw Error(ErrorCode::kTransport,
                    fmt::format("control channel: engine {} sent a {} frame at {}",
                                connection.peer(), to_string(frame_type_of(message)), stage));
    }
  }
  const auto& engine_hello = std::get<EngineHelloMessage>(message);
  if (engine_hello.protocol_version != kProtocolVersion ||
      engine_hello.layout_fingerprint != layout.fingerprint() ||
      engine_hello.groups != hello.groups) {
    throw Error(ErrorCode::kLayoutMismatch,
                fmt::format("control channel: engine {} (rank {}) has protocol {} and layout "
                            "fingerprint {:#018x} with {} groups; this trainer has protocol {} "
                            "and {:#018x} with {} groups (tensor names, dtypes, shapes, order or "
                            "bucket size differ)",
                            connection.peer(), engine_hello.rank, engine_hello.protocol_version,
                            engine_hello.layout_fingerprint, engine_hello.groups.size(),
                            kProtocolVersion, layout.fingerprint(), layout.groups().size()));
  }
  handshake.accept(deadline);  // sends this trainer's hello
  EngineStatus& status = engine.status;
  status.rank = engine_hello.rank;
  status.connected = true;
  status.last_accepted_version = engine_hello.last_accepted_version;
  status.applied_version = engine_hello.applied_version;
  status.applied_step = engine_hello.applied_step;
}

TrainerChannel::~TrainerChannel() { close(); }

void TrainerChannel::close() {
  Impl& impl = *impl_;
  for (auto& engine : impl.engines) {
    bool connected;
    {
      std::lock_guard lock(impl.state_mutex);
      connected = engine->status.connected;
    }
    if (!connected) continue;
    impl.send(*engine, GoodbyeMessage{"trainer shutting down"});
    // The engine closes in answer: that is no news worth a log line.
    std::lock_guard lock(impl.state_mutex);
    engine->status.connected = false;
    engine->status.disconnect_reason = "said goodbye";
    engine->connection->shutdown();
  }
  const std::byte wake{1};
  impl.loop.stop(std::span<const std::byte>(&wake, 1));
  if (impl.io_thread.joinable()) impl.io_thread.join();
}

// --- I/O thread ----------------------------------------------------------------------------------

void TrainerChannel::Impl::collect(std::vector<Link*>& links) {
  std::lock_guard lock(state_mutex);
  for (const auto& engine : engines) {
    if (engine->status.connected) links.push_back(engine.get());
  }
}

bool TrainerChannel::Impl::is_open(const Link& link) const {
  std::lock_guard lock(state_mutex);
  return static_cast<const Engine&>(link).status.connected;
}

void TrainerChannel::Impl::on_failure(Link& link, LinkFailure, const std::string& why) {
  disconnect(static_cast<Engine&>(link), why);
}

void TrainerChannel::Impl::on_message(Link& link, ControlMessage& message) {
  Engine& engine = static_cast<Engine&>(link);
  std::lock_guard lock(state_mutex);
  if (!engine.status.connected) return;
  EngineStatus& status = engine.status;
  if (auto* ack = std::get_if<AckMessage>(&message)) {
    if (ack->version >= status.applied_version) {
      status.applied_version = ack->version;
      status.applied_step = ack->engine_step;
    }
  } else if (auto* error = std::get_if<UpdateErrorMessage>(&message)) {
    const auto code = static_cast<ErrorCode>(error->code);  // range-checked by the decoder
    status.error_version = error->version;
    status.error_code = code;
    status.error = error->message;
    engine.errors[error->version] = {code, error->message};
    if (engine.errors.size() > kErrorsKept) engine.errors.erase(engine.errors.begin());
  } else if (auto* result = std::get_if<RendezvousResultMessage>(&message)) {
    if (result->rendezvous_id == rendezvous_id) {
      engine.rendezvous_answered = result->rendezvous_id;
      engine.rendezvous_error = result->error;
    }
  } else if (auto* goodbye = std::get_if<GoodbyeMessage>(&message)) {
    disconnect_locked(engine, fmt::format("the engine said goodbye: {}", goodbye->reason));
    return;
  } else {
    disconnect_locked(engine, fmt::format("unexpected {} frame after the handshake",
                                          to_string(frame_type_of(message))));
    return;
  }
  state_cv.notify_all();
}

// --- any thread ----------------------------------------------------------------------------------

void TrainerChannel::Impl::disconnect_locked(Engine& engine, const std::string& why) {
  if (!engine.status.connected) return;
  engine.status.connected = false;
  engine.status.disconnect_reason = why;
  engine.connection->shutdown();
  log(fmt::format("{} disconnected: {}", describe(engine.status), why));
  state_cv.notify_all();
}

std::optional<std::string> TrainerChannel::Impl::send(Engine& engine,
                                                      const ControlMessage& message) {
  std::lock_guard send_lock(engine.send_mutex);
  {
    std::lock_guard lock(state_mutex);
    if (!engine.status.connected) {
      return fmt::format("{} is disconnected ({})", describe(engine.status),
                         engine.status.disconnect_reason);
    }
  }
  try {
    engine.connection->send(message, Clock::now() + config.control.send_timeout);
    return std::nullopt;
  } catch (const Error& e) {
    disconnect(engine, e.what());
    return fmt::format("{}: {}", describe(engine.status), e.what());
  }
}

template <typename Make>
void TrainerChannel::Impl::send_all(const char* what, Make&& make) {
  std::string failures;
  for (std::size_t i = 0; i < engines.size(); ++i) {
    if (auto failure = send(*engines[i], make(i))) {
      failures += failures.empty() ? "" : "; ";
      failures += *failure;
    }
  }
  if (!failures.empty()) {
    throw Error(ErrorCode::kTransport,
                fmt::format("trainer channel: {} not delivered: {}", what, failures));
  }
}

std::size_t TrainerChannel::engine_count() const { return impl_->engines.size(); }

std::vector<EngineStatus> TrainerChannel::engines() const {
  std::lock_guard lock(impl_->state_mutex);
  std::vector<EngineStatus> out;
  for (const auto& engine : impl_->engines) out.push_back(engine->status);
  return out;
}

std::uint64_t TrainerChannel::highest_accepted_version() const {
  std::lock_guard lock(impl_->state_mutex);
  std::uint64_t highest = 0;
  for (const auto& engine : impl_->engines) {
    highest =
        std::max({highest, engine->status.last_accepted_version, engine->status.applied_version});
  }
  return highest;
}

void TrainerChannel::send_rendezvous(const RendezvousId& id, int world_size, int first_rank) {
  send_rendezvous(TransportAddress::nccl(id), world_size, first_rank);
}

void TrainerChannel::send_rendezvous(const TransportAddress& address, int world_size,
                                     int first_rank) {
  Impl& impl = *impl_;
  // What the engines' decoder would refuse is refused here, naming it, before anything is sent.
  if (address.kind != TransportKind::kNccl && address.kind != TransportKind::kSameHost) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("send_rendezvous: transport kind {} is not one of {} (nccl), {} "
                            "(same_host)",
                            static_cast<unsigned>(address.kind),
                            static_cast<unsigned>(TransportKind::kNccl),
                            static_cast<unsigned>(TransportKind::kSameHost)));
  }
  if (address.kind == TransportKind::kSameHost &&
      (address.path.empty() || address.path.size() > kMaxSameHostPathBytes ||
       address.path.find('\0') != std::string::npos)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("send_rendezvous: same-host socket path '{}' ({} bytes) must be "
                            "1..{} bytes without a NUL byte",
                            printable(address.path), address.path.size(), kMaxSameHostPathBytes));
  }
  const auto engines = static_cast<long long>(impl.engines.size());
  if (world_size == 0) world_size = static_cast<int>(engines + 1);
  if (first_rank < 0 || world_size < 2 || world_size > static_cast<int>(kMaxControlWorldSize) ||
      first_rank + engines > world_size) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("send_rendezvous: ranks {}..{} of {} engines do not fit a world of "
                            "size {} (2..{})",
                            first_rank, first_rank + engines - 1, engines, world_size,
                            kMaxControlWorldSize));
  }
  std::uint64_t rendezvous_id;
  {
    std::lock_guard lock(impl.state_mutex);
    rendezvous_id = ++impl.rendezvous_id;
  }
  impl.send_all("rendezvous", [&](std::size_t i) {
    RendezvousMessage message;
    message.rendezvous_id = rendezvous_id;
    message.rank = static_cast<std::uint32_t>(first_rank + static_cast<int>(i));
    message.world_size = static_cast<std::uint32_t>(world_size);
    message.transport = address.kind;
    if (address.kind == TransportKind::kNccl) {
      std::memcpy(message.unique_id.data(), address.unique_id.bytes.data(), RendezvousId::kSize);
    } else {
      message.path = address.path;
    }
    return ControlMessage(message);
  });
}

bool TrainerChannel::wait_rendezvous(std::chrono::steady_clock::time_point deadline) {
  Impl& impl = *impl_;
  std::unique_lock lock(impl.state_mutex);
  for (;;) {
    bool all = true;
    std::string failures;
    for (const auto& engine : impl.engines) {
      const EngineStatus& status = engine->status;
      if (engine->rendezvous_answered == impl.rendezvous_id) {
        if (!engine->rendezvous_error.empty()) {
          failures += fmt::format("{}{}: {}", failures.empty() ? "" : "; ", describe(status),
                                  engine->rendezvous_error);
        }
      } else if (!status.connected) {
        failures += fmt::format("{}{} disconnected: {}", failures.empty() ? "" : "; ",
                                describe(status), status.disconnect_reason);
      } else {
        all = false;
      }
    }
    if (!failures.empty()) {
      throw Error(ErrorCode::kTransport, fmt::format("rendezvous failed: {}", failures));
    }
    if (all) return true;
    if (Clock::now() >= deadline) return false;
    impl.state_cv.wait_until(lock, deadline);
  }
}

void TrainerChannel::send_update_header(const UpdateHeader& header) {
  const UpdateHeaderMessage message{header};
  impl_->send_all("update header", [&](std::size_t) { return ControlMessage(message); });
}

bool TrainerChannel::wait_until_all_applied(std::uint64_t version,
                                            std::chrono::steady_clock::time_point deadline) {
  Impl& impl = *impl_;
  std::unique_lock lock(impl.state_mutex);
  for (;;) {
    bool all = true;
    for (const auto& engine : impl.engines) {
      const EngineStatus& status = engine->status;
      if (status.applied_version >= version) continue;
      if (auto it = engine->errors.find(version); it != engine->errors.end()) {
        throw Error(it->second.first,
                    fmt::format("{}: update {}: {}", describe(status), version, it->second.second));
      }
      if (!status.connected) {
        throw Error(ErrorCode::kTransport,
                    fmt::format("{} disconnected before applying update {} (live: {}): {}",
                                describe(status), version, status.applied_version,
                                status.disconnect_reason));
      }
      all = false;
    }
    if (all) return true;
    if (Clock::now() >= deadline) return false;
    impl.state_cv.wait_until(lock, deadline);
  }
}

void TrainerChannel::abort_update(std::uint64_t version, const std::string& reason) {
  std::string clipped = reason.substr(0, kMaxControlTextBytes);
  impl_->send_all("abort", [&](std::size_t) {
    return ControlMessage(AbortMessage{version, clipped});
  });
}

}  // namespace shadowsync
