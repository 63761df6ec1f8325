#include "loopback_rig.h"

#include <string>

#include "deadline.h"
#include "remap_host_backend.h"

namespace shadowsync::testing {

LoopbackRig::LoopbackRig(const Layout& layout, RigOptions options)
    : layout_(layout),
      options_(options),
      backend_(options.backend),
      counting_(options.remap_on_host         ? std::make_unique<RemapHostBackend>(backend_)
                : options.count_backend_calls ? std::make_unique<CountingBackend>(backend_)
                                              : nullptr),
      communicator_(std::make_unique<LoopbackCommunicator>(options.receivers + 1)),
      reports_(options.receivers) {
  Backend& endpoints = counting_ ? static_cast<Backend&>(*counting_) : backend_;
  SenderConfig sender_config = options.sender;
  sender_config.root_rank = 0;
  sender_ = std::make_unique<Sender>(layout, endpoints, communicator_->transport(0), sender_config);
  for (int r = 0; r < options.receivers; ++r) {
    ReceiverConfig config = options.receiver;
    config.root_rank = 0;
    auto receiver = std::make_unique<Receiver>(layout, endpoints, communicator_->transport(r + 1),
                                               config, options.engine_arenas);
    receiver->set_observer([this, r](const UpdateReport& report) {
      std::lock_guard lock(mutex_);
      reports_[r].push_back(report);
      const bool lost = report.outcome == UpdateOutcome::kFailed ||
                        (report.outcome == UpdateOutcome::kSuperseded && !report.error.empty());
      if (lost) history_.mark_failed(report.version);
    });
    receivers_.push_back(std::move(receiver));
  }
}

LoopbackRig::~LoopbackRig() { destroy_endpoints(); }

void LoopbackRig::destroy_endpoints() {
  // Receivers first: an engine must be done with them; then the sender, then the tensors.
  for (auto& receiver : receivers_) receiver->shutdown();
  receivers_.clear();
  sender_.reset();
  std::lock_guard lock(mutex_);
  in_flight_.clear();
}

PublishHandle LoopbackRig::publish(std::uint64_t version, const std::vector<std::string>& groups) {
  auto tensors = std::make_unique<HostTensors>(layout_, groups, version);
  PublishHandle handle = sender_->publish(version, groups, tensors->sources());
  {
    std::lock_guard lock(mutex_);
    std::vector<std::size_t> indices(handle.header().groups.begin(), handle.header().groups.end());
    history_.add(version, std::move(indices));
    while (!in_flight_.empty() && in_flight_.front().handle.done()) in_flight_.pop_front();
    in_flight_.push_back(Published{handle, std::move(tensors)});
  }
  for (auto& receiver : receivers_) receiver->begin_update(handle.header());
  return handle;
}

std::uint64_t LoopbackRig::broadcasts_per_update(const std::vector<std::string>& groups) const {
  return make_update_header(layout_, 1, groups, options_.sender.checksums).bucket_count;
}

void LoopbackRig::reconnect() {
  communicator_ = std::make_unique<LoopbackCommunicator>(options_.receivers + 1);
  sender_->replace_transport(communicator_->transport(0));
  for (int r = 0; r < options_.receivers; ++r) {
    receivers_[r]->replace_transport(communicator_->transport(r + 1));
  }
}

void LoopbackRig::wait_offered(std::uint64_t version, int receiver) {
  Receiver& r = *receivers_[receiver];
  wait_until(
      [&] { return r.stats().updates_ready >= version && r.step_hook().has_pending(); },
      "update " + std::to_string(version) + " offered to the engine");
}

UpdateHistory LoopbackRig::history() const {
  std::lock_guard lock(mutex_);
  return history_;
}

std::vector<UpdateReport> LoopbackRig::reports(int receiver) const {
  std::lock_guard lock(mutex_);
  return reports_[receiver];
}

}  // namespace shadowsync::testing
