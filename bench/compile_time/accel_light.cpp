// Compile-time probe (c) for bench/compile_time.sh: accel_prepare.cpp with the
// lighter includes of README "Including less" (the Accelerator and the data
// loaders, nothing else), the same code.
#include <accel/accelerator.hpp>
#include <accel/data.hpp>
int main() {
  accel::Accelerator<> acc;
  torch::nn::Sequential net;
  net->push_back(torch::nn::Linear(784, 64));
  net->push_back(torch::nn::ReLU());
  net->push_back(torch::nn::Linear(64, 10));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  auto loader = accel::data::make_data_loader(
      accel::data::TensorDataset(torch::randn({256, 784}), torch::randint(0, 10, {256})),
      accel::data::LoaderOptions{.batch_size = 64, .shuffle = true});
  auto [model, opt, dl] = acc.prepare(net, sgd, loader);
  for (auto& batch : dl) {
    opt.zero_grad();
    auto loss = torch::cross_entropy_loss(model(batch.data), batch.target);
    acc.backward(loss);
    opt.step();
  }
  acc.print("done");
  return 0;
}
