// One model's run in bench_same_host_one_gpu (see same_host_model_run.h).
#include "same_host_model_run.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "bench_cuda.h"
#include "same_host_device.h"
#include "same_host_report.h"
#include "shadowsync/receiver.h"
#include "shadowsync/same_host_transport.h"
#include "shadowsync/update_header.h"

namespace shadowsync::bench::same_host {

namespace {

// Left free when deciding whether the trainer's tensors fit (driver, streams, kernels' images).
constexpr std::size_t kFitMargin = std::size_t{1536} << 20;

// The receiver's reports by version, as its observer hands them over.
class Reports {
 public:
  void add(const UpdateReport& report) {
    std::lock_guard lock(mutex_);
    // A late "superseded" must not hide that the update was offered (kReady) first.
    auto [it, fresh] = by_version_.emplace(report.version, report);
    if (!fresh && report.outcome != UpdateOutcome::kSuperseded) it->second = report;
    changed_.notify_all();
  }
  // The report of `version` (kReady); throws for any other outcome or none in time.
  UpdateReport wait(std::uint64_t version) {
    std::unique_lock lock(mutex_);
    if (!changed_.wait_for(lock, bench::kWaitLimit,
                           [&] { return by_version_.count(version) > 0; })) {
      throw BenchError(cat("update ", version, ": no report from the receiver in ",
                           bench::kWaitLimit.count(), " s"));
    }
    const UpdateReport report = by_version_.at(version);
    by_version_.erase(by_version_.begin(), by_version_.lower_bound(version));
    if (report.outcome != UpdateOutcome::kReady) {
      throw BenchError(cat("update ", version, " ",
                           report.outcome == UpdateOutcome::kFailed ? "failed: " : "superseded",
                           report.error));
    }
    return report;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::uint64_t, UpdateReport> by_version_;
};

std::vector<std::string> group_names(const Layout& layout) {
  std::vector<std::string> names;
  for (const GroupLayout& group : layout.groups()) names.push_back(group.name());
  return names;
}

}  // namespace

ModelRun run_model(const ModelConfig& model, Engine& e, int index) {
  const Options& o = e.options;
  TrainerProcess& trainer = *e.trainer;
  ModelRun r;
  r.name = model.name;
  const auto model_start = Clock::now();
  const Layout layout = bench::model_layout(model, 1, kDefaultBucketBytes);
  const std::vector<std::string> groups = group_names(layout);
  for (const GroupLayout& group : layout.groups()) {
    r.bytes += group.arena_bytes();
    r.tensors += group.tensors().size();
    r.buckets += group.bucket_count();
  }
  r.largest_tensor = bench::largest_tensor_bytes(layout);
  const std::size_t bucket = layout.bucket_bytes();
  const auto M = static_cast<double>(r.bytes);

  // Does it fit? The engine's peak is two model-sized buffers (the raw copy's, later the
  // Receiver's two slots) plus the emulated copies' four buckets; the trainer's, its tensors and
  // its two slots. With the trainer on another GPU (--trainer-device) only the engine's part is
  // on this one; the trainer's (one model and two buckets) is less than the engine's peak, so a
  // GPU of the same kind holds it.
  const std::size_t free = free_device_bytes();
  const std::size_t engine_peak = 2 * r.bytes + 4 * bucket;
  const bool beside = o.trainer_device == o.device;
  const std::size_t full_need = engine_peak + (beside ? r.bytes + 2 * bucket : 0) + kFitMargin;
  const std::size_t shared_need =
      engine_peak + (beside ? r.largest_tensor + 2 * bucket : 0) + kFitMargin;
  if (o.sources == "full" || (o.sources == "auto" && full_need <= free)) {
    r.sources = "full";
    if (full_need > free) {
      r.skipped.push_back(
          strf("the model: --sources full needs %.1f GB, %.1f GB free", gb(full_need), gb(free)));
      return r;
    }
  } else if (shared_need <= free) {
    r.sources = "shared";
    r.sources_note = strf(
        "the trainer's %zu source tensors all read one %.2f GB buffer (the largest tensor's "
        "size)%s; packing still reads and writes every byte once",
        r.tensors, gb(r.largest_tensor),
        o.sources == "shared"
            ? " (--sources shared)"
            : strf(
                  ": %.1f GB of tensors do not fit beside the engine's two slots (%.1f GB; %.1f GB "
                  "free)",
                  gb(r.bytes), gb(2 * r.bytes), gb(free))
                  .c_str());
  } else {
    r.skipped.push_back(strf("the model: needs %.1f GB even with shared sources, %.1f GB free",
                             gb(shared_need), gb(free)));
    return r;
  }
  progress(strf("%s: %.2f GB, %zu tensors, %zu buckets of %zu MiB; trainer sources %s",
                r.name.c_str(), gb(M), r.tensors, r.buckets, bucket >> 20, r.sources.c_str()));
  r.source_bytes = static_cast<std::size_t>(
      trainer.call(cat("model ", r.name, " ", r.sources)).integer("source_bytes"));

  // 1. The connection.
  const std::string path = cat(e.socket_dir, "/model", index, ".sock");
  const std::size_t q0 = free_device_bytes();
  const auto engine_bytes0 = static_cast<std::int64_t>(e.backend.bytes_allocated());
  trainer.send(cat("serve ", path));
  // Connect once the trainer listens. A serve() that fails first answers at once (with the
  // reason), where connect() would retry until its timeout: wait for whichever comes first.
  for (const auto deadline = Clock::now() + kConnectTimeout;;) {
    std::error_code ignored;
    if (std::filesystem::is_socket(path, ignored)) break;
    if (trainer.reply_ready(std::chrono::milliseconds(5))) {
      trainer.read_reply("serve");  // throws the trainer's error
      throw BenchError("the trainer answered 'serve' before the engine connected");
    }
    if (Clock::now() > deadline) {
      throw BenchError(
          cat("the trainer did not listen on ", path, " within ", kConnectTimeout.count(), " s"));
    }
  }
  SameHostConfig config;
  config.connect_timeout = kConnectTimeout;
  std::unique_ptr<SameHostTransport> transport =
      SameHostTransport::connect(path, e.token, 1, e.backend, config);
  const Reply served = trainer.read_reply("serve", kConnectTimeout + std::chrono::seconds(5));
  const std::size_t q1 = free_device_bytes();
  MemoryFigures& mem = r.memory;
  mem.slot_bytes = static_cast<std::int64_t>(transport->slot_bytes());
  mem.connection_delta = static_cast<std::int64_t>(q0) - static_cast<std::int64_t>(q1);
  mem.trainer_serve_backend_delta = served.integer("backend_delta");
  mem.engine_connect_backend_delta =
      static_cast<std::int64_t>(e.backend.bytes_allocated()) - engine_bytes0;
  progress(
      strf("%s: connected (serve %.1f ms); device memory taken by the connection %.3f GB "
           "(two slots: %.3f GB)",
           r.name.c_str(), served.number("ms"), gb(mem.connection_delta), gb(2 * mem.slot_bytes)));

  // 2. The raw copy, then the transport alone into a buffer of the model's size.
  {
    DeviceMemory src(r.bytes);
    DeviceMemory dst(r.bytes);
    const auto raw = bench::time_on_stream(e.copy_native, o.reps + 1, [&] {
      BENCH_CUDA(cudaMemcpyAsync(dst.data(), src.data(), r.bytes, cudaMemcpyDeviceToDevice,
                                 e.copy_native));
    });
    r.raw_ms.assign(raw.begin() + 1, raw.end());
    src.reset();
    progress(strf("%s: raw device copy x%d: median %.3f ms (%.0f GB/s), min %.3f ms",
                  r.name.c_str(), o.reps, median(r.raw_ms), gbps(M, median(r.raw_ms)),
                  bench::summarize(r.raw_ms).min));

    std::unique_ptr<Stream> receive_stream = e.backend.create_stream(StreamPriority::kLow);
    std::unique_ptr<Event> received = e.backend.create_event();
    for (int rep = 0; rep < o.reps + 1; ++rep) {
      const auto start = Clock::now();
      // Posted from a thread of their own: a receive waits on the host for its chunk's doorbell,
      // which the trainer (told to send below) rings. The trainer is told only once that thread
      // runs: its start-up (tens of microseconds) is the bench's, and a receiver that posts its
      // receives late is not what the transport's figure is about.
      std::atomic<bool> posting_started{false};
      auto posting = std::async(std::launch::async, [&] {
        posting_started.store(true);
        std::size_t base = 0;
        for (const GroupLayout& group : layout.groups()) {
          for (std::size_t k = 0; k < group.bucket_count(); ++k) {
            const Bucket b = group.bucket(k);
            transport->broadcast_async(dst.data() + base + b.offset, b.bytes, 0, *receive_stream);
          }
          base += group.arena_bytes();
        }
        e.backend.event_record(*received, *receive_stream);
      });
      for (const auto deadline = Clock::now() + std::chrono::seconds(10);
           !posting_started.load();) {
        if (Clock::now() > deadline)
          throw BenchError(
              "transport alone: the posting thread did "
              "not start within 10 s");
        std::this_thread::yield();
      }
      const Reply sent = trainer.call("send");
      posting.get();
      if (!e.backend.event_wait_for(*received, bench::kWaitLimit)) {
        throw BenchError(cat("transport alone: the receives not done ", bench::kWaitLimit.count(),
                             " s after the trainer's sends"));
      }
      const double engine_ms = bench::to_ms(Clock::now() - start);
      if (auto error = transport->async_error()) throw BenchError(cat("transport alone: ", *error));
      if (rep > 0) {
        r.transport_ms.push_back(sent.number("ms"));
        r.transport_engine_ms.push_back(engine_ms);
      } else {  // the timelines start after the warm-up rep
        (void)transport->timeline_summary();
        (void)trainer.call("timeline");
      }
    }
    r.receiver_timeline = transport->timeline_summary();
    r.sender_timeline = trainer.call("timeline").line.substr(3);
    progress(cat(r.name, ": transport alone: ", r.sender_timeline));
    progress(cat(r.name, ": transport alone: ", r.receiver_timeline));
    progress(
        strf("%s: transport alone x%d: median %.3f ms (%.0f GB/s, %.2f of the raw copy), min "
             "%.3f ms; engine-observed median %.3f ms",
             r.name.c_str(), o.reps, median(r.transport_ms), gbps(M, median(r.transport_ms)),
             median(r.raw_ms) / median(r.transport_ms), bench::summarize(r.transport_ms).min,
             median(r.transport_engine_ms)));
  }

  // 3. The receiver and the sender over that connection.
  const std::size_t q1b = free_device_bytes();
  const auto engine_bytes1 = static_cast<std::int64_t>(e.backend.bytes_allocated());
  ReceiverConfig receiver_config;
  receiver_config.root_rank = 0;
  Reports reports;  // outlives the receiver, whose thread calls the observer
  auto receiver =
      std::make_unique<Receiver>(layout, e.backend, std::move(transport), receiver_config);
  // Destroyed before the receiver: the engine stream is done reading the slots by then.
  struct SyncEngine {
    cudaStream_t stream;
    ~SyncEngine() { (void)cudaStreamSynchronize(stream); }
  } sync_engine{e.native};
  receiver->set_observer([&reports](const UpdateReport& report) { reports.add(report); });
  StepHook& hook = receiver->step_hook();
  const std::size_t q2 = free_device_bytes();
  mem.receiver_delta = static_cast<std::int64_t>(q1b) - static_cast<std::int64_t>(q2);
  mem.receiver_backend_delta =
      static_cast<std::int64_t>(e.backend.bytes_allocated()) - engine_bytes1;
  const Reply made = trainer.call("sender");
  mem.sender_delta = made.integer("free_before") - made.integer("free_after");
  mem.sender_backend_delta = made.integer("backend_delta");
  const std::size_t q2b = free_device_bytes();
  progress(strf("%s: receiver %.3f GB (backend %.3f GB), sender %.3f GB (backend %.3f GB)",
                r.name.c_str(), gb(mem.receiver_delta), gb(mem.receiver_backend_delta),
                gb(mem.sender_delta), gb(mem.sender_backend_delta)));

  // 4. Updates end to end, each swapped at a step boundary on this (the engine) thread.
  std::uint64_t version = 0;
  const auto header = [&](std::uint64_t v) {
    return make_update_header(layout, v, groups, o.checksums);
  };
  for (int i = 0; i < kWarmup + o.updates; ++i) {
    if (i >= kWarmup + 5 && elapsed_s() > o.budget_s) {
      r.skipped.push_back(strf("updates %d..%d (budget)", i - kWarmup + 1, o.updates));
      break;
    }
    const std::uint64_t v = ++version;
    receiver->begin_update(header(v));
    const Reply published = trainer.call(cat("publish ", v));
    const UpdateReport report = reports.wait(v);
    bench::wait_until([&] { return hook.has_pending(); }, cat("update ", v, " to be offered"));
    BENCH_CUDA(cudaStreamSynchronize(e.native));  // a step boundary
    BENCH_CUDA(cudaEventRecord(e.start, e.native));
    const auto swap_start = Clock::now();
    const std::optional<std::uint64_t> applied = hook.before_step(*e.stream);
    const double host_us = bench::to_us(Clock::now() - swap_start);
    BENCH_CUDA(cudaEventRecord(e.stop, e.native));
    BENCH_CUDA(cudaEventSynchronize(e.stop));
    if (applied != v) throw BenchError(cat("update ", v, " was offered but not applied"));
    float stream_ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&stream_ms, e.start, e.stop));
    mem.trainer_backend_after_updates = published.integer("backend_bytes");
    if (i < kWarmup) continue;
    r.publish_ms.push_back(published.number("ms"));
    r.receiver_transfer_ms.push_back(bench::to_ms(report.transfer));
    r.stall_host_us.push_back(host_us);
    r.stall_stream_us.push_back(stream_ms * 1e3);
  }
  mem.updates_delta =
      static_cast<std::int64_t>(q2b) - static_cast<std::int64_t>(free_device_bytes());
  const bench::Summary stall = bench::summarize(r.stall_host_us);
  progress(
      strf("%s: %zu updates end to end: median %.3f ms (%.0f GB/s, %.2f of the raw copy), "
           "receiver transfer median %.3f ms; swap stall median %.1f us, p99 %.1f us",
           r.name.c_str(), r.publish_ms.size(), median(r.publish_ms), gbps(M, median(r.publish_ms)),
           median(r.raw_ms) / median(r.publish_ms), median(r.receiver_transfer_ms), stall.median,
           stall.p99));

  // 5. Decode: alone, during real updates, during the engine-side copy on copy engines or SMs.
  const std::size_t group = 0;
  r.decode_bytes = std::min(static_cast<std::size_t>(o.decode_gib * double(bench::kGiB)),
                            layout.groups()[group].arena_bytes()) &
                   ~std::size_t{15};
  const auto window =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(o.during_s));
  {
    e.decode_loop(hook, group, r.decode_bytes, 5, std::nullopt);  // warm-up
    DecodeRow alone{"alone",
                    e.decode_loop(hook, group, r.decode_bytes, o.decode_steps, std::nullopt)};
    r.decode.push_back(alone);
  }
  if (elapsed_s() > o.budget_s) {
    r.skipped.push_back("decode during updates and copies (budget)");
  } else {
    DecodeRow row{"during updates"};
    std::vector<double> ms;
    std::string error;
    {
      Background driver;
      driver.thread = std::thread([&] {
        try {
          while (!driver.stop.load()) {
            const std::uint64_t v = ++version;
            receiver->begin_update(header(v));
            const Reply published = trainer.call(cat("publish ", v));
            reports.wait(v);
            ms.push_back(published.number("ms"));
          }
        } catch (const std::exception& ex) {
          error = ex.what();
        }
      });
      const auto begin = Clock::now();
      row.ms = e.decode_loop(hook, group, r.decode_bytes, 0, begin + window);
      driver.stop.store(true);
      driver.thread.join();
      const double window_ms = bench::to_ms(Clock::now() - begin);
      double busy_ms = 0;
      for (double x : ms) busy_ms += x;
      row.busy = busy_ms / window_ms;
    }
    if (!error.empty()) throw BenchError(cat("decode during updates: ", error));
    hook.apply_pending_now(*e.stream);
    BENCH_CUDA(cudaStreamSynchronize(e.native));
    row.copies = static_cast<int>(ms.size());
    row.copy_gbps = ms.empty() ? 0 : gbps(M, median(ms));
    r.decode.push_back(std::move(row));

    DeviceMemory rings(4 * bucket);  // a two-bucket source and a two-bucket destination
    BENCH_CUDA(cudaMemset(rings.data(), 0x3c, 4 * bucket));
    for (const int ctas : {0, o.sm_copy_ctas > 0 ? o.sm_copy_ctas : e.sms}) {
      DecodeRow copy_row{ctas == 0 ? "during copy-engine copy" : "during SM-kernel copy"};
      CopyLoop loop;
      {
        Background copier;
        copier.thread = std::thread([&] {
          loop.run(o.device, e.copy_native, rings.data(), rings.data() + 2 * bucket, bucket,
                   r.bytes, ctas, copier.stop);
        });
        copy_row.ms = e.decode_loop(hook, group, r.decode_bytes, 0, Clock::now() + window);
        copier.stop.store(true);
        copier.thread.join();
      }
      if (!loop.error.empty()) throw BenchError(cat(copy_row.variant, ": ", loop.error));
      copy_row.copies = loop.updates;
      copy_row.copy_gbps = loop.copy_gbps;
      copy_row.busy = 1;
      r.decode.push_back(std::move(copy_row));
    }
  }
  {
    const double alone = median(r.decode.front().ms);
    std::string line = strf("%s: decode step over %.2f GB: alone median %.3f ms", r.name.c_str(),
                            gb(r.decode_bytes), alone);
    for (std::size_t i = 1; i < r.decode.size(); ++i) {
      line += strf("; %s %.2fx (copy %.0f GB/s)", r.decode[i].variant.c_str(),
                   median(r.decode[i].ms) / alone, r.decode[i].copy_gbps);
    }
    progress(line);
  }

  // 6. Teardown: the receiver first (its end of the connection closes), then the trainer's side.
  hook.apply_pending_now(*e.stream);
  BENCH_CUDA(cudaStreamSynchronize(e.native));
  receiver.reset();
  trainer.call("close");
  r.seconds = bench::to_s(Clock::now() - model_start);
  return r;
}

}  // namespace shadowsync::bench::same_host
