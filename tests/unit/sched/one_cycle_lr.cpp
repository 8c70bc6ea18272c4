// OneCycleLR against torch.optim.lr_scheduler.OneCycleLR (Python, torch 1.13):
// every lr and momentum value of every step, relative tolerance 1e-12. The
// references are in sched_baselines.hpp, made by tests/baselines/gen_sched_baselines.py.
#include <accel/sched.hpp>

#include <cmath>
#include <sstream>
#include <string>

#include "catch.hpp"
#include <torch/torch.h>

#include "sched_baselines.hpp"

namespace {
using accel::sched::OneCycleLR;
using accel_test::sched_baselines::OneCycleCase;
using accel_test::sched_baselines::one_cycle_cases;

constexpr double kRelTol = 1e-12;

bool close(double actual, double expected) {
  if (expected == 0.0) return actual == 0.0;
  return std::abs(actual - expected) <= kRelTol * std::abs(expected);
}

// The same optimizer the Python script builds: one 2-element parameter per
// group, lr 0.5, SGD momentum 0.9 or Adam(W) betas (0.9, 0.999).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OneCycleCase& c) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (int g = 0; g < c.groups; ++g)
    groups.emplace_back(std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())});
  const std::string kind = c.optimizer;
  if (kind == "sgd")
    return std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.5).momentum(0.9));
  if (kind == "sgd_nomomentum")
    return std::make_unique<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.5));
  if (kind == "adam")
    return std::make_unique<torch::optim::Adam>(
        groups, torch::optim::AdamOptions(0.5).betas({0.9, 0.999}));
  if (kind == "adamw")
    return std::make_unique<torch::optim::AdamW>(
        groups, torch::optim::AdamWOptions(0.5).betas({0.9, 0.999}));
  FAIL("unknown optimizer " << kind);
  return nullptr;
}

OneCycleLR::Options options_of(const OneCycleCase& c) {
  OneCycleLR::Options o;
  o.max_lr = c.max_lr;
  if (c.total_steps >= 0) o.total_steps = c.total_steps;
  if (c.epochs >= 0) o.epochs = c.epochs;
  if (c.steps_per_epoch >= 0) o.steps_per_epoch = c.steps_per_epoch;
  o.pct_start = c.pct_start;
  o.anneal_strategy = c.linear ? accel::sched::AnnealStrategy::Linear
                               : accel::sched::AnnealStrategy::Cos;
  o.cycle_momentum = c.cycle_momentum;
  o.base_momentum = c.base_momentum;
  o.max_momentum = c.max_momentum;
  o.div_factor = c.div_factor;
  o.final_div_factor = c.final_div_factor;
  o.three_phase = c.three_phase;
  return o;
}

// Compares scheduler and optimizer with the reference at position `pos`.
void check_position(const OneCycleCase& c, const OneCycleLR& s, torch::optim::Optimizer& opt,
                    size_t pos) {
  INFO("case " << c.name << ", position " << pos);
  REQUIRE(s.step_count() == static_cast<int64_t>(pos));
  const auto last = s.get_last_lr();
  REQUIRE(last.size() == static_cast<size_t>(c.groups));
  for (int g = 0; g < c.groups; ++g) {
    INFO("group " << g);
    const double want = c.lr[pos][g];
    CHECK(close(last[g], want));
    CHECK(close(opt.param_groups()[g].options().get_lr(), want));
    if (c.cycle_momentum) {
      const double want_m = c.momentum[pos][g];
      CHECK(close(accel::sched::detail::get_momentum(opt.param_groups()[g].options()), want_m));
      CHECK(close(s.get_last_momentum()[g], want_m));
    }
  }
}
}  // namespace

TEST_CASE("OneCycleLR equals PyTorch's sequence for every reference case", "[sched][onecycle]") {
  for (const auto& c : one_cycle_cases) {
    auto opt = make_optimizer(c);
    OneCycleLR sched(*opt, options_of(c));
    REQUIRE(sched.total_steps() == static_cast<int64_t>(c.lr.size()) - 1);
    check_position(c, sched, *opt, 0);
    for (size_t pos = 1; pos < c.lr.size(); ++pos) {
      // Step through the base class, as AcceleratedScheduler and users of
      // torch::optim::LRScheduler do.
      static_cast<torch::optim::LRScheduler&>(sched).step();
      check_position(c, sched, *opt, pos);
    }
    // One step past the end: an error, like Python's ValueError, and nothing moves.
    const double lr_before = opt->param_groups()[0].options().get_lr();
    CHECK_THROWS_WITH(sched.step(), Catch::Matchers::ContainsSubstring("accel: OneCycleLR was stepped") &&
                                        Catch::Matchers::ContainsSubstring("total_steps is " +
                                                        std::to_string(sched.total_steps())));
    CHECK(sched.step_count() == sched.total_steps());
    CHECK(opt->param_groups()[0].options().get_lr() == lr_before);
  }
}

TEST_CASE("OneCycleLR leaves Adam's beta2 alone", "[sched][onecycle]") {
  torch::optim::Adam opt(std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
                         torch::optim::AdamOptions(0.1).betas({0.9, 0.98}));
  OneCycleLR sched(opt, OneCycleLR::Options{.max_lr = 0.01, .total_steps = 10});
  for (int i = 0; i < 5; ++i) sched.step();
  auto& o = static_cast<torch::optim::AdamOptions&>(opt.param_groups()[0].options());
  CHECK(std::get<1>(o.betas()) == 0.98);
}

TEST_CASE("OneCycleLR resumes exactly from set_step_count and from an archive",
          "[sched][onecycle]") {
  const auto& c = one_cycle_cases.front();
  const size_t k = 37;

  SECTION("set_step_count") {
    auto opt = make_optimizer(c);
    OneCycleLR sched(*opt, options_of(c));
    sched.set_step_count(static_cast<int64_t>(k));
    check_position(c, sched, *opt, k);
    for (size_t pos = k + 1; pos < c.lr.size(); ++pos) {
      sched.step();
      check_position(c, sched, *opt, pos);
    }
  }
  SECTION("save / load") {
    std::stringstream buffer;
    {
      auto opt = make_optimizer(c);
      OneCycleLR sched(*opt, options_of(c));
      for (size_t i = 0; i < k; ++i) sched.step();
      torch::serialize::OutputArchive out;
      sched.save(out);
      out.save_to(buffer);
    }
    auto opt = make_optimizer(c);
    OneCycleLR sched(*opt, options_of(c));
    torch::serialize::InputArchive in;
    in.load_from(buffer);
    sched.load(in);
    check_position(c, sched, *opt, k);
    sched.step();
    check_position(c, sched, *opt, k + 1);
  }
  SECTION("out of range") {
    auto opt = make_optimizer(c);
    OneCycleLR sched(*opt, options_of(c));
    CHECK_THROWS_WITH(sched.set_step_count(101), Catch::Matchers::ContainsSubstring("cannot move to step 101"));
    CHECK_THROWS_WITH(sched.set_step_count(-1), Catch::Matchers::ContainsSubstring("cannot move to step -1"));
  }
}

TEST_CASE("OneCycleLR's short constructor is total_steps with defaults", "[sched][onecycle]") {
  const auto& c = one_cycle_cases.front();  // cos_default: max_lr 0.1, 100 steps
  auto opt = make_optimizer(c);
  OneCycleLR sched(*opt, 0.1, 100);
  for (size_t pos = 1; pos < c.lr.size(); ++pos) sched.step();
  check_position(c, sched, *opt, c.lr.size() - 1);
}

TEST_CASE("OneCycleLR rejects wrong arguments with a clear message", "[sched][onecycle]") {
  torch::optim::SGD sgd(std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  using O = OneCycleLR::Options;
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.max_lr = 0.1}),
                    Catch::Matchers::ContainsSubstring("needs total_steps or (epochs and steps_per_epoch)"));
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.max_lr = 0.1, .total_steps = 0}),
                    Catch::Matchers::ContainsSubstring("expected a positive total_steps, got 0"));
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.max_lr = 0.1, .epochs = 3}),
                    Catch::Matchers::ContainsSubstring("expected a positive steps_per_epoch, got none"));
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.max_lr = 0.1, .total_steps = 10, .pct_start = 1.5}),
                    Catch::Matchers::ContainsSubstring("expected pct_start between 0 and 1"));
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.max_lr = {0.1, 0.2}, .total_steps = 10}),
                    Catch::Matchers::ContainsSubstring("expected 1 values for max_lr"));
  CHECK_THROWS_WITH(OneCycleLR(sgd, O{.total_steps = 10}), Catch::Matchers::ContainsSubstring("needs a value for max_lr"));

  torch::optim::Adagrad adagrad(
      std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
      torch::optim::AdagradOptions(0.1));
  CHECK_THROWS_WITH(OneCycleLR(adagrad, O{.max_lr = 0.1, .total_steps = 10}),
                    Catch::Matchers::ContainsSubstring("needs an optimizer with momentum") &&
                        Catch::Matchers::ContainsSubstring("cycle_momentum = false"));
  OneCycleLR ok(adagrad, O{.max_lr = 0.1, .total_steps = 10, .cycle_momentum = false});
  CHECK(ok.get_last_momentum().empty());
}
