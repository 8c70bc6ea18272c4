// Compile-time probe (b) for bench/compile_time.sh: LibTorch alone, the plain
// equivalent of accel_prepare.cpp (model, optimizer, data loader, one loop).
#include <torch/torch.h>

#include <iostream>

/// Rows of x and y (LibTorch's own TensorDataset holds one tensor only).
struct Rows : torch::data::datasets::Dataset<Rows> {
  torch::Tensor x, y;
  Rows(torch::Tensor x_, torch::Tensor y_) : x(std::move(x_)), y(std::move(y_)) {}
  torch::data::Example<> get(size_t i) override {
    return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
};

int main() {
  torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(784, 64));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(64, 10));
  net->to(device);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto dataset = Rows(torch::randn({256, 784}), torch::randint(0, 10, {256}))
                     .map(torch::data::transforms::Stack<>());
  auto loader = torch::data::make_data_loader<torch::data::samplers::RandomSampler>(
      std::move(dataset), torch::data::DataLoaderOptions().batch_size(64));
  for (auto& batch : *loader) {
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(net->forward(batch.data.to(device)), batch.target.to(device));
    loss.backward();
    opt.step();
  }
  std::cout << "done" << std::endl;
  return 0;
}
