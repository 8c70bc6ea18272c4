// SPDX-License-Identifier: Apache-2.0
/// @file Defines the agents through which the launchers of several machines
/// run one elastic launch (LaunchOptions::max_restarts with num_nodes > 1):
/// machine 0's launcher hosts the rendezvous on master_addr:master_port, the
/// others connect to it; each attempt starts on every machine together, a
/// failure anywhere stops every machine's workers within seconds, and
/// machine 0 decides whether the group starts again. A machine whose launcher
/// is started again after it died rejoins the next attempt. Free of LibTorch.
///
/// Messages (agent_channel.hpp), client -> machine 0:
///   HELLO protocol node num_nodes processes_per_node max_restarts
///   RESULT attempt <workers>       this machine's workers after the attempt
///   ABORT text                     this launch was interrupted or timed out
/// machine 0 -> client:
///   START attempt worker_port job_id restart_reason
///   STOP attempt why               another machine failed: stop the workers
///   FINISH ok|failed|aborted attempt <workers> | text
///   REFUSE text                    this launcher cannot join (and why)
#ifndef ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP
#define ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <accel/errors.hpp>
#include <accel/launch/detail/agent_channel.hpp>
#include <accel/launch/detail/ports.hpp>
#include <accel/launch/detail/rank_env.hpp>
#include <accel/launch/detail/worker_pool.hpp>
#include <accel/launch/launch_options.hpp>
#include <accel/runtime/detail/tcp_probe.hpp>
#include <accel/runtime/detail/wait_reports.hpp>

namespace accel::detail::launch {

inline constexpr const char* kAgentProtocol = "accel-agent-1";

/// What the launchers agreed to do next.
struct AgentStep {
  bool finished = false;       ///< the launch is over; `outcome` says how
  int attempt = 0;             ///< the attempt to start (0 first), or the last one
  int worker_port = 0;         ///< where this attempt's workers meet (MASTER_PORT)
  std::string job_id;          ///< ACCEL_JOB_ID of every worker of the attempt
  std::string restart_reason;  ///< attempt > 0: why, as every machine prints it
  PoolOutcome outcome;         ///< finished: every machine's workers, and the cause
};

/// "process 1 failed on attempt 1 of 3: killed by signal SIGKILL; process 0 was stopped".
inline std::string attempt_failure(const PoolOutcome& out, int attempt, int attempts) {
  const auto& w = *out.first_failure;
  std::string msg = w.message.size() > 500 ? w.message.substr(0, 500) + "..." : w.message;
  const std::string others = out.others_summary();
  return "process " + std::to_string(w.rank) + " failed on attempt " + std::to_string(attempt + 1) +
         " of " + std::to_string(attempts) + ": " + msg + (others.empty() ? "" : "; " + others);
}

/// "Restarting all 4 processes on 2 machines (restart 1 of 3)."
inline std::string restarting(const LaunchOptions& o, int restart) {
  const int all = o.num_processes * o.num_nodes;
  return "Restarting " + (all == 1 ? std::string("the process") : "all " + std::to_string(all) + " processes") +
         (o.num_nodes > 1 ? " on " + std::to_string(o.num_nodes) + " machines" : "") + " (restart " +
         std::to_string(restart) + " of " + std::to_string(o.max_restarts) + ").";
}

namespace agent {

using Clock = std::chrono::steady_clock;

/// Workers as message fields: the count, then rank, pid, status, code, message of each.
inline void put_workers(AgentMessage& m, const std::vector<WorkerResult>& workers) {
  m.push_back(std::to_string(workers.size()));
  for (const auto& w : workers) {
    m.push_back(std::to_string(w.rank));
    m.push_back(std::to_string(w.pid));
    m.push_back(std::to_string(static_cast<int>(w.status)));
    m.push_back(std::to_string(w.code));
    m.push_back(w.message);
  }
}

inline int to_int(const std::string& s) {
  std::size_t used = 0;
  const int v = std::stoi(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}

/// The inverse of put_workers from field `at`; throws std::exception on a malformed message.
inline std::vector<WorkerResult> get_workers(const AgentMessage& m, std::size_t at) {
  const int n = to_int(m.at(at));
  if (n < 0 || m.size() < at + 1 + 5 * static_cast<std::size_t>(n)) throw std::out_of_range("workers");
  std::vector<WorkerResult> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const std::size_t f = at + 1 + 5 * static_cast<std::size_t>(i);
    auto& w = out[static_cast<std::size_t>(i)];
    w.rank = to_int(m[f]);
    w.pid = to_int(m[f + 1]);
    const int status = to_int(m[f + 2]);
    if (status < 0 || status > static_cast<int>(WorkerStatus::Stopped)) throw std::out_of_range("status");
    w.status = static_cast<WorkerStatus>(status);
    w.code = to_int(m[f + 3]);
    w.message = m[f + 4];
  }
  return out;
}

/// One machine's part of an attempt, in the order machine 0 learned of them.
struct MachineResult {
  int node = 0;
  std::vector<WorkerResult> workers;
  std::optional<int> cause_rank;  ///< the machine's own first failure
};

/// Every machine's workers as one outcome, rank order; the cause is the first
/// failure (in the order reported) that did not fail because of another process.
inline PoolOutcome combine(const std::vector<MachineResult>& results) {
  PoolOutcome out;
  std::vector<WorkerResult> candidates;
  for (const auto& r : results) {
    for (const auto& w : r.workers) out.workers.push_back(w);
    for (const auto& w : r.workers)
      if (r.cause_rank && w.rank == *r.cause_rank) candidates.push_back(w);
  }
  for (const auto& r : results)
    for (const auto& w : r.workers)
      if (w.failed() && !(r.cause_rank && w.rank == *r.cause_rank)) candidates.push_back(w);
  std::sort(out.workers.begin(), out.workers.end(),
            [](const WorkerResult& a, const WorkerResult& b) { return a.rank < b.rank; });
  const auto own = std::find_if(candidates.begin(), candidates.end(), [](const WorkerResult& w) {
    return !accel::detail::caused_by_another_process(w.message);
  });
  if (own != candidates.end()) out.first_failure = *own;
  else if (!candidates.empty()) out.first_failure = candidates.front();
  return out;
}

inline MachineResult local_result(int node, const PoolOutcome& out) {
  MachineResult r{node, out.workers, std::nullopt};
  if (out.first_failure) r.cause_rank = out.first_failure->rank;
  return r;
}

/// A machine whose launcher disappeared during an attempt: one failed worker
/// (its first rank) that says so.
inline MachineResult lost_machine(const LaunchOptions& o, int node, const std::string& why) {
  WorkerResult w;
  w.rank = node * o.num_processes;
  w.status = WorkerStatus::Exited;
  w.code = 1;
  const int last = w.rank + o.num_processes - 1;
  w.message = "machine " + std::to_string(node) + " (process" +
              (last == w.rank ? " " + std::to_string(w.rank)
                              : "es " + std::to_string(w.rank) + "-" + std::to_string(last)) +
              ") was lost: " + why;
  return {node, {w}, w.rank};
}

/// "1, 3" (machines not yet there).
inline std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace agent

/// The launcher's side of a launch over several machines.
class NodeAgent {
 public:
  virtual ~NodeAgent() = default;
  /// Blocks until the next attempt starts on every machine, or the launch is over.
  virtual AgentStep next() = 0;
  /// Polled while this machine's workers run: why they must stop (another
  /// machine failed or was lost), or nothing.
  virtual std::optional<std::string> stop_requested() = 0;
  /// This machine's workers after the attempt (ended, failed or stopped).
  virtual void finish_attempt(const PoolOutcome& local) = 0;
  /// This launch was interrupted or timed out: tell the others to stop.
  virtual void abort(const std::string& why) = 0;
};

/// Machine 0: hosts the rendezvous, collects every machine's result, decides.
class AgentServer final : public NodeAgent {
 public:
  AgentServer(LaunchOptions o, bool any_port, agent::Clock::time_point deadline,
              std::chrono::seconds rdzv_timeout, std::ostream& log)
      : o_(std::move(o)), any_port_(any_port), deadline_(deadline), rdzv_timeout_(rdzv_timeout),
        log_(log), members_(static_cast<std::size_t>(o_.num_nodes), -1) {
    const int fd = bind_tcp(o_.master_addr, o_.master_port);
    if (fd < 0)
      throw Error("accel: machine 0 cannot host the rendezvous of the launchers on " + o_.master_addr +
                  ":" + std::to_string(o_.master_port) + " (" + std::strerror(-fd) + "). " +
                  (fd == -EADDRINUSE ? "Another program holds the port: pick another "
                                       "--main_process_port (master_port) on every machine."
                                     : "Check --main_process_ip (master_addr): it must be an "
                                       "address of machine 0."));
    listener_ = Fd(fd);
    ::listen(fd, 64);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }

  AgentStep next() override {
    if (attempt_ >= 0) {
      collect_results();
      if (abort_) {
        broadcast({"FINISH", "aborted", *abort_});
        throw Error("accel: " + *abort_ + "; every machine's processes were stopped.");
      }
      PoolOutcome all = agent::combine(results_);
      if (all.ok() || attempt_ >= o_.max_restarts) {
        AgentMessage m{"FINISH", all.ok() ? "ok" : "failed", std::to_string(attempt_)};
        agent::put_workers(m, all.workers);
        m.push_back(all.first_failure ? std::to_string(all.first_failure->rank) : "-1");
        broadcast(m);
        return finished(std::move(all));
      }
      reason_ = attempt_failure(all, attempt_, o_.max_restarts + 1) + ". " + restarting(o_, attempt_ + 1);
    }
    wait_for_machines();
    ++attempt_;
    results_.clear();
    stop_sent_ = false;
    const int port = worker_port();
    const std::string job = random_job_id();
    broadcast({"START", std::to_string(attempt_), std::to_string(port), job, reason_});
    AgentStep s;
    s.attempt = attempt_;
    s.worker_port = port;
    s.job_id = job;
    s.restart_reason = reason_;
    return s;
  }

  std::optional<std::string> stop_requested() override {
    accept_and_read(0);
    if (!stop_sent_) return std::nullopt;
    return why_stop_;
  }

  void finish_attempt(const PoolOutcome& local) override {
    results_.push_back(agent::local_result(0, local));
    note_failures();
  }

  void abort(const std::string& why) override { broadcast({"FINISH", "aborted", "machine 0's " + why}); }

 private:
  struct Peer {
    AgentChannel channel;
    int node = -1;  ///< -1 until its HELLO
  };

  AgentStep finished(PoolOutcome all) {
    AgentStep s;
    s.finished = true;
    s.attempt = attempt_;
    s.outcome = std::move(all);
    return s;
  }

  bool has_result(int node) const {
    return std::any_of(results_.begin(), results_.end(),
                       [&](const agent::MachineResult& r) { return r.node == node; });
  }

  /// Waits until every machine reported this attempt (or was lost).
  void collect_results() {
    for (;;) {
      // A machine that left without a result (its launch was interrupted) has none to give.
      bool all = has_result(0);
      for (int n = 1; n < o_.num_nodes; ++n)
        all = all && (has_result(n) || members_[static_cast<std::size_t>(n)] < 0);
      if (all) return;
      if (agent::Clock::now() >= deadline_)
        throw TimeoutError("accel: machine 0 waited for the other machines to report attempt " +
                           std::to_string(attempt_ + 1) + " until the launch timeout. Check that "
                           "their launchers still run.");
      accept_and_read(50);
    }
  }

  /// Before an attempt: every machine's launcher is connected.
  void wait_for_machines() {
    const auto start = agent::Clock::now();
    const auto until = std::min(deadline_, start + rdzv_timeout_);
    const auto bound = std::chrono::duration_cast<std::chrono::seconds>(until - start).count();
    runtime::detail::WaitReports reports(start);
    for (;;) {
      accept_and_read(0);
      std::vector<int> missing;
      for (int n = 1; n < o_.num_nodes; ++n)
        if (members_[static_cast<std::size_t>(n)] < 0) missing.push_back(n);
      if (missing.empty()) return;
      const std::string who = std::string(missing.size() == 1 ? "machine " : "machines ") +
                              agent::list(missing);
      if (agent::Clock::now() >= until) {
        const std::string text = who + " did not " + (attempt_ < 0 ? "join" : "rejoin") +
                                 " the launch at " + o_.master_addr + ":" + std::to_string(o_.master_port) +
                                 " within " + std::to_string(reports.seconds()) + " s";
        broadcast({"FINISH", "aborted", text});
        throw TimeoutError("accel: " + text + " (the rendezvous timeout, --rdzv_timeout / "
                           "ACCEL_RDZV_TIMEOUT). Start the launch on " + who + " with the same "
                           "--main_process_ip and --main_process_port, or launch on fewer machines.");
      }
      if (reports.due())
        log_ << "accel: machine 0 waiting at " << o_.master_addr << ":" << o_.master_port << " for "
             << who << (attempt_ < 0 ? " to join" : " to rejoin for restart " + std::to_string(attempt_ + 1))
             << " (" << (o_.num_nodes - static_cast<int>(missing.size())) << " of " << o_.num_nodes
             << " machines there, " << reports.seconds() << " s of " << bound << " s)." << std::endl;
      accept_and_read(50);
    }
  }

  /// Where the workers of the next attempt meet: master_port + 1 when it is
  /// free (the usual second port to open in a firewall), else a free port.
  int worker_port() const {
    if (!any_port_ && o_.master_port < 65535) {
      const int fd = bind_tcp(o_.master_addr, o_.master_port + 1);
      if (fd >= 0) {
        ::close(fd);
        return o_.master_port + 1;
      }
    }
    return pick_free_port(o_.master_addr);
  }

  void broadcast(const AgentMessage& m) {
    for (auto& p : peers_)
      if (p.node > 0) p.channel.send(m);
  }

  void accept_and_read(int ms) {
    std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
    for (auto& p : peers_) fds.push_back({p.channel.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), ms) <= 0) return;
    // Existing connections first: a machine that died and was started again
    // is seen gone before its new launcher says hello.
    for (std::size_t i = 0; i < peers_.size(); ++i) {
      Peer& p = peers_[i];
      std::vector<AgentMessage> msgs;
      const bool open = p.channel.receive(msgs);
      for (const auto& m : msgs) handle(p, m);
      if (!open || !p.channel.open()) drop(p);
    }
    peers_.erase(std::remove_if(peers_.begin(), peers_.end(), [](const Peer& p) { return !p.channel.open(); }),
                 peers_.end());
    reindex();
    for (;;) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      peers_.push_back(Peer{AgentChannel(Fd(fd)), -1});
    }
    reindex();
    note_failures();
  }

  void reindex() {
    std::fill(members_.begin(), members_.end(), -1);
    for (std::size_t i = 0; i < peers_.size(); ++i)
      if (peers_[i].node > 0 && peers_[i].channel.open()) members_[static_cast<std::size_t>(peers_[i].node)] = static_cast<int>(i);
  }

  void refuse(Peer& p, const std::string& why) {
    p.channel.send({"REFUSE", why});
    p.channel.close();
  }

  void handle(Peer& p, const AgentMessage& m) {
    try {
      if (m.at(0) == "HELLO") {
        const int node = agent::to_int(m.at(2));
        if (m.at(1) != kAgentProtocol) return refuse(p, "it speaks another protocol (" + m[1] + ")");
        if (agent::to_int(m.at(3)) != o_.num_nodes || agent::to_int(m.at(4)) != o_.num_processes)
          return refuse(p, "machine " + m[2] + " was started for " + m[3] + " machines with " + m[4] +
                               " processes each; machine 0 for " + std::to_string(o_.num_nodes) +
                               " with " + std::to_string(o_.num_processes) + ". Give every machine the "
                               "same --num_machines and --num_processes");
        if (node < 1 || node >= o_.num_nodes)
          return refuse(p, "machine rank " + m[2] + " is not in 1.." + std::to_string(o_.num_nodes - 1));
        reindex();
        if (members_[static_cast<std::size_t>(node)] >= 0)
          return refuse(p, "machine " + m[2] + " is already in this launch. Give every machine its own "
                           "--machine_rank (node_rank)");
        p.node = node;
        if (attempt_ >= 0)
          log_ << "accel: machine " << node << " joined; it takes part from the next attempt." << std::endl;
      } else if (m.at(0) == "RESULT" && p.node > 0) {
        if (agent::to_int(m.at(1)) != attempt_ || has_result(p.node)) return;
        agent::MachineResult r{p.node, agent::get_workers(m, 2), std::nullopt};
        const std::size_t at = 3 + 5 * r.workers.size();
        if (m.size() > at && m[at] != "-1") r.cause_rank = agent::to_int(m[at]);
        results_.push_back(std::move(r));
      } else if (m.at(0) == "ABORT" && p.node > 0) {
        abort_ = "machine " + std::to_string(p.node) + "'s " + m.at(1);
        stop_everyone("machine " + std::to_string(p.node) + "'s launch was stopped");
      }
    } catch (const std::exception&) {
      p.channel.close();  // not an accel launcher, or a different version
    }
  }

  /// A member's connection closed: during an attempt that it has not
  /// reported, the machine is lost (a failure of that attempt).
  void drop(Peer& p) {
    p.channel.close();
    if (p.node <= 0 || attempt_ < 0 || has_result(p.node) || abort_) return;
    results_.push_back(agent::lost_machine(o_, p.node,
                                           "its launcher's connection to machine 0 closed (the "
                                           "machine died, or its launch was killed)"));
  }

  /// The first failure of an attempt stops every machine's workers.
  void note_failures() {
    if (stop_sent_ || attempt_ < 0) return;
    for (const auto& r : results_) {
      if (!r.cause_rank) continue;
      stop_everyone("process " + std::to_string(*r.cause_rank) + " on machine " + std::to_string(r.node) +
                    " failed");
      return;
    }
  }

  void stop_everyone(const std::string& why) {
    if (stop_sent_) return;
    stop_sent_ = true;
    why_stop_ = why;
    broadcast({"STOP", std::to_string(attempt_), why});
  }

  LaunchOptions o_;
  bool any_port_;
  agent::Clock::time_point deadline_;
  std::chrono::seconds rdzv_timeout_;
  std::ostream& log_;
  Fd listener_;
  std::vector<Peer> peers_;
  std::vector<int> members_;  ///< node -> index in peers_, -1 if not connected
  int attempt_ = -1;
  std::vector<agent::MachineResult> results_;  ///< this attempt's, in the order learned
  bool stop_sent_ = false;
  std::string why_stop_;
  std::string reason_;                ///< why the attempt about to start is a restart
  std::optional<std::string> abort_;  ///< a machine's launch was interrupted or timed out
};

/// Machines 1..N-1: connect to machine 0's launcher, follow its decisions.
class AgentClient final : public NodeAgent {
 public:
  AgentClient(LaunchOptions o, agent::Clock::time_point deadline, std::chrono::seconds rdzv_timeout,
              std::ostream& log)
      : o_(std::move(o)), deadline_(deadline), log_(log) {
    const auto until = std::min(deadline_, agent::Clock::now() + rdzv_timeout);
    runtime::detail::WaitReports reports(agent::Clock::now());
    for (;;) {
      int err = 0;
      const int fd = runtime::detail::connect_tcp(o_.master_addr, o_.master_port, std::chrono::seconds(2), err);
      if (fd >= 0) {
        channel_ = AgentChannel(Fd(fd));
        break;
      }
      if (err == EADDRNOTAVAIL)
        throw Error("accel: machine " + std::to_string(o_.node_rank) + " cannot resolve the address of "
                    "machine 0, '" + o_.master_addr + "'. Give --main_process_ip (master_addr) as an IP "
                    "address or a host name this machine resolves.");
      if (agent::Clock::now() >= until)
        throw TimeoutError("accel: machine " + std::to_string(o_.node_rank) + " could not reach machine "
                           "0's launcher at " + where() + " within " + std::to_string(reports.seconds()) +
                           " s (" + std::strerror(err) + "; the rendezvous timeout, --rdzv_timeout / "
                           "ACCEL_RDZV_TIMEOUT). Start the launch on machine 0 too, and check "
                           "--main_process_ip and --main_process_port.");
      if (reports.due())
        log_ << "accel: machine " << o_.node_rank << " waiting for machine 0's launcher at " << where()
             << " (" << std::strerror(err) << ", " << reports.seconds() << " s)." << std::endl;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    channel_.send({"HELLO", kAgentProtocol, std::to_string(o_.node_rank), std::to_string(o_.num_nodes),
                   std::to_string(o_.num_processes), std::to_string(o_.max_restarts)});
  }

  AgentStep next() override {
    for (;;) {
      for (; !pending_.empty(); pending_.erase(pending_.begin())) {
        const AgentMessage& m = pending_.front();
        if (m.empty()) continue;
        if (m[0] == "REFUSE")
          throw Error("accel: machine 0 refused machine " + std::to_string(o_.node_rank) + ": " +
                      m.at(1) + ".");
        if (m[0] == "START" && agent::to_int(m.at(1)) > attempt_) {
          attempt_ = agent::to_int(m[1]);
          stop_.reset();
          AgentStep s;
          s.attempt = attempt_;
          s.worker_port = agent::to_int(m.at(2));
          s.job_id = m.at(3);
          s.restart_reason = m.at(4);
          pending_.erase(pending_.begin());
          return s;
        }
        if (m[0] == "FINISH") return finish(m);
      }
      if (!channel_.open()) throw lost();
      if (agent::Clock::now() >= deadline_)
        throw TimeoutError("accel: machine " + std::to_string(o_.node_rank) + " waited for machine 0 "
                           "until the launch timeout.");
      channel_.wait_readable(100);
      channel_.receive(pending_);
    }
  }

  std::optional<std::string> stop_requested() override {
    if (stop_) return stop_;
    const bool open = channel_.receive(pending_);
    for (const auto& m : pending_) {
      if (m.size() >= 3 && m[0] == "STOP" && m[1] == std::to_string(attempt_)) stop_ = m[2];
      if (m.size() >= 3 && m[0] == "FINISH" && m[1] == "aborted") stop_ = m[2];
    }
    if (!stop_ && !open) stop_ = "lost the connection to machine 0's launcher";
    return stop_;
  }

  void finish_attempt(const PoolOutcome& local) override {
    AgentMessage m{"RESULT", std::to_string(attempt_)};
    agent::put_workers(m, local.workers);
    m.push_back(local.first_failure ? std::to_string(local.first_failure->rank) : "-1");
    channel_.send(m);
  }

  void abort(const std::string& why) override {
    channel_.send({"ABORT", why});
    channel_.close();
  }

 private:
  std::string where() const { return o_.master_addr + ":" + std::to_string(o_.master_port); }

  Error lost() const {
    return Error("accel: machine " + std::to_string(o_.node_rank) + " lost the connection to machine "
                 "0's launcher at " + where() + " (machine 0 died, or its launch was stopped); this "
                 "machine's processes were stopped. Look at machine 0's output, and start the launch "
                 "again on every machine (load_latest_state() resumes from the newest checkpoint).");
  }

  AgentStep finish(const AgentMessage& m) {
    if (m.at(1) == "aborted")
      throw Error("accel: the launch was ended: " + m.at(2) + "; machine " + std::to_string(o_.node_rank) +
                  "'s processes were stopped.");
    AgentStep s;
    s.finished = true;
    s.attempt = agent::to_int(m.at(2));
    s.outcome.workers = agent::get_workers(m, 3);
    const std::size_t at = 4 + 5 * s.outcome.workers.size();
    const int cause = m.size() > at ? agent::to_int(m[at]) : -1;
    for (const auto& w : s.outcome.workers)
      if (w.rank == cause) s.outcome.first_failure = w;
    if (m[1] == "failed" && !s.outcome.first_failure)
      throw Error("accel: machine 0 reported a failed launch without its cause. Look at machine 0's output.");
    return s;
  }

  LaunchOptions o_;
  agent::Clock::time_point deadline_;
  std::ostream& log_;
  AgentChannel channel_;
  std::vector<AgentMessage> pending_;
  int attempt_ = -1;
  std::optional<std::string> stop_;
};

/// Machine 0's agent on node 0, a client of it on the others.
inline std::unique_ptr<NodeAgent> make_node_agent(const LaunchOptions& o, bool any_port,
                                                  agent::Clock::time_point deadline,
                                                  std::chrono::seconds rdzv_timeout, std::ostream& log) {
  if (o.node_rank == 0) return std::make_unique<AgentServer>(o, any_port, deadline, rdzv_timeout, log);
  return std::make_unique<AgentClient>(o, deadline, rdzv_timeout, log);
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP
