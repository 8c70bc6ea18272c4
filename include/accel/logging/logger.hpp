// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::logging::Logger and get_logger: Accelerate's
/// get_logger / MultiProcessAdapter over spdlog. A message is logged on the
/// main process only unless LogOptions say otherwise; every line carries
/// "[rank r/n] "; the level of a new logger comes from ACCEL_LOG_LEVEL.
#ifndef ACCEL_LOGGING_LOGGER_HPP
#define ACCEL_LOGGING_LOGGER_HPP

#include <concepts>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#ifdef SPDLOG_USE_STD_FORMAT
#include <format>
#endif

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <accel/errors.hpp>
#include <accel/logging/level.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::logging {

/// Per-call choices, as Accelerate's log(..., main_process_only=, in_order=).
struct LogOptions {
  /// true: only the main process (rank 0) logs; false: every process does.
  bool main_process_only = true;
  /// true: every process logs, one after another in rank order (rank 0's
  /// line first), whatever main_process_only says. Collective: every process
  /// must make the call, and the logger needs a barrier (get_logger(name,
  /// accelerator)) when there is more than one process.
  bool in_order = false;
};

/// A named spdlog logger seen from one process of the job. Cheap to copy:
/// copies share the spdlog logger (its sinks and level).
class Logger {
 public:
  /// `barrier` may be null: then in_order is only possible in a job of one process.
  Logger(std::shared_ptr<::spdlog::logger> logger, int process_index, int num_processes,
         runtime::Communicator* barrier = nullptr)
      : logger_(std::move(logger)),
        rank_(process_index),
        world_(num_processes),
        barrier_(barrier),
        prefix_("[rank " + std::to_string(process_index) + "/" + std::to_string(num_processes) + "] ") {}

  // log.info("loss {}", x): main process only. log.info({.main_process_only = false}, ...):
  // every process. log.info({.in_order = true}, ...): every process, in rank order.
  template <class... A>
  void trace(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::trace, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void trace(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::trace, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void debug(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::debug, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void debug(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::debug, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void info(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::info, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void info(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::info, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void warning(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::warn, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void warning(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::warn, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void error(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::err, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void error(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::err, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void critical(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::critical, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void critical(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::critical, options, fmt, std::forward<A>(args)...);
  }

  /// The message at `level`, on the processes `options` choose. Below the
  /// logger's level nothing happens, not even in_order's barriers (so every
  /// process needs the same level: ACCEL_LOG_LEVEL is inherited by launched
  /// processes).
  template <class... A>
  void log(Level level, const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    if (!logger_->should_log(level)) return;
    if (options.in_order) {
      check_barrier();
      // Every process takes its turn, then all wait: rank 0 writes (and
      // flushes) first, rank 1 after the first barrier, and so on. A process
      // whose write fails still joins the barriers, so no one hangs on it.
      std::exception_ptr failure;
      for (int r = 0; r < world_; ++r) {
        if (r == rank_) {
          try {
            write(level, fmt, std::forward<A>(args)...);
            logger_->flush();
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (world_ > 1) barrier_->barrier();
      }
      if (failure) std::rethrow_exception(failure);
      return;
    }
    if (options.main_process_only && rank_ != 0) return;
    write(level, fmt, std::forward<A>(args)...);
  }

  /// Whether a message at `level` would be written (on a process that logs it).
  bool enabled(Level level) const { return logger_->should_log(level); }
  Level level() const { return logger_->level(); }
  /// This process's level for this name (every copy, every get_logger of it).
  void set_level(Level level) { logger_->set_level(level); }
  const std::string& name() const { return logger_->name(); }
  int process_index() const { return rank_; }
  int num_processes() const { return world_; }
  /// "[rank r/n] ", what every message starts with.
  const std::string& prefix() const { return prefix_; }
  void flush() { logger_->flush(); }
  /// The spdlog logger underneath: its sinks (add a file, replace the
  /// console), pattern, flush policy. Shared with every Logger of this name.
  const std::shared_ptr<::spdlog::logger>& spdlog_logger() const { return logger_; }

 private:
  void check_barrier() const {
    if (world_ > 1 && barrier_ == nullptr)
      throw Error(accel::detail::concat(
          "accel: logger '", logger_->name(), "' cannot log in_order: it has no barrier across the ",
          world_, " processes. Get it with accel::get_logger(\"", logger_->name(),
          "\", accelerator) to log in rank order."));
  }

  template <class... A>
  void write(Level level, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    ::spdlog::memory_buf_t buf;
    buf.append(prefix_.data(), prefix_.data() + prefix_.size());
#ifdef SPDLOG_USE_STD_FORMAT
    std::vformat_to(std::back_inserter(buf), fmt, std::make_format_args(args...));
#else
    ::fmt::format_to(std::back_inserter(buf), fmt, std::forward<A>(args)...);
#endif
    logger_->log(level, ::spdlog::string_view_t(buf.data(), buf.size()));
  }

  std::shared_ptr<::spdlog::logger> logger_;
  int rank_;
  int world_;
  runtime::Communicator* barrier_;
  std::string prefix_;
};

namespace detail {

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

/// spdlog's logger of that name (registered in spdlog's registry, so
/// spdlog::get(name) finds it too); made when there is none: a colored
/// stderr sink, spdlog's default pattern, `level`.
inline std::shared_ptr<::spdlog::logger> named_logger(std::string_view name, Level level) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::string key(name);
  if (auto existing = ::spdlog::get(key)) return existing;
  auto logger = std::make_shared<::spdlog::logger>(key, std::make_shared<::spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(level);
  ::spdlog::register_logger(logger);
  return logger;
}

template <class A>
concept HasCommunicator = requires(A& a) {
  { a.communicator() } -> std::convertible_to<runtime::Communicator&>;
};

}  // namespace detail

/// The logger `name` of this process, rank and world from the environment
/// (API.md section 5). Made on first use with ACCEL_LOG_LEVEL's level (info
/// when unset); later calls share it and keep its level. ACCEL_LOG_LEVEL is
/// checked on every call: a value that is not a level is a ConfigError.
/// in_order needs the overload with an accelerator when there is more than
/// one process.
inline Logger get_logger(std::string_view name) {
  const Level level = level_from_env();
  const auto env = runtime::ProcessEnv::discover();
  return Logger(detail::named_logger(name, level), env.rank, env.world_size);
}

/// The same, rank and world from `comm`, whose barrier orders in_order
/// messages. The logger must not outlive the communicator.
inline Logger get_logger(std::string_view name, runtime::Communicator& comm) {
  const Level level = level_from_env();
  return Logger(detail::named_logger(name, level), comm.rank(), comm.size(), &comm);
}

/// The same, bound to an Accelerator (its communicator): what in_order
/// needs. The logger must not outlive the accelerator.
template <detail::HasCommunicator A>
Logger get_logger(std::string_view name, A& accelerator) {
  return get_logger(name, accelerator.communicator());
}

}  // namespace accel::logging

namespace accel {
using logging::get_logger;
using logging::Logger;
using logging::LogOptions;
}  // namespace accel

#endif  // ACCEL_LOGGING_LOGGER_HPP
