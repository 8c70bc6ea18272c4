// SPDX-License-Identifier: Apache-2.0
// The `accel` command: config | launch | env | test. Flags mirror `accelerate`;
// the work is done in the headers beside this file.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "config_command.hpp"
#include "env_command.hpp"
#include "launch_command.hpp"
#include "test_options.hpp"

namespace {

template <class T>
void set_if(const CLI::Option* opt, const T& value, std::optional<T>& into) {
  if (opt->count() > 0) into = value;
}

// `accel test` runs in accel-test, next to this program: it links LibTorch,
// which would add about a second to the start of every accel command.
// Returns only when the exec fails.
int exec_accel_test(int argc, char** argv) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::string name = ((ec ? std::filesystem::path(argv[0]).parent_path() : self.parent_path()) / "accel-test").string();
  std::vector<char*> args{name.data()};
  int i = 1;
  while (i < argc && std::string(argv[i]) != "test") ++i;
  for (++i; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(name.c_str(), args.data());
  std::cerr << "accel: `accel test` runs " << name << ", which could not be started ("
            << std::strerror(errno) << "). Build it with accel (the accel_test_cli target, built "
            << "with accel_cli) and keep it next to the accel program.\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "accel: configure, test and launch programs built with accel (Accelerate for LibTorch)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string(accel::version_string));

  auto* config = app.add_subcommand(
      "config", "Write the config file `accel launch` reads; asks questions unless --default");
  bool use_default = false;
  std::string mixed_precision = "no", config_file;
  config->add_flag("--default", use_default, "Write the basic config without questions");
  auto* config_mp = config->add_option("--mixed_precision", mixed_precision, "no | fp16 | bf16")
                        ->check(CLI::IsMember({"no", "fp16", "bf16"}));
  auto* config_path = config->add_option("--config_file", config_file,
                                         "Where to write (default: accel::default_config_path())");

  auto* launch = app.add_subcommand("launch", "Start PROGRAM [ARGS...] on N local processes");
  launch->prefix_command();  // everything from PROGRAM on belongs to the program
  accel::cli::LaunchFlags f;
  int num_processes = 0, num_machines = 0, machine_rank = 0, port = 0, threads = 0;
  std::string ip, launch_mp, backend, launch_config, gpu_ids, tee = "0";
  auto* o_np = launch->add_option("--num_processes", num_processes,
                                  "Processes in total over all machines");
  auto* o_nm = launch->add_option("--num_machines", num_machines, "Machines taking part");
  auto* o_mr = launch->add_option("--machine_rank", machine_rank, "This machine's rank");
  auto* o_ip = launch->add_option("--main_process_ip", ip, "Address of machine 0");
  auto* o_port = launch->add_option("--main_process_port", port,
                                    "Rendezvous port on machine 0 (0: pick a free one)");
  std::string rdzv_file;
  auto* o_rdzv = launch->add_option(
      "--rdzv_file", rdzv_file,
      "With --main_process_port 0 on several machines: a shared path through which machine 0 "
      "tells the others the port it chose");
  auto* o_mp = launch->add_option("--mixed_precision", launch_mp, "no | fp16 | bf16")
                   ->check(CLI::IsMember({"no", "fp16", "bf16"}));
  auto* o_be = launch->add_option("--backend", backend, "gloo | mpi | nccl (ACCEL_BACKEND)")
                   ->check(CLI::IsMember({"gloo", "mpi", "nccl"}));
  auto* o_cf = launch->add_option("--config_file", launch_config, "Config file to read");
  auto* o_gpu = launch->add_option("--gpu_ids", gpu_ids, "CUDA devices to use (\"all\" or 0,1,...)");
  auto* o_thr = launch->add_option("--num_cpu_threads_per_process", threads,
                                   "OMP_NUM_THREADS (default: cores / local processes)");
  launch->add_flag("--cpu", f.cpu, "Run on CPU only (ACCEL_USE_CPU=yes)");
  launch->add_flag("--debug", f.debug, "Extra checks in the processes (ACCEL_DEBUG_MODE=yes)");
  launch->add_flag("--prefix_output", f.prefix_output, "Prefix output lines with \"[rank N] \"");
  auto* o_tee = launch->add_option("-t,--tee", tee, "As accelerate: anything but 0 prefixes output");
  launch->add_flag("-q,--quiet", f.quiet, "No notes from accel about the choices it made");
  launch->add_option("--grace_period", f.grace_period,
                     "Seconds between SIGTERM and SIGKILL when stopping processes")
      ->check(CLI::NonNegativeNumber);
  int timeout = 0, rdzv_timeout = 0;
  auto* o_timeout = launch->add_option("--timeout", timeout,
                                       "Seconds the whole launch may run; then every process is "
                                       "stopped and accel exits with 124")
                        ->check(CLI::PositiveNumber);
  auto* o_rdzv_timeout = launch->add_option("--rdzv_timeout", rdzv_timeout,
                                            "Seconds the processes wait for each other to join "
                                            "(ACCEL_RDZV_TIMEOUT; default: the collective timeout)")
                             ->check(CLI::PositiveNumber);

  launch->add_option("--max_restarts", f.max_restarts,
                     "When a process fails, stop all and start them again, up to this many "
                     "times (TORCHELASTIC_RESTART_COUNT tells each attempt; one machine only)")
      ->check(CLI::NonNegativeNumber);
  int monitor_interval = 0;
  auto* o_monitor = launch->add_option(
      "--monitor_interval", monitor_interval,
      "Seconds a process may go without a heartbeat (a loader batch, a collective, or a touch of "
      "$ACCEL_HEARTBEAT_FILE) after its first one before it is killed as hung")
      ->check(CLI::PositiveNumber);

  auto* env = app.add_subcommand("env", "Print versions, backends, cores and the config in effect");
  std::string env_config;
  auto* o_env_cf = env->add_option("--config_file", env_config, "Config file to show");

  auto* test = app.add_subcommand(
      "test", "Check this machine's setup: rendezvous, all_reduce, gradient sync and "
              "save_state/load_state on N local processes, with the config's backend and "
              "mixed precision");
  accel::cli::TestOptions test_options(*test);  // for --help and checks; accel-test reads them

  // `accel launch [OPTIONS] -- PROGRAM ...`: CLI11 would take what follows "--"
  // as extras; parse up to it and hand the rest to the program, unless the
  // program came earlier (then "--" is one of its own arguments).
  std::vector<std::string> after_dashes;
  try {
    int until = argc;
    for (int i = 1; i < argc; ++i)
      if (std::string(argv[i]) == "--") {
        until = i;
        break;
      }
    app.parse(until, argv);
    if (until < argc && *launch && launch->remaining().empty()) {
      after_dashes.assign(argv + until + 1, argv + argc);
    } else if (until < argc) {
      app.parse(argc, argv);
    }
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  try {
    if (*config) {
      std::optional<std::string> path, mp;
      set_if(config_path, config_file, path);
      set_if(config_mp, mixed_precision, mp);
      return accel::cli::run_config(use_default, mp, path, std::cin, std::cout);
    }
    if (*launch) {
      set_if(o_np, num_processes, f.num_processes);
      set_if(o_nm, num_machines, f.num_machines);
      set_if(o_mr, machine_rank, f.machine_rank);
      set_if(o_port, port, f.main_process_port);
      set_if(o_ip, ip, f.main_process_ip);
      set_if(o_rdzv, rdzv_file, f.rdzv_file);
      set_if(o_mp, launch_mp, f.mixed_precision);
      set_if(o_be, backend, f.backend);
      set_if(o_cf, launch_config, f.config_file);
      set_if(o_gpu, gpu_ids, f.gpu_ids);
      set_if(o_thr, threads, f.num_cpu_threads_per_process);
      set_if(o_timeout, timeout, f.timeout);
      set_if(o_rdzv_timeout, rdzv_timeout, f.rdzv_timeout);
      set_if(o_monitor, monitor_interval, f.monitor_interval);
      if (o_tee->count() > 0 && tee != "0") f.prefix_output = true;
      f.command = after_dashes.empty() ? launch->remaining() : after_dashes;
      return accel::cli::run_launch(f);
    }
    if (*test) return exec_accel_test(argc, argv);
    if (*env) {
      std::optional<std::string> path;
      set_if(o_env_cf, env_config, path);
      return accel::cli::run_env(path, std::cout);
    }
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
