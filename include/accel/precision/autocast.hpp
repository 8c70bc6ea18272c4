// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::AutocastGuard: RAII autocast for one device type.
#ifndef ACCEL_PRECISION_AUTOCAST_HPP
#define ACCEL_PRECISION_AUTOCAST_HPP

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

namespace accel::precision {

/// Turns autocast on for `device_type` with `dtype` for its lifetime and
/// restores the previous state after, as `torch.autocast(...)` does in Python.
/// Disabled guards (Fp32) do nothing.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, at::ScalarType dtype, bool enabled = true)
      : device_type_(device_type), active_(enabled) {
    if (!active_) return;
    if (device_type_ == c10::DeviceType::CUDA) {
      prev_enabled_ = at::autocast::is_enabled();
      prev_dtype_ = at::autocast::get_autocast_gpu_dtype();
      at::autocast::set_enabled(true);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      prev_enabled_ = at::autocast::is_cpu_enabled();
      prev_dtype_ = at::autocast::get_autocast_cpu_dtype();
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    // Leaving the outermost region drops the cache of casted weights, so an
    // optimizer step on the fp32 weights is seen by the next forward.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    if (device_type_ == c10::DeviceType::CUDA) {
      at::autocast::set_enabled(prev_enabled_);
      at::autocast::set_autocast_gpu_dtype(prev_dtype_);
    } else {
      at::autocast::set_cpu_enabled(prev_enabled_);
      at::autocast::set_autocast_cpu_dtype(prev_dtype_);
    }
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&& other) noexcept
      : device_type_(other.device_type_), active_(other.active_),
        prev_enabled_(other.prev_enabled_), prev_dtype_(other.prev_dtype_) {
    other.active_ = false;
  }
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_type_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_AUTOCAST_HPP
