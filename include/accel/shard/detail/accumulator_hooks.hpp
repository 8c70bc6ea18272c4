// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::AccumulatorHooks: a callback after each
/// parameter's gradient is accumulated, kept attached across Module::load.
#ifndef ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
#define ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include <accel/errors.hpp>

namespace accel::shard::detail {

/// Post-hooks on the AccumulateGrad nodes of leaf parameters: on_ready(k) runs
/// once parameter k's gradient has been accumulated in backward. LibTorch
/// gives a parameter a new accumulator when its storage is replaced (the
/// user's Module::load after prepare() does Tensor::set_), and the old one,
/// with the hook, is then never run: gradients would silently stop being
/// synchronised. refresh() (before every forward of a prepared model) hooks
/// the parameter's current accumulator when it changed.
class AccumulatorHooks {
 public:
  /// on_ready must not run after its owner is destroyed: hooks check `alive`.
  AccumulatorHooks(std::vector<torch::Tensor> params, std::function<void(std::size_t)> on_ready,
                   std::weak_ptr<bool> alive)
      : params_(std::move(params)), on_ready_(std::move(on_ready)), alive_(std::move(alive)),
        nodes_(params_.size()) {
    for (std::size_t k = 0; k < params_.size(); ++k) hook(k);
  }

  void refresh() {
    for (std::size_t k = 0; k < params_.size(); ++k)
      if (torch::autograd::impl::try_get_grad_accumulator(params_[k]) != nodes_[k]) hook(k);
  }

 private:
  void hook(std::size_t k) {
    auto node = torch::autograd::impl::grad_accumulator(params_[k]);
    ACCEL_CHECK(node, "accel: parameter ", k, " has no gradient accumulator. Give the shard policy "
                "leaf parameters that require gradients.");
    node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [on_ready = on_ready_, alive = alive_, k](const torch::autograd::variable_list& outputs,
                                                  const torch::autograd::variable_list&) {
          if (auto a = alive.lock(); a && *a) on_ready(k);
          return outputs;
        }));
    nodes_[k] = std::move(node);  // keeps the node (and its hook) alive
  }

  std::vector<torch::Tensor> params_;
  std::function<void(std::size_t)> on_ready_;
  std::weak_ptr<bool> alive_;
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes_;
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
