// SPDX-License-Identifier: Apache-2.0
/// @file Defines how the Accelerator ties an optimizer to a sharded model and
/// clips sharded gradients (shard::ShardOptimizer, shard::ShardGradients).
#ifndef ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP
#define ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/gradient_sync.hpp>
#include <accel/shard/detail/zero_reducer.hpp>

namespace accel::shard::detail {

/// The reducers of the prepared sharded models (TrainingState::sharded).
using ZeroReducers = std::vector<std::shared_ptr<ZeroReducer>>;

/// The sharded model (among the prepared ones) whose parameter `p` is, or null.
inline std::shared_ptr<ZeroReducer> find_zero_reducer(const ZeroReducers& sharded, const torch::Tensor& p) {
  for (const auto& z : sharded)
    if (z->owns(p)) return z;
  return nullptr;
}

/// Rebinds `opt` to the partitions of the prepared model that owns its
/// parameters; the returned partition gathers updates and zeroes gradients.
inline std::shared_ptr<ZeroReducer> bind_optimizer(const ZeroReducers& sharded,
                                                          torch::optim::Optimizer& opt) {
  std::shared_ptr<ZeroReducer> owner;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params())
      if (!owner) owner = find_zero_reducer(sharded, p);
  ACCEL_CHECK(owner != nullptr, "accel: under a shard policy an optimizer must be prepared after "
              "the model whose parameters it holds (no prepared model owns this optimizer's "
              "parameters). Pass the model before the optimizer to prepare(), or prepare the "
              "model first.");
  owner->adopt(opt);
  return owner;
}

/// What clip_grad_norm_/clip_grad_value_ act on: the given parameters, or,
/// when they are a model under ShardGradients (whose full gradients are
/// released), that rank's partitions, with the norm reduced across ranks.
struct ClipTargets {
  std::vector<torch::Tensor> tensors;
  runtime::Communicator* reduce_over = nullptr;  ///< set: the norm spans every rank's tensors
  int64_t param_count = 0;                       ///< for norm_type 0 (count of gradients)
};

inline ClipTargets clip_targets(const ZeroReducers& sharded, std::vector<torch::Tensor> params) {
  ClipTargets t;
  t.param_count = static_cast<int64_t>(params.size());
  std::shared_ptr<ZeroReducer> owner;
  for (const auto& p : params)
    if (auto z = find_zero_reducer(sharded, p); z && z->shards_gradients()) {
      owner = z;
      break;
    }
  if (!owner) {
    t.tensors = std::move(params);
    return t;
  }
  std::size_t owned = 0;
  for (const auto& p : params) owned += owner->owns(p) ? 1 : 0;
  ACCEL_CHECK(owned == params.size() && owned == owner->num_params(),
              "accel: under shard::ShardGradients clipping needs exactly the trainable parameters "
              "of one prepared model (each rank holds only its partition of their gradients; got ",
              params.size(), " parameters, ", owned, " of a model with ", owner->num_params(),
              "). Pass the prepared model or model->parameters().");
  t.tensors = owner->partitions();
  t.reduce_over = &owner->communicator();
  return t;
}

/// torch::nn::utils::clip_grad_norm_ over every rank's partitions: the norm of
/// the concatenation is the p-th root of the all-reduced sums of p-th powers.
inline double clip_grad_norm(const ClipTargets& t, double max_norm, double norm_type) {
  if (t.reduce_over == nullptr) return torch::nn::utils::clip_grad_norm_(t.tensors, max_norm, norm_type);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : t.tensors)
    if (p.grad().defined()) grads.push_back(p.grad());
  const bool inf = norm_type == std::numeric_limits<double>::infinity();
  double total = 0;
  if (norm_type == 0) {
    total = static_cast<double>(t.param_count);
  } else {
    double sum = 0;  // local max (inf) or sum of p-th powers
    for (const auto& g : grads) {
      if (g.numel() == 0) continue;
      const double v = inf ? g.abs().max().item<double>() : std::pow(g.norm(norm_type).item<double>(), norm_type);
      sum = inf ? std::max(sum, v) : sum + v;
    }
    auto local = torch::full({1}, sum, torch::TensorOptions().dtype(torch::kDouble).device(t.tensors.front().device()));
    if (inf) {
      t.reduce_over->all_reduce(local, runtime::ReduceOp::Max)->wait();
      total = local.item<double>();
    } else {
      t.reduce_over->all_reduce(local, runtime::ReduceOp::Sum)->wait();
      total = std::pow(local.item<double>(), 1.0 / norm_type);
    }
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for (auto& g : grads) g.mul_(coef);
  return total;
}

inline void clip_grad_value(const ClipTargets& t, double clip_value) {
  torch::nn::utils::clip_grad_value_(t.tensors, clip_value);  // element-wise: the partitions suffice
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP
