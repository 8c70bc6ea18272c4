# libFuzzer target for the torch-free safetensors parser (tests/fuzz/). It is
# compiled by invoking clang++ directly: the project compiler may be GCC, and
# the target must stay out of the LibTorch PCH (it only needs nlohmann_json and
# include/). Skipped, with a message, where clang's libFuzzer is unavailable.
find_program(ACCEL_FUZZ_CLANGXX NAMES clang++ clang++-16 clang++-15 clang++-14)
set(_accel_fuzz_flags -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined
    -fno-sanitize-recover=all -Wall -Wextra)
if(ACCEL_FUZZ_CLANGXX AND NOT DEFINED ACCEL_FUZZ_WORKS)
  set(_probe ${CMAKE_CURRENT_BINARY_DIR}/fuzz/probe)
  file(WRITE ${_probe}.cpp
    "#include <cstddef>\n#include <cstdint>\n"
    "extern \"C\" int LLVMFuzzerTestOneInput(const std::uint8_t*, std::size_t) { return 0; }\n")
  execute_process(COMMAND ${ACCEL_FUZZ_CLANGXX} ${_accel_fuzz_flags} ${_probe}.cpp -o ${_probe}
                  RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_QUIET)
  if(_rc EQUAL 0)
    set(ACCEL_FUZZ_WORKS TRUE CACHE INTERNAL "clang++ links -fsanitize=fuzzer")
  else()
    set(ACCEL_FUZZ_WORKS FALSE CACHE INTERNAL "clang++ links -fsanitize=fuzzer")
  endif()
endif()

if(NOT ACCEL_FUZZ_WORKS)
  message(STATUS "accel: clang++ with libFuzzer not found; fuzz.safetensors is not registered")
  return()
endif()

set(_fuzz_dir ${CMAKE_CURRENT_BINARY_DIR}/fuzz)
set(_fuzz_exe ${_fuzz_dir}/safetensors_fuzz)
set(_fuzz_includes -I${PROJECT_SOURCE_DIR}/include)
get_target_property(_json_includes nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
if(_json_includes)
  list(REMOVE_DUPLICATES _json_includes)
  foreach(_dir IN LISTS _json_includes)
    # Naming a system directory again would break clang's #include_next.
    if(NOT _dir IN_LIST CMAKE_CXX_IMPLICIT_INCLUDE_DIRECTORIES AND NOT _dir STREQUAL "/usr/include")
      list(APPEND _fuzz_includes -isystem ${_dir})
    endif()
  endforeach()
endif()
add_custom_command(
  OUTPUT ${_fuzz_exe}
  COMMAND ${ACCEL_FUZZ_CLANGXX} ${_accel_fuzz_flags} ${_fuzz_includes}
          ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/safetensors_fuzz.cpp -o ${_fuzz_exe}
  DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/safetensors_fuzz.cpp
          ${PROJECT_SOURCE_DIR}/include/accel/checkpoint/detail/safetensors_format.hpp
          ${PROJECT_SOURCE_DIR}/include/accel/errors.hpp
  COMMENT "Building the safetensors fuzzer with ${ACCEL_FUZZ_CLANGXX}"
  VERBATIM)
add_custom_target(fuzz_safetensors ALL DEPENDS ${_fuzz_exe})
file(MAKE_DIRECTORY ${_fuzz_dir}/corpus)

# New inputs go to the first (build-tree) corpus; the checked-in seeds are read only.
add_test(NAME fuzz.safetensors
  COMMAND ${_fuzz_exe} -max_total_time=20 -rss_limit_mb=2048 -print_final_stats=1
          -artifact_prefix=${_fuzz_dir}/ ${_fuzz_dir}/corpus ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus
  WORKING_DIRECTORY ${_fuzz_dir})
set_tests_properties(fuzz.safetensors PROPERTIES TIMEOUT 120 LABELS fuzz)
