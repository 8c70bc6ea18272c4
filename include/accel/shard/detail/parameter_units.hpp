// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::ParameterUnits: which parameters each
/// unit of a model computes with, the granularity at which
/// shard::ShardParameters gathers them.
#ifndef ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
#define ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP

#include <cstddef>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

namespace accel::shard::detail {

/// Unit u is the model's u-th child (one level: a Sequential's modules in
/// order); parameters registered on the model itself form one more unit.
struct ParameterUnits {
  std::vector<std::vector<std::size_t>> uses;  ///< per unit: the trainable parameters it computes with
  std::vector<int> owner;                      ///< per parameter: the first unit using it (its buckets' unit)
};

inline ParameterUnits units_of(const torch::nn::Module& model, const std::vector<torch::Tensor>& trainable) {
  std::unordered_map<const c10::TensorImpl*, std::size_t> index;
  for (std::size_t k = 0; k < trainable.size(); ++k) index[trainable[k].unsafeGetTensorImpl()] = k;
  ParameterUnits units;
  units.owner.assign(trainable.size(), -1);
  const auto add = [&](std::size_t u, const std::vector<torch::Tensor>& params) {
    if (units.uses.size() <= u) units.uses.resize(u + 1);
    for (const auto& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end()) continue;  // frozen: every rank keeps it whole
      units.uses[u].push_back(it->second);
      if (units.owner[it->second] < 0) units.owner[it->second] = static_cast<int>(u);
    }
  };
  const auto children = model.children();
  for (std::size_t u = 0; u < children.size(); ++u) add(u, children[u]->parameters());
  add(children.size(), model.parameters(/*recurse=*/false));
  return units;
}

/// The key plan_buckets groups by: a bucket holds one optimizer group's
/// parameters of one unit, so that a unit is gathered by whole buckets.
inline std::vector<int> bucket_keys(const std::vector<int>& group_of, const ParameterUnits& units) {
  std::vector<int> keys(group_of.size());
  const auto n = static_cast<int>(units.uses.size());
  for (std::size_t k = 0; k < keys.size(); ++k) keys[k] = group_of[k] * n + units.owner[k];
  return keys;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
