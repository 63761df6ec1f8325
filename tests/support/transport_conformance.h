// Transport conformance: one set of test bodies that every Transport must pass, run against each
// transport through a TransportFixture (the ggml backend-ops habit: write the test once, run it
// on every implementation). tests/unit/test_transport_conformance.cpp runs it on the loopback
// transport, tests/gpu/test_nccl_conformance.cpp on NCCL.
//
// Each case runs one thread per rank, each driving its own stream on its own backend, as ranks do
// in real use. Rank threads coordinate through the case's signals, every wait has a deadline that
// fails loudly, and no case sleeps to win a race: a check that something has NOT happened is
// only made while the thing is impossible (the root held back).
//
// Not every transport can do everything a case needs: the same-host transport sends only from
// rank 0. A fixture says what its transport cannot do through capabilities(); a case that needs
// more is not run on it and comes back skipped, naming the capability, so that a report shows
// what was not covered instead of a pass.
//
// After an abort, NCCL refuses new work by throwing from broadcast_async (Error(kTransport)),
// while the loopback transport accepts it and completes it at once, with async_error() set. The
// suite accepts either; what it requires is that an aborted transport says so in async_error()
// and never leaves a stream hanging.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/transport.h"

namespace shadowsync::testing {

// What the fixture's transport can do beyond the Transport contract's minimum.
struct TransportCapabilities {
  // Any rank may be the root of a broadcast. False for a transport with one fixed sender, rank 0
  // (the same-host transport); cases that broadcast from other roots are then skipped.
  bool any_rank_as_root = true;
  // A receiver's broadcast_async blocks its calling thread until the root's data for it arrived,
  // and enqueues only then (the same-host device flavour: its receive streams never wait on the
  // other process). Cases that hold the root back then let receivers announce themselves before
  // the call rather than after it, and check that the call did not return before the root's.
  bool receive_blocks_caller = false;
};

// One set of ranks under test. The suite drives it from one thread per rank plus the thread that
// calls run_*; a fixture needs no locking of its own as long as it honours the contracts below.
class TransportFixture {
 public:
  virtual ~TransportFixture() = default;

  virtual std::string name() const = 0;  // for messages: "loopback, 4 ranks"
  virtual int world_size() const = 0;
  // The default: every capability. Called from the thread that calls run_*.
  virtual TransportCapabilities capabilities() const { return {}; }

  // Rank `rank`'s backend and current transport. The references stay valid until reconnect().
  // Called from rank threads concurrently. Must not throw for a rank in [0, world_size()).
  virtual Backend& backend(int rank) = 0;
  virtual Transport& transport(int rank) = 0;

  // Replaces every rank's transport with one of a new communicator (the old one may have been
  // aborted, or left with call sequences out of step by a failed case). Called with no rank
  // thread running and every stream idle. Throws when the new communicator cannot be made.
  virtual void reconnect() = 0;

  // Host <-> device copies on `stream` of `rank`'s backend, waited for with `timeout`; throw
  // std::runtime_error on timeout. The defaults use memcpy_async and an event, which works on
  // HostBackend (host memory) and CudaBackend (cudaMemcpyDefault, pageable host memory). Called
  // from the rank's own thread.
  virtual void upload(int rank, void* device_dst, const void* host_src, std::size_t bytes,
                      Stream& stream, std::chrono::nanoseconds timeout);
  virtual void download(int rank, void* host_dst, const void* device_src, std::size_t bytes,
                        Stream& stream, std::chrono::nanoseconds timeout);
};

struct ConformanceOptions {
  // Any single wait: an event, a signal from another rank. Generous, since only a bug makes one
  // take this long; NCCL's first collective on a communicator also connects the peers.
  std::chrono::milliseconds deadline{std::chrono::seconds(30)};
  // A bounded wait used to show that an event does NOT complete while the root is held back. It
  // cannot pass by luck (completion is impossible until the root joins); it only widens the
  // window in which a transport that does not block would be caught.
  std::chrono::milliseconds not_complete_wait{std::chrono::milliseconds(20)};
};

struct ConformanceResult {
  std::string name;                   // the case
  std::vector<std::string> failures;  // "rank 1: ..." lines; empty when it passed
  std::vector<std::string> notes;     // behaviour worth reporting that is not a failure
  // Set when the case was not run: the fixture lacks a capability it needs (which one and why).
  // A skipped case has no failures; callers report it as skipped, not as passed.
  std::optional<std::string> skipped;
  bool passed() const { return failures.empty(); }
};

// The names of the cases, in the order run_transport_conformance runs them.
std::vector<std::string> conformance_case_names();

// Runs one case. Before: every transport healthy and the ranks' call sequences in step (a fresh
// fixture is). After: the same again; when the case aborted a transport or failed, the fixture
// was reconnect()ed (a failing reconnect is reported as a failure of the case). A case that needs
// a capability the fixture lacks is not run: its result says why in `skipped`, and the fixture is
// not touched. Throws std::invalid_argument for an unknown name. Calling thread: none of the rank
// threads.
ConformanceResult run_conformance_case(TransportFixture& fixture, const std::string& name,
                                       const ConformanceOptions& options = {});

// Every case, in order, on the same fixture.
std::vector<ConformanceResult> run_transport_conformance(TransportFixture& fixture,
                                                         const ConformanceOptions& options = {});

// The cases the fixture's capabilities rule out, by name, without running anything.
std::vector<std::string> conformance_cases_skipped_on(const TransportFixture& fixture);

// Every failure of `results`, each prefixed with its case name: empty when all passed.
std::vector<std::string> conformance_failures(const std::vector<ConformanceResult>& results);

}  // namespace shadowsync::testing
