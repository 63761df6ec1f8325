# Warnings and sanitizers for every target defined after this file is included (directory scope,
# so a parent project that add_subdirectory()s shadowsync keeps its own flags).

# Warnings: C++ sources only. nvcc would forward them to the host compiler for the code it
# generates, which is noisy and not ours to fix.
set(_ss_warning_flags -Wall -Wextra -Wpedantic)
if(SHADOWSYNC_WERROR)
  list(APPEND _ss_warning_flags -Werror)
endif()
add_compile_options("$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang,AppleClang>:${_ss_warning_flags}>")

# Sanitizers: "address", "undefined", "address,undefined" or "thread".
set(_ss_sanitizers "${SHADOWSYNC_SANITIZE}")
string(REPLACE " " "" _ss_sanitizers "${_ss_sanitizers}")
if(_ss_sanitizers)
  string(REPLACE "," ";" _ss_sanitizer_list "${_ss_sanitizers}")
  foreach(_ss_sanitizer IN LISTS _ss_sanitizer_list)
    if(NOT _ss_sanitizer MATCHES "^(address|undefined|thread)$")
      message(FATAL_ERROR "shadowsync: SHADOWSYNC_SANITIZE='${SHADOWSYNC_SANITIZE}': unknown "
        "sanitizer '${_ss_sanitizer}' (use \"\", \"address,undefined\" or \"thread\")")
    endif()
  endforeach()
  if("thread" IN_LIST _ss_sanitizer_list AND "address" IN_LIST _ss_sanitizer_list)
    message(FATAL_ERROR "shadowsync: SHADOWSYNC_SANITIZE='${SHADOWSYNC_SANITIZE}': thread and "
      "address sanitizers cannot be combined")
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    message(FATAL_ERROR "shadowsync: SHADOWSYNC_SANITIZE needs GCC or Clang, not ${CMAKE_CXX_COMPILER_ID}")
  endif()

  set(_ss_sanitizer_flags -fsanitize=${_ss_sanitizers} -fno-omit-frame-pointer)
  if("undefined" IN_LIST _ss_sanitizer_list)
    # Make every UB report fatal so ctest sees a failure, not a line in the log.
    list(APPEND _ss_sanitizer_flags -fno-sanitize-recover=all)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${_ss_sanitizer_flags}>")
  if("thread" IN_LIST _ss_sanitizer_list AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU"
     AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 11)
    # GCC warns that TSan ignores atomic_thread_fence (moodycamel uses it); the test main
    # suppresses the resulting reports (tests/support/catch_main.cpp). Keep the log readable.
    add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:-Wno-tsan>")
  endif()
  # Links always go through the host compiler (also for CUDA targets), so no language filter.
  add_link_options(${_ss_sanitizer_flags})
  message(STATUS "shadowsync: sanitizers: ${_ss_sanitizers}")
endif()

unset(_ss_warning_flags)
unset(_ss_sanitizers)
unset(_ss_sanitizer_list)
unset(_ss_sanitizer)
unset(_ss_sanitizer_flags)
