// Accelerator<SingleDevice, Fp32, Replicate>: the one-process slice of the API.
// The prepared types alone: tests/unit/prepared/; autocast: tests/unit/precision/.
#include <accel/accelerator.hpp>
#include <accel/random.hpp>

#include "catch.hpp"
#include "small_net.hpp"

namespace {

struct Squares : torch::data::datasets::Dataset<Squares> {
  torch::data::Example<> get(size_t i) override {
    auto x = torch::full({2}, static_cast<float>(i));
    return {x, x.sum().unsqueeze(0)};
  }
  torch::optional<size_t> size() const override { return 32; }
};

}  // namespace

TEST_CASE("prepare returns each argument prepared, in order", "[core][prepare]") {
  accel::Accelerator<> acc;
  auto net = accel_test::small_net();
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
  auto a = accel_test::small_net();
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
    auto net = accel_test::small_net();
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

