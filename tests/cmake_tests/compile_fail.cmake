# Compile-fail tests: each _fail.cpp must not compile and must fail with its
# "accel:" message; each _ok.cpp twin must compile (it is built with the tests).
set(_cf ${CMAKE_CURRENT_SOURCE_DIR}/compile_fail)
accel_add_compile_fail_test(NAME prepare_unsupported_argument
  SOURCE ${_cf}/prepare_unsupported_argument_fail.cpp
  REGEX "accel: prepare\\(\\) argument is not a model.*prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<1, int>")
accel_add_compile_fail_test(NAME shard_with_single_device
  SOURCE ${_cf}/shard_with_single_device_fail.cpp
  REGEX "accel: shard::ShardOptimizer and shard::ShardGradients need more than one process")
accel_add_compile_fail_test(NAME policy_in_wrong_place
  SOURCE ${_cf}/policy_in_wrong_place_fail.cpp
  REGEX "accel: the Backend parameter of Accelerator is not a backend policy")
accel_add_compile_fail_test(NAME backend_missing_member
  SOURCE ${_cf}/backend_missing_member_fail.cpp
  REGEX "accel: this backend policy has no .static std::shared_ptr<runtime::Communicator> make_communicator")
# accelerator.hpp alone declares save_state(), gather_object(), init_trackers()
# and profile() but does not compile their areas: one error each, naming the
# header (in the order GCC instantiates the members).
accel_add_compile_fail_test(NAME area_without_header NO_PCH
  SOURCE ${_cf}/area_without_header_fail.cpp
  REGEX "accel: profile\\(\\) needs #include <accel/profiling.hpp>.*\
accel: save_state\\(\\), load_state\\(\\), load_latest_state\\(\\) and save_model\\(\\) need #include <accel/checkpoint.hpp>.*\
accel: gather_object\\(\\), broadcast_object\\(\\) and gather_for_metrics\\(\\) of a vector need #include <accel/ops.hpp>.*\
accel: init_trackers\\(\\), log\\(\\) and trackers\\(\\) need #include <accel/tracking.hpp>")
if(NOT TORCH_CUDA_LIBRARIES)
  accel_add_compile_fail_test(NAME nccl_without_nccl
    SOURCE ${_cf}/nccl_without_nccl_fail.cpp
    REGEX "accel: backend::Nccl is not available in this build")
endif()
foreach(_ok prepare_unsupported_argument shard_with_single_device nccl_without_nccl policy_in_wrong_place
            backend_missing_member area_without_header)
  add_executable(compile_ok_${_ok} ${_cf}/${_ok}_ok.cpp)
  target_link_libraries(compile_ok_${_ok} PRIVATE accel::accel accel_test_catch)
  target_precompile_headers(compile_ok_${_ok} REUSE_FROM accel_test_pch)
endforeach()
