// SPDX-License-Identifier: Apache-2.0
/// @file Defines ops::Join, what Accelerator::join_uneven_inputs() returns:
/// ranks with fewer batches than the others finish training without a hang
/// (as torch.distributed.algorithms.Join with DDP and ZeroRedundancyOptimizer).
#ifndef ACCEL_OPS_JOIN_HPP
#define ACCEL_OPS_JOIN_HPP

#include <exception>
#include <memory>
#include <utility>
#include <vector>

#include <accel/detail/join_state.hpp>
#include <accel/detail/training_state.hpp>
#include <accel/errors.hpp>

namespace accel::ops {

/// RAII: while it lives, every communicating forward of a guarded model and
/// every prepared optimizer's step() first tells the other ranks (one
/// all-gather of one number). When this rank's data ends, the guard's end
/// (destructor, or finish()) repeats what the other ranks do — the buffer
/// broadcast and gradient reductions of their forward and backward, with
/// zero gradients, and each optimizer step with the gradients so averaged
/// (loss-scaler agreement and ZeRO's all-gather included) — until every
/// rank is out of data. So every rank makes the same updates: the replicas,
/// and their optimizer states, stay equal. Gradients are divided by the
/// whole world size, ranks out of data counting as zeros (torch's default,
/// divide_by_initial_world_size=True).
class Join {
 public:
  Join(std::shared_ptr<accel::detail::TrainingState> state, std::vector<accel::detail::JoinState::Model> models)
      : state_(std::move(state)), exceptions_(std::uncaught_exceptions()) {
    ACCEL_CHECK(state_->join == nullptr, "accel: join_uneven_inputs() while another "
                "join_uneven_inputs() guard of this Accelerator lives. Use one guard, listing "
                "every model.");
    state_->join = std::make_shared<accel::detail::JoinState>(state_->comm, std::move(models));
  }
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// Leaving the training loop by an exception does not shadow anything:
  /// the other ranks then see this rank fail (the launcher stops them).
  ~Join() noexcept(false) {
    if (done_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      state_->join.reset();
      return;
    }
    finish();
  }

  /// This rank is out of data: repeats the other ranks' collectives until
  /// every rank is; then the guard is over.
  void finish() {
    if (done_) return;
    done_ = true;
    auto join = state_->join;
    try {
      while (const auto action = join->next_action()) {
        if (action->kind == accel::detail::JoinState::Action::kForward)
          join->model(action->index).shadow(action->buffers, action->reduce);
        else
          state_->optimizer_shadows.at(action->index)(*state_);
      }
    } catch (...) {
      state_->join.reset();
      throw;
    }
    state_->join.reset();
  }

 private:
  std::shared_ptr<accel::detail::TrainingState> state_;
  int exceptions_;
  bool done_ = false;
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_JOIN_HPP
