// Tests accel::notebook_launcher with real forked workers: the variables each
// worker sees, argument passing, failures (exception, exit status, signal,
// timeout, SIGINT to the launcher) and that no worker survives a failed launch.
#include <accel/launch.hpp>
#include <accel/detail/torch_version.hpp>
#include <accel/runtime/store.hpp>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "catch.hpp"
#include "paths.hpp"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

// A fresh directory for one test's worker reports.
fs::path fresh_dir(const std::string& name) { return accel_test::fresh_dir("launch", name); }

std::string env_or(const char* name, const char* fallback = "<unset>") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Written by a worker: its variables, thread count, pid and received arguments.
void write_report(const fs::path& dir, const std::string& extra = "") {
  std::ostringstream s;
  s << "RANK=" << env_or("RANK") << "\nWORLD_SIZE=" << env_or("WORLD_SIZE")
    << "\nLOCAL_RANK=" << env_or("LOCAL_RANK") << "\nLOCAL_WORLD_SIZE=" << env_or("LOCAL_WORLD_SIZE")
    << "\nNODE_RANK=" << env_or("NODE_RANK") << "\nMASTER_ADDR=" << env_or("MASTER_ADDR")
    << "\nMASTER_PORT=" << env_or("MASTER_PORT")
    << "\nACCEL_FORK_LAUNCHED=" << env_or("ACCEL_FORK_LAUNCHED")
    << "\nACCEL_MIXED_PRECISION=" << env_or("ACCEL_MIXED_PRECISION")
    << "\nthreads=" << at::get_num_threads() << "\npid=" << ::getpid() << "\nextra=" << extra
    << "\n";
  const fs::path tmp = dir / ("rank" + env_or("RANK") + ".tmp");
  std::ofstream(tmp) << s.str();
  fs::rename(tmp, dir / ("rank" + env_or("RANK") + ".txt"));  // readers never see half a file
}

std::map<std::string, std::string> read_report(const fs::path& file) {
  std::map<std::string, std::string> kv;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return kv;
}

// Waits (bounded) until `count` report files exist in dir.
bool wait_for_reports(const fs::path& dir, std::size_t count, std::chrono::seconds limit = 20s) {
  const auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    std::size_t n = 0;
    for (const auto& e : fs::directory_iterator(dir)) n += e.path().extension() == ".txt";
    if (n >= count) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

bool process_gone(pid_t pid) { return ::kill(pid, 0) != 0 && errno == ESRCH; }

void no_core_dump() {
  rlimit none{0, 0};
  ::setrlimit(RLIMIT_CORE, &none);
}

// Runs a launch expected to fail; returns its LaunchError and how long it took.
std::pair<accel::LaunchError, double> failing_launch(const std::function<void()>& launch) {
  const auto t0 = Clock::now();
  try {
    launch();
  } catch (const accel::LaunchError& e) {
    return {e, std::chrono::duration<double>(Clock::now() - t0).count()};
  }
  FAIL("the launch did not throw accel::LaunchError");
  throw std::logic_error("unreachable");
}

}  // namespace

TEST_CASE("2 and 3 workers see their rank variables and the arguments", "[launch]") {
  for (int n : {2, 3}) {
    DYNAMIC_SECTION(n << " workers") {
      const fs::path dir = fresh_dir("vars" + std::to_string(n));
      const int port = accel::detail::launch::pick_free_port();  // a fixed one may be taken under ctest -j
      accel::LaunchOptions opts;
      opts.num_processes = n;
      opts.master_port = port;
      opts.mixed_precision = "bf16";
      accel::notebook_launcher(
          [](const std::string& d, int a, const std::string& b, double c) {
            std::ostringstream args;
            args << a << "," << b << "," << c;
            write_report(d, args.str());
          },
          std::make_tuple(dir.string(), 42, std::string("text"), 2.5), opts);
      for (int r = 0; r < n; ++r) {
        auto kv = read_report(dir / ("rank" + std::to_string(r) + ".txt"));
        CHECK(kv["RANK"] == std::to_string(r));
        CHECK(kv["WORLD_SIZE"] == std::to_string(n));
        CHECK(kv["LOCAL_RANK"] == std::to_string(r));
        CHECK(kv["LOCAL_WORLD_SIZE"] == std::to_string(n));
        CHECK(kv["NODE_RANK"] == "0");
        CHECK(kv["MASTER_ADDR"] == "127.0.0.1");
        CHECK(kv["MASTER_PORT"] == std::to_string(port));
        CHECK(kv["ACCEL_FORK_LAUNCHED"] == "1");
        CHECK(kv["ACCEL_MIXED_PRECISION"] == "bf16");
        CHECK(kv["extra"] == "42,text,2.5");
        CHECK(kv["pid"] != std::to_string(::getpid()));
      }
      // The launcher's process keeps its own environment.
      CHECK(std::getenv("ACCEL_FORK_LAUNCHED") == nullptr);
    }
  }
}

TEST_CASE("accel::launch is the same launcher", "[launch]") {
  const fs::path dir = fresh_dir("alias");
  accel::launch([](const std::string& d) { write_report(d); }, std::make_tuple(dir.string()),
                {.num_processes = 2});
  CHECK(read_report(dir / "rank1.txt")["WORLD_SIZE"] == "2");
}

TEST_CASE("a worker that throws fails the launch and the others are stopped", "[launch]") {
  const fs::path dir = fresh_dir("throw");
  accel::LaunchOptions opts{.num_processes = 3, .timeout = 60s};
  auto [err, seconds] = failing_launch([&] {
    accel::notebook_launcher(
        [](const std::string& d) {
          write_report(d);
          if (env_or("RANK") == "1") {
            wait_for_reports(d, 3);  // the others are certainly running now
            throw std::runtime_error("boom on rank 1");
          }
          std::this_thread::sleep_for(60s);  // would hang the test if not stopped
        },
        std::make_tuple(dir.string()), opts);
  });
  CHECK(err.rank() == 1);
  CHECK(err.message() == "boom on rank 1");
  CHECK(std::string(err.what()) == "accel: process 1 failed: boom on rank 1; processes 0, 2 were stopped");
  CHECK(seconds < 5.0);
  for (int r : {0, 2}) {
    pid_t pid = std::stoi(read_report(dir / ("rank" + std::to_string(r) + ".txt"))["pid"]);
    CHECK(process_gone(pid));
  }
}

TEST_CASE("a worker ignoring SIGTERM is killed after the grace period", "[launch]") {
  const fs::path dir = fresh_dir("stubborn");
  accel::LaunchOptions opts{.num_processes = 2, .timeout = 60s};
  opts.stop_grace = 300ms;
  auto [err, seconds] = failing_launch([&] {
    accel::notebook_launcher(
        [](const std::string& d) {
          std::signal(SIGTERM, SIG_IGN);
          write_report(d);
          if (env_or("RANK") == "0") {
            wait_for_reports(d, 2);
            throw std::invalid_argument("bad input on rank 0");
          }
          std::this_thread::sleep_for(60s);
        },
        std::make_tuple(dir.string()), opts);
  });
  CHECK(err.rank() == 0);
  CHECK(err.message() == "bad input on rank 0");
  CHECK(seconds < 4.0);
  CHECK(process_gone(std::stoi(read_report(dir / "rank1.txt")["pid"])));
}

TEST_CASE("exit status and signals are reported by rank", "[launch]") {
  accel::LaunchOptions opts{.num_processes = 2, .timeout = 60s};
  SECTION("exit(3)") {
    auto [err, s] = failing_launch([&] {
      accel::notebook_launcher([] { if (env_or("RANK") == "1") ::_exit(3); }, std::tuple<>{}, opts);
    });
    CHECK(err.rank() == 1);
    CHECK(err.message() == "exited with status 3");
  }
  SECTION("SIGSEGV") {
    auto [err, s] = failing_launch([&] {
      accel::notebook_launcher(
          [] {
            if (env_or("RANK") == "0") {
              no_core_dump();
              std::raise(SIGSEGV);
            }
          },
          std::tuple<>{}, opts);
    });
    CHECK(err.rank() == 0);
    CHECK(err.message() == "killed by signal SIGSEGV");
  }
  SECTION("abort") {
    auto [err, s] = failing_launch([&] {
      accel::notebook_launcher(
          [] {
            if (env_or("RANK") == "1") {
              no_core_dump();
              std::abort();
            }
            std::this_thread::sleep_for(60s);
          },
          std::tuple<>{}, opts);
    });
    CHECK(err.rank() == 1);
    CHECK(err.message() == "killed by signal SIGABRT");
    CHECK(s < 5.0);
  }
  SECTION("a LibTorch error arrives without its C++ backtrace") {
    auto [err, s] = failing_launch([&] {
      accel::notebook_launcher([] { TORCH_CHECK(env_or("RANK") != "1", "shape mismatch"); },
                               std::tuple<>{}, opts);
    });
    CHECK(err.rank() == 1);
    CHECK(err.message().find("shape mismatch") != std::string::npos);
    CHECK(err.message().find("frame #") == std::string::npos);
  }
}

TEST_CASE("the launch timeout stops hanging workers", "[launch]") {
  const fs::path dir = fresh_dir("timeout");
  accel::LaunchOptions opts{.num_processes = 2, .timeout = 1s};
  const auto t0 = Clock::now();
  try {
    accel::notebook_launcher(
        [](const std::string& d) {
          write_report(d);
          std::this_thread::sleep_for(60s);
        },
        std::make_tuple(dir.string()), opts);
    FAIL("no timeout");
  } catch (const accel::TimeoutError& e) {
    CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring("timed out after 1 s") &&
                             Catch::Matchers::ContainsSubstring("process(es) 0, 1 still running"));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  CHECK(seconds >= 1.0);
  CHECK(seconds < 4.0);
  for (int r : {0, 1})
    CHECK(process_gone(std::stoi(read_report(dir / ("rank" + std::to_string(r) + ".txt"))["pid"])));
}

TEST_CASE("one process on one node runs in this process with the variables set", "[launch]") {
  ::setenv("MASTER_ADDR", "previous-value", 1);
  ::unsetenv("RANK");
  const int threads_before = at::get_num_threads();
  int seen_pid = 0, seen_threads = 0;
  std::string seen_rank, seen_world, seen_addr;
  accel::notebook_launcher(
      [&](int x) {
        CHECK(x == 7);
        seen_pid = ::getpid();
        seen_rank = env_or("RANK");
        seen_world = env_or("WORLD_SIZE");
        seen_addr = env_or("MASTER_ADDR");
        seen_threads = at::get_num_threads();
      },
      std::make_tuple(7), {.master_addr = "127.0.0.1"});
  CHECK(seen_pid == ::getpid());
  CHECK(seen_rank == "0");
  CHECK(seen_world == "1");
  CHECK(seen_addr == "127.0.0.1");
  CHECK(seen_threads == accel::detail::launch::threads_per_worker(1));
  // Restored afterwards.
  CHECK(env_or("MASTER_ADDR") == "previous-value");
  CHECK(std::getenv("RANK") == nullptr);
  CHECK(at::get_num_threads() == threads_before);
  ::unsetenv("MASTER_ADDR");

  SECTION("an exception becomes LaunchError(0) nesting the original") {
    try {
      accel::notebook_launcher([] { throw std::out_of_range("index 9"); }, std::tuple<>{});
      FAIL("no exception");
    } catch (const accel::LaunchError& e) {
      CHECK(e.rank() == 0);
      CHECK(e.message() == "index 9");
      CHECK_THROWS_AS(std::rethrow_if_nested(e), std::out_of_range);
    }
    CHECK(std::getenv("RANK") == nullptr);
  }
}

TEST_CASE("thread count: cores / workers unless OMP_NUM_THREADS is set", "[launch]") {
  using accel::detail::launch::threads_per_worker;
  ::unsetenv("OMP_NUM_THREADS");
  CHECK(threads_per_worker(2, 16) == 8);
  CHECK(threads_per_worker(3, 16) == 5);
  CHECK(threads_per_worker(3, 2) == 1);
  CHECK(threads_per_worker(1, 2) == 2);

  const fs::path dir = fresh_dir("threads");
  accel::notebook_launcher([](const std::string& d) { write_report(d); },
                           std::make_tuple(dir.string()), {.num_processes = 2});
  const int expected = std::max(1, accel::detail::launch::available_cores() / 2);
  CHECK(read_report(dir / "rank0.txt")["threads"] == std::to_string(expected));

  ::setenv("OMP_NUM_THREADS", "3", 1);
  CHECK(threads_per_worker(2, 16) == 3);
  const fs::path dir2 = fresh_dir("threads_omp");
  accel::notebook_launcher([](const std::string& d) { write_report(d); },
                           std::make_tuple(dir2.string()), {.num_processes = 2});
  ::unsetenv("OMP_NUM_THREADS");
  CHECK(read_report(dir2 / "rank0.txt")["threads"] == "3");
  CHECK(read_report(dir2 / "rank1.txt")["threads"] == "3");
}

TEST_CASE("master_port 0 picks one free port for all workers", "[launch]") {
  const fs::path dir = fresh_dir("port0");
  accel::notebook_launcher([](const std::string& d) { write_report(d); },
                           std::make_tuple(dir.string()), {.num_processes = 2, .master_port = 0});
  const auto p0 = read_report(dir / "rank0.txt")["MASTER_PORT"];
  CHECK(p0 == read_report(dir / "rank1.txt")["MASTER_PORT"]);
  const int port = std::stoi(p0);
  CHECK(port > 0);
  CHECK(port <= 65535);
  CHECK(port != 29500);
  CHECK(accel::detail::launch::bind_error("127.0.0.1", port) == 0);  // it was free
}

TEST_CASE("two nodes: two launchers give ranks 0..3 in a world of 4", "[launch]") {
  const fs::path dir = fresh_dir("two_nodes");
  const int port = accel::detail::launch::pick_free_port();
  auto node = [&](int node_rank) {
    accel::notebook_launcher(
        [](const std::string& d) {
          write_report(d);
          // Every worker of both nodes is up at the same time, as in a rendezvous.
          if (!wait_for_reports(d, 4)) throw std::runtime_error("the other node never came");
        },
        std::make_tuple(dir.string()),
        {.num_processes = 2, .num_nodes = 2, .node_rank = node_rank, .master_port = port,
         .timeout = 60s});
  };
  const pid_t other = ::fork();  // node 1 is another process, as on another machine
  REQUIRE(other >= 0);
  if (other == 0) {
    int code = 0;
    try {
      node(1);
    } catch (...) {
      code = 1;
    }
    ::_exit(code);
  }
  node(0);
  int status = 0;
  const auto until = Clock::now() + 30s;
  while (::waitpid(other, &status, WNOHANG) == 0 && Clock::now() < until)
    std::this_thread::sleep_for(10ms);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  for (int r = 0; r < 4; ++r) {
    auto kv = read_report(dir / ("rank" + std::to_string(r) + ".txt"));
    CHECK(kv["WORLD_SIZE"] == "4");
    CHECK(kv["LOCAL_RANK"] == std::to_string(r % 2));
    CHECK(kv["LOCAL_WORLD_SIZE"] == "2");
    CHECK(kv["NODE_RANK"] == std::to_string(r / 2));
    CHECK(kv["MASTER_PORT"] == std::to_string(port));
  }
}

TEST_CASE("invalid options are refused with clear messages", "[launch]") {
  auto noop = [] {};
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{}, {.num_processes = 0}),
                    Catch::Matchers::ContainsSubstring("num_processes is 0. Launch at least 1 process"));
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{}, {.num_processes = 100000}),
                    Catch::Matchers::ContainsSubstring("100000 processes on this machine is more than") &&
                        Catch::Matchers::ContainsSubstring("ACCEL_MAX_LOCAL_PROCESSES=100000"));
  CHECK_THROWS_WITH(
      accel::notebook_launcher(noop, std::tuple<>{}, {.num_nodes = 2, .node_rank = 2}),
      Catch::Matchers::ContainsSubstring("node_rank 2 is outside 0..1"));
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{}, {.master_port = 70000}),
                    Catch::Matchers::ContainsSubstring("master_port 70000 is not a TCP port"));
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{},
                                             {.num_nodes = 2, .master_port = 0}),
                    Catch::Matchers::ContainsSubstring("needs a rendezvous_file") &&
                        Catch::Matchers::ContainsSubstring("Pass the same fixed master_port on every node"));
  accel::LaunchOptions mp;
  mp.mixed_precision = "fp8";
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{}, mp),
                    Catch::Matchers::ContainsSubstring("mixed_precision 'fp8' is unknown"));
}

TEST_CASE("CUDA-before-fork detection reads the process maps", "[launch]") {
  using accel::detail::launch::cuda_driver_loaded;
  CHECK(cuda_driver_loaded("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.535.1\n"));
  CHECK_FALSE(cuda_driver_loaded("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcudart.so.12\n"));
  CHECK_FALSE(cuda_driver_loaded("7f00-7f10 r-xp 0 08:01 1 /opt/libxlibcuda.so\n"));
  CHECK_FALSE(accel::detail::launch::cuda_driver_loaded_in_this_process());  // CPU test build
}

TEST_CASE("ACCEL_DEBUG_MODE: a dry launch checks the workers first", "[launch]") {
  const fs::path dir = fresh_dir("debug");
  ::setenv("ACCEL_DEBUG_MODE", "yes", 1);
  accel::notebook_launcher([](const std::string& d) { write_report(d); },
                           std::make_tuple(dir.string()),
                           {.num_processes = 2, .master_port = accel::detail::launch::pick_free_port()});
  CHECK(read_report(dir / "rank1.txt")["RANK"] == "1");

  // A taken port is named before anything starts.
  accel::detail::launch::Fd s(::socket(AF_INET, SOCK_STREAM, 0));
  sockaddr_in addr = accel::detail::launch::resolve_ipv4("127.0.0.1", 0);
  REQUIRE(::bind(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(s.get(), 1) == 0);
  socklen_t len = sizeof addr;
  ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  const int taken = ntohs(addr.sin_port);
  CHECK_THROWS_WITH(accel::notebook_launcher([] {}, std::tuple<>{},
                                             {.num_processes = 2, .master_port = taken}),
                    Catch::Matchers::ContainsSubstring("master_port " + std::to_string(taken)) &&
                        Catch::Matchers::ContainsSubstring("already in use"));
  ::unsetenv("ACCEL_DEBUG_MODE");
}

TEST_CASE("SIGINT to the launcher stops its workers, then acts as usual", "[launch]") {
  const fs::path dir = fresh_dir("sigint");
  const pid_t launcher = ::fork();  // the "notebook" process that gets Ctrl-C
  REQUIRE(launcher >= 0);
  if (launcher == 0) {
    std::signal(SIGINT, SIG_DFL);
    try {
      accel::notebook_launcher(
          [](const std::string& d) {
            write_report(d);
            std::this_thread::sleep_for(60s);
          },
          std::make_tuple(dir.string()), {.num_processes = 2, .timeout = 60s});
    } catch (...) {
    }
    ::_exit(0);
  }
  REQUIRE(wait_for_reports(dir, 2));
  ::kill(launcher, SIGINT);
  int status = 0;
  const auto until = Clock::now() + 20s;
  while (::waitpid(launcher, &status, WNOHANG) == 0 && Clock::now() < until)
    std::this_thread::sleep_for(10ms);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGINT);
  for (int r : {0, 1})
    CHECK(process_gone(std::stoi(read_report(dir / ("rank" + std::to_string(r) + ".txt"))["pid"])));
}

TEST_CASE("workers use OpenMP threads even after the launcher's process did", "[launch]") {
  // GNU OpenMP is not fork-safe: a child forked from a thread that already ran
  // a parallel region hangs in its first one. The launcher forks from a fresh thread.
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  std::atomic<int> seen{0};
  at::parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) { seen += static_cast<int>(e - b); });
  REQUIRE(seen == 1000);
  at::set_num_threads(before);
  ::setenv("OMP_NUM_THREADS", "2", 1);
  const fs::path dir = fresh_dir("openmp");
  accel::notebook_launcher(
      [](const std::string& d) {
        std::atomic<int> n{0};
        at::parallel_for(0, 1000, 1, [&](int64_t b, int64_t e) { n += static_cast<int>(e - b); });
        write_report(d, std::to_string(n.load()));
      },
      std::make_tuple(dir.string()), {.num_processes = 2, .timeout = 60s});
  ::unsetenv("OMP_NUM_THREADS");
  for (int r : {0, 1}) {
    auto kv = read_report(dir / ("rank" + std::to_string(r) + ".txt"));
    CHECK(kv["extra"] == "1000");
    CHECK(kv["threads"] == "2");
  }
}

TEST_CASE("backward() in workers after backward() in the launching process", "[launch][autograd]") {
  // The launching process is a child of the test, so that the test process
  // itself never runs autograd before it forks other tests' workers.
  const fs::path result = fresh_dir("autograd") / "result.txt";
  const pid_t notebook = ::fork();
  REQUIRE(notebook >= 0);
  if (notebook == 0) {
    std::ofstream out(result);
    try {
      auto x = torch::ones({3}, torch::requires_grad());
      x.sum().backward();  // what a notebook cell before the launch may do
      accel::notebook_launcher(
          [] {
            auto y = torch::ones({3}, torch::requires_grad());
            (y * 2).sum().backward();
            if (!torch::equal(y.grad(), torch::full({3}, 2.0))) throw std::runtime_error("wrong grad");
          },
          std::tuple<>{}, {.num_processes = 2, .timeout = 60s});
      out << "ok";
    } catch (const std::exception& e) {
      out << e.what();
    }
    out.close();
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(notebook, &status, 0) == notebook);
  REQUIRE(WIFEXITED(status));
  std::ifstream in(result);
  const std::string got{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
#if ACCEL_TORCH_AT_LEAST(2, 0)
  // LibTorch 2.x refuses autograd in such workers: accel says why and what to do.
  CHECK_THAT(got, Catch::Matchers::ContainsSubstring("accel: process ") &&
                      Catch::Matchers::ContainsSubstring(
                          "backward() cannot run in a worker forked by notebook_launcher") &&
                      Catch::Matchers::ContainsSubstring("Call notebook_launcher before any backward()"));
#else
  CHECK(got == "ok");  // LibTorch 1.13 allows it on CPU
#endif
}

TEST_CASE("prefix_output tags every worker line with its rank", "[launch]") {
  const fs::path out = fresh_dir("prefix") / "stdout.txt";
  std::fflush(stdout);
  std::cout.flush();
  const int saved = ::dup(STDOUT_FILENO);
  {
    accel::detail::launch::Fd file(::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644));
    ::dup2(file.get(), STDOUT_FILENO);
  }
  accel::LaunchOptions opts{.num_processes = 2};
  opts.prefix_output = true;
  accel::notebook_launcher(
      [] { std::cout << "hello from " << env_or("RANK") << "\nno newline"; }, std::tuple<>{}, opts);
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  std::ifstream in(out);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::sort(lines.begin(), lines.end());
  CHECK(lines == std::vector<std::string>{"[rank 0] hello from 0", "[rank 0] no newline",
                                          "[rank 1] hello from 1", "[rank 1] no newline"});
}

TEST_CASE("two nodes meet in a c10d TCPStore through the launcher's variables", "[launch]") {
  // Node 0 and node 1 are two launcher processes (as on two machines); their
  // four workers rendezvous on MASTER_ADDR:MASTER_PORT and each learns every
  // other worker's global rank from the store.
  const fs::path dir = fresh_dir("two_nodes_store");
  int port = accel::detail::launch::pick_free_port("127.0.0.1");
  std::optional<std::string> rdzv;
  SECTION("a fixed port") {}
  SECTION("port 0: node 0 picks it and tells node 1 through the rendezvous file") {
    port = 0;
    rdzv = (dir / "rdzv").string();
  }
  auto node = [&](int node_rank) {
    accel::notebook_launcher(
        [](const std::string& d) {
          const auto env = accel::runtime::ProcessEnv::discover();
          accel::runtime::StoreOptions so;
          so.timeout = std::chrono::seconds(30);
          auto store = accel::runtime::make_store(env, so);
          const std::string me = std::to_string(env.rank);
          store->set("node_of_" + me, std::vector<uint8_t>(1, static_cast<uint8_t>(
                                                                   std::stoi(env_or("NODE_RANK")))));
          std::vector<std::string> keys;
          for (int r = 0; r < env.world_size; ++r) keys.push_back("node_of_" + std::to_string(r));
          store->wait(keys);
          std::string nodes;
          for (const auto& k : keys) nodes += std::to_string(store->get(k).at(0));
          store->add("done", 1);
          write_report(d, nodes + " " + std::to_string(env.world_size));
          // Rank 0 hosts the store: it leaves only when everyone has read from it.
          if (env.rank == 0)
            while (store->add("done", 0) < env.world_size) std::this_thread::sleep_for(5ms);
        },
        std::make_tuple(dir.string()),
        {.num_processes = 2, .num_nodes = 2, .node_rank = node_rank, .master_port = port,
         .timeout = 60s, .rendezvous_file = rdzv});
  };
  const pid_t other = ::fork();
  REQUIRE(other >= 0);
  if (other == 0) {
    int code = 0;
    try {
      node(1);
    } catch (...) {
      code = 1;
    }
    ::_exit(code);
  }
  node(0);
  int status = 0;
  const auto until = Clock::now() + 30s;
  while (::waitpid(other, &status, WNOHANG) == 0 && Clock::now() < until)
    std::this_thread::sleep_for(10ms);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  std::string seen;
  for (int r = 0; r < 4; ++r) {
    auto kv = read_report(dir / ("rank" + std::to_string(r) + ".txt"));
    CHECK(kv["extra"] == "0011 4");
    if (r == 0) seen = kv["MASTER_PORT"];
    CHECK(kv["MASTER_PORT"] == seen);  // one port on both nodes
  }
  CHECK(std::stoi(seen) > 0);
  if (port != 0) CHECK(seen == std::to_string(port));
  if (rdzv) CHECK(!fs::exists(*rdzv));  // node 0 removed it after its launch
}

TEST_CASE("several nodes with port 0: a rendezvous file is needed, and waited for", "[launch]") {
  auto noop = [] {};
  const fs::path dir = fresh_dir("rdzv_wait");
  // Node 1 without node 0: the launch timeout ends the wait with a clear error.
  const auto t0 = Clock::now();
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{},
                                             {.num_processes = 1, .num_nodes = 2, .node_rank = 1,
                                              .master_port = 0, .timeout = 1s,
                                              .rendezvous_file = (dir / "never").string()}),
                    Catch::Matchers::ContainsSubstring("waited for node 0 to write the port") &&
                        Catch::Matchers::ContainsSubstring("never"));
  CHECK(Clock::now() - t0 < 10s);
  // A file that is not accel's is refused, not misread.
  std::ofstream(dir / "other") << "hello 12\n";
  CHECK_THROWS_WITH(accel::notebook_launcher(noop, std::tuple<>{},
                                             {.num_processes = 1, .num_nodes = 2, .node_rank = 1,
                                              .master_port = 0, .timeout = 5s,
                                              .rendezvous_file = (dir / "other").string()}),
                    Catch::Matchers::ContainsSubstring("is not an accel rendezvous file"));
}
