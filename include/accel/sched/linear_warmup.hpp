// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::sched::LinearWarmup: a linear learning-rate warm-up,
/// optionally followed by a linear decay to zero (Hugging Face's
/// get_linear_schedule_with_warmup when start_factor is 0).
#ifndef ACCEL_SCHED_LINEAR_WARMUP_HPP
#define ACCEL_SCHED_LINEAR_WARMUP_HPP

#include <accel/errors.hpp>
#include <accel/sched/detail/param_groups.hpp>

#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace accel::sched {

/// Arguments of LinearWarmup.
struct LinearWarmupOptions {
  int64_t warmup_steps = 0;            ///< W: steps to go from start_factor to 1
  double start_factor = 0.0;           ///< s in [0, 1]: lr factor at step 0
  std::optional<int64_t> total_steps{};  ///< T >= W: decay linearly to 0 at step T; unset: hold
};

/// lr of group g at step n (n = step() calls since construction) is
/// base_lr[g] * factor(n), base_lr[g] being the group's lr at construction:
///
///   n <  W:                 factor = s + (1 - s) * (n / W)
///   n >= W, no total_steps: factor = 1
///   n >= W, total_steps T:  factor = max(0, (T - n) / max(1, T - W))
///
/// With s = 0 and T set this is transformers' get_linear_schedule_with_warmup;
/// without T it is torch's LinearLR(start_factor = s, end_factor = 1,
/// total_iters = W) (there computed recursively, here in closed form).
/// Steps past T keep lr at 0; stepping never throws.
class LinearWarmup : public torch::optim::LRScheduler {
 public:
  using Options = LinearWarmupOptions;

  LinearWarmup(torch::optim::Optimizer& optimizer, Options options)
      : torch::optim::LRScheduler(optimizer), optimizer_(&optimizer), options_(options) {
    ACCEL_CHECK(options_.warmup_steps >= 0, "accel: LinearWarmup expected warmup_steps >= 0, got ",
                options_.warmup_steps, ". Pass the number of warm-up steps (0 for none).");
    ACCEL_CHECK(options_.start_factor >= 0.0 && options_.start_factor <= 1.0,
                "accel: LinearWarmup expected start_factor between 0 and 1, got ",
                options_.start_factor, ". Pass the fraction of the lr to start from.");
    ACCEL_CHECK(!options_.total_steps || *options_.total_steps >= options_.warmup_steps,
                "accel: LinearWarmup expected total_steps >= warmup_steps, got total_steps ",
                options_.total_steps.value_or(0), " and warmup_steps ", options_.warmup_steps,
                ". Pass a total that includes the warm-up, or leave total_steps unset.");
    ACCEL_CHECK(!optimizer.param_groups().empty(),
                "accel: LinearWarmup got an optimizer without parameter groups. "
                "Construct the optimizer with its parameters first.");
    for (auto& g : optimizer.param_groups()) base_lrs_.push_back(g.options().get_lr());
    apply(0);
  }
  LinearWarmup(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
               double start_factor = 0.0)
      : LinearWarmup(optimizer, Options{.warmup_steps = warmup_steps,
                                        .start_factor = start_factor}) {}

  /// The multiplier of base_lr at step n (formula above).
  double factor(int64_t n) const {
    const auto& o = options_;
    if (n < o.warmup_steps)
      return o.start_factor +
             (1.0 - o.start_factor) * (static_cast<double>(n) / static_cast<double>(o.warmup_steps));
    if (!o.total_steps) return 1.0;
    const int64_t t = *o.total_steps;
    return std::max(0.0, static_cast<double>(t - n) /
                             static_cast<double>(std::max<int64_t>(1, t - o.warmup_steps)));
  }

  /// step() calls since construction.
  int64_t step_count() const { return static_cast<int64_t>(step_count_); }

  /// Moves to position n >= 0 and writes that step's lrs into the optimizer.
  void set_step_count(int64_t n) {
    ACCEL_CHECK(n >= 0, "accel: LinearWarmup cannot move to step ", n,
                ". Pass a step count >= 0.");
    apply(n);
    step_count_ = static_cast<decltype(step_count_)>(n);
  }

  std::vector<double> get_last_lr() const { return last_lr_; }
  /// The lrs the schedule scales (the groups' lrs when it was constructed).
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  const Options& options() const { return options_; }

  /// Saves position and base lrs, so a scheduler rebuilt around an optimizer
  /// whose lr was already changed still resumes exactly.
  void save(torch::serialize::OutputArchive& archive) const {
    detail::write_int(archive, "step_count", step_count());
    detail::write_doubles(archive, "base_lrs", base_lrs_);
  }
  void load(torch::serialize::InputArchive& archive) {
    auto lrs = detail::read_doubles(archive, "base_lrs");
    ACCEL_CHECK(lrs.size() == base_lrs_.size(), "accel: the saved LinearWarmup state has ",
                lrs.size(), " parameter groups but the optimizer has ", base_lrs_.size(),
                ". Load it into a scheduler over the same optimizer layout.");
    base_lrs_ = std::move(lrs);
    set_step_count(detail::read_int(archive, "step_count"));
  }

 protected:
  /// Called by LRScheduler::step() before it increments step_count_.
  std::vector<double> get_lrs() override { return compute(step_count() + 1); }

 private:
  std::vector<double> compute(int64_t n) {
    detail::check_group_count(*optimizer_, base_lrs_.size(), "LinearWarmup");
    const double f = factor(n);
    std::vector<double> lrs;
    lrs.reserve(base_lrs_.size());
    for (double b : base_lrs_) lrs.push_back(b * f);
    last_lr_ = lrs;
    return lrs;
  }
  void apply(int64_t n) { detail::set_lrs(*optimizer_, compute(n)); }

  torch::optim::Optimizer* optimizer_;
  Options options_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
};

}  // namespace accel::sched

#endif  // ACCEL_SCHED_LINEAR_WARMUP_HPP
