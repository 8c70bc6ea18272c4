// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::save_state/load_state, the machinery of
/// Accelerator::save_state()/load_state(): the whole training state in one
/// directory, written atomically by every process, read back exactly.
///
/// Directory layout (docs/checkpoints.md has the details):
///
///   accel_state.json          main   format, accel version, world size, step
///                                    counters, how many of each kind, automatic
///                                    checkpoint number, the XXH64 of every other
///                                    file ("xxh64"); written last
///   model.safetensors         main   prepared model 0 (model_1.safetensors, ...)
///   optimizer.pt              main   optimizer 0, torch archive (optimizer_1.pt, ...;
///                                    optimizer_rank<r>.pt per process when the
///                                    shard policy partitions optimizer state)
///   scheduler.pt              main   scheduler 0 (scheduler_1.pt, ...)
///   custom_checkpoint_<i>.pt  main   objects given to register_for_checkpointing
///   scaler.json               main   loss scale and growth tracker (Fp16 only)
///   random_states_<r>.pt      each   CPU, CUDA and accel::std_generator() states
///   loaders_<r>.json          each   epoch and batches yielded of every prepared loader
///   comm_hook_rank<r>.pt      each   CommHook::PowerSGD's step, errors and Qs
///                                    (comm_hook_1_rank<r>.pt, ...: one per model)
///
/// Atomicity: everything goes to <dir>.accel-tmp first (each file fsynced),
/// the processes agree that all files are in, then the main process renames
/// the directory into place (see detail::commit_directory). A process killed
/// at any point leaves the previous checkpoint complete and loadable.
/// Loading checks every file's checksum and validates it on every process,
/// and the processes agree, before anything is changed; objects restored through torch archives are
/// rolled back if one of them still fails.
#ifndef ACCEL_CHECKPOINT_SAVE_STATE_HPP
#define ACCEL_CHECKPOINT_SAVE_STATE_HPP

#include <accel/checkpoint/detail/state_layout.hpp>
#include <accel/checkpoint/detail/state_reader.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/version.hpp>

#include <exception>
#include <filesystem>
#include <optional>
#include <string>

namespace accel::ckpt {

/// Writes the registry's state to dir, or (no dir) to
/// project_dir/checkpoints/checkpoint_<N> keeping at most options.total_limit
/// of those. Every process must call it. Returns the directory written.
inline std::filesystem::path save_state(StateRegistry& reg, const AcceleratorOptions& options,
                                        std::optional<std::filesystem::path> dir = {}) {
  using namespace detail;
  auto& comm = *reg.state->comm;
  const int rank = comm.rank();
  const bool main = rank == 0;
  const bool automatic = !dir.has_value();
  // Accelerate ignores the directory given when automatic naming is on.
  ACCEL_CHECK(automatic || !options.automatic_checkpoint_naming,
              "accel: AcceleratorOptions::automatic_checkpoint_naming is on, so save_state() "
              "writes project_dir/checkpoints/checkpoint_<N>, not '", dir->string(),
              "'. Call save_state() without a directory, or turn automatic naming off.");
  fs::path base;
  fs::path target;
  if (automatic) {
    base = checkpoints_base(options, "save_state");
    ACCEL_CHECK(!options.total_limit || *options.total_limit >= 1,
                "accel: AcceleratorOptions::total_limit must be at least 1 (got ",
                options.total_limit.value_or(0), "). Leave it unset to keep every checkpoint.");
    target = base / checkpoint_dir_name(reg.checkpoint_iteration);
  } else {
    target = normal_dir(*dir);
  }
  const fs::path stage = target.string() + ".accel-tmp";
  reg.state->finalize_gradients();
  // The scale the next backward would use (an update an iteration left
  // pending), so a resumed run scales its first loss as this run does.
  reg.state->settle_loss_scale();

  std::exception_ptr err;
  if (main) {
    try {
      std::error_code ec;
      if (automatic) {
        // Accelerate's #1601/#3306: a run that did not load numbers from 0
        // again. Refuse anything but a new newest checkpoint.
        const auto all = list_checkpoints(base);
        ACCEL_CHECK(all.empty() || all.back().first < reg.checkpoint_iteration, "accel: '",
                    base.string(), "' already holds checkpoint_", all.empty() ? 0 : all.back().first,
                    ", so checkpoint_", reg.checkpoint_iteration,
                    " would not be the newest. Call load_state() first to continue the numbering "
                    "of an earlier run, or use another project_dir.");
      }
      fs::remove_all(stage, ec);  // left by a killed save
      fs::create_directories(stage, ec);
      if (ec || !fs::is_directory(stage))
        throw Error("accel: cannot create the checkpoint directory '" + stage.string() + "': " +
                    ec.message() + ". Pass a directory that can be written.");
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(*reg.state->comm, err, "save_state (creating the directory)", kSaveKept);

  // A failed save leaves nothing behind: the previous checkpoint, untouched.
  const auto remove_stage = [&] {
    std::error_code ec;
    if (main) fs::remove_all(stage, ec);
  };
  Checksums sums;
  const SkippedModels skipped(reg);
  try {
    reg.models_skipped = reg.save_pre_hooks.run(reg.models, stage, "save_state");
    sums = write_process_files(reg, stage, rank);
  } catch (...) {
    err = std::current_exception();
  }
  try {
    agree(*reg.state->comm, err, "save_state (writing the files)", kSaveKept);
  } catch (...) {
    remove_stage();
    throw;
  }
  sums = gather_checksums(reg, std::move(sums));

  if (main) {
    try {
      nlohmann::json meta = {
          {key::format, std::string(kStateFormat)},
          {key::format_version, kStateFormatVersion},
          {key::accel_version, version_string},
          {key::world_size, comm.size()},
          {key::micro_step, reg.state->micro_step},
          {key::optimizer_steps, reg.state->optimizer_steps},
          {key::checkpoint_iteration, automatic ? nlohmann::json(reg.checkpoint_iteration) : nlohmann::json()},
          {key::models, reg.models.size()},
          {key::models_skipped, reg.models_skipped},
          {key::optimizers, reg.optimizers.size()},
          {key::optimizer_per_rank, reg.optimizer_per_rank},
          {key::partition_bucket_cap_mb, reg.partition_bucket_cap_mb},
          {key::shards_optimizer_state, reg.shards_optimizer_state},
          {key::partitions, partitions_json(reg)},
          {key::schedulers, reg.schedulers.size()},
          {key::loaders, reg.loaders.size()},
          {key::custom_objects, reg.custom.size()},
          {key::comm_hook_states, comm_hook_states(reg).size()},
          {key::loss_scaler, reg.scaler != nullptr},
          {key::checksums, checksums_json(sums)}};
      write_json(stage / kStateFile, meta);
      fsync_path(stage, true);
      crash_point("before_commit");
      commit_directory(stage, target);
      if (automatic && options.total_limit) {
        auto all = list_checkpoints(base);
        std::error_code ec;
        for (std::size_t i = 0; i + static_cast<std::size_t>(*options.total_limit) < all.size(); ++i)
          fs::remove_all(all[i].second, ec);
      }
    } catch (...) {
      err = std::current_exception();
      remove_stage();
    }
  }
  agree(*reg.state->comm, err, "save_state (committing the directory)", kSaveKept);
  if (automatic) ++reg.checkpoint_iteration;
  return target;
}

namespace detail {

/// load_state's second half: puts what read_state() read (and every process
/// agreed is valid) into the registry's objects. Archive loads that still
/// fail are rolled back on every process, which then all throw.
inline void apply_state(StateRegistry& reg, ReadState& s) {
  std::exception_ptr err;
  const auto optimizers = optimizer_states(reg);  // these outlive tx, which refers to them
  const auto hooks = comm_hook_states(reg);
  ArchiveTransaction tx;
  try {
    for (std::size_t i = 0; i < optimizers.size(); ++i)
      tx.apply(optimizers[i], s.optimizers[i], "optimizer", i);
    for (std::size_t i = 0; i < reg.schedulers.size(); ++i)
      tx.apply(reg.schedulers[i], s.schedulers[i], "scheduler", i);
    for (std::size_t i = 0; i < reg.custom.size(); ++i)
      tx.apply(reg.custom[i], s.custom[i], "registered object", i);
    for (std::size_t i = 0; i < hooks.size(); ++i)
      tx.apply(hooks[i], s.comm_hooks[i], "communication hook", i);
  } catch (...) {
    err = std::current_exception();
  }
  if (failed_rank(*reg.state->comm, err == nullptr) >= 0) {
    tx.rollback();
    agree(*reg.state->comm, err, "load_state (restoring optimizers, schedulers and registered objects)",
          kLoadKept);
  }

  // Validated above: nothing below can fail.
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      if (reg.models_skipped.count(i)) continue;
      std::map<std::string, torch::Tensor> by_name(s.models[i].begin(), s.models[i].end());
      for (auto& [key, t] : module_state(*reg.models[i])) {
        torch::Tensor target_tensor = t;
        target_tensor.copy_(by_name.at(key));
      }
    }
  }
  if (reg.scaler) reg.scaler->load(s.scaler->first, s.scaler->second);
  if (s.generators) s.generators->apply();
  reg.state->micro_step = s.meta.at(key::micro_step).get<int64_t>();
  reg.state->optimizer_steps = s.meta.at(key::optimizer_steps).get<int64_t>();
  for (auto& seen : reg.scheduler_seen_steps) *seen = reg.state->optimizer_steps;
  for (std::size_t i = 0; i < reg.loaders.size(); ++i) reg.loaders[i].restore(s.loaders[i]);
}

}  // namespace detail

/// Restores the registry's state from dir, or (no dir) from the newest
/// project_dir/checkpoints/checkpoint_<N>, whose N+1 becomes the next
/// automatic number. Every process must call it. A bad checkpoint throws
/// accel::Error on every process and changes nothing. Returns the directory read.
inline std::filesystem::path load_state(StateRegistry& reg, const AcceleratorOptions& options,
                                        std::optional<std::filesystem::path> dir = {}) {
  using namespace detail;
  fs::path target;
  std::optional<int64_t> number;
  std::exception_ptr err;
  ReadState s;
  const SkippedModels skipped(reg);
  try {
    if (dir) {
      target = normal_dir(*dir);
    } else {
      const fs::path base = checkpoints_base(options, "load_state");
      const auto all = list_checkpoints(base);
      ACCEL_CHECK(!all.empty(), "accel: load_state() found no checkpoint_<N> directory in '",
                  base.string(), "'. Save one with save_state() first, or pass a directory.");
      target = all.back().second;
      number = all.back().first;
    }
    const auto readable = readable_checkpoint(target);
    reg.models_skipped = reg.load_pre_hooks.run(reg.models, readable, "load_state");
    s = read_state(reg, readable);
  } catch (...) {
    err = std::current_exception();
  }
  agree(*reg.state->comm, err, "load_state (reading the checkpoint)", kLoadKept);
  apply_state(reg, s);
  if (number) {
    reg.checkpoint_iteration = *number + 1;
  } else if (const auto it = s.meta.find(key::checkpoint_iteration);
             it != s.meta.end() && it->is_number_integer()) {
    reg.checkpoint_iteration = it->get<int64_t>() + 1;
  }
  return target;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAVE_STATE_HPP
