// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::AcceleratedScheduler<S>: advances once per optimizer
/// step that really happened, whatever the number of processes.
#ifndef ACCEL_PREPARED_SCHEDULER_HPP
#define ACCEL_PREPARED_SCHEDULER_HPP

#include <cstdint>
#include <memory>
#include <type_traits>

#include <torch/torch.h>

#include <accel/detail/training_state.hpp>

namespace accel {

namespace detail {
template <class S>
inline constexpr bool is_scheduler_v =
    std::is_base_of_v<torch::optim::LRScheduler, std::remove_cvref_t<S>>;
}  // namespace detail

/// Accelerate steps a scheduler num_processes times per optimizer step (so
/// schedules sized in optimizer steps end N times too early); accel steps it
/// exactly once for each optimizer step that happened: not on the non-sync
/// micro-steps of accumulate(), not when the loss scaler skipped the step.
template <class S>
class AcceleratedScheduler {
 public:
  using scheduler_type = S;

  AcceleratedScheduler(std::shared_ptr<S> scheduler, std::shared_ptr<detail::TrainingState> state,
                       bool step_with_optimizer)
      : sched_(std::move(scheduler)), state_(std::move(state)),
        step_with_optimizer_(step_with_optimizer),
        seen_steps_(std::make_shared<int64_t>(state_->optimizer_steps)) {}

  void step() {
    if (step_with_optimizer_) {
      if (state_->optimizer_steps == *seen_steps_) return;  // no real optimizer step since the last call
      *seen_steps_ = state_->optimizer_steps;
    }
    sched_->step();
  }

  S* operator->() const { return sched_.get(); }
  S& operator*() const { return *sched_; }
  S& scheduler() const { return *sched_; }
  /// The optimizer step count this scheduler last stepped at, shared by
  /// copies; load_state() sets it to the restored count.
  const std::shared_ptr<int64_t>& seen_steps() const { return seen_steps_; }

 private:
  std::shared_ptr<S> sched_;
  std::shared_ptr<detail::TrainingState> state_;
  bool step_with_optimizer_;
  std::shared_ptr<int64_t> seen_steps_;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_SCHEDULER_HPP
