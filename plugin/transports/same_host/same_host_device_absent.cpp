// The device flavours (the broadcast's DeviceLink, the pull transport's DeviceSlots) in builds
// without CUDA: refused with a clear error; nothing else can be reached (none is ever made).
#include "shadowsync/error.h"
#include "transports/same_host/same_host_device.h"
#include "transports/same_host/same_host_pull_device.h"

namespace shadowsync::same_host {

struct DeviceLink::Impl {};

namespace {
[[noreturn]] void refuse() {
  throw Error(ErrorCode::kInvalidArgument,
              "same-host transport: the device memory flavour needs a CudaBackend and a build "
              "with CUDA (SHADOWSYNC_WITH_CUDA); this one has none. Use SameHostMemory::kHost "
              "with a HostBackend");
}
}  // namespace

std::unique_ptr<DeviceLink> DeviceLink::create(Backend&, std::size_t, std::chrono::milliseconds) {
  refuse();
}
std::unique_ptr<DeviceLink> DeviceLink::open(Backend&, Fd, const Setup&, const std::string&,
                                             std::chrono::milliseconds) {
  refuse();
}
DeviceLink::DeviceLink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DeviceLink::~DeviceLink() = default;
int DeviceLink::exported_fd() const { return -1; }
std::array<std::byte, kHandleBytes> DeviceLink::handle() const { return {}; }
std::byte* DeviceLink::slot(std::uint32_t) const { return nullptr; }
void DeviceLink::start(SameHostTransport::State&) {}
std::uint64_t DeviceLink::reserve(std::size_t) { refuse(); }
void DeviceLink::send_async(const std::byte*, std::size_t, std::uint64_t, Stream&) { refuse(); }
void DeviceLink::flush() { refuse(); }
void DeviceLink::receive_async(std::byte*, std::size_t, std::uint64_t, Stream&) { refuse(); }
void DeviceLink::release() noexcept {}
std::string DeviceLink::timeline() { return {}; }

DeviceSlots create_device_slots(Backend&, std::size_t) { refuse(); }
DeviceSlots open_device_slots(Backend&, Fd, const PullSetup&, const std::string&) { refuse(); }
std::optional<SharedAllocation> share_allocation(Backend&, const void*, std::string& why) {
  why = "this build has no CUDA";
  return std::nullopt;
}
bool still_allocated(Backend&, const SharedAllocation&) { return false; }
MappedAllocation open_shared_allocation(Backend&, const std::array<std::byte, kHandleBytes>&,
                                        std::size_t, const std::string&) {
  refuse();
}

}  // namespace shadowsync::same_host
