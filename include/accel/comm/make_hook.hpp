// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::make_hook, the hook AcceleratorOptions ask for.
#ifndef ACCEL_COMM_MAKE_HOOK_HPP
#define ACCEL_COMM_MAKE_HOOK_HPP

#include <memory>

#include <accel/comm/cast_hook.hpp>
#include <accel/comm/hook.hpp>
#include <accel/comm/powersgd_hook.hpp>
#include <accel/options.hpp>

namespace accel::comm {

/// A new hook object (one per prepared model: PowerSGD keeps state per bucket).
inline std::shared_ptr<Hook> make_hook(CommHook kind, const PowerSGDOptions& powersgd = {}) {
  switch (kind) {
    case CommHook::Fp16: return std::make_shared<CastHook>(torch::kHalf);
    case CommHook::Bf16: return std::make_shared<CastHook>(torch::kBFloat16);
    case CommHook::PowerSGD: return std::make_shared<PowerSGDHook>(powersgd);
    case CommHook::None: break;
  }
  return std::make_shared<MeanHook>();
}

}  // namespace accel::comm

#endif  // ACCEL_COMM_MAKE_HOOK_HPP
