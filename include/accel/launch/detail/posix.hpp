// SPDX-License-Identifier: Apache-2.0
/// @file Defines the small POSIX helpers the launcher is built on: owned file
/// descriptors, pipes, signal names, CPU count, scoped environment variables.
#ifndef ACCEL_LAUNCH_DETAIL_POSIX_HPP
#define ACCEL_LAUNCH_DETAIL_POSIX_HPP

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <accel/detail/cores.hpp>
#include <accel/errors.hpp>

namespace accel::detail::launch {

/// Environment variables to set in a worker, in order (later entries win).
using EnvList = std::vector<std::pair<std::string, std::string>>;

/// An owned file descriptor (closed on destruction, movable).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

/// A close-on-exec pipe; `read` is non-blocking because the parent multiplexes
/// many of them with poll() and must never block on one.
struct Pipe {
  Fd read;
  Fd write;

  static Pipe make() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0)
      throw Error(std::string("accel: cannot create a pipe for a worker (") + std::strerror(errno) +
                  "). Raise the open-file limit (ulimit -n) or launch fewer processes.");
    Pipe p{Fd(fds[0]), Fd(fds[1])};
    ::fcntl(p.read.get(), F_SETFL, ::fcntl(p.read.get(), F_GETFL) | O_NONBLOCK);
    return p;
  }
};

/// Writes all of `data` to `fd`, retrying on EINTR and short writes.
/// Async-signal-safe (used in forked children before exit).
inline void write_all(int fd, const char* data, std::size_t size) noexcept {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

/// Reads what is available on a non-blocking fd into `out`.
/// Returns false once the writer side is closed (EOF) or the fd failed.
inline bool read_available(int fd, std::string& out) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

/// "SIGSEGV" for 11 and so on; the names users see in crash reports.
inline std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal " + std::to_string(sig);
  }
}

using accel::detail::available_cores;

/// Parses a positive integer environment variable; nullopt when unset/invalid.
inline std::optional<int> positive_env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < 1 || n > 1 << 20) return std::nullopt;
  return static_cast<int>(n);
}

/// Sets variables for a scope and puts back the previous values (or unsets
/// them) on destruction, also when an exception leaves the scope.
class ScopedEnv {
 public:
  explicit ScopedEnv(const EnvList& vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      ::setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    // Reverse order so a key listed twice ends with its original value.
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

/// While alive, SIGINT, SIGTERM and SIGHUP sent to this process do not kill it
/// but are recorded and wake up poll() through a self-pipe, so the launcher can
/// stop its workers first. The previous handlers are restored on destruction.
/// Only one guard is active at a time; a nested one does nothing.
class StopSignalGuard {
 public:
  StopSignalGuard() {
    if (active().exchange(true)) return;
    owner_ = true;
    pipe_ = Pipe::make();
    ::fcntl(pipe_.write.get(), F_SETFL, ::fcntl(pipe_.write.get(), F_GETFL) | O_NONBLOCK);
    caught() = 0;
    write_fd().store(pipe_.write.get());
    struct sigaction sa {};
    sa.sa_handler = &StopSignalGuard::on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;
  ~StopSignalGuard() {
    if (!owner_) return;
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    write_fd().store(-1);
    active().store(false);
  }

  /// The fd that becomes readable when a signal arrived (-1 when not the owner).
  int fd() const noexcept { return owner_ ? pipe_.read.get() : -1; }
  /// The first signal received since construction, 0 if none.
  static int received() noexcept { return caught(); }
  /// In a forked child: the parent's guard is not the child's, so a launcher
  /// started inside a worker can install its own.
  static void forget_after_fork() noexcept {
    write_fd().store(-1);
    active().store(false);
    caught() = 0;
  }

  static constexpr std::array<int, 3> kSignals{SIGINT, SIGTERM, SIGHUP};

 private:
  static void on_signal(int sig) {
    int saved = errno;
    if (caught() == 0) caught() = sig;
    int fd = write_fd().load();
    if (fd >= 0) {
      char c = 1;
      [[maybe_unused]] ssize_t n = ::write(fd, &c, 1);
    }
    errno = saved;
  }
  static std::atomic<bool>& active() {
    static std::atomic<bool> a{false};
    return a;
  }
  static std::atomic<int>& write_fd() {
    static std::atomic<int> fd{-1};
    return fd;
  }
  static volatile std::sig_atomic_t& caught() {
    static volatile std::sig_atomic_t sig = 0;
    return sig;
  }

  bool owner_ = false;
  Pipe pipe_;
  std::array<struct sigaction, kSignals.size()> old_{};
};

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_POSIX_HPP
