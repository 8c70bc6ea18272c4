// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::AutocastGuard: RAII autocast for one device type.
#ifndef ACCEL_PRECISION_AUTOCAST_HPP
#define ACCEL_PRECISION_AUTOCAST_HPP

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <accel/detail/torch_version.hpp>

namespace accel::precision {

/// Turns autocast on for `device_type` with `dtype` for its lifetime and
/// restores the previous state after, as `torch.autocast(...)` does in Python.
/// Disabled guards (Fp32) do nothing.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, at::ScalarType dtype, bool enabled = true)
      : device_type_(device_type), active_(enabled) {
    if (!active_) return;
    prev_enabled_ = is_enabled(device_type_);
    prev_dtype_ = dtype_of(device_type_);
    set(device_type_, true, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    // Leaving the outermost region drops the cache of casted weights, so an
    // optimizer step on the fp32 weights is seen by the next forward.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set(device_type_, prev_enabled_, prev_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&& other) noexcept
      : device_type_(other.device_type_), active_(other.active_),
        prev_enabled_(other.prev_enabled_), prev_dtype_(other.prev_dtype_) {
    other.active_ = false;
  }
  AutocastGuard& operator=(AutocastGuard&&) = delete;

  // The thread's autocast state for one device type (public for
  // memory::checkpoint, which replays a forward's state in backward).
  // LibTorch 2.4 replaced the per-device functions (is_enabled, is_cpu_enabled,
  // get_autocast_gpu_dtype, ...) by ones taking the device type, and
  // deprecated the old ones.
#if ACCEL_TORCH_AT_LEAST(2, 4)
  static bool is_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
  static at::ScalarType dtype_of(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
  static void set(c10::DeviceType d, bool enabled, at::ScalarType dtype) {
    at::autocast::set_autocast_enabled(d, enabled);
    at::autocast::set_autocast_dtype(d, dtype);
  }
#else
  static bool is_enabled(c10::DeviceType d) {
    return d == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
  }
  static at::ScalarType dtype_of(c10::DeviceType d) {
    return d == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                      : at::autocast::get_autocast_cpu_dtype();
  }
  static void set(c10::DeviceType d, bool enabled, at::ScalarType dtype) {
    if (d == c10::DeviceType::CUDA) {
      at::autocast::set_enabled(enabled);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      at::autocast::set_cpu_enabled(enabled);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
  }
#endif

 private:
  c10::DeviceType device_type_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_AUTOCAST_HPP
