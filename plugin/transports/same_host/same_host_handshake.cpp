// SameHostTransport's handshake: the sender listens and admits its receivers (in
// same_host_admission.cpp: each after both proved the token, HMAC over fresh nonces, then hands it
// the staging memory, a memfd over SCM_RIGHTS); a receiver connects, proves itself, checks the
// sender's proof and maps the staging read-only. See same_host_transport.h for the protocol.
#include "shadowsync/same_host_transport.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "shadowsync/token.h"
#include "transports/same_host/same_host_admission.h"
#include "transports/same_host/same_host_dial.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_memory_file.h"
#include "transports/same_host/same_host_socket.h"
#include "transports/same_host/same_host_state.h"

namespace shadowsync {

using same_host::Clock;
using same_host::Fd;
using same_host::Io;

namespace {

void check_same_host_token(std::string_view token) { check_token(token, "the same-host token"); }

}  // namespace

std::unique_ptr<SameHostTransport> SameHostTransport::serve(const std::string& path,
                                                            std::string_view token, int receivers,
                                                            Backend& backend, SameHostMemory memory,
                                                            std::size_t slot_bytes,
                                                            SameHostConfig config) {
  check_same_host_token(token);
  if (receivers < 1 || receivers > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host serve: {} receivers, expected 1..65535", receivers));
  }
  if (slot_bytes == 0) {
    throw Error(ErrorCode::kInvalidArgument, "same-host serve: staging slots of 0 bytes");
  }
  if (memory != SameHostMemory::kHost && memory != SameHostMemory::kDevice) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host serve: unknown memory flavour {}", static_cast<int>(memory)));
  }
  same_host::check_private_directory(same_host::socket_directory(path), /*create=*/true);

  auto state = std::make_shared<State>();
  state->rank = 0;
  state->world_size = receivers + 1;
  state->memory = memory;
  state->slot_bytes = slot_bytes;
  state->wake = same_host::make_wake();
  Fd memory_file;  // host flavour; the device flavour's link holds its exported fd
  if (memory == SameHostMemory::kDevice) {
    state->device = same_host::DeviceLink::create(backend, slot_bytes, config.doorbell_timeout);
  } else {
    state->mapped_bytes = same_host::kSlotCount * slot_bytes;
    void* mapped = nullptr;
    memory_file = same_host::make_sealed_staging(state->mapped_bytes, &mapped);
    state->staging = static_cast<std::byte*>(mapped);
  }
  const int shared_fd = state->device ? state->device->exported_fd() : memory_file.get();

  Fd listener = same_host::listen_on(path, receivers + 4);
  // Whatever happens from here, the socket file goes: a later sender need not find it stale.
  struct Unlink {
    const std::string& path;
    ~Unlink() { ::unlink(path.c_str()); }
  } unlink_at_exit{path};

  same_host::Setup setup;
  setup.memory = static_cast<std::uint32_t>(memory);
  setup.world_size = static_cast<std::uint32_t>(receivers + 1);
  setup.slot_bytes = slot_bytes;
  if (state->device) setup.handle = state->device->handle();
  const auto setup_record = same_host::encode(setup);
  state->peers = same_host::admit_receivers(listener.get(), path, token, receivers, setup_record,
                                            shared_fd, config);
  if (state->device) state->device->start(*state);
  return std::unique_ptr<SameHostTransport>(new SameHostTransport(std::move(state)));
}

std::unique_ptr<SameHostTransport> SameHostTransport::connect(const std::string& path,
                                                              std::string_view token, int rank,
                                                              Backend& backend,
                                                              SameHostConfig config) {
  (void)backend;
  check_same_host_token(token);
  if (config.doorbell_timeout <= std::chrono::milliseconds(0)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host connect: SameHostConfig::doorbell_timeout is {} ms; it must "
                            "be positive (default {} ms)",
                            config.doorbell_timeout.count(),
                            SameHostConfig{}.doorbell_timeout.count()));
  }
  if (rank < 1 || rank > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host connect: rank {} is outside 1..65535 (0 is the sender)",
                            rank));
  }
  same_host::check_private_directory(same_host::socket_directory(path), /*create=*/true);
  int last_errno = 0;
  Fd socket = same_host::dial(path, Clock::now() + config.connect_timeout, last_errno);
  if (!socket) {
    throw Error(ErrorCode::kTimeout,
                fmt::format("same-host connect to '{}': no sender listened within {} ms ({})",
                            path, config.connect_timeout.count(), std::strerror(last_errno)));
  }
  const auto deadline = Clock::now() + config.handshake_timeout;
  same_host::prove_to_sender(socket.get(), path, token, static_cast<std::uint32_t>(rank),
                             deadline);
  const auto failed = [&](const std::string& what, Io io) {
    return Error(io == Io::kTimeout ? ErrorCode::kTimeout : ErrorCode::kTransport,
                 fmt::format("same-host connect to '{}' as rank {}: {}: {}", path, rank, what,
                             same_host::describe(io, errno)));
  };
  std::string problem;
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
  if (setup.memory == static_cast<std::uint32_t>(SameHostMemory::kDevice)) {
    auto state = std::make_shared<State>();
    state->rank = rank;
    state->world_size = static_cast<int>(setup.world_size);
    state->memory = SameHostMemory::kDevice;
    state->slot_bytes = static_cast<std::size_t>(setup.slot_bytes);
    state->device = same_host::DeviceLink::open(backend, std::move(memory_file), setup, path,
                                                config.doorbell_timeout);
    state->wake = same_host::make_wake();
    state->peers.push_back(std::move(socket));
    state->device->start(*state);
    return std::unique_ptr<SameHostTransport>(new SameHostTransport(std::move(state)));
  }
  auto state = std::make_shared<State>();
  state->rank = rank;
  state->world_size = static_cast<int>(setup.world_size);
  state->memory = SameHostMemory::kHost;
  state->slot_bytes = static_cast<std::size_t>(setup.slot_bytes);
  const same_host::MappedStaging mapped = same_host::map_received_staging(
      memory_file, setup.slot_bytes, path, "same-host connect", "sender");
  state->staging = mapped.base;
  state->mapped_bytes = mapped.bytes;
  state->wake = same_host::make_wake();
  state->peers.push_back(std::move(socket));
  return std::unique_ptr<SameHostTransport>(new SameHostTransport(std::move(state)));
}

}  // namespace shadowsync
