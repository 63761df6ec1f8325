// Catch2 v2's main(), compiled once into an object library and linked into every test executable
// (the catch.hpp implementation is the slowest thing in the test build to compile).
//
// Built a second time with SHADOWSYNC_GPU_TEST_MAIN for tests/gpu: there main() first checks for
// a usable CUDA device and, if there is none, says why and exits 77, which ctest reports as
// skipped (SKIP_RETURN_CODE) rather than passed.

#if defined(__SANITIZE_THREAD__)
#define SHADOWSYNC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define SHADOWSYNC_TSAN 1
#endif
#endif

#if defined(SHADOWSYNC_TSAN)
// ThreadSanitizer does not model the standalone fences moodycamel::ConcurrentQueue synchronizes
// with (GCC warns: -Wtsan), so it reports races inside the queue's own code that are not there.
// Suppressed for every test binary, however it is run; races in our code are still reported.
extern "C" const char* __tsan_default_suppressions() { return "race:moodycamel::\n"; }
#endif

#if defined(SHADOWSYNC_GPU_TEST_MAIN)

#define CATCH_CONFIG_RUNNER
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdio>

namespace {
constexpr int kSkipReturnCode = 77;
}  // namespace

int main(int argc, char* argv[]) {
  int device_count = 0;
  const cudaError_t status = cudaGetDeviceCount(&device_count);
  if (status != cudaSuccess || device_count == 0) {
    std::printf("SKIPPED: no usable CUDA device (%s)\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "cudaGetDeviceCount: 0");
    return kSkipReturnCode;
  }
  const int failures = Catch::Session().run(argc, argv);
  // Catch returns the number of failed assertions; 77 of them must not read as "skipped".
  return failures == kSkipReturnCode ? 1 : failures;
}

#else

#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>

#endif
