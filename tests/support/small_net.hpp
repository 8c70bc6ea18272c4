// A two-layer net of 2 inputs and 1 output, for the one-process tests of
// the Accelerator and the prepared types.
#pragma once

#include <torch/torch.h>

namespace accel_test {

inline torch::nn::Sequential small_net() {
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(2, 8));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(8, 1));
  return seq;
}

}  // namespace accel_test
