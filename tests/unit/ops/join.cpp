// join_uneven_inputs(): 3 Gloo processes with 5, 7 and 9 batches finish
// without a hang, with equal replicas and optimizer states, and with the
// parameters of a one-process reference that averages each step's gradients
// over the whole world (ranks out of data counting as zeros); under
// Replicate, ShardOptimizer and ShardGradients, with accumulate(); ranks that
// run different collectives get an error naming them.
#include <accel/accel.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <chrono>
#include <filesystem>
#include <string>
#include <tuple>
#include <vector>

#include "catch.hpp"

#include "paths.hpp"
#include "workers.hpp"

namespace {

using accel_test::expect;
using Catch::Matchers::ContainsSubstring;

constexpr int kWorld = 3;
int batches_of(int rank) { return 5 + 2 * rank; }  // 5, 7, 9

// The same on every rank and in the reference: a BatchNorm (buffers are
// broadcast before each training forward) and two Linear layers. The first
// has no bias: before a BatchNorm its gradient is zero up to rounding, which
// Adam would scale up to whole steps of noise.
torch::nn::Sequential make_model() {
  torch::manual_seed(11);
  return torch::nn::Sequential(torch::nn::Linear(torch::nn::LinearOptions(6, 16).bias(false)),
                               torch::nn::BatchNorm1d(16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 1));
}
std::pair<torch::Tensor, torch::Tensor> batch(int rank, int b) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 * rank + b));
  auto x = torch::randn({8, 6}, gen);
  return {x, x.sum(1, true).sin()};
}
torch::Tensor flat_parameters(torch::nn::Module& m) {
  std::vector<torch::Tensor> ps;
  for (const auto& p : m.parameters()) ps.push_back(p.detach().reshape(-1));
  return torch::cat(ps);
}

template <class Shard>
void uneven_rank(std::string out, int micro_steps) {
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.gradient_accumulation_steps = micro_steps, .bucket_cap_mb = 0.001});
  auto model = make_model();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  auto [m, opt] = acc.prepare(model, adam);
  const int rank = acc.process_index();
  const auto train = [&] {
    for (int b = 0; b < batches_of(rank) * micro_steps; ++b) {
      auto guard = acc.accumulate(m);
      auto [x, y] = batch(rank, b);
      acc.backward(torch::mse_loss(m(x), y));  // divided by micro_steps inside, as in Accelerate
      opt.step();
      opt.zero_grad();
    }
  };
  {
    auto join = acc.join_uneven_inputs(m);
    train();
  }  // ranks 0 and 1 repeat rank 2's collectives here
  // Every rank made the same 9 updates (shard policies: of its partition).
  for (const auto& [key, state] : opt->state()) {
    const auto steps = static_cast<torch::optim::AdamParamState&>(*state).step();
    expect(steps == batches_of(kWorld - 1),
           "rank " + std::to_string(rank) + "'s Adam made " + std::to_string(steps) + " steps");
  }
  auto flat = flat_parameters(*model);
  expect(acc.reduce(flat).equal(flat * kWorld), "the replicas differ after join_uneven_inputs()");
  if (rank == 0) torch::save(flat, out);
}

// Rank 1 steps without the forward that rank 0 runs.
void mismatched_rank() {
  accel::Accelerator<accel::backend::Gloo> acc;
  auto model = make_model();
  torch::optim::SGD sgd(model->parameters(), 0.1);
  auto [m, opt] = acc.prepare(model, sgd);
  auto join = acc.join_uneven_inputs(m);
  auto [x, y] = batch(0, 0);
  if (acc.process_index() == 0) acc.backward(torch::mse_loss(m(x), y));
  opt.step();
}

/// One process: step t averages the gradients of the ranks that still have a
/// batch over the whole world; BatchNorm sees each rank's batch as its own
/// forward would (running statistics: rank 0's, which the broadcast keeps).
torch::Tensor reference(int micro_steps) {
  auto model = make_model();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(0.01));
  for (int t = 0; t < batches_of(kWorld - 1); ++t) {
    std::vector<torch::Tensor> sum;
    for (int r = 0; r < kWorld; ++r) {
      if (t >= batches_of(r)) continue;
      // Rank r's micro-steps accumulate into its gradients, as they do in accel.
      adam.zero_grad();
      for (int k = 0; k < micro_steps; ++k) {
        auto [x, y] = batch(r, t * micro_steps + k);
        (torch::mse_loss(model->forward(x), y) / micro_steps).backward();
      }
      auto params = model->parameters();
      if (sum.empty())
        for (auto& p : params) sum.push_back(p.grad().clone());
      else
        for (std::size_t i = 0; i < params.size(); ++i) sum[i] += params[i].grad();
    }
    auto params = model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = sum[i] / kWorld;
    adam.step();
  }
  return flat_parameters(*model);
}

template <class Shard>
void check_uneven(const char* name, int micro_steps) {
  const auto out = (accel_test::fresh_dir("join", name) / "params.pt").string();
  accel::notebook_launcher(uneven_rank<Shard>, std::make_tuple(out, micro_steps),
                           accel_test::local_processes(kWorld, std::chrono::seconds(120)));
  torch::Tensor trained;
  torch::load(trained, out);
  // Gloo sums three ranks in its own order: a few ulps over 9 Adam steps.
  const auto expected = reference(micro_steps);
  INFO("max difference " << (trained - expected).abs().max().item<double>() << " of "
                         << expected.abs().max().item<double>());
  CHECK(torch::allclose(trained, expected, 1e-5, 1e-6));
}

}  // namespace

TEST_CASE("join_uneven_inputs: 5, 7 and 9 batches under Replicate", "[parallel][join][gloo]") {
  check_uneven<accel::shard::Replicate>("replicate", 1);
}

// One launch per case: the reference's backward in this process would make
// LibTorch 2.x refuse autograd in workers forked after it.
TEST_CASE("join_uneven_inputs: ZeRO-1 with uneven batches", "[parallel][join][gloo]") {
  check_uneven<accel::shard::ShardOptimizer>("zero1", 1);
}

TEST_CASE("join_uneven_inputs: ZeRO-2 with uneven batches", "[parallel][join][gloo]") {
  check_uneven<accel::shard::ShardGradients>("zero2", 1);
}

// Non-sync micro-steps broadcast BatchNorm's buffers but reduce nothing:
// the ranks out of data repeat just the broadcast.
TEST_CASE("join_uneven_inputs: under accumulate(), non-sync forwards only broadcast buffers", "[parallel][join][gloo]") {
  check_uneven<accel::shard::Replicate>("accumulate", 2);
}

TEST_CASE("join_uneven_inputs: ranks running different collectives are named", "[parallel][join][gloo]") {
  CHECK_THROWS_WITH(accel::notebook_launcher(mismatched_rank, std::make_tuple(), accel_test::local_processes(2, std::chrono::seconds(120))),
                    ContainsSubstring("rank 0: forward of guarded model 0") &&
                        ContainsSubstring("rank 1: step() of prepared optimizer 0"));
}
