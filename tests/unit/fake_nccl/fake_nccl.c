/* Stand-ins for libnccl, for tests/unit/test_nccl_library.cpp: each is built as a shared library
 * (cmake/ShadowsyncTesting.cmake, shadowsync_add_fake_nccl_libraries). With FAKE_NCCL_VERSION
 * defined it exports ncclGetVersion reporting that version code and nothing else of NCCL's API;
 * without, it exports no NCCL symbol at all. */
#if defined(FAKE_NCCL_VERSION)
int ncclGetVersion(int* version);
int ncclGetVersion(int* version) {
  *version = FAKE_NCCL_VERSION;
  return 0; /* ncclSuccess */
}
#endif

/* Something to export either way, so the library is never empty. */
int fake_nccl_marker(void);
int fake_nccl_marker(void) { return 1; }
