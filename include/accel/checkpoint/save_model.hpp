// SPDX-License-Identifier: Apache-2.0
/// @file Defines the file side of save_model: a module's parameters and
/// buffers to safetensors shards plus Hugging Face's index, and back into a
/// module (its options, SaveModelOptions, are in accel/options.hpp).
#ifndef ACCEL_CHECKPOINT_SAVE_MODEL_HPP
#define ACCEL_CHECKPOINT_SAVE_MODEL_HPP

#include <accel/checkpoint/detail/file_io.hpp>
#include <accel/checkpoint/safetensors.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace accel::ckpt {

inline constexpr std::string_view kModelFile = "model.safetensors";
inline constexpr std::string_view kIndexFile = "model.safetensors.index.json";
/// Metadata key (every shard's and the index's) naming the save_model call
/// that wrote them: load_index refuses shards of another save.
inline constexpr std::string_view kSaveIdKey = "accel_save_id";

/// Bytes meant by a size string such as "10GB" (see SaveModelOptions).
inline std::uint64_t parse_size(std::string_view text) {
  const auto bad = [&](const char* why) {
    return Error(accel::detail::concat("accel: max_shard_size '", text, "' ", why,
                                       ". Write a positive size such as \"10GB\", \"500MB\", "
                                       "\"2GiB\" or a number of bytes."));
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  const auto ends_with_ci = [&](std::string_view suffix) {
    if (s.size() < suffix.size()) return false;
    for (std::size_t i = 0; i < suffix.size(); ++i)
      if (std::toupper(static_cast<unsigned char>(s[s.size() - suffix.size() + i])) != suffix[i])
        return false;
    return true;
  };
  long double unit = 1;
  std::size_t unit_len = 0;
  static constexpr std::pair<std::string_view, long double> kUnits[] = {
      {"GIB", 1073741824.0L}, {"MIB", 1048576.0L}, {"KIB", 1024.0L},
      {"GB", 1e9L}, {"MB", 1e6L}, {"KB", 1e3L}};
  for (const auto& [suffix, factor] : kUnits) {
    if (ends_with_ci(suffix)) {
      unit = factor;
      unit_len = suffix.size();
      break;
    }
  }
  const bool bits = unit_len == 2 && s.back() == 'b';  // Accelerate: "Gb" etc. are bits
  std::string_view number = s.substr(0, s.size() - unit_len);
  while (!number.empty() && std::isspace(static_cast<unsigned char>(number.back())))
    number.remove_suffix(1);
  // Digits with at most one decimal point: no sign, exponent, inf or nan.
  long double value = 0, scale = 1;
  bool digits = false, point = false;
  for (const char c : number) {
    if (c == '.' && !point && unit_len != 0) {
      point = true;
    } else if (c >= '0' && c <= '9') {
      digits = true;
      if (point) value += (scale /= 10) * (c - '0');
      else value = value * 10 + (c - '0');
    } else {
      throw bad("is not a size");
    }
  }
  if (!digits) throw bad("is not a size");
  long double bytes = value * unit;
  if (bits) bytes /= 8;
  if (bytes >= 9.2e18L) throw bad("is too large");
  const auto result = static_cast<std::uint64_t>(bytes);
  if (result == 0) throw bad("is zero");
  return result;
}

/// The module's parameters and buffers under the names the module gives them
/// ("0.weight" in a Sequential), in state_dict order: each module's own
/// parameters, then its buffers, then its children.
inline NamedTensors module_state(const torch::nn::Module& module) {
  NamedTensors out;
  module.apply(torch::nn::Module::ConstNamedModuleApplyFunction(
      [&](const std::string& prefix, const torch::nn::Module& m) {
        const auto add = [&](const torch::OrderedDict<std::string, torch::Tensor>& dict) {
          for (const auto& item : dict)
            if (item.value().defined())
              out.emplace_back(prefix.empty() ? item.key() : prefix + "." + item.key(),
                               item.value());
        };
        add(m.named_parameters(/*recurse=*/false));
        add(m.named_buffers(/*recurse=*/false));
      }));
  return out;
}

namespace detail {

/// "model-00001-of-00003.safetensors"
inline std::string shard_name(std::size_t index, std::size_t count) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "model-%05zu-of-%05zu.safetensors", index, count);
  return buffer;
}

inline bool is_shard_name(std::string_view name) {
  if (name.size() != shard_name(1, 1).size()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const bool digit_slot = (i >= 6 && i < 11) || (i >= 15 && i < 20);
    const char expected = shard_name(1, 1)[i];
    if (digit_slot ? !std::isdigit(static_cast<unsigned char>(name[i])) : name[i] != expected)
      return false;
  }
  return true;
}

/// Where save_model writes a shard before the set is put in place.
inline std::string staging_name(const std::string& shard) { return "." + shard + ".accel-new"; }
inline bool is_staging_name(std::string_view name) {
  constexpr std::string_view suffix = ".accel-new";
  return name.size() > suffix.size() + 1 && name.front() == '.' &&
         name.substr(name.size() - suffix.size()) == suffix &&
         is_shard_name(name.substr(1, name.size() - suffix.size() - 1));
}

/// A save id: 16 hex digits, different for every save_model call.
inline std::string new_save_id() {
  std::random_device rd;
  const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32 ^ rd()) ^ now;
  char buffer[17];
  std::snprintf(buffer, sizeof buffer, "%016llx", static_cast<unsigned long long>(v));
  return buffer;
}

/// Greedy split in key order, as Accelerate/Hugging Face: a new shard starts
/// when the next tensor would push the current one past `limit` (a tensor
/// larger than the limit thus gets its own shard); a tensor tied to an earlier
/// one costs nothing and joins that one's shard, where it is saved once.
inline std::vector<NamedTensors> split_shards(const NamedTensors& state, std::uint64_t limit,
                                              std::uint64_t& total_size) {
  std::vector<NamedTensors> shards(1);
  const auto stored_index = ckpt::detail::stored_as(state);
  std::vector<std::size_t> shard_of(state.size());
  std::uint64_t current = 0;
  total_size = 0;
  for (std::size_t i = 0; i < state.size(); ++i) {
    const auto& entry = state[i];
    if (stored_index[i] != i) {  // tied: goes with the tensor it shares
      shard_of[i] = shard_of[stored_index[i]];
      shards[shard_of[i]].push_back(entry);
      continue;
    }
    const auto bytes =
        static_cast<std::uint64_t>(entry.second.numel()) * entry.second.element_size();
    if (current + bytes > limit && !shards.back().empty()) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(entry);
    shard_of[i] = shards.size() - 1;
    current += bytes;
    total_size += bytes;
  }
  return shards;
}

inline std::string read_small_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail_io("read", path, ec.value());
  ACCEL_CHECK(size <= ckpt::detail::kMaxHeaderBytes, "accel: index file '", path.string(),
              "' has ", size, " bytes, more than an index can need. Check the file.");
  std::string text(static_cast<std::size_t>(size), '\0');
  ckpt::detail::ReadFile(path).read_at(0, text.data(), text.size());
  return text;
}

/// Tensors of a Hugging Face index and its shards, checked against each other.
inline NamedTensors load_index(const std::filesystem::path& index_path) {
  const std::string source = index_path.string();
  const auto fail = [&](const std::string& problem) -> Error {
    return Error("accel: invalid safetensors index '" + source + "': " + problem +
                 ". Save the model again.");
  };
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_small_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("it is not valid JSON (") + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw fail("it has no \"weight_map\" object");
  std::vector<std::string> files;  // in order of first mention
  std::map<std::string, std::string> where;
  for (const auto& [key, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw fail("the entry of '" + key + "' is not a file name");
    const std::string name = file.get<std::string>();
    // Only plain names in the index's directory: an index must not reach elsewhere.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      throw fail("the file name '" + name + "' of '" + key + "' is not a plain file name");
    if (std::find(files.begin(), files.end(), name) == files.end()) files.push_back(name);
    where.emplace(key, name);
  }
  // Written by accel: every shard must come from the same save_model call.
  std::optional<std::string> save_id;
  if (index.contains("metadata") && index["metadata"].is_object() &&
      index["metadata"].contains(std::string(kSaveIdKey)) && index["metadata"][std::string(kSaveIdKey)].is_string())
    save_id = index["metadata"][std::string(kSaveIdKey)].get<std::string>();
  NamedTensors out;
  std::map<std::string, std::string> found;  // tensor -> file it came from
  for (const auto& name : files) {
    auto contents = read_safetensors(index_path.parent_path() / name);
    if (save_id) {
      const auto it = contents.metadata.find(std::string(kSaveIdKey));
      if (it == contents.metadata.end() || it->second != *save_id)
        throw fail("'" + name + "' was written by another save_model() than the index (save " +
                   (it == contents.metadata.end() ? std::string("unknown") : it->second) + ", index " +
                   *save_id + "): a save was interrupted while it put its files in place, or files "
                   "of two saves were copied together; loading would mix two models");
    }
    for (auto& entry : contents.tensors) {
      if (!found.emplace(entry.first, name).second)
        throw fail("tensor '" + entry.first + "' is in both '" + found[entry.first] + "' and '" +
                   name + "'");
      out.push_back(std::move(entry));
    }
  }
  for (const auto& [key, file] : where)
    if (found.count(key) == 0 || found[key] != file)
      throw fail("it places '" + key + "' in '" + file + "', which does not hold it");
  return out;
}

inline std::string list(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return "[" + out + "]";
}

/// Throws accel::Error, before anything is copied, when `loaded` and the
/// module's state `targets` differ: every missing, unexpected and mismatched
/// (shape or dtype) key listed. `what` names the module in the mismatches
/// ("model", "module"), `into` in the message ("the prepared model", ...).
inline void check_state_matches(const NamedTensors& loaded, const NamedTensors& targets,
                                const std::string& source, std::string_view what,
                                std::string_view into) {
  std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> expected;
  for (const auto& [key, target] : targets) {
    expected.insert(key);
    const auto it = by_name.find(key);
    if (it == by_name.end()) {
      missing.push_back(key);
    } else if (it->second.sizes() != target.sizes() ||
               it->second.scalar_type() != target.scalar_type()) {
      std::ostringstream why;
      why << key << " (checkpoint " << it->second.scalar_type() << it->second.sizes() << ", "
          << what << " " << target.scalar_type() << target.sizes() << ")";
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
  throw Error("accel: cannot load '" + source + "' into " + std::string(into) + problem +
              ". Nothing was loaded: load a checkpoint saved from the same model.");
}

}  // namespace detail

/// Every tensor of a checkpoint: a directory (holding model.safetensors or
/// model.safetensors.index.json), a .safetensors file or an index file.
inline NamedTensors load_checkpoint(const std::filesystem::path& dir_or_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(dir_or_file, ec)) {
    if (fs::exists(dir_or_file / kModelFile, ec)) return load_safetensors(dir_or_file / kModelFile);
    if (fs::exists(dir_or_file / kIndexFile, ec)) return detail::load_index(dir_or_file / kIndexFile);
    throw Error("accel: directory '" + dir_or_file.string() + "' holds neither " +
                std::string(kModelFile) + " nor " + std::string(kIndexFile) +
                ". Pass the directory save_model wrote to, or a .safetensors file.");
  }
  const std::string name = dir_or_file.filename().string();
  if (name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0)
    return detail::load_index(dir_or_file);
  return load_safetensors(dir_or_file);
}

namespace detail {

/// The tensors save_module stores (a tied tensor once), in the order it reads
/// their bytes: state order, which the split into shards keeps.
inline std::vector<torch::Tensor> read_order(const NamedTensors& state) {
  const auto stored_index = ckpt::detail::stored_as(state);
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < state.size(); ++i)
    if (stored_index[i] == i) out.push_back(state[i].second);
  return out;
}

/// save_module's files for `state`, shards of at most `limit` bytes.
inline void save_tensors(const NamedTensors& state, const std::filesystem::path& dir,
                         std::uint64_t limit, bool checksum, const BeforeRead& before_read) {
  namespace fs = std::filesystem;
  std::uint64_t total_size = 0;
  const auto shards = split_shards(state, limit, total_size);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Error("accel: cannot create the checkpoint directory '" + dir.string() + "': " +
                ec.message() + ". Pass a directory path that can be written.");

  std::set<std::string> written;
  if (shards.size() == 1) {
    save_safetensors(dir / kModelFile, shards[0], {}, checksum, before_read);
    written.insert(std::string(kModelFile));
  } else {
    // The shards are written under staging names first (a failure or a kill
    // while writing leaves the previous save whole), then renamed into place
    // and the index written last. All carry one save id, so a kill during
    // the renames is an error at load time, never a silent mix of two saves.
    const std::string save_id = new_save_id();
    nlohmann::json index = {{"metadata", {{"total_size", total_size}, {std::string(kSaveIdKey), save_id}}},
                            {"weight_map", nlohmann::json::object()}};
    std::vector<std::string> names;
    try {
      for (std::size_t i = 0; i < shards.size(); ++i) {
        names.push_back(shard_name(i + 1, shards.size()));
        save_safetensors(dir / staging_name(names.back()), shards[i],
                         {{std::string(kSaveIdKey), save_id}}, checksum, before_read);
      }
    } catch (...) {
      for (const auto& name : names) fs::remove(dir / staging_name(name), ec);
      throw;
    }
    for (const auto& name : names) {
      fs::rename(dir / staging_name(name), dir / name, ec);
      if (ec)
        throw Error("accel: save_model could not move '" + staging_name(name) + "' to '" + name +
                    "' in '" + dir.string() + "': " + ec.message() + ". The index was not written; "
                    "free the directory and save again.");
    }
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const std::string& name = names[i];
      written.insert(name);
      // Only stored tensors, as Hugging Face lists them; tied names live in
      // the shard's metadata.
      const auto stored_index = ckpt::detail::stored_as(shards[i]);
      for (std::size_t k = 0; k < shards[i].size(); ++k)
        if (stored_index[k] == k) index["weight_map"][shards[i][k].first] = name;
    }
    ckpt::detail::write_file_atomic(dir / kIndexFile, index.dump(2) + "\n");
    written.insert(std::string(kIndexFile));
  }
  // Files of an earlier save that this one did not rewrite would mix two
  // models at load time.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kModelFile || name == kIndexFile || is_shard_name(name) ||
                      is_staging_name(name);  // left by an interrupted save
    if (ours && written.count(name) == 0 && entry.is_regular_file(ec)) fs::remove(entry.path(), ec);
  }
}

}  // namespace detail

/// Saves module's parameters and buffers to dir (created if needed): one
/// model.safetensors, or model-0000i-of-0000N.safetensors shards plus
/// model.safetensors.index.json when they exceed options.max_shard_size.
/// Tied tensors are saved once; stale shards of an earlier save are removed.
inline void save_module(const torch::nn::Module& module, const std::filesystem::path& dir,
                        const SaveModelOptions& options = {}) {
  detail::save_tensors(module_state(module), dir, parse_size(options.max_shard_size),
                       options.checksum, {});
}

/// save_module run by every process of a job, where only `writes` writes and
/// each stored tensor becomes readable through a collective: make_readable
/// runs on every process for the same tensors in the same order (read_order),
/// the writer's calls just before it reads each one. A writer that fails still
/// makes its remaining calls, so that no process waits for it, and returns its
/// error, for the processes to agree on (a bad max_shard_size throws on all,
/// before any call).
inline std::exception_ptr save_module_collectively(const torch::nn::Module& module,
                                                   const std::filesystem::path& dir,
                                                   const SaveModelOptions& options, bool writes,
                                                   const BeforeRead& make_readable) {
  const std::uint64_t limit = parse_size(options.max_shard_size);
  const NamedTensors state = module_state(module);
  const auto order = detail::read_order(state);
  std::size_t next = 0;
  std::exception_ptr err;
  if (writes) {
    try {
      detail::save_tensors(state, dir, limit, options.checksum, [&](const torch::Tensor& t) {
        ACCEL_CHECK(next < order.size() && order[next].unsafeGetTensorImpl() == t.unsafeGetTensorImpl(),
                    "accel: internal error: save_model read tensor ", next, " out of order");
        ++next;
        make_readable(t);
      });
    } catch (...) {
      err = std::current_exception();
    }
  }
  for (; next < order.size(); ++next) make_readable(order[next]);
  return err;
}

/// Copies a checkpoint (see load_checkpoint) into module's existing
/// parameters and buffers. Missing or unexpected keys, or a shape or dtype
/// that differs, throw accel::Error listing every such key, before anything
/// is copied: the module is then left as it was.
inline void load_module(torch::nn::Module& module, const std::filesystem::path& dir_or_file) {
  const NamedTensors loaded = load_checkpoint(dir_or_file);
  const NamedTensors targets = module_state(module);
  detail::check_state_matches(loaded, targets, dir_or_file.string(), "module", "the module");
  std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
  torch::NoGradGuard no_grad;
  for (const auto& [key, target] : targets) {
    torch::Tensor t = target;  // shares the module's tensor
    t.copy_(by_name.at(key));
  }
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAVE_MODEL_HPP
