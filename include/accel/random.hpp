// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::set_seed: one seed for every generator a training run uses.
#ifndef ACCEL_RANDOM_HPP
#define ACCEL_RANDOM_HPP

#include <cstdint>
#include <cstdlib>
#include <random>

#include <torch/torch.h>

#include <accel/runtime/process_env.hpp>

namespace accel {

/// A std::mt19937_64 owned by accel and seeded by set_seed, for user code that
/// wants std generators to follow the same seed (std::rand is seeded too).
inline std::mt19937_64& std_generator() {
  static std::mt19937_64 gen{0};
  return gen;
}

/// Seeds LibTorch's CPU (and every CUDA) generator, std::rand and
/// accel::std_generator(). With `device_specific` the seed is offset by the
/// global rank, so ranks draw different numbers (dropout, augmentation).
inline void set_seed(uint64_t seed, bool device_specific = false) {
  if (device_specific) seed += static_cast<uint64_t>(runtime::ProcessEnv::discover().rank);
  torch::manual_seed(seed);  // also seeds every CUDA device when CUDA is available
  std::srand(static_cast<unsigned>(seed));
  std_generator().seed(seed);
}

}  // namespace accel

#endif  // ACCEL_RANDOM_HPP
