// Builds against the installed package only: public header, exported target, dependencies.
#include <cstdio>

#include "shadowsync/layout.h"
#if defined(SHADOWSYNC_WITH_CUDA)
#include "shadowsync/nccl_transport.h"
#endif

int main() {
  using shadowsync::DType;
  const auto layout =
      shadowsync::Layout::build({shadowsync::TensorSpec{"w", DType::kFloat32, {4, 4}}});
  std::printf("shadowsync consumer: fingerprint %016llx\n",
              static_cast<unsigned long long>(layout.fingerprint()));
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
