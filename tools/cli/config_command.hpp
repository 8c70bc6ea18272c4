// SPDX-License-Identifier: Apache-2.0
/// @file Defines `accel config`: the questions (read line by line, so they work
/// from a terminal or piped answers) and `--default`.
#ifndef ACCEL_TOOLS_CLI_CONFIG_COMMAND_HPP
#define ACCEL_TOOLS_CLI_CONFIG_COMMAND_HPP

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <string>

#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/launch/config_file.hpp>

namespace accel::cli {

/// Asks one question until the answer parses; an empty answer takes the
/// default. The end of the input is an error, never a wait.
class Questions {
 public:
  Questions(std::istream& in, std::ostream& out) : in_(in), out_(out) {}

  /// parse returns nullopt and sets `why` for a bad answer.
  template <class T>
  T ask(const std::string& question, const std::string& default_answer,
        const std::function<std::optional<T>(const std::string&, std::string& why)>& parse,
        const std::string& header = "") {
    for (;;) {
      out_ << header;
      out_ << question << (default_answer.empty() ? "" : " [" + default_answer + "]") << ": "
           << std::flush;
      std::string line;
      if (!std::getline(in_, line))
        throw Error("accel: the input ended before \"" + (header.empty() ? question : header.substr(0, header.find('\n'))) +
                    "\" was answered. Answer every question, or run `accel config --default`.");
      line = trim(line);
      if (line.empty()) line = default_answer;
      std::string why;
      if (auto v = parse(line, why)) return *v;
      out_ << "accel: '" << line << "' is not a valid answer: " << why << ". Please answer again.\n";
    }
  }

  int integer(const std::string& question, int def, int lo, int hi) {
    return ask<int>(question, std::to_string(def),
                    [&](const std::string& s, std::string& why) -> std::optional<int> {
                      try {
                        std::size_t used = 0;
                        const long v = std::stol(s, &used);
                        if (used == s.size() && v >= lo && v <= hi) return static_cast<int>(v);
                      } catch (const std::exception&) {
                      }
                      why = "expected a whole number from " + std::to_string(lo) + " to " +
                            std::to_string(hi);
                      return std::nullopt;
                    });
  }

  bool yes_no(const std::string& question, bool def) {
    return ask<bool>(question + (def ? " [YES/no]" : " [yes/NO]"), "",
                     [&](const std::string& s, std::string& why) -> std::optional<bool> {
                       const std::string l = lower(s);
                       if (l.empty()) return def;
                       if (l == "y" || l == "yes" || l == "true") return true;
                       if (l == "n" || l == "no" || l == "false") return false;
                       why = "answer yes or no";
                       return std::nullopt;
                     });
  }

  /// One of `options` by name (any case) or by its number.
  std::string choice(const std::string& question, const std::vector<std::string>& options,
                     const std::string& def) {
    std::string header = question + "\n";
    for (std::size_t i = 0; i < options.size(); ++i)
      header += "  [" + std::to_string(i) + "] " + options[i] + "\n";
    return ask<std::string>("Your choice", def,
                            [&](const std::string& s, std::string& why) -> std::optional<std::string> {
                              for (std::size_t i = 0; i < options.size(); ++i)
                                if (s == std::to_string(i) || lower(s) == lower(options[i]))
                                  return options[i];
                              why = "expected a number from 0 to " +
                                    std::to_string(options.size() - 1) + " or one of the names";
                              return std::nullopt;
                            },
                            header);
  }

  static std::string lower(std::string s) {
    std::transform(s.begin(), s.end(), s.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return s;
  }
  static std::string trim(const std::string& s) {
    const auto b = s.find_first_not_of(" \t\r");
    if (b == std::string::npos) return "";
    return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
  }

 private:
  std::istream& in_;
  std::ostream& out_;
};

/// The interactive questionnaire (Accelerate's cluster questions that apply to accel).
/// A mixed_precision given on the command line is not asked again.
inline LaunchConfig ask_config(std::istream& in, std::ostream& out,
                               const std::optional<std::string>& mixed_precision = {}) {
  Questions q(in, out);
  LaunchConfig c;
  const std::string kind = q.choice("Which type of machine are you using?",
                                    {"NO", "MULTI_CPU", "MULTI_GPU"}, "NO");
  c.distributed_type = kind == "MULTI_CPU"   ? DistributedType::MultiCpu
                       : kind == "MULTI_GPU" ? DistributedType::MultiGpu
                                             : DistributedType::No;
  c.use_cpu = c.distributed_type == DistributedType::MultiCpu ||
              (c.distributed_type == DistributedType::No && !ACCEL_WITH_CUDA);
  if (c.distributed_type == DistributedType::No) {
    c.num_processes = 1;
  } else {
    const bool gpu = c.distributed_type == DistributedType::MultiGpu;
    c.backend = q.choice("Which communication backend should the processes use?",
                         {"gloo", "mpi", "nccl"}, gpu ? "nccl" : "gloo");
    c.num_machines = q.integer("How many different machines will you use (more than 1 for "
                               "multi-node training)?", 1, 1, 65536);
    if (c.num_machines > 1) {
      c.machine_rank = q.integer("What is the rank of this machine?", 0, 0, c.num_machines - 1);
      c.main_process_ip = q.ask<std::string>(
          "What is the IP address of the machine that will host the main process?", "",
          [](const std::string& s, std::string& why) -> std::optional<std::string> {
            if (!s.empty() && s.find_first_of(" \t") == std::string::npos) return s;
            why = "expected an address such as 192.168.1.10";
            return std::nullopt;
          });
      c.main_process_port = q.integer(
          "What is the port you will use to communicate with the main process?", 29500, 1, 65535);
      c.same_network = q.yes_no("Are all the machines on the same local network?", true);
    }
    for (;;) {
      const int n = q.integer("How many processes in total will you use (all machines "
                              "together)?", c.num_machines, 1, 1 << 20);
      if (n % c.num_machines == 0) {
        c.num_processes = n;
        break;
      }
      out << "accel: " << n << " processes cannot be shared evenly by " << c.num_machines
          << " machines. Please answer again.\n";
    }
    c.debug = q.yes_no("Should distributed operations be checked while running for errors? "
                       "This can avoid timeout issues but will be slower.", false);
  }
  c.mixed_precision = mixed_precision ? *mixed_precision
                                      : q.choice("Do you wish to use mixed precision?",
                                                 {"no", "fp16", "bf16"}, "no");
  return c;
}

/// `accel config [--default] [--mixed_precision M] [--config_file F]`.
inline int run_config(bool use_default, const std::optional<std::string>& mixed_precision,
                      const std::optional<std::string>& config_file, std::istream& in,
                      std::ostream& out) {
  const std::filesystem::path path =
      config_file ? std::filesystem::path(*config_file) : default_config_path();
  if (use_default) {
    const bool existed = std::filesystem::exists(path);
    write_basic_config(mixed_precision.value_or("no"), path);
    if (!existed) out << "accel configuration saved at " << path.string() << "\n";
    return 0;
  }
  const LaunchConfig c = ask_config(in, out, mixed_precision);
  write_config_file(c, path);
  out << "accel configuration saved at " << path.string() << "\n";
  return 0;
}

}  // namespace accel::cli

#endif  // ACCEL_TOOLS_CLI_CONFIG_COMMAND_HPP
