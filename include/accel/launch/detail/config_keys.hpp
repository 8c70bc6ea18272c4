// SPDX-License-Identifier: Apache-2.0
/// @file Defines the typed, line-aware reading of config file values and the
/// list of Accelerate keys accel accepts but ignores (config_file.hpp uses them).
#ifndef ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP
#define ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>

#include <accel/errors.hpp>

namespace accel::detail::launch {

/// Converts one value; every failure names file, line, key, what was found and
/// what is allowed.
struct ConfigReader {
  std::string file;
  std::vector<std::string>& warnings;

  static int line_of(const YAML::Node& v) { return v.Mark().line + 1; }

  /// Text from the file as messages quote it: at most 80 characters.
  static std::string clipped(const std::string& text) {
    return text.size() <= 80 ? text
                             : text.substr(0, 80) + "... (" + std::to_string(text.size()) + " characters)";
  }

  static std::string shown(const YAML::Node& v) {
    if (v.IsScalar()) return "'" + clipped(v.Scalar()) + "'";
    if (v.IsSequence()) return "a list";
    if (v.IsMap()) return "a mapping";
    return "nothing";
  }

  [[noreturn]] void fail(const std::string& key, const YAML::Node& v, const std::string& found,
                         const std::string& allowed) const {
    throw ConfigError("accel: " + file + ":" + std::to_string(line_of(v)) + ": key '" +
                      clipped(key) + "' " + found + ". Use " + allowed + ".");
  }

  void warn(const std::string& key, int line, const std::string& why) {
    warnings.push_back("accel: warning: " + file + ":" + std::to_string(line) + ": key '" +
                       clipped(key) + "': " + why + ".");
  }

  std::string choice(const std::string& key, const YAML::Node& v,
                     std::initializer_list<std::string_view> allowed) const {
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    if (!v.IsScalar()) fail(key, v, "is " + shown(v), "one of: " + list);
    const std::string s = v.Scalar();
    if (std::find(allowed.begin(), allowed.end(), s) == allowed.end())
      fail(key, v, "has the value '" + clipped(s) + "', which is not allowed", "one of: " + list);
    return s;
  }

  bool boolean(const std::string& key, const YAML::Node& v) const {
    bool b = false;
    if (!v.IsScalar() || !YAML::convert<bool>::decode(v, b))
      fail(key, v, "is " + shown(v) + ", not a boolean", "true or false (yes/no also accepted)");
    return b;
  }

  int integer(const std::string& key, const YAML::Node& v, int lo, int hi) const {
    const std::string range = "a whole number in [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]";
    long long n = 0;
    if (!v.IsScalar() || !YAML::convert<long long>::decode(v, n))
      fail(key, v, "is " + shown(v) + ", not a whole number", range);
    if (n < lo || n > hi) fail(key, v, "is " + std::to_string(n) + ", out of range", range);
    return static_cast<int>(n);
  }

  std::string string(const std::string& key, const YAML::Node& v) const {
    if (!v.IsScalar()) fail(key, v, "is " + shown(v) + ", not a single value", "a string");
    return v.Scalar();
  }
};

/// Keys of Accelerate features accel does not have (TPU, DeepSpeed, FSDP,
/// SageMaker, ...): accepted so that an Accelerate file reads as it is.
inline bool is_ignored_accelerate_key(std::string_view key) {
  static constexpr std::array<std::string_view, 26> names{
      "deepspeed_config", "fsdp_config", "megatron_lm_config", "fp8_config", "parallelism_config",
      "mpirun_config", "dynamo_config", "ipex_config", "commands", "command_file",
      "use_mps_device", "ipex", "use_xpu", "mpirun_hostfile", "ec2_instance_type",
      "iam_role_name", "image_uri", "profile", "region", "py_version", "pytorch_version",
      "transformers_version", "success_message", "base_job_name", "sagemaker_inputs_file",
      "sagemaker_metrics_file"};
  return key.rfind("tpu_", 0) == 0 || key == "additional_args" ||
         std::find(names.begin(), names.end(), key) != names.end();
}

/// True for values that ask for nothing (null, false, empty, or a mapping of
/// such): an ignored key holding one of them is not worth a warning.
inline bool is_trivial(const YAML::Node& v) {
  if (v.IsNull()) return true;
  if (v.IsScalar()) {
    bool b = true;
    return v.Scalar().empty() || (YAML::convert<bool>::decode(v, b) && !b);
  }
  if (v.IsSequence()) return v.size() == 0;
  for (const auto& kv : v)
    if (!is_trivial(kv.second)) return false;
  return true;
}

/// Writes a whole file, creating its parent directories.
inline void write_text(const std::filesystem::path& path, const std::string& text) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out)
    throw Error("accel: cannot write " + path.string() +
                ". Check that the directory is writable or pass another path.");
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP
