// Elastic restarts end to end on 2 Gloo processes: a training that saves an
// automatic checkpoint every 4 steps and calls load_latest_state() first;
// rank 1 dies by SIGKILL in the middle of an epoch (or during a save) on the
// first attempt only. With max_restarts = 1 the launch finishes by itself and
// the parameters are bit-identical to an uninterrupted run; with 0 it fails.
// Also load_latest_state() on one process: which checkpoint it picks, and
// what it skips.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/random.hpp>
#include <accel/runtime/restart_count.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
#include <thread>

#include "catch.hpp"
#include "paths.hpp"

#include "workload.hpp"

namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;

namespace {

fs::path scratch(const std::string& name) { return accel_test::fresh_dir("elastic", name); }

struct Counter {
  int64_t step = 0;
  torch::Tensor state_dict() const { return torch::tensor(step); }
  void load_state_dict(const torch::Tensor& t) { step = t.item<int64_t>(); }
};

/// A small MLP with dropout (each rank's generator state matters); 72 rows,
/// 4 per rank and step: 9 steps per epoch, 20 steps cross two epochs.
torch::nn::Sequential small_mlp(uint64_t seed = 1) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(16, 32));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Dropout(0.2));
  seq->push_back(torch::nn::Linear(32, 4));
  return seq;
}

auto small_loader(int64_t batch) {
  torch::manual_seed(0);
  workload::Data d{torch::randn({72, 16}), torch::randint(0, 4, {72}, torch::kLong)};
  return accel::data::make_data_loader(
      workload::Dataset(d), accel::data::LoaderOptions{.batch_size = batch, .shuffle = true, .seed = 7});
}

enum Fault { kNone = 0, kKillAtStep10 = 1, kKillDuringSecondSave = 2 };

/// 20 steps, save_state() (automatic naming) every 4; load_latest_state()
/// first. On attempt 0 only, rank `fault_rank` meets `fault`. Rank 0 appends
/// "attempt resumed-from" to project/attempts.txt; each rank writes its
/// final parameters to out_<rank>.pt.
void train(std::string out, std::string project, int fault, int fault_rank) {
  accel::AcceleratorOptions o;
  o.project_dir = project;
  o.automatic_checkpoint_naming = true;
  accel::Accelerator<accel::backend::Gloo> acc(o);
  auto model = small_mlp();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::StepLR steplr(sgd, 3, 0.7);
  auto loader = small_loader(4);
  accel::set_seed(42, /*device_specific=*/true);
  Counter counter;
  auto [m, opt, dl, sched] = acc.prepare(model, sgd, loader, steplr);
  acc.register_for_checkpointing(counter);
  const auto resumed = acc.load_latest_state();
  if (acc.is_main_process())
    std::ofstream(fs::path(project) / "attempts.txt", std::ios::app)
        << accel::restart_count() << ' ' << (resumed ? resumed->filename().string() : "-") << '\n';
  const bool faulty = accel::restart_count() == 0 && acc.process_index() == fault_rank;
  while (counter.step < 20) {
    for (auto& batch : dl) {
      opt.zero_grad();
      acc.backward(torch::cross_entropy_loss(m(batch.data), batch.target));
      opt.step();
      sched.step();
      ++counter.step;
      if (counter.step % 4 == 0) {
        if (faulty && fault == kKillDuringSecondSave && counter.step == 8)
          ::setenv("ACCEL_TEST_SAVE_STATE_CRASH", "writing", 1);  // SIGKILL half-way through
        acc.save_state();
      }
      if (faulty && fault == kKillAtStep10 && counter.step == 10) std::raise(SIGKILL);
      if (counter.step == 20) break;
    }
  }
  std::vector<torch::Tensor> params;
  for (auto& p : model->parameters()) params.push_back(p.detach().clone());
  torch::save(params, out + "_" + std::to_string(acc.process_index()) + ".pt");
}

std::string text(const fs::path& f);

/// One machine's launch: 2 processes; with `machines` > 1, node `node` of
/// them, meeting machine 0 at `port`.
void launch(const fs::path& out, const fs::path& project, Fault fault, int max_restarts,
            int fault_rank = 1, int machines = 1, int node = 0, int port = 0) {
  fs::create_directories(project);
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.num_nodes = machines;
  lo.node_rank = node;
  lo.master_port = port;
  lo.timeout = std::chrono::seconds(300);
  lo.stop_grace = std::chrono::seconds(2);
  lo.max_restarts = max_restarts;
  accel::notebook_launcher(
      train, std::make_tuple(out.string(), project.string(), static_cast<int>(fault), fault_rank), lo);
}

/// Two machines on this one: machine 1's launcher is a forked process, as on
/// another machine; machine 0's runs here. Returns machine 0's error ("" if
/// none) and expects machine 1 to end the same way (its error in a file).
std::string launch_two_machines(const fs::path& out, const fs::path& project, Fault fault,
                                int max_restarts, int fault_rank) {
  fs::create_directories(project);
  const int port = accel::detail::launch::pick_free_port();
  const fs::path other_error = out.string() + "_machine1_error.txt";
  const pid_t other = ::fork();
  REQUIRE(other >= 0);
  if (other == 0) {
    int code = 0;
    try {
      launch(out, project, fault, max_restarts, fault_rank, 2, 1, port);
    } catch (const std::exception& e) {
      std::ofstream(other_error) << e.what();
      code = 1;
    }
    ::_exit(code);
  }
  std::string error;
  try {
    launch(out, project, fault, max_restarts, fault_rank, 2, 0, port);
  } catch (const std::exception& e) {
    error = e.what();
  }
  int status = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::waitpid(other, &status, WNOHANG) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (::waitpid(other, &status, WNOHANG) == 0) {
    ::kill(other, SIGKILL);
    ::waitpid(other, &status, 0);
    FAIL("machine 1's launcher did not end within 60 s of machine 0's");
  }
  REQUIRE(WIFEXITED(status));
  INFO("machine 0: " << error);
  INFO("machine 1: " << (fs::exists(other_error) ? text(other_error) : std::string("no error")));
  CHECK(WEXITSTATUS(status) == (error.empty() ? 0 : 1));
  return error;
}

std::vector<torch::Tensor> load_params(const fs::path& out, int rank) {
  std::vector<torch::Tensor> v;
  torch::load(v, out.string() + "_" + std::to_string(rank) + ".pt");
  return v;
}

void check_identical(const fs::path& a_out, const fs::path& b_out, int world = 2) {
  for (int r = 0; r < world; ++r) {
    auto a = load_params(a_out, r);
    auto b = load_params(b_out, r);
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("rank " << r << " parameter " << i << " max |diff| = " << (a[i] - b[i]).abs().max().item<double>());
      CHECK(torch::equal(a[i], b[i]));
    }
  }
}

std::string text(const fs::path& f) {
  std::ifstream in(f);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

const std::set<std::string> kAllFive{"checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3",
                                     "checkpoint_4"};

}  // namespace

TEST_CASE("elastic: rank 1 killed mid-epoch on attempt 0; max_restarts 1 resumes and ends bit-identical",
          "[checkpoint][elastic][gloo]") {
  const auto dir = scratch("kill");
  launch(dir / "full", dir / "full_project", kNone, 0);
  CHECK(text(dir / "full_project" / "attempts.txt") == "0 -\n");

  launch(dir / "restarted", dir / "project", kKillAtStep10, 1);
  // Attempt 1 resumed from step 8's checkpoint_1, and numbered on from 2.
  CHECK(text(dir / "project" / "attempts.txt") == "0 -\n1 checkpoint_1\n");
  CHECK(listing(dir / "project" / "checkpoints") == kAllFive);
  check_identical(dir / "full", dir / "restarted");
}

TEST_CASE("elastic: the same kill with max_restarts 0 fails the launch, naming rank 1",
          "[checkpoint][elastic][gloo]") {
  const auto dir = scratch("no_restart");
  CHECK_THROWS_WITH(launch(dir / "out", dir / "project", kKillAtStep10, 0),
                    Catch::Matchers::StartsWith("accel: process 1 failed: killed by signal SIGKILL"));
  CHECK(text(dir / "project" / "attempts.txt") == "0 -\n");
  CHECK(!fs::exists(dir / "out_0.pt"));
}

TEST_CASE("elastic: rank 1 killed during save_state on attempt 0 resumes from the previous checkpoint",
          "[checkpoint][elastic][gloo][sigkill]") {
  const auto dir = scratch("kill_in_save");
  launch(dir / "full", dir / "full_project", kNone, 0);
  launch(dir / "restarted", dir / "project", kKillDuringSecondSave, 1);
  // The save of step 8 (checkpoint_1) died half-way: attempt 1 resumed from
  // step 4's checkpoint_0 and wrote checkpoint_1 again, over the leftover.
  CHECK(text(dir / "project" / "attempts.txt") == "0 -\n1 checkpoint_0\n");
  CHECK(listing(dir / "project" / "checkpoints") == kAllFive);
  check_identical(dir / "full", dir / "restarted");
}

TEST_CASE("elastic, two machines: rank 3 (machine 1) killed mid-epoch; both machines restart and end bit-identical",
          "[checkpoint][elastic][gloo][machines]") {
  const auto dir = scratch("two_machines");
  REQUIRE(launch_two_machines(dir / "full", dir / "full_project", kNone, 0, 3).empty());
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(launch_two_machines(dir / "restarted", dir / "project", kKillAtStep10, 1, 3).empty());
  // Machine 0's processes were stopped at once, not after a collective timeout.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));
  CHECK(text(dir / "project" / "attempts.txt") == "0 -\n1 checkpoint_1\n");
  CHECK(listing(dir / "project" / "checkpoints") == kAllFive);
  check_identical(dir / "full", dir / "restarted", 4);
}

TEST_CASE("load_latest_state picks the newest complete checkpoint and numbers on after every one",
          "[checkpoint][elastic][latest]") {
  const auto project = scratch("latest");
  const auto base = project / "checkpoints";
  accel::AcceleratorOptions o;
  o.project_dir = project.string();
  o.automatic_checkpoint_naming = true;

  // Saves after steps 3, 6 and 9: checkpoint_0 .. checkpoint_2. Remembers the
  // parameters and step of the last one.
  std::vector<torch::Tensor> at_9;
  {
    accel::Accelerator<> acc(o);
    auto model = small_mlp();
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto loader = small_loader(8);
    Counter c;
    auto [m, opt, dl] = acc.prepare(model, sgd, loader);
    acc.register_for_checkpointing(c);
    CHECK(!acc.load_latest_state().has_value());  // no checkpoints directory yet
    for (auto& batch : dl) {
      opt.zero_grad();
      acc.backward(torch::cross_entropy_loss(m(batch.data), batch.target));
      opt.step();
      if (++c.step % 3 == 0) acc.save_state();
    }
    for (auto& p : model->parameters()) at_9.push_back(p.detach().clone());
  }
  REQUIRE(listing(base) == std::set<std::string>{"checkpoint_0", "checkpoint_1", "checkpoint_2"});

  // A fresh run (other initial weights) resumes from `expect` and numbers on from `next`.
  const auto resume = [&](const std::string& expect, const std::string& next) {
    accel::Accelerator<> acc(o);
    auto model = small_mlp(99);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto loader = small_loader(8);
    Counter c;
    auto [m, opt, dl] = acc.prepare(model, sgd, loader);
    acc.register_for_checkpointing(c);
    const auto got = acc.load_latest_state();
    REQUIRE(got.has_value());
    CHECK(got->filename() == expect);
    CHECK(c.step == 9);
    const auto params = model->parameters();
    for (size_t i = 0; i < params.size(); ++i) CHECK(torch::equal(params[i], at_9[i]));
    acc.save_state();
    CHECK(fs::exists(base / next));
    fs::remove_all(base / next);
  };
  resume("checkpoint_2", "checkpoint_3");

  // What a save killed half-way leaves (checkpoint_3.accel-tmp), a directory
  // without accel_state.json, and one with a flipped bit: none is chosen, and
  // the numbering continues after the highest.
  fs::copy(base / "checkpoint_2", base / "checkpoint_3.accel-tmp", fs::copy_options::recursive);
  fs::remove(base / "checkpoint_3.accel-tmp" / "accel_state.json");
  fs::copy(base / "checkpoint_1", base / "checkpoint_4", fs::copy_options::recursive);
  fs::remove(base / "checkpoint_4" / "accel_state.json");
  fs::copy(base / "checkpoint_1", base / "checkpoint_5", fs::copy_options::recursive);
  {
    const auto f = base / "checkpoint_5" / "model.safetensors";
    std::string bytes = text(f);
    bytes[bytes.size() - 3] ^= 0x10;
    std::ofstream(f, std::ios::binary | std::ios::trunc) << bytes;
  }
  resume("checkpoint_2", "checkpoint_6");

  // Nothing complete at all: nothing loaded, nothing changed, numbering after the leftovers.
  fs::remove_all(base / "checkpoint_5");
  for (const char* n : {"checkpoint_0", "checkpoint_1", "checkpoint_2"}) fs::remove_all(base / n);
  {
    accel::Accelerator<> acc(o);
    auto model = small_mlp(99);
    const auto before = model->parameters()[0].clone();
    auto [m] = acc.prepare(model);
    CHECK(!acc.load_latest_state().has_value());
    CHECK(torch::equal(model->parameters()[0], before));
    acc.save_state();
    CHECK(fs::exists(base / "checkpoint_5"));
  }

  // Checkpoints that exist but none loads (here: another model): the newest's
  // error, on every process, rather than a silent fresh start.
  {
    accel::Accelerator<> acc(o);
    auto other = small_mlp();
    other->push_back(torch::nn::Linear(4, 2));
    auto [m] = acc.prepare(other);
    CHECK_THROWS_WITH(acc.load_latest_state(), ContainsSubstring("checkpoint_5") &&
                                                   ContainsSubstring("model"));
  }
  accel::Accelerator<> plain;
  CHECK_THROWS_WITH(plain.load_latest_state(), ContainsSubstring("load_latest_state() without a directory needs "
                                                                 "AcceleratorOptions::project_dir"));
}
