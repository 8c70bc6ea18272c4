// 011 — the same loop with accel: the "after" of the README. The lines marked
// `accel:` are the only changes. Runs on one device as it is; with
// Accelerator<accel::backend::Gloo> and `accel launch --num_processes 2` (or
// under mpirun with backend::Mpi) the same code trains data-parallel.
// Run: ./build/examples/011-accel-loop
// Expected output (last line): "final loss 0.0xx, accuracy 0.9x" (accuracy > 0.9).
#include <accel/accel.hpp>  // accel:
#include <torch/torch.h>

#include <iostream>

struct Blobs : torch::data::datasets::Dataset<Blobs> {
  torch::Tensor x, y;
  Blobs() {
    torch::manual_seed(7);
    auto centres = torch::randn({4, 8}) * 3;
    y = torch::randint(0, 4, {1024}, torch::kLong);
    x = centres.index_select(0, y) + torch::randn({1024, 8});
  }
  torch::data::Example<> get(size_t i) override { return {x[i], y[i]}; }
  torch::optional<size_t> size() const override { return 1024; }
};

int main() {
  accel::Accelerator<> accelerator;  // accel: one device; pick Gloo/Mpi/Nccl, Bf16, sharding here
  accel::set_seed(0);                // accel: replaces torch::manual_seed
  torch::nn::Sequential model;
  model->push_back(torch::nn::Linear(8, 32));
  model->push_back(torch::nn::ReLU());
  model->push_back(torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto loader = accel::data::make_data_loader(Blobs(), {.batch_size = 64});  // accel:
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);         // accel:

  double last_loss = 0;
  for (int epoch = 0; epoch < 5; ++epoch) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);  // accel: replaces loss.backward()
      opt.step();
      last_loss = loss.item<double>();
    }
  }
  Blobs data;
  auto predictions = m(data.x.to(accelerator.device())).argmax(1).cpu();
  auto accuracy = predictions.eq(data.y).to(torch::kFloat).mean().item<double>();
  accelerator.print("final loss ", last_loss, ", accuracy ", accuracy);  // accel: main process only
  return accuracy > 0.9 ? 0 : 1;
}
