// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::TrainingState, the state an Accelerator shares
/// with the objects it prepared (they outlive no Accelerator copy: shared_ptr),
/// and the step protocol they follow around every optimizer step.
#ifndef ACCEL_DETAIL_TRAINING_STATE_HPP
#define ACCEL_DETAIL_TRAINING_STATE_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include <accel/detail/join_state.hpp>
#include <accel/errors.hpp>
#include <accel/precision/loss_scaler.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

namespace accel::shard::detail {
class ZeroReducer;
}  // namespace accel::shard::detail

namespace accel::detail {

struct TrainingState {
  std::shared_ptr<runtime::Communicator> comm;
  torch::Device device{torch::kCPU};
  int gradient_accumulation_steps = 1;
  /// The one "synchronise gradients now" flag: false on the non-sync
  /// micro-steps of accumulate(); gradient syncs read it (sync_flag()).
  bool sync_gradients = true;
  int64_t micro_step = 0;         ///< counts accumulate() entries (Accelerate's `step`)
  int64_t optimizer_steps = 0;    ///< optimizer steps that really happened
  bool last_step_skipped = false; ///< the last AcceleratedOptimizer::step() did not update
  std::vector<std::shared_ptr<shard::detail::GradientSync>> syncs;  ///< one per prepared model
  /// The sharded models' reducers (also in syncs): where an optimizer or a
  /// clip finds the model that owns its parameters.
  std::vector<std::shared_ptr<shard::detail::ZeroReducer>> sharded;
  /// precision::Fp16's loss scaler. The Accelerator owns it; a prepared
  /// optimizer may outlive the Accelerator, and must then say so.
  std::weak_ptr<precision::LossScaler> scaler;
  bool loss_scaling = false;
  /// join_uneven_inputs(): the live guard's state (null outside one).
  std::shared_ptr<JoinState> join;
  /// Each prepared optimizer's step as a rank out of data repeats it under
  /// join_uneven_inputs() (prepare() order; AcceleratedOptimizer adds it).
  std::vector<std::function<void(TrainingState&)>> optimizer_shadows;

  /// sync_gradients, shared with the gradient syncs of prepared models.
  static std::shared_ptr<const bool> sync_flag(const std::shared_ptr<TrainingState>& self) {
    return std::shared_ptr<const bool>(self, &self->sync_gradients);
  }

  /// Every gradient averaged and ready for the optimizer or for clipping.
  void finalize_gradients() {
    for (auto& s : syncs) s->finalize();
  }

  /// Before an optimizer step (Fp16: unscale the optimizer's gradients, each
  /// once per iteration, and agree on inf/NaN across ranks); false when every
  /// rank must skip it. `index`: the optimizer's place in prepare() order.
  bool before_step(torch::optim::Optimizer& opt, std::size_t index) {
    if (!loss_scaling) return true;
    // Its second step with no backward in between (a rank out of data under
    // join_uneven_inputs()): the last iteration is over.
    if (index < stepped_.size() && stepped_[index]) update_scaler();
    std::vector<torch::Tensor> params;
    for (auto& g : opt.param_groups())
      for (auto& p : g.params()) params.push_back(p);
    return !live_scaler()->unscale(params, *comm);
  }

  /// After a step attempt (Fp16: the scale is updated once per iteration:
  /// now if every prepared optimizer has stepped, else before the next
  /// backward scales a loss, as GradScaler.update() after all steps).
  void after_step(std::size_t index) {
    if (!loss_scaling) return;
    if (stepped_.size() < std::max(optimizer_shadows.size(), index + 1))
      stepped_.resize(std::max(optimizer_shadows.size(), index + 1), false);
    stepped_[index] = true;
    if (std::all_of(stepped_.begin(), stepped_.end(), [](bool b) { return b; })) update_scaler();
  }

  /// Before a backward scales its loss, or before save_state records the
  /// scale: the update an iteration with fewer steps than optimizers left.
  void settle_loss_scale() {
    if (loss_scaling && std::any_of(stepped_.begin(), stepped_.end(), [](bool b) { return b; })) update_scaler();
  }

 private:
  void update_scaler() {
    live_scaler()->update();
    stepped_.assign(stepped_.size(), false);
  }

  std::vector<bool> stepped_;  ///< Fp16: per optimizer, stepped since the last scale update

  std::shared_ptr<precision::LossScaler> live_scaler() const {
    auto s = scaler.lock();
    ACCEL_CHECK(s != nullptr, "accel: optimizer.step() after the Accelerator that prepared the "
                "optimizer was destroyed (its loss scaler went with it). Keep the Accelerator "
                "alive while you train with what it prepared.");
    return s;
  }
};

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_TRAINING_STATE_HPP
