// Activation checkpointing inside a prepared model on 2 Gloo processes: the
// recomputation in backward accumulates each parameter's gradient once, so
// every bucket is all-reduced once per step and W trained with every layer
// checkpointed equals one process without checkpointing.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/memory.hpp>

#include <stdexcept>
#include <string>
#include <vector>

#include "catch.hpp"

#include "paths.hpp"
#include "whole_parameters.hpp"
#include "workload.hpp"

namespace {

/// W's model, each layer under its own checkpoint.
struct CheckpointedImpl : torch::nn::Module {
  torch::nn::Sequential seq;
  explicit CheckpointedImpl(torch::nn::Sequential s) : seq(register_module("seq", std::move(s))) {}
  torch::Tensor forward(const torch::Tensor& x) { return accel::checkpoint_sequential(seq, x); }
};
TORCH_MODULE(Checkpointed);

template <class Shard>
void train_checkpointed(std::string out, int micro_steps, int64_t per_rank_batch, int accumulation) {
  accel::AcceleratorOptions opts{.gradient_accumulation_steps = accumulation};
  opts.overlap_gradient_sync = true;  // buckets start from backward's hooks: counted below
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc(opts);
  Checkpointed model(workload::make_model());
  torch::optim::SGD sgd(model->parameters(), workload::sgd_options());
  auto loader = accel::data::make_data_loader(
      workload::Dataset(workload::make_data()),
      accel::data::LoaderOptions{.batch_size = per_rank_batch, .shuffle = false});
  auto [m, opt, dl] = acc.prepare(model, sgd, loader);
  int step = 0;
  for (auto& batch : dl) {
    if (step++ == micro_steps) break;
    auto guard = acc.accumulate(m);
    acc.backward(torch::cross_entropy_loss(m(batch.data), batch.target));
    opt.step();
    opt.zero_grad();
  }
  // Each bucket started exactly once per optimizer step, from backward's
  // hooks: none twice (a parameter reported ready twice would restart the
  // round), none left for the step.
  if (auto* reducer = dynamic_cast<accel::shard::detail::BucketReducer*>(&m.gradient_sync())) {
    const auto expected = reducer->num_buckets() * static_cast<std::size_t>(micro_steps / accumulation);
    if (reducer->launched_during_backward() != expected)
      throw std::runtime_error(std::to_string(reducer->launched_during_backward()) +
                               " bucket all-reduces started during backward, expected " +
                               std::to_string(expected));
  }
  auto params = accel_test::whole_parameters(acc, m, out + "_model");
  torch::save(params, out + "_" + std::to_string(acc.process_index()) + ".pt");
}

void check_equivalent(const std::string& out, const std::vector<torch::Tensor>& reference) {
  for (int r = 0; r < 2; ++r) {
    std::vector<torch::Tensor> got;
    torch::load(got, out + "_" + std::to_string(r) + ".pt");
    const double diff = workload::max_abs_diff(got, reference);
    INFO("rank " << r << " max |checkpointed, 2 processes - single process| = " << diff);
    CHECK(diff <= 1e-5);
  }
}

}  // namespace

TEST_CASE("W with every layer checkpointed on 2 Gloo processes equals one process",
          "[parallel][gloo][checkpointing]") {
  auto out = accel_test::scratch("parallel", "checkpointing").string();
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(300);
  // 10 steps of global batch 64: 32 rows per rank; then with accumulate():
  // 20 micro-steps of 16 rows per rank, 2 per step; then ZeRO-2 and ZeRO-3
  // (the model is not a Sequential, so ZeRO-3 gathers it whole for forward
  // and recomputation must find the gathered parameters). All launches
  // before the reference, which runs backward() in this process.
  using accel::shard::Replicate, accel::shard::ShardGradients, accel::shard::ShardParameters;
  accel::notebook_launcher(train_checkpointed<Replicate>, std::make_tuple(out + "_plain", 10, int64_t{32}, 1), lo);
  accel::notebook_launcher(train_checkpointed<Replicate>, std::make_tuple(out + "_accum", 20, int64_t{16}, 2), lo);
  accel::notebook_launcher(train_checkpointed<ShardGradients>, std::make_tuple(out + "_zero2", 10, int64_t{32}, 1), lo);
  accel::notebook_launcher(train_checkpointed<ShardParameters>, std::make_tuple(out + "_zero3", 10, int64_t{32}, 1), lo);
  const auto reference = workload::reference_parameters(10);  // no checkpointing
  for (const char* run : {"_plain", "_accum", "_zero2", "_zero3"}) {
    INFO("run " << run);
    check_equivalent(out + run, reference);
  }
}
