// SPDX-License-Identifier: Apache-2.0
/// @file Defines LoaderState and active_loader_state(): which data loader is
/// being iterated and whether its current batch is the last one (Accelerate's
/// GradientState.end_of_dataloader / remainder, used by gather_for_metrics and
/// gradient accumulation).
#ifndef ACCEL_DATA_LOADER_STATE_HPP
#define ACCEL_DATA_LOADER_STATE_HPP

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace accel::data {

/// The state of one iteration (epoch) of a data loader.
struct LoaderState {
  /// True while the last batch of the epoch (on this rank) is being
  /// processed: it is set before that batch is handed out.
  bool end_of_dataloader = false;
  /// dataset_size % total_batch_size (total = batch_size with split_batches,
  /// else batch_size * world_size); 0 with drop_last. On the last batch,
  /// gather_for_metrics keeps only the first `remainder` gathered samples
  /// when it is > 0: the rest are the wrap-around duplicates of even_batches.
  int64_t remainder = 0;
  /// Index (0-based, per rank, counting skipped batches) of the batch being
  /// processed; -1 before the first.
  int64_t batch_index = -1;
  /// Batches of this epoch on this rank.
  int64_t num_batches = 0;
};

namespace detail {

// Per-thread stack of the loaders being iterated, innermost last: a thread
// sees only the loops it runs itself (two threads training side by side do
// not see each other's loader). An entry is removed by identity so that
// out-of-order ends cannot corrupt it; an iteration keeps its stack alive and
// removes itself from it even when it ends on another thread (hence the lock).
class ActiveLoaders {
 public:
  static const std::shared_ptr<ActiveLoaders>& instance() {
    thread_local const auto stack = std::make_shared<ActiveLoaders>();
    return stack;
  }
  void push(const LoaderState* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    states_.push_back(s);
  }
  void remove(const LoaderState* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find(states_.rbegin(), states_.rend(), s);
    if (it != states_.rend()) states_.erase(std::next(it).base());
  }
  const LoaderState* top() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return states_.empty() ? nullptr : states_.back();
  }
  std::size_t depth() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return states_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::vector<const LoaderState*> states_;
};

}  // namespace detail

/// The state of the innermost data loader being iterated, or nullptr when no
/// loader is. An evaluation loader iterated inside the training loop is the
/// active one until its loop ends (or is left by break/exception); then the
/// training loader is active again. The pointer is valid until that loop ends.
inline const LoaderState* active_loader_state() { return detail::ActiveLoaders::instance()->top(); }

}  // namespace accel::data

#endif  // ACCEL_DATA_LOADER_STATE_HPP
