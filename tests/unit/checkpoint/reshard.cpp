// load_state on another number of processes (issue 16 item 3): a checkpoint
// written by 2 Gloo processes under ZeRO-1/2/3 (optimizer state in
// per-process chunks) or Replicate resumes on 1, 3 and 4 processes with the
// same global batch, and the run ends where an uninterrupted one does.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <filesystem>
#include <fstream>

#include "catch.hpp"
#include "paths.hpp"
#include "whole_parameters.hpp"
#include <nlohmann/json.hpp>

#include "workload.hpp"

namespace fs = std::filesystem;

namespace {

enum Phase { kFull = 0, kInterrupt = 1, kResume = 2 };

constexpr int kGlobalBatch = 12;  // divides among 1, 2, 3 and 4 processes
constexpr int kSteps = 12;        // 6 per epoch of 72 rows: the resumed run crosses an epoch
constexpr int kSaveAt = 5;

/// Two parameter groups (weights, biases) and tiny buckets, so that the
/// partitions cut parameters, end in padding, and differ per group:
/// buckets of 4, 128, 32 and 512 elements.
template <class Shard>
void worker(std::string out, std::string ckpt, int phase, int batch) {
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.bucket_cap_mb = 0.0005});
  torch::manual_seed(1);
  torch::nn::Sequential model(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  std::vector<torch::Tensor> weights, biases;
  for (auto& item : model->named_parameters())
    (item.key().find("bias") != std::string::npos ? biases : weights).push_back(item.value());
  torch::optim::Adam adam({torch::optim::OptimizerParamGroup(weights, std::make_unique<torch::optim::AdamOptions>(0.01)),
                           torch::optim::OptimizerParamGroup(biases, std::make_unique<torch::optim::AdamOptions>(0.02))},
                          torch::optim::AdamOptions(0.01));
  torch::manual_seed(0);
  workload::Data data{torch::randn({72, 16}), torch::randint(0, 4, {72}, torch::kLong)};
  auto loader = accel::data::make_data_loader(
      workload::Dataset(data), accel::data::LoaderOptions{.batch_size = batch, .shuffle = true, .seed = 7});
  auto [m, opt, dl] = acc.prepare(model, adam, loader);
  int64_t step = 0;
  if (phase == kResume) {
    acc.load_state(ckpt);
    step = kSaveAt;
  }
  while (step < kSteps) {
    for (auto& b : dl) {
      opt.zero_grad();
      acc.backward(torch::cross_entropy_loss(m(b.data), b.target));
      opt.step();
      ++step;
      if (phase == kInterrupt && step == kSaveAt) {
        acc.save_state(ckpt);
        return;
      }
      if (step == kSteps) break;
    }
  }
  const auto params = accel_test::whole_parameters(acc, m, out + "_model");
  torch::save(params, out + "_" + std::to_string(acc.process_index()) + ".pt");
}

template <class Shard>
void launch(int processes, const fs::path& out, const fs::path& ckpt, Phase phase, int batch = 0) {
  accel::LaunchOptions lo;
  lo.num_processes = processes;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(300);
  // One process is forked too (a hang watch forces that): otherwise it runs
  // backward() in this process, and LibTorch 2.x then refuses autograd in
  // the workers of the next launch.
  if (processes == 1) lo.monitor_interval = std::chrono::seconds(120);
  accel::notebook_launcher(worker<Shard>,
                           std::make_tuple(out.string(), ckpt.string(), static_cast<int>(phase),
                                           batch ? batch : kGlobalBatch / processes),
                           lo);
}

std::vector<torch::Tensor> load_params(const fs::path& out, int rank) {
  std::vector<torch::Tensor> v;
  torch::load(v, out.string() + "_" + std::to_string(rank) + ".pt");
  return v;
}

/// Every rank of the resumed run against rank 0 of the uninterrupted one.
/// 1e-6: the runs differ only in how the global batch's gradient is summed.
void check_close(const fs::path& full, const fs::path& resumed, int processes) {
  const auto want = load_params(full, 0);
  for (int r = 0; r < processes; ++r) {
    const auto got = load_params(resumed, r);
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double diff = (got[i] - want[i]).abs().max().item<double>();
      INFO("rank " << r << " of " << processes << ", parameter " << i << ": max |diff| = " << diff);
      CHECK(diff <= 1e-6);
    }
  }
}

/// Returns the directory holding the checkpoint ("ckpt").
template <class Shard>
fs::path resume_on_other_worlds(const std::string& name, std::initializer_list<int> worlds) {
  const auto dir = accel_test::fresh_dir("reshard", name);
  launch<Shard>(2, dir / "full", dir / "unused", kFull);
  launch<Shard>(2, dir / "unused", dir / "ckpt", kInterrupt);
  for (int n : worlds) {  // one checkpoint for all: no SECTIONs, which would run the saves again
    INFO(name << ": saved by 2 processes, resumed by " << n);
    const auto out = dir / ("resumed" + std::to_string(n));
    launch<Shard>(n, out, dir / "ckpt", kResume);
    check_close(dir / "full", out, n);
  }
  return dir;
}

}  // namespace

TEST_CASE("ZeRO-1: a checkpoint of 2 processes resumes on 1, 3 and 4", "[checkpoint][reshard][gloo][zero]") {
  resume_on_other_worlds<accel::shard::ShardOptimizer>("zero1", {1, 3, 4});
}

TEST_CASE("ZeRO-2: a checkpoint of 2 processes resumes on 1, 3 and 4; one of 1 process on 3",
          "[checkpoint][reshard][gloo][zero]") {
  using S = accel::shard::ShardGradients;
  resume_on_other_worlds<S>("zero2", {1, 3, 4});
  // Saved unpartitioned (one process), cut into chunks on 3.
  const auto dir = accel_test::fresh_dir("reshard", "zero2_from_one");
  launch<S>(2, dir / "full", dir / "unused", kFull);
  launch<S>(1, dir / "unused", dir / "ckpt", kInterrupt);
  CHECK(fs::exists(dir / "ckpt" / "optimizer.pt"));
  launch<S>(3, dir / "resumed", dir / "ckpt", kResume);
  check_close(dir / "full", dir / "resumed", 3);
}

TEST_CASE("ZeRO-3: a checkpoint of 2 processes resumes on 1, 2, 3 and 4", "[checkpoint][reshard][gloo][zero]") {
  resume_on_other_worlds<accel::shard::ShardParameters>("zero3", {1, 2, 3, 4});
}

TEST_CASE("Replicate: a checkpoint of 2 processes resumes on 3; positions that are no whole step are refused",
          "[checkpoint][reshard][gloo]") {
  using S = accel::shard::Replicate;
  const auto dir = resume_on_other_worlds<S>("replicate", {3});
  // 5 steps of 12 samples are 60; 3 processes of 7 take 21 per step.
  CHECK_THROWS_WITH((launch<S>(3, dir / "unused", dir / "ckpt", kResume, 7)),
                    Catch::Matchers::ContainsSubstring("was saved by 2 processes after 5 steps of 12 samples of data loader 0") &&
                        Catch::Matchers::ContainsSubstring("this run takes 21 samples per step (3 processes), and 60 samples are not a whole number"));
}
