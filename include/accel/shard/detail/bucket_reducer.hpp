// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::BucketReducer: averages gradients across
/// ranks in buckets whose all-reduce starts from autograd hooks while backward
/// is still running (shard::Replicate).
#ifndef ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <torch/torch.h>

#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/accumulator_hooks.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

namespace accel::shard::detail {

/// Gradients live in a few flat buffers (buckets) that are allocated once and
/// reused every step: each parameter's .grad is re-pointed at its slice, so
/// autograd accumulates straight into the buffer and no copy is needed after
/// the first step. Buckets hold parameters in reverse registration order
/// (roughly the order backward produces them) and are all-reduced strictly in
/// index order, so every rank issues the same sequence of collectives even
/// when their gradients become ready in different orders.
class BucketReducer final : public GradientSync {
 public:
  /// overlap: start a bucket's all-reduce from backward once it is full;
  /// otherwise all of them in finalize(), after backward.
  BucketReducer(std::vector<torch::Tensor> params, std::shared_ptr<runtime::Communicator> comm,
                int64_t bucket_bytes, bool overlap = true)
      : params_(std::move(params)), comm_(std::move(comm)), overlap_(overlap) {
    build_buckets(bucket_bytes);
    hooks_.emplace(
        params_, [this](std::size_t k) { before_accumulate(k); },
        [this](std::size_t k) { on_grad_ready(k); }, alive_);
  }
  BucketReducer(const BucketReducer&) = delete;
  BucketReducer& operator=(const BucketReducer&) = delete;
  ~BucketReducer() override {
    // Hooks capture `this`: they must never run after destruction.
    *alive_ = false;
    try {
      wait_launched();
    } catch (...) {
    }
  }

  void set_sync_enabled(bool enabled) override { enabled_ = enabled; }
  void before_forward() override { hooks_->refresh(); }

  void finalize() override {
    if (!round_started_) return;
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) fill_missing(b);
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) buckets_[b].pending = 0;
    launch_ready();
    wait_launched();
    reset_round();
  }

  std::size_t num_buckets() const { return buckets_.size(); }
  bool overlaps() const { return overlap_; }
  /// Number of buckets whose all-reduce was started from a backward hook in
  /// the last round (the overlap that happened); exposed for tests/benchmarks.
  std::size_t launched_during_backward() const { return launched_in_hooks_; }

 private:
  struct Slot {
    std::size_t bucket;
    int64_t offset;
  };
  struct Bucket {
    torch::Tensor buffer;
    std::vector<std::size_t> params;
    std::size_t pending = 0;
    std::shared_ptr<runtime::Work> work;
  };

  void build_buckets(int64_t bucket_bytes) {
    slots_.resize(params_.size());
    ready_.assign(params_.size(), false);
    // Reverse order; a new bucket when the dtype/device changes or it is full.
    std::vector<std::vector<std::size_t>> groups;
    int64_t bytes = 0;
    for (std::size_t k = params_.size(); k-- > 0;) {
      const auto& p = params_[k];
      bool start = groups.empty() || bytes + static_cast<int64_t>(p.nbytes()) > bucket_bytes;
      if (!start) {
        const auto& q = params_[groups.back().front()];
        start = q.scalar_type() != p.scalar_type() || q.device() != p.device();
      }
      if (start) {
        groups.emplace_back();
        bytes = 0;
      }
      groups.back().push_back(k);
      bytes += static_cast<int64_t>(p.nbytes());
    }
    for (auto& g : groups) {
      Bucket b;
      int64_t numel = 0;
      for (auto k : g) {
        slots_[k] = Slot{buckets_.size(), numel};
        numel += params_[k].numel();
      }
      b.buffer = torch::zeros({numel}, params_[g.front()].options().requires_grad(false));
      b.params = std::move(g);
      b.pending = b.params.size();
      buckets_.push_back(std::move(b));
    }
  }

  // A tensor sharing the bucket's storage that is NOT an autograd view, so
  // LibTorch's zero_grad (detach_ + zero_) and in-place accumulation keep it.
  torch::Tensor slice_for(std::size_t k) const {
    const auto& p = params_[k];
    const auto& buf = buckets_[slots_[k].bucket].buffer;
    return torch::empty({0}, buf.options())
        .set_(buf.storage(), buf.storage_offset() + slots_[k].offset, p.sizes(),
              c10::contiguous_strides(p.sizes()));
  }

  void adopt_grad(std::size_t k) {
    auto& grad = params_[k].mutable_grad();
    auto slice = slice_for(k);
    if (grad.defined() && grad.data_ptr() == slice.data_ptr() && grad.is_contiguous()) return;
    torch::NoGradGuard no_grad;
    if (grad.defined())
      slice.copy_(grad);
    else
      slice.zero_();
    grad = slice;
  }

  // A second backward before the optimizer step: finish the first round
  // before autograd adds into a bucket whose all-reduce may still run (the
  // average of averages is still the average), then start a new one.
  void before_accumulate(std::size_t k) {
    if (enabled_ && ready_[k]) finalize();
  }

  void on_grad_ready(std::size_t k) {
    if (!enabled_) return;
    round_started_ = true;
    ready_[k] = true;
    adopt_grad(k);
    auto& b = buckets_[slots_[k].bucket];
    if (--b.pending == 0 && overlap_) {
      std::size_t before = next_launch_;
      launch_ready();
      launched_in_hooks_ += next_launch_ - before;
    }
  }

  void fill_missing(std::size_t b) {
    for (auto k : buckets_[b].params)
      if (!ready_[k]) adopt_grad(k);  // no gradient this round: contributes its current value (zero after zero_grad)
  }

  void launch_ready() {
    const double inv_world = 1.0 / comm_->size();
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      auto& b = buckets_[next_launch_++];
      if (comm_->size() > 1) {
        b.buffer.mul_(inv_world);
        b.work = comm_->all_reduce(b.buffer, runtime::ReduceOp::Sum);
      }
    }
  }

  void wait_launched() {
    for (auto& b : buckets_) {
      if (b.work) {
        auto w = std::move(b.work);
        w->wait();
      }
    }
  }

  void reset_round() {
    for (auto& b : buckets_) b.pending = b.params.size();
    std::fill(ready_.begin(), ready_.end(), false);
    next_launch_ = 0;
    round_started_ = false;
  }

  std::vector<torch::Tensor> params_;
  std::shared_ptr<runtime::Communicator> comm_;
  std::vector<Slot> slots_;
  std::vector<Bucket> buckets_;
  std::vector<bool> ready_;
  std::shared_ptr<Alive> alive_ = std::make_shared<Alive>(true);
  std::optional<AccumulatorHooks> hooks_;  ///< after alive_: hooks check it
  std::size_t next_launch_ = 0;
  std::size_t launched_in_hooks_ = 0;
  bool overlap_;
  bool enabled_ = true;
  bool round_started_ = false;
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
