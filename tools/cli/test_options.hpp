// SPDX-License-Identifier: Apache-2.0
/// @file Defines the flags of `accel test` and how they are read, shared by
/// the `accel` command (which shows them in --help and checks them) and the
/// accel-test program it hands the command to (which links LibTorch, so
/// that `accel` itself starts without it).
#ifndef ACCEL_TOOLS_CLI_TEST_OPTIONS_HPP
#define ACCEL_TOOLS_CLI_TEST_OPTIONS_HPP

#include <optional>
#include <string>

#include <CLI/CLI.hpp>

namespace accel::cli {

/// What the command line says; unset: from the config file.
struct TestFlags {
  std::optional<std::string> config_file, backend, mixed_precision;
  int num_processes = 2;
  int timeout = 120;  ///< seconds for everything, both launches included
};

/// The options of `accel test` on `test`; flags() reads them after parsing.
class TestOptions {
 public:
  explicit TestOptions(CLI::App& test) {
    config_ = test.add_option("--config_file", config_file_,
                              "Config file to read (default: the one `accel launch` reads)");
    backend_ = test.add_option("--backend", backend_value_, "gloo | mpi | nccl")
                   ->check(CLI::IsMember({"gloo", "mpi", "nccl"}));
    precision_ = test.add_option("--mixed_precision", precision_value_, "no | fp16 | bf16")
                     ->check(CLI::IsMember({"no", "fp16", "bf16"}));
    test.add_option("--num_processes", flags_.num_processes, "Processes to start (at least 2)")
        ->capture_default_str();
    test.add_option("--timeout", flags_.timeout,
                    "Seconds the whole test may run; then every process is stopped, accel says "
                    "where each one waited and exits with 124")
        ->capture_default_str();
  }
  TestOptions(const TestOptions&) = delete;
  TestOptions& operator=(const TestOptions&) = delete;

  TestFlags flags() const {
    TestFlags f = flags_;
    if (config_->count() > 0) f.config_file = config_file_;
    if (backend_->count() > 0) f.backend = backend_value_;
    if (precision_->count() > 0) f.mixed_precision = precision_value_;
    return f;
  }

 private:
  TestFlags flags_;
  std::string config_file_, backend_value_, precision_value_;
  CLI::Option* config_ = nullptr;
  CLI::Option* backend_ = nullptr;
  CLI::Option* precision_ = nullptr;
};

}  // namespace accel::cli

#endif  // ACCEL_TOOLS_CLI_TEST_OPTIONS_HPP
