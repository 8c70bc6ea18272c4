// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::plan_buckets, how gradient sync groups
/// parameters into flat buckets, and storage_alias, how a parameter or its
/// gradient lives inside one.
#ifndef ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP

#include <cstddef>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace accel::shard::detail {

/// A tensor sharing `base`'s storage from element `offset` on, that is NOT an
/// autograd view: LibTorch's zero_grad (detach_ + zero_), in-place
/// accumulation, set_data and optimizers treat it as a leaf and keep it.
inline torch::Tensor storage_alias(const torch::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  return torch::empty({0}, base.options().requires_grad(false))
      .set_(base.storage(), base.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
}

/// Which parameters share a bucket and where each one sits in it. Every
/// reducer (Replicate's, ZeRO's) uses this one plan, so that the order of
/// collectives, and the chunks a sharded optimizer checkpoints, follow one rule.
struct BucketPlan {
  struct Slot {
    std::size_t bucket = 0;
    int64_t offset = 0;          ///< first element of the parameter in its bucket
    std::vector<int64_t> shape;  ///< the parameter's shape when it was planned
  };
  std::vector<std::vector<std::size_t>> buckets;  ///< parameter indices, in bucket order
  std::vector<int64_t> numel;                     ///< elements of each bucket (unpadded)
  std::vector<Slot> slots;                        ///< one per parameter

  std::size_t size() const { return buckets.size(); }
};

/// Buckets hold parameters in reverse registration order (roughly the order
/// backward produces their gradients); a new bucket starts when the next
/// parameter would take it past bucket_bytes, or has another dtype, device or
/// group (group_of: e.g. the optimizer's parameter group; empty: one group).
inline BucketPlan plan_buckets(const std::vector<torch::Tensor>& params, int64_t bucket_bytes,
                               const std::vector<int>& group_of = {}) {
  const auto group = [&](std::size_t k) { return group_of.empty() ? 0 : group_of[k]; };
  BucketPlan plan;
  plan.slots.resize(params.size());
  int64_t bytes = 0;
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    bool start = plan.buckets.empty() || bytes + static_cast<int64_t>(p.nbytes()) > bucket_bytes;
    if (!start) {
      const auto first = plan.buckets.back().front();
      const auto& q = params[first];
      start = q.scalar_type() != p.scalar_type() || q.device() != p.device() || group(first) != group(k);
    }
    if (start) {
      plan.buckets.emplace_back();
      plan.numel.push_back(0);
      bytes = 0;
    }
    plan.slots[k] = BucketPlan::Slot{plan.buckets.size() - 1, plan.numel.back(), p.sizes().vec()};
    plan.buckets.back().push_back(k);
    plan.numel.back() += p.numel();
    bytes += static_cast<int64_t>(p.nbytes());
  }
  return plan;
}

/// Views of `buffer` (bucket b's flat storage, laid out as the plan says)
/// with each of its parameters' shapes: what a communication hook sees.
inline std::vector<torch::Tensor> member_views(const BucketPlan& plan, std::size_t b, const torch::Tensor& buffer) {
  std::vector<torch::Tensor> views;
  for (auto k : plan.buckets[b]) views.push_back(storage_alias(buffer, plan.slots[k].offset, plan.slots[k].shape));
  return views;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP
