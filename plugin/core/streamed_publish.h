// The state of a streamed publish (Sender::publish_streamed), shared by the caller's
// StreamedPublish and the sender's worker, and the worker's half of their handshake.
//
// The handshake: each supply() checks its tensors, queues their pointers as one batch and blocks.
// The worker takes the batch tensor by tensor as it packs them into staging, and once every copy
// out of the batch has run on the pack stream it counts the batch as copied and wakes the caller,
// who may then free the tensors. Either side can end it: the caller by cancel() (or destroying its
// StreamedPublish early), the worker by finish() with the update's outcome.
//
// Threads: the fields under `mutex` are shared; the batch being packed belongs to the worker.
// Ownership: held by shared_ptr by both sides; the layout is the sender's and outlives the job.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "shadowsync/backend.h"
#include "shadowsync/error.h"
#include "shadowsync/layout.h"
#include "shadowsync/sender.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// What the sender's worker lends a streamed job while it sends it. Worker thread only.
struct StreamedWorkerContext {
  Backend& backend;
  Stream& pack_stream;  // the copies out of the caller's tensors run here
  Event& copied;        // recorded behind a batch's copies: its bytes are in staging
  Transport& transport;
  const std::atomic<bool>& stopping;  // the sender is being destroyed
  std::chrono::microseconds poll_interval;
  std::chrono::milliseconds update_deadline;
  std::chrono::steady_clock::time_point start;  // when the worker started the update
};

struct StreamedPublish::State {
  std::uint64_t version = 0;
  const Layout* layout = nullptr;  // the sender's; outlives the job
  std::vector<std::pair<std::size_t, std::size_t>> order;  // (group, tensor), fixed

  mutable std::mutex mutex;
  std::condition_variable cv;
  std::size_t supplied = 0;                          // caller: tensors accepted so far
  std::deque<std::vector<const std::byte*>> queued;  // caller -> worker, one entry per supply()
  std::uint64_t batches_pushed = 0;
  std::uint64_t batches_copied = 0;  // worker: supplies whose bytes are in staging
  bool cancelled = false;
  bool finished = false;  // worker: done with the job (see failure)
  std::optional<Error> failure;

  // Worker only: the batch being packed.
  std::vector<const std::byte*> batch;
  std::size_t batch_position = 0;
  bool batch_open = false;

  // Worker: the job is over, failed with `error` if set. Wakes a caller blocked in supply().
  void finish(const std::optional<Error>& error);

  // Worker: the next supplied tensor's bytes, in order(); waits for the caller's next supply,
  // first completing the batch before (complete_batch). Throws the update's failure if the
  // caller cancelled, the sender stops, the transport failed or the deadline passed.
  const std::byte* next_tensor(const StreamedWorkerContext& context);
  // Worker: waits until every copy out of the open batch has run, then tells the caller its
  // tensors may be freed. Nothing without an open batch. Throws as next_tensor.
  void complete_batch(const StreamedWorkerContext& context);

 private:
  // Throws the streamed update's failure, if any: the caller gave up (only if `caller_side_too`),
  // the sender stops, the transport failed, or the deadline passed.
  void check(const StreamedWorkerContext& context, bool caller_side_too);
};

}  // namespace shadowsync
