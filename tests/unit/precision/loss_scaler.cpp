// Dynamic loss scaling (the machinery of precision::Fp16) driven end to end on
// CPU: a precision policy with loss scaling and no float16 autocast runs the
// same scaler, optimizer skip and scheduler logic as Fp16 does on CUDA. Inf/NaN
// is injected into the loss; skip, backoff, growth, unscaled clipping and the
// agreement of ranks (inf on one rank only) are checked.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <limits>
#include <optional>

#include "catch.hpp"

#include "paths.hpp"

namespace {

/// Fp16's loss scaling without its float16 autocast (which needs CUDA).
struct ScaledFp32 {
  static constexpr std::string_view name = "no";
  static constexpr bool autocast = false;
  static constexpr at::ScalarType autocast_dtype = at::kFloat;
  static constexpr bool loss_scaling = true;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

accel::AcceleratorOptions scaler_options() {
  accel::AcceleratorOptions o;
  o.grad_scaler.init_scale = 1024;
  o.grad_scaler.growth_factor = 2;
  o.grad_scaler.backoff_factor = 0.5;
  o.grad_scaler.growth_interval = 3;
  return o;
}

torch::nn::Linear make_net() {
  torch::manual_seed(3);
  return torch::nn::Linear(4, 2);
}

torch::Tensor batch_x(int step, int rank) {
  return torch::linspace(-1, 1, 12).view({3, 4}) * (step + 1) + rank;
}

/// One step of the loop; `poison` multiplies the loss by inf on this rank.
template <class Acc, class M, class O, class S>
void train_step(Acc& acc, M& model, O& opt, S& sched, int step, int rank, bool poison) {
  auto loss = model(batch_x(step, rank)).pow(2).mean();
  if (poison) loss = loss * kInf;
  acc.backward(loss);
  opt.step();
  sched.step();
  opt.zero_grad();
}

}  // namespace

TEST_CASE("loss scaling: skip and backoff on inf/NaN, growth after growth_interval clean steps",
          "[parallel][precision][scaler]") {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  accel::Accelerator<accel::backend::SingleDevice, ScaledFp32> acc(scaler_options());
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  REQUIRE(acc.loss_scaler() != nullptr);
  auto* scaler = acc.loss_scaler();
  CHECK(scaler->scale() == 1024);

  // A clean step equals plain fp32 SGD: 1024 is a power of two, so scaling and
  // unscaling are exact.
  auto reference = make_net();
  auto ref_loss = reference(batch_x(0, 0)).pow(2).mean();
  ref_loss.backward();
  std::vector<torch::Tensor> expected;
  for (auto& p : reference->parameters()) expected.push_back((p - 0.1 * p.grad()).detach());
  train_step(acc, model, opt, s, 0, 0, false);
  CHECK_FALSE(opt.step_was_skipped());
  for (std::size_t i = 0; i < expected.size(); ++i)
    CHECK(torch::allclose(net->parameters()[i], expected[i], 0, 1e-7));
  // LibTorch's StepLR keeps the initial lr on its first call (its counter
  // starts at 0): after k real steps the lr is 0.1 * 0.5^(k-1).
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.1));
  CHECK(scaler->scale() == 1024);
  CHECK(scaler->growth_tracker() == 1);

  // inf in the loss: the step is skipped, parameters and lr stay, scale halves.
  std::vector<torch::Tensor> before;
  for (auto& p : net->parameters()) before.push_back(p.detach().clone());
  train_step(acc, model, opt, s, 1, 0, true);
  CHECK(opt.step_was_skipped());
  for (std::size_t i = 0; i < before.size(); ++i) CHECK(torch::equal(net->parameters()[i], before[i]));
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.1));  // the scheduler did not step
  CHECK(scaler->scale() == 512);
  CHECK(scaler->growth_tracker() == 0);

  // NaN (0 * inf) is treated the same way.
  {
    auto loss = model(batch_x(2, 0)).pow(2).mean() * 0.0 * kInf;
    acc.backward(loss);
    opt.step();
    s.step();
    opt.zero_grad();
  }
  CHECK(opt.step_was_skipped());
  CHECK(scaler->scale() == 256);

  // growth_interval (3) clean steps in a row double the scale once.
  for (int k = 0; k < 3; ++k) {
    train_step(acc, model, opt, s, 3 + k, 0, false);
    CHECK_FALSE(opt.step_was_skipped());
  }
  CHECK(scaler->scale() == 512);
  CHECK(scaler->growth_tracker() == 0);
  CHECK(sgd.param_groups()[0].options().get_lr() == Approx(0.1 * std::pow(0.5, 3)));
}

TEST_CASE("loss scaling: clip_grad_norm_ sees the unscaled gradients, unscaled once",
          "[parallel][precision][scaler]") {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  accel::Accelerator<accel::backend::SingleDevice, ScaledFp32> acc(scaler_options());
  auto [model, opt] = acc.prepare(net, sgd);

  auto reference = make_net();
  reference(batch_x(0, 0)).pow(2).mean().backward();
  double ref_norm = 0;
  for (auto& p : reference->parameters()) ref_norm += p.grad().pow(2).sum().item<double>();
  ref_norm = std::sqrt(ref_norm);

  acc.backward(model(batch_x(0, 0)).pow(2).mean());
  const double norm = acc.clip_grad_norm_(model, 1e9);  // no clipping: only the norm
  CHECK(norm == Approx(ref_norm).epsilon(1e-6));
  // The step does not unscale a second time: the gradients are the reference's.
  for (std::size_t i = 0; i < reference->parameters().size(); ++i)
    CHECK(torch::allclose(net->parameters()[i].grad(), reference->parameters()[i].grad(), 0, 1e-7));
  opt.step();
  CHECK_FALSE(opt.step_was_skipped());
  for (std::size_t i = 0; i < reference->parameters().size(); ++i) {
    auto p = reference->parameters()[i];
    CHECK(torch::allclose(net->parameters()[i], p - 0.1 * p.grad(), 0, 1e-7));
  }
}

// Two optimizers (issue 13 B10): clip_grad_norm_ over both models unscales
// every gradient once (the second optimizer's step does not divide again),
// and the scale moves once per iteration, after both steps.
TEST_CASE("loss scaling: two optimizers: each gradient unscaled once, the scale updated once per iteration",
          "[parallel][precision][scaler]") {
  const auto pair = [] {
    torch::manual_seed(3);
    torch::nn::Linear a(4, 3), b(3, 1);
    return std::pair{a, b};
  };
  auto [net_a, net_b] = pair();
  auto [ref_a, ref_b] = pair();
  torch::optim::SGD sgd_a(net_a->parameters(), 0.1), sgd_b(net_b->parameters(), 0.1);
  accel::Accelerator<accel::backend::SingleDevice, ScaledFp32> acc(scaler_options());
  auto [a, b, opt_a, opt_b] = acc.prepare(net_a, net_b, sgd_a, sgd_b);
  auto* scaler = acc.loss_scaler();
  const auto all_params = [](torch::nn::Linear& x, torch::nn::Linear& y) {
    auto ps = x->parameters();
    for (auto& p : y->parameters()) ps.push_back(p);
    return ps;
  };
  for (int it = 0; it < 3; ++it) {
    const auto x = batch_x(it, 0);
    acc.backward(b(a(x)).pow(2).mean());
    const double norm = acc.clip_grad_norm_(all_params(net_a, net_b), 1e9);  // the norm only
    opt_a.step();
    opt_b.step();
    CHECK_FALSE(opt_a.step_was_skipped());
    CHECK_FALSE(opt_b.step_was_skipped());
    opt_a.zero_grad();
    opt_b.zero_grad();

    ref_b(ref_a(x)).pow(2).mean().backward();
    double ref_norm = 0;
    {
      torch::NoGradGuard no_grad;
      for (auto& p : all_params(ref_a, ref_b)) {
        ref_norm += p.grad().pow(2).sum().item<double>();
        p.sub_(0.1 * p.grad());
        p.mutable_grad().zero_();
      }
    }
    CHECK(norm == Approx(std::sqrt(ref_norm)).epsilon(1e-6));
    const auto mine = all_params(net_a, net_b), theirs = all_params(ref_a, ref_b);
    for (std::size_t i = 0; i < mine.size(); ++i) CHECK(torch::allclose(mine[i], theirs[i], 0, 1e-6));
    // growth_interval 3: one count per iteration, not per optimizer.
    CHECK(scaler->growth_tracker() == (it + 1) % 3);
  }
  CHECK(scaler->scale() == 2048);

  // inf in model b's gradients only: a steps, b skips, the scale halves once.
  acc.backward(a(batch_x(3, 0)).pow(2).mean() + b(torch::ones({2, 3})).pow(2).mean() * kInf);
  opt_a.step();
  opt_b.step();
  CHECK_FALSE(opt_a.step_was_skipped());
  CHECK(opt_b.step_was_skipped());
  CHECK(scaler->scale() == 1024);
  CHECK(scaler->growth_tracker() == 0);
}

namespace {

/// Rank 1 alone gets inf on step 1; every rank must skip it. Replicate: the
/// loss is multiplied by inf. ShardGradients: one gradient element that rank 0
/// owns becomes inf on rank 1 only, so after the reduce-scatter only rank 0
/// sees it and rank 1 skips because the finding is all-reduced.
template <class Shard>
void two_rank_body(std::string out) {
  accel::Accelerator<accel::backend::Gloo, ScaledFp32, Shard> acc(scaler_options());
  const int rank = acc.process_index();
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  auto [model, opt, s] = acc.prepare(net, sgd, sched);
  constexpr bool sharded = !std::is_same_v<Shard, accel::shard::Replicate>;
  int step = 0;
  if (sharded && rank == 1) {
    // weight[0][0]: the third element of the (bias, weight) bucket, in rank 0's half.
    net->weight.register_hook([&step](torch::Tensor g) {
      if (step != 1) return g;
      auto h = g.clone();
      h.view(-1)[0] = std::numeric_limits<float>::infinity();
      return h;
    });
  }
  std::vector<double> record;  // per step: skipped, scale after, lr after
  for (; step < 5; ++step) {
    train_step(acc, model, opt, s, step, rank, !sharded && step == 1 && rank == 1);
    record.push_back(opt.step_was_skipped() ? 1 : 0);
    record.push_back(acc.loss_scaler()->scale());
    record.push_back(sgd.param_groups()[0].options().get_lr());
  }
  std::vector<torch::Tensor> saved;
  for (auto& p : net->parameters()) saved.push_back(p.detach().clone());
  saved.push_back(torch::tensor(record, torch::kDouble));
  torch::save(saved, out + "_" + std::to_string(rank) + ".pt");
}

template <class Shard>
void check_two_ranks(const std::string& name) {
  const auto out = accel_test::scratch("parallel", name).string();
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(240);
  accel::notebook_launcher(two_rank_body<Shard>, std::make_tuple(out), lo);
  std::vector<torch::Tensor> r0, r1;
  torch::load(r0, out + "_0.pt");
  torch::load(r1, out + "_1.pt");
  REQUIRE(r0.size() == r1.size());
  auto rec0 = r0.back(), rec1 = r1.back();
  INFO("rank 0 [skipped, scale, lr] per step: " << rec0.view({5, 3}));
  INFO("rank 1: " << rec1.view({5, 3}));
  CHECK(torch::equal(rec0, rec1));  // same skips, scales and lrs on both ranks
  auto rec = rec0.view({5, 3});
  // Only step 1 is skipped; the scale halves there and doubles after 3 clean steps.
  CHECK(torch::equal(rec.select(1, 0), torch::tensor({0., 1., 0., 0., 0.}, torch::kDouble)));
  CHECK(torch::equal(rec.select(1, 1), torch::tensor({1024., 512., 512., 512., 1024.}, torch::kDouble)));
  CHECK(torch::allclose(rec.select(1, 2), torch::tensor({0.1, 0.1, 0.05, 0.025, 0.0125}, torch::kDouble)));
  for (std::size_t i = 0; i + 1 < r0.size(); ++i) CHECK(torch::equal(r0[i], r1[i]));  // replicas agree

  // The clean steps (0, 2, 3, 4) equal one process on both ranks' batches.
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR sched(sgd, 1, 0.5);
  for (int step : {0, 2, 3, 4}) {
    net(torch::cat({batch_x(step, 0), batch_x(step, 1)})).pow(2).mean().backward();
    sgd.step();
    sched.step();
    sgd.zero_grad();
  }
  for (std::size_t i = 0; i + 1 < r0.size(); ++i)
    CHECK(torch::allclose(r0[i], net->parameters()[i], 1e-6, 1e-6));
}

}  // namespace

// Two test cases, not two sections: a section reruns the case in the same
// process, whose reference backward() would come before the second launch.
TEST_CASE("loss scaling: an overflow on one rank makes every rank skip the step (Replicate, inf in rank 1's loss)",
          "[parallel][precision][scaler][gloo]") {
  check_two_ranks<accel::shard::Replicate>("scaler_replicate");
}

TEST_CASE("loss scaling: an overflow on one rank makes every rank skip the step (ShardGradients, inf in one gradient element)",
          "[parallel][precision][scaler][gloo]") {
  check_two_ranks<accel::shard::ShardGradients>("scaler_zero2");
}

TEST_CASE("loss scaling: a step after the Accelerator is gone is a clear error, not a crash",
          "[parallel][scaler]") {
  auto net = make_net();
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
  std::optional<accel::AcceleratedOptimizer<torch::optim::SGD>> kept;
  {
    accel::Accelerator<accel::backend::SingleDevice, ScaledFp32> acc(scaler_options());
    auto [m, opt] = acc.prepare(net, sgd);
    acc.backward(m(batch_x(0, 0)).pow(2).mean());
    kept.emplace(std::move(opt));
  }
  CHECK_THROWS_WITH(kept->step(), Catch::Matchers::ContainsSubstring(
                                      "optimizer.step() after the Accelerator that prepared the optimizer was destroyed"));
}
