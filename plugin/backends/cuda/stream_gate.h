// Internal to the CUDA backend: runs host work that calls CUDA at a point of a stream's order,
// without the thread that enqueues it waiting for the stream. Not installed.
//
// The remap swap is the user: the live range may be unmapped only once every kernel already
// enqueued on the engine stream has finished, and must be mapped onto the new slot before the
// next one starts. Synchronizing the stream on the engine thread does that, but holds the engine
// thread for the rest of the step in flight, so it cannot prepare and launch the next step
// meanwhile. A host function (cudaLaunchHostFunc) may not call CUDA, so it cannot remap either.
//
//   StreamGate gate(device);
//   gate.enqueue(engine_stream, [&] { remap(); });  // returns at once
//   launch(engine_stream);                          // starts once remap() has returned
//
// How: enqueue records an event on the stream, then makes the stream wait (cuStreamWaitValue32)
// until a word in pinned host memory reaches the task's number. The gate's own thread waits for the
// event, runs the task, then writes the number: the GPU stands still on that stream only while the
// task runs. Tasks run one at a time, in the order they were enqueued.
//
// The gate is always opened, also when the task throws or the event's wait fails: a stream left
// waiting would hang the engine. The error is kept for take_error(); the task is responsible for
// leaving nothing silently wrong behind (the remap leaves its range unmapped: the engine's next
// kernel faults, loudly).
//
// Deadlocks: the task waits for nothing the gated stream must do (only for the event before the
// gate). A probe on an H100 (scripts/gpu/probe_gated_remap.py) found no deadlock when, while the
// gate was closed, the engine thread called cudaDeviceSynchronize, cuMemFree or
// torch.cuda.empty_cache (they wait for the gated stream; the remap's driver calls did not wait for
// them).
#pragma once

#include <cuda_runtime_api.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace shadowsync::cuda_detail {

class StreamGate {
 public:
  // Pinned host memory for the word and the gate's thread, on `device`. Throws Error(kBackend)
  // naming what is missing (cuStreamWaitValue32, host memory the device can map).
  explicit StreamGate(int device);
  // Runs every task still queued (opening their gates), then stops the thread; waits until every
  // gated stream has passed its gate before the word's memory goes.
  ~StreamGate();
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;

  // Enqueues on `stream`: `task` runs on the gate's thread once everything enqueued on `stream`
  // before this call has completed; work enqueued on `stream` after this call starts once `task`
  // returned. Returns at once. Throws Error(kBackend) if a CUDA call fails (then nothing was
  // gated and `task` never runs).
  void enqueue(cudaStream_t stream, std::function<void()> task);

  // Blocks until every task enqueued so far has run (its gate is open).
  void drain();

  // The first failure since the last call (a task that threw, an event that could not be waited
  // for), or an empty string; cleared by the call.
  std::string take_error();

  // How long the last task kept its stream waiting: from its event's completion (as the gate's
  // thread saw it) to the gate opening, in nanoseconds. What a remap costs the GPU.
  std::int64_t last_gate_ns() const;

 private:
  struct Task {
    cudaEvent_t before = nullptr;  // everything enqueued on the stream before the gate
    std::uint32_t number = 0;      // the word's value that opens this gate
    std::function<void()> work;
  };

  void run();
  void open(std::uint32_t number);

  int device_ = 0;
  std::uint32_t* word_ = nullptr;     // pinned, mapped host memory; only the gate's thread writes
  void* word_on_device_ = nullptr;    // the same word as the GPU sees it
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> queue_;
  std::uint32_t enqueued_ = 0;        // numbers handed out
  std::uint32_t done_ = 0;            // gates opened
  bool stopping_ = false;
  std::string error_;
  std::int64_t last_gate_ns_ = 0;
  // Per gated stream, an event recorded right after its last gate: passed before the word goes.
  std::map<cudaStream_t, cudaEvent_t> passed_;
  std::thread thread_;
};

}  // namespace shadowsync::cuda_detail
