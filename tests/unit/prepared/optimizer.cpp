// accel::AcceleratedOptimizer (include/accel/prepared/optimizer.hpp) on one
// process: when it steps, what zero_grad() keeps, what its copies share.
// Across processes: tests/unit/shard/ and tests/unit/ops/join.cpp.
#include <accel/accelerator.hpp>

#include "catch.hpp"
#include "small_net.hpp"

TEST_CASE("gradient accumulation: step every N batches, loss divided by N", "[prepared][optimizer]") {
  torch::manual_seed(0);
  auto net = accel_test::small_net();
  auto reference = accel_test::small_net();
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < net->parameters().size(); ++i)
      reference->parameters()[i].copy_(net->parameters()[i]);
  }
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ref_sgd(reference->parameters(), torch::optim::SGDOptions(0.1));
  accel::Accelerator<> acc(accel::AcceleratorOptions{.gradient_accumulation_steps = 2});
  auto [model, opt] = acc.prepare(net, sgd);
  std::vector<bool> synced;
  for (int step = 0; step < 4; ++step) {
    auto x = torch::full({2, 2}, static_cast<float>(step + 1));
    {
      auto guard = acc.accumulate(model);
      synced.push_back(acc.sync_gradients());
      auto loss = torch::mse_loss(model(x), x.sum(1, true));
      acc.backward(loss);
      opt.step();
      opt.zero_grad();
      CHECK(opt.step_was_skipped() == !acc.sync_gradients());
    }
  }
  CHECK(synced == std::vector<bool>{false, true, false, true});
  // Reference: the mean loss of each pair of batches, one step per pair.
  for (int pair = 0; pair < 2; ++pair) {
    ref_sgd.zero_grad();
    for (int k = 0; k < 2; ++k) {
      auto x = torch::full({2, 2}, static_cast<float>(2 * pair + k + 1));
      (torch::mse_loss(reference->forward(x), x.sum(1, true)) / 2).backward();
    }
    ref_sgd.step();
  }
  for (size_t i = 0; i < net->parameters().size(); ++i)
    CHECK(torch::allclose(net->parameters()[i], reference->parameters()[i], 1e-6, 1e-7));
}

// Two models trained in one step: one accumulate() entry, as Accelerate's
// accumulate(model_a, model_b); a call per model would count each.
TEST_CASE("gradient accumulation: two models in one accumulate() call count one micro-step", "[prepared][optimizer]") {
  auto net_a = accel_test::small_net();
  auto net_b = accel_test::small_net();
  torch::optim::SGD sgd_a(net_a->parameters(), 0.1), sgd_b(net_b->parameters(), 0.1);
  accel::Accelerator<> acc(accel::AcceleratorOptions{.gradient_accumulation_steps = 2});
  auto [a, b, opt_a, opt_b] = acc.prepare(net_a, net_b, sgd_a, sgd_b);
  std::vector<bool> synced;
  for (int step = 0; step < 4; ++step) {
    auto guard = acc.accumulate(a, b);
    synced.push_back(acc.sync_gradients());
    auto x = torch::full({2, 2}, static_cast<float>(step + 1));
    acc.backward(torch::mse_loss(a(x) + b(x), x.sum(1, true)));
    opt_a.step();
    opt_b.step();
    CHECK(opt_a.step_was_skipped() == !acc.sync_gradients());
    CHECK(opt_b.step_was_skipped() == !acc.sync_gradients());
    opt_a.zero_grad();
    opt_b.zero_grad();
  }
  CHECK(synced == std::vector<bool>{false, true, false, true});
}

TEST_CASE("zero_grad() keeps the gradients of the micro-steps and clears them after the real step",
          "[prepared][optimizer]") {
  auto net = torch::nn::Linear(2, 1);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.0));  // lr 0: the weights stay
  accel::Accelerator<> acc(accel::AcceleratorOptions{.gradient_accumulation_steps = 3});
  auto [model, opt] = acc.prepare(net, sgd);
  // d(sum(w x + b))/dw = x; each micro-step's loss is divided by 3.
  const auto x = torch::tensor({{3.0f, 6.0f}});
  std::vector<float> seen;
  for (int step = 0; step < 3; ++step) {
    auto guard = acc.accumulate(model);
    acc.backward(model(x).sum());
    opt.step();
    opt.zero_grad();
    seen.push_back(net->weight.grad()[0][0].item<float>());
  }
  CHECK(seen[0] == Approx(1.0f));  // 3 / 3, kept by the no-op zero_grad()
  CHECK(seen[1] == Approx(2.0f));
  CHECK(seen[2] == 0.0f);          // after the step: zeroed in place
  CHECK(net->weight.grad().defined());
}

TEST_CASE("copies of a prepared optimizer step the same optimizer", "[prepared][optimizer]") {
  auto net = torch::nn::Linear(2, 1);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.5));
  accel::Accelerator<> acc;
  auto [model, opt] = acc.prepare(net, sgd);
  auto copy = opt;
  CHECK(&copy.optimizer() == &sgd);
  CHECK(copy.operator->() == &sgd);
  const auto before = net->bias.detach().clone();
  acc.backward(model(torch::ones({1, 2})).sum());  // d/db = 1
  copy.step();
  CHECK(torch::allclose(net->bias, before - 0.5));
  CHECK_FALSE(copy.step_was_skipped());
}
