// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::PartitionLayout: where each tensor an
/// optimizer steps lies in the flat buckets of a sharded model. save_state
/// records the buckets, so that load_state can re-partition optimizer state
/// saved by another number of processes (checkpoint/detail/optimizer_relayout.hpp).
#ifndef ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP
#define ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/shard/detail/bucket_plan.hpp>

namespace accel::shard::detail {

/// The buckets (BucketPlan: they depend on the model, the optimizer's groups
/// and bucket_cap_mb, not on the number of processes) and, for every
/// parameter k of optimizer group g, the range of its bucket it holds.
struct PartitionLayout {
  struct Piece {
    std::size_t bucket = 0;
    int64_t offset = 0;          ///< first element in the bucket (may lie in its padding)
    int64_t numel = 0;
    std::vector<int64_t> shape;  ///< of the tensor the optimizer holds
  };
  std::vector<int64_t> bucket_numel;  ///< unpadded, in bucket order
  std::vector<int> bucket_group;      ///< the optimizer group of each bucket
  std::vector<std::vector<Piece>> groups;
};

/// ZeRO's partition on `rank` of `world`: group g holds, in bucket order,
/// chunk `rank` (ceil(numel / world) elements) of each of its buckets.
inline PartitionLayout chunk_layout(std::vector<int64_t> numel, std::vector<int> group, std::size_t groups,
                                    int world, int rank) {
  PartitionLayout l;
  l.groups.resize(groups);
  for (std::size_t b = 0; b < numel.size(); ++b) {
    const int64_t chunk = (numel[b] + world - 1) / world;
    l.groups[static_cast<std::size_t>(group[b])].push_back({b, rank * chunk, chunk, {chunk}});
  }
  l.bucket_numel = std::move(numel);
  l.bucket_group = std::move(group);
  return l;
}

/// The unpartitioned optimizer over the same buckets: each group holds its
/// parameters (`group_params`, as the optimizer lists them) whole.
/// `trainable` and `group_of` are what the plan was made from.
inline PartitionLayout parameter_layout(const std::vector<torch::Tensor>& trainable, const BucketPlan& plan,
                                        const std::vector<int>& group_of,
                                        const std::vector<std::vector<torch::Tensor>>& group_params) {
  std::unordered_map<const c10::TensorImpl*, std::size_t> index;
  for (std::size_t k = 0; k < trainable.size(); ++k) index[trainable[k].unsafeGetTensorImpl()] = k;
  PartitionLayout l;
  l.bucket_numel = plan.numel;
  for (const auto& members : plan.buckets) l.bucket_group.push_back(group_of[members.front()]);
  for (const auto& params : group_params) {
    auto& pieces = l.groups.emplace_back();
    for (const auto& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      ACCEL_CHECK(it != index.end(), "accel: the optimizer holds a parameter that is not a trainable "
                  "parameter of its prepared model; a shard policy needs exactly those.");
      const auto& slot = plan.slots[it->second];
      pieces.push_back({slot.bucket, slot.offset, p.numel(), slot.shape});
    }
  }
  return l;
}

/// group_of for plan_buckets: the optimizer group of each trainable parameter
/// (-1: in none).
inline std::vector<int> groups_of(const std::vector<torch::Tensor>& trainable,
                                  const std::vector<std::vector<torch::Tensor>>& group_params) {
  std::unordered_map<const c10::TensorImpl*, int> group;
  for (std::size_t g = 0; g < group_params.size(); ++g)
    for (const auto& p : group_params[g]) group[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  std::vector<int> out;
  for (const auto& p : trainable) {
    const auto it = group.find(p.unsafeGetTensorImpl());
    out.push_back(it == group.end() ? -1 : it->second);
  }
  return out;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP
