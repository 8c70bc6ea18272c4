// Accelerator::profile: a Chrome trace per rank with LibTorch's operators,
// and merge_traces with one track per rank. No backward() runs in the test
// process before the 2-process case forks (LibTorch 2.x refuses autograd in
// a child forked after it).
#include <accel/accelerator.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/profiling/trace.hpp>

#include <fstream>
#include <set>
#include <string>

#include <nlohmann/json.hpp>

#include "catch.hpp"

#include "paths.hpp"

namespace {

nlohmann::json read(const std::filesystem::path& f) {
  std::ifstream in(f);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

/// The Chrome trace event format's required fields; returns the operator names.
std::set<std::string> check_events(const nlohmann::json& events, std::set<int>& pids) {
  std::set<std::string> names;
  REQUIRE(events.is_array());
  for (const auto& e : events) {
    INFO(e.dump());
    REQUIRE(e.contains("name"));
    REQUIRE(e.contains("ph"));
    REQUIRE(e.contains("pid"));
    REQUIRE(e.contains("tid"));
    pids.insert(e["pid"].get<int>());
    if (e["ph"] == "M") continue;
    REQUIRE(e["ph"] == "X");  // complete events: no begin/end pairs to match
    REQUIRE(e["ts"].is_number());
    REQUIRE(e["dur"].is_number());
    CHECK(e["dur"].get<double>() >= 0);
    names.insert(e["name"].get<std::string>());
  }
  return names;
}

void profiled_rank(std::string dir) {
  accel::Accelerator<accel::backend::Gloo> acc;
  {
    auto trace = acc.profile(dir);
    auto x = torch::randn({16, 16});
    auto y = torch::mm(x, x);
    (void)acc.reduce(y);
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) accel::profiling::merge_traces(dir, acc.num_processes());
}

}  // namespace

TEST_CASE("profile: a Chrome trace with LibTorch's operators", "[profiling]") {
  const auto dir = accel_test::scratch("profiling", "one");
  accel::Accelerator<> acc;
  {
    auto trace = acc.profile(dir);
    auto x = torch::randn({8, 8});
    (void)torch::mm(x, x).relu();
  }
  std::set<int> pids;
  const auto names = check_events(read(dir / "trace_rank0.json"), pids);
  CHECK(names.count("aten::mm") == 1);
  CHECK(names.count("aten::relu") == 1);
  CHECK(pids == std::set<int>{0});
}

TEST_CASE("profile: 2 processes, merged into one trace with a track per rank", "[profiling][gloo]") {
  const auto dir = accel_test::scratch("profiling", "two");
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(120);
  accel::notebook_launcher(profiled_rank, std::make_tuple(dir.string()), lo);
  std::set<int> pids;
  const auto merged = read(dir / "trace.json");
  const auto names = check_events(merged["traceEvents"], pids);
  CHECK(pids == std::set<int>{0, 1});
  CHECK(names.count("aten::mm") == 1);
}
