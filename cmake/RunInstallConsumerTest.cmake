# ctest install.find_package (cmake -P): install the shadowsync build tree into a scratch prefix,
# then configure, build and run tests/install_consumer against that prefix only.
#
# Inputs (-D): SHADOWSYNC_BUILD_DIR, CONSUMER_SOURCE_DIR, WORK_DIR, CONFIG, GENERATOR, CXX_COMPILER,
# PREFIX_PATH and HINTS ('|'-separated; HINTS holds VAR=VALUE cache entries for the consumer).

cmake_minimum_required(VERSION 3.25)

foreach(var IN ITEMS SHADOWSYNC_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "RunInstallConsumerTest: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)  # single-config build without CMAKE_BUILD_TYPE
endif()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc COMMAND_ECHO STDOUT)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "install consumer test: ${what} failed (${rc})")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/build")
file(REMOVE_RECURSE "${WORK_DIR}")

run_step("cmake --install" "${CMAKE_COMMAND}" --install "${SHADOWSYNC_BUILD_DIR}"
  --prefix "${prefix}" --config "${CONFIG}")

# Settings for the consumer go through an initial-cache file: lists (the prefix path) survive
# intact there, unlike on a command line.
string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
list(PREPEND prefix_path "${prefix}")
set(init_cache "${WORK_DIR}/consumer-init.cmake")
file(WRITE "${init_cache}" "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE STRING \"\")\n")
string(REPLACE "|" ";" hints "${HINTS}")
foreach(hint IN LISTS hints)
  if(hint MATCHES "^([^=]+)=(.*)$")
    file(APPEND "${init_cache}" "set(${CMAKE_MATCH_1} \"${CMAKE_MATCH_2}\" CACHE STRING \"\")\n")
  endif()
endforeach()
set(configure_args
  -C "${init_cache}"
  -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}" -G "${GENERATOR}"
  "-DCMAKE_BUILD_TYPE=${CONFIG}"
  # Only the scratch prefix may provide shadowsync: no user/system package registry.
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()

run_step("configuring the consumer" "${CMAKE_COMMAND}" ${configure_args})
run_step("building the consumer" "${CMAKE_COMMAND}" --build "${consumer_build}" --config "${CONFIG}")

# The package must have come from the scratch prefix, not from the build tree or the system.
file(STRINGS "${consumer_build}/CMakeCache.txt" found_dir REGEX "^shadowsync_DIR:")
string(FIND "${found_dir}" "${prefix}/" at)
if(at EQUAL -1)
  message(FATAL_ERROR "install consumer test: shadowsync was found outside ${prefix}: ${found_dir}")
endif()

find_program(consumer NAMES consumer
  PATHS "${consumer_build}" "${consumer_build}/${CONFIG}" NO_DEFAULT_PATH NO_CACHE)
if(NOT consumer)
  message(FATAL_ERROR "install consumer test: no consumer executable under ${consumer_build}")
endif()
execute_process(COMMAND "${consumer}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "consumer says: ${out}${err}")
if(NOT rc EQUAL 0 OR NOT out MATCHES "fingerprint [0-9a-f]+")
  message(FATAL_ERROR "install consumer test: running ${consumer} failed (${rc})")
endif()
