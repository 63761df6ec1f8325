// Builds against the installed package only: public headers, exported targets (the library and
// the C++ engine adapter), dependencies.
#include <cstdio>
#include <span>
#include <vector>

#include "shadowsync/engine_adapter.h"
#include "shadowsync/host_backend.h"
#include "shadowsync/layout.h"
#if defined(SHADOWSYNC_WITH_CUDA)
#include "shadowsync/nccl_transport.h"
#endif

namespace {

// A worker with no parameters: enough to construct the adapter, whose code the installed archive
// must provide.
class NoWorker final : public shadowsync::engine_adapter::Worker {
 public:
  std::vector<shadowsync::engine_adapter::NamedParameter> named_parameters() override { return {}; }
  void load_weights(std::span<const shadowsync::engine_adapter::WeightBinding>) override {}
  void execute_model(shadowsync::Stream&) override {}
};

}  // namespace

int main() {
  using shadowsync::DType;
  const auto layout =
      shadowsync::Layout::build({shadowsync::TensorSpec{"w", DType::kFloat32, {4, 4}}});
  shadowsync::HostBackend backend;
  const auto stream = backend.create_stream(shadowsync::StreamPriority::kNormal);
  NoWorker worker;
  const shadowsync::engine_adapter::WorkerExtension extension(worker, backend, *stream);
  std::printf("shadowsync consumer: fingerprint %016llx, engine adapter %s\n",
              static_cast<unsigned long long>(layout.fingerprint()),
              extension.initialized() ? "initialized" : "constructed");
#if defined(SHADOWSYNC_WITH_CUDA)
  // Links the NCCL transport, which opens libnccl at run time: the package names no NCCL, and the
  // link needs none. Not called: that would need NCCL on the machine running the test.
  auto* volatile create = &shadowsync::NcclTransport::create;
  auto* volatile library = &shadowsync::NcclTransport::library;
  std::printf("shadowsync consumer: NCCL transport linked (%d)\n",
              create != nullptr && library != nullptr);
#endif
  return 0;
}
