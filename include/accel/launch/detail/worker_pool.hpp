// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::launch::WorkerPool, the process supervisor shared
/// by notebook_launcher (fork and run a C++ function) and the `accel launch`
/// command (fork and exec a program): it starts workers, waits for them with a
/// deadline, stops all of them when one fails, and never leaves one behind.
#ifndef ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP
#define ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <accel/errors.hpp>
#include <accel/launch/detail/posix.hpp>

extern char** environ;

namespace accel::detail::launch {

/// How a worker ended (or that it has not yet).
enum class WorkerStatus { Running, Succeeded, Threw, Exited, Signaled, Stopped };

struct WorkerResult {
  int rank = -1;
  pid_t pid = -1;
  WorkerStatus status = WorkerStatus::Running;
  int code = 0;         ///< exit status, or the signal number (Signaled, Stopped)
  std::string message;  ///< exception text, "exited with status N", "killed by signal SIGSEGV"

  bool failed() const {
    return status == WorkerStatus::Threw || status == WorkerStatus::Exited ||
           status == WorkerStatus::Signaled;
  }
  /// Shell convention: 0, the exit status, or 128 + signal.
  int exit_code() const {
    if (status == WorkerStatus::Signaled || status == WorkerStatus::Stopped) return 128 + code;
    return code;
  }
};

struct PoolOutcome {
  std::vector<WorkerResult> workers;          ///< in spawn order
  /// The cause: the first worker seen failing by itself, not because another
  /// one did (accel::detail::caused_by_another_process); else the first seen.
  std::optional<WorkerResult> first_failure;
  bool timed_out = false;                     ///< the pool's deadline passed first
  int interrupted_by = 0;                     ///< signal this process received (SIGINT...), 0 if none
  /// PoolOptions::stop_requested stopped the workers (another machine failed): why.
  std::optional<std::string> stopped_because;

  bool ok() const { return !first_failure && !timed_out && interrupted_by == 0 && !stopped_because; }
  /// For a command-line launcher: 128+signal if interrupted, 124 on timeout,
  /// else the first failure's exit code (at least 1), else 0.
  int exit_code() const {
    if (interrupted_by != 0) return 128 + interrupted_by;
    if (timed_out) return 124;
    if (first_failure) return std::max(1, first_failure->exit_code());
    return stopped_because ? 1 : 0;
  }
  /// What became of the others: "process 0 failed because of it; process 2
  /// was stopped", or "" when there were no others. A process that failed by
  /// itself too is listed with its own message.
  std::string others_summary() const {
    std::vector<int> because, stopped;
    std::string independent;
    for (const auto& w : workers) {
      if (first_failure && w.rank == first_failure->rank) continue;
      if (w.status == WorkerStatus::Stopped || w.status == WorkerStatus::Running) {
        stopped.push_back(w.rank);
      } else if (w.failed() && accel::detail::caused_by_another_process(w.message)) {
        because.push_back(w.rank);
      } else if (w.failed()) {
        const std::string msg = w.message.size() > 300 ? w.message.substr(0, 300) + "..." : w.message;
        independent += (independent.empty() ? "" : "; ") + std::string("process ") +
                       std::to_string(w.rank) + " failed too: " + msg;
      }
    }
    const auto join = [](const std::vector<int>& ranks, const char* one, const char* many) {
      std::string s = ranks.size() == 1 ? "process " : "processes ";
      for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
      return s + (ranks.size() == 1 ? one : many);
    };
    std::string out;
    const auto add = [&out](const std::string& part) { out += (out.empty() ? "" : "; ") + part; };
    if (!because.empty()) add(join(because, " failed because of it", " failed because of it"));
    if (!independent.empty()) add(independent);
    if (!stopped.empty()) add(join(stopped, " was stopped", " were stopped"));
    return out;
  }
  /// Ranks that were still running when the pool stopped them.
  std::vector<int> stopped_ranks() const {
    std::vector<int> r;
    for (const auto& w : workers)
      if (w.status == WorkerStatus::Stopped || w.status == WorkerStatus::Running) r.push_back(w.rank);
    return r;
  }
};

struct PoolOptions {
  /// Bound on the whole run, from the pool's construction to the end of wait().
  std::chrono::milliseconds timeout{std::chrono::seconds{1800}};
  /// Between SIGTERM and SIGKILL when stopping workers.
  std::chrono::milliseconds grace{std::chrono::seconds{5}};
  /// After a first failure, how long the others may take to end by
  /// themselves before they are stopped: processes that fail because of it
  /// then say so, and the report names the one that failed first by itself.
  std::chrono::milliseconds settle{std::chrono::seconds{2}};
  /// Capture each worker's stdout/stderr and forward it line by line, prefixed.
  bool prefix_output = false;
  /// Where captured lines go (stream 1 or 2); default: "[rank N] line" to this
  /// process's stdout/stderr, one write per line so ranks never interleave mid-line.
  std::function<void(int rank, int stream, std::string_view line)> on_output;
  /// SIGINT/SIGTERM/SIGHUP to this process stop the workers and end wait().
  bool handle_signals = true;
  /// Hang detection (LaunchOptions::monitor_interval): each worker gets a file
  /// (ACCEL_HEARTBEAT_FILE) whose time runtime::heartbeat() advances. A worker
  /// that has beaten and then does not for this long is killed (SIGKILL) and
  /// counts as failed. Workers that never beat are never judged.
  std::optional<std::chrono::milliseconds> heartbeat_timeout;
  /// Polled while the workers run (every 20 ms at most): a reason stops them
  /// all, as a failure would (a launch over several machines, another failed).
  std::function<std::optional<std::string>()> stop_requested;
};

/// "[rank 3] " + line: the default prefix of forwarded output.
inline std::string prefixed_line(int rank, std::string_view line) {
  std::string s = "[rank " + std::to_string(rank) + "] ";
  s.append(line);
  s.push_back('\n');
  return s;
}

class WorkerPool {
 public:
  explicit WorkerPool(PoolOptions options = {})
      : options_(std::move(options)), start_(Clock::now()) {
    if (options_.handle_signals) signals_.emplace();
    if (options_.heartbeat_timeout) make_heartbeat_dir();
    // With SIGCHLD ignored the kernel reaps children itself and waitpid could
    // not report how they ended: use the default while the pool lives.
    struct sigaction current {};
    if (::sigaction(SIGCHLD, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      ::sigaction(SIGCHLD, &dfl, &old_sigchld_);
      restore_sigchld_ = true;
    }
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  /// Stops and reaps whatever is still running.
  ~WorkerPool() {
    try {
      if (running() > 0) stop_all();
    } catch (...) {
    }
    if (restore_sigchld_) ::sigaction(SIGCHLD, &old_sigchld_, nullptr);
    if (!heartbeat_dir_.empty()) {
      for (const auto& w : workers_)
        if (!w.heartbeat.empty()) ::unlink(w.heartbeat.c_str());
      ::rmdir(heartbeat_dir_.c_str());
    }
  }

  /// Forks a worker that sets `env`, runs `fn` and exits: 0 on return; on an
  /// exception, its what() goes to the parent and the exit status is 1. The
  /// child never returns into the caller and never runs atexit handlers.
  pid_t spawn(int rank, const EnvList& given, std::function<void()> fn) {
    const EnvList env = with_heartbeat(rank, given);
    return fork_worker(rank, [&](int err_fd) {
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      int code = 0;
      try {
        fn();
      } catch (const std::exception& e) {
        report(err_fd, e.what());
        code = 1;
      } catch (...) {
        report(err_fd, "unknown exception (not derived from std::exception)");
        code = 1;
      }
      flush_stdio();
      ::_exit(code);
    });
  }

  /// Forks a worker that execs argv (argv[0] searched in PATH) with this
  /// process's environment plus `env`. Exec failure: status 127 and a message.
  pid_t spawn_exec(int rank, const EnvList& given, const std::vector<std::string>& argv) {
    if (argv.empty())
      throw Error("accel: spawn_exec() got an empty command line. Pass the program to run first.");
    const EnvList env = with_heartbeat(rank, given);
    // Everything is prepared before fork: the child only makes async-signal-safe calls.
    std::vector<std::string> envs;
    for (char** e = environ; e && *e; ++e) {
      std::string_view entry(*e);
      std::string_view key = entry.substr(0, entry.find('='));
      bool overridden = false;
      for (const auto& kv : env) overridden = overridden || kv.first == key;
      if (!overridden) envs.emplace_back(entry);
    }
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
    cargv.push_back(nullptr);
    cenv.push_back(nullptr);
    const std::string failure = "cannot execute '" + argv[0] + "': ";
    return fork_worker(rank, [&](int err_fd) {
      ::execvpe(cargv[0], cargv.data(), cenv.data());
      const char* why = std::strerror(errno);
      write_all(err_fd, failure.data(), failure.size());
      write_all(err_fd, why, std::strlen(why));
      ::_exit(127);
    });
  }

  /// Waits until every worker has ended, one failed (the others are then
  /// stopped), the deadline passed, or this process got SIGINT/SIGTERM/SIGHUP.
  /// Everything has been reaped when it returns (unless stuck in the kernel).
  PoolOutcome wait() {
    PoolOutcome out;
    const auto deadline = start_ + options_.timeout;
    std::vector<std::size_t> failed;  // in the order seen
    while (running() > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pump(static_cast<int>(std::clamp<long long>(left.count(), 0, 20)));
      for (std::size_t i : reap())
        if (workers_[i].result.failed()) failed.push_back(i);
      if (failed.empty() && options_.heartbeat_timeout) check_heartbeats();
      if (!failed.empty()) {
        settle(failed);
        stop_all();
        break;
      }
      if (int sig = signals_ ? StopSignalGuard::received() : 0; sig != 0) {
        out.interrupted_by = sig;
        stop_all(sig);  // forwarded as received: Ctrl-C reaches the workers as SIGINT
        break;
      }
      if (running() > 0 && Clock::now() >= deadline) {
        out.timed_out = true;
        stop_all();
        break;
      }
      if (options_.stop_requested && running() > 0) {
        if (auto why = options_.stop_requested()) {
          out.stopped_because = std::move(why);
          stop_all();
          break;
        }
      }
    }
    pump(0);
    for (auto& w : workers_) {
      flush_partial(w);
      out.workers.push_back(w.result);
    }
    if (!failed.empty()) {
      const auto cause = std::find_if(failed.begin(), failed.end(), [&](std::size_t i) {
        return !accel::detail::caused_by_another_process(workers_[i].result.message);
      });
      out.first_failure = workers_[cause != failed.end() ? *cause : failed.front()].result;
    }
    return out;
  }

  /// Lets the other workers end by themselves for up to options_.settle,
  /// adding those that fail to `failed`.
  void settle(std::vector<std::size_t>& failed) {
    const auto until = Clock::now() + options_.settle;
    while (running() > 0 && Clock::now() < until) {
      pump(10);
      for (std::size_t i : reap())
        if (workers_[i].result.failed()) failed.push_back(i);
    }
  }

  /// `first` (SIGTERM) to every running worker's process group, SIGKILL to
  /// those still there after the grace period, and reap them (bounded wait).
  void stop_all(int first = SIGTERM) {
    stopping_ = true;
    signal_running(first);
    wait_until(Clock::now() + options_.grace);
    if (running() > 0) {
      signal_running(SIGKILL);
      wait_until(Clock::now() + std::chrono::seconds(10));
    }
  }

  std::size_t running() const {
    std::size_t n = 0;
    for (const auto& w : workers_) n += w.result.status == WorkerStatus::Running;
    return n;
  }
  std::size_t size() const { return workers_.size(); }
  std::vector<pid_t> pids() const {
    std::vector<pid_t> p;
    for (const auto& w : workers_) p.push_back(w.result.pid);
    return p;
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Worker {
    WorkerResult result;
    Fd err, out, errout;  // parent's read ends: error report, captured stdout/stderr
    std::string err_text, out_buf, errout_buf;
    std::string heartbeat;   ///< its ACCEL_HEARTBEAT_FILE, "" without hang detection
    timespec created{};      ///< the file's time before the worker started
    bool beating = false;    ///< it has beaten at least once
    double hung_for = 0;     ///< > 0: killed as hung after this many seconds without a beat
  };

  using RealClock = std::chrono::system_clock;

  void make_heartbeat_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                          "/accel-heartbeat-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr)
      throw Error(std::string("accel: cannot create a directory for the heartbeat files of hang "
                              "detection (") + std::strerror(errno) + "). Set TMPDIR to a "
                  "writable directory, or launch without a monitor interval.");
    heartbeat_dir_ = pattern;
  }

  /// env plus this worker's heartbeat file (created now, its time remembered).
  EnvList with_heartbeat(int rank, const EnvList& env) {
    pending_heartbeat_.clear();
    if (heartbeat_dir_.empty()) return env;
    const std::string path = heartbeat_dir_ + "/rank_" + std::to_string(rank) + "_" +
                             std::to_string(workers_.size());
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      const int e = errno;
      if (fd >= 0) ::close(fd);
      throw Error("accel: cannot create the heartbeat file '" + path + "' (" + std::strerror(e) +
                  "). Set TMPDIR to a writable directory, or launch without a monitor interval.");
    }
    ::close(fd);
    pending_heartbeat_ = path;
    pending_created_ = st.st_mtim;
    EnvList out = env;
    out.emplace_back("ACCEL_HEARTBEAT_FILE", path);
    return out;
  }

  /// Kills the worker that has gone longest without a beat, if that is more
  /// than the timeout (one at a time: the others, blocked in a collective
  /// with it, stop beating too, and are the ones that failed because of it).
  void check_heartbeats() {
    const auto now = Clock::now();
    if (now - last_heartbeat_check_ < std::chrono::milliseconds(100)) return;
    last_heartbeat_check_ = now;
    const double limit = std::chrono::duration<double>(*options_.heartbeat_timeout).count();
    const double wall = std::chrono::duration<double>(RealClock::now().time_since_epoch()).count();
    Worker* worst = nullptr;
    double worst_age = limit;
    for (auto& w : workers_) {
      if (w.result.status != WorkerStatus::Running || w.heartbeat.empty() || w.hung_for > 0) continue;
      struct stat st {};
      if (::stat(w.heartbeat.c_str(), &st) != 0) continue;
      if (!w.beating) {
        w.beating = st.st_mtim.tv_sec != w.created.tv_sec || st.st_mtim.tv_nsec != w.created.tv_nsec;
        if (!w.beating) continue;
      }
      const double age = wall - (static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec * 1e-9);
      if (age > worst_age) {
        worst = &w;
        worst_age = age;
      }
    }
    if (worst == nullptr) return;
    worst->hung_for = worst_age;
    if (::kill(-worst->result.pid, SIGKILL) != 0) ::kill(worst->result.pid, SIGKILL);
  }

  static void report(int fd, const char* what) noexcept {
    std::size_t n = std::min<std::size_t>(std::strlen(what), 64 * 1024);
    if (n == 0) {
      what = "an exception with an empty message";
      n = std::strlen(what);
    }
    write_all(fd, what, n);
  }

  static void flush_stdio() noexcept {
    try {
      std::cout.flush();
      std::cerr.flush();
      std::clog.flush();
    } catch (...) {
    }
    std::fflush(nullptr);
  }

  template <class Child>
  pid_t fork_worker(int rank, Child&& child) {
    // Unflushed parent output would be duplicated by every child that flushes.
    flush_stdio();
    Pipe err = Pipe::make();
    std::optional<Pipe> out, errout;
    if (options_.prefix_output) {
      out = Pipe::make();
      errout = Pipe::make();
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      int e = errno;
      stop_all();
      throw Error(std::string("accel: cannot fork worker ") + std::to_string(rank) + " (" +
                  std::strerror(e) + "). Launch fewer processes or raise the process limit.");
    }
    if (pid == 0) {
      // Own process group: stopping a worker also stops whatever it started.
      ::setpgid(0, 0);
#ifdef __linux__
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher died: do not linger
      if (::getppid() != parent) ::_exit(1);
#endif
      // Default dispositions: the launcher, not inherited test-framework or
      // user handlers, reports a worker's crash.
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL})
        ::signal(sig, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      StopSignalGuard::forget_after_fork();
      if (out) {
        ::dup2(out->write.get(), STDOUT_FILENO);
        ::dup2(errout->write.get(), STDERR_FILENO);
      }
      child(err.write.get());
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from the parent, so signalling the group never races
    Worker w;
    w.result.rank = rank;
    w.result.pid = pid;
    w.err = std::move(err.read);
    w.heartbeat = std::move(pending_heartbeat_);
    w.created = pending_created_;
    if (out) {
      w.out = std::move(out->read);
      w.errout = std::move(errout->read);
    }
    workers_.push_back(std::move(w));
    return pid;
  }

  void signal_running(int sig) {
    for (const auto& w : workers_) {
      if (w.result.status != WorkerStatus::Running) continue;
      if (::kill(-w.result.pid, sig) != 0) ::kill(w.result.pid, sig);
    }
  }

  void wait_until(Clock::time_point until) {
    while (running() > 0 && Clock::now() < until) {
      pump(10);
      reap();
    }
  }

  /// Polls the signal pipe and every open worker pipe for up to timeout_ms,
  /// and consumes what is readable.
  void pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, int>> owner;  // which worker, which stream (0 err, 1, 2)
    if (signals_ && signals_->fd() >= 0) {
      fds.push_back({signals_->fd(), POLLIN, 0});
      owner.emplace_back(nullptr, 0);
    }
    for (auto& w : workers_) {
      for (auto [fd, stream] : {std::pair{&w.err, 0}, {&w.out, 1}, {&w.errout, 2}}) {
        if (!fd->valid()) continue;
        fds.push_back({fd->get(), POLLIN, 0});
        owner.emplace_back(&w, stream);
      }
    }
    if (fds.empty()) {
      if (timeout_ms > 0) ::usleep(static_cast<useconds_t>(timeout_ms) * 1000);
      return;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      if (owner[i].first == nullptr) {
        std::string drop;
        read_available(fds[i].fd, drop);
        continue;
      }
      consume(*owner[i].first, owner[i].second);
    }
  }

  void consume(Worker& w, int stream) {
    Fd& fd = stream == 0 ? w.err : stream == 1 ? w.out : w.errout;
    std::string& buf = stream == 0 ? w.err_text : stream == 1 ? w.out_buf : w.errout_buf;
    bool open = read_available(fd.get(), buf);
    if (!open) fd.reset();
    if (stream == 0) {
      if (buf.size() > 64 * 1024) buf.resize(64 * 1024);
      return;
    }
    std::size_t start = 0;
    for (std::size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(w.result.rank, stream, std::string_view(buf).substr(start, nl - start));
    buf.erase(0, start);
    if (buf.size() > 64 * 1024 || (!open && !buf.empty())) {
      emit(w.result.rank, stream, buf);
      buf.clear();
    }
  }

  void emit(int rank, int stream, std::string_view line) {
    if (options_.on_output) {
      options_.on_output(rank, stream, line);
      return;
    }
    std::string s = prefixed_line(rank, line);
    write_all(stream == 1 ? STDOUT_FILENO : STDERR_FILENO, s.data(), s.size());
  }

  void flush_partial(Worker& w) {
    for (int stream : {1, 2}) {
      std::string& buf = stream == 1 ? w.out_buf : w.errout_buf;
      if (!buf.empty()) emit(w.result.rank, stream, buf);
      buf.clear();
    }
  }

  /// Reaps the workers that ended; returns their indices in spawn order.
  std::vector<std::size_t> reap() {
    std::vector<std::size_t> ended;
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (w.result.status != WorkerStatus::Running) continue;
      int st = 0;
      pid_t r = ::waitpid(w.result.pid, &st, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      // The child is gone: whatever it wrote before exiting is in the pipes.
      for (int stream : {0, 1, 2})
        if ((stream == 0 ? w.err : stream == 1 ? w.out : w.errout).valid()) consume(w, stream);
      classify(w, r < 0 ? -1 : st);
      ended.push_back(i);
    }
    return ended;
  }

  void classify(Worker& w, int st) {
    WorkerResult& r = w.result;
    if (st < 0) {  // not our child any more (someone else reaped it)
      r.status = WorkerStatus::Exited;
      r.code = 1;
      r.message = "vanished (reaped by someone else)";
    } else if (WIFEXITED(st)) {
      r.code = WEXITSTATUS(st);
      if (r.code == 0) {
        r.status = WorkerStatus::Succeeded;  // it returned normally, even if a stop was under way
      } else if (!w.err_text.empty()) {
        r.status = WorkerStatus::Threw;
        r.message = w.err_text;
      } else {
        r.status = WorkerStatus::Exited;
        r.message = "exited with status " + std::to_string(r.code);
      }
      if (stopping_ && r.status == WorkerStatus::Exited) r.status = WorkerStatus::Stopped;
    } else if (WIFSIGNALED(st) && w.hung_for > 0) {
      r.code = WTERMSIG(st);
      r.status = WorkerStatus::Signaled;  // a failure of its own, even if a stop began since
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", w.hung_for);
      r.message = std::string("made no progress (no heartbeat) for ") + secs +
                  " s, more than the monitor interval of " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                     *options_.heartbeat_timeout).count()) +
                  " s; it was killed as hung";
    } else if (WIFSIGNALED(st)) {
      r.code = WTERMSIG(st);
      r.status = stopping_ ? WorkerStatus::Stopped : WorkerStatus::Signaled;
      r.message = (stopping_ ? "stopped by signal " : "killed by signal ") + signal_name(r.code);
      if (!stopping_ && !w.err_text.empty()) r.message = w.err_text + " (then " + r.message + ")";
    }
  }

  PoolOptions options_;
  Clock::time_point start_;
  std::optional<StopSignalGuard> signals_;
  std::vector<Worker> workers_;
  bool stopping_ = false;
  bool restore_sigchld_ = false;
  std::string heartbeat_dir_;       ///< "" without hang detection
  std::string pending_heartbeat_;   ///< with_heartbeat() -> fork_worker()
  timespec pending_created_{};
  Clock::time_point last_heartbeat_check_{};
  struct sigaction old_sigchld_ {};
};

/// Runs f() on a new thread, waits for it and returns its result (or rethrows).
/// Fork C++-function workers from such a thread: a child inherits the forking
/// thread's GNU OpenMP pool, whose threads do not exist in the child, so its
/// first parallel region would hang; a fresh thread has no pool. The thread must
/// outlive the workers, because PR_SET_PDEATHSIG follows the forking thread.
template <class F>
auto on_fresh_thread(F&& f) -> decltype(f()) {
  std::optional<decltype(f())> result;
  std::exception_ptr error;
  std::thread t([&] {
    try {
      result.emplace(f());
    } catch (...) {
      error = std::current_exception();
    }
  });
  t.join();
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP
