# Test, example and benchmark targets. Every source file is picked up by a CONFIGURE_DEPENDS glob,
# so adding a file needs no CMake edit (the next build re-runs the configure step).
#
# Naming (one executable and one ctest per file):
#   tests/unit/test_foo.cpp        target unit_test_foo         ctest unit.test_foo
#                                  binary <build>/tests/unit/test_foo          label unit
#   tests/integration/test_bar.cpp target integration_test_bar  ctest integration.test_bar
#                                  binary <build>/tests/integration/test_bar   label integration
#   tests/gpu/baz.{cpp,cu}         target gpu_baz               ctest gpu.baz (CUDA builds only)
#                                  binary <build>/tests/gpu/baz     label gpu, exit 77 = skipped
#   examples/demo.cpp              target demo                  binary <build>/examples/demo
#   bench/bench_x.cpp              target bench_x               binary <build>/bench/bench_x
#   bench/bench_y.cu               target bench_y (CUDA builds only)
#   bench/support/*.cpp            static library shadowsync_bench_support, linked by every bench
#                                  program (bench/support/*.cu too, in CUDA builds only)
#   (bench smoke test)             ctest bench.bench_updates_cpu: bench_updates --cpu, label bench
#   (install test)                 ctest install.find_package   labels unit;install
#   tests/c_abi/foo.c              target c_abi_foo             ctest c_abi.foo     label unit
#                                  binary <build>/tests/c_abi/foo: C11, -pedantic -Werror, linked
#                                  against libshadowsync_c (the header must stay plain C)
#   (export tests)                 ctest unit.shadowsync_c_exports_no_testing_hooks and
#                                  unit.shadowsync_c_testing_exports_hooks     label unit

# tests/support/*.cpp (except catch_main.cpp), plus tests/support/*.cu in CUDA builds ->
# shadowsync_testkit: the fake engines, the oracle and other helpers shared by tests and
# benchmarks (not examples: they link examples/common). It must not depend on Catch2. White-box
# tests may include private headers from plugin/ through it; it passes fmt on to whoever links it.
function(shadowsync_add_testkit)
  file(GLOB sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/tests/support/*.cpp")
  list(FILTER sources EXCLUDE REGEX "/catch_main\\.cpp$")
  if(SHADOWSYNC_CUDA_ENABLED)
    file(GLOB cuda_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/tests/support/*.cu")
    list(APPEND sources ${cuda_sources})
  endif()
  if(sources)
    add_library(shadowsync_testkit STATIC ${sources})
    set_target_properties(shadowsync_testkit PROPERTIES
      CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
    set(scope PUBLIC)
  else()
    add_library(shadowsync_testkit INTERFACE)
    set(scope INTERFACE)
  endif()
  target_include_directories(shadowsync_testkit ${scope}
    "${PROJECT_SOURCE_DIR}/tests/support"
    "${PROJECT_SOURCE_DIR}/plugin")
  target_include_directories(shadowsync_testkit SYSTEM ${scope}
    "${SHADOWSYNC_CONCURRENTQUEUE_INCLUDE_DIR}")
  target_link_libraries(shadowsync_testkit ${scope}
    shadowsync::shadowsync shadowsync::control shadowsync::c_api fmt::fmt)
endfunction()

# How test code compiles: for the build's time, not the debugger's (every build of CI compiles
# all tests, and Catch2's assertion macros expand to much code). CATCH_CONFIG_FAST_COMPILE drops
# the try/catch around each REQUIRE (an exception still fails the test case; Catch2 wants it in
# every file of a test binary or in none). Test sources get line tables only (-g1: file:line in
# failures, sanitizer reports and backtraces) and, in RelWithDebInfo, -O1; the library keeps the
# build type's flags. Catch's main(), the slowest file of all, is compiled without optimization
# or debug info: its speed and its frames never matter.
set(SHADOWSYNC_TEST_DEFINITIONS CATCH_CONFIG_FAST_COMPILE)
set(SHADOWSYNC_TEST_OPTIONS
  "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>:-g1>"
  "$<$<AND:$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>,$<CONFIG:RelWithDebInfo>>:-O1>")
set(SHADOWSYNC_CATCH_MAIN_OPTIONS "$<$<COMPILE_LANG_AND_ID:CXX,GNU,Clang>:-O0;-g0>")

# tests/support/catch_main.cpp -> object libraries holding Catch2's main(), compiled once and
# linked into every test (Catch's main is the slowest file to compile). The GPU variant returns 77
# (ctest: skipped) when no CUDA device is usable.
function(shadowsync_add_catch_main)
  set(source "${PROJECT_SOURCE_DIR}/tests/support/catch_main.cpp")
  add_library(shadowsync_catch_main OBJECT "${source}")
  target_link_libraries(shadowsync_catch_main PUBLIC Catch2::Catch2)
  target_compile_features(shadowsync_catch_main PUBLIC cxx_std_20)
  target_compile_definitions(shadowsync_catch_main PRIVATE ${SHADOWSYNC_TEST_DEFINITIONS})
  target_compile_options(shadowsync_catch_main PRIVATE ${SHADOWSYNC_CATCH_MAIN_OPTIONS})
  if(SHADOWSYNC_CUDA_ENABLED)
    add_library(shadowsync_catch_main_gpu OBJECT "${source}")
    target_compile_definitions(shadowsync_catch_main_gpu PRIVATE SHADOWSYNC_GPU_TEST_MAIN=1
      ${SHADOWSYNC_TEST_DEFINITIONS})
    target_compile_options(shadowsync_catch_main_gpu PRIVATE ${SHADOWSYNC_CATCH_MAIN_OPTIONS})
    target_link_libraries(shadowsync_catch_main_gpu PUBLIC Catch2::Catch2 CUDA::cudart)
    target_compile_features(shadowsync_catch_main_gpu PUBLIC cxx_std_20)
  endif()
endfunction()

# One executable + one ctest per file of tests/<kind>/.
function(shadowsync_add_tests kind timeout)
  if(kind STREQUAL "gpu")
    file(GLOB sources CONFIGURE_DEPENDS
      "${PROJECT_SOURCE_DIR}/tests/gpu/*.cpp" "${PROJECT_SOURCE_DIR}/tests/gpu/*.cu")
  else()
    file(GLOB sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/tests/${kind}/test_*.cpp")
  endif()
  foreach(source IN LISTS sources)
    get_filename_component(stem "${source}" NAME_WLE)
    set(target "${kind}_${stem}")
    add_executable(${target} "${source}")
    target_link_libraries(${target} PRIVATE shadowsync_testkit Catch2::Catch2)
    target_compile_definitions(${target} PRIVATE ${SHADOWSYNC_TEST_DEFINITIONS})
    target_compile_options(${target} PRIVATE ${SHADOWSYNC_TEST_OPTIONS})
    set_target_properties(${target} PROPERTIES
      OUTPUT_NAME "${stem}"
      RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests/${kind}")
    set(main shadowsync_catch_main)
    if(kind STREQUAL "gpu")
      set(main shadowsync_catch_main_gpu)
      set_target_properties(${target} PROPERTIES
        CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
    endif()
    # A GPU test may bring its own main() (CATCH_CONFIG_RUNNER) to decide itself when to skip.
    file(STRINGS "${source}" own_main
      REGEX "CATCH_CONFIG_RUNNER|CATCH_CONFIG_MAIN|^[ \t]*int[ \t]+main[ \t]*\\(")
    if(NOT own_main)
      target_link_libraries(${target} PRIVATE ${main})
    endif()
    add_test(NAME "${kind}.${stem}" COMMAND ${target})
    set_tests_properties("${kind}.${stem}" PROPERTIES LABELS "${kind}" TIMEOUT ${timeout})
    if(kind STREQUAL "gpu")
      set_tests_properties("${kind}.${stem}" PROPERTIES SKIP_RETURN_CODE 77)
    endif()
  endforeach()
endfunction()

# One executable per <dir>/*.cpp (and <dir>/*.cu in CUDA builds), named after the file, in
# <build>/<dir>/, linked against shadowsync_testkit; examples link only the library and
# examples/common (shadowsync_examples_common), so that each can be copied out of the tree. Sources
# in <dir>/support/ (*.cpp, and *.cu in CUDA builds) are compiled once into the static library
# shadowsync_<dir>_support, which every program of <dir> links; their headers are included as
# "support/<name>.h".
function(shadowsync_add_programs dir)
  file(GLOB sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${dir}/*.cpp")
  file(GLOB support_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${dir}/support/*.cpp")
  if(SHADOWSYNC_CUDA_ENABLED)
    file(GLOB cuda_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${dir}/*.cu")
    list(APPEND sources ${cuda_sources})
    file(GLOB cuda_support_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/${dir}/support/*.cu")
    list(APPEND support_sources ${cuda_support_sources})
  endif()
  set(support "")
  if(support_sources)
    set(support "shadowsync_${dir}_support")
    add_library(${support} STATIC ${support_sources})
    target_include_directories(${support} PUBLIC "${PROJECT_SOURCE_DIR}/${dir}")
    target_link_libraries(${support} PUBLIC shadowsync_testkit)
    set_target_properties(${support} PROPERTIES
      CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  endif()
  foreach(source IN LISTS sources)
    get_filename_component(stem "${source}" NAME_WLE)
    if(TARGET ${stem})
      message(FATAL_ERROR "shadowsync: ${dir}/${stem}.cpp: a target named '${stem}' already "
        "exists; rename the file")
    endif()
    add_executable(${stem} "${source}")
    if(dir STREQUAL "examples")
      target_link_libraries(${stem} PRIVATE shadowsync_examples_common)
    else()
      target_link_libraries(${stem} PRIVATE shadowsync_testkit ${support})
    endif()
    set_target_properties(${stem} PROPERTIES RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/${dir}"
      CUDA_STANDARD 20 CUDA_STANDARD_REQUIRED ON CUDA_EXTENSIONS OFF)
  endforeach()
  # The update benchmark's CPU smoke mode runs in CI (its figures say "CPU smoke, not GPU figures").
  if(dir STREQUAL "bench" AND TARGET bench_updates AND SHADOWSYNC_BUILD_TESTS)
    add_test(NAME bench.bench_updates_cpu
      COMMAND bench_updates --cpu --out "${PROJECT_BINARY_DIR}/bench-out")
    set_tests_properties(bench.bench_updates_cpu PROPERTIES LABELS bench TIMEOUT 300)
  endif()
endfunction()

# Installs the build into a scratch prefix and builds tests/install_consumer against it through
# find_package(shadowsync): checks the exported targets, the config and the installed headers.
function(shadowsync_add_install_test)
  # Hand the consumer the exact dependencies this build used (lists joined with '|' to survive
  # add_test's argument handling).
  string(REPLACE ";" "|" prefix_path "${CMAKE_PREFIX_PATH}")
  set(hints "fmt_DIR=${fmt_DIR}")
  if(SHADOWSYNC_CUDA_ENABLED)
    get_filename_component(cuda_root "${CUDAToolkit_BIN_DIR}" DIRECTORY)
    # No NCCL hint: the package must not need NCCL (the transport opens libnccl at run time).
    list(APPEND hints "CUDAToolkit_ROOT=${cuda_root}")
  endif()
  string(REPLACE ";" "|" hints "${hints}")
  add_test(NAME install.find_package
    COMMAND "${CMAKE_COMMAND}"
      "-DSHADOWSYNC_BUILD_DIR=${PROJECT_BINARY_DIR}"
      "-DCONSUMER_SOURCE_DIR=${PROJECT_SOURCE_DIR}/tests/install_consumer"
      "-DWORK_DIR=${PROJECT_BINARY_DIR}/install_consumer"
      "-DCONFIG=$<CONFIG>"
      "-DGENERATOR=${CMAKE_GENERATOR}"
      "-DCXX_COMPILER=${CMAKE_CXX_COMPILER}"
      "-DPREFIX_PATH=${prefix_path}"
      "-DHINTS=${hints}"
      -P "${PROJECT_SOURCE_DIR}/cmake/RunInstallConsumerTest.cmake")
  set_tests_properties(install.find_package PROPERTIES LABELS "unit;install" TIMEOUT 300)
endfunction()

# tests/c_abi/*.c: C programs against the C ABI, compiled as strict C11 (-std=c11 -Wall -Wextra
# -Werror -pedantic) and linked against the shared libshadowsync_c, as a C user would.
function(shadowsync_add_c_abi_tests)
  file(GLOB sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/tests/c_abi/*.c")
  foreach(source IN LISTS sources)
    get_filename_component(stem "${source}" NAME_WLE)
    set(target "c_abi_${stem}")
    add_executable(${target} "${source}")
    target_link_libraries(${target} PRIVATE shadowsync_c)
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror -pedantic)
    set_target_properties(${target} PROPERTIES
      C_STANDARD 11 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF
      OUTPUT_NAME "${stem}"
      RUNTIME_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests/c_abi")
    add_test(NAME "c_abi.${stem}" COMMAND ${target})
    set_tests_properties("c_abi.${stem}" PROPERTIES LABELS unit TIMEOUT 60)
  endforeach()
endfunction()

# What the two C shared libraries export (tests/exports/check_exports.sh, through nm -D
# --defined-only): the product libshadowsync_c.so no test hook (shadowsync_testing_*: only the
# test-only libraries of plugin/c_api/CMakeLists.txt are built with them), and
# libshadowsync_c_testing.so, which the Python tests load, every hook python/tests/testing_hooks.py
# declares.
function(shadowsync_add_export_tests)
  if(NOT CMAKE_NM)
    message(STATUS "shadowsync: no nm found: the ctests of the C libraries' exports are left out")
    return()
  endif()
  set(check "${PROJECT_SOURCE_DIR}/tests/exports/check_exports.sh")
  add_test(NAME unit.shadowsync_c_exports_no_testing_hooks
    COMMAND sh "${check}" "${CMAKE_NM}" "$<TARGET_FILE:shadowsync_c>" none shadowsync_testing_)
  add_test(NAME unit.shadowsync_c_testing_exports_hooks
    COMMAND sh "${check}" "${CMAKE_NM}" "$<TARGET_FILE:shadowsync_c_testing>" all
      shadowsync_testing_loopback_inject_delay shadowsync_testing_loopback_inject_drop
      shadowsync_testing_loopback_inject_flip shadowsync_testing_host_arena_create)
  set_tests_properties(unit.shadowsync_c_exports_no_testing_hooks
    unit.shadowsync_c_testing_exports_hooks PROPERTIES LABELS unit TIMEOUT 60)
endfunction()

# CUDA builds: stand-ins for libnccl (tests/unit/fake_nccl/fake_nccl.c) that the NCCL loader's test
# `test_target` must refuse, their paths handed to it as SHADOWSYNC_FAKE_NCCL_* definitions:
#   OLD         exports ncclGetVersion = 21000 (NCCL 2.10.0, older than the 2.14 the code needs)
#   INCOMPLETE  exports ncclGetVersion = 22809 and nothing else of NCCL's API
#   NOT_NCCL    exports no NCCL symbol
# Also the ctest unit.shadowsync_c_needs_no_nccl: libshadowsync_c.so must not list libnccl among
# the libraries it needs (the transport opens NCCL at run time).
function(shadowsync_add_fake_nccl_libraries test_target)
  target_link_libraries(${test_target} PRIVATE NCCL::headers)  # it includes nccl_library.h
  set(source "${PROJECT_SOURCE_DIR}/tests/unit/fake_nccl/fake_nccl.c")
  foreach(variant IN ITEMS OLD INCOMPLETE NOT_NCCL)
    string(TOLOWER "fake_nccl_${variant}" target)
    add_library(${target} MODULE "${source}")
    if(variant STREQUAL "OLD")
      target_compile_definitions(${target} PRIVATE FAKE_NCCL_VERSION=21000)
    elseif(variant STREQUAL "INCOMPLETE")
      target_compile_definitions(${target} PRIVATE FAKE_NCCL_VERSION=22809)
    endif()
    set_target_properties(${target} PROPERTIES
      PREFIX "lib" LIBRARY_OUTPUT_DIRECTORY "${PROJECT_BINARY_DIR}/tests/unit/fake_nccl")
    add_dependencies(${test_target} ${target})
    target_compile_definitions(${test_target} PRIVATE
      "SHADOWSYNC_FAKE_NCCL_${variant}=\"$<TARGET_FILE:${target}>\"")
  endforeach()

  if(CMAKE_READELF)
    add_test(NAME unit.shadowsync_c_needs_no_nccl
      COMMAND sh -c [[out=$("$0" -d "$1") || exit 2; printf '%s\n' "$out" | grep NEEDED; ! printf '%s\n' "$out" | grep -qi nccl]]
        "${CMAKE_READELF}" "$<TARGET_FILE:shadowsync_c>")
    set_tests_properties(unit.shadowsync_c_needs_no_nccl PROPERTIES LABELS unit TIMEOUT 60)
  endif()
endfunction()
