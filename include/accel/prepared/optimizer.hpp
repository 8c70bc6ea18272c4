// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::AcceleratedOptimizer<O>: steps only when gradients are
/// synchronised and finite on every rank.
#ifndef ACCEL_PREPARED_OPTIMIZER_HPP
#define ACCEL_PREPARED_OPTIMIZER_HPP

#include <memory>
#include <type_traits>

#include <torch/torch.h>

#include <accel/detail/training_state.hpp>

namespace accel {

namespace detail {
template <class O>
inline constexpr bool is_optimizer_v =
    std::is_base_of_v<torch::optim::Optimizer, std::remove_cvref_t<O>>;
}  // namespace detail

template <class O>
class AcceleratedOptimizer {
 public:
  using optimizer_type = O;

  AcceleratedOptimizer(std::shared_ptr<O> optimizer, std::shared_ptr<detail::TrainingState> state)
      : opt_(std::move(optimizer)), state_(std::move(state)) {}

  /// No-op on the non-sync micro-steps of accumulate(); otherwise waits for
  /// the gradient all-reduce still in flight, then steps unless the loss
  /// scaler found inf/NaN on any rank (step_was_skipped() says so).
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) {
    if (!state_->sync_gradients) {
      skipped_ = true;
      return {};
    }
    state_->finalize_gradients();
    const bool ok = state_->before_step(*opt_);
    torch::Tensor loss;
    if (ok) loss = opt_->step(std::move(closure));
    if (partition_) partition_->after_step(ok);
    state_->after_step(ok);
    skipped_ = !ok;
    state_->last_step_skipped = !ok;
    if (ok) ++state_->optimizer_steps;
    return loss;
  }

  /// Zeroes the gradients in place (keeping them in the gradient buckets);
  /// a no-op while accumulate() is on a non-sync step, as in Accelerate.
  void zero_grad() {
    if (!state_->sync_gradients) return;
    torch::NoGradGuard no_grad;
    for (auto& group : opt_->param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) p.mutable_grad().zero_();
    if (partition_) partition_->zero_grad();
  }

  /// Shard policies: the optimizer's parameters are this rank's partitions of
  /// a model's; the partition gathers the update and zeroes the full gradients.
  void set_partition(std::shared_ptr<shard::detail::OptimizerPartition> partition) {
    partition_ = std::move(partition);
  }

  bool step_was_skipped() const { return skipped_; }

  O* operator->() const { return opt_.get(); }
  O& operator*() const { return *opt_; }
  O& optimizer() const { return *opt_; }

 private:
  std::shared_ptr<O> opt_;
  std::shared_ptr<detail::TrainingState> state_;
  std::shared_ptr<shard::detail::OptimizerPartition> partition_;
  bool skipped_ = false;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_OPTIMIZER_HPP
