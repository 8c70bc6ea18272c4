// The progress bar: its formatting (pure functions), when it draws, and what a
// real terminal (a pseudo-terminal from openpty) and a pipe receive.
#include <accel/accelerator.hpp>
#include <accel/tracking/progress.hpp>

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include "catch.hpp"

#include <cstdlib>
#include <string>

namespace tr = accel::tracking;
namespace td = accel::tracking::detail;

TEST_CASE("progress formats durations, rates and bars", "[tracking][progress]") {
  CHECK(td::format_duration(0) == "00:00");
  CHECK(td::format_duration(65.4) == "01:05");
  CHECK(td::format_duration(59.6) == "01:00");
  CHECK(td::format_duration(3723) == "1:02:03");
  CHECK(td::format_duration(-1) == "?");
  CHECK(td::format_duration(std::numeric_limits<double>::infinity()) == "?");

  CHECK(td::format_rate(12.345) == "12.35it/s");
  CHECK(td::format_rate(0.4) == "2.50s/it");
  CHECK(td::format_rate(0) == "?it/s");

  CHECK(td::format_bar(0, 10, 10) == "[----------]");
  CHECK(td::format_bar(4, 10, 10) == "[####------]");
  CHECK(td::format_bar(10, 10, 10) == "[##########]");
  CHECK(td::format_bar(15, 10, 4) == "[####]");  // clamped
  CHECK(td::format_bar(3, 0, 4) == "[----]");    // unknown total

  CHECK(td::format_postfix({{"loss", 0.123456}, {"acc", 0.5}}) == "loss=0.1235, acc=0.5");
}

TEST_CASE("progress line: percentage, counts, elapsed<ETA, rate, postfix", "[tracking][progress]") {
  // 4 of 10 in 2 s: 2 it/s, 6 left -> 3 s.
  CHECK(td::format_line("train", 4, 10, 2.0, 10) ==
        "train  40%[####------] 4/10 [00:02<00:03, 2.00it/s]");
  CHECK(td::format_line("", 10, 10, 5.0, 4, {{"loss", 0.25}}) ==
        "100%[####] 10/10 [00:05<00:00, 2.00it/s, loss=0.25]");
  // Nothing done yet: rate and ETA unknown.
  CHECK(td::format_line("eval", 0, 8, 0.0, 4) == "eval   0%[----] 0/8 [00:00<?, ?it/s]");
  // Unknown total: count, elapsed and rate only.
  CHECK(td::format_line("x", 30, 0, 10.0, 4) == "x 30 [00:10, 3.00it/s]");
}

TEST_CASE("progress draws only on a main process, on a terminal, unless disabled",
          "[tracking][progress]") {
  ::unsetenv("ACCEL_DISABLE_PROGRESS");
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  std::FILE* pipe_end = ::fdopen(fds[1], "w");
  REQUIRE(pipe_end != nullptr);

  tr::ProgressOptions o;
  o.stream = pipe_end;
  CHECK_FALSE(tr::progress_enabled(o));  // a pipe is not a terminal
  o.enabled = true;
  CHECK(tr::progress_enabled(o));        // forced on
  o.main_process = false;
  CHECK_FALSE(tr::progress_enabled(o));  // never on other processes

  int master = -1, slave = -1;
  REQUIRE(::openpty(&master, &slave, nullptr, nullptr, nullptr) == 0);
  std::FILE* tty = ::fdopen(slave, "w");
  REQUIRE(tty != nullptr);
  tr::ProgressOptions t;
  t.stream = tty;
  CHECK(tr::progress_enabled(t));
  ::setenv("ACCEL_DISABLE_PROGRESS", "1", 1);
  CHECK_FALSE(tr::progress_enabled(t));
  ::setenv("ACCEL_DISABLE_PROGRESS", "0", 1);
  CHECK(tr::progress_enabled(t));
  ::unsetenv("ACCEL_DISABLE_PROGRESS");
  t.enabled = false;
  CHECK_FALSE(tr::progress_enabled(t));

  // A disabled bar still counts.
  tr::ProgressBar bar(5, "x", o);
  bar.update(2);
  CHECK(bar.n() == 2);
  CHECK_FALSE(bar.enabled());

  std::fclose(tty);
  ::close(master);
  std::fclose(pipe_end);
  ::close(fds[0]);
}

namespace {

// Reads everything from fd until EOF/EIO (a pty master reads EIO once the
// child's side is closed) or 20 s pass.
std::string drain(int fd) {
  std::string out;
  char buf[4096];
  for (int i = 0; i < 200; ++i) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    auto n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// The child: an Accelerator's bar over 5 steps on its stdout, then exit.
[[noreturn]] void child_draws(bool disable_env) {
  if (disable_env) ::setenv("ACCEL_DISABLE_PROGRESS", "1", 1);
  {
    accel::Accelerator<> acc;
    tr::ProgressOptions o;
    o.min_interval_s = 0;  // draw every update
    auto bar = acc.progress(5, "train", o);
    for (int i = 0; i < 5; ++i) bar.update(1, {{"loss", 1.0 / (i + 1)}});
  }
  std::fflush(stdout);
  ::_exit(0);
}

int wait_child(pid_t pid) {
  int status = 0;
  for (int i = 0; i < 200; ++i) {
    if (::waitpid(pid, &status, WNOHANG) == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    ::usleep(50000);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -2;
}

}  // namespace

TEST_CASE("a pseudo-terminal receives \\r-redraws and one final newline", "[tracking][progress]") {
  std::fflush(nullptr);  // or the child would also flush what the parent buffered
  int master = -1;
  pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  REQUIRE(pid >= 0);
  if (pid == 0) child_draws(false);
  auto out = drain(master);
  ::close(master);
  REQUIRE(wait_child(pid) == 0);
  // The tty line discipline turns "\n" into "\r\n" (ONLCR).
  INFO(out);
  CHECK(std::count(out.begin(), out.end(), '\r') >= 6);  // first draw + 5 updates (+ close)
  CHECK(out.find("train   0%") != std::string::npos);
  CHECK(out.find("train 100%[########################] 5/5 [") != std::string::npos);
  CHECK(out.find("loss=0.2]") != std::string::npos);
  REQUIRE(out.size() >= 2);
  CHECK(out.substr(out.size() - 2) == "\r\n");
  CHECK(std::count(out.begin(), out.end(), '\n') == 1);  // one line, redrawn in place
}

TEST_CASE("a pipe, or ACCEL_DISABLE_PROGRESS=1 on a terminal, receives nothing",
          "[tracking][progress]") {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    child_draws(false);
  }
  ::close(fds[1]);
  auto piped = drain(fds[0]);
  ::close(fds[0]);
  REQUIRE(wait_child(pid) == 0);
  CHECK(piped.empty());

  int master = -1;
  std::fflush(nullptr);
  pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  REQUIRE(pid >= 0);
  if (pid == 0) child_draws(true);
  auto tty = drain(master);
  ::close(master);
  REQUIRE(wait_child(pid) == 0);
  CHECK(tty.empty());
}
