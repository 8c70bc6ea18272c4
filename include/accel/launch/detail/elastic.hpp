// SPDX-License-Identifier: Apache-2.0
/// @file Defines the elastic loop shared by notebook_launcher and `accel
/// launch`: start the worker group, and when a worker fails start the whole
/// group again, up to LaunchOptions::max_restarts times. The worker pool
/// already stops a failed group; this only decides whether to go again, with
/// which port, and says so. Free of LibTorch (the `accel` command uses it).
#ifndef ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
#define ACCEL_LAUNCH_DETAIL_ELASTIC_HPP

#include <iostream>
#include <ostream>
#include <string>
#include <utility>

#include <accel/launch/detail/ports.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/launch/launch_options.hpp>

namespace accel::detail::launch {

/// The last attempt's outcome, and which attempt it was (0 = the first).
struct ElasticOutcome {
  PoolOutcome outcome;
  int attempt = 0;
};

/// "process 1 failed on attempt 1 of 3: killed by signal SIGKILL; process 0 was stopped".
inline std::string attempt_failure(const PoolOutcome& out, int attempt, int attempts) {
  const auto& w = *out.first_failure;
  std::string msg = w.message.size() > 500 ? w.message.substr(0, 500) + "..." : w.message;
  const std::string others = out.others_summary();
  return "process " + std::to_string(w.rank) + " failed on attempt " + std::to_string(attempt + 1) +
         " of " + std::to_string(attempts) + ": " + msg + (others.empty() ? "" : "; " + others);
}

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

/// Runs start(options, attempt) -> PoolOutcome, and again, with a new
/// attempt number (and maybe port), while a worker failed and restarts are
/// left. A timeout or a signal to the launcher ends the loop at once.
/// any_port: the user left the port to accel (master_port 0).
template <class Start>
ElasticOutcome run_elastic(LaunchOptions o, bool any_port, Start&& start,
                           std::ostream& log = std::cerr) {
  const int attempts = o.max_restarts + 1;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      const int port = restart_port(o, any_port);
      if (port != o.master_port && !any_port)
        log << "accel: port " << o.master_port << " is taken; the restarted processes meet on "
            << "port " << port << "." << std::endl;
      o.master_port = port;
    }
    PoolOutcome out = start(static_cast<const LaunchOptions&>(o), attempt);
    const bool failed = out.first_failure && !out.timed_out && out.interrupted_by == 0;
    if (!failed || attempt + 1 >= attempts) return {std::move(out), attempt};
    log << "accel: " << attempt_failure(out, attempt, attempts) << ". Restarting "
        << (o.num_processes == 1 ? std::string("the process")
                                 : "all " + std::to_string(o.num_processes) + " processes")
        << " (restart " << attempt + 1 << " of " << o.max_restarts << ")." << std::endl;
  }
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
