// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::comm::Hook, how a bucket of gradients is averaged
/// across processes, and the two simplest hooks: MeanHook (what accel does
/// without a hook) and FunctionHook (a user's callable).
#ifndef ACCEL_COMM_HOOK_HPP
#define ACCEL_COMM_HOOK_HPP

#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include <torch/torch.h>

#include <accel/comm/grad_bucket.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::comm {

/// A user's hook: start averaging bucket.buffer across ranks and return the
/// work to wait for; when that work's wait() returns, bucket.buffer must hold
/// the mean. It runs on every rank for the same buckets in the same order, so
/// it must issue the same collectives everywhere. Return a runtime::ThenWork
/// to decompress (or start a second collective) after the first one.
using HookFunction = std::function<std::shared_ptr<runtime::Work>(GradBucket&, runtime::Communicator&)>;

/// What a gradient sync calls where a bucket's reduction starts. One object
/// per prepared model (hooks with state keep it per bucket index).
class Hook {
 public:
  virtual ~Hook() = default;
  /// Replicate and ZeRO-1: when the returned work is done, bucket.buffer holds
  /// the mean over ranks.
  virtual std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) = 0;
  /// ZeRO-2: `output` (1/N of bucket.buffer's elements) receives the mean of
  /// every rank's chunk `comm.rank()`. By default the whole bucket is
  /// all-reduced through all_reduce() and this rank's chunk kept.
  virtual std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                        runtime::Communicator& comm) {
    auto work = all_reduce(bucket, comm);
    const auto n = output.numel();
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [out = std::move(output), buf = bucket.buffer, r = comm.rank(), n]() mutable {
          torch::NoGradGuard no_grad;
          out.view(-1).copy_(buf.view(-1).narrow(0, r * n, n));
        });
  }
  /// State that save_state() keeps and load_state() restores (PowerSGD's).
  virtual bool has_state() const { return false; }
  virtual void save(torch::serialize::OutputArchive& /*archive*/) const {}
  virtual void load(torch::serialize::InputArchive& /*archive*/) {}
};

/// No compression: divide by the world size, sum across ranks.
class MeanHook final : public Hook {
 public:
  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    bucket.buffer.mul_(1.0 / comm.size());
    return comm.all_reduce(bucket.buffer, runtime::ReduceOp::Sum);
  }
  std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                runtime::Communicator& comm) override {
    bucket.buffer.mul_(1.0 / comm.size());
    return comm.reduce_scatter(output, bucket.buffer, runtime::ReduceOp::Sum);
  }
};

/// A user's callable (Accelerator::register_comm_hook).
class FunctionHook final : public Hook {
 public:
  explicit FunctionHook(HookFunction fn) : fn_(std::move(fn)) {
    ACCEL_CHECK(fn_ != nullptr, "accel: register_comm_hook() was given an empty function. Pass a "
                "callable (GradBucket&, Communicator&) -> std::shared_ptr<Work>.");
  }
  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    auto work = fn_(bucket, comm);
    return work ? work : std::make_shared<runtime::CompletedWork>();
  }

 private:
  HookFunction fn_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_HOOK_HPP
