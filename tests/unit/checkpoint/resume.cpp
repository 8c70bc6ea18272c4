// Exact resume on 2 Gloo processes: an uninterrupted run equals a run that
// saved, ended, and was resumed by new processes; a process killed with
// SIGKILL during save_state leaves the previous checkpoint loadable.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/random.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "catch.hpp"
#include "paths.hpp"
#include "whole_parameters.hpp"
#include "xxhsum.hpp"
#include <nlohmann/json.hpp>

#include "workload.hpp"

namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) { return accel_test::fresh_dir("resume", name); }

struct Counter {
  int64_t step = 0;
  torch::Tensor state_dict() const { return torch::tensor(step); }
  void load_state_dict(const torch::Tensor& t) { step = t.item<int64_t>(); }
};

enum Phase { kFull = 0, kInterrupt = 1, kResume = 2 };

/// The shuffled case: a small MLP with dropout (so every rank's generator
/// state matters), 72 rows, 4 per rank: 9 global batches per epoch, so 20
/// steps cross two epochs and step 10 is in the middle of epoch 1.
torch::nn::Sequential small_mlp() {
  torch::manual_seed(1);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(16, 32));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Dropout(0.2));
  seq->push_back(torch::nn::Linear(32, 4));
  return seq;
}

workload::Data small_data() {
  torch::manual_seed(0);
  return {torch::randn({72, 16}), torch::randint(0, 4, {72}, torch::kLong)};
}

/// phase kFull: 20 steps, parameters to out_<rank>.pt. kInterrupt: 10 steps,
/// save_state(ckpt), end (with `crash` set on rank crash_rank, that save is
/// killed at that point). kResume: load_state(ckpt), steps 11..20, parameters out.
template <class Precision, class Shard = accel::shard::Replicate>
void worker(std::string out, std::string ckpt, int phase, bool w_case, std::string crash,
            int crash_rank, double lr_scale) {
  accel::Accelerator<accel::backend::Gloo, Precision, Shard> acc;
  auto model = w_case ? workload::make_model() : small_mlp();
  auto sgd_opts = w_case ? workload::sgd_options() : torch::optim::SGDOptions(0.05).momentum(0.9);
  sgd_opts.lr(sgd_opts.lr() * lr_scale);
  torch::optim::SGD sgd(model->parameters(), sgd_opts);
  torch::optim::StepLR steplr(sgd, 3, 0.7);
  auto loader =
      w_case ? accel::data::make_data_loader(workload::Dataset(workload::make_data()),
                                             accel::data::LoaderOptions{.batch_size = 32, .shuffle = false})
             : accel::data::make_data_loader(
                   workload::Dataset(small_data()),
                   accel::data::LoaderOptions{.batch_size = 4, .shuffle = true, .seed = 7});
  accel::set_seed(42, /*device_specific=*/true);  // dropout differs per rank
  Counter counter;
  auto [m, opt, dl, sched] = acc.prepare(model, sgd, loader, steplr);
  acc.register_for_checkpointing(counter);
  if (phase == kResume) acc.load_state(ckpt);
  while (counter.step < 20) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      acc.backward(loss);
      opt.step();
      sched.step();
      ++counter.step;
      if (phase == kInterrupt && counter.step == 10) {
        if (!crash.empty() && acc.process_index() == crash_rank)
          ::setenv("ACCEL_TEST_SAVE_STATE_CRASH", crash.c_str(), 1);
        acc.save_state(ckpt);
        return;
      }
      if (counter.step == 20) break;
    }
  }
  const auto params = accel_test::whole_parameters(acc, m, out + "_model");
  torch::save(params, out + "_" + std::to_string(acc.process_index()) + ".pt");
}

accel::LaunchOptions two_processes() {
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(600);
  return lo;
}

template <class P, class S = accel::shard::Replicate>
void launch(const fs::path& out, const fs::path& ckpt, Phase phase, bool w_case,
            std::string crash = "", int crash_rank = 0, double lr_scale = 1.0) {
  accel::notebook_launcher(worker<P, S>, std::make_tuple(out.string(), ckpt.string(), static_cast<int>(phase),
                                                      w_case, crash, crash_rank, lr_scale),
                           two_processes());
}

std::vector<torch::Tensor> load_params(const fs::path& out, int rank) {
  std::vector<torch::Tensor> v;
  torch::load(v, out.string() + "_" + std::to_string(rank) + ".pt");
  return v;
}

void check_identical(const fs::path& full, const fs::path& resumed) {
  for (int r = 0; r < 2; ++r) {
    auto a = load_params(full, r);
    auto b = load_params(resumed, r);
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("rank " << r << " parameter " << i << " max |diff| = " << (a[i] - b[i]).abs().max().item<double>());
      CHECK(torch::equal(a[i], b[i]));
    }
  }
  // The replicas agree, too.
  auto a0 = load_params(resumed, 0), a1 = load_params(resumed, 1);
  for (size_t i = 0; i < a0.size(); ++i) CHECK(torch::equal(a0[i], a1[i]));
}

std::string bytes(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <class P>
void exact_resume_of_w(const std::string& name) {
  const auto dir = scratch(name);
  launch<P>(dir / "full", dir / "unused", kFull, true);
  launch<P>(dir / "unused", dir / "ckpt", kInterrupt, true);
  launch<P>(dir / "resumed", dir / "ckpt", kResume, true);
  check_identical(dir / "full", dir / "resumed");
}

}  // namespace

TEST_CASE("W on 2 Gloo processes: 10 steps, save, new processes, load, 10 steps == 20 steps (Fp32)",
          "[checkpoint][resume][gloo]") {
  exact_resume_of_w<accel::precision::Fp32>("w_fp32");
}

TEST_CASE("W on 2 Gloo processes: 10 steps, save, new processes, load, 10 steps == 20 steps (Bf16)",
          "[checkpoint][resume][gloo][bf16]") {
  exact_resume_of_w<accel::precision::Bf16>("w_bf16");
}

TEST_CASE("shuffled resume across epochs with a mid-epoch checkpoint, and SIGKILL during save_state",
          "[checkpoint][resume][gloo][sigkill]") {
  using P = accel::precision::Fp32;
  const auto dir = scratch("shuffle");
  const auto good = dir / "good";
  launch<P>(dir / "full", dir / "unused", kFull, false);
  launch<P>(dir / "unused", good, kInterrupt, false);
  launch<P>(dir / "resumed", good, kResume, false);
  check_identical(dir / "full", dir / "resumed");

  struct Crash {
    const char* point;
    int rank;
  };
  for (const Crash c : {Crash{"writing", 1}, Crash{"writing", 0}, Crash{"before_commit", 0},
                        Crash{"between_renames", 0}}) {
    DYNAMIC_SECTION("killed at " << c.point << " on rank " << c.rank) {
      const auto ckpt = dir / (std::string("ckpt_") + c.point + std::to_string(c.rank));
      fs::copy(good, ckpt, fs::copy_options::recursive);
      // Another run (other learning rate) saves over it and is killed.
      CHECK_THROWS_AS(launch<P>(dir / "unused", ckpt, kInterrupt, false, c.point, c.rank, 0.5),
                      accel::LaunchError);
      const bool moved_aside = std::string(c.point) == "between_renames";
      CHECK(fs::exists(ckpt) == !moved_aside);
      const auto readable = moved_aside ? fs::path(ckpt.string() + ".accel-old") : ckpt;
      CHECK(bytes(readable / "model.safetensors") == bytes(good / "model.safetensors"));
      CHECK(bytes(readable / "optimizer.pt") == bytes(good / "optimizer.pt"));
      // The previous checkpoint loads, and resumes exactly.
      const auto out = dir / (std::string("after_") + c.point + std::to_string(c.rank));
      launch<P>(out, ckpt, kResume, false);
      check_identical(dir / "full", out);
    }
  }
}

TEST_CASE("ZeRO-3 (ShardParameters): save_state gathers the model, load_state re-shards it; shuffled resume is bit-identical",
          "[checkpoint][resume][gloo][zero]") {
  using P = accel::precision::Fp32;
  using S = accel::shard::ShardParameters;
  const auto dir = scratch("zero3");
  launch<P, S>(dir / "full", dir / "unused", kFull, false);
  launch<P, S>(dir / "unused", dir / "ckpt", kInterrupt, false);
  CHECK(fs::exists(dir / "ckpt" / "model.safetensors"));  // the whole model, as Replicate writes it
  CHECK(fs::exists(dir / "ckpt" / "optimizer_rank1.pt"));
  launch<P, S>(dir / "resumed", dir / "ckpt", kResume, false);
  check_identical(dir / "full", dir / "resumed");
}

TEST_CASE("ZeRO-1 (ShardOptimizer): per-process optimizer files, shuffled resume is bit-identical",
          "[checkpoint][resume][gloo][zero]") {
  using P = accel::precision::Fp32;
  using S = accel::shard::ShardOptimizer;
  const auto dir = scratch("zero1");
  launch<P, S>(dir / "full", dir / "unused", kFull, false);
  launch<P, S>(dir / "unused", dir / "ckpt", kInterrupt, false);
  CHECK(fs::exists(dir / "ckpt" / "optimizer_rank0.pt"));
  CHECK(fs::exists(dir / "ckpt" / "optimizer_rank1.pt"));
  CHECK(!fs::exists(dir / "ckpt" / "optimizer.pt"));
  launch<P, S>(dir / "resumed", dir / "ckpt", kResume, false);
  check_identical(dir / "full", dir / "resumed");

  // Rank 0 records rank 1's checksums too (gathered at save time).
  const auto sums = nlohmann::json::parse(std::ifstream(dir / "ckpt" / "accel_state.json")).at("xxh64");
  for (const char* file : {"optimizer_rank0.pt", "optimizer_rank1.pt", "random_states_1.pt", "loaders_1.json"}) {
    INFO(file);
    CHECK(sums.at(file).get<std::string>() == accel_test::xxhsum(dir / "ckpt" / file));
  }
  // One flipped bit in rank 1's own file: the launcher reports rank 1's own
  // error, and rank 0 as failing because of it (Accelerate prints neither).
  {
    const auto file = dir / "ckpt" / "optimizer_rank1.pt";
    const std::string good = bytes(file);
    std::string bad = good;
    bad[bad.size() / 2] ^= 0x01;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bad;
    CHECK_THROWS_WITH((launch<P, S>(dir / "unused", dir / "ckpt", kResume, false)),
                      Catch::Matchers::StartsWith("accel: process 1 failed: accel: the checkpoint file '") &&
                          Catch::Matchers::ContainsSubstring("optimizer_rank1.pt' is corrupt") &&
                          Catch::Matchers::ContainsSubstring("; process 0 failed because of it"));
    std::ofstream(file, std::ios::binary | std::ios::trunc) << good;
  }

  // Saved with other buckets: each rank's file holds other chunks. An
  // explicit error before anything is loaded, not a shape mismatch later.
  auto meta = nlohmann::json::parse(std::ifstream(dir / "ckpt" / "accel_state.json"));
  CHECK(meta["partition_bucket_cap_mb"] == 25.0);
  meta["partition_bucket_cap_mb"] = 1.0;
  std::ofstream(dir / "ckpt" / "accel_state.json") << meta.dump();
  CHECK_THROWS_WITH((launch<P, S>(dir / "unused", dir / "ckpt", kResume, false)),
                    Catch::Matchers::ContainsSubstring("partitioned by buckets of 1 MB") &&
                        Catch::Matchers::ContainsSubstring("Resume with AcceleratorOptions::bucket_cap_mb = 1."));
}
