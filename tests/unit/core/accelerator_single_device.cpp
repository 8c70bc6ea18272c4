// Accelerator<SingleDevice, Fp32, Replicate>: the one-process slice of the API.
#include <accel/accelerator.hpp>
#include <accel/random.hpp>

#include "catch.hpp"

namespace {

struct Squares : torch::data::datasets::Dataset<Squares> {
  torch::data::Example<> get(size_t i) override {
    auto x = torch::full({2}, static_cast<float>(i));
    return {x, x.sum().unsqueeze(0)};
  }
  torch::optional<size_t> size() const override { return 32; }
};

torch::nn::Sequential make_net() {
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(2, 8));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(8, 1));
  return seq;
}

}  // namespace

TEST_CASE("prepare returns each argument prepared, in order", "[core][prepare]") {
  accel::Accelerator<> acc;
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR sched(sgd, 10);
  auto loader = accel::data::make_data_loader(Squares{}, accel::data::LoaderOptions{.batch_size = 4});
  auto [s, m, l, o] = acc.prepare(sched, net, loader, sgd);
  STATIC_REQUIRE(std::is_same_v<decltype(s), accel::AcceleratedScheduler<torch::optim::StepLR>>);
  STATIC_REQUIRE(std::is_same_v<decltype(m), accel::PreparedModel<torch::nn::Sequential>>);
  STATIC_REQUIRE(accel::data::is_data_loader_v<decltype(l)>);
  STATIC_REQUIRE(std::is_same_v<decltype(o), accel::AcceleratedOptimizer<torch::optim::SGD>>);
  CHECK(&o.optimizer() == &sgd);                 // lvalues stay the caller's objects
  CHECK(m.get() == net.get());                   // same module, not a copy
  CHECK(&acc.unwrap_model(m) != nullptr);
  CHECK(acc.unwrap_model(m).get() == net.get());
  CHECK(acc.device() == torch::Device(torch::kCPU));
  CHECK(acc.process_index() == 0);
  CHECK(acc.num_processes() == 1);
  CHECK(acc.is_main_process());
  CHECK(acc.is_local_main_process());
  CHECK(l.size() == 8);
}

TEST_CASE("Adam and AdamW, several models, optimizers given as shared_ptr", "[core][prepare]") {
  accel::Accelerator<> acc;
  auto a = make_net();
  auto b = std::make_shared<torch::nn::LinearImpl>(3, 3);
  auto adam = std::make_shared<torch::optim::Adam>(a->parameters());
  torch::optim::AdamW adamw(b->parameters());
  auto [pa, pb, oa, ob] = acc.prepare(a, b, adam, adamw);
  STATIC_REQUIRE(std::is_same_v<decltype(pb), accel::PreparedModel<std::shared_ptr<torch::nn::LinearImpl>>>);
  STATIC_REQUIRE(std::is_same_v<decltype(oa), accel::AcceleratedOptimizer<torch::optim::Adam>>);
  CHECK(&oa.optimizer() == adam.get());
  CHECK(pb(torch::ones({1, 3})).sizes() == torch::IntArrayRef{1, 3});
  CHECK(pb->weight.sizes() == torch::IntArrayRef{3, 3});
}

// The prepared loop equals the plain LibTorch loop bit for bit on one device.
TEST_CASE("a prepared training loop equals the plain loop", "[core][train]") {
  auto run = [](bool with_accel) {
    torch::manual_seed(3);
    auto net = make_net();
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    if (!with_accel) {
      for (int step = 0; step < 5; ++step) {
        auto x = torch::full({4, 2}, static_cast<float>(step));
        sgd.zero_grad();
        auto loss = torch::mse_loss(net->forward(x), x.sum(1, true));
        loss.backward();
        sgd.step();
      }
      return net;
    }
    accel::Accelerator<> acc;
    auto [model, opt] = acc.prepare(net, sgd);
    for (int step = 0; step < 5; ++step) {
      auto x = torch::full({4, 2}, static_cast<float>(step));
      opt.zero_grad();
      auto loss = torch::mse_loss(model(x), x.sum(1, true));
      acc.backward(loss);
      opt.step();
    }
    return net;
  };
  auto plain = run(false);
  auto accelerated = run(true);
  auto p = plain->parameters();
  auto q = accelerated->parameters();
  for (size_t i = 0; i < p.size(); ++i) CHECK(torch::equal(p[i], q[i]));
}

TEST_CASE("gradient accumulation: step every N batches, loss divided by N", "[core][accumulate]") {
  torch::manual_seed(0);
  auto net = make_net();
  auto reference = make_net();
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
TEST_CASE("gradient accumulation: two models in one accumulate() call count one micro-step", "[core][accumulate]") {
  auto net_a = make_net();
  auto net_b = make_net();
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

TEST_CASE("scheduler advances once per real optimizer step", "[core][scheduler]") {
  auto net = make_net();
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

TEST_CASE("set_seed: same seed, same numbers", "[core][seed]") {
  accel::set_seed(42);
  auto a = torch::randn({4});
  auto ra = accel::std_generator()();
  int ca = std::rand();
  accel::set_seed(42);
  CHECK(torch::equal(a, torch::randn({4})));
  CHECK(ra == accel::std_generator()());
  CHECK(ca == std::rand());
  accel::set_seed(43);
  CHECK_FALSE(torch::equal(a, torch::randn({4})));
}

TEST_CASE("collectives on one process are identities", "[core][ops]") {
  accel::Accelerator<> acc;
  auto t = torch::arange(6).view({2, 3});
  CHECK(torch::equal(acc.gather(t), t));
  CHECK(torch::equal(acc.reduce(t), t));
  CHECK(torch::equal(acc.reduce(t.to(torch::kFloat), accel::Reduction::Mean), t.to(torch::kFloat)));
  CHECK(torch::equal(acc.broadcast(t), t));
  CHECK(torch::equal(acc.pad_across_processes(t), t));
  CHECK(acc.gather(torch::tensor(3)).sizes() == torch::IntArrayRef{1});
  acc.wait_for_everyone();
  { auto first = acc.main_process_first(); }
}

TEST_CASE("bf16 autocast: forward in bfloat16, outputs back in float32", "[core][precision]") {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  auto lin = torch::nn::Linear(4, 4);
  auto [model] = acc.prepare(lin);
  auto x = torch::randn({2, 4});
  auto y = model(x);
  CHECK(y.scalar_type() == torch::kFloat);
  auto expected = lin->forward(x.to(torch::kBFloat16).to(torch::kFloat)).to(torch::kFloat);
  {
    auto guard = acc.autocast();
    CHECK(lin->forward(x).scalar_type() == torch::kBFloat16);
  }
  CHECK(lin->forward(x).scalar_type() == torch::kFloat);  // guard restored the state
  CHECK(torch::allclose(y, expected, 2e-2, 2e-2));
}

namespace {
// Records the dtype of its intermediate result: what autocast made of it.
struct Probe : torch::nn::Module {
  torch::nn::Linear lin{nullptr};
  at::ScalarType seen = at::kDouble;
  Probe() { lin = register_module("lin", torch::nn::Linear(8, 8)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = lin->forward(x);
    seen = h.scalar_type();
    return h.to(torch::kFloat);
  }
};
}  // namespace

TEST_CASE("bf16 autocast is on inside the prepared model's forward, and only there", "[core][precision]") {
  accel::Accelerator<accel::backend::SingleDevice, accel::precision::Bf16> acc;
  torch::manual_seed(0);
  auto probe = std::make_shared<Probe>();
  auto [model] = acc.prepare(probe);
  const auto x = torch::randn({4, 8});
  const auto through_accel = model(x);
  CHECK(probe->seen == torch::kBFloat16);
  const auto plain = probe->forward(x);
  CHECK(probe->seen == torch::kFloat);
  CHECK_FALSE(torch::equal(through_accel, plain));  // rounded through bfloat16
  CHECK(torch::allclose(through_accel, plain, 2e-2, 2e-2));
}

TEST_CASE("Fp16 without CUDA is a clear error that suggests Bf16", "[core][precision]") {
  if (torch::cuda::is_available()) return;
  using Fp16Acc = accel::Accelerator<accel::backend::SingleDevice, accel::precision::Fp16>;
  CHECK_THROWS_WITH(Fp16Acc(), Catch::Matchers::ContainsSubstring("precision::Fp16 needs a CUDA device") &&
                                   Catch::Matchers::ContainsSubstring("precision::Bf16"));
}
