// accel::get_logger: levels from ACCEL_LOG_LEVEL and the rank prefix in one
// process, then main-process-only, every-process and in-order lines on 2 and
// 3 real Gloo processes forked by accel's own launcher, each writing through
// a file sink (or its stderr) that the test reads back.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/logging.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/ostream_sink.h>

#include "catch.hpp"

#include "paths.hpp"
#include "workers.hpp"

namespace {

using accel_test::expect;

/// Sets (or, with nullptr, unsets) one variable for a scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1); else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

/// The logger's messages go to `out` only, as "<level> <message>".
void capture(accel::Logger& log, std::ostream& out) {
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out, /*force_flush=*/true);
  sink->set_pattern("%l %v");
  log.spdlog_logger()->sinks() = {sink};
}

/// The same into a file every process appends to, flushed line by line.
void capture(accel::Logger& log, const std::string& path) {
  auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  sink->set_pattern("%l %v");
  log.spdlog_logger()->sinks() = {sink};
  log.spdlog_logger()->flush_on(spdlog::level::trace);
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}
std::vector<std::string> lines_of(const std::ostringstream& s) {
  std::istringstream in(s.str());
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const auto& l : lines) s += "  " + l + "\n";
  return s;
}

std::size_t count(const std::vector<std::string>& lines, const std::string& line) {
  return static_cast<std::size_t>(std::count(lines.begin(), lines.end(), line));
}

std::string rank_prefix(int r, int n) { return "[rank " + std::to_string(r) + "/" + std::to_string(n) + "] "; }

accel::AcceleratorOptions short_timeout() {
  accel::AcceleratorOptions o;
  o.timeout = std::chrono::seconds(60);
  return o;
}

/// A file for one test's lines, empty.
std::string log_file(const std::string& name) {
  auto p = accel_test::scratch("logging", name);
  std::ofstream(p).flush();
  return p.string();
}

}  // namespace

TEST_CASE("one process: every line carries [rank 0/1]; the level comes from ACCEL_LOG_LEVEL",
          "[core][logging]") {
  ScopedEnv no_rank("RANK", nullptr), no_world("WORLD_SIZE", nullptr);
  std::ostringstream out;

  SECTION("unset: info") {
    ScopedEnv level("ACCEL_LOG_LEVEL", nullptr);
    auto log = accel::get_logger("logging.test.default");
    capture(log, out);
    CHECK(log.level() == spdlog::level::info);
    CHECK(log.prefix() == "[rank 0/1] ");
    CHECK(log.process_index() == 0);
    CHECK(log.num_processes() == 1);
    log.debug("hidden {}", 1);
    log.info("loss {:.2f}", 0.25);
    log.warning("careful");
    // One process: in_order needs no barrier, main_process_only=false is the same line.
    log.error(accel::LogOptions{.main_process_only = false, .in_order = true}, "ordered {}", "x");
    CHECK(lines_of(out) == std::vector<std::string>{"info [rank 0/1] loss 0.25", "warning [rank 0/1] careful",
                                                    "error [rank 0/1] ordered x"});
  }
  SECTION("warning (any case) hides info") {
    ScopedEnv level("ACCEL_LOG_LEVEL", "WARNING");
    auto log = accel::get_logger("logging.test.warning");
    capture(log, out);
    CHECK(log.level() == spdlog::level::warn);
    log.info("hidden");
    log.info({.main_process_only = false}, "hidden too");
    log.warning("shown {}", 1);
    log.critical("shown {}", 2);
    CHECK(lines_of(out) == std::vector<std::string>{"warning [rank 0/1] shown 1", "critical [rank 0/1] shown 2"});
  }
  SECTION("trace shows everything, off nothing") {
    {
      ScopedEnv level("ACCEL_LOG_LEVEL", "trace");
      auto log = accel::get_logger("logging.test.trace");
      capture(log, out);
      log.trace("t");
      log.debug("d");
      CHECK(lines_of(out) == std::vector<std::string>{"trace [rank 0/1] t", "debug [rank 0/1] d"});
    }
    std::ostringstream none;
    ScopedEnv level("ACCEL_LOG_LEVEL", "Off");
    auto log = accel::get_logger("logging.test.off");
    capture(log, none);
    log.critical("c");
    CHECK(none.str().empty());
  }
  SECTION("error: only error and critical") {
    ScopedEnv level("ACCEL_LOG_LEVEL", "error");
    auto log = accel::get_logger("logging.test.error");
    capture(log, out);
    log.warning("w");
    log.error("e");
    log.critical("c");
    CHECK(lines_of(out) == std::vector<std::string>{"error [rank 0/1] e", "critical [rank 0/1] c"});
  }
}

TEST_CASE("a bad ACCEL_LOG_LEVEL names the variable and the levels", "[core][logging]") {
  const std::string expected =
      "accel: environment variable ACCEL_LOG_LEVEL='verbose' is not a log level. Set it to one of "
      "trace, debug, info, warning, error, critical, off (any case), or unset it for info.";
  {
    ScopedEnv level("ACCEL_LOG_LEVEL", "verbose");
    CHECK_THROWS_AS(accel::get_logger("logging.test.bad"), accel::ConfigError);
    CHECK_THROWS_WITH(accel::get_logger("logging.test.bad"), expected);
  }
  // Checked on every call, also for a logger that exists already.
  auto log = accel::get_logger("logging.test.bad.existing");
  ScopedEnv level("ACCEL_LOG_LEVEL", "verbose");
  CHECK_THROWS_WITH(accel::get_logger("logging.test.bad.existing"), expected);
  CHECK(accel::logging::parse_level("Critical") == spdlog::level::critical);
  CHECK_FALSE(accel::logging::parse_level("warn").has_value());
  CHECK(accel::logging::level_name(spdlog::level::warn) == "warning");
}

TEST_CASE("get_logger shares one spdlog logger per name, registered with spdlog", "[core][logging]") {
  ScopedEnv level("ACCEL_LOG_LEVEL", nullptr);
  auto a = accel::get_logger("logging.test.shared");
  auto b = accel::get_logger("logging.test.shared");
  CHECK(a.spdlog_logger() == b.spdlog_logger());
  CHECK(spdlog::get("logging.test.shared") == a.spdlog_logger());
  a.set_level(spdlog::level::debug);
  CHECK(b.enabled(spdlog::level::debug));
  CHECK(b.name() == "logging.test.shared");
  // A logger the program registered itself is used as it is (sinks, level).
  std::ostringstream out;
  auto mine = std::make_shared<spdlog::logger>(
      "logging.test.mine", std::make_shared<spdlog::sinks::ostream_sink_mt>(out, true));
  mine->set_pattern("%v");
  mine->set_level(spdlog::level::err);
  spdlog::register_logger(mine);
  auto log = accel::get_logger("logging.test.mine");
  log.info("hidden");
  log.error("kept");
  CHECK(out.str() == "[rank 0/1] kept\n");
}

namespace {

// Each rank logs main-process-only and every-process lines, and (in the
// same file) in-order lines whose ranks would otherwise come out in reverse:
// rank r waits (n - 1 - r) * 150 ms before each of them.
void rank_lines_worker(std::string path, std::string name) {
  accel::Accelerator<accel::backend::Gloo> acc(short_timeout());
  const int r = acc.process_index(), n = acc.num_processes();
  auto log = accel::get_logger(name, acc);
  expect(log.process_index() == r && log.num_processes() == n, "rank and world from the accelerator");
  capture(log, path);
  log.info("main only {}", 1);
  log.warning(accel::LogOptions{}, "main only {}", 2);
  log.info({.main_process_only = false}, "every process {}", r);
  acc.wait_for_everyone();
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(150 * (n - 1 - r)));
    log.info({.main_process_only = false, .in_order = true}, "in order {} from {}", i, r);
  }
  // in_order alone means every process too.
  log.error({.in_order = true}, "in order last");
  // Below the level: nothing, and no barrier (all ranks skip it alike).
  log.debug({.in_order = true}, "hidden");
}

}  // namespace

TEST_CASE("main-process-only, every-process and in-order lines on 2 and 3 processes",
          "[core][logging][multiprocess]") {
  ScopedEnv level("ACCEL_LOG_LEVEL", nullptr);
  for (int n : {2, 3}) {
    DYNAMIC_SECTION(n << " processes") {
      const auto path = log_file("ranks" + std::to_string(n) + ".log");
      const auto name = "logging.test.ranks" + std::to_string(n);
      REQUIRE_NOTHROW(accel::notebook_launcher(rank_lines_worker, std::make_tuple(path, name),
                                               accel_test::local_processes(n)));
      const auto lines = lines_of(path);
      INFO("log file:\n" << joined(lines));
      REQUIRE(lines.size() == static_cast<std::size_t>(2 + n + 3 * n));
      // Unordered part: the main process's two lines once, each rank's once.
      std::vector<std::string> first(lines.begin(), lines.begin() + 2 + n);
      CHECK(count(first, "info [rank 0/" + std::to_string(n) + "] main only 1") == 1);
      CHECK(count(first, "warning [rank 0/" + std::to_string(n) + "] main only 2") == 1);
      for (int r = 0; r < n; ++r)
        CHECK(count(first, "info " + rank_prefix(r, n) + "every process " + std::to_string(r)) == 1);
      // Ordered part: rank 0, 1, ... for each message.
      std::vector<std::string> ordered(lines.begin() + 2 + n, lines.end());
      std::vector<std::string> expected;
      for (int i = 0; i < 2; ++i)
        for (int r = 0; r < n; ++r)
          expected.push_back("info " + rank_prefix(r, n) + "in order " + std::to_string(i) + " from " +
                             std::to_string(r));
      for (int r = 0; r < n; ++r) expected.push_back("error " + rank_prefix(r, n) + "in order last");
      CHECK(ordered == expected);
    }
  }
}

namespace {

// ACCEL_LOG_LEVEL=error, inherited from the launching process.
void level_worker(std::string path) {
  accel::Accelerator<accel::backend::Gloo> acc(short_timeout());
  auto log = accel::get_logger("logging.test.level", acc);
  capture(log, path);
  log.warning({.main_process_only = false}, "hidden");
  log.info({.in_order = true}, "hidden");
  log.error({.main_process_only = false}, "shown by {}", acc.process_index());
  log.critical("main {}", acc.process_index());
}

// No accelerator: rank and world from the environment, and in_order refused.
void env_worker(std::string dir) {
  const int r = accel::runtime::ProcessEnv::discover().rank;
  const auto err = dir + "/stderr" + std::to_string(r) + ".txt";
  const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  expect(fd >= 0 && ::dup2(fd, 2) == 2, "stderr to " + err);
  ::close(fd);
  auto log = accel::get_logger("logging.test.env");
  expect(log.process_index() == r && log.num_processes() == 2, "rank and world from the environment");
  log.info({.main_process_only = false}, "to stderr from {}", r);
  log.info("main only");
  try {
    log.info({.in_order = true}, "refused");
  } catch (const accel::Error& e) {
    log.warning({.main_process_only = false}, "{}", e.what());
  }
  log.flush();
}

}  // namespace

TEST_CASE("ACCEL_LOG_LEVEL filters on every process", "[core][logging][multiprocess]") {
  ScopedEnv level("ACCEL_LOG_LEVEL", "error");
  const auto path = log_file("level.log");
  REQUIRE_NOTHROW(accel::notebook_launcher(level_worker, std::make_tuple(path), accel_test::local_processes(2)));
  auto lines = lines_of(path);
  INFO("log file:\n" << joined(lines));
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"critical [rank 0/2] main 0", "error [rank 0/2] shown by 0",
                                          "error [rank 1/2] shown by 1"});
}

TEST_CASE("get_logger(name) without an accelerator: ranks from the environment, stderr, no in_order",
          "[core][logging][multiprocess]") {
  ScopedEnv level("ACCEL_LOG_LEVEL", nullptr);
  const auto dir = accel_test::fresh_dir("logging", "env").string();
  REQUIRE_NOTHROW(accel::notebook_launcher(env_worker, std::make_tuple(dir), accel_test::local_processes(2)));
  for (int r = 0; r < 2; ++r) {
    const auto lines = lines_of(dir + "/stderr" + std::to_string(r) + ".txt");
    INFO("rank " << r << " stderr:\n" << joined(lines));
    auto has = [&](const std::string& tail) {
      return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) {
        return l.size() >= tail.size() && l.compare(l.size() - tail.size(), tail.size(), tail) == 0;
      });
    };
    // spdlog's default pattern: [time] [name] [level] message.
    CHECK(has("[logging.test.env] [info] " + rank_prefix(r, 2) + "to stderr from " + std::to_string(r)));
    CHECK(has("main only") == (r == 0));
    CHECK(has(rank_prefix(r, 2) + "accel: logger 'logging.test.env' cannot log in_order: it has no barrier "
              "across the 2 processes. Get it with accel::get_logger(\"logging.test.env\", accelerator) to "
              "log in rank order."));
  }
}
