// Tests the process supervisor shared by notebook_launcher and `accel launch`:
// exec'd programs with an environment, prefixed output, exit codes for a
// command-line launcher, process groups, timeouts and SIGINT forwarding.
#include <accel/launch/detail/worker_pool.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "catch.hpp"
#include "paths.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using accel::detail::launch::PoolOptions;
using accel::detail::launch::WorkerPool;
using accel::detail::launch::WorkerStatus;
using Clock = std::chrono::steady_clock;

namespace {

struct Line {
  int rank, stream;
  std::string text;
};

// A dead process, or one only waiting to be reaped by init (a zombie).
bool dead_or_zombie(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string content((std::istreambuf_iterator<char>(stat)), {});
  auto close = content.rfind(')');
  return close != std::string::npos && content.size() > close + 2 && content[close + 2] == 'Z';
}

fs::path fresh_dir(const std::string& name) { return accel_test::fresh_dir("pool", name); }

}  // namespace

TEST_CASE("exec workers get their environment; output is prefixed per rank", "[launch][pool]") {
  std::vector<Line> lines;
  PoolOptions po;
  po.prefix_output = true;
  po.on_output = [&](int rank, int stream, std::string_view text) {
    lines.push_back({rank, stream, std::string(text)});
  };
  WorkerPool pool(po);
  for (int r = 0; r < 2; ++r)
    pool.spawn_exec(r, {{"RANK", std::to_string(r)}, {"ACCEL_POOL_TEST", "v" + std::to_string(r)}},
                    {"/bin/sh", "-c", "echo \"out $RANK $ACCEL_POOL_TEST\"; echo err >&2; printf tail"});
  auto out = pool.wait();
  REQUIRE(out.ok());
  CHECK(out.exit_code() == 0);
  REQUIRE(out.workers.size() == 2);
  for (int r = 0; r < 2; ++r) {
    CHECK(out.workers[r].status == WorkerStatus::Succeeded);
    std::vector<std::string> o, e;
    for (const auto& l : lines)
      if (l.rank == r) (l.stream == 1 ? o : e).push_back(l.text);
    CHECK(o == std::vector<std::string>{"out " + std::to_string(r) + " v" + std::to_string(r), "tail"});
    CHECK(e == std::vector<std::string>{"err"});
  }
  CHECK(accel::detail::launch::prefixed_line(3, "hello") == "[rank 3] hello\n");
}

TEST_CASE("exec failures and exit codes follow the shell convention", "[launch][pool]") {
  SECTION("program not found") {
    WorkerPool pool;
    pool.spawn_exec(0, {}, {"accel-no-such-program-xyz"});
    auto out = pool.wait();
    REQUIRE(out.first_failure);
    CHECK(out.first_failure->status == WorkerStatus::Threw);
    CHECK(out.first_failure->message ==
          "cannot execute 'accel-no-such-program-xyz': No such file or directory");
    CHECK(out.exit_code() == 127);
  }
  SECTION("exit 5 on rank 1 stops rank 0") {
    WorkerPool pool;
    const auto t0 = Clock::now();
    pool.spawn_exec(0, {}, {"sleep", "30"});
    pool.spawn_exec(1, {}, {"/bin/sh", "-c", "sleep 0.2; exit 5"});
    auto out = pool.wait();
    REQUIRE(out.first_failure);
    CHECK(out.first_failure->rank == 1);
    CHECK(out.first_failure->message == "exited with status 5");
    CHECK(out.exit_code() == 5);
    CHECK(out.workers[0].status == WorkerStatus::Stopped);
    CHECK(out.workers[0].message == "stopped by signal SIGTERM");
    CHECK(out.stopped_ranks() == std::vector<int>{0});
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 5.0);
  }
  SECTION("killed by SIGKILL") {
    WorkerPool pool;
    pool.spawn_exec(0, {}, {"/bin/sh", "-c", "kill -9 $$"});
    auto out = pool.wait();
    REQUIRE(out.first_failure);
    CHECK(out.first_failure->message == "killed by signal SIGKILL");
    CHECK(out.exit_code() == 128 + SIGKILL);
  }
}

TEST_CASE("the report names the process that failed by itself, not those that failed because of it",
          "[launch][pool]") {
  WorkerPool pool;
  // Rank 0 sees rank 1's failure first (an agreement after a failed read) and
  // is reaped first; rank 1's own error comes 300 ms later.
  pool.spawn(0, {}, [] {
    throw std::runtime_error(
        "accel: load_state failed on process 1 (its own error says why); nothing was loaded");
  });
  pool.spawn(1, {}, [] {
    std::this_thread::sleep_for(300ms);
    throw std::runtime_error("accel: the checkpoint file 'random_states_1.pt' is missing");
  });
  pool.spawn(2, {}, [] { std::this_thread::sleep_for(30s); });
  pool.spawn(3, {}, [] {
    std::this_thread::sleep_for(600ms);  // after rank 1: not the cause, but its own failure
    throw std::runtime_error("rank 3 ran out of memory");
  });
  const auto t0 = Clock::now();
  auto out = pool.wait();
  REQUIRE(out.first_failure);
  CHECK(out.first_failure->rank == 1);
  CHECK(out.first_failure->message == "accel: the checkpoint file 'random_states_1.pt' is missing");
  CHECK(out.others_summary() ==
        "process 0 failed because of it; process 3 failed too: rank 3 ran out of memory; process 2 was stopped");
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 10.0);
}

TEST_CASE("stopping a worker also stops what it started", "[launch][pool]") {
  const fs::path dir = fresh_dir("group");
  WorkerPool pool;
  const std::string pidfile = (dir / "grandchild.pid").string();
  pool.spawn_exec(0, {}, {"/bin/sh", "-c", "sleep 30 & echo $! > " + pidfile + "; wait"});
  pool.spawn(1, {}, [&] {
    for (int i = 0; i < 1000 && !fs::exists(pidfile); ++i) std::this_thread::sleep_for(10ms);
    std::this_thread::sleep_for(50ms);
    throw std::runtime_error("rank 1 gives up");
  });
  auto out = pool.wait();
  REQUIRE(out.first_failure);
  CHECK(out.first_failure->rank == 1);
  CHECK(out.first_failure->message == "rank 1 gives up");
  pid_t grandchild = 0;
  std::ifstream(pidfile) >> grandchild;
  REQUIRE(grandchild > 0);
  bool gone = false;
  for (int i = 0; i < 200 && !gone; ++i, std::this_thread::sleep_for(10ms))
    gone = dead_or_zombie(grandchild);
  CHECK(gone);
}

TEST_CASE("the pool deadline stops everything with exit code 124", "[launch][pool]") {
  PoolOptions po;
  po.timeout = 500ms;
  WorkerPool pool(po);
  pool.spawn_exec(0, {}, {"sleep", "30"});
  pool.spawn(1, {}, [] { std::this_thread::sleep_for(30s); });
  const auto t0 = Clock::now();
  auto out = pool.wait();
  CHECK(out.timed_out);
  CHECK_FALSE(out.first_failure);
  CHECK(out.exit_code() == 124);
  CHECK(out.stopped_ranks() == std::vector<int>{0, 1});
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 3.0);
  for (pid_t p : pool.pids()) CHECK((::kill(p, 0) != 0 && errno == ESRCH));
}

TEST_CASE("SIGINT to the supervisor stops the workers and is reported", "[launch][pool]") {
  WorkerPool pool;
  const pid_t self = ::getpid();
  pool.spawn_exec(0, {}, {"sleep", "30"});
  pool.spawn(1, {}, [self] {
    std::this_thread::sleep_for(100ms);
    ::kill(self, SIGINT);  // as Ctrl-C in the terminal would
    std::this_thread::sleep_for(30s);
  });
  auto out = pool.wait();
  CHECK(out.interrupted_by == SIGINT);
  CHECK(out.exit_code() == 128 + SIGINT);
  CHECK(out.stopped_ranks() == std::vector<int>{0, 1});
  CHECK(out.workers[0].message == "stopped by signal SIGINT");  // forwarded as received
  for (pid_t p : pool.pids()) CHECK((::kill(p, 0) != 0 && errno == ESRCH));
}

TEST_CASE("destroying a pool without wait() leaves nothing running", "[launch][pool]") {
  std::vector<pid_t> pids;
  {
    WorkerPool pool;
    pool.spawn_exec(0, {}, {"sleep", "30"});
    pool.spawn(1, {}, [] { std::this_thread::sleep_for(30s); });
    pids = pool.pids();
  }
  for (pid_t p : pids) CHECK((::kill(p, 0) != 0 && errno == ESRCH));
}

TEST_CASE("exit statuses are seen even when SIGCHLD is ignored", "[launch][pool]") {
  struct sigaction ign {}, old {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  ::sigaction(SIGCHLD, &ign, &old);
  {
    WorkerPool pool;
    pool.spawn_exec(0, {}, {"true"});
    pool.spawn_exec(1, {}, {"/bin/sh", "-c", "sleep 0.1; exit 4"});
    auto out = pool.wait();
    CHECK(out.workers[0].status == WorkerStatus::Succeeded);
    REQUIRE(out.first_failure);
    CHECK(out.first_failure->message == "exited with status 4");
  }
  struct sigaction now {};
  ::sigaction(SIGCHLD, nullptr, &now);
  CHECK(now.sa_handler == SIG_IGN);  // the pool put it back
  ::sigaction(SIGCHLD, &old, nullptr);
}

TEST_CASE("an exception with an empty message is still reported as one", "[launch][pool]") {
  WorkerPool pool;
  pool.spawn(0, {}, [] { throw std::runtime_error(""); });
  auto out = pool.wait();
  REQUIRE(out.first_failure);
  CHECK(out.first_failure->status == WorkerStatus::Threw);
  CHECK(out.first_failure->message == "an exception with an empty message");
}
