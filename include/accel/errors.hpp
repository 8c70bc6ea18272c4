// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel's run-time exceptions and the ACCEL_CHECK macro.
#ifndef ACCEL_ERRORS_HPP
#define ACCEL_ERRORS_HPP

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace accel {

/// Base of every run-time error accel raises. Messages follow one form:
/// "accel: <what is wrong>. <what to do instead>."
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A launched worker failed: names the rank and carries its message; `others`
/// says what became of the other processes ("process 0 failed because of it").
class LaunchError : public Error {
 public:
  LaunchError(int rank, std::string message, const std::string& others = {})
      : Error("accel: process " + std::to_string(rank) + " failed: " + message +
              (others.empty() ? "" : "; " + others)),
        rank_(rank), message_(std::move(message)) {}
  /// The failure that used up the last restart (LaunchOptions::max_restarts):
  /// "accel: process 1 failed on attempt 2 of 2 (max_restarts = 1): ...".
  LaunchError(int rank, std::string message, const std::string& others, int attempt, int attempts)
      : Error("accel: process " + std::to_string(rank) + " failed on attempt " +
              std::to_string(attempt) + " of " + std::to_string(attempts) + " (max_restarts = " +
              std::to_string(attempts - 1) + "): " + message + (others.empty() ? "" : "; " + others)),
        rank_(rank), message_(std::move(message)), attempt_(attempt) {}
  int rank() const noexcept { return rank_; }
  const std::string& message() const noexcept { return message_; }
  /// Which attempt failed, from 1 (a launch without restarts has only attempt 1).
  int attempt() const noexcept { return attempt_; }

 private:
  int rank_;
  std::string message_;
  int attempt_ = 1;
};

/// A configuration file or value is wrong: names the key (and line, when known).
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A collective or rendezvous did not finish within the timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... A>
std::string concat(A&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<A>(parts));
  return out.str();
}

// Phrases of the errors a process raises because another process failed (it
// saw the failure, or its peer vanished). Launchers report the process that
// failed by itself as the cause, not these.
inline constexpr std::string_view kFailedElsewhere = "(its own error says why)";
inline constexpr std::string_view kPeerVanished = "A peer process probably exited";

inline bool caused_by_another_process(std::string_view message) {
  return message.find(kFailedElsewhere) != std::string_view::npos ||
         message.find(kPeerVanished) != std::string_view::npos;
}
}  // namespace detail

}  // namespace accel

/// Throws accel::Error with the streamed message parts when cond is false.
#define ACCEL_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) throw ::accel::Error(::accel::detail::concat(__VA_ARGS__)); \
  } while (false)

#endif  // ACCEL_ERRORS_HPP
