// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::shard::detail::GradientSync, what a prepared model's
/// shard policy does with gradients, as seen by the optimizer and the Accelerator.
#ifndef ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
#define ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP

#include <vector>

#include <torch/torch.h>

namespace accel::shard::detail {

class GradientSync {
 public:
  virtual ~GradientSync() = default;
  /// false on the non-sync micro-steps of accumulate(): no communication at all.
  virtual void set_sync_enabled(bool enabled) = 0;
  /// Starts what backward did not start (buckets of parameters that got no
  /// gradient), waits for everything in flight: afterwards every gradient on
  /// this rank is the average over ranks.
  virtual void finalize() = 0;
  /// Before each forward of the prepared model: re-attach what the user may
  /// have detached since (Module::load replaces gradient accumulators).
  virtual void before_forward() {}
};

/// What a sharded model's policy does around the optimizer whose parameters
/// are this rank's partitions (shard::ShardOptimizer, ShardGradients).
class OptimizerPartition {
 public:
  virtual ~OptimizerPartition() = default;
  /// Zeroes (or releases) every gradient the model holds, not only the
  /// partitions' that the optimizer sees.
  virtual void zero_grad() = 0;
  /// After the inner optimizer step: make every rank's full parameters the
  /// updated ones again (all-gather). stepped is false when it was skipped.
  virtual void after_step(bool stepped) = 0;
};

/// The policy for one process: gradients are already complete.
class NoSync final : public GradientSync {
 public:
  void set_sync_enabled(bool) override {}
  void finalize() override {}
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
