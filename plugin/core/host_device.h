// SHADOWSYNC_HOST_DEVICE: marks an inline function that both the host backend (host code) and the
// CUDA backend (device code, under nvcc) compile, so that both compute the same bits. Not
// installed.
#pragma once

#if !defined(SHADOWSYNC_HOST_DEVICE)
#if defined(__CUDACC__)
#define SHADOWSYNC_HOST_DEVICE __host__ __device__
#else
#define SHADOWSYNC_HOST_DEVICE
#endif
#endif
