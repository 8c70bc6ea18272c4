// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::AcceleratedOptimizer<O>: steps only when gradients are
/// synchronised and finite on every rank.
#ifndef ACCEL_PREPARED_OPTIMIZER_HPP
#define ACCEL_PREPARED_OPTIMIZER_HPP

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <accel/detail/training_state.hpp>
#include <accel/profiling/events.hpp>

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
      : core_(std::make_shared<Core>(Core{std::move(optimizer), nullptr})), state_(std::move(state)),
        index_(state_->optimizer_shadows.size()) {
    // A rank out of data under join_uneven_inputs() repeats this step (weak:
    // the state must not keep the optimizer alive).
    state_->optimizer_shadows.push_back([core = std::weak_ptr<Core>(core_), i = index_](detail::TrainingState& s) {
      if (auto c = core.lock()) run_step(s, *c, i, nullptr);
    });
  }

  /// No-op on the non-sync micro-steps of accumulate(); otherwise waits for
  /// the gradient all-reduce still in flight, then steps unless the loss
  /// scaler found inf/NaN on any rank (step_was_skipped() says so).
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) {
    if (!state_->sync_gradients) {
      skipped_ = true;
      return {};
    }
    {
      profiling::Span wait("accel: optimizer.step waits for gradients", "accel.comm");
      state_->finalize_gradients();
    }
    // After the reductions: a rank out of data repeats them from the
    // announcement of the forward, before this one.
    if (state_->join) state_->join->announce({accel::detail::JoinState::Action::kStep, index_});
    auto [ok, loss] = run_step(*state_, *core_, index_, std::move(closure));
    skipped_ = !ok;
    return loss;
  }

  /// Zeroes the gradients in place (keeping them in the gradient buckets);
  /// a no-op while accumulate() is on a non-sync step, as in Accelerate.
  void zero_grad() {
    if (!state_->sync_gradients) return;
    torch::NoGradGuard no_grad;
    for (auto& group : core_->opt->param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) p.mutable_grad().zero_();
    if (core_->partition) core_->partition->zero_grad();
  }

  /// Shard policies: the optimizer's parameters are this rank's partitions of
  /// a model's; the partition gathers the update and zeroes the full gradients.
  void set_partition(std::shared_ptr<shard::detail::OptimizerPartition> partition) {
    core_->partition = std::move(partition);
  }

  bool step_was_skipped() const { return skipped_; }

  O* operator->() const { return core_->opt.get(); }
  O& operator*() const { return *core_->opt; }
  O& optimizer() const { return *core_->opt; }

 private:
  /// What copies of one prepared optimizer share.
  struct Core {
    std::shared_ptr<O> opt;
    std::shared_ptr<shard::detail::OptimizerPartition> partition;
  };

  // With the gradients reduced: steps unless the loss scaler found inf/NaN
  // on any rank; returns whether it stepped, and the loss.
  static std::pair<bool, torch::Tensor> run_step(detail::TrainingState& state, Core& c, std::size_t index,
                                                 torch::optim::Optimizer::LossClosure closure) {
    const bool ok = state.before_step(*c.opt, index);
    torch::Tensor loss;
    if (ok) loss = c.opt->step(std::move(closure));
    if (c.partition) c.partition->after_step(ok);
    state.after_step(index);
    state.last_step_skipped = !ok;
    if (ok) ++state.optimizer_steps;
    return {ok, loss};
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<detail::TrainingState> state_;
  std::size_t index_;  ///< in TrainingState::optimizer_shadows
  bool skipped_ = false;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_OPTIMIZER_HPP
