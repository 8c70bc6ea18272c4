// 010 — a plain LibTorch training loop: the "before" of the README.
// Run: ./build/examples/010-plain-loop
// Expected output (last line): "final loss 0.0xx, accuracy 0.9x" (accuracy > 0.9).
#include <torch/torch.h>

#include <iostream>

// 4 classes of points in 8 dimensions: the label is the nearest of 4 fixed centres.
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
  torch::manual_seed(0);
  torch::nn::Sequential model;
  model->push_back(torch::nn::Linear(8, 32));
  model->push_back(torch::nn::ReLU());
  model->push_back(torch::nn::Linear(32, 4));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto loader = torch::data::make_data_loader(
      Blobs().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(64));

  double last_loss = 0;
  for (int epoch = 0; epoch < 5; ++epoch) {
    for (auto& batch : *loader) {
      optimizer.zero_grad();
      auto loss = torch::cross_entropy_loss(model->forward(batch.data), batch.target);
      loss.backward();
      optimizer.step();
      last_loss = loss.item<double>();
    }
  }
  Blobs data;
  auto accuracy = model->forward(data.x).argmax(1).eq(data.y).to(torch::kFloat).mean().item<double>();
  std::cout << "final loss " << last_loss << ", accuracy " << accuracy << std::endl;
  return accuracy > 0.9 ? 0 : 1;
}
