// A user's program: one prepared step on one device through the installed or
// embedded accel. Exits 0 when the loss went down.
#include <accel/accel.hpp>

#include <iostream>

int main() {
  accel::Accelerator<> accelerator;
  accel::set_seed(0);
  auto model = torch::nn::Linear(3, 1);
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  auto [m, opt] = accelerator.prepare(model, sgd);
  auto x = torch::randn({16, 3});
  auto y = x.sum(1, true);
  double first = 0, last = 0;
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    auto loss = torch::mse_loss(m(x), y);
    accelerator.backward(loss);
    opt.step();
    (i == 0 ? first : last) = loss.item<double>();
  }
  std::cout << "accel " << accel::version_string << ": loss " << first << " -> " << last << "\n";
  return last < first ? 0 : 1;
}
