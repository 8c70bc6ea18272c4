// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::AccumulatorHooks: callbacks before and
/// after each parameter's gradient is accumulated, kept attached across
/// Module::load.
#ifndef ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
#define ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP

#include <atomic>
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
/// Whether a hook's owner still exists: read on autograd's threads, cleared
/// by the owner's destructor.
using Alive = std::atomic<bool>;

/// before(k) runs just before parameter k's gradient is added into .grad:
/// the last moment to wait for a collective still working on that memory.
class AccumulatorHooks {
 public:
  /// The callbacks must not run after their owner is destroyed: hooks check `alive`.
  AccumulatorHooks(std::vector<torch::Tensor> params, std::function<void(std::size_t)> before,
                   std::function<void(std::size_t)> on_ready, std::weak_ptr<Alive> alive)
      : params_(std::move(params)), before_(std::move(before)), on_ready_(std::move(on_ready)),
        alive_(std::move(alive)), nodes_(params_.size()) {
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
    node->add_pre_hook(std::make_unique<PreHook>([before = before_, alive = alive_, k] {
      if (auto a = alive.lock(); a && *a) before(k);
    }));
    node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [on_ready = on_ready_, alive = alive_, k](const torch::autograd::variable_list& outputs,
                                                  const torch::autograd::variable_list&) {
          if (auto a = alive.lock(); a && *a) on_ready(k);
          return outputs;
        }));
    nodes_[k] = std::move(node);  // keeps the node (and its hook) alive
  }

  struct PreHook final : torch::autograd::FunctionPreHook {
    explicit PreHook(std::function<void()> f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      fn();
      return grads;
    }
    std::function<void()> fn;
  };

  std::vector<torch::Tensor> params_;
  std::function<void(std::size_t)> before_;
  std::function<void(std::size_t)> on_ready_;
  std::weak_ptr<Alive> alive_;
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes_;
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
