// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::BucketReducer: averages gradients across
/// ranks in buckets whose all-reduce starts from autograd hooks while backward
/// is still running (shard::Replicate).
#ifndef ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

#include <accel/comm/grad_bucket.hpp>
#include <accel/comm/hook.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/bucket_plan.hpp>
#include <accel/shard/detail/bucket_round.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

namespace accel::shard::detail {

/// Gradients live in a few flat buffers (buckets, planned by plan_buckets)
/// that are allocated once and reused every step: each parameter's .grad is
/// re-pointed at its slice, so autograd accumulates straight into the buffer
/// and no copy is needed after the first step. BucketRound decides when each
/// bucket is all-reduced.
class BucketReducer final : public GradientSync, private BucketReduction {
 public:
  /// overlap: start a bucket's all-reduce from backward once it is full;
  /// otherwise all of them in finalize(), after backward. sync_now: see GradientSync.
  /// hook: how each bucket is averaged (null: comm::MeanHook).
  BucketReducer(std::vector<torch::Tensor> params, std::shared_ptr<runtime::Communicator> comm,
                int64_t bucket_bytes, bool overlap = true, std::shared_ptr<const bool> sync_now = nullptr,
                std::shared_ptr<comm::Hook> hook = nullptr)
      : GradientSync(std::move(sync_now)), params_(std::move(params)), comm_(std::move(comm)),
        plan_(plan_buckets(params_, bucket_bytes)),
        overlap_(overlap), round_(params_, *this, *this, RoundOptions{.overlap = overlap}, std::move(hook)) {
    for (std::size_t b = 0; b < plan_.size(); ++b) {
      buffers_.push_back(torch::zeros({plan_.numel[b]}, params_[plan_.buckets[b].front()].options().requires_grad(false)));
      views_.push_back(member_views(plan_, b, buffers_.back()));
    }
    round_.set_plan(plan_);
  }

  void before_forward() override { round_.refresh_hooks(); }
  comm::Hook* comm_hook() const override { return &round_.hook(); }
  void set_comm_hook(std::shared_ptr<comm::Hook> hook) override { round_.set_hook(std::move(hook)); }
  void finalize() override { round_.close(); }
  void shadow_backward() override {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().zero_();
    }
    round_.close_without_backward();
  }

  std::size_t num_buckets() const { return plan_.size(); }
  bool overlaps() const { return overlap_; }
  /// Buckets whose all-reduce was started from a backward hook (the overlap
  /// that happened); exposed for tests/benchmarks.
  std::size_t launched_during_backward() const { return round_.launched_during_backward(); }

 private:
  std::shared_ptr<runtime::Work> launch_reduction(std::size_t b) override {
    if (comm_->size() == 1) return nullptr;
    comm::GradBucket bucket{b, buffers_[b], views_[b], b + 1 == plan_.size()};
    return round_.hook().all_reduce(bucket, *comm_);
  }

  int64_t bucket_bytes(std::size_t b) const override { return static_cast<int64_t>(buffers_[b].nbytes()); }

  // Points .grad at the parameter's slice of its bucket (autograd then adds
  // into the bucket); a parameter without a gradient contributes its current
  // value (zero after zero_grad).
  void take_gradient(std::size_t k) override {
    const auto& slot = plan_.slots[k];
    auto& grad = params_[k].mutable_grad();
    auto slice = storage_alias(buffers_[slot.bucket], slot.offset, params_[k].sizes());
    if (grad.defined() && grad.data_ptr() == slice.data_ptr() && grad.is_contiguous()) return;
    torch::NoGradGuard no_grad;
    if (grad.defined())
      slice.copy_(grad);
    else
      slice.zero_();
    grad = slice;
  }

  std::vector<torch::Tensor> params_;
  std::shared_ptr<runtime::Communicator> comm_;
  BucketPlan plan_;
  std::vector<torch::Tensor> buffers_;  ///< one flat buffer per bucket
  std::vector<std::vector<torch::Tensor>> views_;  ///< per bucket: its parameters' gradients in it
  bool overlap_;
  BucketRound round_;  ///< last: destroyed first, while what it calls exists
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
