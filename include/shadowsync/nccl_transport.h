// NcclTransport: the Transport interface on a nonblocking NCCL communicator.
//
// Nonblocking (ncclConfig_t::blocking = 0) because no NCCL call may trap the receiver thread:
// every call returns at once, possibly with ncclInProgress, and this class polls the
// communicator's state against a deadline. When a deadline passes or NCCL reports an error, the
// communicator is aborted (ncclCommAbort) and the call throws; the transport is dead afterwards,
// and the next rendezvous needs a new one (a new NcclUniqueId).
//
// NCCL is opened at run time (dlopen), when the first call below needs it, not linked: a process
// that also runs torch has torch's NCCL in it, and two NCCLs in one process break one another
// (their sonames collide). Which library is used, and how to choose it: see library().
//
// This header does not include nccl.h or cuda_runtime.h.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shadowsync/transport.h"

struct ncclComm;  // NCCL's opaque communicator: ncclComm_t is ncclComm*.

namespace shadowsync {

class Layout;
class RoutingPlan;  // plugin/core/routing_plan.h: a sharded trainer's routes (DESIGN §14)

// The rendezvous token of one communicator: ncclUniqueId's 128 bytes.
using NcclUniqueId = RendezvousId;

// The NCCL library this process uses (NcclTransport::library()).
struct NcclLibraryInfo {
  std::string path;   // the file as the process maps it (symbolic links resolved)
  int version = 0;    // ncclGetVersion's code: 22809 is NCCL 2.28.9
  std::string place;  // where it was found: "already loaded by the process", ...
};

struct NcclTransportConfig {
  // Bounds on the CTAs (thread blocks, one per SM) each NCCL kernel uses; 0 leaves NCCL's default.
  // A low max_ctas leaves SMs to the engine's decode kernels while a transfer runs, at some cost
  // in bandwidth (NVLink broadcast reaches ~360 GB/s with NCCL's default channel count on H200).
  int max_ctas = 0;
  int min_ctas = 0;
  // Thread-block cluster size of NCCL kernels on sm_90+; 0 leaves NCCL's default. (NCCL itself
  // reads 0 as "no clusters"; to get that, set NCCL_CGA_CLUSTER_SIZE=0 in the environment.)
  int cga_cluster_size = 0;

  // How long create() waits for every rank to join. Generous: ranks start at different times
  // (a trainer loading its checkpoint, an engine compiling CUDA graphs).
  std::chrono::milliseconds init_timeout{std::chrono::minutes(5)};
  // How long a broadcast or group_end waits for NCCL to finish enqueueing (ncclInProgress). The
  // first collective connects the ranks' peers lazily, which needs every rank to make that call,
  // so this is a bound on how far apart ranks start a transfer, not on the transfer itself (a
  // transfer is bounded by the caller's wait on its event).
  std::chrono::milliseconds enqueue_timeout{std::chrono::minutes(2)};
  // How long the destructor lets ncclCommFinalize flush outstanding work before it aborts instead.
  std::chrono::milliseconds finalize_timeout{std::chrono::seconds(30)};
};

// What create_routed() needs beyond create()'s arguments.
struct NcclRouteConfig {
  // The GPU of every communicator rank, trainer ranks first, then each replica's engine ranks
  // (M + replicas x N entries): any name unique to a GPU across the hosts, such as the host name
  // and the device's UUID. NCCL cannot connect two ranks of one communicator on one GPU;
  // create_routed() refuses that before NCCL is called.
  std::vector<std::string> gpus;
  // Data-parallel replicas of the engine, R >= 1: R x N engine ranks join the communicator.
  // Each trainer rank still sends every route once, to replica 0; each replica's engine rank
  // forwards the bucket it landed to the next replica's (a chain: p2p_schedule.h).
  int replicas = 1;
};

class NcclTransport final : public Transport {
 public:
  // Joins communicator `id` as `rank` of `world_size` on CUDA device `device`: every rank calls
  // this with the same id and world_size. Blocks until all ranks joined or config.init_timeout
  // passed (then aborts and throws Error(kTimeout)). NCCL failures throw Error(kTransport), bad
  // arguments Error(kInvalidArgument). Sets NCCL_NVLS_ENABLE=0 unless the environment sets it.
  // Makes `device` current on the calling thread.
  // The NCCL library every transport of this process uses; loads it on the first call (of this,
  // generate_unique_id() or create()) that succeeds, and prints one line on stderr then:
  //   shadowsync: NCCL 2.28.9 from /usr/lib/x86_64-linux-gnu/libnccl.so.2 (<place>)
  // unless SHADOWSYNC_NCCL_QUIET is set (to anything but "" or "0"). Later calls return the same.
  //
  // Where it looks, in order; the first usable library wins:
  //   1. SHADOWSYNC_NCCL_LIBRARY, when set: the path of the library to use. An explicit choice wins
  //      over every search and is then the only place looked at, so that a mistake in it is an
  //      error rather than quietly another NCCL. (An NCCL the process already has stays loaded;
  //      the stderr line then says that the process has two.)
  //   2. An NCCL the process already has (torch's): any loaded libnccl.so*, else what
  //      dlopen("libnccl.so.2", RTLD_NOLOAD) finds. Using it keeps one NCCL in the process.
  //   3. The nvidia-nccl-cu* Python package, <site-packages>/nvidia/nccl/lib/libnccl.so.2, for the
  //      site-packages (or dist-packages) directories holding a loaded library (libtorch, any
  //      extension module, a pip-installed libshadowsync_c.so), the directories an embedding
  //      Python named with add_python_path (the Python package hands over its sys.path when it
  //      loads the library), those of PYTHONPATH, and
  //      <prefix>/lib/python3*/{site,dist}-packages for VIRTUAL_ENV, CONDA_PREFIX and, in a python
  //      interpreter, its own prefix and ~/.local. That is the file torch loads when imported
  //      later, so the process still ends up with one NCCL.
  //   4. The system's: dlopen("libnccl.so.2") through the dynamic loader's search path.
  // Usable means: loads, exports ncclGetVersion, is NCCL 2.14.0 or newer (nonblocking
  // communicators, ncclCommFinalize, CTA limits) and exports every function the transport calls.
  // Throws Error(kTransport) listing every place looked at and why each failed; a failure is not
  // remembered, the next call searches again. Thread-safe.
  static NcclLibraryInfo library();

  // Directories (a sys.path, ':'-separated) searched in step 3 above for
  // nvidia/nccl/lib/libnccl.so.2 before the library's own guesses: a Python knows where its
  // packages are, the library can only guess. Loads nothing. Thread-safe.
  static void add_python_path(std::string_view paths);

  // ncclGetUniqueId: rank 0's side makes the id and sends it to every rank over the control plane.
  // Opens a listening socket for the bootstrap in this process, so call it on the side that will
  // take part as a rank. Throws Error(kTransport). Thread-safe.
  static NcclUniqueId generate_unique_id();

  static std::unique_ptr<NcclTransport> create(const NcclUniqueId& id, int rank, int world_size,
                                               int device, NcclTransportConfig config = {});

  // A communicator of the M trainer ranks and N engine ranks of routing plan `plan` (built on
  // `wire`) that moves its routes: route_mover() is then non-null, as create()'s transport
  // otherwise (its broadcasts work the same). Communicator rank `rank`: trainer rank t is t,
  // engine rank e of replica r is M + r x N + e; world size M + R x N (R: route_config.replicas).
  // Every rank calls this with the same id, an equal plan and the same R. Refused with
  // Error(kInvalidArgument) before NCCL is called: route_config.gpus not naming one GPU per
  // rank, or two ranks on one GPU ("trainer rank 1 and engine rank 0 (communicator rank 2) are
  // both on GPU '...'": use the same-host pull transport), replicas < 1, a rank outside the
  // communicator. Then as create(). An engine rank allocates its landing
  // buffer (the largest bucket it receives) from `backend`, the CudaBackend of `device` whose
  // streams the routed calls get; `backend` must outlive the transport.
  static std::unique_ptr<NcclTransport> create_routed(const NcclUniqueId& id, int rank, int device,
                                                      std::shared_ptr<const RoutingPlan> plan,
                                                      const Layout& wire, Backend& backend,
                                                      NcclRouteConfig route_config,
                                                      NcclTransportConfig config = {});

  // ncclCommFinalize (bounded by finalize_timeout) then ncclCommDestroy; ncclCommAbort instead
  // when finalizing fails or times out; nothing more after abort(). No other call may be running.
  ~NcclTransport() override;

  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  std::string_view name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  int device() const noexcept { return device_; }

  // ncclBroadcast in place (sendbuff == recvbuff) of `bytes` bytes on `stream`, which must come
  // from a CudaBackend of this transport's device. Outside a group, returns once NCCL has
  // enqueued the work (polling ncclInProgress against enqueue_timeout); inside a group, once
  // NCCL has queued it for group_end(). Throws Error(kInvalidArgument) for a bad root or stream,
  // Error(kTransport) for an NCCL failure or an aborted transport, Error(kTimeout) when
  // enqueueing passed its deadline (the transport is aborted then). Owner thread only.
  void broadcast_async(void* buffer, std::size_t bytes, int root, Stream& stream) override;

  // ncclGroupStart / ncclGroupEnd. group_end() polls ncclInProgress like broadcast_async and
  // throws like it. group_end() must follow group_begin() even when a broadcast in between threw
  // (NCCL's group state is per thread). Owner thread only.
  void group_begin() override;
  void group_end() override;

  // ncclCommGetAsyncError: nullopt while the communicator is healthy (ncclSuccess or
  // ncclInProgress), else NCCL's error string and last-error detail; after abort() a message
  // saying so (with the failure that led to it, if any). Thread-safe.
  std::optional<std::string> async_error() override;

  // The routes of a create_routed() transport (nccl_route_mover.h: one NCCL group of
  // ncclSend/ncclRecv per bucket per rank, receives posted only inside receive_routes_async);
  // nullptr for create()'s. Lives as long as the transport.
  RouteMover* route_mover() override;

  // ncclCommAbort, once: kernels of this communicator still running on the GPU exit, so every
  // enqueued collective completes (with undefined bytes in its buffer). When called while the
  // owner thread is between group_begin() and group_end(), the abort happens at group_end()
  // (aborting under an open group would leave NCCL's per-thread group state pointing at a freed
  // communicator); until then async_error() already reports it. Blocks while NCCL tears down.
  // Thread-safe, idempotent.
  void abort() noexcept override;

 private:
  NcclTransport(::ncclComm* comm, int rank, int world_size, int device,
                NcclTransportConfig config) noexcept;

  // Polls the communicator until it leaves ncclInProgress; throws (after aborting) on error or
  // when `timeout` passes. `what` names the operation in messages.
  void wait_until_ready(const char* what, std::chrono::milliseconds timeout);
  void abort_locked(const std::string& reason) noexcept;  // requires mutex_
  std::string describe() const;                           // "rank 1 of 2, device 1"

  // ncclSend (`send`) or ncclRecv of `bytes` bytes with communicator rank `peer` on `stream`;
  // checks, enqueues and throws as broadcast_async. Owner thread only.
  void p2p_async(bool send, void* buffer, std::size_t bytes, int peer, Stream& stream);
  class P2p;  // the route mover's view of this communicator (nccl_transport.cpp)

  const int rank_;
  const int world_size_;
  const int device_;
  const NcclTransportConfig config_;

  // Guards comm_'s lifetime and serializes every NCCL call on it: NCCL allows one thread at a time
  // per communicator, and abort() must not free it under another thread's call. Never held while
  // sleeping between polls, so abort() gets in promptly.
  mutable std::mutex mutex_;
  ::ncclComm* comm_;                  // nullptr once aborted or destroyed
  int group_depth_ = 0;               // open group_begin()s of the owner thread
  bool abort_pending_ = false;        // abort() came while a group was open
  std::string abort_reason_;          // why the communicator was (or will be) aborted
  std::atomic<bool> aborted_{false};  // abort requested: checked without the lock in poll loops

  // create_routed() only. Destroyed after the destructor's body finalized or aborted the
  // communicator, the mover first (it frees its landing buffer).
  std::unique_ptr<P2p> p2p_;
  std::unique_ptr<RouteMover> route_mover_;
};

}  // namespace shadowsync
