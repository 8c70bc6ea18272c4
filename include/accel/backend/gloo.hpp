// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Gloo: PyTorch's c10d Gloo process group.
#ifndef ACCEL_BACKEND_GLOO_HPP
#define ACCEL_BACKEND_GLOO_HPP

#include <memory>
#include <string_view>

#include <accel/backend/concept.hpp>
#include <accel/runtime/gloo_communicator.hpp>

namespace accel::backend {

/// CPU tensors (and CUDA) across processes and machines; rendezvous through
/// a c10d TCPStore at MASTER_ADDR:MASTER_PORT, or a FileStore
/// (AcceleratorOptions::file_store).
struct Gloo {
  static constexpr std::string_view name = runtime::GlooCommunicator::name;
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "gloo";
  static constexpr bool multi_process = true;
  static constexpr bool available = true;

  static torch::Device device(const runtime::ProcessEnv& env) {
    if (torch::cuda::is_available())
      return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                             env.local_rank % static_cast<int>(torch::cuda::device_count())));
    return torch::Device(torch::kCPU);
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv& env,
                                                                  const AcceleratorOptions& opts) {
    if (env.world_size == 1) return std::make_shared<runtime::LocalCommunicator>();
    runtime::GlooOptions g;
    g.timeout = opts.timeout;
    g.file_store = opts.file_store;
    return runtime::make_gloo_communicator(env, g);
  }
};

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_GLOO_HPP
