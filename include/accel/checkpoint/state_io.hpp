// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StateIo, what Accelerator's save_state(),
/// load_state(), load_latest_state() and save_model() call. accelerator.hpp
/// only declares it: a translation unit compiles the checkpoint writer and
/// reader when it includes this header (through checkpoint.hpp or accel.hpp).
#ifndef ACCEL_CHECKPOINT_STATE_IO_HPP
#define ACCEL_CHECKPOINT_STATE_IO_HPP

#include <exception>
#include <filesystem>
#include <optional>
#include <utility>

#include <torch/torch.h>

#include <accel/checkpoint/latest_state.hpp>
#include <accel/checkpoint/save_model.hpp>
#include <accel/checkpoint/save_state.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::ckpt {

struct StateIo {
  static std::filesystem::path save_state(StateRegistry& reg, const AcceleratorOptions& options,
                                          std::optional<std::filesystem::path> dir) {
    return ckpt::save_state(reg, options, std::move(dir));
  }
  static std::filesystem::path load_state(StateRegistry& reg, const AcceleratorOptions& options,
                                          std::optional<std::filesystem::path> dir) {
    return ckpt::load_state(reg, options, std::move(dir));
  }
  static std::optional<std::filesystem::path> load_latest_state(StateRegistry& reg,
                                                                const AcceleratorOptions& options) {
    return ckpt::load_latest_state(reg, options);
  }
  /// The main process writes; every process makes the model's tensors
  /// readable in the writer's order, and all throw the same error.
  static void save_model(runtime::Communicator& comm, const torch::nn::Module& module,
                         const std::filesystem::path& dir, const SaveModelOptions& options,
                         bool main, const BeforeRead& make_readable) {
    const auto err = save_module_collectively(module, dir, options, main, make_readable);
    detail::agree(comm, err, "save_model", "the main process writes the files, this one wrote none");
  }
};

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_STATE_IO_HPP
