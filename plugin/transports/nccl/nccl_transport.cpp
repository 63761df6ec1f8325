// NcclTransport: the Transport interface on a nonblocking NCCL communicator. See
// nccl_transport.h for the contract of each call.
//
// How the nonblocking communicator is driven. With ncclConfig_t::blocking = 0, every NCCL call
// except ncclCommAbort and ncclCommDestroy returns at once; one that has work left returns
// ncclInProgress, and the communicator's state (ncclCommGetAsyncError) stays ncclInProgress until
// that work is done. Until the state is ncclSuccess, NCCL forbids any other call on the
// communicator (it answers "Attempt to use communicator before the previous operation returned
// ncclSuccess") and any other work on the streams NCCL enqueues to. So every call here that may
// return ncclInProgress is followed by a poll of the state, against a deadline, before it
// returns: the caller can record an event right after broadcast_async() or group_end().
//
// Inside a group, broadcasts only queue work; group_end() launches it and is the call that may
// return ncclInProgress. The first collective of a communicator also connects its peers
// (NCCL's runtime connection), which needs the other ranks to reach the same collective: that
// is what enqueue_timeout bounds.
#include "shadowsync/nccl_transport.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>

#include <fmt/format.h>

#include "backends/cuda/cuda_check.h"
#include "backends/cuda/scoped_device.h"
#include "core/p2p_schedule.h"
#include "core/route_mover.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "transports/nccl/nccl_library.h"
#include "transports/nccl/nccl_route_mover.h"

static_assert(sizeof(ncclUniqueId) == shadowsync::NcclUniqueId::kSize,
              "NcclUniqueId must hold exactly an ncclUniqueId");
static_assert(std::is_same_v<ncclComm_t, ::ncclComm*>, "ncclComm_t is expected to be ncclComm*");

namespace shadowsync {

namespace {

using Clock = std::chrono::steady_clock;

// The process's NCCL, loaded by the first create() or generate_unique_id(); may throw only there.
// Every other caller holds a transport, so the library is loaded and this returns at once.
const nccl_detail::NcclApi& nccl() { return nccl_detail::NcclLibrary::process().api(); }

// Poll back-off: enqueueing normally completes in microseconds, while init and the first
// collective's connection setup take up to seconds; doubling from a few microseconds to a
// millisecond serves both without a hot spin.
constexpr std::chrono::microseconds kFirstPollSleep{5};
constexpr std::chrono::microseconds kLongestPollSleep{1000};

void sleep_backoff(std::chrono::microseconds& sleep) {
  std::this_thread::sleep_for(sleep);
  sleep = std::min(sleep * 2, kLongestPollSleep);
}

Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const Clock::time_point now = Clock::now();
  if (timeout >= Clock::time_point::max() - now) return Clock::time_point::max();
  return now + timeout;
}

// NVLink SHARP (NVLS) builds multicast objects on the NVSwitches. On the shared GPU hosts this
// project runs on, a program using multicast can take the host's GPUs, which others share, out
// of service for a day or more; a bulk broadcast gains nothing from it either. So multicast stays
// off unless the user decided otherwise in the environment (overwrite = 0 keeps their setting).
// NCCL reads its environment once, at its first initialization, so this runs before every NCCL
// call of ours; setenv races with getenv on other threads, hence once, under call_once. A process
// that initialized NCCL elsewhere first (or where other threads read the environment) should set
// NCCL_NVLS_ENABLE=0 itself at startup.
void disable_nvls_once() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0); });
}

// "unhandled system error (ncclResult 2); <last error detail>"
std::string nccl_message(ncclResult_t result, ncclComm_t comm) {
  const char* last = nccl().get_last_error(comm);
  return fmt::format("{} (ncclResult {}){}{}", nccl().get_error_string(result),
                     static_cast<int>(result), last != nullptr && *last != '\0' ? "; " : "",
                     last != nullptr ? last : "");
}

// Invalid arguments and usage leave the communicator as it was; anything else breaks it.
bool is_caller_error(ncclResult_t result) {
  return result == ncclInvalidArgument || result == ncclInvalidUsage;
}

}  // namespace

NcclLibraryInfo NcclTransport::library() {
  const nccl_detail::NcclLibrary& library = nccl_detail::NcclLibrary::process();
  return NcclLibraryInfo{library.path(), library.version(), library.place()};
}

void NcclTransport::add_python_path(std::string_view paths) { nccl_detail::add_python_path(paths); }

NcclUniqueId NcclTransport::generate_unique_id() {
  disable_nvls_once();
  ncclUniqueId raw;
  const ncclResult_t result = nccl().get_unique_id(&raw);
  if (result != ncclSuccess) {
    throw Error(ErrorCode::kTransport,
                fmt::format("ncclGetUniqueId failed: {}", nccl_message(result, nullptr)));
  }
  NcclUniqueId id;
  std::memcpy(id.bytes.data(), &raw, NcclUniqueId::kSize);
  return id;
}

std::unique_ptr<NcclTransport> NcclTransport::create(const NcclUniqueId& id, int rank,
                                                     int world_size, int device,
                                                     NcclTransportConfig config) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create: rank {} is not in [0, world_size = {})", rank,
                            world_size));
  }
  if (config.max_ctas < 0 || config.min_ctas < 0 || config.cga_cluster_size < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create: max_ctas ({}), min_ctas ({}) and "
                            "cga_cluster_size ({}) must be >= 0 (0: NCCL's default)",
                            config.max_ctas, config.min_ctas, config.cga_cluster_size));
  }
  if (config.max_ctas > 0 && config.min_ctas > config.max_ctas) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create: min_ctas {} exceeds max_ctas {}",
                            config.min_ctas, config.max_ctas));
  }
  if (config.init_timeout.count() <= 0 || config.enqueue_timeout.count() <= 0 ||
      config.finalize_timeout.count() <= 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create: timeouts must be > 0 ms, got init {} ms, "
                            "enqueue {} ms, finalize {} ms",
                            config.init_timeout.count(), config.enqueue_timeout.count(),
                            config.finalize_timeout.count()));
  }
  int device_count = 0;
  SHADOWSYNC_CUDA_CHECK(cudaGetDeviceCount(&device_count), "NcclTransport::create(device={})",
                        device);
  if (device < 0 || device >= device_count) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create: device {} does not exist; this process sees "
                            "{} CUDA device(s)",
                            device, device_count));
  }

  disable_nvls_once();
  // NCCL binds the communicator to the current device.
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device), "device={}", device);

  ncclConfig_t nccl_config = NCCL_CONFIG_INITIALIZER;
  nccl_config.blocking = 0;
  if (config.max_ctas > 0) nccl_config.maxCTAs = config.max_ctas;
  if (config.min_ctas > 0) nccl_config.minCTAs = config.min_ctas;
  if (config.cga_cluster_size > 0) nccl_config.cgaClusterSize = config.cga_cluster_size;

  ncclUniqueId raw_id;
  std::memcpy(&raw_id, id.bytes.data(), NcclUniqueId::kSize);

  ncclComm_t comm = nullptr;
  const ncclResult_t result =
      nccl().comm_init_rank_config(&comm, world_size, raw_id, rank, &nccl_config);
  if (result != ncclSuccess && result != ncclInProgress) {
    const std::string message = nccl_message(result, comm);
    if (comm != nullptr) (void)nccl().comm_abort(comm);
    throw Error(is_caller_error(result) ? ErrorCode::kInvalidArgument : ErrorCode::kTransport,
                fmt::format("NcclTransport (rank {} of {}, device {}): ncclCommInitRankConfig "
                            "failed: {}",
                            rank, world_size, device, message));
  }

  std::unique_ptr<NcclTransport> transport;
  try {
    transport.reset(new NcclTransport(comm, rank, world_size, device, config));
  } catch (...) {
    (void)nccl().comm_abort(comm);
    throw;
  }
  // On failure this aborts the communicator and throws; the transport's destructor then has
  // nothing left to do.
  transport->wait_until_ready(
      "communicator init (every rank must call create() with the same "
      "id and world size)",
      config.init_timeout);
  return transport;
}

// The route mover's calls, on this transport's communicator: its group brackets, and
// point-to-point ops enqueued as broadcasts are (lock, enqueue deadline, abort).
class NcclTransport::P2p final : public nccl_detail::P2pCommunicator {
 public:
  explicit P2p(NcclTransport& transport) : transport_(transport) {}
  void group_begin() override { transport_.group_begin(); }
  void group_end() override { transport_.group_end(); }
  void send_async(const void* buffer, std::size_t bytes, int peer, Stream& stream) override {
    // ncclSend only reads the buffer.
    transport_.p2p_async(true, const_cast<void*>(buffer), bytes, peer, stream);
  }
  void recv_async(void* buffer, std::size_t bytes, int peer, Stream& stream) override {
    transport_.p2p_async(false, buffer, bytes, peer, stream);
  }

 private:
  NcclTransport& transport_;
};

std::unique_ptr<NcclTransport> NcclTransport::create_routed(const NcclUniqueId& id, int rank,
                                                            int device,
                                                            std::shared_ptr<const RoutingPlan> plan,
                                                            const Layout& wire, Backend& backend,
                                                            NcclRouteConfig route_config,
                                                            NcclTransportConfig config) {
  if (plan == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, "NcclTransport::create_routed: no routing plan");
  }
  // Before NCCL: its own refusal of two ranks on one GPU comes only after every rank joined,
  // and names neither role.
  check_p2p_gpus(*plan, route_config.gpus, route_config.replicas);
  (void)comm_place(*plan, rank, route_config.replicas);  // a rank outside the communicator
  if (backend.name() != "cuda") {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("NcclTransport::create_routed: backend '{}' given; NCCL moves device "
                            "memory: give the CUDA backend of device {}",
                            backend.name(), device));
  }
  const int world_size =
      plan->trainer_count() + route_config.replicas * plan->engine_count();
  std::unique_ptr<NcclTransport> transport = create(id, rank, world_size, device, config);
  transport->p2p_ = std::make_unique<P2p>(*transport);
  transport->route_mover_ = std::make_unique<nccl_detail::NcclRouteMover>(
      *transport->p2p_, std::move(plan), wire, rank, backend, route_config.replicas);
  return transport;
}

RouteMover* NcclTransport::route_mover() { return route_mover_.get(); }

NcclTransport::NcclTransport(::ncclComm* comm, int rank, int world_size, int device,
                             NcclTransportConfig config) noexcept
    : rank_(rank), world_size_(world_size), device_(device), config_(config), comm_(comm) {}

NcclTransport::~NcclTransport() {
  std::lock_guard lock(mutex_);
  if (comm_ == nullptr) return;
  if (group_depth_ > 0) {
    std::fprintf(stderr,
                 "shadowsync: NcclTransport (rank %d of %d, device %d) destroyed with %d open "
                 "group_begin() call(s); aborting the communicator\n",
                 rank_, world_size_, device_, group_depth_);
    group_depth_ = 0;
    abort_locked("destroyed with an open group");
    return;
  }
  if (abort_pending_) {
    abort_locked(abort_reason_);
    return;
  }

  cuda_detail::ScopedDeviceNoThrow device(device_);
  ncclResult_t state = ncclSuccess;
  ncclResult_t result = nccl().comm_get_async_error(comm_, &state);
  if (result != ncclSuccess || state != ncclSuccess) {
    // Broken (or, after a caller's error, still busy): finalizing is not allowed, abort.
    abort_locked("destroyed while the communicator was not healthy");
    return;
  }
  // Finalize flushes our enqueued work; it may never end if a peer died with a collective
  // pending, hence the deadline (the lock stays held: no other call may run now).
  result = nccl().comm_finalize(comm_);
  if (result == ncclSuccess || result == ncclInProgress) {
    const Clock::time_point deadline = deadline_after(config_.finalize_timeout);
    std::chrono::microseconds sleep = kFirstPollSleep;
    for (;;) {
      if (nccl().comm_get_async_error(comm_, &state) != ncclSuccess) break;
      if (state != ncclInProgress || Clock::now() >= deadline) break;
      sleep_backoff(sleep);
    }
    if (state == ncclSuccess) {
      result = nccl().comm_destroy(comm_);
      if (result != ncclSuccess) {
        std::fprintf(stderr,
                     "shadowsync: NcclTransport (rank %d of %d, device %d): ncclCommDestroy: %s\n",
                     rank_, world_size_, device_, nccl().get_error_string(result));
      }
      comm_ = nullptr;
      return;
    }
  }
  abort_locked(fmt::format("ncclCommFinalize did not complete within {} ms",
                           config_.finalize_timeout.count()));
}

std::string NcclTransport::describe() const {
  return fmt::format("NcclTransport (rank {} of {}, device {})", rank_, world_size_, device_);
}

void NcclTransport::wait_until_ready(const char* what, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = deadline_after(timeout);
  std::chrono::microseconds sleep = kFirstPollSleep;
  for (;;) {
    {
      std::lock_guard lock(mutex_);
      if (comm_ == nullptr || abort_pending_) {
        throw Error(ErrorCode::kTransport, fmt::format("{}: {}: the communicator was aborted ({})",
                                                       describe(), what, abort_reason_));
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t result = nccl().comm_get_async_error(comm_, &state);
      if (result != ncclSuccess) state = result;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const std::string message =
            fmt::format("{}: {} failed: {}", describe(), what, nccl_message(state, comm_));
        abort_locked(message);
        throw Error(ErrorCode::kTransport, message);
      }
      if (Clock::now() >= deadline) {
        const std::string message =
            fmt::format("{}: {} did not complete within {} ms", describe(), what, timeout.count());
        abort_locked(message);
        throw Error(ErrorCode::kTimeout, message);
      }
    }
    sleep_backoff(sleep);  // without the lock: abort() may come in meanwhile
  }
}

void NcclTransport::broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) {
  if (root < 0 || root >= world_size_) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: broadcast root {} is not in [0, {})",
                                                         describe(), root, world_size_));
  }
  if (buffer == nullptr && bytes > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: broadcast of {} bytes into a null buffer", describe(), bytes));
  }
  const cudaStream_t cuda_stream = CudaBackend::native(stream);  // throws for a foreign stream
  const int stream_device = CudaBackend::device_of(stream);
  if (stream_device != device_) {
    throw Error(
        ErrorCode::kInvalidArgument,
        fmt::format("{}: the broadcast's stream belongs to device {}", describe(), stream_device));
  }

  std::unique_lock lock(mutex_);
  if (comm_ == nullptr || abort_pending_) {
    throw Error(ErrorCode::kTransport,
                fmt::format("{}: broadcast of {} bytes from root {}: the communicator was aborted "
                            "({})",
                            describe(), bytes, root, abort_reason_));
  }
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device_), "device={}", device_);
  // In place: for a broadcast NCCL allows sendbuff == recvbuff, and the root's buffer is only
  // read. Bytes as ncclUint8 so any tensor image goes through unchanged.
  const ncclResult_t result =
      nccl().broadcast(buffer, buffer, bytes, ncclUint8, root, comm_, cuda_stream);
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) {
    if (group_depth_ > 0) return;  // group_end() waits for the whole group
    lock.unlock();
    wait_until_ready("broadcast enqueue", config_.enqueue_timeout);
    return;
  }
  const std::string message =
      fmt::format("{}: ncclBroadcast of {} bytes at {} from root {} failed: {}", describe(), bytes,
                  buffer, root, nccl_message(result, comm_));
  if (is_caller_error(result)) throw Error(ErrorCode::kInvalidArgument, message);
  // Inside a group the abort waits for group_end(), which the caller still owes NCCL.
  abort_locked(message);
  throw Error(ErrorCode::kTransport, message);
}

void NcclTransport::p2p_async(bool send, void* buffer, std::size_t bytes, int peer,
                              Stream& stream) {
  const char* call = send ? "ncclSend" : "ncclRecv";
  if (peer < 0 || peer >= world_size_ || peer == rank_) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} with peer {}: not another rank of [0, {})", describe(), call,
                            peer, world_size_));
  }
  if (buffer == nullptr && bytes > 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} of {} bytes with a null buffer", describe(), call, bytes));
  }
  const cudaStream_t cuda_stream = CudaBackend::native(stream);  // throws for a foreign stream
  const int stream_device = CudaBackend::device_of(stream);
  if (stream_device != device_) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("{}: the {}'s stream belongs to device {}",
                                                         describe(), call, stream_device));
  }

  std::unique_lock lock(mutex_);
  if (comm_ == nullptr || abort_pending_) {
    throw Error(ErrorCode::kTransport,
                fmt::format("{}: {} of {} bytes with rank {}: the communicator was aborted ({})",
                            describe(), call, bytes, peer, abort_reason_));
  }
  SHADOWSYNC_CUDA_CHECK(cudaSetDevice(device_), "device={}", device_);
  const ncclResult_t result = send
                                  ? nccl().send(buffer, bytes, ncclUint8, peer, comm_, cuda_stream)
                                  : nccl().recv(buffer, bytes, ncclUint8, peer, comm_, cuda_stream);
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) {
    if (group_depth_ > 0) return;  // group_end() waits for the whole group
    lock.unlock();
    wait_until_ready(send ? "send enqueue" : "receive enqueue", config_.enqueue_timeout);
    return;
  }
  const std::string message =
      fmt::format("{}: {} of {} bytes at {} with rank {} failed: {}", describe(), call, bytes,
                  buffer, peer, nccl_message(result, comm_));
  if (is_caller_error(result)) throw Error(ErrorCode::kInvalidArgument, message);
  // Inside a group the abort waits for group_end(), which the caller still owes NCCL.
  abort_locked(message);
  throw Error(ErrorCode::kTransport, message);
}

void NcclTransport::group_begin() {
  std::lock_guard lock(mutex_);
  if (comm_ == nullptr || abort_pending_) {
    // No group is opened: the caller must not call group_end() for this one.
    throw Error(ErrorCode::kTransport,
                fmt::format("{}: group_begin: the communicator was aborted ({})", describe(),
                            abort_reason_));
  }
  const ncclResult_t result = nccl().group_start();
  if (result != ncclSuccess) {
    throw Error(ErrorCode::kTransport, fmt::format("{}: ncclGroupStart failed: {}", describe(),
                                                   nccl_message(result, comm_)));
  }
  ++group_depth_;
}

void NcclTransport::group_end() {
  std::unique_lock lock(mutex_);
  if (group_depth_ == 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: group_end without a matching group_begin", describe()));
  }
  // Best effort: ncclGroupEnd must run whatever happens, or this thread's NCCL group stays open.
  (void)cudaSetDevice(device_);
  cuda_detail::clear_last_error();
  const ncclResult_t result = nccl().group_end();
  --group_depth_;
  if (group_depth_ > 0) {
    // Nested: NCCL launches at the outermost end; only a hard failure matters here.
    if (result != ncclSuccess && result != ncclInProgress) {
      throw Error(is_caller_error(result) ? ErrorCode::kInvalidArgument : ErrorCode::kTransport,
                  fmt::format("{}: nested ncclGroupEnd failed: {}", describe(),
                              nccl_message(result, comm_)));
    }
    return;
  }
  if (comm_ == nullptr || abort_pending_) {
    // abort() came while the group was open; NCCL's group is closed now, so it can run.
    abort_locked(abort_reason_);
    throw Error(
        ErrorCode::kTransport,
        fmt::format("{}: group_end: the communicator was aborted ({})", describe(), abort_reason_));
  }
  if (result == ncclSuccess) return;
  if (result == ncclInProgress) {
    lock.unlock();
    wait_until_ready("group enqueue", config_.enqueue_timeout);
    return;
  }
  const std::string message =
      fmt::format("{}: ncclGroupEnd failed: {}", describe(), nccl_message(result, comm_));
  if (is_caller_error(result)) throw Error(ErrorCode::kInvalidArgument, message);
  abort_locked(message);
  throw Error(ErrorCode::kTransport, message);
}

std::optional<std::string> NcclTransport::async_error() {
  if (aborted_.load(std::memory_order_acquire)) {
    // Never wait behind an abort in progress (it can take a while): say so instead.
    std::unique_lock lock(mutex_, std::try_to_lock);
    return fmt::format("{}: the communicator was aborted ({})", describe(),
                       lock.owns_lock() ? abort_reason_ : std::string("abort in progress"));
  }
  std::lock_guard lock(mutex_);
  if (comm_ == nullptr) {
    return fmt::format("{}: the communicator was aborted ({})", describe(), abort_reason_);
  }
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = nccl().comm_get_async_error(comm_, &state);
  if (result != ncclSuccess) {
    return fmt::format("{}: ncclCommGetAsyncError failed: {}", describe(),
                       nccl_message(result, comm_));
  }
  if (state == ncclSuccess || state == ncclInProgress) return std::nullopt;
  return fmt::format("{}: asynchronous NCCL error: {}", describe(), nccl_message(state, comm_));
}

void NcclTransport::abort() noexcept {
  try {
    std::lock_guard lock(mutex_);
    abort_locked("abort() was called");
  } catch (...) {
    // Only std::mutex::lock can throw here (a system error); nothing better to do than report.
    std::fprintf(stderr, "shadowsync: NcclTransport::abort: could not take the lock\n");
  }
}

void NcclTransport::abort_locked(const std::string& reason) noexcept {
  if (comm_ == nullptr) return;
  aborted_.store(true, std::memory_order_release);
  try {
    if (abort_reason_.empty()) abort_reason_ = reason;
  } catch (...) {  // out of memory copying the reason: abort anyway
  }
  if (group_depth_ > 0) {
    // The owner thread has an NCCL group open that refers to the communicator: aborting now
    // would free it under that group (and, on the owner thread itself, NCCL would queue the
    // abort into the open group). group_end() runs it.
    abort_pending_ = true;
    return;
  }
  cuda_detail::ScopedDeviceNoThrow device(device_);
  // Blocking even for a nonblocking communicator: sets the abort flag that NCCL kernels poll, so
  // kernels waiting for a lost peer exit and their streams move on; then frees the communicator.
  const ncclResult_t result = nccl().comm_abort(comm_);
  if (result != ncclSuccess) {
    std::fprintf(stderr,
                 "shadowsync: NcclTransport (rank %d of %d, device %d): ncclCommAbort: %s\n", rank_,
                 world_size_, device_, nccl().get_error_string(result));
  }
  comm_ = nullptr;
  abort_pending_ = false;
}

}  // namespace shadowsync
