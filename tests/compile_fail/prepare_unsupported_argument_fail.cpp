// expected-error {{accel: prepare\(\) argument is not a model}} and the position/type:
// prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<1, int>
#include <accel/accelerator.hpp>

int main() {
  accel::Accelerator<> acc;
  torch::nn::Linear model(2, 2);
  int not_preparable = 3;
  auto prepared = acc.prepare(model, not_preparable);
  (void)prepared;
}
