// Aborting a receiver's transport after a failed update (or releasing it after its trainer left),
// and saying so when that hangs. The
// receiver aborts the transport (ncclCommAbort) on its own thread; an abort that never returns
// would leave that thread, and every later update, stuck without a word. So the abort runs under
// the second-level watchdog (abort_watchdog.h), and an overdue one is reported: to the receiver
// (`on_stuck`, which counts it), on stderr, and, with ReceiverConfig::exit_on_stuck_abort, by
// ending the process so that the engine's supervisor restarts it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "shadowsync/receiver.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// Aborts `transport` and destroys it (the destructor may tear a communicator down, so it runs
// under the watch too); `transport` is null afterwards. Runs on the calling thread (the
// receiver's) and returns when the abort does. If it has not returned after
// config.abort_deadline, on a watcher thread while the abort keeps going: `on_stuck(message)`,
// then the message on stderr, or with config.exit_on_stuck_abort the message and
// std::_Exit(kStuckAbortExitStatus). `on_stuck` must not wait for the receiver thread (it is the
// one stuck); it runs at most once. `version` is the update that failed, for the message.
void abort_transport_watched(std::unique_ptr<Transport>& transport, std::uint64_t version,
                             const ReceiverConfig& config,
                             const std::function<void(const std::string& message)>& on_stuck);

// Destroys `transport` without aborting it (Receiver::release_transport: its trainer left and
// tears its own end down; NCCL's teardown waits for both ends, so a trainer that never does holds
// it), under the same watch and with the same reports as abort_transport_watched. `why` is the
// release's reason, for the message.
void release_transport_watched(std::unique_ptr<Transport>& transport, const std::string& why,
                               const ReceiverConfig& config,
                               const std::function<void(const std::string& message)>& on_stuck);

}  // namespace shadowsync
