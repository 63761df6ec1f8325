// SameHostPullTransport's handshake: a trainer rank admits its engine processes (the same-host
// admission, with the pull hello as its last step) and shares its staging; an engine rank
// connects to every trainer rank in rank order, says hello and maps each one's staging
// read-only. See same_host_pull_transport.h for the protocol.

#include <cerrno>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "shadowsync/token.h"
#include "transports/same_host/same_host_admission.h"
#include "transports/same_host/same_host_dial.h"
#include "transports/same_host/same_host_frame.h"
#include "transports/same_host/same_host_memory_file.h"
#include "transports/same_host/same_host_pull_device.h"
#include "transports/same_host/same_host_pull_state.h"
#include "transports/same_host/same_host_pull_transport.h"

namespace shadowsync {

using same_host::Clock;
using same_host::Fd;
using same_host::Io;
using same_host::RecordType;

namespace {

// Each slot of trainer rank `t`: the plan's largest packing of one bucket, rounded up to 64 bytes
// (the second slot starts aligned for the packer's copies) and never 0 (a rank that sends
// nothing still shares a mappable file and rings empty doorbells).
std::size_t slot_bytes_for(const RoutingPlan& plan, int t) {
  const std::size_t packed = plan.max_packed_bytes(t);
  return (std::max<std::size_t>(packed, 1) + 63) / 64 * 64;
}

void check_plan(const std::shared_ptr<const RoutingPlan>& plan, const char* call) {
  if (!plan) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull {}: no routing plan", call));
  }
}

void check_peer_timeout(const SameHostConfig& config, const char* call) {
  if (config.doorbell_timeout.count() <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull {}: doorbell_timeout is {} ms; it bounds the device "
                            "flavour's waits for each peer and must be positive",
                            call, config.doorbell_timeout.count()));
  }
}

const char* flavour_name(SameHostMemory memory) {
  return memory == SameHostMemory::kDevice ? "device" : "host";
}

// The data path's flavour: the device one runs on its callers' threads with `backend`'s events.
void set_flavour(SameHostPullTransport::State& state, SameHostMemory memory, Backend& backend,
                 const SameHostConfig& config) {
  state.device = memory == SameHostMemory::kDevice;
  state.backend = &backend;
  state.peer_timeout = config.doorbell_timeout;
  if (state.device) state.passed = backend.create_event();
}

// The trainer rank's answer to an engine process's hello: its seat is 1 + replica * N + engine
// rank (the order the data path names peers in, same_host_pull_state.h).
same_host::HelloAnswer answer_hello(const RoutingPlan& plan, int trainer_rank, int replicas,
                                    const std::string& path, std::span<const std::byte> setup,
                                    std::uint32_t proved, std::span<const std::byte> record,
                                    const std::function<bool(std::uint32_t)>& taken) {
  same_host::PullHello hello;
  std::string problem;
  if (!same_host::decode(record, hello, problem)) {
    return {false, 0, {}, fmt::format("a malformed hello: {}", problem)};
  }
  const auto refuse = [&](same_host::PullRefuseReason reason, std::string why) {
    const same_host::PullRefuse refusal{reason,
                                        static_cast<std::uint32_t>(trainer_rank),
                                        static_cast<std::uint32_t>(plan.trainer_count()),
                                        static_cast<std::uint32_t>(plan.engine_count()),
                                        plan.fingerprint(),
                                        static_cast<std::uint32_t>(replicas)};
    const auto bytes = same_host::encode(refusal);
    return same_host::HelloAnswer{false, 0, {bytes.begin(), bytes.end()}, std::move(why)};
  };
  if (hello.engine_rank + 1 != proved) {
    return {false, 0, {},
            fmt::format("its hello names engine rank {}, but it proved the token for engine rank "
                        "{}",
                        hello.engine_rank, static_cast<long long>(proved) - 1)};
  }
  const std::string who = pull_engine_name(hello.engine_rank, hello.replica);
  if (hello.trainer_count != static_cast<std::uint32_t>(plan.trainer_count()) ||
      hello.engine_count != static_cast<std::uint32_t>(plan.engine_count())) {
    return refuse(same_host::PullRefuseReason::kWorldSizeDiffers,
                  fmt::format("{} was set up for {} trainer ranks and {} engine ranks, trainer "
                              "rank {} at {} for {} and {}",
                              who, hello.trainer_count, hello.engine_count, trainer_rank, path,
                              plan.trainer_count(), plan.engine_count()));
  }
  if (hello.fingerprint != plan.fingerprint()) {
    return refuse(
        same_host::PullRefuseReason::kPlanDiffers,
        fmt::format("{} has routing plan {:#018x}, trainer rank {} at {} has {:#018x}", who,
                    hello.fingerprint, trainer_rank, path, plan.fingerprint()));
  }
  if (hello.replica >= static_cast<std::uint32_t>(replicas)) {
    return refuse(same_host::PullRefuseReason::kReplicaOutside,
                  fmt::format("{}: replica {} is outside the {} replica(s) trainer rank {} serves",
                              who, hello.replica, replicas, trainer_rank));
  }
  const auto seat = 1 + hello.replica * static_cast<std::uint32_t>(plan.engine_count()) +
                    hello.engine_rank;
  if (taken(seat)) {
    return refuse(same_host::PullRefuseReason::kRankTaken,
                  fmt::format("{} was taken by another engine process already", who));
  }
  return {true, seat, {setup.begin(), setup.end()}, {}};
}

// What an engine rank says when the trainer rank at `path` refused it.
Error refused(const same_host::PullRefuse& r, const RoutingPlan& plan, int engine_rank,
              int replica, const std::string& path) {
  const std::string who = pull_engine_name(static_cast<std::uint32_t>(engine_rank),
                                           static_cast<std::uint32_t>(replica));
  switch (r.reason) {
    case same_host::PullRefuseReason::kWorldSizeDiffers: {
      // Named by the first count that differs.
      const bool trainers = r.trainer_count != static_cast<std::uint32_t>(plan.trainer_count());
      return Error(ErrorCode::kInvalidArgument,
                   fmt::format("{} was set up for {} {} ranks, trainer rank {} at {} for {}: "
                               "every rank must build its routing plan from the same trainer and "
                               "engine ranks",
                               who, trainers ? plan.trainer_count() : plan.engine_count(),
                               trainers ? "trainer" : "engine", r.trainer_rank, path,
                               trainers ? r.trainer_count : r.engine_count));
    }
    case same_host::PullRefuseReason::kPlanDiffers:
      return Error(
          ErrorCode::kLayoutMismatch,
          fmt::format("{}'s routing plan (fingerprint {:#018x}) differs from trainer rank {}'s "
                      "at {} ({:#018x}): build both from the same wire layout, trainer regions "
                      "and engine needs",
                      who, plan.fingerprint(), r.trainer_rank, path, r.fingerprint));
    case same_host::PullRefuseReason::kRankTaken:
      return Error(ErrorCode::kInvalidArgument,
                   fmt::format("{}: trainer rank {} at {} already admitted another engine process "
                               "as {}; it serves replicas 0..{} of each engine rank: give each "
                               "process of an engine rank its own replica",
                               who, r.trainer_rank, path, who, r.replicas - 1));
    case same_host::PullRefuseReason::kReplicaOutside:
      break;
  }
  return Error(ErrorCode::kInvalidArgument,
               fmt::format("{}: trainer rank {} at {} serves {} replica(s) of each engine rank "
                           "(replicas 0..{}); serve every trainer rank with engine_processes = "
                           "replicas x engine ranks",
                           who, r.trainer_rank, path, r.replicas, r.replicas - 1));
}

}  // namespace

std::unique_ptr<SameHostPullTransport> SameHostPullTransport::serve(
    const std::string& path, std::string_view token, std::shared_ptr<const RoutingPlan> plan,
    int trainer_rank, int engine_processes, Backend& backend, SameHostMemory memory,
    SameHostConfig config) {
  check_token(token, "the same-host token");
  check_plan(plan, "serve");
  if (trainer_rank < 0 || trainer_rank >= plan->trainer_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull serve on '{}': trainer rank {} is outside the routing "
                            "plan's 0..{}",
                            path, trainer_rank, plan->trainer_count() - 1));
  }
  if (engine_processes < plan->engine_count() || engine_processes % plan->engine_count() != 0 ||
      engine_processes > 65536) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull serve on '{}': {} engine processes, but the routing "
                            "plan has {} engine ranks; serve replicas x engine ranks processes "
                            "(one per engine rank of each data-parallel replica), at most 65536",
                            path, engine_processes, plan->engine_count()));
  }
  const int replicas = engine_processes / plan->engine_count();
  if (memory != SameHostMemory::kHost && memory != SameHostMemory::kDevice) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull serve on '{}': unknown memory flavour {}", path,
                            static_cast<int>(memory)));
  }
  check_peer_timeout(config, "serve");
  same_host::check_private_directory(same_host::socket_directory(path), /*create=*/true);

  auto state = std::make_shared<State>();
  state->plan = plan;
  state->trainer_rank = trainer_rank;
  state->paths = {path};
  state->wake = same_host::make_wake();
  set_flavour(*state, memory, backend, config);
  State::Staging own;
  own.slot_bytes = slot_bytes_for(*plan, trainer_rank);
  own.mapped_bytes = same_host::kSlotCount * own.slot_bytes;
  Fd memory_file;  // host flavour: the sealed memory file the engines map
  same_host::DeviceSlots device_slots;
  if (memory == SameHostMemory::kDevice) {
    device_slots = same_host::create_device_slots(backend, own.slot_bytes);
    own.base = device_slots.base;
    own.device = device_slots.owner;
  } else {
    void* mapped = nullptr;
    memory_file = same_host::make_sealed_staging(own.mapped_bytes, &mapped);
    own.base = static_cast<std::byte*>(mapped);
  }
  state->staging.push_back(own);

  Fd listener = same_host::listen_on(path, engine_processes + 4);
  // Whatever happens from here, the socket file goes: a later trainer need not find it stale.
  struct Unlink {
    const std::string& path;
    ~Unlink() { ::unlink(path.c_str()); }
  } unlink_at_exit{path};

  same_host::PullSetup setup;
  setup.memory = static_cast<std::uint32_t>(memory);
  setup.handle = device_slots.handle;
  setup.trainer_rank = static_cast<std::uint32_t>(trainer_rank);
  setup.trainer_count = static_cast<std::uint32_t>(plan->trainer_count());
  setup.engine_count = static_cast<std::uint32_t>(plan->engine_count());
  setup.fingerprint = plan->fingerprint();
  setup.slot_bytes = own.slot_bytes;
  const auto setup_record = same_host::encode(setup);
  same_host::AdmissionHello hello;
  hello.record_bytes = same_host::record_bytes(RecordType::kPullHello);
  hello.receivers = "engine processes";
  hello.shown_rank_offset = -1;  // engine rank e proves rank e + 1
  hello.answer = [&](std::uint32_t proved, std::span<const std::byte> record,
                     const std::function<bool(std::uint32_t)>& taken) {
    return answer_hello(*plan, trainer_rank, replicas, path, setup_record, proved, record, taken);
  };
  hello.seat_name = [&](std::uint32_t seat) {
    const auto engines = static_cast<std::uint32_t>(plan->engine_count());
    return replicas == 1 ? std::to_string(seat - 1)
                         : fmt::format("{} (replica {})", (seat - 1) % engines,
                                       (seat - 1) / engines);
  };
  state->peers = same_host::admit_receivers(listener.get(), path, token, engine_processes, {},
                                            memory == SameHostMemory::kDevice
                                                ? device_slots.exported_fd
                                                : memory_file.get(),
                                            config, &hello);
  return std::unique_ptr<SameHostPullTransport>(new SameHostPullTransport(std::move(state)));
}

std::unique_ptr<SameHostPullTransport> SameHostPullTransport::connect_engine_rank(
    const std::vector<std::string>& trainer_paths, std::string_view token,
    std::shared_ptr<const RoutingPlan> plan, int engine_rank, Backend& backend,
    SameHostConfig config, int replica) {
  check_token(token, "the same-host token");
  check_plan(plan, "connect");
  check_peer_timeout(config, "connect");
  if (engine_rank < 0 || engine_rank >= plan->engine_count()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull connect: engine rank {} is outside the routing plan's "
                            "0..{}",
                            engine_rank, plan->engine_count() - 1));
  }
  if (replica < 0 || replica > 65535) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull connect as engine rank {}: replica {} is outside "
                            "0..65535",
                            engine_rank, replica));
  }
  if (trainer_paths.size() != static_cast<std::size_t>(plan->trainer_count())) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("same-host pull connect as engine rank {}: {} trainer paths, but the "
                            "routing plan has {} trainer ranks (one path per rank, in rank order)",
                            engine_rank, trainer_paths.size(), plan->trainer_count()));
  }
  for (const std::string& path : trainer_paths) {
    same_host::check_private_directory(same_host::socket_directory(path), /*create=*/true);
  }
  auto state = std::make_shared<State>();
  state->plan = plan;
  state->engine_rank = engine_rank;
  state->replica = replica;
  state->paths = trainer_paths;
  state->wake = same_host::make_wake();
  const auto connect_deadline = Clock::now() + config.connect_timeout;
  const auto rank_on_wire = static_cast<std::uint32_t>(engine_rank) + 1;
  const std::string self = state->self_name();
  for (std::size_t t = 0; t < trainer_paths.size(); ++t) {
    const std::string& path = trainer_paths[t];
    int last_errno = 0;
    Fd socket = same_host::dial(path, connect_deadline, last_errno);
    if (!socket) {
      throw Error(ErrorCode::kTimeout,
                  fmt::format("same-host pull {}: trainer rank {} ({}) never served within {} "
                              "ms ({})",
                              self, t, path, config.connect_timeout.count(),
                              std::strerror(last_errno)));
    }
    const auto deadline = Clock::now() + config.handshake_timeout;
    same_host::prove_to_sender(socket.get(), path, token, rank_on_wire, deadline);
    const same_host::PullHello hello{static_cast<std::uint32_t>(plan->trainer_count()),
                                     static_cast<std::uint32_t>(plan->engine_count()),
                                     static_cast<std::uint32_t>(engine_rank), plan->fingerprint(),
                                     static_cast<std::uint32_t>(replica)};
    const auto failed = [&](const std::string& what, Io io) {
      return Error(io == Io::kTimeout ? ErrorCode::kTimeout : ErrorCode::kTransport,
                   fmt::format("same-host pull connect to '{}' as {}: {}: {}", path, self, what,
                               same_host::describe(io, errno)));
    };
    const auto malformed = [&](const std::string& problem) {
      return Error(ErrorCode::kTransport,
                   fmt::format("same-host pull connect to '{}': {}", path, problem));
    };
    if (const Io io = same_host::write_all(socket.get(), same_host::encode(hello), -1, deadline);
        io != Io::kOk) {
      throw failed("sending the hello", io);
    }
    // The staging fd rides on the setup's first byte: read the header with read_with_fd too, or
    // the kernel discards it.
    std::array<std::byte, same_host::kMaxRecordBytes> answer{};
    Fd memory_file;
    const std::span<std::byte> head(answer.data(), same_host::kHeaderBytes);
    if (const Io io = same_host::read_with_fd(socket.get(), head, memory_file, deadline);
        io != Io::kOk) {
      throw failed("waiting for the trainer's setup", io);
    }
    RecordType type{};
    std::string problem;
    if (!same_host::parse_record_header(head, type, problem)) throw malformed(problem);
    if (type != RecordType::kPullSetup && type != RecordType::kPullRefuse) {
      throw Error(ErrorCode::kTransport,
                  fmt::format("same-host pull connect to '{}': record type {} where a pull "
                              "trainer's setup was expected{}",
                              path, static_cast<int>(type),
                              type == RecordType::kSetup
                                  ? " (a same-host broadcast sender, SameHostTransport::serve, "
                                    "listens there, not a trainer rank of the pull transport)"
                                  : ""));
    }
    const std::size_t size = same_host::record_bytes(type);
    const std::span<std::byte> rest(answer.data() + same_host::kHeaderBytes,
                                    size - same_host::kHeaderBytes);
    if (const Io io = same_host::read_with_fd(socket.get(), rest, memory_file, deadline);
        io != Io::kOk) {
      throw failed("reading the trainer's setup", io);
    }
    const std::span<const std::byte> record(answer.data(), size);
    if (type == RecordType::kPullRefuse) {
      same_host::PullRefuse refusal;
      if (!same_host::decode(record, refusal, problem)) throw malformed(problem);
      throw refused(refusal, *plan, engine_rank, replica, path);
    }
    same_host::PullSetup setup;
    if (!same_host::decode(record, setup, problem)) throw malformed(problem);
    if (setup.trainer_rank != t) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("{} is served by trainer rank {}; expected {} (trainer paths go in "
                              "trainer rank order, each once)",
                              path, setup.trainer_rank, t));
    }
    // The trainer checked the hello against its plan; a setup that disagrees is not ours.
    if (setup.trainer_count != hello.trainer_count || setup.engine_count != hello.engine_count ||
        setup.fingerprint != hello.fingerprint ||
        setup.slot_bytes < plan->max_packed_bytes(static_cast<int>(t))) {
      throw Error(ErrorCode::kTransport,
                  fmt::format("same-host pull connect to '{}': the trainer's setup ({} trainer "
                              "ranks, {} engine ranks, plan {:#018x}, slots of {} bytes) does not "
                              "match this engine rank's plan ({}, {}, {:#018x}, at least {} "
                              "bytes)",
                              path, setup.trainer_count, setup.engine_count, setup.fingerprint,
                              setup.slot_bytes, hello.trainer_count, hello.engine_count,
                              hello.fingerprint, plan->max_packed_bytes(static_cast<int>(t))));
    }
    const auto memory = static_cast<SameHostMemory>(setup.memory);
    if (memory != SameHostMemory::kHost && memory != SameHostMemory::kDevice) {
      throw Error(ErrorCode::kTransport,
                  fmt::format("same-host pull connect to '{}': the trainer's setup names memory "
                              "flavour {}, which this library does not know",
                              path, setup.memory));
    }
    if (t == 0) {
      if (memory == SameHostMemory::kHost && backend.name() != "host") {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("same-host pull connect as engine rank {}: trainer rank 0 ({}) "
                                "shares host memory, but this engine rank's backend is '{}'; "
                                "host memory is pulled with a HostBackend (give the trainer "
                                "ranks a CudaBackend to serve device memory)",
                                engine_rank, path, backend.name()));
      }
      set_flavour(*state, memory, backend, config);
    } else if ((memory == SameHostMemory::kDevice) != state->device) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("same-host pull connect as engine rank {}: trainer rank {} ({}) "
                              "shares {} memory, but trainer rank 0 shares {} memory; every "
                              "trainer rank must serve the same flavour",
                              engine_rank, t, path, flavour_name(memory),
                              flavour_name(state->device ? SameHostMemory::kDevice
                                                         : SameHostMemory::kHost)));
    }
    if (state->device) {
      same_host::DeviceSlots slots =
          same_host::open_device_slots(backend, std::move(memory_file), setup, path);
      state->staging.push_back({slots.base, same_host::kSlotCount * slots.slot_bytes,
                                slots.slot_bytes, std::move(slots.owner)});
    } else {
      const same_host::MappedStaging mapped = same_host::map_received_staging(
          memory_file, setup.slot_bytes, path, "same-host pull connect", "trainer");
      state->staging.push_back(
          {mapped.base, mapped.bytes, static_cast<std::size_t>(setup.slot_bytes), nullptr});
    }
    state->peers.push_back(std::move(socket));
  }
  return std::unique_ptr<SameHostPullTransport>(new SameHostPullTransport(std::move(state)));
}

}  // namespace shadowsync
