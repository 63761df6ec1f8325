// Builds against the installed package only: public header, exported target, dependencies.
#include <cstdio>

#include "shadowsync/layout.h"

int main() {
  using shadowsync::DType;
  const auto layout =
      shadowsync::Layout::build({shadowsync::TensorSpec{"w", DType::kFloat32, {4, 4}}});
  std::printf("shadowsync consumer: fingerprint %016llx\n",
              static_cast<unsigned long long>(layout.fingerprint()));
  return 0;
}
