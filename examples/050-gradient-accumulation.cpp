// 050 — gradient accumulation: batches of 16 with gradient_accumulation_steps
// = 4 train exactly as batches of 64 without it. Inside
// `auto guard = accelerator.accumulate(m);` backward() divides the loss by 4
// and the optimizer (and the scheduler) step only on every 4th batch, where
// the gradients are also synchronised across processes (none here; the same
// code is data-parallel under a multi-process backend).
// Run: ./build/examples/050-gradient-accumulation
// Expected output (the digits may differ on another machine):
//   step 0: loss 1.65709 (4 x 16, accumulated) vs 1.65709 (64)
//   ...
//   step 47: loss 1.26915e-05 (4 x 16, accumulated) vs 1.26915e-05 (64)
//   48 optimizer steps each; largest loss difference 1.9e-08, largest weight difference 3.6e-07 (or so)
// Exit status 0 when every step's loss and the final weights agree within 1e-5.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <vector>

// 4 classes of points in 8 dimensions: the label is the nearest of 4 fixed centres.
struct Blobs : torch::data::datasets::Dataset<Blobs> {
  torch::Tensor x, y;
  Blobs() {
    auto gen = at::detail::createCPUGenerator(7);
    auto centres = torch::randn({4, 8}, gen) * 3;
    y = torch::randint(0, 4, {1024}, gen, torch::kLong);
    x = centres.index_select(0, y) + torch::randn({1024, 8}, gen);
  }
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return 1024; }
};

struct Run {
  std::vector<double> step_losses;  // the loss of each optimizer step's samples
  torch::Tensor weights;            // all parameters at the end, flattened
};

/// Trains 3 epochs with loader batches of batch_size and accumulation_steps.
Run train(int64_t batch_size, int accumulation_steps) {
  accel::Accelerator<> accelerator({.gradient_accumulation_steps = accumulation_steps});
  accel::set_seed(0);  // the same initial weights in both runs
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loader = accel::data::make_data_loader(
      Blobs(), {.batch_size = batch_size, .shuffle = true, .seed = 3});  // same sample order
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);

  Run run;
  double step_loss = 0;
  for (int epoch = 0; epoch < 3; ++epoch) {
    for (auto& batch : dl) {
      auto guard = accelerator.accumulate(m);
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();       // a real step only when accelerator.sync_gradients()
      opt.zero_grad();  // likewise
      step_loss += loss.item<double>() / accumulation_steps;
      if (accelerator.sync_gradients()) {
        run.step_losses.push_back(step_loss);
        step_loss = 0;
      }
    }
  }
  std::vector<torch::Tensor> flat;
  for (auto& p : m->parameters()) flat.push_back(p.detach().flatten());
  run.weights = torch::cat(flat);
  return run;
}

int main() {
  const Run accumulated = train(16, 4);
  const Run large = train(64, 1);
  if (accumulated.step_losses.size() != large.step_losses.size()) {
    std::cout << "different step counts: " << accumulated.step_losses.size() << " vs "
              << large.step_losses.size() << std::endl;
    return 1;
  }
  double loss_diff = 0;
  for (size_t i = 0; i < large.step_losses.size(); ++i) {
    loss_diff = std::max(loss_diff, std::abs(accumulated.step_losses[i] - large.step_losses[i]));
    if (i % 16 == 0 || i + 1 == large.step_losses.size())
      std::cout << "step " << i << ": loss " << accumulated.step_losses[i] << " (4 x 16, accumulated) vs "
                << large.step_losses[i] << " (64)" << std::endl;
  }
  const double weight_diff = (accumulated.weights - large.weights).abs().max().item<double>();
  std::cout << large.step_losses.size() << " optimizer steps each; largest loss difference " << loss_diff
            << ", largest weight difference " << weight_diff << std::endl;
  return large.step_losses.size() == 48 && loss_diff < 1e-5 && weight_diff < 1e-5 ? 0 : 1;
}
