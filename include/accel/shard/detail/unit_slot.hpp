// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::UnitSlot, what prepare() finds of a
/// unit the user names with shard::Unit, and named_units(), which finds them.
#ifndef ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP
#define ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

namespace accel::shard::detail {

/// A unit's number in its model and the model's gradient sync, set by
/// prepare(). Unbound (one process, or another shard policy), a unit
/// computes as the module it wraps.
class UnitSlot {
 public:
  virtual ~UnitSlot() = default;
  void bind(std::weak_ptr<GradientSync> sync, std::size_t index) {
    sync_ = std::move(sync);
    index_ = index;
  }

 protected:
  /// The model's ParameterGather (ShardParameters on several processes), or null.
  ParameterGather* gather() const {
    const auto sync = sync_.lock();
    return sync ? sync->parameter_gather() : nullptr;
  }
  const std::weak_ptr<GradientSync>& sync() const { return sync_; }
  std::size_t index() const { return index_; }

 private:
  std::weak_ptr<GradientSync> sync_;
  std::size_t index_ = 0;
};

/// The modules of `model` that are shard::Unit, in named_modules() order
/// (the model itself excluded). A unit inside another is refused: its
/// parameters would belong to both.
inline std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named_units(
    const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (dynamic_cast<UnitSlot*>(item.value().get()) == nullptr) continue;
    for (const auto& [outer, unit] : out)
      ACCEL_CHECK(item.key().rfind(outer + ".", 0) != 0, "accel: shard::Unit '", item.key(),
                  "' is inside shard::Unit '", outer, "'. Units must not nest: wrap either the "
                  "outer module or the modules inside it.");
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP
