// bench_same_host_one_gpu's trainer process (see same_host_trainer.h).
#include "same_host_trainer.h"

#include <cuda_runtime.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_cuda.h"
#include "bench_models.h"
#include "same_host_device.h"
#include "same_host_protocol.h"
#include "shadowsync/cuda_backend.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/sender.h"

namespace shadowsync::bench::same_host {

int trainer_main(const Options& o) {
  std::signal(SIGPIPE, SIG_IGN);
  LineReader in(o.command_fd);
  const auto reply = [&](const std::string& text) { write_line(o.reply_fd, text); };
  std::string token;
  std::unique_ptr<CudaBackend> backend;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<Event> sent;
  try {
    token = load_token(o.token_file);
    backend = std::make_unique<CudaBackend>(o.device);
    stream = backend->create_stream(StreamPriority::kNormal);
    sent = backend->create_event();
    reply(cat("ok ready pid=", ::getpid()));
  } catch (const std::exception& e) {
    try {
      reply(cat("error ", e.what()));
    } catch (...) {
    }
    return 1;
  }

  std::optional<Layout> layout;
  std::vector<std::string> groups;
  std::vector<SourceTensor> sources;
  std::vector<void*> memory;
  std::unique_ptr<SameHostTransport> transport;
  std::unique_ptr<Sender> sender;
  const auto release = [&] {
    sender.reset();
    transport.reset();
    for (void* p : memory) (void)cudaFree(p);
    memory.clear();
    sources.clear();
    groups.clear();
    layout.reset();
  };
  const auto allocate = [&](std::size_t bytes) {
    void* p = nullptr;
    BENCH_CUDA(cudaMalloc(&p, bytes));
    memory.push_back(p);
    // 0x3c3c: a finite bf16 in every element (a non-finite guard, if on, passes).
    BENCH_CUDA(cudaMemset(p, 0x3c, bytes));
    return static_cast<std::byte*>(p);
  };

  for (;;) {
    std::optional<std::string> line;
    try {
      line = in.next(std::chrono::hours(2), "the engine's next command");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[trainer] %s\n", e.what());
    }
    if (!line) {  // the engine went away
      release();
      return 0;
    }
    std::istringstream words(*line);
    std::string verb;
    words >> verb;
    try {
      if (verb == "model") {
        std::string name;
        std::string mode;
        words >> name >> mode;
        release();
        const bench::ModelConfig* model = bench::find_model(name);
        if (model == nullptr) throw BenchError(cat("unknown model '", name, "'"));
        layout = bench::model_layout(*model, 1, kDefaultBucketBytes);
        std::size_t source_bytes = 0;
        std::byte* shared = nullptr;
        if (mode == "shared") {
          source_bytes = bench::largest_tensor_bytes(*layout);
          shared = allocate(source_bytes);
        } else if (mode != "full") {
          throw BenchError(cat("model: sources are full or shared, got '", mode, "'"));
        }
        for (const GroupLayout& group : layout->groups()) {
          groups.push_back(group.name());
          std::byte* arena = shared;
          if (shared == nullptr) {
            arena = allocate(group.arena_bytes());
            source_bytes += group.arena_bytes();
          }
          for (const TensorPlacement& t : group.tensors()) {
            sources.push_back({t.spec.name, shared != nullptr ? shared : arena + t.offset,
                               t.spec.dtype, t.spec.shape});
          }
        }
        BENCH_CUDA(cudaDeviceSynchronize());
        reply(cat("ok source_bytes=", source_bytes));
      } else if (verb == "serve") {
        std::string path;
        words >> path;
        if (!layout) throw BenchError("serve before model");
        SameHostConfig config;
        config.connect_timeout = kConnectTimeout;
        const std::size_t free_before = free_device_bytes();
        const std::size_t bytes_before = backend->bytes_allocated();
        const auto start = Clock::now();
        transport = SameHostTransport::serve(path, token, 1, *backend, SameHostMemory::kDevice,
                                             layout->bucket_bytes(), config);
        const double ms = bench::to_ms(Clock::now() - start);
        reply(cat("ok ms=", ms, " free_before=", free_before, " free_after=", free_device_bytes(),
                  " backend_delta=",
                  static_cast<std::int64_t>(backend->bytes_allocated()) -
                      static_cast<std::int64_t>(bytes_before),
                  " slot_bytes=", transport->slot_bytes()));
      } else if (verb == "send") {
        if (!transport) throw BenchError("send without a served transport");
        std::size_t chunk = 0;
        const auto start = Clock::now();
        for (const GroupLayout& group : layout->groups()) {
          for (std::size_t k = 0; k < group.bucket_count(); ++k, ++chunk) {
            const std::size_t n = group.bucket(k).bytes;
            void* slot = transport->staging_buffer(static_cast<int>(chunk % 2), n);
            if (slot == nullptr) {
              throw BenchError(
                  cat("the transport has no staging slot ", chunk % 2, " for ", n, " bytes"));
            }
            transport->broadcast_async(slot, n, 0, *stream);
          }
        }
        transport->flush();  // every receiver copied every chunk out
        backend->event_record(*sent, *stream);
        if (!backend->event_wait_for(*sent, bench::kWaitLimit)) {
          throw BenchError(
              cat(chunk, " broadcasts not done after ", bench::kWaitLimit.count(), " s"));
        }
        const double ms = bench::to_ms(Clock::now() - start);
        if (auto error = transport->async_error()) throw BenchError(*error);
        reply(cat("ok ms=", ms, " chunks=", chunk));
      } else if (verb == "timeline") {
        // The sender's per-chunk medians since the last "timeline" (SameHostTransport's).
        if (!transport) throw BenchError("timeline without a served transport");
        reply(cat("ok ", transport->timeline_summary()));
      } else if (verb == "sender") {
        if (!transport) throw BenchError("sender without a served transport");
        SenderConfig config;
        config.checksums = o.checksums;
        const std::size_t free_before = free_device_bytes();
        const std::size_t bytes_before = backend->bytes_allocated();
        sender = std::make_unique<Sender>(*layout, *backend, std::move(transport), config);
        reply(cat("ok free_before=", free_before, " free_after=", free_device_bytes(),
                  " backend_delta=",
                  static_cast<std::int64_t>(backend->bytes_allocated()) -
                      static_cast<std::int64_t>(bytes_before)));
      } else if (verb == "publish") {
        std::uint64_t version = 0;
        words >> version;
        if (!sender) throw BenchError("publish without a sender");
        const auto start = Clock::now();
        const PublishHandle handle = sender->publish(version, groups, sources);
        if (!handle.wait_for(bench::kWaitLimit)) {
          throw BenchError(
              cat("update ", version, " not done after ", bench::kWaitLimit.count(), " s"));
        }
        handle.wait();  // throws the update's error, if it failed
        const double ms = bench::to_ms(Clock::now() - start);
        reply(cat("ok ms=", ms, " backend_bytes=", backend->bytes_allocated()));
      } else if (verb == "close") {
        release();
        reply("ok");
      } else if (verb == "quit") {
        release();
        reply("ok");
        return 0;
      } else {
        throw BenchError(cat("unknown command '", *line, "'"));
      }
    } catch (const std::exception& e) {
      try {
        reply(cat("error ", e.what()));
      } catch (const std::exception& lost) {
        std::fprintf(stderr, "[trainer] %s (and the reply was lost: %s)\n", e.what(), lost.what());
      }
    }
  }
}

}  // namespace shadowsync::bench::same_host
