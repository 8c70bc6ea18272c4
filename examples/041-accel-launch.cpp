// 041 — started by `accel launch`, accel's accelerate launch: it starts
// --num_processes copies of the program with torchrun's variables (RANK,
// WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and
// Accelerator<backend::Gloo> meets the others through a c10d TCPStore. Started
// directly, the same program runs as one process.
// Run: ./build/tools/accel launch --num_processes 2 ./build/examples/041-accel-launch [2]
//      (--main_process_port 0 picks a free port; `accel config` saves defaults)
// Expected output (from rank 0 only; the loss and accuracy vary a little):
//   2 processes (Gloo), replicas equal: yes
//   final loss 0.000xxx, accuracy 1
// With an argument N, it also checks that N processes took part.
// Exit status 0 when the replicas hold the same weights and accuracy > 0.9.
#include <accel/accel.hpp>
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>

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

int main(int argc, char** argv) {
  const int expected = argc > 1 ? std::atoi(argv[1]) : 0;  // optional: the world size to check
  accel::Accelerator<accel::backend::Gloo> accelerator;  // rank and world from accel launch
  accel::set_seed(0);
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto loader = accel::data::make_data_loader(Blobs(), {.batch_size = 32, .shuffle = true});
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);

  double last_loss = 0;
  for (int epoch = 0; epoch < 10; ++epoch) {
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      last_loss = loss.item<double>();
    }
  }
  // Every process saw other batches, yet all hold the same weights.
  auto weights = torch::cat({m->parameters()[0].detach().flatten(), m->parameters()[2].detach().flatten()});
  auto everyone = accelerator.gather(weights.unsqueeze(0));
  const bool equal = (everyone - weights).abs().max().item<double>() == 0.0;

  Blobs data;
  auto accuracy = m(data.x).argmax(1).eq(data.y).to(torch::kFloat).mean().item<double>();
  accelerator.print(accelerator.num_processes(), " processes (Gloo), replicas equal: ", equal ? "yes" : "no");
  accelerator.print("final loss ", last_loss, ", accuracy ", accuracy);
  const bool world_ok = expected == 0 || accelerator.num_processes() == expected;
  return world_ok && equal && accuracy > 0.9 ? 0 : 1;
}
