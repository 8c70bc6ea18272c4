# Finds what accel::accel needs and defines accel_link_dependencies(target).
# Shared by the build tree and the installed accelConfig.cmake so both agree.
include(CMakeFindDependencyMacro)
include(GNUInstallDirs)

if(NOT TARGET torch)
  find_dependency(Torch)
endif()
find_dependency(Boost)
find_dependency(nlohmann_json)
find_dependency(yaml-cpp)  # launch/config_file.hpp reads Accelerate-style YAML configs
# logging/: spdlog's compiled library (Debian's libspdlog-dev; its fmt::fmt is
# Debian's libfmt.so). Header-only spdlog would make every translation unit
# that includes accel compile spdlog's formatters and sinks: about 9 s of a
# 38 s compile (bench/compile_time.sh). The GPU bundle's spdlog::spdlog is
# header-only over a header-only fmt.
find_dependency(spdlog)
if(NOT DEFINED ACCEL_WITH_MPI OR ACCEL_WITH_MPI)
  find_package(MPI QUIET COMPONENTS CXX)
endif()

function(accel_link_dependencies target)
  # spdlog first: its fmt's include folder must come before LibTorch's, as
  # pip's LibTorch carries an fmt of its own (another version) in include/.
  target_link_libraries(${target} INTERFACE spdlog::spdlog torch Boost::headers
                                            nlohmann_json::nlohmann_json yaml-cpp)
  # A CUDA build of LibTorch brings NCCL: backend::Nccl becomes available.
  if(TORCH_CUDA_LIBRARIES)
    target_compile_definitions(${target} INTERFACE ACCEL_WITH_NCCL=1 ACCEL_WITH_CUDA=1)
  endif()
  if(MPI_CXX_FOUND)
    target_link_libraries(${target} INTERFACE MPI::MPI_CXX)
    target_compile_definitions(${target} INTERFACE ACCEL_WITH_MPI=1)
  endif()
endfunction()
