// SPDX-License-Identifier: Apache-2.0
/// @file Defines `accel test` (Accelerate's `accelerate test`): a short check
/// of this machine's setup with the backend and mixed precision of the config
/// file or the flags. Two launches of notebook_launcher run the checks of
/// test_checks.hpp; this side reports which check failed or hung, and why.
#ifndef ACCEL_TOOLS_CLI_TEST_COMMAND_HPP
#define ACCEL_TOOLS_CLI_TEST_COMMAND_HPP

#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include <accel/config.hpp>
#include <accel/dispatch.hpp>
#include <accel/errors.hpp>
#include <accel/launch/config_file.hpp>
#include <accel/launch/detail/ports.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include "test_checks.hpp"
#include "test_options.hpp"

namespace accel::cli {

/// Flags > config file > defaults (gloo, no mixed precision). Refuses what
/// this build cannot run before any process starts.
inline selftest::Plan make_test_plan(const TestFlags& f, std::vector<std::string>& notes) {
  LaunchConfig c;
  const auto path = f.config_file ? std::optional<std::filesystem::path>(*f.config_file)
                                  : config_file_in_effect();
  if (path) {
    c = read_config_file(*path);
    notes.push_back("testing with the config file " + path->string());
  } else {
    notes.push_back("no config file at " + default_config_path().string() +
                    "; testing the defaults (run `accel config` to save your own)");
  }
  selftest::Plan p;
  PolicyChoice choice = PolicyChoice::from_config(c);
  if (f.backend) {
    p.backend = *f.backend;
  } else if (choice.backend == "single") {
    p.backend = "gloo";  // a one-process config still has the processes of a launch to check
  } else {
    p.backend = choice.backend;
  }
  p.precision = f.mixed_precision.value_or(choice.precision);
  p.num_processes = f.num_processes;
  p.timeout = std::chrono::seconds(f.timeout);
  // Messages name where a value came from: the flag, or the config file.
  const std::string in_config = " (from " + c.source.string() + ")";
  const std::string backend = "backend " + p.backend + (f.backend ? "" : in_config);
  const std::string precision =
      "mixed precision " + p.precision + (f.mixed_precision ? "" : in_config);

  ACCEL_CHECK(p.num_processes >= 2, "accel: --num_processes ", p.num_processes, ": `accel test` ",
              "checks how processes work together and needs at least 2. Pass 2 or more (the "
              "default is 2).");
  ACCEL_CHECK(f.timeout >= 1, "accel: --timeout ", f.timeout, " s leaves no time for the test. "
              "Give a positive number of seconds (the default is 120).");
  ACCEL_CHECK(p.backend == "gloo" || p.backend == "mpi" || p.backend == "nccl", "accel: ",
              backend, " is not one `accel test` can check. Pass --backend gloo, mpi or nccl.");
  ACCEL_CHECK(p.backend != "mpi" || ACCEL_WITH_MPI, "accel: ", backend, ": MPI is not compiled "
              "into this accel (it was built with ACCEL_WITH_MPI=OFF, or CMake found no MPI). "
              "Install MPI (libopenmpi-dev) and rebuild accel, or pass --backend gloo.");
  ACCEL_CHECK(p.backend != "nccl" || ACCEL_WITH_NCCL, "accel: ", backend, ": NCCL is not "
              "compiled into this accel (it needs a CUDA build of LibTorch; this one has ",
              ACCEL_WITH_CUDA ? "CUDA but no NCCL" : "no CUDA", "). Pass --backend gloo.");
  ACCEL_CHECK(p.precision == "no" || p.precision == "fp16" || p.precision == "bf16", "accel: ",
              precision, " is unknown. Pass --mixed_precision no, fp16 or bf16.");
  ACCEL_CHECK(p.precision != "fp16" || (ACCEL_WITH_CUDA && p.backend != "mpi"), "accel: ",
              precision, ": fp16 needs CUDA devices, and ",
              ACCEL_WITH_CUDA ? "backend mpi runs on the CPU" : "this accel has no CUDA",
              ". Pass --mixed_precision bf16 (or no) to test on the CPU.");
  return p;
}

namespace detail::test {

/// A fresh directory under the system's temporary directory, removed with everything in it.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "accel-test-XXXXXX").string();
    ACCEL_CHECK(::mkdtemp(tmpl.data()) != nullptr, "accel: cannot create a temporary directory "
                "in ", std::filesystem::temp_directory_path().string(), ". Point TMPDIR at a "
                "writable directory.");
    path_ = tmpl;
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

/// The check process `rank` was in, from its stage file; empty before it began.
inline std::string stage_of(const selftest::Plan& p, int rank) {
  std::ifstream in(selftest::stage_file(p, rank));
  std::string s;
  std::getline(in, s);
  return s;
}

/// Position of `check` in the run; 0 before the first.
inline int order(const std::string& check) {
  int i = 1;
  for (auto c : {selftest::kRendezvous, selftest::kAllReduce, selftest::kGradientSync,
                 selftest::kCheckpoint}) {
    if (check == c) return i;
    ++i;
  }
  return 0;
}

/// What a process in `check` waits for, for the message after a timeout.
inline std::string waiting_for(const selftest::Plan& p, const std::string& check, int port) {
  if (check.empty()) return "LibTorch to load (it had not begun the checks)";
  if (check == selftest::kRendezvous)
    return "all " + std::to_string(p.num_processes) + " processes to join at 127.0.0.1:" +
           std::to_string(port);
  if (check == selftest::kAllReduce) return "the other processes' values in an all_reduce";
  if (check == selftest::kGradientSync) return "the gradient all-reduces of the training steps";
  return "the other processes to write or read the checkpoint (or to join the resumed run)";
}

/// What to do when `check` failed, or (hung) did not finish.
inline std::string advice(const selftest::Plan& p, const std::string& check, bool hung) {
  const std::string report = "report it with the output of `accel env` and this message";
  const std::string other_backend = p.backend == "gloo" ? "" : ", or try --backend gloo";
  const std::string tmp = std::filesystem::temp_directory_path().string();
  if (check.empty() || check == selftest::kRendezvous)
    return "Check that TCP connections to 127.0.0.1 work (a firewall may block them)" +
           other_backend + "; if they do, " + report;
  if (check == selftest::kCheckpoint)
    return "The checkpoint goes to " + tmp + " (TMPDIR): check that it is a writable local "
           "directory with free space; if it is, " + report;
  if (hung) return "If it hangs again, " + report;
  if (check == selftest::kAllReduce)
    return "The " + p.backend + " backend sums wrongly: " + report +
           (other_backend.empty() ? "" : "; meanwhile try --backend gloo");
  return "Training on " + std::to_string(p.num_processes) + " processes does not match one "
         "process: " + report;
}

}  // namespace detail::test

/// `accel test [--config_file F] [--backend B] [--mixed_precision M] [--num_processes N]
/// [--timeout S]`.
/// 0 when every check passed; 1 when one failed; 124 past --timeout.
inline int run_test(const TestFlags& f, std::ostream& out, std::ostream& err) {
  namespace dt = detail::test;
  std::vector<std::string> notes;
  selftest::Plan plan = make_test_plan(f, notes);
  for (const auto& n : notes) err << "accel: " << n << ".\n";
  const std::string what = plan.backend + ", " + selftest::precision_label(plan.precision) + ", " +
                           std::to_string(plan.num_processes) + " processes";

  dt::ScratchDir scratch;
  plan.scratch = scratch.path();
  LaunchOptions lo;
  lo.num_processes = plan.num_processes;
  lo.master_port = accel::detail::launch::pick_free_port(lo.master_addr);  // named if the rendezvous hangs
  const auto deadline = std::chrono::steady_clock::now() + plan.timeout;
  auto time_left = [&] {
    return std::max(std::chrono::seconds(1), std::chrono::ceil<std::chrono::seconds>(
                                                 deadline - std::chrono::steady_clock::now()));
  };
  out << std::flush;
  try {
    lo.timeout = time_left();
    notebook_launcher(selftest::first_run, std::make_tuple(plan), lo);
    lo.timeout = time_left();
    lo.master_port = accel::detail::launch::pick_free_port(lo.master_addr);
    notebook_launcher(selftest::resumed_run, std::make_tuple(plan), lo);
  } catch (const LaunchError& e) {
    const std::string check = dt::stage_of(plan, e.rank());
    std::string cause = e.message();
    while (!cause.empty() && (cause.back() == '.' || cause.back() == ' ')) cause.pop_back();
    // accel's own errors say what to do; what the checks find needs the advice.
    const bool says_what_to_do = cause.rfind("accel: ", 0) == 0;
    if (says_what_to_do) cause.erase(0, 7);
    err << "accel: `accel test` check '" << (check.empty() ? selftest::kRendezvous : check)
        << "' failed on process " << e.rank() << " (" << what << "): " << cause << ". "
        << (says_what_to_do ? "Then run `accel test` again" : dt::advice(plan, check, false))
        << ".\n";
    return 1;
  } catch (const TimeoutError&) {
    // The processes ahead wait for those behind: the earliest check is the one that hung.
    std::string waits, hung;
    for (int r = 0; r < plan.num_processes; ++r) {
      const std::string check = dt::stage_of(plan, r);
      if (r == 0 || dt::order(check) < dt::order(hung)) hung = check;
      waits += "\n  process " + std::to_string(r) +
               (check.empty() ? "" : " was in '" + check + "',") + " waiting for " +
               dt::waiting_for(plan, check, lo.master_port);
    }
    err << "accel: `accel test` (" << what << "): "
        << (hung.empty() ? std::string("the processes") : "check '" + hung + "'")
        << " did not finish within --timeout " << plan.timeout.count()
        << " s; every process was stopped." << waits
        << "\nOn a slow or busy machine, run it again with a larger --timeout. "
        << dt::advice(plan, hung, true) << ".\n";
    return 124;
  }
  out << "accel test: all checks passed (" << what << ")\n";
  return 0;
}

}  // namespace accel::cli

#endif  // ACCEL_TOOLS_CLI_TEST_COMMAND_HPP
