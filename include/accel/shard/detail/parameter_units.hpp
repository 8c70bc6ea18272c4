// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::ParameterUnits: which parameters each
/// unit of a model computes with, the granularity at which
/// shard::ShardParameters gathers them.
#ifndef ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
#define ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include <accel/shard/detail/bucket_plan.hpp>
#include <accel/shard/detail/unit_slot.hpp>

namespace accel::shard::detail {

/// Without shard::Unit in the model, unit u is the model's u-th child (one
/// level: a Sequential's modules in order) and parameters registered on the
/// model itself form one more unit. With them (named_units()), unit 0 is
/// every parameter outside them, held whole from the start of the model's
/// forward until backward reduce-scatters its gradients, and unit u is the
/// u-th shard::Unit.
struct ParameterUnits {
  std::vector<std::vector<std::size_t>> uses;  ///< per unit: the trainable parameters it computes with
  std::vector<int> owner;                      ///< per parameter: the first unit using it (its buckets' unit)
  bool named = false;                          ///< units are shard::Unit modules, and unit 0 is held
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
  if (const auto named = named_units(model); !named.empty()) {
    units.named = true;
    // Unit 0: the parameters of the modules outside every unit.
    std::vector<torch::Tensor> outside = model.parameters(/*recurse=*/false);
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      bool inside = false;
      for (const auto& [name, unit] : named)
        inside = inside || item.key() == name || item.key().rfind(name + ".", 0) == 0;
      if (inside) continue;
      const auto own = item.value()->parameters(/*recurse=*/false);
      outside.insert(outside.end(), own.begin(), own.end());
    }
    add(0, outside);
    for (std::size_t u = 0; u < named.size(); ++u) add(u + 1, named[u].second->parameters());
    return units;
  }
  const auto children = model.children();
  for (std::size_t u = 0; u < children.size(); ++u) add(u, children[u]->parameters());
  add(children.size(), model.parameters(/*recurse=*/false));
  return units;
}

/// prepare(): tells each shard::Unit of the model its number and the
/// model's gradient sync.
inline void bind_named_units(const torch::nn::Module& model, const std::shared_ptr<GradientSync>& sync) {
  const auto named = named_units(model);
  for (std::size_t u = 0; u < named.size(); ++u)
    dynamic_cast<UnitSlot&>(*named[u].second).bind(sync, u + 1);
}

/// The buckets of a sharded model: one optimizer group's parameters each
/// and, under ZeRO-3 (units given), one unit's, so that a unit is gathered by
/// whole buckets. The reducer and load_state's one-process layout both use
/// this, so a checkpoint's buckets match on any number of processes.
inline BucketPlan zero_plan(const std::vector<torch::Tensor>& params, int64_t bucket_bytes,
                            const std::vector<int>& group_of, const std::optional<ParameterUnits>& units) {
  if (!units) return plan_buckets(params, bucket_bytes, group_of);
  std::vector<int> keys(group_of.size());
  const auto n = static_cast<int>(units->uses.size());
  for (std::size_t k = 0; k < keys.size(); ++k) keys[k] = group_of[k] * n + units->owner[k];
  return plan_buckets(params, bucket_bytes, keys);
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
