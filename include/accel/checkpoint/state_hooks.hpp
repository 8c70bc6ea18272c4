// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StatePreHooks, what
/// Accelerator::register_save_state_pre_hook / register_load_state_pre_hook
/// keep: callables run by save_state()/load_state() with the prepared models
/// and the checkpoint directory before accel writes or reads its files
/// (Accelerate's hooks of the same names), and the handle that removes one.
#ifndef ACCEL_CHECKPOINT_STATE_HOOKS_HPP
#define ACCEL_CHECKPOINT_STATE_HOOKS_HPP

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>

namespace accel::ckpt {

/// The prepared models, in prepare() order. A hook may erase entries: accel
/// then neither writes (save) nor reads (load) those models' files, and the
/// hook saves or loads them itself; it may write or read its own files in dir.
using ModelList = std::vector<std::shared_ptr<torch::nn::Module>>;
/// save: dir is where the checkpoint is being assembled (committed with
/// accel's files, atomically); load: the checkpoint directory being read.
using StatePreHook = std::function<void(ModelList& models, const std::filesystem::path& dir)>;

/// Removes the hook it was returned for (as torch.utils.hooks.RemovableHandle);
/// harmless twice, or after the Accelerator is gone.
class RemovableHandle {
 public:
  RemovableHandle() = default;
  RemovableHandle(std::weak_ptr<std::map<int, StatePreHook>> table, int id) : table_(std::move(table)), id_(id) {}
  void remove() {
    if (auto t = table_.lock()) t->erase(id_);
  }

 private:
  std::weak_ptr<std::map<int, StatePreHook>> table_;
  int id_ = -1;
};

/// Hooks of one kind, run in registration order.
class StatePreHooks {
 public:
  RemovableHandle add(StatePreHook hook) {
    ACCEL_CHECK(static_cast<bool>(hook), "accel: a state pre-hook must be callable (got an empty std::function).");
    const int id = next_++;
    table_->emplace(id, std::move(hook));
    return {table_, id};
  }

  /// Runs every hook on a copy of `models`; returns the indices of the
  /// models a hook erased. `what` names the call in errors.
  std::set<std::size_t> run(const ModelList& models, const std::filesystem::path& dir, const char* what) const {
    if (table_->empty()) return {};
    ModelList kept = models;
    for (const auto& [id, hook] : *table_) hook(kept, dir);
    for (const auto& m : kept)
      ACCEL_CHECK(std::find(models.begin(), models.end(), m) != models.end(), "accel: a ", what,
                  " pre-hook put a model into the list that is not a prepared model of this "
                  "Accelerator. A hook may only erase entries (and save or load those models itself).");
    std::set<std::size_t> erased;
    for (std::size_t i = 0; i < models.size(); ++i)
      if (std::find(kept.begin(), kept.end(), models[i]) == kept.end()) erased.insert(i);
    return erased;
  }

 private:
  std::shared_ptr<std::map<int, StatePreHook>> table_ = std::make_shared<std::map<int, StatePreHook>>();
  int next_ = 0;
};

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_STATE_HOOKS_HPP
