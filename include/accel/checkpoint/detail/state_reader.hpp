// SPDX-License-Identifier: Apache-2.0
/// @file Defines how load_state reads a checkpoint: every file read and
/// validated before anything changes, and archive loads that roll back.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP

#include <accel/checkpoint/detail/optimizer_relayout.hpp>
#include <accel/checkpoint/detail/state_layout.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

/// Keys, shapes and dtypes of a saved model against the module; the error
/// lists every offending key.
inline void check_model(const NamedTensors& loaded, const torch::nn::Module& module,
                        const fs::path& source) {
  check_state_matches(loaded, module_state(module), source.string(), "model", "the prepared model");
}

inline void check_count(const nlohmann::json& meta, const char* key, std::size_t have,
                        const char* what, const fs::path& source) {
  const auto saved = json_field<int64_t>(meta, key, source);
  ACCEL_CHECK(saved == static_cast<int64_t>(have), "accel: the checkpoint '", source.parent_path().string(),
              "' holds ", saved, " ", what, " but this Accelerator has ", have,
              ". Prepare and register the same objects, in the same order, as the run that saved it.");
}

/// Everything one process reads, validated, before anything is applied.
struct ReadState {
  nlohmann::json meta;
  std::vector<NamedTensors> models;
  std::vector<torch::serialize::InputArchive> optimizers, schedulers, custom, comm_hooks;
  std::optional<GeneratorStates> generators;  ///< none: a process the saving run did not have
  std::vector<data::LoaderCheckpoint> loaders;
  std::optional<std::pair<double, int64_t>> scaler;
};

inline ReadState read_state(StateRegistry& reg, const fs::path& dir) {
  auto& comm = *reg.state->comm;
  const int rank = comm.rank();
  const fs::path state_file = dir / kStateFile;
  ReadState s;
  s.meta = read_json(state_file);
  ACCEL_CHECK(s.meta.value(key::format, "") == kStateFormat, "accel: '", state_file.string(),
              "' is not an accel save_state file. Pass a directory written by save_state().");
  ACCEL_CHECK(json_field<int>(s.meta, key::format_version, state_file) <= kStateFormatVersion,
              "accel: '", dir.string(), "' was written by a newer accel (checkpoint format ",
              s.meta[key::format_version].dump(), "). Load it with that version.");
  const auto saved_world = json_field<int64_t>(s.meta, key::world_size, state_file);
  const bool other_world = saved_world != comm.size();
  ACCEL_CHECK(saved_world >= 1, "accel: '", state_file.string(), "' records ", saved_world,
              " processes. Load a directory written by save_state().");
  check_count(s.meta, key::models, reg.models.size(), "models", state_file);
  check_count(s.meta, key::optimizers, reg.optimizers.size(), "optimizers", state_file);
  check_count(s.meta, key::schedulers, reg.schedulers.size(), "schedulers", state_file);
  check_count(s.meta, key::loaders, reg.loaders.size(), "data loaders", state_file);
  check_count(s.meta, key::custom_objects, reg.custom.size(), "registered objects", state_file);
  // Checkpoints from before communication hooks: none.
  const auto hooks = comm_hook_states(reg).size();
  const auto saved_hooks = s.meta.contains(key::comm_hook_states) ? json_field<int64_t>(s.meta, key::comm_hook_states, state_file) : 0;
  ACCEL_CHECK(saved_hooks == static_cast<int64_t>(hooks), "accel: the checkpoint '", dir.string(),
              "' holds the state of ", saved_hooks, " communication hooks (CommHook::PowerSGD) and "
              "this Accelerator's prepared models have ", hooks, ". Resume with the same "
              "AcceleratorOptions::comm_hook as the run that saved it.");
  ACCEL_CHECK(!other_world || hooks == 0, "accel: the checkpoint '", dir.string(), "' was saved by ",
              saved_world, " processes but this run has ", comm.size(), "; CommHook::PowerSGD's error "
              "feedback and Q matrices are per process and cannot be mapped onto another number of "
              "processes. Resume with ", saved_world, " processes.");
  ACCEL_CHECK(json_field<bool>(s.meta, key::loss_scaler, state_file) == (reg.scaler != nullptr),
              "accel: the checkpoint '", dir.string(), "' was saved ",
              reg.scaler ? "without" : "with", " a loss scaler (precision::Fp16) and this "
              "Accelerator runs ", reg.scaler ? "with" : "without",
              " one. Resume with the same precision policy.");
  const bool saved_per_rank = json_field<bool>(s.meta, key::optimizer_per_rank, state_file);
  // Checkpoints from before re-partitioning record only whether the state was per process.
  const bool saved_shards = s.meta.contains(key::shards_optimizer_state)
                                ? json_field<bool>(s.meta, key::shards_optimizer_state, state_file)
                                : saved_per_rank;
  ACCEL_CHECK(saved_shards == reg.shards_optimizer_state && (other_world || saved_per_rank == reg.optimizer_per_rank),
              "accel: the checkpoint '", dir.string(), "' was saved with another shard policy "
              "(optimizer state per process or not). Resume with the same shard policy.");
  if (reg.optimizer_per_rank && saved_per_rank && s.meta.contains(key::partition_bucket_cap_mb)) {
    // Each rank's optimizer file holds its chunks of the gradient buckets.
    const auto cap = json_field<double>(s.meta, key::partition_bucket_cap_mb, state_file);
    ACCEL_CHECK(cap == reg.partition_bucket_cap_mb, "accel: the checkpoint '", dir.string(),
                "' holds sharded optimizer state partitioned by buckets of ", cap,
                " MB, and this run's bucket_cap_mb is ", reg.partition_bucket_cap_mb,
                ", which splits the parameters differently. Resume with "
                "AcceleratorOptions::bucket_cap_mb = ", cap, ".");
  }
  // Another number of processes: the optimizer files whose state each
  // optimizer is cut from now (all processes' files), with their layouts.
  const bool relayout = other_world && reg.shards_optimizer_state;
  std::vector<std::vector<SavedPartition>> sources(reg.optimizers.size());
  if (relayout) {
    const auto saved = s.meta.find(key::partitions);
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
      const bool known = saved != s.meta.end() && saved->is_array() && saved->size() == reg.optimizers.size() &&
                         (*saved)[i].is_object() && i < reg.partitions.size() &&
                         !reg.partitions[i].whole.groups.empty();
      ACCEL_CHECK(known, "accel: the checkpoint '", dir.string(), "' was saved by ", saved_world,
                  " processes but this run has ", comm.size(), ", and it records no buckets for the "
                  "sharded state of optimizer ", i, " (written by an older accel, or an optimizer "
                  "that does not hold exactly one prepared model's trainable parameters), so that "
                  "state cannot be re-partitioned. Resume with ", saved_world, " processes.");
      const auto& whole = reg.partitions[i].whole;
      const auto& entry = (*saved)[i];
      const auto numel = json_field<std::vector<int64_t>>(entry, key::bucket_numel, state_file);
      const auto group = json_field<std::vector<int>>(entry, key::bucket_group, state_file);
      const auto groups = json_field<std::size_t>(entry, key::groups, state_file);
      ACCEL_CHECK(numel == whole.bucket_numel && group == whole.bucket_group && groups == whole.groups.size(),
                  "accel: the checkpoint '", dir.string(), "' holds the sharded state of optimizer ", i,
                  " in ", numel.size(), " buckets of ", c10::IntArrayRef(numel), " elements, and this "
                  "run's model, optimizer parameter groups and bucket_cap_mb make ", whole.bucket_numel.size(),
                  " buckets of ", c10::IntArrayRef(whole.bucket_numel), ". Resume with the same model, "
                  "parameter groups and AcceleratorOptions::bucket_cap_mb as the run that saved it.");
      if (saved_per_rank) {
        for (int r = 0; r < saved_world; ++r)
          sources[i].push_back({nullptr, shard::detail::chunk_layout(numel, group, groups, static_cast<int>(saved_world), r),
                                dir / optimizer_file(i, r, true)});
      } else {
        sources[i].push_back({nullptr, whole, dir / optimizer_file(i, 0, false)});
      }
    }
  }
  // A process the saving run did not have keeps its random generators and
  // continues the data where process 0 stood (mapped below).
  const bool has_own_files = rank < saved_world;
  const std::string loader_positions = loaders_file(has_own_files ? rank : 0);

  // Every missing file at once.
  std::vector<std::string> files;
  if (!other_world) {
    files = main_files(reg);
    for (auto& f : own_files(reg, rank)) files.push_back(std::move(f));
  } else {
    for (auto& f : main_files(reg))
      if (f.rfind("optimizer", 0) != 0) files.push_back(std::move(f));
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
      if (!relayout) files.push_back(optimizer_file(i, 0, false));
      for (const auto& src : sources[i]) files.push_back(src.file.filename().string());
    }
    if (has_own_files) files.push_back(random_states_file(rank));
    files.push_back(loader_positions);
  }
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto& f : files)
    if (!fs::is_regular_file(dir / f, ec)) missing.push_back(f);
  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    const auto skipped = s.meta.find(key::models_skipped);
    const bool skipped_at_save = skipped != s.meta.end() && skipped->is_array() &&
                                 std::find(skipped->begin(), skipped->end(), i) != skipped->end();
    ACCEL_CHECK(!skipped_at_save || reg.models_skipped.count(i), "accel: the checkpoint '", dir.string(),
                "' holds no file for model ", i, ": a save_state pre-hook took it out when it was "
                "written (and saved it its own way). Register a load_state pre-hook that erases "
                "it from the list and loads it the same way.");
  }
  ACCEL_CHECK(missing.empty(), "accel: the checkpoint '", dir.string(), "' lacks ", list(missing),
              other_world ? ". Another number of processes reads every process's optimizer files: put "
                            "the checkpoint where every process can read all of it (a shared file "
                            "system), or resume with the number of processes that saved it."
                          : ". Load a directory written completely by save_state().");

  // The checksums save_state recorded (none in checkpoints written before it recorded them).
  std::optional<Checksums> sums;
  if (const auto it = s.meta.find(key::checksums); it != s.meta.end()) {
    sums.emplace();
    const bool valid = it->is_object() && std::all_of(it->begin(), it->end(), [&](const auto& v) {
      const auto value = v.is_string() ? from_hex(v.template get<std::string>()) : std::nullopt;
      return value.has_value();
    });
    ACCEL_CHECK(valid, "accel: the checkpoint file '", state_file.string(),
                "' has no valid 'xxh64' entry. Load a directory written by save_state().");
    for (auto e = it->begin(); e != it->end(); ++e) (*sums)[e.key()] = *from_hex(e.value().get<std::string>());
  }
  const auto expected = [&](const std::string& name) -> std::optional<std::uint64_t> {
    if (!sums) return std::nullopt;
    const auto it = sums->find(name);
    ACCEL_CHECK(it != sums->end(), "accel: the checkpoint file '", state_file.string(),
                "' records no checksum for '", name, "'. Load a directory written completely by "
                "save_state().");
    return it->second;
  };

  s.models.resize(reg.models.size());
  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    if (reg.models_skipped.count(i)) continue;  // a load_state pre-hook loads it
    const std::string name = model_file(i);
    const fs::path f = dir / name;
    auto contents = read_safetensors(f);  // checks the data against the header's checksum
    if (const auto want = expected(name)) {
      const auto it = contents.metadata.find(std::string(kDataChecksumKey));
      const auto have = it == contents.metadata.end() ? std::nullopt : from_hex(it->second);
      ACCEL_CHECK(have == want, "accel: the checkpoint file '", f.string(),
                  "' is not the file save_state() wrote there (its data checksum is ",
                  have ? to_hex(*have) : std::string("missing"), ", '", kStateFile, "' records ",
                  to_hex(*want), "). Load another checkpoint, or restore this file from a copy.");
    }
    s.models[i] = std::move(contents.tensors);
    check_model(s.models[i], *reg.models[i], f);
  }
  s.optimizers.resize(reg.optimizers.size());
  for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
    if (!relayout) {
      const std::string name = other_world ? optimizer_file(i, 0, false) : optimizer_file(i, rank, reg.optimizer_per_rank);
      load_archive(s.optimizers[i], dir / name, expected(name), reg.state->device);
      continue;
    }
    std::vector<torch::serialize::InputArchive> saved(sources[i].size());
    for (std::size_t r = 0; r < saved.size(); ++r) {
      const auto name = sources[i][r].file.filename().string();
      load_archive(saved[r], sources[i][r].file, expected(name), reg.state->device);
      sources[i][r].archive = &saved[r];
    }
    s.optimizers[i] = relayout_optimizer(sources[i], reg.partitions[i].held, reg.state->device);
  }
  s.schedulers.resize(reg.schedulers.size());
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) {
    const std::string name = scheduler_file(i);
    load_archive(s.schedulers[i], dir / name, expected(name));
  }
  s.custom.resize(reg.custom.size());
  for (std::size_t i = 0; i < reg.custom.size(); ++i) {
    const std::string name = custom_file(i);
    load_archive(s.custom[i], dir / name, expected(name));
  }
  s.comm_hooks.resize(hooks);
  for (std::size_t i = 0; i < hooks; ++i) {
    const std::string name = comm_hook_file(i, rank);
    load_archive(s.comm_hooks[i], dir / name, expected(name), reg.state->device);
  }
  if (has_own_files) {
    const fs::path f = dir / random_states_file(rank);
    torch::serialize::InputArchive rng;
    load_archive(rng, f, expected(random_states_file(rank)));
    s.generators = GeneratorStates::read(rng, f);
  }
  {
    const fs::path f = dir / loader_positions;
    const auto j = read_json(f, expected(loader_positions));
    const auto list_j = j.find(key::loaders);
    ACCEL_CHECK(list_j != j.end() && list_j->is_array() && list_j->size() == reg.loaders.size(),
                "accel: the checkpoint file '", f.string(), "' does not hold ", reg.loaders.size(),
                " loader positions. Load a directory written completely by save_state().");
    for (const auto& l : *list_j) {
      data::LoaderCheckpoint c{json_field<int64_t>(l, key::epoch, f), json_field<int64_t>(l, key::batches_yielded, f)};
      ACCEL_CHECK(c.batches_yielded >= 0 && c.epoch >= 0, "accel: the checkpoint file '", f.string(),
                  "' holds a negative loader position. Save the checkpoint again.");
      if (other_world && c.batches_yielded > 0) {
        // The same samples, in whole steps of this run (the epoch's order
        // does not depend on the number of processes).
        const std::size_t index = s.loaders.size();
        const auto saved_step = l.contains(key::samples_per_step) ? json_field<int64_t>(l, key::samples_per_step, f) : 0;
        const auto step = reg.loaders[index].samples_per_step();
        const auto samples = c.batches_yielded * saved_step;
        ACCEL_CHECK(saved_step > 0, "accel: the checkpoint '", dir.string(), "' was saved by ", saved_world,
                    " processes but this run has ", comm.size(), ", and it does not record how many "
                    "samples a step of data loader ", index, " took (written by an older accel). "
                    "Resume with ", saved_world, " processes.");
        ACCEL_CHECK(samples % step == 0, "accel: the checkpoint '", dir.string(), "' was saved by ",
                    saved_world, " processes after ", c.batches_yielded, " steps of ", saved_step,
                    " samples of data loader ", index, " in epoch ", c.epoch, " (", samples,
                    " samples); this run takes ", step, " samples per step (", comm.size(),
                    " processes), and ", samples, " samples are not a whole number of its steps, so "
                    "the epoch cannot be continued exactly. Use a batch size with which ", samples,
                    " samples are whole steps, or resume with ", saved_world, " processes.");
        c.batches_yielded = samples / step;
      }
      s.loaders.push_back(c);
    }
  }
  if (reg.scaler) {
    const fs::path f = dir / kScalerFile;
    const auto j = read_json(f, expected(kScalerFile));
    s.scaler.emplace(json_field<double>(j, key::scale, f), json_field<int64_t>(j, key::growth_tracker, f));
    ACCEL_CHECK(s.scaler->first > 0 && s.scaler->second >= 0, "accel: '", f.string(),
                "' holds an invalid loss scale. Save the checkpoint again.");
  }
  json_field<int64_t>(s.meta, key::micro_step, state_file);
  json_field<int64_t>(s.meta, key::optimizer_steps, state_file);
  return s;
}

/// Loads archives into objects; on failure puts back the objects already
/// loaded (from in-memory snapshots) and rethrows.
class ArchiveTransaction {
 public:
  void apply(const Archived& target, torch::serialize::InputArchive& in, const char* what,
             std::size_t index) {
    if (target.snapshot) {
      done_.push_back(target.snapshot());
    } else {
      torch::serialize::OutputArchive snap;
      target.save(snap);
      std::ostringstream out;
      snap.save_to(out);
      done_.push_back([&target, bytes = out.str()] {
        std::istringstream in_bytes(bytes);
        torch::serialize::InputArchive in;
        in.load_from(in_bytes);
        target.load(in);
      });
    }
    try {
      target.load(in);
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      rollback();
      throw Error(accel::detail::concat("accel: cannot restore ", what, " ", index,
                                        " from the checkpoint (", msg,
                                        "); nothing was loaded. Prepare the same objects as the "
                                        "run that saved it."));
    }
  }
  void rollback() noexcept {
    for (auto it = done_.rbegin(); it != done_.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {  // best effort: the snapshot was taken from this very object
      }
    }
    done_.clear();
  }

 private:
  std::vector<std::function<void()>> done_;  ///< restores, in the order applied
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP
