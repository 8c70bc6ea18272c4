// SPDX-License-Identifier: Apache-2.0
/// @file Defines `accel launch`: merges flags, config file and defaults into a
/// plan, then starts the local processes of PROGRAM through the WorkerPool.
#ifndef ACCEL_TOOLS_CLI_LAUNCH_COMMAND_HPP
#define ACCEL_TOOLS_CLI_LAUNCH_COMMAND_HPP

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/launch/config_file.hpp>
#include <accel/launch/detail/elastic.hpp>
#include <accel/launch/detail/ports.hpp>
#include <accel/launch/detail/posix.hpp>
#include <accel/launch/detail/rank_env.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/launch/launch_options.hpp>

#if ACCEL_WITH_CUDA
#include <torch/cuda.h>
#endif

namespace accel::cli {

/// What the command line says; unset means "take it from the config file".
struct LaunchFlags {
  std::optional<int> num_processes, num_machines, machine_rank, main_process_port;
  std::optional<std::string> main_process_ip, mixed_precision, backend, config_file, gpu_ids;
  std::optional<std::string> rdzv_file;  ///< port 0 on several machines: the port goes through it
  std::optional<int> num_cpu_threads_per_process;
  bool cpu = false, debug = false, prefix_output = false, quiet = false;
  double grace_period = 5.0;  ///< seconds between SIGTERM and SIGKILL
  std::optional<int> timeout;       ///< seconds the whole launch may take (--timeout)
  std::optional<int> rdzv_timeout;  ///< seconds the workers wait to meet (ACCEL_RDZV_TIMEOUT)
  int max_restarts = 0;             ///< restarts of the whole group after a failure (--max_restarts)
  std::optional<int> monitor_interval;  ///< seconds without a heartbeat that make a process hung
  std::vector<std::string> command;  ///< PROGRAM ARGS...
};

/// The merged result: flags > config file > defaults.
struct LaunchPlan {
  LaunchConfig config;
  int num_processes = 1, local_processes = 1, num_machines = 1, machine_rank = 0;
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 29500;
  bool any_port = false;  ///< --main_process_port 0: a restart may take another free port
  std::optional<std::string> published_port_file;  ///< machine 0 wrote it; removed after the launch
  std::vector<std::string> notes;  ///< what was chosen for the user (printed unless quiet)
};

inline LaunchPlan make_launch_plan(const LaunchFlags& f) {
  LaunchPlan p;
  if (f.config_file) {
    p.config = read_config_file(*f.config_file);
  } else if (auto found = config_file_in_effect()) {
    p.config = read_config_file(*found);
    if (*found != default_config_path())
      p.notes.push_back("reading Accelerate's config file " + found->string());
  } else {
    p.notes.push_back("no config file at " + default_config_path().string() +
                      "; using defaults (run `accel config` to save your own)");
  }
  const LaunchConfig& c = p.config;
  p.num_machines = f.num_machines.value_or(c.num_machines);
  p.machine_rank = f.machine_rank.value_or(c.machine_rank);
  // Default: one process per CUDA device (as Accelerate), one on a CPU machine.
  int per_machine = 1;
#if ACCEL_WITH_CUDA
  if (!f.cpu && !c.use_cpu)
    per_machine = std::max(1, static_cast<int>(torch::cuda::device_count()));  // exec follows
#endif
  p.num_processes =
      f.num_processes.value_or(c.num_processes.value_or(p.num_machines * per_machine));
  if (p.num_machines < 1)
    throw ConfigError("accel: --num_machines must be at least 1. Pass 1 for a single machine.");
  if (p.num_processes < 1)
    throw ConfigError("accel: --num_processes must be at least 1. Pass the total number of "
                      "processes over all machines.");
  if (p.machine_rank < 0 || p.machine_rank >= p.num_machines)
    throw ConfigError("accel: --machine_rank " + std::to_string(p.machine_rank) +
                      " is not in [0, " + std::to_string(p.num_machines) +
                      "). Give each machine a distinct rank below --num_machines.");
  if (p.num_processes % p.num_machines != 0)
    throw ConfigError("accel: --num_processes " + std::to_string(p.num_processes) +
                      " (the total over all machines) is not a multiple of --num_machines " +
                      std::to_string(p.num_machines) + ". Use the same number of processes on "
                      "every machine.");
  p.local_processes = p.num_processes / p.num_machines;
  detail::launch::check_local_process_count(p.local_processes);

  if (f.main_process_ip) p.main_process_ip = *f.main_process_ip;
  else if (c.main_process_ip) p.main_process_ip = *c.main_process_ip;
  else if (p.num_machines > 1)
    throw ConfigError("accel: --main_process_ip is required with --num_machines > 1. Pass the "
                      "address of the machine with --machine_rank 0.");

  const std::optional<int> port = f.main_process_port ? f.main_process_port : c.main_process_port;
  if (port && (*port < 0 || *port > 65535))
    throw ConfigError("accel: --main_process_port " + std::to_string(*port) +
                      " is not a port. Use 1-65535, or 0 to let accel choose.");
  // Only the main machine hosts the rendezvous, so only it can check the port.
  const bool hosts = p.machine_rank == 0;
  if (port && *port == 0 && p.num_machines > 1 && !f.rdzv_file)
    throw ConfigError("accel: --main_process_port 0 with several machines needs --rdzv_file "
                      "PATH on a filesystem all machines share, through which machine 0 tells "
                      "the others the port it chose. Or pass the same fixed port to every "
                      "machine.");
  if (p.num_machines > 1 && f.rdzv_file && (!port || *port == 0)) {
    // Machine 0 takes a free port (port 0) or the default 29500 if it is free
    // (no port given), and the others learn which through the shared file.
    const int preferred = port ? 0 : 29500;
    p.main_process_port = detail::launch::agree_on_free_port(
        *f.rdzv_file, p.machine_rank, p.main_process_ip,
        std::chrono::steady_clock::now() + std::chrono::minutes(30), preferred);
    if (hosts) p.published_port_file = *f.rdzv_file;
    if (p.main_process_port != preferred) {
      const std::string what = !hosts     ? "machine 0 chose port "
                               : preferred ? "default port 29500 is in use; chose free port "
                                           : "chose free port ";
      p.notes.push_back(what + std::to_string(p.main_process_port) + " (through " +
                        *f.rdzv_file + ")");
    }
  } else if (port && *port == 0) {
    p.any_port = true;
    p.main_process_port = detail::launch::pick_free_port(p.main_process_ip);
    p.notes.push_back("using free port " + std::to_string(p.main_process_port));
  } else if (port) {
    p.main_process_port = *port;
    if (hosts) detail::launch::ensure_port_free(p.main_process_ip, *port);
  } else {
    p.main_process_port = 29500;
    if (hosts) {
      try {
        detail::launch::ensure_port_free(p.main_process_ip, 29500);
      } catch (const Error&) {
        if (p.num_machines > 1) throw;
        p.main_process_port = detail::launch::pick_free_port(p.main_process_ip);
        p.notes.push_back("default port 29500 is in use; using free port " +
                          std::to_string(p.main_process_port));
      }
    }
  }
  return p;
}

/// The same per-node options notebook_launcher takes (num_processes per node).
inline LaunchOptions node_options(const LaunchPlan& p, const LaunchFlags& f) {
  LaunchOptions o;
  o.num_processes = p.local_processes;
  o.num_nodes = p.num_machines;
  o.node_rank = p.machine_rank;
  o.master_addr = p.main_process_ip;
  o.master_port = p.main_process_port;
  o.mixed_precision = f.mixed_precision.value_or(p.config.mixed_precision);
  o.max_restarts = f.max_restarts;
  if (f.monitor_interval) o.monitor_interval = std::chrono::seconds(*f.monitor_interval);
  return o;
}

/// The variables worker `local_rank` gets on top of the launcher's environment:
/// notebook_launcher's rank variables plus what the config file asks for.
/// restart: the attempt of an elastic launch (TORCHELASTIC_RESTART_COUNT).
inline detail::launch::EnvList worker_env(const LaunchPlan& p, const LaunchFlags& f,
                                          int local_rank, const std::string& job_id,
                                          int restart = 0) {
  const LaunchConfig& c = p.config;
  detail::launch::EnvList env =
      detail::launch::rank_environment(node_options(p, f), local_rank, job_id, restart);
  if (std::getenv("OMP_NUM_THREADS") == nullptr)
    env.emplace_back("OMP_NUM_THREADS",
                     std::to_string(f.num_cpu_threads_per_process.value_or(
                         detail::launch::threads_per_worker(p.local_processes))));
  if (f.debug || c.debug) env.emplace_back("ACCEL_DEBUG_MODE", "yes");
  if (f.cpu || c.use_cpu) env.emplace_back("ACCEL_USE_CPU", "yes");
  if (auto b = f.backend ? f.backend : c.backend) env.emplace_back("ACCEL_BACKEND", *b);
  if (f.rdzv_timeout) env.emplace_back("ACCEL_RDZV_TIMEOUT", std::to_string(*f.rdzv_timeout));
  if (auto g = f.gpu_ids ? f.gpu_ids : c.gpu_ids; g && *g != "all")
    env.emplace_back("CUDA_VISIBLE_DEVICES", *g);
  return env;
}

/// Runs the launch; returns the process exit status (0, or the first failing
/// rank's status, 128+signal for a signal).
inline int run_launch(const LaunchFlags& f) {
  if (f.command.empty())
    throw Error("accel: no program given. Usage: accel launch [OPTIONS] PROGRAM [ARGS...].");
  const LaunchPlan p = make_launch_plan(f);
  if (f.debug || p.config.debug) {  // the address checks the docs promise for --debug
    if (p.machine_rank != 0)
      detail::launch::check_reachable(p.main_process_ip, p.main_process_port, std::chrono::seconds(5));
    else
      (void)detail::launch::resolve_ipv4(p.main_process_ip, p.main_process_port);
  }
  std::optional<detail::launch::RemoveAtExit> published;
  if (p.published_port_file) published.emplace(*p.published_port_file);
  detail::launch::validate(node_options(p, f));
  if (!f.quiet)
    for (const auto& n : p.notes) std::cerr << "accel: " << n << ".\n";
  detail::launch::PoolOptions po;
  po.prefix_output = f.prefix_output;
  po.grace = std::chrono::milliseconds(static_cast<long long>(f.grace_period * 1000));
  if (f.monitor_interval) po.heartbeat_timeout = std::chrono::seconds(*f.monitor_interval);
  // A training run ends when it ends, unless --timeout bounds it.
  po.timeout = f.timeout ? std::chrono::milliseconds(std::chrono::seconds(*f.timeout))
                         : std::chrono::milliseconds(std::chrono::hours(24 * 365 * 10));
  // Each attempt of an elastic launch (--max_restarts) is a new pool, a new
  // job id and maybe a new port; the pool's deadline is what is left of --timeout.
  const auto deadline = std::chrono::steady_clock::now() + po.timeout;
  const auto r = detail::launch::run_elastic(
      node_options(p, f), p.any_port,
      [&](const detail::launch::Attempt& a) {
        LaunchPlan pa = p;
        pa.main_process_port = a.options.master_port;
        po.timeout = std::max(std::chrono::milliseconds(1),
                              std::chrono::duration_cast<std::chrono::milliseconds>(
                                  deadline - std::chrono::steady_clock::now()));
        po.stop_requested = a.stop_requested;
        detail::launch::WorkerPool pool(po);
        for (int i = 0; i < pa.local_processes; ++i)
          pool.spawn_exec(pa.machine_rank * pa.local_processes + i,
                          worker_env(pa, f, i, a.job_id, a.index), f.command);
        return pool.wait();
      },
      deadline,
      f.rdzv_timeout ? std::chrono::seconds(*f.rdzv_timeout) : detail::launch::launcher_rdzv_timeout());
  const detail::launch::PoolOutcome& out = r.outcome;
  if (out.interrupted_by != 0) {
    std::cerr << "accel: received " << detail::launch::signal_name(out.interrupted_by)
              << "; stopped all processes.\n";
  } else if (out.timed_out) {
    std::cerr << "accel: the launch ran past --timeout " << *f.timeout
              << " s; stopped all processes.\n";
  } else if (out.first_failure) {
    const auto& w = *out.first_failure;
    const std::string others = out.others_summary();
    std::cerr << "accel: rank " << w.rank << " (pid " << w.pid << ") failed"
              << (f.max_restarts > 0 ? " on attempt " + std::to_string(r.attempt + 1) + " of " +
                                           std::to_string(f.max_restarts + 1) + " (--max_restarts " +
                                           std::to_string(f.max_restarts) + ")"
                                     : std::string())
              << ": " << w.message << (others.empty() ? "" : "; " + others) << ".\n";
  }
  return out.exit_code();
}

}  // namespace accel::cli

#endif  // ACCEL_TOOLS_CLI_LAUNCH_COMMAND_HPP
