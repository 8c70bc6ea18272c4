# At least one translation unit of accel's headers built with clang++ (the
# LibTorch-free ones; see tests/clang/torch_free_headers.cpp for why).
find_program(ACCEL_CLANGXX NAMES clang++ clang++-14 clang++-16 clang++-19)
if(ACCEL_CLANGXX)
  add_test(NAME clang.torch_free_headers
    COMMAND ${ACCEL_CLANGXX} -std=c++20 -Wall -Wextra -Werror -fsyntax-only
            -I${PROJECT_SOURCE_DIR}/include ${CMAKE_CURRENT_SOURCE_DIR}/clang/torch_free_headers.cpp)
  set_tests_properties(clang.torch_free_headers PROPERTIES TIMEOUT 300)
else()
  message(STATUS "accel: clang++ not found; clang.torch_free_headers is not registered")
endif()
