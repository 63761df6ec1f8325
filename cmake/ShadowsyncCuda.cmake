# Decides whether the CUDA/NCCL backend is built (SHADOWSYNC_WITH_CUDA = AUTO | ON | OFF) and, if
# so, enables the CUDA language. Included (not called) from the top-level CMakeLists.txt because
# enable_language() must run at directory scope.
#
# Sets SHADOWSYNC_CUDA_ENABLED (ON/OFF) and SHADOWSYNC_CUDA_REASON (one line for the status
# message). AUTO turns the backend on only when a working nvcc, the CUDA toolkit libraries and
# NCCL's header are all found; ON fails the configure with the reason when one is missing. libnccl
# itself is not needed to build: the NCCL transport opens it at run time.

include(CheckLanguage)

set(SHADOWSYNC_CUDA_ENABLED OFF)
set(SHADOWSYNC_CUDA_REASON "")
string(TOUPPER "${SHADOWSYNC_WITH_CUDA}" _ss_cuda_mode)

if(_ss_cuda_mode STREQUAL "AUTO")
  set(_ss_cuda_required OFF)
elseif(_ss_cuda_mode)
  set(_ss_cuda_required ON)
else()
  set(_ss_cuda_required OFF)
  set(SHADOWSYNC_CUDA_REASON "SHADOWSYNC_WITH_CUDA=${SHADOWSYNC_WITH_CUDA}")
endif()

if(NOT SHADOWSYNC_CUDA_REASON)
  # nvcc needs a host compiler; use the one that builds the C++ sources so both sides agree on the
  # standard library and ABI. check_language() runs a sub-project that only reads CUDAHOSTCXX.
  if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX})
    set(ENV{CUDAHOSTCXX} "${CMAKE_CXX_COMPILER}")
    set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}" CACHE FILEPATH "CUDA host compiler")
  endif()
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    set(SHADOWSYNC_CUDA_REASON
      "no working CUDA compiler (nvcc not on PATH/CUDACXX, or it rejects host compiler ${CMAKE_CXX_COMPILER})")
  endif()
endif()

if(NOT SHADOWSYNC_CUDA_REASON)
  # Look for the toolkit next to the nvcc that check_language() accepted, so headers, libraries and
  # compiler come from one installation.
  if(NOT DEFINED CUDAToolkit_ROOT AND NOT DEFINED ENV{CUDAToolkit_ROOT})
    get_filename_component(_ss_nvcc_real "${CMAKE_CUDA_COMPILER}" REALPATH)
    get_filename_component(_ss_nvcc_bin "${_ss_nvcc_real}" DIRECTORY)
    get_filename_component(CUDAToolkit_ROOT "${_ss_nvcc_bin}" DIRECTORY)
  endif()
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    set(SHADOWSYNC_CUDA_REASON "nvcc found (${CMAKE_CUDA_COMPILER}) but find_package(CUDAToolkit) failed")
  elseif(NOT TARGET CUDA::cudart OR NOT TARGET CUDA::cuda_driver)
    set(SHADOWSYNC_CUDA_REASON "CUDA toolkit ${CUDAToolkit_VERSION} lacks libcudart or the libcuda stub")
  endif()
endif()

if(NOT SHADOWSYNC_CUDA_REASON)
  find_package(NCCL QUIET)
  if(NOT NCCL_FOUND)
    set(SHADOWSYNC_CUDA_REASON
      "NCCL's header not found (nccl.h; searched NCCL_ROOT, NCCL_HOME, ${CUDAToolkit_INCLUDE_DIRS}, /usr/local/cuda, /usr)")
  endif()
endif()

if(SHADOWSYNC_CUDA_REASON)
  if(_ss_cuda_required)
    message(FATAL_ERROR "shadowsync: SHADOWSYNC_WITH_CUDA=ON but ${SHADOWSYNC_CUDA_REASON}. "
      "Set CUDACXX / CUDAToolkit_ROOT / NCCL_ROOT, or configure with -DSHADOWSYNC_WITH_CUDA=OFF.")
  endif()
  message(STATUS "shadowsync: CUDA/NCCL backend OFF (${_ss_cuda_mode}: ${SHADOWSYNC_CUDA_REASON})")
else()
  # Hopper (H100/H200) is the target; override with -DCMAKE_CUDA_ARCHITECTURES=...
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures to build for")
  endif()
  # One CUDA runtime per process: the library links the shared libcudart (CUDA::cudart), so .cu
  # objects must not pull in the static one that CMake would add by default.
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
  enable_language(CUDA)
  # CMake < 3.26 does not know that nvcc >= 12 accepts -std=c++20 (CUDA_STANDARD 20 would fail to
  # generate); teach it.
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION
     AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
     AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  set(SHADOWSYNC_CUDA_ENABLED ON)
  set(SHADOWSYNC_CUDA_REASON
    "CUDA ${CUDAToolkit_VERSION} (${CMAKE_CUDA_COMPILER}, host ${CMAKE_CUDA_HOST_COMPILER}, arch ${CMAKE_CUDA_ARCHITECTURES}), nccl.h ${NCCL_VERSION} (${NCCL_INCLUDE_DIR}; libnccl is opened at run time)")
  message(STATUS "shadowsync: CUDA/NCCL backend ON (${_ss_cuda_mode}: ${SHADOWSYNC_CUDA_REASON})")
endif()

unset(_ss_cuda_mode)
unset(_ss_cuda_required)
unset(_ss_nvcc_real)
unset(_ss_nvcc_bin)
