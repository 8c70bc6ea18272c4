// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::checkpoint::save_state/load_state, the machinery of
/// Accelerator::save_state()/load_state(): the whole training state in one
/// directory, written atomically by every process, read back exactly.
///
/// Directory layout (docs/checkpoints.md has the details):
///
///   accel_state.json          main   format, accel version, world size, step
///                                    counters, how many of each kind, automatic
///                                    checkpoint number; written last
///   model.safetensors         main   prepared model 0 (model_1.safetensors, ...)
///   optimizer.pt              main   optimizer 0, torch archive (optimizer_1.pt, ...;
///                                    optimizer_rank<r>.pt per process when the
///                                    shard policy partitions optimizer state)
///   scheduler.pt              main   scheduler 0 (scheduler_1.pt, ...)
///   custom_checkpoint_<i>.pt  main   objects given to register_for_checkpointing
///   scaler.json               main   loss scale and growth tracker (Fp16 only)
///   random_states_<r>.pt      each   CPU, CUDA and accel::std_generator() states
///   loaders_<r>.json          each   epoch and batches yielded of every prepared loader
///
/// Atomicity: everything goes to <dir>.accel-tmp first (each file fsynced),
/// the processes agree that all files are in, then the main process renames
/// the directory into place (see detail::commit_directory). A process killed
/// at any point leaves the previous checkpoint complete and loadable.
/// Loading validates every file on every process, and the processes agree,
/// before anything is changed; objects restored through torch archives are
/// rolled back if one of them still fails.
#ifndef ACCEL_CHECKPOINT_SAVE_STATE_HPP
#define ACCEL_CHECKPOINT_SAVE_STATE_HPP

#include <accel/checkpoint/detail/state_files.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/checkpoint/save_model.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/version.hpp>

#include <algorithm>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::checkpoint {

inline constexpr std::string_view kStateFile = "accel_state.json";
inline constexpr std::string_view kStateFormat = "accel.save_state";
inline constexpr int kStateFormatVersion = 1;

namespace detail {

/// "model.safetensors", "model_1.safetensors", ...
inline std::string indexed_name(const char* stem, std::size_t i, const char* ext) {
  return std::string(stem) + (i == 0 ? "" : "_" + std::to_string(i)) + ext;
}

/// The checkpoint number of a directory named checkpoint_<N>.
inline std::optional<int64_t> checkpoint_number(const std::string& name) {
  constexpr std::string_view prefix = "checkpoint_";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      }))
    return std::nullopt;
  return std::stoll(digits);
}

/// The complete automatic checkpoints under base, oldest first.
inline std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& base) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(base, ec))
    if (auto n = checkpoint_number(e.path().filename().string()); n && e.is_directory(ec))
      out.emplace_back(*n, e.path());
  std::sort(out.begin(), out.end());
  return out;
}

inline fs::path checkpoints_base(const AcceleratorOptions& o, const char* caller) {
  ACCEL_CHECK(o.project_dir.has_value(), "accel: ", caller,
              "() without a directory needs AcceleratorOptions::project_dir (checkpoints go to "
              "project_dir/checkpoints/checkpoint_<N>). Pass a directory, or set project_dir.");
  return fs::path(*o.project_dir) / "checkpoints";
}

/// Every process says whether its part worked (one all-reduce MAX); returns
/// the highest failing rank, or -1 when all succeeded.
inline int failed_rank(StateRegistry& reg, bool ok) {
  auto& comm = *reg.state->comm;
  float mine = ok ? 0.f : static_cast<float>(comm.rank() + 1);
  if (comm.size() > 1) {
    const torch::Device dev = comm.backend_name() == "Nccl" ? reg.state->device : torch::kCPU;
    auto t = torch::full({1}, mine, torch::kFloat).to(dev);
    comm.all_reduce(t, runtime::ReduceOp::Max)->wait();
    mine = t.to(torch::kCPU).item<float>();
  }
  return static_cast<int>(mine) - 1;
}

/// Rethrows this process's error, or throws if another process failed.
inline void agree(StateRegistry& reg, const std::exception_ptr& err, const char* what,
                  const char* consequence) {
  const int failed = failed_rank(reg, err == nullptr);
  if (err) std::rethrow_exception(err);
  if (failed >= 0)
    throw Error(accel::detail::concat("accel: ", what, " failed on process ", failed,
                                      " (its own error says why); ", consequence,
                                      ". Fix the cause reported by that process and retry."));
}
inline constexpr const char* kSaveKept = "the previous checkpoint is untouched";
inline constexpr const char* kLoadKept = "nothing was loaded on this process";

/// dir without a trailing separator, so that dir.accel-tmp is a sibling.
inline fs::path normal_dir(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

inline std::string optimizer_file(const StateRegistry& reg, std::size_t i, int rank) {
  return reg.optimizer_per_rank
             ? indexed_name("optimizer", i, ("_rank" + std::to_string(rank) + ".pt").c_str())
             : indexed_name("optimizer", i, ".pt");
}

/// This process's files of a checkpoint, into stage.
inline void write_process_files(StateRegistry& reg, const fs::path& stage, int rank) {
  const bool main = rank == 0;
  if (main) {
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      save_safetensors(stage / indexed_name("model", i, ".safetensors"), module_state(*reg.models[i]));
      crash_point("writing");
    }
  }
  const auto archive_all = [&](const std::vector<Archived>& items, auto name_of) {
    for (std::size_t i = 0; i < items.size(); ++i) {
      torch::serialize::OutputArchive out;
      items[i].save(out);
      save_archive(out, stage / name_of(i));
    }
  };
  if (main || reg.optimizer_per_rank)
    archive_all(reg.optimizers, [&](std::size_t i) { return optimizer_file(reg, i, rank); });
  if (main) {
    archive_all(reg.schedulers, [](std::size_t i) { return indexed_name("scheduler", i, ".pt"); });
    archive_all(reg.custom, [](std::size_t i) {
      return "custom_checkpoint_" + std::to_string(i) + ".pt";
    });
    if (reg.scaler)
      write_json(stage / "scaler.json", {{"scale", reg.scaler->scale()},
                                         {"growth_tracker", reg.scaler->growth_tracker()}});
  }
  torch::serialize::OutputArchive rng;
  save_generators(rng);
  save_archive(rng, stage / ("random_states_" + std::to_string(rank) + ".pt"));
  crash_point("writing");
  nlohmann::json loaders = nlohmann::json::array();
  for (const auto& l : reg.loaders) {
    const auto c = l.position();
    loaders.push_back({{"epoch", c.epoch}, {"batches_yielded", c.batches_yielded}});
  }
  write_json(stage / ("loaders_" + std::to_string(rank) + ".json"),
             {{"rank", rank}, {"loaders", loaders}});
}

/// Keys, shapes and dtypes of a saved model against the module; the error
/// lists every offending key.
inline void check_model(const NamedTensors& loaded, const torch::nn::Module& module,
                        const fs::path& source) {
  std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> expected;
  for (const auto& [key, target] : module_state(module)) {
    expected.insert(key);
    const auto it = by_name.find(key);
    if (it == by_name.end()) {
      missing.push_back(key);
    } else if (it->second.sizes() != target.sizes() ||
               it->second.scalar_type() != target.scalar_type()) {
      std::ostringstream why;
      why << key << " (checkpoint " << it->second.scalar_type() << it->second.sizes() << ", model "
          << target.scalar_type() << target.sizes() << ")";
      mismatched.push_back(why.str());
    }
  }
  for (const auto& entry : loaded)
    if (expected.count(entry.first) == 0) unexpected.push_back(entry.first);
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return;
  std::string problem;
  if (!missing.empty()) problem += "; missing keys " + list(missing);
  if (!unexpected.empty()) problem += "; unexpected keys " + list(unexpected);
  if (!mismatched.empty()) problem += "; mismatched keys " + list(mismatched);
  throw Error("accel: cannot load '" + source.string() + "' into the prepared model" + problem +
              ". Nothing was loaded: load a checkpoint saved from the same model.");
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
  std::vector<torch::serialize::InputArchive> optimizers, schedulers, custom;
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
  ACCEL_CHECK(json_field<bool>(s.meta, "loss_scaler", state_file) == (reg.scaler != nullptr),
              "accel: the checkpoint '", dir.string(), "' was saved ",
              reg.scaler ? "without" : "with", " a loss scaler (precision::Fp16) and this "
              "Accelerator runs ", reg.scaler ? "with" : "without",
              " one. Resume with the same precision policy.");
  ACCEL_CHECK(json_field<bool>(s.meta, "optimizer_per_rank", state_file) == reg.optimizer_per_rank,
              "accel: the checkpoint '", dir.string(), "' was saved with another shard policy "
              "(optimizer state per process or not). Resume with the same shard policy.");

  // Every missing file at once.
  std::vector<std::string> files;
  for (std::size_t i = 0; i < reg.models.size(); ++i) files.push_back(indexed_name("model", i, ".safetensors"));
  for (std::size_t i = 0; i < reg.optimizers.size(); ++i) files.push_back(optimizer_file(reg, i, rank));
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) files.push_back(indexed_name("scheduler", i, ".pt"));
  for (std::size_t i = 0; i < reg.custom.size(); ++i)
    files.push_back("custom_checkpoint_" + std::to_string(i) + ".pt");
  if (reg.scaler) files.push_back("scaler.json");
  files.push_back("random_states_" + std::to_string(rank) + ".pt");
  files.push_back("loaders_" + std::to_string(rank) + ".json");
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto& f : files)
    if (!fs::is_regular_file(dir / f, ec)) missing.push_back(f);
  ACCEL_CHECK(missing.empty(), "accel: the checkpoint '", dir.string(), "' lacks ", list(missing),
              ". Load a directory written completely by save_state().");

  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    const fs::path f = dir / indexed_name("model", i, ".safetensors");
    s.models.push_back(load_safetensors(f));
    check_model(s.models.back(), *reg.models[i], f);
  }
  s.optimizers.resize(reg.optimizers.size());
  for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
    const fs::path f = dir / optimizer_file(reg, i, rank);
    std::error_code e;
    ACCEL_CHECK(fs::is_regular_file(f, e), "accel: the checkpoint file '", f.string(), "' is missing.");
    try {
      s.optimizers[i].load_from(f.string(), reg.state->device);
    } catch (const c10::Error& err) {
      throw Error(accel::detail::concat("accel: the checkpoint file '", f.string(),
                                        "' is truncated or corrupt (", err.what_without_backtrace(),
                                        "). Load another checkpoint, or save this one again."));
    }
  }
  s.schedulers.resize(reg.schedulers.size());
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i)
    load_archive(s.schedulers[i], dir / indexed_name("scheduler", i, ".pt"));
  s.custom.resize(reg.custom.size());
  for (std::size_t i = 0; i < reg.custom.size(); ++i)
    load_archive(s.custom[i], dir / ("custom_checkpoint_" + std::to_string(i) + ".pt"));
  {
    const fs::path f = dir / ("random_states_" + std::to_string(rank) + ".pt");
    torch::serialize::InputArchive rng;
    load_archive(rng, f);
    s.generators = GeneratorStates::read(rng, f);
  }
  {
    const fs::path f = dir / ("loaders_" + std::to_string(rank) + ".json");
    const auto j = read_json(f);
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
    const auto j = read_json(f);
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
    torch::serialize::OutputArchive snap;
    target.save(snap);
    std::ostringstream bytes;
    snap.save_to(bytes);
    done_.push_back({&target, bytes.str()});
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
        std::istringstream bytes(it->second);
        torch::serialize::InputArchive in;
        in.load_from(bytes);
        it->first->load(in);
      } catch (...) {  // best effort: the snapshot was taken from this very object
      }
    }
    done_.clear();
  }

 private:
  std::vector<std::pair<const Archived*, std::string>> done_;
};

}  // namespace detail

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
  fs::path base;
  fs::path target;
  if (automatic) {
    base = checkpoints_base(options, "save_state");
    ACCEL_CHECK(!options.total_limit || *options.total_limit >= 1,
                "accel: AcceleratorOptions::total_limit must be at least 1 (got ",
                options.total_limit.value_or(0), "). Leave it unset to keep every checkpoint.");
    target = base / ("checkpoint_" + std::to_string(reg.checkpoint_iteration));
  } else {
    target = normal_dir(*dir);
  }
  const fs::path stage = target.string() + ".accel-tmp";
  reg.state->finalize_gradients();

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
  agree(reg, err, "save_state (creating the directory)", kSaveKept);

  try {
    write_process_files(reg, stage, rank);
  } catch (...) {
    err = std::current_exception();
  }
  agree(reg, err, "save_state (writing the files)", kSaveKept);

  if (main) {
    try {
      nlohmann::json meta = {
          {"format", std::string(kStateFormat)},
          {"format_version", kStateFormatVersion},
          {"accel_version", version_string},
          {"world_size", comm.size()},
          {"micro_step", reg.state->micro_step},
          {"optimizer_steps", reg.state->optimizer_steps},
          {"checkpoint_iteration", automatic ? nlohmann::json(reg.checkpoint_iteration) : nlohmann::json()},
          {"models", reg.models.size()},
          {"optimizers", reg.optimizers.size()},
          {"optimizer_per_rank", reg.optimizer_per_rank},
          {"schedulers", reg.schedulers.size()},
          {"loaders", reg.loaders.size()},
          {"custom_objects", reg.custom.size()},
          {"loss_scaler", reg.scaler != nullptr}};
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
    }
  }
  agree(reg, err, "save_state (committing the directory)", kSaveKept);
  if (automatic) ++reg.checkpoint_iteration;
  return target;
}

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
    s = read_state(reg, readable_checkpoint(target));
  } catch (...) {
    err = std::current_exception();
  }
  agree(reg, err, "load_state (reading the checkpoint)", kLoadKept);

  ArchiveTransaction tx;
  try {
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i)
      tx.apply(reg.optimizers[i], s.optimizers[i], "optimizer", i);
    for (std::size_t i = 0; i < reg.schedulers.size(); ++i)
      tx.apply(reg.schedulers[i], s.schedulers[i], "scheduler", i);
    for (std::size_t i = 0; i < reg.custom.size(); ++i)
      tx.apply(reg.custom[i], s.custom[i], "registered object", i);
  } catch (...) {
    err = std::current_exception();
  }
  if (failed_rank(reg, err == nullptr) >= 0) {
    tx.rollback();
    agree(reg, err, "load_state (restoring optimizers, schedulers and registered objects)",
          kLoadKept);
  }

  // Validated above: nothing below can fail.
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      std::map<std::string, torch::Tensor> by_name(s.models[i].begin(), s.models[i].end());
      for (auto& [key, t] : module_state(*reg.models[i])) {
        torch::Tensor target_tensor = t;
        target_tensor.copy_(by_name.at(key));
      }
    }
  }
  if (reg.scaler) reg.scaler->load(s.scaler->first, s.scaler->second);
  s.generators.apply();
  reg.state->micro_step = s.meta.at("micro_step").get<int64_t>();
  reg.state->optimizer_steps = s.meta.at("optimizer_steps").get<int64_t>();
  for (auto& seen : reg.scheduler_seen_steps) *seen = reg.state->optimizer_steps;
  for (std::size_t i = 0; i < reg.loaders.size(); ++i) reg.loaders[i].restore(s.loaders[i]);
  if (number) {
    reg.checkpoint_iteration = *number + 1;
  } else if (const auto it = s.meta.find("checkpoint_iteration");
             it != s.meta.end() && it->is_number_integer()) {
    reg.checkpoint_iteration = it->get<int64_t>() + 1;
  }
  return target;
}

}  // namespace accel::checkpoint

#endif  // ACCEL_CHECKPOINT_SAVE_STATE_HPP
