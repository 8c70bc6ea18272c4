// accel::AcceleratedScheduler (include/accel/prepared/scheduler.hpp): it
// advances once per optimizer step that happened.
#include <accel/accelerator.hpp>

#include "catch.hpp"
#include "small_net.hpp"

TEST_CASE("scheduler advances once per real optimizer step", "[prepared][scheduler]") {
  auto net = accel_test::small_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  accel::Accelerator<> acc(accel::AcceleratorOptions{.gradient_accumulation_steps = 3});
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  for (int step = 0; step < 9; ++step) {
    auto guard = acc.accumulate(model);
    acc.backward(model(torch::ones({1, 2})).sum());
    opt.step();
    s.step();
    opt.zero_grad();
  }
  // 9 micro-steps, 3 real steps. LibTorch's StepLR leaves the first call at the
  // initial lr (its counter starts at 0), so 3 calls give 1, 0.5, 0.25.
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.25));
}

TEST_CASE("copies of a prepared scheduler, and a second call, advance once per optimizer step",
          "[prepared][scheduler]") {
  auto net = accel_test::small_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  accel::Accelerator<> acc;
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  auto copy = s;
  CHECK(&copy.scheduler() == &sched);
  for (int step = 0; step < 3; ++step) {
    acc.backward(model(torch::ones({1, 2})).sum());
    opt.step();
    s.step();
    copy.step();  // the same optimizer step: no second advance
    s.step();
    opt.zero_grad();
  }
  CHECK(*copy.seen_steps() == 3);
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.25));  // 3 advances, as above
}

TEST_CASE("step_scheduler_with_optimizer = false: every call advances, as in plain LibTorch",
          "[prepared][scheduler]") {
  auto net = accel_test::small_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(1.0));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  accel::Accelerator<> acc(accel::AcceleratorOptions{.gradient_accumulation_steps = 3,
                                                     .step_scheduler_with_optimizer = false});
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  for (int step = 0; step < 4; ++step) {
    auto guard = acc.accumulate(model);
    acc.backward(model(torch::ones({1, 2})).sum());
    opt.step();
    s.step();
    opt.zero_grad();
  }
  // 4 calls (one real optimizer step): 1, 0.5, 0.25, 0.125.
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.125));
}
