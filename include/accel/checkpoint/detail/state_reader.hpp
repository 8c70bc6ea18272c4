// SPDX-License-Identifier: Apache-2.0
/// @file Defines how load_state reads a checkpoint: every file read and
/// validated before anything changes, and archive loads that roll back.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP

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
  GeneratorStates generators;
  std::vector<data::LoaderCheckpoint> loaders;
  std::optional<std::pair<double, int64_t>> scaler;
};

inline ReadState read_state(StateRegistry& reg, const fs::path& dir) {
  auto& comm = *reg.state->comm;
  const int rank = comm.rank();
  const fs::path state_file = dir / kStateFile;
  ReadState s;
  s.meta = read_json(state_file);
  ACCEL_CHECK(s.meta.value("format", "") == kStateFormat, "accel: '", state_file.string(),
              "' is not an accel save_state file. Pass a directory written by save_state().");
  ACCEL_CHECK(json_field<int>(s.meta, "format_version", state_file) <= kStateFormatVersion,
              "accel: '", dir.string(), "' was written by a newer accel (checkpoint format ",
              s.meta["format_version"].dump(), "). Load it with that version.");
  const auto world = json_field<int64_t>(s.meta, "world_size", state_file);
  ACCEL_CHECK(world == comm.size(), "accel: the checkpoint '", dir.string(), "' was saved by ",
              world, " processes but this run has ", comm.size(),
              "; its random states and data loader positions are per process and cannot be "
              "mapped onto another world size. Resume with ", world, " processes.");
  check_count(s.meta, "models", reg.models.size(), "models", state_file);
  check_count(s.meta, "optimizers", reg.optimizers.size(), "optimizers", state_file);
  check_count(s.meta, "schedulers", reg.schedulers.size(), "schedulers", state_file);
  check_count(s.meta, "loaders", reg.loaders.size(), "data loaders", state_file);
  check_count(s.meta, "custom_objects", reg.custom.size(), "registered objects", state_file);
  // Checkpoints from before communication hooks: none.
  const auto hooks = comm_hook_states(reg).size();
  const auto saved_hooks = s.meta.contains("comm_hook_states") ? json_field<int64_t>(s.meta, "comm_hook_states", state_file) : 0;
  ACCEL_CHECK(saved_hooks == static_cast<int64_t>(hooks), "accel: the checkpoint '", dir.string(),
              "' holds the state of ", saved_hooks, " communication hooks (CommHook::PowerSGD) and "
              "this Accelerator's prepared models have ", hooks, ". Resume with the same "
              "AcceleratorOptions::comm_hook as the run that saved it.");
  ACCEL_CHECK(json_field<bool>(s.meta, "loss_scaler", state_file) == (reg.scaler != nullptr),
              "accel: the checkpoint '", dir.string(), "' was saved ",
              reg.scaler ? "without" : "with", " a loss scaler (precision::Fp16) and this "
              "Accelerator runs ", reg.scaler ? "with" : "without",
              " one. Resume with the same precision policy.");
  ACCEL_CHECK(json_field<bool>(s.meta, "optimizer_per_rank", state_file) == reg.optimizer_per_rank,
              "accel: the checkpoint '", dir.string(), "' was saved with another shard policy "
              "(optimizer state per process or not). Resume with the same shard policy.");
  if (reg.optimizer_per_rank && s.meta.contains("partition_bucket_cap_mb")) {
    // Each rank's optimizer file holds its chunks of the gradient buckets.
    const auto cap = json_field<double>(s.meta, "partition_bucket_cap_mb", state_file);
    ACCEL_CHECK(cap == reg.partition_bucket_cap_mb, "accel: the checkpoint '", dir.string(),
                "' holds sharded optimizer state partitioned by buckets of ", cap,
                " MB, and this run's bucket_cap_mb is ", reg.partition_bucket_cap_mb,
                ", which splits the parameters differently. Resume with "
                "AcceleratorOptions::bucket_cap_mb = ", cap, ".");
  }

  // Every missing file at once.
  std::vector<std::string> files = main_files(reg);
  for (auto& f : own_files(reg, rank)) files.push_back(std::move(f));
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto& f : files)
    if (!fs::is_regular_file(dir / f, ec)) missing.push_back(f);
  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    const auto skipped = s.meta.find("models_skipped");
    const bool skipped_at_save = skipped != s.meta.end() && skipped->is_array() &&
                                 std::find(skipped->begin(), skipped->end(), i) != skipped->end();
    ACCEL_CHECK(!skipped_at_save || reg.models_skipped.count(i), "accel: the checkpoint '", dir.string(),
                "' holds no file for model ", i, ": a save_state pre-hook took it out when it was "
                "written (and saved it its own way). Register a load_state pre-hook that erases "
                "it from the list and loads it the same way.");
  }
  ACCEL_CHECK(missing.empty(), "accel: the checkpoint '", dir.string(), "' lacks ", list(missing),
              ". Load a directory written completely by save_state().");

  // The checksums save_state recorded (none in checkpoints written before it recorded them).
  std::optional<Checksums> sums;
  if (const auto it = s.meta.find("xxh64"); it != s.meta.end()) {
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
    const std::string name = indexed_name("model", i, ".safetensors");
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
    const std::string name = optimizer_file(reg, i, rank);
    load_archive(s.optimizers[i], dir / name, expected(name), reg.state->device);
  }
  s.schedulers.resize(reg.schedulers.size());
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) {
    const std::string name = indexed_name("scheduler", i, ".pt");
    load_archive(s.schedulers[i], dir / name, expected(name));
  }
  s.custom.resize(reg.custom.size());
  for (std::size_t i = 0; i < reg.custom.size(); ++i) {
    const std::string name = "custom_checkpoint_" + std::to_string(i) + ".pt";
    load_archive(s.custom[i], dir / name, expected(name));
  }
  s.comm_hooks.resize(hooks);
  for (std::size_t i = 0; i < hooks; ++i) {
    const std::string name = comm_hook_file(i, rank);
    load_archive(s.comm_hooks[i], dir / name, expected(name), reg.state->device);
  }
  {
    const fs::path f = dir / random_states_file(rank);
    torch::serialize::InputArchive rng;
    load_archive(rng, f, expected(random_states_file(rank)));
    s.generators = GeneratorStates::read(rng, f);
  }
  {
    const fs::path f = dir / loaders_file(rank);
    const auto j = read_json(f, expected(loaders_file(rank)));
    const auto list_j = j.find("loaders");
    ACCEL_CHECK(list_j != j.end() && list_j->is_array() && list_j->size() == reg.loaders.size(),
                "accel: the checkpoint file '", f.string(), "' does not hold ", reg.loaders.size(),
                " loader positions. Load a directory written completely by save_state().");
    for (const auto& l : *list_j) {
      data::LoaderCheckpoint c{json_field<int64_t>(l, "epoch", f), json_field<int64_t>(l, "batches_yielded", f)};
      ACCEL_CHECK(c.batches_yielded >= 0 && c.epoch >= 0, "accel: the checkpoint file '", f.string(),
                  "' holds a negative loader position. Save the checkpoint again.");
      s.loaders.push_back(c);
    }
  }
  if (reg.scaler) {
    const fs::path f = dir / "scaler.json";
    const auto j = read_json(f, expected("scaler.json"));
    s.scaler.emplace(json_field<double>(j, "scale", f), json_field<int64_t>(j, "growth_tracker", f));
    ACCEL_CHECK(s.scaler->first > 0 && s.scaler->second >= 0, "accel: '", f.string(),
                "' holds an invalid loss scale. Save the checkpoint again.");
  }
  json_field<int64_t>(s.meta, "micro_step", state_file);
  json_field<int64_t>(s.meta, "optimizer_steps", state_file);
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
