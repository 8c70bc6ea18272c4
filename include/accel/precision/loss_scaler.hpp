// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::LossScaler: dynamic loss scaling for fp16,
/// with the inf/NaN decision agreed by every rank.
#ifndef ACCEL_PRECISION_LOSS_SCALER_HPP
#define ACCEL_PRECISION_LOSS_SCALER_HPP

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::precision {

/// The loss is multiplied by scale() before backward so small fp16 gradients
/// do not flush to zero. Before an optimizer step the gradients are divided
/// by the scale (each gradient once per iteration, whoever asks first:
/// clip_grad_norm_ or a step) and checked for inf/NaN; the finding is
/// all-reduced (MAX) so every rank skips the same steps. update(), once per
/// iteration, backs the scale off after an overflow and grows it after
/// growth_interval clean iterations, as torch.cuda.amp.GradScaler.
class LossScaler {
 public:
  explicit LossScaler(GradScalerOptions opts = {}) : opts_(opts), scale_(opts.init_scale) {
    ACCEL_CHECK(opts.init_scale > 0 && opts.growth_factor > 1 && opts.backoff_factor > 0 &&
                    opts.backoff_factor < 1 && opts.growth_interval > 0,
                "accel: invalid GradScalerOptions (need init_scale > 0, growth_factor > 1, 0 < "
                "backoff_factor < 1, growth_interval > 0). Fix the options.");
  }

  double scale() const { return scale_; }
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }

  /// Divides the gradients of `params` not yet unscaled in this iteration
  /// by the scale; returns true when any rank found inf/NaN in the gradients
  /// of `params` (those unscaled earlier count with what their call found).
  bool unscale(const std::vector<torch::Tensor>& params, runtime::Communicator& comm) {
    torch::NoGradGuard no_grad;
    bool known_inf = false;
    std::vector<torch::Tensor> todo;
    for (const auto& p : params) {
      const auto it = unscaled_.find(p.unsafeGetTensorImpl());
      if (it == unscaled_.end())
        todo.push_back(p);
      else
        known_inf = known_inf || it->second;
    }
    if (todo.empty()) return known_inf;
    const double inv = 1.0 / scale_;
    auto found = torch::zeros({1}, torch::kFloat);
    for (const auto& p : todo) {
      if (!p.grad().defined()) continue;
      auto g = p.grad();
      g.mul_(inv);
      found = found.to(g.device()) + (g.isfinite().all().logical_not()).to(torch::kFloat);
    }
    found = found.to(torch::kCPU).contiguous();
    if (comm.size() > 1) {
      // The flag travels on the communicator's device (CUDA for NCCL).
      auto flag = found.to(comm_device_);
      comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
      found = flag.to(torch::kCPU);
    }
    const bool inf = found.item<float>() > 0;
    for (const auto& p : todo) unscaled_.emplace(p.unsafeGetTensorImpl(), inf);
    found_inf_ = found_inf_ || inf;
    return known_inf || inf;
  }

  /// End of an iteration: adjust the scale, forget what was unscaled.
  void update() {
    if (found_inf_) {
      scale_ *= opts_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ >= opts_.growth_interval) {
      scale_ *= opts_.growth_factor;
      growth_tracker_ = 0;
    }
    unscaled_.clear();
    found_inf_ = false;
  }

  /// Whether any gradient was unscaled in this iteration.
  bool unscaled() const { return !unscaled_.empty(); }
  int64_t growth_tracker() const { return growth_tracker_; }
  void set_comm_device(torch::Device d) { comm_device_ = d; }

  /// For checkpoints: scale and growth tracker.
  void load(double scale, int64_t growth_tracker) {
    scale_ = scale;
    growth_tracker_ = growth_tracker;
  }

 private:
  GradScalerOptions opts_;
  double scale_;
  int64_t growth_tracker_ = 0;
  /// This iteration's unscaled gradients (by parameter), with whether the
  /// call that unscaled them found inf/NaN.
  std::unordered_map<const c10::TensorImpl*, bool> unscaled_;
  bool found_inf_ = false;  ///< any call of this iteration
  torch::Device comm_device_{torch::kCPU};
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_LOSS_SCALER_HPP
