// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::shard::detail::GradientSync, what a prepared model's
/// shard policy does with gradients, as seen by the optimizer and the Accelerator.
#ifndef ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
#define ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <accel/comm/hook.hpp>

namespace accel::shard::detail {

class ParameterGather;

class GradientSync {
 public:
  /// sync_now: the Accelerator's one "synchronise gradients now" flag
  /// (TrainingState::sync_gradients, false on the non-sync micro-steps of
  /// accumulate()); null: always.
  explicit GradientSync(std::shared_ptr<const bool> sync_now = nullptr) : sync_now_(std::move(sync_now)) {}
  virtual ~GradientSync() = default;

  /// Inside accumulate(model) the model follows the sync flag; outside it,
  /// every backward synchronises.
  void set_accumulating(bool accumulating) { accumulating_ = accumulating; }
  /// Whether this backward communicates: no communication at all otherwise.
  bool sync_now() const { return !accumulating_ || sync_now_ == nullptr || *sync_now_; }

  /// Starts what backward did not start (buckets of parameters that got no
  /// gradient), waits for everything in flight: afterwards every gradient on
  /// this rank is the average over ranks.
  virtual void finalize() = 0;
  /// Before each forward of the prepared model: re-attach what the user may
  /// have detached since (Module::load replaces gradient accumulators).
  virtual void before_forward() {}
  /// join_uneven_inputs() on a rank out of data, while the others run a
  /// backward: contribute zero gradients to every bucket's reduction, in the
  /// same order, and wait (afterwards the gradients are the others' average).
  virtual void shadow_backward() {}
  /// How buckets are averaged across ranks (AcceleratorOptions::comm_hook,
  /// Accelerator::register_comm_hook); null where nothing is communicated.
  virtual comm::Hook* comm_hook() const { return nullptr; }
  virtual void set_comm_hook(std::shared_ptr<comm::Hook> /*hook*/) {}
  /// Under shard::ShardParameters, how the model's forward gathers its
  /// parameters; null where every rank holds them whole.
  virtual ParameterGather* parameter_gather() { return nullptr; }

 private:
  std::shared_ptr<const bool> sync_now_;
  bool accumulating_ = false;
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

/// ZeRO-3 (shard::ShardParameters): each rank holds a partition of the
/// parameters; the whole values exist only while a unit computes. Units are
/// numbered as units_of() (parameter_units.hpp) numbers them. Every call is a
/// collective where it gathers: all ranks make the same calls in the same order.
class ParameterGather {
 public:
  virtual ~ParameterGather() = default;
  /// Makes unit u's parameters (and any tied parameter it uses) whole.
  virtual void gather_unit(std::size_t u) = 0;
  /// Frees what gather_unit(u) made whole.
  virtual void release_unit(std::size_t u) = 0;
  /// Unit u's backward is next (units run as a chain): the units after it
  /// are done with theirs and are freed; unit u is gathered.
  virtual void gather_for_backward(std::size_t u) = 0;
  /// The model's forward begins: with shard::Unit modules, the parameters
  /// outside them become whole (until backward); without, all of them.
  virtual void gather_for_forward() = 0;
  /// The model names its units with shard::Unit (units_of()).
  virtual bool has_named_units() const = 0;
  virtual void gather_all() = 0;
  virtual void release_all() = 0;
  /// Streaming save_model: makes whole the bucket holding t, when t is one
  /// of this model's sharded parameters (not a buffer, a frozen parameter or
  /// another model's), and frees the bucket the previous call made whole
  /// (release_all() ends the stream).
  virtual void gather_holding(const torch::Tensor& t) = 0;
  /// After the parameters were written while whole (load_state): each
  /// rank's partition takes the new values.
  virtual void keep_written_values() = 0;
};

/// The policy for one process: gradients are already complete.
class NoSync final : public GradientSync {
 public:
  void finalize() override {}
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
