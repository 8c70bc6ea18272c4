// Compile-time probe (a) for bench/compile_time.sh: the accel umbrella header
// and an Accelerator<> whose prepare() takes a model, an optimizer and a data
// loader, then one training loop. Compare with torch_plain.cpp, which does the
// same with LibTorch alone.
// Built with ACCEL_PROBE_LIGHT (target compile_time_accel_light) it is probe
// (c): the same code including only what it uses (README "Including less").
#ifdef ACCEL_PROBE_LIGHT
#include <accel/accelerator.hpp>
#include <accel/data.hpp>
#else
#include <accel/accel.hpp>
#endif

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
