// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::sched::OneCycleLR, the 1cycle policy with the same
/// learning-rate and momentum sequence as torch.optim.lr_scheduler.OneCycleLR.
#ifndef ACCEL_SCHED_ONE_CYCLE_LR_HPP
#define ACCEL_SCHED_ONE_CYCLE_LR_HPP

#include <accel/errors.hpp>
#include <accel/sched/detail/param_groups.hpp>

#include <torch/optim/schedulers/lr_scheduler.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <utility>
#include <vector>

namespace accel::sched {

/// How OneCycleLR moves between two anchors (Python's anneal_strategy).
enum class AnnealStrategy { Cos, Linear };

/// Arguments of OneCycleLR, named and defaulted as in Python. Give either
/// total_steps, or epochs and steps_per_epoch (total_steps wins when both are set).
struct OneCycleLROptions {
  PerGroup max_lr{};                       ///< required: peak lr, one or one per group
  std::optional<int64_t> total_steps{};    ///< number of step() calls in the cycle
  std::optional<int64_t> epochs{};         ///< with steps_per_epoch: total = product
  std::optional<int64_t> steps_per_epoch{};
  double pct_start = 0.3;                  ///< share of the cycle spent increasing lr
  AnnealStrategy anneal_strategy = AnnealStrategy::Cos;
  bool cycle_momentum = true;              ///< cycle SGD/RMSprop momentum or Adam(W) beta1
  PerGroup base_momentum = 0.85;           ///< momentum at peak lr
  PerGroup max_momentum = 0.95;            ///< momentum at the start and the end
  double div_factor = 25.0;                ///< initial_lr = max_lr / div_factor
  double final_div_factor = 1e4;           ///< min_lr = initial_lr / final_div_factor
  bool three_phase = false;                ///< warm up, come back down, then anneal to min_lr
};

/// The 1cycle learning-rate policy (Smith & Topin), a port of PyTorch's Python
/// OneCycleLR (torch 1.13): same phases, same floating-point formulas, so the
/// sequence of lr (and momentum) values is the same for the same arguments.
///
/// Position: construction puts the optimizer at step 0 (lr = max_lr/div_factor
/// up to rounding, momentum = max_momentum); the n-th step() call moves it to
/// step n, for n up to total_steps. Stepping further throws accel::Error
/// (Python raises ValueError) and changes nothing.
class OneCycleLR : public torch::optim::LRScheduler {
 public:
  using Options = OneCycleLROptions;

  OneCycleLR(torch::optim::Optimizer& optimizer, Options options)
      : torch::optim::LRScheduler(optimizer), optimizer_(&optimizer), options_(std::move(options)) {
    init();
  }
  OneCycleLR(torch::optim::Optimizer& optimizer, double max_lr, int64_t total_steps)
      : OneCycleLR(optimizer, Options{.max_lr = max_lr, .total_steps = total_steps}) {}

  /// step() calls since construction (Python's last_epoch).
  int64_t step_count() const { return static_cast<int64_t>(step_count_); }

  /// Moves to position n (0 <= n <= total_steps) and writes that step's lr and
  /// momentum into the optimizer: what resuming from a checkpoint needs.
  void set_step_count(int64_t n) {
    ACCEL_CHECK(n >= 0 && n <= total_steps_, "accel: OneCycleLR cannot move to step ", n,
                ", its schedule has steps 0 to ", total_steps_,
                ". Pass a step count within the schedule.");
    apply(n);
    step_count_ = static_cast<decltype(step_count_)>(n);
  }

  /// The lr of each parameter group set by the last construction/step().
  std::vector<double> get_last_lr() const { return last_lr_; }
  /// The momentum (or beta1) of each group set last; empty without cycle_momentum.
  std::vector<double> get_last_momentum() const { return last_momentum_; }

  int64_t total_steps() const { return total_steps_; }
  const Options& options() const { return options_; }

  /// Saves the position (and total_steps, checked on load) in a torch archive.
  void save(torch::serialize::OutputArchive& archive) const {
    detail::write_int(archive, "step_count", step_count());
    detail::write_int(archive, "total_steps", total_steps_);
  }
  void load(torch::serialize::InputArchive& archive) {
    const int64_t saved_total = detail::read_int(archive, "total_steps");
    ACCEL_CHECK(saved_total == total_steps_, "accel: the saved OneCycleLR state has total_steps ",
                saved_total, " but this scheduler has ", total_steps_,
                ". Construct the scheduler with the same arguments as the saved one.");
    set_step_count(detail::read_int(archive, "step_count"));
  }

 protected:
  /// Called by LRScheduler::step() before it increments step_count_: computes
  /// the next step's lrs (and sets momentum, as Python's get_lr() does).
  std::vector<double> get_lrs() override {
    const int64_t next = step_count() + 1;
    if (next > total_steps_)
      throw Error(::accel::detail::concat(
          "accel: OneCycleLR was stepped ", next, " times but total_steps is ", total_steps_,
          " (Python: \"Tried to step ", next + 1, " times. The specified number of total steps is ",
          total_steps_, "\"). Increase total_steps (or epochs/steps_per_epoch), or stop "
          "calling step() after the last step."));
    return compute_and_set_momentum(next);
  }

 private:
  enum class Anchor { InitialLr, MaxLr, MinLr, MaxMomentum, BaseMomentum };
  struct Phase {
    double end_step;
    Anchor start_lr, end_lr, start_momentum, end_momentum;
  };
  struct Group {
    double initial_lr, max_lr, min_lr, max_momentum, base_momentum;
    double at(Anchor a) const {
      switch (a) {
        case Anchor::InitialLr: return initial_lr;
        case Anchor::MaxLr: return max_lr;
        case Anchor::MinLr: return min_lr;
        case Anchor::MaxMomentum: return max_momentum;
        case Anchor::BaseMomentum: return base_momentum;
      }
      return 0.0;
    }
  };

  void init() {
    const Options& o = options_;
    if (o.total_steps) {
      ACCEL_CHECK(*o.total_steps > 0, "accel: OneCycleLR expected a positive total_steps, got ",
                  *o.total_steps, ". Pass the number of step() calls of the whole run.");
      total_steps_ = *o.total_steps;
    } else {
      ACCEL_CHECK(o.epochs || o.steps_per_epoch,
                  "accel: OneCycleLR needs total_steps or (epochs and steps_per_epoch). "
                  "Set one of them in the options.");
      ACCEL_CHECK(o.epochs && *o.epochs > 0, "accel: OneCycleLR expected a positive epochs, got ",
                  o.epochs ? std::to_string(*o.epochs) : "none",
                  ". Set epochs together with steps_per_epoch, or set total_steps.");
      ACCEL_CHECK(o.steps_per_epoch && *o.steps_per_epoch > 0,
                  "accel: OneCycleLR expected a positive steps_per_epoch, got ",
                  o.steps_per_epoch ? std::to_string(*o.steps_per_epoch) : "none",
                  ". Set steps_per_epoch together with epochs, or set total_steps.");
      total_steps_ = *o.epochs * *o.steps_per_epoch;
    }
    ACCEL_CHECK(o.pct_start >= 0.0 && o.pct_start <= 1.0,
                "accel: OneCycleLR expected pct_start between 0 and 1, got ", o.pct_start,
                ". Pass the share of the cycle spent increasing the learning rate.");
    ACCEL_CHECK(o.div_factor > 0.0 && o.final_div_factor > 0.0,
                "accel: OneCycleLR needs positive div_factor and final_div_factor, got ",
                o.div_factor, " and ", o.final_div_factor, ". Pass positive divisors.");

    // Phase boundaries in Python's float arithmetic: same rounding, same values.
    const double total = static_cast<double>(total_steps_);
    if (o.three_phase) {
      phases_ = {{o.pct_start * total - 1, Anchor::InitialLr, Anchor::MaxLr, Anchor::MaxMomentum,
                  Anchor::BaseMomentum},
                 {2 * o.pct_start * total - 2, Anchor::MaxLr, Anchor::InitialLr,
                  Anchor::BaseMomentum, Anchor::MaxMomentum},
                 {total - 1, Anchor::InitialLr, Anchor::MinLr, Anchor::MaxMomentum,
                  Anchor::MaxMomentum}};
    } else {
      phases_ = {{o.pct_start * total - 1, Anchor::InitialLr, Anchor::MaxLr, Anchor::MaxMomentum,
                  Anchor::BaseMomentum},
                 {total - 1, Anchor::MaxLr, Anchor::MinLr, Anchor::BaseMomentum,
                  Anchor::MaxMomentum}};
    }

    const std::size_t n = optimizer_->param_groups().size();
    ACCEL_CHECK(n > 0, "accel: OneCycleLR got an optimizer without parameter groups. "
                "Construct the optimizer with its parameters first.");
    const auto max_lrs = o.max_lr.expand(n, "OneCycleLR", "max_lr");
    std::vector<double> max_m(n, 0.0), base_m(n, 0.0);
    if (o.cycle_momentum) {
      max_m = o.max_momentum.expand(n, "OneCycleLR", "max_momentum");
      base_m = o.base_momentum.expand(n, "OneCycleLR", "base_momentum");
      for (auto& g : optimizer_->param_groups())
        ACCEL_CHECK(detail::momentum_field(g.options()) != detail::MomentumField::None,
                    "accel: OneCycleLR with cycle_momentum needs an optimizer with momentum "
                    "(SGD, RMSprop) or betas (Adam, AdamW). Set cycle_momentum = false for "
                    "this optimizer.");
    }
    groups_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const double initial = max_lrs[i] / o.div_factor;
      groups_.push_back({initial, max_lrs[i], initial / o.final_div_factor, max_m[i], base_m[i]});
    }
    apply(0);  // Python's constructor takes the first step, to position 0
  }

  double anneal(double start, double end, double pct) const {
    if (options_.anneal_strategy == AnnealStrategy::Cos) {
      const double cos_out = std::cos(std::numbers::pi * pct) + 1;
      return end + (start - end) / 2.0 * cos_out;
    }
    return (end - start) * pct + start;
  }

  // lr of every group at position step; sets the optimizer's momentum on the way.
  std::vector<double> compute_and_set_momentum(int64_t step) {
    detail::check_group_count(*optimizer_, groups_.size(), "OneCycleLR");
    std::vector<double> lrs, moms;
    auto& param_groups = optimizer_->param_groups();
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      double start_step = 0.0;
      for (std::size_t i = 0; i < phases_.size(); ++i) {
        const Phase& ph = phases_[i];
        if (static_cast<double>(step) <= ph.end_step || i + 1 == phases_.size()) {
          const double span = ph.end_step - start_step;
          ACCEL_CHECK(span != 0.0, "accel: OneCycleLR has an empty phase at step ", step,
                      " (Python raises ZeroDivisionError here). Use a pct_start that leaves "
                      "room for every phase.");
          const double pct = (static_cast<double>(step) - start_step) / span;
          lrs.push_back(anneal(groups_[g].at(ph.start_lr), groups_[g].at(ph.end_lr), pct));
          if (options_.cycle_momentum) {
            moms.push_back(
                anneal(groups_[g].at(ph.start_momentum), groups_[g].at(ph.end_momentum), pct));
            detail::set_momentum(param_groups[g].options(), moms.back());
          }
          break;
        }
        start_step = ph.end_step;
      }
    }
    last_lr_ = lrs;
    last_momentum_ = std::move(moms);
    return lrs;
  }

  void apply(int64_t step) { detail::set_lrs(*optimizer_, compute_and_set_momentum(step)); }

  torch::optim::Optimizer* optimizer_;
  Options options_;
  int64_t total_steps_ = 0;
  std::vector<Phase> phases_;
  std::vector<Group> groups_;
  std::vector<double> last_lr_, last_momentum_;
};

}  // namespace accel::sched

#endif  // ACCEL_SCHED_ONE_CYCLE_LR_HPP
