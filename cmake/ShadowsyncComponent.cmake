# shadowsync_add_component(NAME <name> [HEADERS <public headers under include/shadowsync>...]
#                          [DEPENDS <targets>...] [PRIVATE_DEPENDS <targets>...]
#                          [EXCLUDE <file names of the folder not in the library>...])
#
# One folder of plugin/ -> one static library `shadowsync_<name>` (alias and exported name
# shadowsync::<name>) built from that folder's *.cpp and *.cu. DEPENDS are the components and
# packages its public headers need; PRIVATE_DEPENDS those only its sources need. A component sees
# no library it does not name here: core names no CUDA, NCCL or OpenSSL, so it cannot include
# them. Which sibling folder's private headers a component may include is checked by
# scripts/check_layering.py (ctest unit.layering), from the same dependency table.
function(shadowsync_add_component)
  cmake_parse_arguments(PARSE_ARGV 0 arg "" "NAME" "HEADERS;DEPENDS;PRIVATE_DEPENDS;EXCLUDE")
  set(target "shadowsync_${arg_NAME}")
  file(GLOB sources CONFIGURE_DEPENDS
    "${CMAKE_CURRENT_SOURCE_DIR}/*.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/*.cu")
  list(TRANSFORM arg_EXCLUDE PREPEND "${CMAKE_CURRENT_SOURCE_DIR}/")
  list(REMOVE_ITEM sources ${arg_EXCLUDE})
  add_library(${target} STATIC ${sources})
  add_library(shadowsync::${arg_NAME} ALIAS ${target})
  # fmt::fmt stands for the fmt the build chose (SHADOWSYNC_FMT_HEADER_ONLY: the header-only one).
  list(TRANSFORM arg_DEPENDS REPLACE "^fmt::fmt$" "${SHADOWSYNC_FMT_TARGET}")
  list(TRANSFORM arg_PRIVATE_DEPENDS REPLACE "^fmt::fmt$" "${SHADOWSYNC_FMT_TARGET}")
  list(TRANSFORM arg_HEADERS PREPEND "${PROJECT_SOURCE_DIR}/include/shadowsync/")
  target_sources(${target} PUBLIC
    FILE_SET HEADERS
    BASE_DIRS "${PROJECT_SOURCE_DIR}/include"
    FILES ${arg_HEADERS})
  target_compile_features(${target} PUBLIC cxx_std_20)
  # Private headers are spelled from plugin/ ("core/layout_hash.h"), so a reader sees which
  # component a header belongs to.
  target_include_directories(${target} PRIVATE "${PROJECT_SOURCE_DIR}/plugin")
  target_link_libraries(${target} PUBLIC ${arg_DEPENDS} PRIVATE ${arg_PRIVATE_DEPENDS})
  set_target_properties(${target} PROPERTIES
    EXPORT_NAME ${arg_NAME}
    # The C ABI's shared library and Python extension modules link these archives.
    POSITION_INDEPENDENT_CODE ON
    CUDA_STANDARD 20
    CUDA_STANDARD_REQUIRED ON
    CUDA_EXTENSIONS OFF)
  set_property(GLOBAL APPEND PROPERTY SHADOWSYNC_COMPONENTS ${target})
endfunction()
