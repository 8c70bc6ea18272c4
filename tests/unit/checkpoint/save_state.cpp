// Accelerator::save_state / load_state on one process: everything comes
// back bit-exactly, automatic naming and rotation, registered objects, and
// bad checkpoints that change nothing.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/sched/one_cycle_lr.hpp>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "catch.hpp"
#include "paths.hpp"
#include "xxhsum.hpp"

#include "optim_state.hpp"
#include "workload.hpp"

namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;

namespace {

fs::path scratch(const std::string& name) { return accel_test::fresh_dir("save_state", name); }

/// A step counter the user registers (state_dict concept).
struct Counter {
  int64_t step = 0;
  torch::Tensor state_dict() const { return torch::tensor(step); }
  void load_state_dict(const torch::Tensor& t) { step = t.item<int64_t>(); }
};

torch::nn::Sequential small_mlp(uint64_t seed, int64_t hidden = 32) {
  torch::manual_seed(seed);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(16, hidden));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Dropout(0.25));
  seq->push_back(torch::nn::Linear(hidden, 4));
  return seq;
}

/// 72 rows: 9 batches of 8 per epoch.
auto small_loader(bool shuffle = true) {
  torch::manual_seed(0);
  workload::Data d{torch::randn({72, 16}), torch::randint(0, 4, {72}, torch::kLong)};
  return accel::data::make_data_loader(
      workload::Dataset(d), accel::data::LoaderOptions{.batch_size = 8, .shuffle = shuffle, .seed = 7});
}

std::vector<torch::Tensor> params_of(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.detach().clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

std::vector<torch::Tensor> momenta(torch::optim::SGD& opt) {
  std::vector<torch::Tensor> out;
  for (auto& p : opt.param_groups()[0].params()) {
    auto it = opt.state().find(accel_test::optim_state_key(p));
    out.push_back(it == opt.state().end()
                      ? torch::Tensor()
                      : static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer().clone());
  }
  return out;
}

/// Trains until counter.step == until; saves to save_dir after step save_at.
template <class A, class M, class O, class L, class S>
void train(A& acc, M& m, O& opt, L& dl, S& sched, Counter& c, int64_t until, int64_t save_at = -1,
           const fs::path& save_dir = {}) {
  while (c.step < until) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      acc.backward(loss);
      opt.step();
      sched.step();
      ++c.step;
      if (c.step == save_at) acc.save_state(save_dir);
      if (c.step >= until) break;
    }
  }
}

std::set<std::string> listing(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

}  // namespace

TEST_CASE("save_state/load_state resume a single process bit-exactly", "[checkpoint][save_state]") {
  const auto dir = scratch("roundtrip") / "ckpt";
  std::vector<torch::Tensor> reference;
  double reference_lr = 0;
  {
    accel::Accelerator<> acc;
    auto model = small_mlp(1);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::StepLR steplr(sgd, 4, 0.5);
    Counter counter;
    auto [m, opt, dl, sched] = acc.prepare(model, sgd, small_loader(), steplr);
    acc.register_for_checkpointing(counter);
    // Step 12 is batch 3 of epoch 1: a checkpoint in mid-epoch; the run goes on.
    train(acc, m, opt, dl, sched, counter, 20, 12, dir);
    reference = params_of(*model);
    reference_lr = sgd.param_groups()[0].options().get_lr();
  }
  CHECK(listing(dir) == std::set<std::string>{"accel_state.json", "model.safetensors", "optimizer.pt",
                                              "scheduler.pt", "custom_checkpoint_0.pt",
                                              "random_states_0.pt", "loaders_0.json"});
  CHECK(!fs::exists(dir.string() + ".accel-tmp"));

  // A new run: other initial weights, other generator state, then load.
  accel::Accelerator<> acc;
  auto model = small_mlp(99);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::StepLR steplr(sgd, 4, 0.5);
  Counter counter;
  auto [m, opt, dl, sched] = acc.prepare(model, sgd, small_loader(), steplr);
  acc.register_for_checkpointing(counter);
  torch::manual_seed(12345);
  acc.load_state(dir);
  CHECK(counter.step == 12);
  CHECK(dl.checkpoint().epoch == 1);
  CHECK(dl.checkpoint().batches_yielded == 3);
  train(acc, m, opt, dl, sched, counter, 20);
  CHECK(all_equal(params_of(*model), reference));
  CHECK(sgd.param_groups()[0].options().get_lr() == reference_lr);
}

// Checkpoints cross LibTorch versions: tests/unit/checkpoint/data holds one
// written by LibTorch 1.13 (Debian 12) and one by 2.6 (Debian 13), by this
// same training run (Adam, StepLR, dropout, a shuffled loader, a counter;
// saved at step 12). Each suite loads both, finishes the run and must land on
// the weights of its own uninterrupted run (to rounding). Regenerate a version's copy with
// ACCEL_WRITE_CHECKPOINT_FIXTURES=<tests/unit/checkpoint/data> unit_checkpoint "[versions]".
TEST_CASE("checkpoints written by LibTorch 1.13 and 2.6 load in either", "[checkpoint][save_state][versions]") {
  auto run = [](accel::Accelerator<>& acc, uint64_t seed, int64_t until, int64_t save_at,
                const fs::path& save_dir, const fs::path& load_dir) {
    auto model = small_mlp(seed);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    torch::optim::StepLR steplr(adam, 5, 0.5);
    Counter counter;
    auto [m, opt, dl, sched] = acc.prepare(model, adam, small_loader(), steplr);
    acc.register_for_checkpointing(counter);
    if (!load_dir.empty()) {
      acc.load_state(load_dir);
      REQUIRE(counter.step == 12);
    }
    train(acc, m, opt, dl, sched, counter, until, save_at, save_dir);
    return params_of(*model);
  };
  const auto scratch_dir = scratch("versions");
  std::vector<torch::Tensor> reference;
  {
    accel::Accelerator<> acc;
    reference = run(acc, 1, 20, 12, scratch_dir / "ckpt", {});
  }
  const std::string mine = "libtorch_" + std::to_string(TORCH_VERSION_MAJOR) + "." +
                           std::to_string(TORCH_VERSION_MINOR);
  if (const char* out = std::getenv("ACCEL_WRITE_CHECKPOINT_FIXTURES")) {
    const auto dst = fs::path(out) / ("state_" + mine);
    fs::remove_all(dst);
    fs::copy(scratch_dir / "ckpt", dst, fs::copy_options::recursive);
  }
  const fs::path data = accel_test::source_dir() / "unit" / "checkpoint" / "data";
  for (const char* version : {"libtorch_1.13", "libtorch_2.6"}) {
    INFO("checkpoint written by " << version << ", loaded by " << mine);
    const auto dir = data / (std::string("state_") + version);
    REQUIRE(fs::exists(dir / "accel_state.json"));
    accel::Accelerator<> acc;
    auto resumed = run(acc, 99, 20, -1, {}, dir);
    REQUIRE(resumed.size() == reference.size());
    // The fixtures were written on another machine: its CPU may have taken
    // other BLAS kernels (and another version other kernels still), which
    // round differently in the 8 steps after the load: 1e-6 relative.
    // Bit-exact resume on one machine is the first test of this file.
    for (size_t i = 0; i < resumed.size(); ++i)
      CHECK(torch::allclose(resumed[i], reference[i], 1e-6, 1e-7));
  }
}

namespace {

/// Parameter i's Adam exp_avg in an optimizer archive, found by the key the
/// archive itself lists for parameter i: a reference that does not go through
/// Optimizer::load. Also returns whether the keys are 1.13's hex addresses.
std::vector<torch::Tensor> exp_avgs_by_archive_keys(const fs::path& file, bool& hex_keys) {
  torch::serialize::InputArchive in, groups, group0, state;
  in.load_from(file.string());
  in.read("param_groups", groups);
  groups.read("param_groups/0", group0);
  in.read("state", state);
  torch::Tensor size;
  group0.read("params/size", size);
  std::vector<torch::Tensor> out;
  hex_keys = true;
  for (int64_t i = 0; i < size.item<int64_t>(); ++i) {
    c10::IValue key;
    group0.read("params/" + std::to_string(i), key);
    hex_keys = hex_keys && accel::ckpt::detail::is_hex_address(key.toStringRef());
    torch::serialize::InputArchive param_state;
    state.read(key.toStringRef(), param_state);
    torch::Tensor t;
    param_state.read("exp_avg", t, /*is_buffer=*/true);
    out.push_back(t);
  }
  return out;
}

std::vector<torch::Tensor> exp_avgs(torch::optim::Adam& adam) {
  std::vector<torch::Tensor> out;
  for (auto& p : adam.param_groups()[0].params()) {
    auto it = adam.state().find(accel_test::optim_state_key(p));
    REQUIRE(it != adam.state().end());
    out.push_back(static_cast<torch::optim::AdamParamState&>(*it->second).exp_avg());
  }
  return out;
}

}  // namespace

// LibTorch 2.x reads 1.13's hex keys with std::stoull as 0 and puts every
// state on one parameter; accel rewrites them first (optimizer_keys.hpp).
TEST_CASE("LibTorch 1.13's optimizer archives put each state on its own parameter, on either version",
          "[checkpoint][save_state][versions]") {
  const fs::path file =
      accel_test::source_dir() / "unit" / "checkpoint" / "data" / "state_libtorch_1.13" / "optimizer.pt";
  bool hex = false;
  const auto expected = exp_avgs_by_archive_keys(file, hex);
  REQUIRE(hex);
  REQUIRE(expected.size() == 4);
  auto check = [&](torch::optim::Adam& adam) {
    const auto got = exp_avgs(adam);
    REQUIRE(got.size() == expected.size());
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("parameter " << i);
      CHECK(torch::equal(got[i], expected[i]));
    }
  };
  {  // accel's load path
    auto model = small_mlp(99);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    torch::serialize::InputArchive in;
    in.load_from(file.string());
    accel::ckpt::detail::load_optimizer(adam, in);
    check(adam);
  }
  {  // the rewritten archive, loaded by LibTorch alone: decimal keys, as 2.x writes them
    torch::serialize::InputArchive in;
    in.load_from(file.string());
    torch::serialize::OutputArchive rewritten;
    accel::ckpt::detail::copy_archive(in, rewritten, /*decimal_addresses=*/true);
    std::stringstream bytes;
    rewritten.save_to(bytes);
    torch::serialize::InputArchive converted;
    converted.load_from(bytes);
    REQUIRE_FALSE(accel::ckpt::detail::has_hex_state_keys(converted));
    auto model = small_mlp(99);
    torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
    adam.load(converted);
    check(adam);
  }
}

TEST_CASE("resume under gradient accumulation: the scheduler paces on real optimizer steps",
          "[checkpoint][save_state][accumulate]") {
  const auto dir = scratch("accumulate") / "ckpt";
  accel::AcceleratorOptions o;
  o.gradient_accumulation_steps = 2;
  auto run = [&](uint64_t init_seed, bool load, int64_t save_at, std::vector<double>* lrs) {
    accel::Accelerator<> acc(o);
    auto model = small_mlp(init_seed);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    torch::optim::StepLR steplr(sgd, 1, 0.5);  // halves on every real optimizer step
    Counter c;
    auto [m, opt, dl, sched] = acc.prepare(model, sgd, small_loader(), steplr);
    acc.register_for_checkpointing(c);
    if (load) acc.load_state(dir);
    while (c.step < 16) {
      for (auto& batch : dl) {
        auto guard = acc.accumulate(m);
        auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
        acc.backward(loss);
        opt.step();
        sched.step();
        opt.zero_grad();
        lrs->push_back(sgd.param_groups()[0].options().get_lr());
        if (++c.step == save_at) acc.save_state(dir);
        if (c.step >= 16) break;
      }
    }
    return params_of(*model);
  };
  std::vector<double> full_lrs, resumed_lrs;
  const auto full = run(1, false, 6, &full_lrs);  // 6 micro-steps: 3 optimizer steps
  const auto resumed = run(7, true, -1, &resumed_lrs);
  CHECK(all_equal(full, resumed));
  REQUIRE(full_lrs.size() == 16);
  CHECK(resumed_lrs == std::vector<double>(full_lrs.begin() + 6, full_lrs.end()));
}

TEST_CASE("after load_state, skip_first_batches continues the epoch and later epochs are whole",
          "[checkpoint][save_state][skip]") {
  const auto dir = scratch("skip") / "ckpt";
  auto reference = small_loader();
  std::vector<torch::Tensor> expected;
  for (int e = 0; e < 3; ++e)
    for (auto& b : reference) expected.push_back(b.target.clone());
  {
    accel::Accelerator<> acc;
    auto [dl] = acc.prepare(small_loader());
    int64_t n = 0;
    for (auto& b : dl) {  // epoch 0
      (void)b;
      ++n;
    }
    for (auto& b : dl) {  // epoch 1, interrupted after 4 batches
      (void)b;
      if (++n == 13) {
        acc.save_state(dir);
        break;
      }
    }
  }
  accel::Accelerator<> acc;
  auto [dl] = acc.prepare(small_loader());
  acc.load_state(dir);
  auto skipped = acc.skip_first_batches(dl, 4);  // Accelerate's idiom: same count
  std::vector<torch::Tensor> got;
  for (auto& b : skipped) got.push_back(b.target.clone());
  for (auto& b : dl) got.push_back(b.target.clone());  // the original: epoch 2, whole
  REQUIRE(got.size() == 5 + 9);
  for (size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], expected[13 + i]));
}

TEST_CASE("automatic checkpoint naming keeps total_limit and continues the numbering after load",
          "[checkpoint][save_state][naming]") {
  const auto project = scratch("naming");
  accel::AcceleratorOptions o;
  o.project_dir = project.string();
  o.automatic_checkpoint_naming = true;
  o.total_limit = 2;
  const auto base = project / "checkpoints";
  {
    accel::Accelerator<> acc(o);
    auto model = small_mlp(1);
    auto [m] = acc.prepare(model);
    for (int i = 0; i < 3; ++i) acc.save_state();
    CHECK(listing(base) == std::set<std::string>{"checkpoint_1", "checkpoint_2"});
  }
  {
    // A new run that does not load first would number from 0 again (and its
    // checkpoint would be the one rotated away): refused, nothing written.
    accel::Accelerator<> acc(o);
    auto model = small_mlp(1);
    auto [m] = acc.prepare(model);
    CHECK_THROWS_WITH(acc.save_state(), ContainsSubstring("already holds checkpoint_2") &&
                                            ContainsSubstring("Call load_state() first"));
    CHECK(listing(base) == std::set<std::string>{"checkpoint_1", "checkpoint_2"});
  }
  accel::Accelerator<> acc(o);
  auto model = small_mlp(5);
  auto [m] = acc.prepare(model);
  acc.load_state();  // the newest: checkpoint_2
  acc.save_state();
  CHECK(listing(base) == std::set<std::string>{"checkpoint_2", "checkpoint_3"});
  // Accelerate would silently write checkpoint_4 instead of this directory.
  CHECK_THROWS_WITH(acc.save_state(project / "mine"),
                    ContainsSubstring("automatic_checkpoint_naming is on") && ContainsSubstring("mine"));
  CHECK(!fs::exists(project / "mine"));

  accel::Accelerator<> plain;
  CHECK_THROWS_WITH(plain.save_state(), ContainsSubstring("needs AcceleratorOptions::project_dir"));
}

TEST_CASE("register_for_checkpointing: modules, optimizers, schedulers, state_dict objects",
          "[checkpoint][save_state][register]") {
  const auto dir = scratch("register") / "ckpt";
  struct Bag {
    std::vector<torch::Tensor> v;
    std::vector<torch::Tensor> state_dict() const { return v; }
    void load_state_dict(std::vector<torch::Tensor> x) { v = std::move(x); }
  };
  auto make = [](uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Linear(3, 2);
  };
  torch::Tensor adam_avg, lin_w, shared_w;
  double one_cycle_lr = 0;
  {
    accel::Accelerator<> acc;
    auto lin = make(1);
    auto shared = std::make_shared<torch::nn::LinearImpl>(2, 2);
    torch::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(0.1));
    accel::sched::OneCycleLR cycle(adam, 0.1, 10);
    Bag bag{{torch::arange(3), torch::ones({2, 2})}};
    for (int i = 0; i < 3; ++i) {
      adam.zero_grad();
      lin(torch::ones({1, 3})).sum().backward();
      adam.step();
      cycle.step();
    }
    acc.register_for_checkpointing(lin);
    acc.register_for_checkpointing(shared);
    acc.register_for_checkpointing(adam);
    acc.register_for_checkpointing(cycle);
    acc.register_for_checkpointing(bag);
    acc.save_state(dir);
    lin_w = lin->weight.detach().clone();
    shared_w = shared->weight.detach().clone();
    adam_avg = static_cast<torch::optim::AdamParamState&>(
                   *adam.state().at(accel_test::optim_state_key(lin->weight)))
                   .exp_avg()
                   .clone();
    one_cycle_lr = cycle.get_last_lr()[0];
  }
  accel::Accelerator<> acc;
  auto lin = make(2);
  auto shared = std::make_shared<torch::nn::LinearImpl>(2, 2);
  torch::optim::Adam adam(lin->parameters(), torch::optim::AdamOptions(0.1));
  accel::sched::OneCycleLR cycle(adam, 0.1, 10);
  Bag bag;
  acc.register_for_checkpointing(lin);
  acc.register_for_checkpointing(shared);
  acc.register_for_checkpointing(adam);
  acc.register_for_checkpointing(cycle);
  acc.register_for_checkpointing(bag);
  acc.load_state(dir);
  CHECK(torch::equal(lin->weight, lin_w));
  CHECK(torch::equal(shared->weight, shared_w));
  CHECK(torch::equal(static_cast<torch::optim::AdamParamState&>(
                         *adam.state().at(accel_test::optim_state_key(lin->weight)))
                         .exp_avg(),
                     adam_avg));
  CHECK(cycle.step_count() == 3);
  CHECK(adam.param_groups()[0].options().get_lr() == one_cycle_lr);
  REQUIRE(bag.v.size() == 2);
  CHECK(torch::equal(bag.v[1], torch::ones({2, 2})));
}

TEST_CASE("save_state/load_state pre-hooks: a hook adds its own file and saves one model itself",
          "[checkpoint][save_state][hooks]") {
  const auto root = scratch("hooks");
  const auto dir = root / "ckpt";
  accel::Accelerator<> acc;
  torch::manual_seed(3);
  torch::nn::Linear base(4, 3), adapter(3, 2);
  auto [m_base, m_adapter] = acc.prepare(base, adapter);
  const auto base_w = base->weight.detach().clone();
  const auto adapter_w = adapter->weight.detach().clone();

  // Save: the hook sees both models and the directory being assembled, writes
  // a file of its own there and saves the adapter itself (as PEFT users do).
  fs::path save_dir_seen;
  auto save_hook = acc.register_save_state_pre_hook([&](accel::ckpt::ModelList& models, const fs::path& d) {
    REQUIRE(models.size() == 2);
    save_dir_seen = d;
    std::ofstream(d / "extra.txt") << "written by the hook";
    torch::save(adapter->weight.detach().clone(), (d / "adapter.pt").string());
    models.erase(models.begin() + 1);
  });
  acc.save_state(dir);
  CHECK(save_dir_seen == fs::path(dir.string() + ".accel-tmp"));  // committed with the rest
  CHECK(fs::is_regular_file(dir / "extra.txt"));
  CHECK(fs::is_regular_file(dir / "adapter.pt"));
  CHECK(fs::is_regular_file(dir / "model.safetensors"));
  CHECK_FALSE(fs::exists(dir / "model_1.safetensors"));

  torch::NoGradGuard no_grad;
  base->weight.zero_();
  adapter->weight.zero_();
  // Without a load hook the skipped model is named, and nothing changes.
  CHECK_THROWS_WITH(acc.load_state(dir), ContainsSubstring("holds no file for model 1") &&
                                             ContainsSubstring("load_state pre-hook"));
  CHECK(base->weight.abs().sum().item<double>() == 0);

  fs::path load_dir_seen;
  auto load_hook = acc.register_load_state_pre_hook([&](accel::ckpt::ModelList& models, const fs::path& d) {
    load_dir_seen = d;
    torch::Tensor w;
    torch::load(w, (d / "adapter.pt").string());
    adapter->weight.copy_(w);
    models.pop_back();
  });
  acc.load_state(dir);
  CHECK(load_dir_seen == dir);
  CHECK(torch::equal(base->weight, base_w));
  CHECK(torch::equal(adapter->weight, adapter_w));

  // Removed hooks no longer run: accel saves and loads both models again.
  save_hook.remove();
  load_hook.remove();
  save_hook.remove();  // harmless twice
  const auto dir2 = root / "ckpt2";
  acc.save_state(dir2);
  CHECK(fs::is_regular_file(dir2 / "model_1.safetensors"));
  CHECK_FALSE(fs::exists(dir2 / "extra.txt"));
  adapter->weight.zero_();
  acc.load_state(dir2);
  CHECK(torch::equal(adapter->weight, adapter_w));

  // A hook that fails makes save_state fail cleanly: no directory is left.
  auto failing = acc.register_save_state_pre_hook(
      [](accel::ckpt::ModelList&, const fs::path&) { throw std::runtime_error("hook: disk quota"); });
  CHECK_THROWS_WITH(acc.save_state(root / "ckpt3"), ContainsSubstring("hook: disk quota"));
  CHECK_FALSE(fs::exists(root / "ckpt3"));
  CHECK_FALSE(fs::exists(root / "ckpt3.accel-tmp"));
  failing.remove();
  // A hook may only take models out.
  auto stranger = acc.register_save_state_pre_hook([](accel::ckpt::ModelList& models, const fs::path&) {
    models.push_back(std::make_shared<torch::nn::LinearImpl>(1, 1));
  });
  CHECK_THROWS_WITH(acc.save_state(root / "ckpt4"),
                    ContainsSubstring("not a prepared model of this Accelerator"));
}

TEST_CASE("the loss scaler's scale and growth tracker are saved", "[checkpoint][save_state][scaler]") {
  // precision::Fp16 needs CUDA; the registry is driven directly on CPU.
  const auto dir = scratch("scaler") / "ckpt";
  auto make_registry = [] {
    accel::ckpt::StateRegistry reg;
    reg.state = std::make_shared<accel::detail::TrainingState>();
    reg.state->comm = accel::backend::SingleDevice::make_communicator(accel::runtime::ProcessEnv{},
                                                                      accel::AcceleratorOptions{});
    reg.scaler = std::make_shared<accel::precision::LossScaler>();
    return reg;
  };
  auto saved = make_registry();
  saved.scaler->load(1024.0, 7);
  saved.state->micro_step = 5;
  accel::ckpt::save_state(saved, {}, dir);
  auto loaded = make_registry();
  accel::ckpt::load_state(loaded, {}, dir);
  CHECK(loaded.scaler->scale() == 1024.0);
  CHECK(loaded.scaler->growth_tracker() == 7);
  CHECK(loaded.state->micro_step == 5);
  // A run without a scaler cannot take that checkpoint.
  auto plain = make_registry();
  plain.scaler.reset();
  CHECK_THROWS_WITH(accel::ckpt::load_state(plain, {}, dir),
                    ContainsSubstring("was saved with a loss scaler"));
}

TEST_CASE("bad checkpoints are clear errors and change nothing", "[checkpoint][save_state][errors]") {
  const auto root = scratch("bad");
  const auto good = root / "good";
  {
    accel::Accelerator<> acc;
    auto model = small_mlp(1);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    Counter counter;
    auto [m, opt, dl] = acc.prepare(model, sgd, small_loader());
    acc.register_for_checkpointing(counter);
    auto sched = std::make_shared<torch::optim::StepLR>(sgd, 100);
    train(acc, m, opt, dl, *sched, counter, 5);
    acc.save_state(good);
  }
  // The running state: trained a little differently, mid-epoch.
  accel::Accelerator<> acc;
  auto model = small_mlp(3);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  Counter counter;
  auto [m, opt, dl] = acc.prepare(model, sgd, small_loader());
  acc.register_for_checkpointing(counter);
  auto sched = std::make_shared<torch::optim::StepLR>(sgd, 100);
  train(acc, m, opt, dl, *sched, counter, 2);
  const auto params = params_of(*model);
  const auto mom = momenta(sgd);
  const auto pos = dl.checkpoint();
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  auto& loader = dl;  // clang 14 cannot capture structured bindings
  auto untouched = [&] {
    CHECK(all_equal(params_of(*model), params));
    CHECK(all_equal(momenta(sgd), mom));
    CHECK(loader.checkpoint().epoch == pos.epoch);
    CHECK(loader.checkpoint().batches_yielded == pos.batches_yielded);
    CHECK(counter.step == 2);
    CHECK(torch::equal(at::detail::getDefaultCPUGenerator().get_state(), rng));
  };
  auto copy_good = [&](const std::string& name) {
    const auto d = root / name;
    fs::remove_all(d);
    fs::copy(good, d, fs::copy_options::recursive);
    return d;
  };

  SECTION("missing directory") {
    CHECK_THROWS_WITH(acc.load_state(root / "nowhere"),
                      ContainsSubstring("nowhere' does not exist") && ContainsSubstring("save_state()"));
    CHECK_THROWS_WITH(acc.load_state(good / "accel_state.json"),
                      ContainsSubstring("accel_state.json' is a file, not a directory"));
    untouched();
  }
  SECTION("missing files are named") {
    const auto d = copy_good("missing");
    fs::remove(d / "optimizer.pt");
    fs::remove(d / "loaders_0.json");
    CHECK_THROWS_WITH(acc.load_state(d), ContainsSubstring("lacks [optimizer.pt, loaders_0.json]"));
    fs::remove(d / "accel_state.json");
    CHECK_THROWS_WITH(acc.load_state(d), ContainsSubstring("accel_state.json' is missing"));
    untouched();
  }
  SECTION("a model whose keys or shapes differ lists the keys") {
    accel::Accelerator<> other;
    auto wide = small_mlp(3, 48);
    torch::optim::SGD wide_sgd(wide->parameters(), torch::optim::SGDOptions(0.05));
    Counter c2;
    auto [wm, wopt, wdl] = other.prepare(wide, wide_sgd, small_loader());
    other.register_for_checkpointing(c2);
    auto wide_sched = std::make_shared<torch::optim::StepLR>(wide_sgd, 100);
    (void)wide_sched;
    const auto before = params_of(*wide);
    CHECK_THROWS_WITH(other.load_state(good),
                      ContainsSubstring("mismatched keys [0.weight (checkpoint Float[32, 16], model Float[48, 16])") &&
                          ContainsSubstring("3.weight") && ContainsSubstring("Nothing was loaded"));
    CHECK(all_equal(params_of(*wide), before));
    CHECK(c2.step == 0);
  }
  SECTION("another world size: whole optimizer state and positions in samples carry over") {
    // (Re-partitioned state and real processes: reshard.cpp.) Marked as
    // written by 4 processes, the checkpoint's process 0 files are this
    // process's, and its loader took as many samples per step as this one.
    const auto d = copy_good("world");
    auto meta = nlohmann::json::parse(std::ifstream(d / "accel_state.json"));
    meta["world_size"] = 4;
    std::ofstream(d / "accel_state.json") << meta.dump();
    acc.load_state(d);
    CHECK(counter.step == 5);
    CHECK(loader.checkpoint().batches_yielded == 5);
    CHECK(!all_equal(params_of(*model), params));
  }
  SECTION("other objects registered") {
    Counter extra;
    acc.register_for_checkpointing(extra);
    CHECK_THROWS_WITH(acc.load_state(good),
                      ContainsSubstring("holds 1 registered objects but this Accelerator has 2"));
    untouched();
  }
  for (const char* file : {"model.safetensors", "optimizer.pt", "random_states_0.pt",
                           "custom_checkpoint_0.pt", "loaders_0.json", "accel_state.json"}) {
    SECTION(std::string("truncated ") + file) {
      const auto d = copy_good(std::string("trunc_") + file);
      fs::resize_file(d / file, fs::file_size(d / file) / 2);
      CHECK_THROWS_WITH(acc.load_state(d), ContainsSubstring(file) && (ContainsSubstring("truncated") || ContainsSubstring("corrupt") ||
                                                              ContainsSubstring("invalid safetensors")));
      untouched();
    }
  }
  SECTION("accel_state.json records every file's XXH64, as xxhsum computes it") {
    const auto meta = nlohmann::json::parse(std::ifstream(good / "accel_state.json"));
    const auto& sums = meta.at("xxh64");
    CHECK(sums.size() == 5);
    for (const char* file : {"optimizer.pt", "random_states_0.pt", "custom_checkpoint_0.pt", "loaders_0.json"}) {
      INFO(file);
      CHECK(sums.at(file).get<std::string>() == accel_test::xxhsum(good / file));
    }
    // The model file's: of its data buffer, as its header records it too.
    const auto header = accel::ckpt::detail::read_safetensors_header(good / "model.safetensors");
    CHECK(sums.at("model.safetensors").get<std::string>() == accel_test::xxhsum(good / "model.safetensors", header.data_start));
    CHECK(header.metadata.at("accel.data_xxh64") == sums.at("model.safetensors").get<std::string>());
  }
  for (const char* file : {"model.safetensors", "optimizer.pt", "random_states_0.pt",
                           "custom_checkpoint_0.pt", "loaders_0.json"}) {
    SECTION(std::string("one flipped bit in ") + file) {
      const auto d = copy_good(std::string("flip_") + file);
      std::string bytes;
      {
        std::ifstream in(d / file, std::ios::binary);
        bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      }
      bytes[bytes.size() * 3 / 4] ^= 0x04;  // in the data (safetensors: the header comes first)
      std::ofstream(d / file, std::ios::binary | std::ios::trunc) << bytes;
      CHECK_THROWS_WITH(acc.load_state(d), ContainsSubstring(std::string(file) + "' is corrupt") &&
                                               ContainsSubstring("XXH64"));
      untouched();
    }
  }
  SECTION("a file from another checkpoint is refused") {
    const auto d = copy_good("swapped");
    acc.save_state(root / "other");  // the running state: same shapes, other values
    fs::copy_file(root / "other" / "model.safetensors", d / "model.safetensors",
                  fs::copy_options::overwrite_existing);
    CHECK_THROWS_WITH(acc.load_state(d), ContainsSubstring("model.safetensors' is not the file save_state() wrote there"));
    untouched();
  }
  SECTION("checkpoints without checksums (written before accel recorded them) still load") {
    const auto d = copy_good("no_sums");
    auto meta = nlohmann::json::parse(std::ifstream(d / "accel_state.json"));
    meta.erase("xxh64");
    std::ofstream(d / "accel_state.json") << meta.dump();
    acc.load_state(d);
    CHECK(counter.step == 5);
  }
  SECTION("an optimizer that fails while loading is rolled back with the rest") {
    // Valid files, but the registered object refuses its state: the optimizer,
    // loaded just before it, must be put back.
    struct Fussy {
      torch::Tensor state_dict() const { return torch::zeros({1}); }
      void load_state_dict(const torch::Tensor&) { throw std::runtime_error("refused"); }
    };
    accel::Accelerator<> other;
    auto m2 = small_mlp(3);
    torch::optim::SGD sgd2(m2->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    Fussy fussy;
    auto [pm, popt, pdl] = other.prepare(m2, sgd2, small_loader());
    other.register_for_checkpointing(fussy);
    Counter c3;
    train(other, pm, popt, pdl, *std::make_shared<torch::optim::StepLR>(sgd2, 100), c3, 1);
    const auto mom2 = momenta(sgd2);
    const auto p2 = params_of(*m2);
    CHECK_THROWS_WITH(other.load_state(good), ContainsSubstring("cannot restore registered object 0") &&
                                                  ContainsSubstring("refused"));
    CHECK(all_equal(momenta(sgd2), mom2));
    CHECK(all_equal(params_of(*m2), p2));
  }
  SECTION("the good checkpoint loads") {
    acc.load_state(good);
    CHECK(counter.step == 5);
  }
}

TEST_CASE("a save killed with SIGKILL at a random moment leaves a complete, consistent checkpoint",
          "[checkpoint][save_state][sigkill]") {
  auto make_model = [] {
    torch::nn::Sequential seq;
    seq->push_back(torch::nn::Linear(512, 1024));
    seq->push_back(torch::nn::Linear(1024, 512));
    return seq;
  };
  std::mt19937 rng(std::random_device{}());
  for (int round = 0; round < 4; ++round) {
    const auto dir = scratch("random_kill_" + std::to_string(round)) / "ckpt";
    // The child saves again and again, every file of save i holding i.
    // Forked from a fresh thread, as the launcher does (OpenMP's pool).
    pid_t pid = -1;
    std::thread([&] {
      pid = ::fork();
      if (pid != 0) return;
      try {
        at::set_num_threads(1);
        accel::Accelerator<> acc;
        auto model = make_model();
        Counter c;
        auto prepared = acc.prepare(model);
        (void)prepared;
        acc.register_for_checkpointing(c);
        for (int64_t i = 1;; ++i) {
          {
            torch::NoGradGuard no_grad;
            for (auto& p : model->parameters()) p.fill_(static_cast<double>(i));
          }
          c.step = i;
          acc.save_state(dir);
        }
      } catch (...) {
        ::_exit(3);
      }
    }).join();
    REQUIRE(pid > 0);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int status = 0;
    while (!fs::exists(dir / "accel_state.json") && std::chrono::steady_clock::now() < deadline &&
           ::waitpid(pid, &status, WNOHANG) == 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const int delay_ms = std::uniform_int_distribution<int>(0, 60)(rng);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    INFO("round " << round << ": killed " << delay_ms << " ms after the first complete save");
    REQUIRE(WIFSIGNALED(status));

    accel::Accelerator<> acc;
    auto model = make_model();
    Counter c;
    auto prepared = acc.prepare(model);
    (void)prepared;
    acc.register_for_checkpointing(c);
    acc.load_state(dir);
    CHECK(c.step >= 1);
    for (auto& p : model->parameters())
      CHECK(torch::equal(p, torch::full_like(p, static_cast<double>(c.step))));
    // The next save replaces it and clears what the killed one left.
    acc.save_state(dir);
    CHECK(!fs::exists(dir.string() + ".accel-tmp"));
    CHECK(!fs::exists(dir.string() + ".accel-old"));
  }
}

// A full disk (here: the file size limit, which fails writes the same way,
// with EFBIG instead of ENOSPC) at every point of a save: an accel::Error
// naming the file and the cause, nothing left behind, the previous checkpoint
// intact. Each limit runs in a child of its own (limits are per process),
// forked before anything ran backward().
TEST_CASE("save_state on a full disk is an accel::Error and keeps the previous checkpoint",
          "[checkpoint][save_state][errors][full_disk]") {
  const auto dir = scratch("full_disk") / "ckpt";
  for (const long limit : {0L, 600L, 3000L, 6000L, 9000L}) {
    INFO("file size limit " << limit << " bytes");
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      int code = 0;
      try {
        accel::Accelerator<> acc;
        auto model = small_mlp(1);
        torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
        Counter counter;
        auto [m, opt, dl] = acc.prepare(model, adam, small_loader());
        acc.register_for_checkpointing(counter);
        counter.step = 1;
        acc.save_state(dir);
        counter.step = 2;
        ::signal(SIGXFSZ, SIG_IGN);  // the write fails with EFBIG instead of killing us
        const rlimit lim{static_cast<rlim_t>(limit), RLIM_INFINITY};
        ::setrlimit(RLIMIT_FSIZE, &lim);
        try {
          acc.save_state(dir);
          code = 10;  // the save fit: the limit is too high to test anything
        } catch (const accel::Error& e) {
          const std::string msg = e.what();
          if (msg.find("File too large") == std::string::npos || msg.find(dir.string()) == std::string::npos) {
            std::fprintf(stderr, "unexpected message: %s\n", msg.c_str());
            code = 11;
          }
        }
        const rlimit none{RLIM_INFINITY, RLIM_INFINITY};
        ::setrlimit(RLIMIT_FSIZE, &none);
        if (code == 0 && fs::exists(dir.string() + ".accel-tmp")) code = 12;
        if (code == 0) {
          counter.step = 0;
          acc.load_state(dir);
          if (counter.step != 1) code = 13;
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s\n", e.what());
        code = 14;
      }
      ::_exit(code);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
  }
}
