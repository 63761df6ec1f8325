#include "control/engine_requests.h"

#include <fmt/format.h>

#include <cstring>
#include <exception>
#include <utility>

#include "control/channel_loop.h"
#include "shadowsync/error.h"

namespace shadowsync::control {

EngineRequests::EngineRequests(Receiver& receiver, const TransportFactory& factory,
                               const ControlConfig& config,
                               const std::atomic<std::uint64_t>& current, EngineCounters& counters,
                               Reply reply)
    : receiver_(receiver),
      factory_(factory),
      config_(config),
      current_(current),
      counters_(counters),
      reply_(std::move(reply)),
      worker_([this] { worker_loop(); }) {}

EngineRequests::~EngineRequests() {
  close();
  join();
}

void EngineRequests::push(std::uint64_t generation, EngineRequest request) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({generation, std::move(request)});
  }
  cv_.notify_one();
}

void EngineRequests::close() {
  {
    std::lock_guard lock(mutex_);
    closed_ = true;
    queue_.clear();
  }
  cv_.notify_all();
}

void EngineRequests::join() {
  if (worker_.joinable()) worker_.join();
  // Factories given up on (or still running at close()) are waited for, as a running one was.
  for (FactoryThread& factory : factories_) factory.thread.join();
  factories_.clear();
}

void EngineRequests::join_finished_factories() {
  std::vector<FactoryThread> finished;
  {
    std::lock_guard lock(mutex_);
    for (auto it = factories_.begin(); it != factories_.end();) {
      if (it->run->done) {
        finished.push_back(std::move(*it));
        it = factories_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (FactoryThread& factory : finished) factory.thread.join();  // it is returning
}

std::unique_ptr<Transport> EngineRequests::run_factory(std::uint64_t generation,
                                                       const RendezvousRequest& request) {
  join_finished_factories();
  auto run = std::make_shared<FactoryRun>();
  std::thread thread([this, run, request] {
    std::unique_ptr<Transport> transport;
    std::exception_ptr error;
    try {
      transport = factory_(request);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      run->done = true;
      if (!run->abandoned) {
        run->transport = std::move(transport);
        run->error = error;
      }
    }
    cv_.notify_all();
    // An abandoned run's transport is destroyed here, outside the lock.
  });
  std::unique_lock lock(mutex_);
  factories_.push_back({run, std::move(thread)});
  cv_.wait(lock, [&] { return run->done || closed_ || current_.load() != generation; });
  if (!run->done) {
    run->abandoned = true;
    return nullptr;
  }
  if (run->error) std::rethrow_exception(run->error);
  if (!run->transport) throw Error(ErrorCode::kTransport, "the transport factory returned none");
  return std::move(run->transport);
}

void EngineRequests::worker_loop() {
  for (;;) {
    Work item;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return closed_ || !queue_.empty(); });
      if (closed_) return;
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    const bool departed = item.generation != current_.load();
    if (departed && !std::holds_alternative<TrainerLeft>(item.request)) continue;  // it is gone
    run(item);
  }
}

void EngineRequests::run(Work& item) {
  if (auto* rendezvous = std::get_if<RendezvousMessage>(&item.request)) {
    RendezvousRequest request;
    request.transport.kind = rendezvous->transport;
    std::memcpy(request.transport.unique_id.bytes.data(), rendezvous->unique_id.data(),
                RendezvousId::kSize);
    request.transport.path = rendezvous->path;
    request.rank = static_cast<int>(rendezvous->rank);  // < world_size <= 2^16: checked
    request.world_size = static_cast<int>(rendezvous->world_size);
    RendezvousResultMessage result;
    result.rendezvous_id = rendezvous->rendezvous_id;
    try {
      std::unique_ptr<Transport> transport = run_factory(item.generation, request);
      if (!transport) {
        // Its trainer left (or the channel closes): nobody waits for the answer.
        counters_.update([](EngineChannelStats& s) { ++s.rendezvous_failed; });
        log_line(config_,
                 fmt::format("{} rendezvous as rank {} of {} given up: the trainer that "
                             "asked for it left (or the channel closed) before the "
                             "transport factory returned",
                             to_string(request.transport.kind), request.rank, request.world_size));
        return;
      }
      receiver_.replace_transport(std::move(transport));
      result.ok = true;
      counters_.update([](EngineChannelStats& s) { ++s.rendezvous_done; });
    } catch (const std::exception& e) {
      result.error = clip_control_text(fmt::format("{} rendezvous as rank {} of {} failed: {}",
                                                   to_string(request.transport.kind), request.rank,
                                                   request.world_size, e.what()));
      counters_.update([](EngineChannelStats& s) { ++s.rendezvous_failed; });
      log_line(config_, result.error);
    }
    reply_(item.generation, std::move(result));
  } else if (auto* header = std::get_if<UpdateHeader>(&item.request)) {
    try {
      receiver_.begin_update(*header);
      counters_.update([](EngineChannelStats& s) { ++s.headers_accepted; });
    } catch (const std::exception& e) {
      // Nothing changed in the receiver: the trainer learns why.
      const auto* error = dynamic_cast<const Error*>(&e);
      UpdateErrorMessage refused;
      refused.version = header->version;
      refused.code = static_cast<std::uint32_t>(error ? error->code() : ErrorCode::kInternal);
      refused.message = clip_control_text(e.what());
      counters_.update([](EngineChannelStats& s) { ++s.headers_refused; });
      reply_(item.generation, std::move(refused));
    }
  } else if (auto* abort = std::get_if<AbortMessage>(&item.request)) {
    log_line(config_, fmt::format("trainer aborts update {}: {}", abort->version, abort->reason));
    receiver_.abort_update();
  } else if (auto* left = std::get_if<TrainerLeft>(&item.request)) {
    receiver_.release_transport(left->why);
  }
}

}  // namespace shadowsync::control
