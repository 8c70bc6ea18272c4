// SPDX-License-Identifier: Apache-2.0
/// @file Defines the names of save_state's files, the listing of automatic
/// checkpoints, the agreement of the processes on success, and what each
/// process writes.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP

#include <accel/checkpoint/detail/state_files.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/checkpoint/save_model.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::ckpt {

inline constexpr std::string_view kStateFile = "accel_state.json";
inline constexpr std::string_view kStateFormat = "accel.save_state";
inline constexpr int kStateFormatVersion = 1;

namespace detail {

/// "model.safetensors", "model_1.safetensors", ...
inline std::string indexed_name(const char* stem, std::size_t i, const char* ext) {
  return std::string(stem) + (i == 0 ? "" : "_" + std::to_string(i)) + ext;
}

/// Automatic checkpoints (ProjectConfiguration::automatic_checkpoint_naming)
/// are directories checkpoint_<N> under <project_dir>/checkpoints.
inline constexpr std::string_view kCheckpointPrefix = "checkpoint_";
inline std::string checkpoint_dir_name(int64_t n) {
  return std::string(kCheckpointPrefix) + std::to_string(n);
}

/// The checkpoint number of a directory named checkpoint_<N>.
inline std::optional<int64_t> checkpoint_number(const std::string& name) {
  if (name.size() <= kCheckpointPrefix.size() || name.compare(0, kCheckpointPrefix.size(), kCheckpointPrefix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(kCheckpointPrefix.size());
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
inline int failed_rank(runtime::Communicator& comm, bool ok) {
  float mine = ok ? 0.f : static_cast<float>(comm.rank() + 1);
  if (comm.size() > 1) {
    auto t = torch::full({1}, mine, torch::TensorOptions().device(comm.device()));
    comm.all_reduce(t, runtime::ReduceOp::Max)->wait();
    mine = t.to(torch::kCPU).item<float>();
  }
  return static_cast<int>(mine) - 1;
}

/// Rethrows this process's error, or throws if another process failed.
inline void agree(runtime::Communicator& comm, const std::exception_ptr& err, const char* what,
                  const char* consequence) {
  const int failed = failed_rank(comm, err == nullptr);
  if (err) std::rethrow_exception(err);
  if (failed >= 0)
    throw Error(accel::detail::concat("accel: ", what, " failed on process ", failed, " ",
                                      accel::detail::kFailedElsewhere, "; ", consequence,
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

// --- The layout: one table of file names and keys for the writer
// (write_process_files, save_state) and the reader (read_state,
// load_latest_state). Renaming an entry breaks old checkpoints. ---

inline std::string model_file(std::size_t i) { return indexed_name("model", i, ".safetensors"); }
inline std::string optimizer_file(std::size_t i, int rank, bool per_rank) {
  return per_rank ? indexed_name("optimizer", i, ("_rank" + std::to_string(rank) + ".pt").c_str())
                  : indexed_name("optimizer", i, ".pt");
}
inline std::string scheduler_file(std::size_t i) { return indexed_name("scheduler", i, ".pt"); }
inline std::string custom_file(std::size_t i) { return "custom_checkpoint_" + std::to_string(i) + ".pt"; }
inline constexpr const char* kScalerFile = "scaler.json";
inline std::string random_states_file(int rank) { return "random_states_" + std::to_string(rank) + ".pt"; }
inline std::string loaders_file(int rank) { return "loaders_" + std::to_string(rank) + ".json"; }
inline std::string comm_hook_file(std::size_t i, int rank) {
  return indexed_name("comm_hook", i, ("_rank" + std::to_string(rank) + ".pt").c_str());
}

/// The keys of accel_state.json (kStateFile), of the loaders_<rank>.json
/// files and of scaler.json.
namespace key {
inline constexpr const char *format = "format", *format_version = "format_version",
                            *accel_version = "accel_version", *world_size = "world_size",
                            *micro_step = "micro_step", *optimizer_steps = "optimizer_steps",
                            *checkpoint_iteration = "checkpoint_iteration", *models = "models",
                            *models_skipped = "models_skipped", *optimizers = "optimizers",
                            *optimizer_per_rank = "optimizer_per_rank",
                            *partition_bucket_cap_mb = "partition_bucket_cap_mb",
                            *shards_optimizer_state = "shards_optimizer_state",
                            *partitions = "partitions", *schedulers = "schedulers",
                            *loaders = "loaders", *custom_objects = "custom_objects",
                            *comm_hook_states = "comm_hook_states", *loss_scaler = "loss_scaler",
                            *checksums = "xxh64";
// partitions[i]
inline constexpr const char *bucket_numel = "bucket_numel", *bucket_group = "bucket_group",
                            *groups = "groups";
// loaders_<rank>.json: {rank, loaders: [{epoch, batches_yielded, samples_per_step}]}
inline constexpr const char *rank = "rank", *epoch = "epoch", *batches_yielded = "batches_yielded",
                            *samples_per_step = "samples_per_step";
// scaler.json
inline constexpr const char *scale = "scale", *growth_tracker = "growth_tracker";
}  // namespace key

// --- end of the layout ---

/// The prepared optimizers' save/load closures, in prepare() order.
inline std::vector<Archived> optimizer_states(const StateRegistry& reg) {
  std::vector<Archived> out;
  for (const auto& opt : reg.optimizers) out.push_back(archived(*opt));
  return out;
}

/// The state of the prepared models' communication hooks that keep some
/// (CommHook::PowerSGD: its step, error feedback and Qs differ per process),
/// in prepare order; one file per hook and process.
inline std::vector<Archived> comm_hook_states(const StateRegistry& reg) {
  std::vector<Archived> out;
  for (const auto& sync : reg.state->syncs)
    if (auto* hook = sync->comm_hook(); hook && hook->has_state())
      out.push_back(Archived{[hook](torch::serialize::OutputArchive& a) { hook->save(a); },
                             [hook](torch::serialize::InputArchive& a) { hook->load(a); }});
  return out;
}

/// Clears StateRegistry::models_skipped when a save or load ends, however it ends.
class SkippedModels {
 public:
  explicit SkippedModels(StateRegistry& reg) : reg_(reg) { reg_.models_skipped.clear(); }
  SkippedModels(const SkippedModels&) = delete;
  SkippedModels& operator=(const SkippedModels&) = delete;
  ~SkippedModels() { reg_.models_skipped.clear(); }

 private:
  StateRegistry& reg_;
};

/// The files the main process writes and every process reads.
inline std::vector<std::string> main_files(const StateRegistry& reg) {
  std::vector<std::string> files;
  for (std::size_t i = 0; i < reg.models.size(); ++i)
    if (!reg.models_skipped.count(i)) files.push_back(model_file(i));
  if (!reg.optimizer_per_rank)
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) files.push_back(optimizer_file(i, 0, reg.optimizer_per_rank));
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) files.push_back(scheduler_file(i));
  for (std::size_t i = 0; i < reg.custom.size(); ++i)
    files.push_back(custom_file(i));
  if (reg.scaler) files.push_back(kScalerFile);
  return files;
}

/// The files process `rank` writes and reads itself; as many on every process.
inline std::vector<std::string> own_files(const StateRegistry& reg, int rank) {
  std::vector<std::string> files;
  if (reg.optimizer_per_rank)
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) files.push_back(optimizer_file(i, rank, reg.optimizer_per_rank));
  files.push_back(random_states_file(rank));
  files.push_back(loaders_file(rank));
  for (std::size_t i = 0; i < comm_hook_states(reg).size(); ++i) files.push_back(comm_hook_file(i, rank));
  return files;
}

/// File name -> XXH64, as accel_state.json's "xxh64" records them: of the
/// whole file, except for .safetensors files: of their data buffer (the value
/// their header's accel.data_xxh64 holds too).
using Checksums = std::map<std::string, std::uint64_t>;

/// This process's files of a checkpoint, into stage; returns their checksums.
inline Checksums write_process_files(StateRegistry& reg, const fs::path& stage, int rank) {
  const bool main = rank == 0;
  Checksums sums;
  if (main) {
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      if (reg.models_skipped.count(i)) continue;  // a save_state pre-hook saves it
      const std::string name = model_file(i);
      sums[name] = save_safetensors(stage / name, module_state(*reg.models[i]));
      crash_point("writing");
    }
  }
  const auto archive_all = [&](const std::vector<Archived>& items, auto name_of) {
    for (std::size_t i = 0; i < items.size(); ++i) {
      torch::serialize::OutputArchive out;
      items[i].save(out);
      const std::string name = name_of(i);
      sums[name] = save_archive(out, stage / name);
    }
  };
  if (main || reg.optimizer_per_rank)
    archive_all(optimizer_states(reg), [&](std::size_t i) { return optimizer_file(i, rank, reg.optimizer_per_rank); });
  archive_all(comm_hook_states(reg), [&](std::size_t i) { return comm_hook_file(i, rank); });
  if (main) {
    archive_all(reg.schedulers, scheduler_file);
    archive_all(reg.custom, custom_file);
    if (reg.scaler)
      sums[kScalerFile] = write_json(stage / kScalerFile, {{key::scale, reg.scaler->scale()},
                                                           {key::growth_tracker, reg.scaler->growth_tracker()}});
  }
  torch::serialize::OutputArchive rng;
  save_generators(rng);
  sums[random_states_file(rank)] = save_archive(rng, stage / random_states_file(rank));
  crash_point("writing");
  nlohmann::json loaders = nlohmann::json::array();
  for (const auto& l : reg.loaders) {
    const auto c = l.position();
    loaders.push_back({{key::epoch, c.epoch}, {key::batches_yielded, c.batches_yielded},
                       {key::samples_per_step, l.samples_per_step()}});
  }
  sums[loaders_file(rank)] = write_json(stage / loaders_file(rank), {{key::rank, rank}, {key::loaders, loaders}});
  return sums;
}

/// Every process's checksums, on every process: one all-reduce (sum) of a
/// [processes, own files] table in which each process fills its own row.
inline Checksums gather_checksums(StateRegistry& reg, Checksums mine) {
  auto& comm = *reg.state->comm;
  const int world = comm.size();
  if (world == 1) return mine;
  const auto count = static_cast<int64_t>(own_files(reg, 0).size());
  auto table = torch::zeros({world, count}, torch::kLong);
  {
    const auto names = own_files(reg, comm.rank());
    auto row = table[comm.rank()];
    for (int64_t j = 0; j < count; ++j)
      row[j] = std::bit_cast<int64_t>(mine.at(names[static_cast<std::size_t>(j)]));
  }
  table = table.to(comm.device());
  comm.all_reduce(table, runtime::ReduceOp::Sum)->wait();
  table = table.to(torch::kCPU);
  for (int r = 0; r < world; ++r) {
    const auto names = own_files(reg, r);
    for (int64_t j = 0; j < count; ++j)
      mine[names[static_cast<std::size_t>(j)]] = std::bit_cast<std::uint64_t>(table[r][j].item<int64_t>());
  }
  return mine;
}

/// The buckets each optimizer's partitions follow (shard policies that
/// partition optimizer state; null where they are not known), so that
/// another number of processes can re-partition the state.
inline nlohmann::json partitions_json(const StateRegistry& reg) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& p : reg.partitions) {
    if (p.whole.groups.empty()) {
      out.push_back(nullptr);
      continue;
    }
    out.push_back({{key::bucket_numel, p.whole.bucket_numel},
                   {key::bucket_group, p.whole.bucket_group},
                   {key::groups, p.whole.groups.size()}});
  }
  return out;
}

inline nlohmann::json checksums_json(const Checksums& sums) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, sum] : sums) j[name] = to_hex(sum);
  return j;
}

}  // namespace detail
}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP
