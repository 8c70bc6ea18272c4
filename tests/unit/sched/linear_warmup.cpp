// LinearWarmup against torch's LinearLR (warm-up only) and against
// transformers' get_linear_schedule_with_warmup lambda run by torch's LambdaLR
// (warm-up then linear decay): references in sched_baselines.hpp, relative
// tolerance 1e-12.
#include <accel/sched.hpp>

#include <cmath>
#include <sstream>

#include "catch.hpp"
#include <torch/torch.h>

#include "sched_baselines.hpp"

namespace {
using accel::sched::LinearWarmup;
using accel_test::sched_baselines::warmup_cases;

bool close(double actual, double expected) {
  if (expected == 0.0) return actual == 0.0;
  return std::abs(actual - expected) <= 1e-12 * std::abs(expected);
}

std::vector<torch::optim::OptimizerParamGroup> groups_with(const std::vector<double>& lrs) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (double lr : lrs)
    groups.emplace_back(std::vector<torch::Tensor>{torch::zeros({2}, torch::requires_grad())},
                        std::make_unique<torch::optim::SGDOptions>(lr));
  return groups;
}
}  // namespace

TEST_CASE("LinearWarmup equals the Python reference sequences", "[sched][warmup]") {
  for (const auto& c : warmup_cases) {
    torch::optim::SGD opt(groups_with(c.base_lr), torch::optim::SGDOptions(1.0));
    LinearWarmup::Options o{.warmup_steps = c.warmup_steps, .start_factor = c.start_factor};
    if (c.total_steps >= 0) o.total_steps = c.total_steps;
    LinearWarmup sched(opt, o);
    CHECK(sched.base_lrs() == c.base_lr);
    for (size_t pos = 0; pos < c.lr.size(); ++pos) {
      if (pos > 0) static_cast<torch::optim::LRScheduler&>(sched).step();
      INFO("case " << c.name << ", position " << pos);
      REQUIRE(sched.step_count() == static_cast<int64_t>(pos));
      for (size_t g = 0; g < c.base_lr.size(); ++g) {
        CHECK(close(sched.get_last_lr()[g], c.lr[pos][g]));
        CHECK(close(opt.param_groups()[g].options().get_lr(), c.lr[pos][g]));
      }
    }
  }
}

TEST_CASE("LinearWarmup's formula at its corners", "[sched][warmup]") {
  torch::optim::SGD opt(groups_with({0.2}), torch::optim::SGDOptions(1.0));
  LinearWarmup hold(opt, 4, 0.5);  // 0.5, 0.625, 0.75, 0.875, then 1 forever
  CHECK(hold.factor(0) == 0.5);
  CHECK(hold.factor(2) == 0.75);
  CHECK(hold.factor(4) == 1.0);
  CHECK(hold.factor(1000000) == 1.0);
  CHECK(opt.param_groups()[0].options().get_lr() == 0.2 * 0.5);

  torch::optim::SGD opt2(groups_with({0.2}), torch::optim::SGDOptions(1.0));
  LinearWarmup none(opt2, LinearWarmup::Options{.warmup_steps = 0});
  CHECK(none.factor(0) == 1.0);  // no warm-up: full lr at once
  CHECK(opt2.param_groups()[0].options().get_lr() == 0.2);

  torch::optim::SGD opt3(groups_with({0.2}), torch::optim::SGDOptions(1.0));
  LinearWarmup decay(opt3, LinearWarmup::Options{.warmup_steps = 3, .total_steps = 3});
  CHECK(decay.factor(2) == 2.0 / 3.0);
  CHECK(decay.factor(3) == 0.0);  // warm-up reaches the end: lr drops to 0
  CHECK(decay.factor(10) == 0.0);
}

TEST_CASE("LinearWarmup resumes exactly", "[sched][warmup]") {
  const auto& c = warmup_cases[1];  // two groups, warm-up then decay
  auto make = [&](torch::optim::SGD& opt) {
    return LinearWarmup(opt, LinearWarmup::Options{.warmup_steps = c.warmup_steps,
                                                   .total_steps = c.total_steps});
  };
  std::stringstream buffer;
  {
    torch::optim::SGD opt(groups_with(c.base_lr), torch::optim::SGDOptions(1.0));
    auto sched = make(opt);
    for (int i = 0; i < 7; ++i) sched.step();
    torch::serialize::OutputArchive out;
    sched.save(out);
    out.save_to(buffer);
  }
  // Rebuilt around an optimizer whose lr is already the step-7 value (as after
  // loading optimizer state): the saved base lrs keep the schedule right.
  torch::optim::SGD opt(groups_with(c.lr[7]), torch::optim::SGDOptions(1.0));
  auto sched = make(opt);
  torch::serialize::InputArchive in;
  in.load_from(buffer);
  sched.load(in);
  for (size_t pos = 7; pos < c.lr.size(); ++pos) {
    if (pos > 7) sched.step();
    INFO("position " << pos);
    REQUIRE(sched.step_count() == static_cast<int64_t>(pos));
    for (size_t g = 0; g < c.base_lr.size(); ++g)
      CHECK(close(opt.param_groups()[g].options().get_lr(), c.lr[pos][g]));
  }

  torch::optim::SGD opt2(groups_with(c.base_lr), torch::optim::SGDOptions(1.0));
  auto other = make(opt2);
  other.set_step_count(3);
  CHECK(close(opt2.param_groups()[1].options().get_lr(), c.lr[3][1]));
  CHECK_THROWS_WITH(other.set_step_count(-2), Catch::Matchers::ContainsSubstring("cannot move to step -2"));
}

TEST_CASE("LinearWarmup rejects wrong arguments with a clear message", "[sched][warmup]") {
  torch::optim::SGD opt(groups_with({0.1}), torch::optim::SGDOptions(1.0));
  using O = LinearWarmup::Options;
  CHECK_THROWS_WITH(LinearWarmup(opt, O{.warmup_steps = -1}),
                    Catch::Matchers::ContainsSubstring("expected warmup_steps >= 0"));
  CHECK_THROWS_WITH(LinearWarmup(opt, O{.warmup_steps = 5, .start_factor = 1.5}),
                    Catch::Matchers::ContainsSubstring("expected start_factor between 0 and 1"));
  CHECK_THROWS_WITH(LinearWarmup(opt, O{.warmup_steps = 5, .total_steps = 4}),
                    Catch::Matchers::ContainsSubstring("expected total_steps >= warmup_steps"));
}
