// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::LaunchConfig and the config file it is read from and
/// written to: default_config_path(), read_config_file(), write_config_file(),
/// write_basic_config(). The keys are Accelerate's, so an existing
/// `accelerate config` file is read as it is.
#ifndef ACCEL_LAUNCH_CONFIG_FILE_HPP
#define ACCEL_LAUNCH_CONFIG_FILE_HPP

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/launch/detail/config_keys.hpp>

#if ACCEL_WITH_CUDA
#include <torch/cuda.h>
#endif

namespace accel {

/// How the processes of a launch are laid out (Accelerate's distributed_type).
/// DEEPSPEED, FSDP and MEGATRON_LM are read as MultiGpu with a warning.
enum class DistributedType { No, MultiCpu, MultiGpu };

inline const char* distributed_type_name(DistributedType t) {
  switch (t) {
    case DistributedType::MultiCpu: return "MULTI_CPU";
    case DistributedType::MultiGpu: return "MULTI_GPU";
    default: return "NO";
  }
}

/// The contents of a config file. Defaults are Accelerate's ClusterConfig ones.
struct LaunchConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::No;
  std::optional<std::string> backend;  ///< accel's own key: gloo | mpi | nccl
  std::string mixed_precision = "no";  ///< no | fp16 | bf16
  bool use_cpu = false;
  bool debug = false;                  ///< exported as ACCEL_DEBUG_MODE=yes
  std::optional<int> num_processes;    ///< total over all machines; unset (or -1): default
  int num_machines = 1;
  int machine_rank = 0;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::string rdzv_backend = "static";
  bool same_network = false;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  bool downcast_bf16 = false;
  std::optional<std::string> gpu_ids;  ///< "all" or "0,1,..."
  int gradient_accumulation_steps = 1;

  std::filesystem::path source;        ///< the file it was read from (empty: defaults)
  std::vector<std::string> warnings;   ///< unknown and ignored keys, one message each
};

namespace detail::launch {
/// The keys a file holds for `c`: Accelerate's, plus accel's `backend` when set.
inline nlohmann::json to_json(const LaunchConfig& c) {
  nlohmann::json j;
  j["compute_environment"] = c.compute_environment;
  j["debug"] = c.debug;
  j["distributed_type"] = distributed_type_name(c.distributed_type);
  j["downcast_bf16"] = c.downcast_bf16;
  j["enable_cpu_affinity"] = c.enable_cpu_affinity;
  j["machine_rank"] = c.machine_rank;
  j["main_training_function"] = c.main_training_function;
  j["mixed_precision"] = c.mixed_precision;
  j["num_machines"] = c.num_machines;
  j["num_processes"] = c.num_processes.value_or(-1);
  j["rdzv_backend"] = c.rdzv_backend;
  j["same_network"] = c.same_network;
  j["use_cpu"] = c.use_cpu;
  if (c.backend) j["backend"] = *c.backend;
  if (c.gpu_ids) j["gpu_ids"] = *c.gpu_ids;
  if (c.main_process_ip) j["main_process_ip"] = *c.main_process_ip;
  if (c.main_process_port) j["main_process_port"] = *c.main_process_port;
  if (c.gradient_accumulation_steps != 1)
    j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  return j;
}
}  // namespace detail::launch

/// Where the config file lives: $ACCEL_CONFIG_FILE, else
/// $XDG_CONFIG_HOME/accel/default_config.yaml, else ~/.config/accel/default_config.yaml.
inline std::filesystem::path default_config_path() {
  auto env = [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
  if (auto f = env("ACCEL_CONFIG_FILE")) return *f;
  std::filesystem::path base;
  if (auto x = env("XDG_CONFIG_HOME")) {
    base = *x;
  } else if (auto h = env("HOME")) {
    base = std::filesystem::path(*h) / ".config";
  } else {
    throw ConfigError(
        "accel: cannot find a config directory: none of ACCEL_CONFIG_FILE, XDG_CONFIG_HOME, HOME "
        "is set. Set ACCEL_CONFIG_FILE or pass a path.");
  }
  return base / "accel" / "default_config.yaml";
}

/// Where `accelerate config` saves its file: $HF_HOME/accelerate/default_config.yaml,
/// HF_HOME defaulting to ${XDG_CACHE_HOME:-~/.cache}/huggingface.
inline std::optional<std::filesystem::path> accelerate_config_path() {
  auto env = [](const char* name) -> std::optional<std::filesystem::path> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::filesystem::path(v);
  };
  std::optional<std::filesystem::path> hf = env("HF_HOME");
  if (!hf) {
    if (auto cache = env("XDG_CACHE_HOME")) hf = *cache / "huggingface";
    else if (auto home = env("HOME")) hf = *home / ".cache" / "huggingface";
    else return std::nullopt;
  }
  return *hf / "accelerate" / "default_config.yaml";
}

/// The file `accel launch` and `accel env` use when given none:
/// default_config_path() when it exists, else Accelerate's own file when that
/// exists (so a machine set up with `accelerate config` needs nothing more),
/// else nullopt (built-in defaults).
inline std::optional<std::filesystem::path> config_file_in_effect() {
  if (auto own = default_config_path(); std::filesystem::exists(own)) return own;
  if (auto theirs = accelerate_config_path(); theirs && std::filesystem::exists(*theirs))
    return theirs;
  return std::nullopt;
}

/// Reads a YAML (or JSON: Accelerate writes JSON into .yaml files) config file.
/// Unknown keys and keys of features accel does not have are warnings
/// (collected in .warnings and written to `warn` unless it is null); a wrong
/// type or value is a ConfigError naming the key, its line and what is allowed.
inline LaunchConfig read_config_file(const std::filesystem::path& path,
                                     std::ostream* warn = &std::cerr) {
  if (!std::filesystem::exists(path))
    throw ConfigError("accel: config file " + path.string() +
                      " does not exist. Run `accel config` to create it or pass another path.");
  if (std::filesystem::is_directory(path))
    throw ConfigError("accel: config file " + path.string() +
                      " is a directory. Pass the YAML file itself (`accel config` writes " +
                      default_config_path().filename().string() + ").");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path.string());
  } catch (const YAML::Exception& e) {
    throw ConfigError("accel: " + path.string() + ":" + std::to_string(e.mark.line + 1) +
                      ": not valid YAML or JSON (" + e.msg + "). Fix the file or run `accel config`.");
  }
  LaunchConfig c;
  c.source = path;
  if (root.IsNull()) {  // Accelerate reads an empty file as all defaults: so do we, aloud
    c.warnings.push_back("accel: warning: " + path.string() +
                         " is empty; every setting takes its default.");
    if (warn != nullptr) *warn << c.warnings.back() << '\n';
    return c;
  }
  if (!root.IsMap())
    throw ConfigError("accel: " + path.string() +
                      ": the top level must be a mapping of keys to values. Run `accel config` to "
                      "write a valid file.");
  detail::launch::ConfigReader r{path.string(), c.warnings};
  std::map<std::string, int> seen;  // key -> line: YAML readers disagree on duplicates
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    const int line = kv.first.Mark().line + 1;
    if (const auto [it, fresh] = seen.emplace(key, line); !fresh)
      throw ConfigError("accel: " + path.string() + ":" + std::to_string(line) + ": key '" +
                        detail::launch::ConfigReader::clipped(key) + "' appears twice (lines " +
                        std::to_string(it->second) + " and " + std::to_string(line) +
                        "). Keep one of them.");
    if (v.IsNull()) continue;  // Accelerate drops None values; a null means "unset"
    if (key == "compute_environment") {
      c.compute_environment = r.choice(key, v, {"LOCAL_MACHINE", "AMAZON_SAGEMAKER"});
      if (c.compute_environment != "LOCAL_MACHINE")
        r.warn(key, line, "accel runs on the local machine only; the value is ignored");
    } else if (key == "distributed_type") {
      const std::string t = r.choice(key, v, {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP",
                                              "MEGATRON_LM"});
      if (t == "NO") c.distributed_type = DistributedType::No;
      else if (t == "MULTI_CPU") c.distributed_type = DistributedType::MultiCpu;
      else {
        c.distributed_type = DistributedType::MultiGpu;
        if (t != "MULTI_GPU")
          r.warn(key, line, "accel does not support " + t + "; it is read as MULTI_GPU");
      }
    } else if (key == "backend") {
      c.backend = r.choice(key, v, {"gloo", "mpi", "nccl"});
    } else if (key == "mixed_precision") {
      c.mixed_precision = r.choice(key, v, {"no", "fp16", "bf16"});
    } else if (key == "use_cpu") {
      c.use_cpu = r.boolean(key, v);
    } else if (key == "debug") {
      c.debug = r.boolean(key, v);
    } else if (key == "num_processes") {
      const int n = r.integer(key, v, -1, 1 << 20);
      if (n == 0) r.fail(key, v, "is 0", "a positive number of processes (or -1 for the default)");
      c.num_processes = n < 0 ? std::nullopt : std::optional<int>(n);
    } else if (key == "num_machines") {
      c.num_machines = r.integer(key, v, 1, 1 << 16);
    } else if (key == "machine_rank") {
      c.machine_rank = r.integer(key, v, 0, (1 << 16) - 1);
    } else if (key == "main_process_ip") {
      c.main_process_ip = r.string(key, v);
    } else if (key == "main_process_port") {
      c.main_process_port = r.integer(key, v, 0, 65535);
    } else if (key == "rdzv_backend") {
      c.rdzv_backend = r.choice(key, v, {"static", "c10d", "etcd", "etcd-v2"});
      if (c.rdzv_backend != "static")
        r.warn(key, line, "accel always uses a static rendezvous (c10d TCPStore at main_process_ip:"
                          "main_process_port)");
    } else if (key == "same_network") {
      c.same_network = r.boolean(key, v);
    } else if (key == "main_training_function") {
      c.main_training_function = r.string(key, v);
    } else if (key == "enable_cpu_affinity") {
      c.enable_cpu_affinity = r.boolean(key, v);
    } else if (key == "downcast_bf16") {
      c.downcast_bf16 = r.boolean(key, v);  // Accelerate writes 'no' as a string
    } else if (key == "gpu_ids") {
      c.gpu_ids = r.string(key, v);
    } else if (key == "gradient_accumulation_steps") {
      c.gradient_accumulation_steps = r.integer(key, v, 1, 1 << 30);
    } else if (detail::launch::is_ignored_accelerate_key(key)) {
      if (!detail::launch::is_trivial(v))
        r.warn(key, line, "accel does not support this Accelerate feature; the key is ignored");
    } else {
      r.warn(key, line, "unknown key, ignored. Check its spelling (keys are Accelerate's)");
    }
  }
  if (c.machine_rank >= c.num_machines)
    throw ConfigError("accel: " + path.string() + ": machine_rank " +
                      std::to_string(c.machine_rank) + " is not below num_machines " +
                      std::to_string(c.num_machines) + ". Use a machine_rank in [0, num_machines).");
  if (warn != nullptr)
    for (const auto& w : c.warnings) *warn << w << '\n';
  return c;
}

/// Writes `c` as YAML (sorted keys, Accelerate's names; accel's `backend` only
/// when set), creating parent directories and replacing an existing file.
inline void write_config_file(const LaunchConfig& c, const std::filesystem::path& path) {
  nlohmann::json j = detail::launch::to_json(c);
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& [k, v] : j.items()) {  // nlohmann::json keeps keys sorted
    out << YAML::Key << k << YAML::Value;
    if (v.is_boolean()) out << v.get<bool>();
    else if (v.is_number_integer()) out << v.get<int>();
    else out << v.get<std::string>();
  }
  out << YAML::EndMap;
  detail::launch::write_text(path, std::string(out.c_str()) + "\n");
}

/// Writes the basic config Accelerate's write_basic_config writes (JSON, sorted
/// keys, two-space indent, into the .yaml path): all CUDA devices of this
/// machine when the build has CUDA, else one CPU process. An existing file is
/// left alone (a note on stderr says so). Throws ConfigError for a
/// mixed_precision other than no, fp16, bf16.
inline void write_basic_config(std::string_view mixed_precision = "no",
                               std::optional<std::filesystem::path> path = {}) {
  std::string mp(mixed_precision);
  for (auto& ch : mp) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (mp != "no" && mp != "fp16" && mp != "bf16")
    throw ConfigError("accel: mixed_precision '" + std::string(mixed_precision) +
                      "' is not supported. Use one of: no, fp16, bf16.");
  const std::filesystem::path where = path ? *path : default_config_path();
  if (std::filesystem::exists(where)) {
    std::cerr << "accel: configuration already exists at " << where.string()
              << ", will not override. Run `accel config` or pass another path.\n";
    return;
  }
  LaunchConfig c;
  c.mixed_precision = mp;
  c.use_cpu = true;
  c.num_processes = 1;
#if ACCEL_WITH_CUDA
  if (const int gpus = static_cast<int>(torch::cuda::device_count()); gpus > 0) {
    c.use_cpu = false;
    c.num_processes = gpus;
    c.distributed_type = gpus > 1 ? DistributedType::MultiGpu : DistributedType::No;
  }
#endif
  nlohmann::json j = detail::launch::to_json(c);
  j["tpu_use_cluster"] = false;  // Accelerate's ClusterConfig writes these defaults too
  j["tpu_use_sudo"] = false;
  detail::launch::write_text(where, j.dump(2) + "\n");
}

}  // namespace accel

#endif  // ACCEL_LAUNCH_CONFIG_FILE_HPP
