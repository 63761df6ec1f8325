# FindNCCL: locates NCCL's header (nccl.h) and provides the imported target NCCL::headers.
#
# Only the header: shadowsync opens libnccl at run time (dlopen; see include/shadowsync/
# nccl_transport.h), so that a process keeps the one NCCL it already has (torch's), and nothing
# links libnccl at build time.
#
# Search order: NCCL_INCLUDE_DIR if given, then the NCCL_ROOT and NCCL_HOME variables or
# environment variables, the CUDA toolkit (CUDAToolkit_INCLUDE_DIRS, when find_package(CUDAToolkit)
# ran first), /usr/local/cuda, and the system default paths (/usr/include).
#
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_VERSION (from nccl.h's NCCL_MAJOR,
# NCCL_MINOR and NCCL_PATCH: the API the code is compiled against, not the library it will run on).

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
  REQUIRED_VARS NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)
mark_as_advanced(NCCL_INCLUDE_DIR)

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  if(NOT TARGET NCCL::headers)
    add_library(NCCL::headers INTERFACE IMPORTED)
    set_target_properties(NCCL::headers PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()

unset(_nccl_hints)
unset(_nccl_root)
unset(_nccl_version_lines)
