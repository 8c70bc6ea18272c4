// The key of a parameter in torch::optim::Optimizer::state(): a string of
// the TensorImpl address in LibTorch 1.13, the address itself from 2.x on.
#ifndef ACCEL_TESTS_SUPPORT_OPTIM_STATE_HPP
#define ACCEL_TESTS_SUPPORT_OPTIM_STATE_HPP

#include <torch/torch.h>

#include <accel/detail/torch_version.hpp>

namespace accel_test {

inline auto optim_state_key(const torch::Tensor& p) {
#if ACCEL_TORCH_AT_LEAST(2, 0)
  return static_cast<void*>(p.unsafeGetTensorImpl());
#else
  return c10::guts::to_string(p.unsafeGetTensorImpl());
#endif
}

}  // namespace accel_test

#endif  // ACCEL_TESTS_SUPPORT_OPTIM_STATE_HPP
