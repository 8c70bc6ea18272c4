// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::SingleDevice: one process, one device.
#ifndef ACCEL_BACKEND_SINGLE_DEVICE_HPP
#define ACCEL_BACKEND_SINGLE_DEVICE_HPP

#include <memory>
#include <string_view>

#include <accel/backend/concept.hpp>

namespace accel::backend {

/// One process on CUDA device 0 when available, else the CPU. The rank
/// variables of a launcher are ignored: every process trains on its own.
struct SingleDevice {
  static constexpr std::string_view name = "SingleDevice";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "single";
  static constexpr bool multi_process = false;
  static constexpr bool available = true;

  static torch::Device device(const runtime::ProcessEnv&) {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv&,
                                                                  const AcceleratorOptions&) {
    return std::make_shared<runtime::LocalCommunicator>();
  }
};

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_SINGLE_DEVICE_HPP
