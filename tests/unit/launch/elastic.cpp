// Elastic restarts of notebook_launcher with real forked workers: every
// attempt's variables, that a failure (exception, exit status, SIGKILL)
// restarts the whole group with fresh processes, that the last allowed
// failure names the rank and the attempt, and that a port in TIME_WAIT or
// taken does not break the restart, and that a worker that stops
// heart-beating is killed as hung (monitor_interval). No autograd here (training restarts:
// tests/unit/checkpoint/elastic.cpp).
#include <accel/launch.hpp>
#include <accel/runtime/heartbeat.hpp>
#include <accel/runtime/restart_count.hpp>
#include <accel/runtime/store.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "paths.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Catch::Matchers::ContainsSubstring;

namespace {

fs::path fresh(const std::string& name) { return accel_test::fresh_dir("launch", "elastic_" + name); }

std::string env_or(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "<unset>";
}

/// One line per worker start: "attempt rank pid port", appended atomically (O_APPEND, one write).
void log_start(const fs::path& dir) {
  std::ostringstream line;
  line << accel::restart_count() << ' ' << env_or("RANK") << ' ' << ::getpid() << ' '
       << env_or("MASTER_PORT") << ' ' << env_or("TORCHELASTIC_MAX_RESTARTS") << '\n';
  std::ofstream(dir / "starts.txt", std::ios::app) << line.str() << std::flush;
}

struct Start {
  int attempt, rank;
  pid_t pid;
  int port, max_restarts;
};

std::vector<Start> starts(const fs::path& dir) {
  std::vector<Start> out;
  std::ifstream in(dir / "starts.txt");
  Start s{};
  while (in >> s.attempt >> s.rank >> s.pid >> s.port >> s.max_restarts) out.push_back(s);
  return out;
}

bool process_gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

accel::LaunchOptions two(int max_restarts, int port = 0) {
  accel::LaunchOptions o;
  o.num_processes = 2;
  o.master_port = port;
  o.timeout = 60s;
  o.stop_grace = 2s;
  o.max_restarts = max_restarts;
  return o;
}

}  // namespace

TEST_CASE("elastic: a failed worker restarts the whole group, each attempt with its restart count",
          "[launch][elastic]") {
  rlimit none{0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
  const fs::path dir = fresh("restart");
  // Rank 1 fails on attempt 0 by an exception, on attempt 1 by SIGKILL; rank 0
  // would run for a minute unless stopped. Attempt 2 finishes.
  accel::notebook_launcher(
      [](const std::string& d) {
        log_start(d);
        const int attempt = accel::restart_count();
        if (attempt < 2 && env_or("RANK") == "1") {
          std::this_thread::sleep_for(100ms);
          if (attempt == 0) throw std::runtime_error("boom");
          std::raise(SIGKILL);
        }
        if (attempt < 2) std::this_thread::sleep_for(60s);
      },
      std::make_tuple(dir.string()), two(2));
  const auto s = starts(dir);
  REQUIRE(s.size() == 6);
  for (int attempt = 0; attempt < 3; ++attempt) {
    int ranks = 0;
    for (const auto& x : s) ranks += x.attempt == attempt ? (x.rank == 0 ? 1 : 2) : 0;
    CHECK(ranks == 3);  // ranks 0 and 1 once each
  }
  for (std::size_t i = 0; i < s.size(); ++i) {
    CHECK(s[i].max_restarts == 2);
    CHECK(process_gone(s[i].pid));
    for (std::size_t j = i + 1; j < s.size(); ++j) CHECK(s[i].pid != s[j].pid);  // fresh processes
  }
}

TEST_CASE("elastic: a worker failing on every attempt ends the launch after max_restarts + 1 attempts",
          "[launch][elastic]") {
  const fs::path dir = fresh("always");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    accel::notebook_launcher(
        [](const std::string& d) {
          log_start(d);
          if (env_or("RANK") == "1") throw std::runtime_error("boom");
          std::this_thread::sleep_for(60s);
        },
        std::make_tuple(dir.string()), two(2));
    FAIL("the launch did not fail");
  } catch (const accel::LaunchError& e) {
    CHECK(e.rank() == 1);
    CHECK(e.attempt() == 3);
    CHECK(e.message() == "boom");
    CHECK(std::string(e.what()) ==
          "accel: process 1 failed on attempt 3 of 3 (max_restarts = 2): boom; process 0 was stopped");
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
  const auto s = starts(dir);
  CHECK(s.size() == 6);
  for (const auto& x : s) CHECK(process_gone(x.pid));
}

TEST_CASE("elastic: max_restarts 0 fails on the first failure, as without restarts", "[launch][elastic]") {
  const fs::path dir = fresh("none");
  try {
    accel::notebook_launcher(
        [](const std::string& d) {
          log_start(d);
          if (env_or("RANK") == "1") throw std::runtime_error("boom");
          std::this_thread::sleep_for(60s);
        },
        std::make_tuple(dir.string()), two(0));
    FAIL("the launch did not fail");
  } catch (const accel::LaunchError& e) {
    CHECK(e.attempt() == 1);
    CHECK(std::string(e.what()) == "accel: process 1 failed: boom; process 0 was stopped");
  }
  const auto s = starts(dir);
  REQUIRE(s.size() == 2);
  for (const auto& x : s) {
    CHECK(x.attempt == 0);
    CHECK(x.max_restarts == 0);
  }
}

TEST_CASE("elastic: one process with max_restarts runs as a worker, so a crash restarts it",
          "[launch][elastic]") {
  const fs::path dir = fresh("one");
  accel::LaunchOptions o = two(1);
  o.num_processes = 1;
  accel::notebook_launcher(
      [](const std::string& d) {
        log_start(d);
        if (accel::restart_count() == 0) std::raise(SIGKILL);
      },
      std::make_tuple(dir.string()), o);
  const auto s = starts(dir);
  REQUIRE(s.size() == 2);
  CHECK(s[0].attempt == 0);
  CHECK(s[1].attempt == 1);
  CHECK(s[0].pid != ::getpid());
}

TEST_CASE("elastic: the restarted group meets again on its port despite TIME_WAIT, or on a free one when taken",
          "[launch][elastic]") {
  const fs::path dir = fresh("ports");
  const int port = accel::detail::launch::pick_free_port("127.0.0.1");
  // Every attempt meets in a TCPStore on MASTER_PORT; on attempt 0 rank 0,
  // which serves it, fails first, so its side closes first and leaves the
  // port's connections in TIME_WAIT.
  auto body = [](const std::string& d) {
    log_start(d);
    const auto env = accel::runtime::ProcessEnv::discover();
    accel::runtime::StoreOptions so;
    so.timeout = 20s;
    auto store = accel::runtime::make_store(env, so);
    store->add("met", 1);
    while (store->add("met", 0) < env.world_size) std::this_thread::sleep_for(5ms);
    if (accel::restart_count() == 0) {
      if (env.rank == 0) throw std::runtime_error("rank 0 leaves first");
      std::this_thread::sleep_for(60s);
    }
    store->add("done", 1);
    if (env.rank == 0)
      while (store->add("done", 0) < env.world_size) std::this_thread::sleep_for(5ms);
  };
  SECTION("TIME_WAIT: the same port again") {
    accel::notebook_launcher(body, std::make_tuple(dir.string()), two(1, port));
    const auto s = starts(dir);
    REQUIRE(s.size() == 4);
    for (const auto& x : s) CHECK(x.port == port);
  }
  SECTION("taken: another free port") {
    // A listener that is not a store holds the port from the start; attempt 0
    // does not meet (rank 1 fails first), the restart must move.
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    REQUIRE(::listen(fd, 1) == 0);
    accel::notebook_launcher(
        [&body](const std::string& d) {
          if (accel::restart_count() == 0) {
            log_start(d);
            if (env_or("RANK") == "1") throw std::runtime_error("fails before meeting");
            std::this_thread::sleep_for(60s);
          }
          body(d);
        },
        std::make_tuple(dir.string()), two(1, port));
    ::close(fd);
    const auto s = starts(dir);
    REQUIRE(s.size() == 4);
    for (const auto& x : s) CHECK((x.attempt == 0 ? x.port == port : x.port != port));
  }
}

namespace {

/// Beats (runtime::heartbeat) every 20 ms for `how_long`.
void beat_for(std::chrono::milliseconds how_long) {
  const auto until = std::chrono::steady_clock::now() + how_long;
  while (std::chrono::steady_clock::now() < until) {
    accel::runtime::heartbeat();
    std::this_thread::sleep_for(20ms);
  }
}

}  // namespace

TEST_CASE("elastic: a worker that stops heart-beating is killed as hung, and the group restarted",
          "[launch][elastic][heartbeat]") {
  const fs::path dir = fresh("hung");
  auto o = two(1);
  o.monitor_interval = 1s;
  const auto t0 = std::chrono::steady_clock::now();
  accel::notebook_launcher(
      [](const std::string& d) {
        log_start(d);
        if (accel::restart_count() == 0) {
          beat_for(300ms);
          // Rank 1 hangs; rank 0 goes on beating until it is stopped.
          if (env_or("RANK") == "1") std::this_thread::sleep_for(60s);
          beat_for(60s);
        }
        // Attempt 1: rank 0 never beats and is never judged; rank 1 beats and ends.
        if (env_or("RANK") == "0") std::this_thread::sleep_for(1500ms);
        else beat_for(300ms);
      },
      std::make_tuple(dir.string()), o);
  CHECK(std::chrono::steady_clock::now() - t0 < 15s);
  const auto s = starts(dir);
  REQUIRE(s.size() == 4);
  for (const auto& x : s) CHECK(process_gone(x.pid));
}

TEST_CASE("elastic: a hung worker without restarts fails the launch, named", "[launch][elastic][heartbeat]") {
  auto o = two(0);
  o.monitor_interval = 1s;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    accel::notebook_launcher(
        [] {
          beat_for(200ms);
          if (env_or("RANK") == "1") std::this_thread::sleep_for(60s);
          beat_for(60s);
        },
        std::make_tuple(), o);
    FAIL("the launch did not fail");
  } catch (const accel::LaunchError& e) {
    CHECK(e.rank() == 1);
    CHECK_THAT(e.message(), Catch::Matchers::StartsWith("made no progress (no heartbeat) for 1.") &&
                                ContainsSubstring(" s, more than the monitor interval of 1 s; it was killed as hung"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 10s);
}

TEST_CASE("elastic: invalid restart options are refused", "[launch][elastic]") {
  auto o = two(-1);
  CHECK_THROWS_WITH(accel::notebook_launcher([] {}, std::make_tuple(), o),
                    ContainsSubstring("max_restarts is -1"));
  o = two(1);
  o.monitor_interval = std::chrono::seconds(0);
  CHECK_THROWS_WITH(accel::notebook_launcher([] {}, std::make_tuple(), o),
                    ContainsSubstring("monitor_interval is 0 s"));
  CHECK(accel::restart_count() == 0);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  CHECK(accel::restart_count() == 3);
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
}

TEST_CASE("elastic, several machines: the launchers' messages survive any text", "[launch][elastic][machines]") {
  namespace dl = accel::detail::launch;
  const dl::AgentMessage m{"RESULT", "", "tab\there", "two\nlines\\and a backslash", "\\t literal"};
  const std::string line = dl::encode_message(m);
  CHECK(line.find('\n') == line.size() - 1);
  CHECK(dl::decode_message(std::string_view(line).substr(0, line.size() - 1)) == m);
}

TEST_CASE("elastic, several machines: a launcher started for another launch is refused with both values",
          "[launch][elastic][machines]") {
  namespace dl = accel::detail::launch;
  accel::LaunchOptions o;
  o.num_processes = 2;
  o.num_nodes = 2;
  o.max_restarts = 1;
  o.master_port = accel::detail::launch::pick_free_port();
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  std::ostringstream server_log;
  std::string server_error;
  std::thread machine0([&] {
    try {
      dl::AgentServer server(o, false, deadline, 3s, server_log);
      server.next();
    } catch (const std::exception& e) {
      server_error = e.what();
    }
  });
  std::this_thread::sleep_for(300ms);
  accel::LaunchOptions other = o;
  other.node_rank = 1;
  other.num_processes = 3;
  std::ostringstream client_log;
  dl::AgentClient client(other, deadline, 3s, client_log);
  CHECK_THROWS_WITH(client.next(), "accel: machine 0 refused machine 1: machine 1 was started for 2 "
                                   "machines with 3 processes each; machine 0 for 2 with 2. Give every "
                                   "machine the same --num_machines and --num_processes.");
  machine0.join();
  // Machine 0 gives up within its rendezvous timeout, naming the machine it waited for.
  CHECK_THAT(server_error, ContainsSubstring("accel: machine 1 did not join the launch at 127.0.0.1:" +
                                             std::to_string(o.master_port) + " within 3 s"));
}
