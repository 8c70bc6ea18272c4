// Accelerator::profile: a Chrome trace per rank with LibTorch's operators
// (and their input shapes),
// and merge_traces with one track per rank. No backward() runs in the test
// process before the 2-process case forks (LibTorch 2.x refuses autograd in
// a child forked after it).
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/profiling/trace.hpp>

#include <fstream>
#include <map>
#include <tuple>
#include <vector>
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

/// The Chrome trace event format's required fields, and every asynchronous
/// span ("b" ... "e", same pid, cat and id) begun once, ended once, after it
/// began; returns the event names.
std::set<std::string> check_events(const nlohmann::json& events, std::set<int>& pids) {
  std::set<std::string> names;
  std::map<std::tuple<int, std::string, int64_t>, std::pair<double, int>> open;  // begin ts, state
  REQUIRE(events.is_array());
  for (const auto& e : events) {
    INFO(e.dump());
    REQUIRE(e.contains("name"));
    REQUIRE(e.contains("ph"));
    REQUIRE(e.contains("pid"));
    REQUIRE(e.contains("tid"));
    pids.insert(e["pid"].get<int>());
    const auto ph = e["ph"].get<std::string>();
    if (ph == "M") continue;
    REQUIRE(e["ts"].is_number());
    names.insert(e["name"].get<std::string>());
    if (ph == "X") {
      REQUIRE(e["dur"].is_number());
      CHECK(e["dur"].get<double>() >= 0);
      continue;
    }
    REQUIRE((ph == "b" || ph == "n" || ph == "e"));
    REQUIRE(e.contains("cat"));
    REQUIRE(e.contains("id"));
    const std::tuple key{e["pid"].get<int>(), e["cat"].get<std::string>(), e["id"].get<int64_t>()};
    const double ts = e["ts"].get<double>();
    if (ph == "b") {
      REQUIRE(open.count(key) == 0);
      open[key] = {ts, 1};
    } else {
      REQUIRE(open.count(key) == 1);
      REQUIRE(open[key].second == 1);
      CHECK(ts >= open[key].first);
      if (ph == "e") open[key].second = 2;
    }
  }
  for (const auto& [key, state] : open) {
    INFO("span " << std::get<1>(key) << " " << std::get<2>(key) << " of pid " << std::get<0>(key));
    CHECK(state.second == 2);
  }
  return names;
}

/// The events named `name` (of pid `pid`, -1: any).
std::vector<nlohmann::json> named(const nlohmann::json& events, const std::string& name, int pid = -1) {
  std::vector<nlohmann::json> out;
  for (const auto& e : events)
    if (e["name"] == name && (pid < 0 || e["pid"] == pid)) out.push_back(e);
  return out;
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
    auto x = torch::randn({8, 3});
    (void)torch::mm(x, x.t()).relu();
  }
  std::set<int> pids;
  const auto events = read(dir / "trace_rank0.json");
  const auto names = check_events(events, pids);
  CHECK(names.count("aten::mm") == 1);
  CHECK(names.count("aten::relu") == 1);
  CHECK(pids == std::set<int>{0});
  // Operators carry their input shapes, as Kineto's traces do.
  const auto mm = named(events, "aten::mm");
  REQUIRE(mm.size() == 1);
  CHECK(mm[0]["args"]["Input Dims"] == nlohmann::json::parse("[[8, 3], [3, 8]]"));
  CHECK(named(events, "aten::relu")[0]["args"]["Input Dims"] == nlohmann::json::parse("[[8, 8]]"));
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

namespace {

struct Data : torch::data::datasets::Dataset<Data> {
  torch::Tensor x = torch::randn({64, 16}, at::detail::createCPUGenerator(3));
  torch::data::Example<> get(size_t i) override { return {x[i], x[i].sum().unsqueeze(0)}; }
  torch::optional<size_t> size() const override { return 64; }
};

// A prepared model trained for 4 steps while profiling, and one save_state:
// accel's own events land in the trace beside the operators.
void trained_rank(std::string dir) {
  accel::Accelerator<accel::backend::Gloo> acc(accel::AcceleratorOptions{.bucket_cap_mb = 0.001});
  torch::manual_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  torch::optim::SGD sgd(model->parameters(), 0.1);
  auto loader = accel::data::make_data_loader(Data(), {.batch_size = 8});
  auto [m, opt, dl] = acc.prepare(model, sgd, loader);
  {
    auto trace = acc.profile(dir);
    int steps = 0;
    for (auto& batch : dl) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(m(batch.data), batch.target));
      opt.step();
      if (++steps == 4) break;
    }
    acc.save_state(dir + "/ckpt");
  }
  acc.wait_for_everyone();
  if (acc.is_main_process()) accel::profiling::merge_traces(dir, acc.num_processes());
}

}  // namespace

TEST_CASE("profile: accel's events (bucket reductions, waits, data loading, save_state) on every rank",
          "[profiling][gloo]") {
  const auto dir = accel_test::scratch("profiling", "events");
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(120);
  accel::notebook_launcher(trained_rank, std::make_tuple(dir.string()), lo);
  std::set<int> pids;
  const auto events = read(dir / "trace.json")["traceEvents"];
  const auto names = check_events(events, pids);
  CHECK(pids == std::set<int>{0, 1});
  // ~1 kB buckets, parameters in reverse order: the biases and the 32x1
  // weight share bucket 0 (260 B), the 16x32 weight (2 kB) is bucket 1.
  for (int rank : {0, 1}) {
    INFO("rank " << rank);
    std::map<std::string, int> begun, ended;
    int64_t bytes_per_round = 0;
    for (const auto& e : events) {
      if (e["pid"] != rank || e.value("cat", "") != "accel.comm") continue;
      const auto ph = e["ph"].get<std::string>();
      if (ph == "b") {
        ++begun[e["name"].get<std::string>()];
        if (e["args"]["round"] == 0) bytes_per_round += e["args"]["bytes"].get<int64_t>();
      }
      if (ph == "n") CHECK((e["args"]["from"] == "backward" || e["args"]["from"] == "close"));
      if (ph == "e") ++ended[e["name"].get<std::string>()];
    }
    REQUIRE(begun.size() >= 2);  // several buckets
    for (const auto& [name, n] : begun) {
      CHECK(n == 4);  // one span per bucket and step
      CHECK(ended[name] == 4);
    }
    // Every gradient byte is in exactly one bucket: (16*32 + 32 + 32 + 1) floats.
    CHECK(bytes_per_round == (16 * 32 + 32 + 32 + 1) * 4);
    CHECK(named(events, "accel: optimizer.step waits for gradients", rank).size() == 4);
    CHECK(named(events, "accel: data loading", rank).size() == 4);
    CHECK(named(events, "accel: save_state", rank).size() == 1);
    CHECK_FALSE(named(events, "accel: wait for bucket reduction", rank).empty());
    for (const auto& w : named(events, "accel: wait for bucket reduction", rank))
      CHECK((w["args"]["bucket"] == 0 || w["args"]["bucket"] == 1));
  }
  // Each wait sits inside a step's wait, on the same thread (one track).
  for (const auto& w : named(events, "accel: wait for bucket reduction")) {
    bool inside = false;
    for (const auto& s : named(events, "accel: optimizer.step waits for gradients", w["pid"]))
      inside = inside || (s["tid"] == w["tid"] && s["ts"] <= w["ts"] &&
                          w["ts"].get<double>() + w["dur"].get<double>() <=
                              s["ts"].get<double>() + s["dur"].get<double>());
    CHECK(inside);
  }
}

TEST_CASE("profile: nothing is recorded outside a profile() object; one at a time", "[profiling]") {
  const auto dir = accel_test::scratch("profiling", "scope");
  accel::Accelerator<> acc;
  CHECK_FALSE(accel::profiling::Events::recording());
  std::optional<accel::profiling::Span> before;
  before.emplace("begun before profiling", "test");  // does not read the clock: never recorded
  {
    auto trace = acc.profile(dir);
    CHECK(accel::profiling::Events::recording());
    CHECK_THROWS_WITH(acc.profile(dir / "second"),
                      Catch::Matchers::ContainsSubstring("another profile() object of this process is still recording"));
    { accel::profiling::Span inside("inside", "test"); }
    before.reset();
  }
  CHECK_FALSE(accel::profiling::Events::recording());
  { accel::profiling::Span after("after", "test"); }
  std::set<int> pids;
  const auto names = check_events(read(dir / "trace_rank0.json"), pids);
  CHECK(names.count("inside") == 1);
  CHECK(names.count("begun before profiling") == 0);
  CHECK(names.count("after") == 0);
}
