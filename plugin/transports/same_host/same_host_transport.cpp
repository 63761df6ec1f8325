// SameHostTransport: see same_host_transport.h for the protocol and its failure semantics.
#include "shadowsync/same_host_transport.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "backends/host/host_stream.h"
#include "shadowsync/error.h"
#include "transports/same_host/same_host_auth.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_socket.h"

namespace shadowsync {

using same_host::Clock;
using same_host::DataRecord;
using same_host::Fd;
using same_host::Io;
using same_host::RecordType;

// Shared by the transport and every enqueued stream task, so that either may go first.
struct SameHostTransport::State {
  int rank = 0;
  int world_size = 0;
  SameHostMemory memory = SameHostMemory::kHost;
  std::size_t slot_bytes = 0;
  std::byte* staging = nullptr;  // kSlotCount slots; the sender maps it writable, receivers not
  std::size_t mapped_bytes = 0;
  Fd wake;                   // eventfd: readable once aborted
  std::vector<Fd> peers;     // sender: ranks 1..n at index rank-1; receiver: the sender

  std::mutex mutex;
  std::condition_variable turn_changed;
  std::uint64_t calls_enqueued = 0;  // the caller's thread only
  std::uint64_t calls_done = 0;      // under mutex
  bool aborted = false;              // under mutex
  bool broken = false;               // under mutex: a failure put the ranks out of step
  std::optional<std::string> error;  // under mutex: the first failure
  std::uint64_t next_sequence = 0;   // the task whose turn it is

  ~State() {
    if (staging != nullptr) ::munmap(staging, mapped_bytes);
  }

  void fail(std::string reason) {
    std::lock_guard lock(mutex);
    if (!error) error = std::move(reason);
    broken = true;
    turn_changed.notify_all();
  }

  void do_abort(std::string reason) noexcept {
    {
      std::lock_guard lock(mutex);
      if (aborted) return;
      aborted = true;
      if (!error) error = std::move(reason);
      turn_changed.notify_all();
    }
    const std::uint64_t one = 1;
    if (wake) [[maybe_unused]] auto written = ::write(wake.get(), &one, sizeof(one));
    // The peers see EOF at once and fail their update, as if this process had died.
    for (Fd& peer : peers) ::shutdown(peer.get(), SHUT_RDWR);
  }

  // Waits until call `call` may run; false when the transport is dead (then the call does
  // nothing: as an aborted NCCL collective, it completes with async_error() set).
  bool wait_turn(std::uint64_t call) {
    std::unique_lock lock(mutex);
    turn_changed.wait(lock, [&] { return aborted || broken || calls_done == call; });
    return !aborted && !broken;
  }
  void end_turn() {
    std::lock_guard lock(mutex);
    ++calls_done;
    turn_changed.notify_all();
  }

  std::byte* slot(std::uint32_t s) const { return staging + std::size_t{s} * slot_bytes; }

  void run_send(const std::byte* buffer, std::size_t bytes, std::uint64_t call);
  void run_receive(std::byte* buffer, std::size_t bytes, std::uint64_t call);
};

void SameHostTransport::State::run_send(const std::byte* buffer, std::size_t bytes,
                                        std::uint64_t call) {
  if (!wait_turn(call)) return;
  const same_host::SlotGeometry geometry{same_host::kSlotCount, slot_bytes};
  // Packed straight into a slot by the caller (staging_buffer()): no copy.
  std::optional<std::uint32_t> own_slot;
  for (std::uint32_t s = 0; s < same_host::kSlotCount; ++s) {
    if (buffer == slot(s) && bytes <= slot_bytes) own_slot = s;
  }
  for (std::size_t offset = 0; offset < bytes; offset += slot_bytes) {
    const std::size_t n = std::min(slot_bytes, bytes - offset);
    const std::uint64_t sequence = next_sequence++;
    std::uint32_t s = own_slot.value_or(static_cast<std::uint32_t>(sequence % 2));
    if (!own_slot) std::memcpy(slot(s), buffer + offset, n);
    const DataRecord doorbell{RecordType::kDoorbell, sequence, s, 0, n};
    const auto frame = same_host::encode(doorbell);
    for (std::size_t p = 0; p < peers.size(); ++p) {
      const Io io = same_host::write_all(peers[p].get(), frame, wake.get(), std::nullopt);
      if (io != Io::kOk) {
        if (io != Io::kWoken) {
          fail(fmt::format("same-host sender: doorbell {} to rank {}: {}", sequence, p + 1,
                           same_host::describe(io, errno)));
        }
        return;
      }
    }
    // Every receiver must have copied the slot out before it is written again.
    for (std::size_t p = 0; p < peers.size(); ++p) {
      std::array<std::byte, same_host::kDataRecordBytes> record{};
      const Io io = same_host::read_exact(peers[p].get(), record, wake.get(), std::nullopt);
      if (io != Io::kOk) {
        if (io != Io::kWoken) {
          fail(fmt::format("same-host sender: waiting for rank {} to ack chunk {}: {}", p + 1,
                           sequence, same_host::describe(io, errno)));
        }
        return;
      }
      DataRecord ack;
      std::string problem;
      if (!same_host::decode(record, RecordType::kAck, geometry, ack, problem)) {
        fail(fmt::format("same-host sender: rank {} broke the protocol: {}", p + 1, problem));
        return;
      }
      if (ack.sequence != sequence || ack.slot != s || ack.bytes != n) {
        fail(fmt::format("same-host sender: rank {} acked chunk {} (slot {}, {} bytes) where "
                         "chunk {} (slot {}, {} bytes) was due",
                         p + 1, ack.sequence, ack.slot, ack.bytes, sequence, s, n));
        return;
      }
    }
  }
  end_turn();
}

void SameHostTransport::State::run_receive(std::byte* buffer, std::size_t bytes,
                                           std::uint64_t call) {
  if (!wait_turn(call)) return;
  const same_host::SlotGeometry geometry{same_host::kSlotCount, slot_bytes};
  for (std::size_t offset = 0; offset < bytes; offset += slot_bytes) {
    const std::size_t n = std::min(slot_bytes, bytes - offset);
    const std::uint64_t sequence = next_sequence++;
    std::array<std::byte, same_host::kDataRecordBytes> record{};
    const Io io = same_host::read_exact(peers[0].get(), record, wake.get(), std::nullopt);
    if (io != Io::kOk) {
      if (io != Io::kWoken) {
        fail(fmt::format("same-host rank {}: waiting for the doorbell of chunk {}: {}", rank,
                         sequence, same_host::describe(io, errno)));
      }
      return;
    }
    DataRecord doorbell;
    std::string problem;
    if (!same_host::decode(record, RecordType::kDoorbell, geometry, doorbell, problem) ||
        !(problem = same_host::check_doorbell(doorbell, sequence, n)).empty()) {
      // Nothing of this chunk is copied: the sender broke the protocol.
      fail(fmt::format("same-host rank {}: the sender broke the protocol: {}", rank, problem));
      return;
    }
    std::memcpy(buffer + offset, slot(doorbell.slot) + doorbell.offset, n);
    doorbell.type = RecordType::kAck;
    const Io sent =
        same_host::write_all(peers[0].get(), same_host::encode(doorbell), wake.get(), std::nullopt);
    if (sent != Io::kOk) {
      if (sent != Io::kWoken) {
        fail(fmt::format("same-host rank {}: ack of chunk {}: {}", rank, sequence,
                         same_host::describe(sent, errno)));
      }
      return;
    }
  }
  end_turn();
}

namespace {

std::string directory_of(const std::string& path) {
  const std::filesystem::path p(path);
  if (!p.has_parent_path() || p.filename().empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host socket path '{}' needs a directory and a file name", path));
  }
  return p.parent_path().string();
}

void check_token(std::string_view token) {
  if (token.size() < 16) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host token is {} bytes; at least 16 are required (use 32 "
                            "random bytes)",
                            token.size()));
  }
}

Fd make_wake() {
  Fd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake) {
    throw Error(ErrorCode::kTransport, fmt::format("eventfd: {}", std::strerror(errno)));
  }
  return wake;
}

template <std::size_t N>
Io read_record(int fd, std::array<std::byte, N>& out, Clock::time_point deadline) {
  return same_host::read_exact(fd, out, -1, deadline);
}

// One receiver's handshake on the sender side. Returns the rank it proved, or nullopt with the
// refusal in `why` (the connection is then dropped).
std::optional<int> admit(int fd, std::string_view token, int receivers,
                         const std::vector<bool>& taken, std::chrono::milliseconds timeout,
                         std::string& why) {
  const auto deadline = Clock::now() + timeout;
  ucred cred{};
  socklen_t cred_size = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cred_size) != 0 ||
      cred.uid != ::geteuid()) {
    why = fmt::format("a peer of uid {} is not this user ({})", cred.uid, ::geteuid());
    return std::nullopt;
  }
  const same_host::Nonce sender_nonce = same_host::make_nonce();
  if (const Io io = same_host::write_all(fd, same_host::encode(same_host::Challenge{sender_nonce}),
                                         -1, deadline);
      io != Io::kOk) {
    why = "sending the challenge: " + same_host::describe(io, errno);
    return std::nullopt;
  }
  std::array<std::byte, 80> record{};
  if (const Io io = read_record(fd, record, deadline); io != Io::kOk) {
    why = "waiting for the receiver's proof: " + same_host::describe(io, errno);
    return std::nullopt;
  }
  same_host::Proof proof;
  if (!same_host::decode(record, proof, why)) return std::nullopt;
  std::optional<same_host::RefuseReason> refusal;
  if (!same_host::macs_equal(proof.mac, same_host::receiver_proof(token, sender_nonce,
                                                                  proof.receiver_nonce, proof.rank))) {
    refusal = same_host::RefuseReason::kBadProof;
  } else if (proof.rank < 1 || proof.rank > static_cast<std::uint32_t>(receivers)) {
    refusal = same_host::RefuseReason::kBadRank;
  } else if (taken[proof.rank]) {
    refusal = same_host::RefuseReason::kRankTaken;
  }
  if (refusal) {
    (void)same_host::write_all(fd, same_host::encode(same_host::Refuse{*refusal}), -1, deadline);
    why = fmt::format("refused a receiver asking for rank {}: {}", proof.rank,
                      same_host::to_string(*refusal));
    return std::nullopt;
  }
  const same_host::Accept accept{
      same_host::sender_proof(token, sender_nonce, proof.receiver_nonce, proof.rank)};
  if (const Io io = same_host::write_all(fd, same_host::encode(accept), -1, deadline);
      io != Io::kOk) {
    why = "sending the proof: " + same_host::describe(io, errno);
    return std::nullopt;
  }
  std::array<std::byte, 8> ready{};
  if (const Io io = read_record(fd, ready, deadline); io != Io::kOk) {
    why = fmt::format("rank {} did not accept this sender's proof: {}", proof.rank,
                      same_host::describe(io, errno));
    return std::nullopt;
  }
  if (!same_host::decode_ready(ready, why)) return std::nullopt;
  return static_cast<int>(proof.rank);
}

}  // namespace

SameHostTransport::SameHostTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

SameHostTransport::~SameHostTransport() {
  // A transport that goes away is, to its peers, a peer that died: they see EOF.
  state_->do_abort(fmt::format("same-host transport of rank {} was destroyed", state_->rank));
}

std::unique_ptr<SameHostTransport> SameHostTransport::serve(const std::string& path,
                                                            std::string_view token, int receivers,
                                                            Backend& backend, SameHostMemory memory,
                                                            std::size_t slot_bytes,
                                                            SameHostConfig config) {
  (void)backend;
  check_token(token);
  if (receivers < 1 || receivers > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host serve: {} receivers, expected 1..65535", receivers));
  }
  if (slot_bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "same-host serve: staging slots of 0 bytes");
  }
  if (memory != SameHostMemory::kHost) {
    throw Error(ErrorCode::kInvalidArgument,
                "same-host serve: the device memory flavour is not implemented in this build; use "
                "SameHostMemory::kHost with a HostBackend");
  }
  same_host::check_private_directory(directory_of(path), /*create=*/true);

  auto state = std::make_shared<State>();
  state->rank = 0;
  state->world_size = receivers + 1;
  state->memory = memory;
  state->slot_bytes = slot_bytes;
  state->wake = make_wake();
  state->mapped_bytes = same_host::kSlotCount * slot_bytes;
  Fd memory_file(::memfd_create("shadowsync-same-host-staging", MFD_CLOEXEC));
  if (!memory_file || ::ftruncate(memory_file.get(), static_cast<off_t>(state->mapped_bytes)) != 0) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host serve: a shared memory file of {} bytes (memfd_create, "
                            "ftruncate): {}",
                            state->mapped_bytes, std::strerror(errno)));
  }
  void* mapped = ::mmap(nullptr, state->mapped_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                        memory_file.get(), 0);
  if (mapped == MAP_FAILED) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host serve: mmap of {} bytes of staging: {}",
                            state->mapped_bytes, std::strerror(errno)));
  }
  state->staging = static_cast<std::byte*>(mapped);

  Fd listener = same_host::listen_on(path, receivers + 4);
  // Whatever happens from here, the socket file goes: a later sender need not find it stale.
  struct Unlink {
    const std::string& path;
    ~Unlink() { ::unlink(path.c_str()); }
  } unlink_at_exit{path};

  state->peers.resize(static_cast<std::size_t>(receivers));
  std::vector<bool> taken(static_cast<std::size_t>(receivers) + 1, false);
  int admitted = 0;
  std::string last_refusal;
  const auto deadline = Clock::now() + config.connect_timeout;
  same_host::Setup setup;
  setup.memory = static_cast<std::uint32_t>(memory);
  setup.world_size = static_cast<std::uint32_t>(receivers + 1);
  setup.slot_bytes = slot_bytes;
  const auto setup_record = same_host::encode(setup);
  while (admitted < receivers) {
    pollfd pfd{listener.get(), POLLIN, 0};
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now());
    const int n = left.count() > 0 ? ::poll(&pfd, 1, static_cast<int>(left.count())) : 0;
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("same-host serve on '{}': {} of {} receivers connected within {} "
                              "ms{}",
                              path, admitted, receivers, config.connect_timeout.count(),
                              last_refusal.empty() ? "" : "; last refusal: " + last_refusal));
    }
    Fd connection(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection) continue;
    std::string why;
    const std::optional<int> rank =
        admit(connection.get(), token, receivers, taken, config.handshake_timeout, why);
    if (!rank) {
      last_refusal = why;
      continue;
    }
    const Io io = same_host::write_with_fd(connection.get(), setup_record, memory_file.get(),
                                           Clock::now() + config.handshake_timeout);
    if (io != Io::kOk) {
      last_refusal = fmt::format("sending the staging memory to rank {}: {}", *rank,
                                 same_host::describe(io, errno));
      continue;
    }
    taken[static_cast<std::size_t>(*rank)] = true;
    state->peers[static_cast<std::size_t>(*rank - 1)] = std::move(connection);
    ++admitted;
  }
  return std::unique_ptr<SameHostTransport>(new SameHostTransport(std::move(state)));
}

std::unique_ptr<SameHostTransport> SameHostTransport::connect(const std::string& path,
                                                              std::string_view token, int rank,
                                                              Backend& backend,
                                                              SameHostConfig config) {
  (void)backend;
  check_token(token);
  if (rank < 1 || rank > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host connect: rank {} is outside 1..65535 (0 is the sender)",
                            rank));
  }
  same_host::check_private_directory(directory_of(path), /*create=*/true);
  const auto connect_deadline = Clock::now() + config.connect_timeout;
  Fd socket;
  int last_errno = 0;
  for (;;) {
    socket = same_host::try_connect(path);
    if (socket) break;
    last_errno = errno;
    if (last_errno != ENOENT && last_errno != ECONNREFUSED && last_errno != EAGAIN) {
      throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path,
                                                     std::strerror(last_errno)));
    }
    if (Clock::now() >= connect_deadline) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("same-host connect to '{}': no sender listened within {} ms ({})",
                              path, config.connect_timeout.count(), std::strerror(last_errno)));
    }
    // No sender yet (or a stale file of a dead one): poll for the next one.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  const auto deadline = Clock::now() + config.handshake_timeout;
  const auto failed = [&](const std::string& what, Io io) {
    return Error(io == Io::kTimeout ? ErrorCode::kTimeout : ErrorCode::kTransport,
                 fmt::format("same-host connect to '{}' as rank {}: {}: {}", path, rank, what,
                             same_host::describe(io, errno)));
  };
  std::array<std::byte, 40> challenge_record{};
  if (const Io io = read_record(socket.get(), challenge_record, deadline); io != Io::kOk) {
    throw failed("waiting for the sender's challenge", io);
  }
  std::string problem;
  same_host::Challenge challenge;
  if (!same_host::decode(challenge_record, challenge, problem)) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': {}", path, problem));
  }
  same_host::Proof proof;
  proof.rank = static_cast<std::uint32_t>(rank);
  proof.receiver_nonce = same_host::make_nonce();
  proof.mac = same_host::receiver_proof(token, challenge.sender_nonce, proof.receiver_nonce,
                                        proof.rank);
  if (const Io io = same_host::write_all(socket.get(), same_host::encode(proof), -1, deadline);
      io != Io::kOk) {
    throw failed("sending the proof", io);
  }
  std::array<std::byte, 40> answer{};
  const std::span<std::byte> head(answer.data(), same_host::kHeaderBytes);
  if (const Io io = same_host::read_exact(socket.get(), head, -1, deadline); io != Io::kOk) {
    throw failed("waiting for the sender's answer", io);
  }
  RecordType type{};
  if (!same_host::parse_record_header(head, type, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  if (type == RecordType::kRefuse) {
    const std::span<std::byte> rest(answer.data() + same_host::kHeaderBytes, 8);
    same_host::Refuse refuse;
    if (same_host::read_exact(socket.get(), rest, -1, deadline) == Io::kOk &&
        same_host::decode(std::span<const std::byte>(answer.data(), 16), refuse, problem)) {
      problem = same_host::to_string(refuse.reason);
    }
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}' as rank {}: the sender refused: {}", path,
                            rank, problem));
  }
  if (type != RecordType::kAccept) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': record type {} where the sender's proof "
                            "was expected",
                            path, static_cast<int>(type)));
  }
  const std::span<std::byte> rest(answer.data() + same_host::kHeaderBytes,
                                  answer.size() - same_host::kHeaderBytes);
  if (const Io io = same_host::read_exact(socket.get(), rest, -1, deadline); io != Io::kOk) {
    throw failed("reading the sender's proof", io);
  }
  same_host::Accept accept;
  if (!same_host::decode(answer, accept, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  if (!same_host::macs_equal(accept.mac,
                             same_host::sender_proof(token, challenge.sender_nonce,
                                                     proof.receiver_nonce, proof.rank))) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender could not prove the token "
                            "(wrong token, or not our sender); refusing it before any memory is "
                            "shared",
                            path));
  }
  if (const Io io = same_host::write_all(socket.get(), same_host::encode_ready(), -1, deadline);
      io != Io::kOk) {
    throw failed("sending ready", io);
  }
  std::array<std::byte, 96> setup_record{};
  Fd memory_file;
  if (const Io io = same_host::read_with_fd(socket.get(), setup_record, memory_file, deadline);
      io != Io::kOk) {
    throw failed("waiting for the staging memory", io);
  }
  same_host::Setup setup;
  if (!same_host::decode(setup_record, setup, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  if (static_cast<std::uint32_t>(rank) >= setup.world_size) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': rank {} but world size {}", path, rank,
                            setup.world_size));
  }
  if (setup.memory != static_cast<std::uint32_t>(SameHostMemory::kHost)) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender shares device memory, which "
                            "this build cannot import",
                            path));
  }
  if (!memory_file) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender's setup carried no memory "
                            "file descriptor (SCM_RIGHTS)",
                            path));
  }
  auto state = std::make_shared<State>();
  state->rank = rank;
  state->world_size = static_cast<int>(setup.world_size);
  state->memory = SameHostMemory::kHost;
  state->slot_bytes = static_cast<std::size_t>(setup.slot_bytes);
  state->mapped_bytes = same_host::kSlotCount * state->slot_bytes;
  struct stat st {};
  if (setup.slot_bytes > (std::uint64_t{1} << 40) || ::fstat(memory_file.get(), &st) != 0 ||
      static_cast<std::uint64_t>(st.st_size) < state->mapped_bytes) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender's memory file holds {} bytes, "
                            "but 2 slots of {} bytes were announced",
                            path, st.st_size, setup.slot_bytes));
  }
  void* mapped = ::mmap(nullptr, state->mapped_bytes, PROT_READ, MAP_SHARED, memory_file.get(), 0);
  if (mapped == MAP_FAILED) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': could not map the sender's staging memory "
                            "(memfd of {} bytes, mmap PROT_READ MAP_SHARED): {}",
                            path, state->mapped_bytes, std::strerror(errno)));
  }
  state->staging = static_cast<std::byte*>(mapped);
  state->wake = make_wake();
  state->peers.push_back(std::move(socket));
  return std::unique_ptr<SameHostTransport>(new SameHostTransport(std::move(state)));
}

int SameHostTransport::rank() const { return state_->rank; }
int SameHostTransport::world_size() const { return state_->world_size; }
SameHostMemory SameHostTransport::memory() const { return state_->memory; }
std::size_t SameHostTransport::slot_bytes() const { return state_->slot_bytes; }

void SameHostTransport::broadcast_async(void* buffer, std::size_t bytes, int root,
                                        Stream& stream) {
  host::HostStream* host_stream = host::as_host_stream(stream);
  if (host_stream == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host transport (host memory) needs a stream from HostBackend, "
                            "got a {}",
                            host::type_name(typeid(stream))));
  }
  if (root != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host broadcast on rank {}: root {}, but the sender is always "
                            "rank 0",
                            state_->rank, root));
  }
  if (buffer == nullptr && bytes > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host broadcast on rank {}: null buffer for {} bytes",
                            state_->rank, bytes));
  }
  const std::uint64_t call = state_->calls_enqueued++;
  if (state_->rank == 0) {
    host_stream->enqueue([state = state_, buffer, bytes, call] {
      state->run_send(static_cast<const std::byte*>(buffer), bytes, call);
    });
  } else {
    host_stream->enqueue([state = state_, buffer, bytes, call] {
      state->run_receive(static_cast<std::byte*>(buffer), bytes, call);
    });
  }
}

void* SameHostTransport::staging_buffer(int index, std::size_t bytes) {
  if (state_->rank != 0 || index < 0 || index >= static_cast<int>(same_host::kSlotCount) ||
      bytes > state_->slot_bytes) {
    return nullptr;
  }
  return state_->slot(static_cast<std::uint32_t>(index));
}

std::optional<std::string> SameHostTransport::async_error() {
  std::lock_guard lock(state_->mutex);
  return state_->error;
}

void SameHostTransport::abort() noexcept {
  std::string reason;
  try {
    reason = fmt::format("same-host transport aborted by rank {}", state_->rank);
  } catch (...) {
  }
  state_->do_abort(std::move(reason));
}

}  // namespace shadowsync
