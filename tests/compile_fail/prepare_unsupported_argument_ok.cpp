// Twin of prepare_unsupported_argument_fail.cpp: the same call with a valid
// second argument compiles.
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<> acc;
  torch::nn::Linear model(2, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto prepared = acc.prepare(model, opt);
  (void)prepared;
}
