// SPDX-License-Identifier: Apache-2.0
/// @file The one place that knows LibTorch versions: ACCEL_TORCH_AT_LEAST(major, minor).
/// accel builds against LibTorch 1.13 (Debian 12, in CI) and 2.x (2.6 on
/// Debian 13, tools/test-libtorch2.sh); code that differs between them tests
/// this macro, nothing else.
#ifndef ACCEL_DETAIL_TORCH_VERSION_HPP
#define ACCEL_DETAIL_TORCH_VERSION_HPP

#include <torch/version.h>

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#endif  // ACCEL_DETAIL_TORCH_VERSION_HPP
