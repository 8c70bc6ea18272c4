// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::NcclCommunicator: the Communicator over c10d's
/// ProcessGroupNCCL, one CUDA device per process. Only in CUDA builds of
/// LibTorch (ACCEL_WITH_NCCL); backend::Nccl is its only user.
#ifndef ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP

#include <accel/config.hpp>
#if ACCEL_WITH_NCCL

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/runtime/c10d_communicator.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/store.hpp>

namespace accel::runtime {

/// Communicator over c10d::ProcessGroupNCCL on this process's CUDA device;
/// tensors elsewhere are refused with a message (NCCL reads GPU memory only).
class NcclCommunicator final : public C10dCommunicator {
 public:
  static constexpr std::string_view name = "Nccl";

  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, const ProcessEnv& env,
                   torch::Device device, std::chrono::milliseconds timeout)
      : C10dCommunicator(name, std::move(store), env, device, Staging::Refuse, timeout) {
    c10::cuda::set_device(device_.index());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    make_group([&] { return c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank_, size_, opts); });
  }

  void barrier() override {
    // A one-element all-reduce on this rank's device: NCCL's own barrier
    // guesses the device from the rank, which is wrong with several nodes.
    auto t = torch::zeros({1}, torch::TensorOptions().device(device_));
    all_reduce(t)->wait();
    torch::cuda::synchronize(device_.index());
  }
};

/// Rendezvous (TCPStore on MASTER_ADDR:MASTER_PORT, or a FileStore) and an
/// NCCL process group over all ranks of `env`, on `device`.
inline std::shared_ptr<Communicator> make_nccl_communicator(const ProcessEnv& env,
                                                            torch::Device device,
                                                            std::chrono::milliseconds timeout,
                                                            std::optional<std::string> file_store) {
  auto store = make_store(env, StoreOptions{timeout, std::move(file_store)});
  return std::make_shared<NcclCommunicator>(std::move(store), env, device, timeout);
}

}  // namespace accel::runtime

#endif  // ACCEL_WITH_NCCL
#endif  // ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP
