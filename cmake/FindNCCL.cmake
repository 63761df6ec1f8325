# FindNCCL: locates the NCCL header and library and provides the imported target NCCL::nccl.
#
# Search order: NCCL_INCLUDE_DIR / NCCL_LIBRARY if given, then the NCCL_ROOT and NCCL_HOME
# variables or environment variables, the CUDA toolkit (CUDAToolkit_INCLUDE_DIRS /
# CUDAToolkit_LIBRARY_DIR, when find_package(CUDAToolkit) ran first), /usr/local/cuda, and the
# system default paths (/usr/include, /usr/lib/<triplet>).
#
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES, NCCL_VERSION.
# Installed next to shadowsyncConfig.cmake so that a CUDA-enabled shadowsync resolves NCCL::nccl
# for its consumers the same way.

set(_nccl_hints)
foreach(_nccl_root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${NCCL_HOME}" "$ENV{NCCL_HOME}")
  if(_nccl_root)
    list(APPEND _nccl_hints "${_nccl_root}")
  endif()
endforeach()

find_path(NCCL_INCLUDE_DIR
  NAMES nccl.h
  HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
  PATH_SUFFIXES include
  PATHS /usr/local/cuda /usr
  DOC "Directory containing nccl.h")

find_library(NCCL_LIBRARY
  NAMES nccl
  HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
  PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu
  PATHS /usr/local/cuda /usr
  DOC "Path to libnccl")

set(NCCL_VERSION "")
if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
    REGEX "^#define NCCL_(MAJOR|MINOR|PATCH)[ \t]+[0-9]+")
  foreach(_part IN ITEMS MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part}[ \t]+([0-9]+)" _ "${_nccl_version_lines}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  if(NOT _nccl_MAJOR STREQUAL "")
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::nccl)
    add_library(NCCL::nccl UNKNOWN IMPORTED)
    set_target_properties(NCCL::nccl PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()

unset(_nccl_hints)
unset(_nccl_root)
