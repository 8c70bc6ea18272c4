# Self-containment of the public headers (every include/accel/**/*.hpp outside
# a detail/ folder): target accel_header_check compiles one translation unit
# per header that includes only that header, twice (the include guard), so a
# header that uses a name it does not include fails the build. Built with the
# tests (part of `all`), so CI builds it on both LibTorch versions.
# LibTorch's torch/torch.h comes from a precompiled header (parsing it 92
# times would cost 15 CPU-minutes): a header that uses LibTorch without
# including it is not caught here; every other omission is.
file(GLOB_RECURSE _accel_headers RELATIVE ${accel_SOURCE_DIR}/include CONFIGURE_DEPENDS
     ${accel_SOURCE_DIR}/include/accel/*.hpp)
list(FILTER _accel_headers EXCLUDE REGEX "/detail/")
list(SORT _accel_headers)
set(_accel_header_tus)
foreach(_h IN LISTS _accel_headers)
  string(MAKE_C_IDENTIFIER "${_h}" _id)
  set(_tu ${CMAKE_CURRENT_BINARY_DIR}/header_check/${_id}.cpp)
  file(CONFIGURE OUTPUT ${_tu} CONTENT "#include <${_h}>\n#include <${_h}>\n" @ONLY)
  list(APPEND _accel_header_tus ${_tu})
endforeach()
add_library(accel_header_check OBJECT ${_accel_header_tus})
target_link_libraries(accel_header_check PRIVATE accel::accel)
target_compile_options(accel_header_check PRIVATE -Wall -Wextra $<$<CONFIG:Release>:-O0>)
target_precompile_headers(accel_header_check PRIVATE <torch/torch.h>)
list(LENGTH _accel_headers _n)
message(STATUS "accel: accel_header_check compiles ${_n} public headers alone")
