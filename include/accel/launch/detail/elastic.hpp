// SPDX-License-Identifier: Apache-2.0
/// @file Defines the elastic loop shared by notebook_launcher and `accel
/// launch`: start the worker group, and when a worker fails start the whole
/// group again, up to LaunchOptions::max_restarts times. The worker pool
/// already stops a failed group; this only decides whether to go again, with
/// which port, and says so. Over several machines the machines' launchers
/// decide together through their agents (node_agent.hpp). Free of LibTorch
/// (the `accel` command uses it).
#ifndef ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
#define ACCEL_LAUNCH_DETAIL_ELASTIC_HPP

#include <chrono>
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

#include <accel/launch/detail/node_agent.hpp>
#include <accel/launch/detail/ports.hpp>
#include <accel/launch/detail/rank_env.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/launch/launch_options.hpp>

namespace accel::detail::launch {

/// One attempt of a launch, as the start callback of run_elastic gets it.
struct Attempt {
  LaunchOptions options;  ///< master_port: where this attempt's workers meet
  int index = 0;          ///< 0 first (TORCHELASTIC_RESTART_COUNT)
  std::string job_id;     ///< ACCEL_JOB_ID of every worker of the attempt ("" : none)
  /// Several machines: why this machine's workers must stop now (another
  /// machine failed), polled by the pool (PoolOptions::stop_requested).
  std::function<std::optional<std::string>()> stop_requested;
};

/// The last attempt's outcome, and which attempt it was (0 = the first).
struct ElasticOutcome {
  PoolOutcome outcome;
  int attempt = 0;
};

/// The rendezvous port of a restart. The workers of the failed attempt are
/// gone, but the port may still be held (their connections in TIME_WAIT are
/// not a problem: the store binds with SO_REUSEADDR; another program that
/// took it meanwhile is). One node owns all workers, so it can move them to
/// a free port: always when any port would do (master_port 0), else only
/// when the given one cannot be listened on.
inline int restart_port(const LaunchOptions& o, bool any_port) {
  if (any_port) return pick_free_port(o.master_addr);
  const int fd = bind_tcp(o.master_addr, o.master_port);
  if (fd >= 0) {
    ::close(fd);
    return o.master_port;
  }
  return pick_free_port(o.master_addr);
}

/// The rendezvous timeout of the launchers of several machines: how long
/// machine 0 waits for the others to join (or rejoin after a restart), as
/// the workers' own (ACCEL_RDZV_TIMEOUT, default 30 minutes).
inline std::chrono::seconds launcher_rdzv_timeout() {
  if (const auto t = positive_env_int("ACCEL_RDZV_TIMEOUT")) return std::chrono::seconds(*t);
  return std::chrono::minutes(30);
}

/// Several machines: every attempt starts on all of them together, a failure
/// on one stops the workers of all within seconds, and machine 0's launcher
/// decides whether to go again.
template <class Start>
ElasticOutcome run_elastic_machines(const LaunchOptions& o, bool any_port, Start&& start,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::chrono::seconds rdzv_timeout, std::ostream& log) {
  const auto agent = make_node_agent(o, any_port, deadline, rdzv_timeout, log);
  for (;;) {
    AgentStep step = agent->next();
    if (step.finished) return {std::move(step.outcome), step.attempt};
    if (!step.restart_reason.empty()) log << "accel: " << step.restart_reason << std::endl;
    Attempt a{o, step.attempt, step.job_id, [&agent] { return agent->stop_requested(); }};
    a.options.master_port = step.worker_port;
    PoolOutcome out = start(static_cast<const Attempt&>(a));
    if (out.interrupted_by != 0 || out.timed_out) {
      agent->abort(out.timed_out ? std::string("launch ran past its timeout")
                                 : "launcher received " + signal_name(out.interrupted_by));
      return {std::move(out), step.attempt};
    }
    agent->finish_attempt(out);
  }
}

/// Runs start(Attempt) -> PoolOutcome, and again, with a new attempt number
/// (and maybe port), while a worker failed and restarts are left. A timeout
/// or a signal to the launcher ends the loop at once. any_port: the user
/// left the port to accel (master_port 0). deadline: the launch timeout.
template <class Start>
ElasticOutcome run_elastic(LaunchOptions o, bool any_port, Start&& start,
                           std::chrono::steady_clock::time_point deadline,
                           std::chrono::seconds rdzv_timeout = launcher_rdzv_timeout(),
                           std::ostream& log = std::cerr) {
  if (o.num_nodes > 1 && o.max_restarts > 0)
    return run_elastic_machines(o, any_port, start, deadline, rdzv_timeout, log);
  const int attempts = o.max_restarts + 1;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      const int port = restart_port(o, any_port);
      if (port != o.master_port && !any_port)
        log << "accel: port " << o.master_port << " is taken; the restarted processes meet on "
            << "port " << port << "." << std::endl;
      o.master_port = port;
    }
    PoolOutcome out = start(Attempt{o, attempt, new_job_id(o), {}});
    const bool failed = out.first_failure && !out.timed_out && out.interrupted_by == 0;
    if (!failed || attempt + 1 >= attempts) return {std::move(out), attempt};
    log << "accel: " << attempt_failure(out, attempt, attempts) << ". " << restarting(o, attempt + 1)
        << std::endl;
  }
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
