// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Nccl: c10d's NCCL process group, one CUDA
/// device per process. Usable only where ACCEL_WITH_NCCL is 1 (a CUDA build of
/// LibTorch); elsewhere Accelerator<backend::Nccl> is a compile error.
#ifndef ACCEL_BACKEND_NCCL_HPP
#define ACCEL_BACKEND_NCCL_HPP

#include <memory>
#include <string_view>

#include <accel/backend/concept.hpp>
#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/nccl_communicator.hpp>  // empty unless ACCEL_WITH_NCCL

namespace accel::backend {

struct Nccl {
  static constexpr std::string_view name = "Nccl";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "nccl";
  static constexpr bool multi_process = true;
  static constexpr bool available = ACCEL_WITH_NCCL;

  static torch::Device device(const runtime::ProcessEnv& env) {
    ACCEL_CHECK(torch::cuda::is_available(),
                "accel: backend::Nccl needs a CUDA device, and none is visible. Use backend::Gloo "
                "on CPU, or check CUDA_VISIBLE_DEVICES and the driver.");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                           env.local_rank % static_cast<int>(torch::cuda::device_count())));
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(
      [[maybe_unused]] const runtime::ProcessEnv& env,
      [[maybe_unused]] const AcceleratorOptions& opts) {
#if ACCEL_WITH_NCCL
    return runtime::make_nccl_communicator(env, device(env), opts.timeout, opts.file_store);
#else
    throw Error("accel: backend::Nccl is not available in this build. Use backend::Gloo.");
#endif
  }
};

#if ACCEL_WITH_NCCL
static_assert(Nccl::name == runtime::NcclCommunicator::name);
#endif

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_NCCL_HPP
