# Syntax check of the NCCL code path (ACCEL_WITH_NCCL=1) against Debian's
# LibTorch headers and the CUDA toolkit's NCCL headers, when the toolkit is
# installed ($CUDA_HOME or /usr/local/cuda). The LibTorch CPU package lacks one
# generated CUDA header (c10/cuda/impl/cuda_cmake_macros.h): a stub is written.
set(_cuda_home "$ENV{CUDA_HOME}")
if(NOT _cuda_home)
  set(_cuda_home /usr/local/cuda)
endif()
if(EXISTS ${_cuda_home}/include/nccl.h AND EXISTS /usr/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp)
  set(_stub ${CMAKE_CURRENT_BINARY_DIR}/nccl_stub)
  file(WRITE ${_stub}/c10/cuda/impl/cuda_cmake_macros.h "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
  add_test(NAME nccl.syntax
    COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only -Wall -Wextra -Werror
            -DACCEL_WITH_NCCL=1 -DACCEL_WITH_CUDA=1 -DUSE_C10D_NCCL -D_GLIBCXX_USE_CXX11_ABI=1
            -I${PROJECT_SOURCE_DIR}/include -isystem /usr/include/torch/csrc/api/include
            -isystem ${_cuda_home}/include -isystem ${_stub}
            ${CMAKE_CURRENT_SOURCE_DIR}/nccl/nccl_syntax.cpp)
  set_tests_properties(nccl.syntax PROPERTIES TIMEOUT 600)
endif()

# The GPU machine's programs (tests/gpu/run.sh, issue 20) compiled the same way:
# what runs there must at least compile here.
if(EXISTS ${_cuda_home}/include/nccl.h AND EXISTS /usr/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp)
  add_test(NAME gpu.compile COMMAND ${CMAKE_COMMAND} -E env CUDA_HOME=${_cuda_home}
           OUT=${CMAKE_CURRENT_BINARY_DIR}/gpu-out bash ${PROJECT_SOURCE_DIR}/tests/gpu/run.sh --compile-only)
  set_tests_properties(gpu.compile PROPERTIES TIMEOUT 900)
endif()
