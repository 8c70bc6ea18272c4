// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::TrainingState, the state an Accelerator shares
/// with the objects it prepared (they outlive no Accelerator copy: shared_ptr).
#ifndef ACCEL_DETAIL_TRAINING_STATE_HPP
#define ACCEL_DETAIL_TRAINING_STATE_HPP

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

namespace accel::detail {

struct TrainingState {
  std::shared_ptr<runtime::Communicator> comm;
  torch::Device device{torch::kCPU};
  int gradient_accumulation_steps = 1;
  bool sync_gradients = true;     ///< false on the non-sync micro-steps of accumulate()
  int64_t micro_step = 0;         ///< counts accumulate() entries (Accelerate's `step`)
  int64_t optimizer_steps = 0;    ///< optimizer steps that really happened
  bool last_step_skipped = false; ///< the last AcceleratedOptimizer::step() did not update
  std::vector<std::shared_ptr<shard::detail::GradientSync>> syncs;  ///< one per prepared model
  /// Precision hook run before an optimizer step (Fp16: unscale, agree on
  /// inf/NaN); returns false when the step must be skipped on every rank.
  std::function<bool(torch::optim::Optimizer&)> before_step;
  /// Precision hook run after a step attempt (Fp16: update the scale).
  std::function<void(bool stepped)> after_step;

  /// Every gradient averaged and ready for the optimizer or for clipping.
  void finalize_gradients() {
    for (auto& s : syncs) s->finalize();
  }
};

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_TRAINING_STATE_HPP
