# The GPU machine's programs (tests/gpu/run.sh, issue 20) compiled with
# -fsyntax-only against Debian's LibTorch headers and the CUDA toolkit's NCCL
# headers (ACCEL_WITH_NCCL=1), when the toolkit is installed ($CUDA_HOME or
# /usr/local/cuda): backend::Nccl and NcclCommunicator as a CUDA build of
# LibTorch sees them; what runs there must at least compile here. (They
# instantiate Accelerator<Nccl>; the former nccl.syntax only named it.)
set(_cuda_home "$ENV{CUDA_HOME}")
if(NOT _cuda_home)
  set(_cuda_home /usr/local/cuda)
endif()
if(EXISTS ${_cuda_home}/include/nccl.h AND EXISTS /usr/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp)
  add_test(NAME gpu.compile COMMAND ${CMAKE_COMMAND} -E env CUDA_HOME=${_cuda_home}
           OUT=${CMAKE_CURRENT_BINARY_DIR}/gpu-out bash ${PROJECT_SOURCE_DIR}/tests/gpu/run.sh --compile-only)
  set_tests_properties(gpu.compile PROPERTIES TIMEOUT 900)
endif()
