// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::notebook_launcher (also named accel::launch): run a
/// function in num_processes forked workers of this node, as Accelerate's
/// notebook_launcher does, and fail loudly and completely when one fails.
#ifndef ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP
#define ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/launch/detail/elastic.hpp>
#include <accel/launch/detail/ports.hpp>
#include <accel/launch/detail/posix.hpp>
#include <accel/launch/detail/rank_env.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/launch/launch_options.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel {

namespace detail::launch {

/// Restores the intra-op thread count of the calling process on scope exit.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : old_(at::get_num_threads()) { at::set_num_threads(n); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;
  ~ScopedThreads() { at::set_num_threads(old_); }

 private:
  int old_;
};

/// A worker's LibTorch error as users should read it. From LibTorch 2.0 on,
/// a process that ran backward() before forking has children whose autograd
/// refuses to run; say so in accel's terms, not only autograd's.
inline std::string worker_error_message(const c10::Error& e) {
  std::string msg = e.what_without_backtrace();
  if (msg.find("autograd's threading in combination with fork") == std::string::npos) return msg;
  return "accel: backward() cannot run in a worker forked by notebook_launcher: this process "
         "ran backward() before it launched, and LibTorch 2.x refuses autograd in processes "
         "forked after that. Call notebook_launcher before any backward() in this process, or "
         "start the processes with `accel launch` or mpirun. (LibTorch: " + msg + ")";
}

/// Runs body in one worker per local rank (one attempt of an elastic
/// launch) and waits until the pool's outcome.
template <class Body>
PoolOutcome run_pool(const Attempt& a, std::chrono::steady_clock::time_point deadline, Body& body) {
  const LaunchOptions& o = a.options;
  PoolOptions po;
  po.timeout = std::max(std::chrono::milliseconds(1),
                        std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now()));
  po.grace = o.stop_grace;
  po.prefix_output = o.prefix_output;
  if (o.monitor_interval) po.heartbeat_timeout = *o.monitor_interval;
  po.stop_requested = a.stop_requested;
  // Fork from a fresh thread that stays until the workers are reaped: GNU
  // OpenMP's thread pool lives in the forking thread, and a child forked from a
  // thread that already ran a parallel region hangs in its first one.
  return on_fresh_thread([&] {
    WorkerPool pool(po);
    for (int local = 0; local < o.num_processes; ++local) {
      EnvList env = rank_environment(o, local, a.job_id, a.index);
      env.emplace_back("ACCEL_FORK_LAUNCHED", "1");
      pool.spawn(o.node_rank * o.num_processes + local, env, [&, local] {
        at::set_num_threads(threads_per_worker(o.num_processes));
        try {
          body(local);
        } catch (const c10::Error& e) {
          // LibTorch's what() carries a C++ backtrace; the message is what users need.
          throw std::runtime_error(worker_error_message(e));
        }
      });
    }
    return pool.wait();
  });  // the pool restored the parent's signal handlers here
}

/// Turns the pool's outcome into the launcher's exceptions. `what` names the
/// launch in messages; `attempt` (0 first) is named when restarts were allowed.
inline void throw_on_failure(const PoolOutcome& out, const LaunchOptions& o, const char* what,
                             int attempt = 0) {
  if (out.interrupted_by != 0) {
    // Workers are stopped; now let the signal do what it would have done.
    std::raise(out.interrupted_by);
    throw Error(std::string("accel: ") + what + " was interrupted by " +
                signal_name(out.interrupted_by) + "; all " + std::to_string(o.num_processes) +
                " workers were stopped. Launch again when ready.");
  }
  if (out.first_failure && o.max_restarts > 0)
    throw LaunchError(out.first_failure->rank, out.first_failure->message, out.others_summary(),
                      attempt + 1, o.max_restarts + 1);
  if (out.first_failure)
    throw LaunchError(out.first_failure->rank, out.first_failure->message, out.others_summary());
  if (out.timed_out) {
    std::string ranks;
    for (int r : out.stopped_ranks()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw TimeoutError(std::string("accel: ") + what + " timed out after " +
                       std::to_string(o.timeout.count()) + " s (LaunchOptions::timeout) with " +
                       (ranks.empty() ? "no process" : "process(es) " + ranks) +
                       " still running; they were stopped. Raise the timeout or find why they "
                       "hang (ACCEL_DEBUG_MODE=yes checks the launch).");
  }
}

/// One attempt, its outcome turned into exceptions.
template <class Body>
void run_workers(const LaunchOptions& o, std::chrono::steady_clock::time_point deadline,
                 const char* what, Body&& body) {
  throw_on_failure(run_pool(Attempt{o, 0, new_job_id(o), {}}, deadline, body), o, what);
}

}  // namespace detail::launch

/// Runs fn(args...) in opts.num_processes forked workers on this node and
/// returns when all have finished. Each worker sees RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT and
/// ACCEL_FORK_LAUNCHED=1, and uses max(1, cores / num_processes) intra-op
/// threads unless OMP_NUM_THREADS is set. If a worker throws, exits non-zero
/// or dies by a signal, the others are stopped (SIGTERM, then SIGKILL after
/// stop_grace) and accel::LaunchError names the first failing rank and its
/// message; past opts.timeout accel::TimeoutError. One process on one node
/// runs fn in this process (no fork) with the same variables, restored after;
/// an exception then arrives as LaunchError(0, ...) nesting the original.
/// With opts.max_restarts = N > 0, a failure stops every worker and forks
/// the whole group again, up to N times, each attempt with
/// TORCHELASTIC_RESTART_COUNT = 0, 1, ... (accel::restart_count()) and a
/// usable port; the failure of attempt N+1 is the LaunchError, "process R
/// failed on attempt N+1 of N+1 (max_restarts = N): ...". Over several nodes
/// the launchers decide together: node 0's hosts their rendezvous on
/// master_port, the workers meet on master_port + 1 (or a free port), and a
/// failure on any node restarts all (docs/launching.md, "Fault tolerance"). With
/// opts.monitor_interval a worker that stops heart-beating is killed as hung
/// (a failure). With either, even one process is a forked worker.
template <class F, class... Args>
void notebook_launcher(F&& fn, std::tuple<Args...> args, LaunchOptions opts = {}) {
  namespace dl = detail::launch;
  // The timeout bounds the whole call, debug dry launch included.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::min<std::chrono::seconds>(opts.timeout, std::chrono::hours(24 * 36500));
  dl::validate(opts);
  std::optional<dl::RemoveAtExit> published;  // node 0's rendezvous file, removed when done
  const bool any_port = opts.master_port == 0;
  if (opts.master_port == 0 && opts.num_nodes > 1) {
    opts.master_port = dl::agree_on_free_port(*opts.rendezvous_file, opts.node_rank,
                                              opts.master_addr, deadline);
    if (opts.node_rank == 0) published.emplace(*opts.rendezvous_file);
  } else if (opts.master_port == 0) {
    opts.master_port = dl::pick_free_port(opts.master_addr);
  }

  // In this process unless a crash must be survivable (max_restarts) or a
  // hang detectable (monitor_interval).
  if (opts.num_processes == 1 && opts.num_nodes == 1 && opts.max_restarts == 0 &&
      !opts.monitor_interval) {
    dl::EnvList env = dl::rank_environment(opts, 0);
    dl::ScopedEnv scoped_env(env);
    dl::ScopedThreads threads(dl::threads_per_worker(1));
    try {
      std::apply(std::forward<F>(fn), std::move(args));
    } catch (const c10::Error& e) {
      std::throw_with_nested(LaunchError(0, e.what_without_backtrace()));
    } catch (const std::exception& e) {
      std::throw_with_nested(LaunchError(0, e.what()));
    }
    return;
  }

#if ACCEL_WITH_CUDA
  dl::refuse_fork_after_cuda();
#endif
  if (runtime::detail::getenv_flag("ACCEL_DEBUG_MODE")) {
    // Dry run first, as Accelerate's debug mode: spawn-time problems show up
    // as a clear error before any real work starts.
    if (opts.node_rank != 0) dl::check_reachable(opts.master_addr, opts.master_port, std::chrono::seconds(5));
    if (opts.node_rank == 0 && dl::bind_error(opts.master_addr, opts.master_port) == -EADDRINUSE)
      throw Error("accel: debug launch: master_port " + std::to_string(opts.master_port) +
                  " on " + opts.master_addr +
                  " is already in use. Pass another master_port, or 0 to pick a free one.");
    dl::run_workers(opts, deadline, "notebook_launcher's debug launch (ACCEL_DEBUG_MODE)",
                    [&](int local) { dl::check_worker_environment(opts, local); });
  }
  // Each attempt forks fresh workers from this process, so every attempt
  // starts from the same state: what the workers did (moving the arguments
  // out included) dies with them.
  auto body = [&](int) { std::apply(fn, std::move(args)); };
  const auto r = dl::run_elastic(
      opts, any_port, [&](const dl::Attempt& a) { return dl::run_pool(a, deadline, body); }, deadline);
  dl::throw_on_failure(r.outcome, opts, "notebook_launcher", r.attempt);
}

/// The same as notebook_launcher: the name to use outside notebooks.
template <class F, class... Args>
void launch(F&& fn, std::tuple<Args...> args, LaunchOptions opts = {}) {
  notebook_launcher(std::forward<F>(fn), std::move(args), std::move(opts));
}

}  // namespace accel

#endif  // ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP
