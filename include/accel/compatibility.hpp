// SPDX-License-Identifier: Apache-2.0
/// @file Defines the cross-policy rules of Accelerator<B, P, S>, in one place:
/// a trait that asserts nothing (dispatch_accelerator filters with it) and
/// the check whose static_asserts say what is wrong.
#ifndef ACCEL_COMPATIBILITY_HPP
#define ACCEL_COMPATIBILITY_HPP

#include <type_traits>

#include <accel/backend/concept.hpp>
#include <accel/config.hpp>
#include <accel/precision.hpp>
#include <accel/shard.hpp>

// Named by the rules below, not used: their headers (and c10d, Gloo, MPI)
// come with the user's choice of them, not with every Accelerator.
namespace accel::backend {
struct Mpi;
struct Nccl;
}  // namespace accel::backend

namespace accel {

namespace detail {

/// Each rule of Accelerator<B, P, S> as a constant; nothing fires.
template <class B, class P, class S>
struct policy_rules {
  static constexpr bool kinds_ok =
      is_backend_policy_v<B> && is_precision_policy_v<P> && is_shard_policy_v<S>;
  static constexpr bool nccl_ok = !std::is_same_v<B, backend::Nccl> || ACCEL_WITH_NCCL;
  static constexpr bool mpi_ok = !std::is_same_v<B, backend::Mpi> || ACCEL_WITH_MPI;
  static constexpr bool shard_ok = [] {
    if constexpr (kinds_ok)
      return B::multi_process || !(S::shards_optimizer_state || S::shards_gradients);
    else
      return true;  // not policies: their own checks say so, B::multi_process may not exist
  }();
  static constexpr bool value = kinds_ok && nccl_ok && mpi_ok && shard_ok;
};

}  // namespace detail

/// True when Accelerator<B, P, S> is valid; asserts nothing.
template <class B, class P, class S>
inline constexpr bool accelerator_policies_valid_v = detail::policy_rules<B, P, S>::value;

/// One static_assert per rule (each policy's own check first); `value` is true
/// when the combination is valid. Instantiating it is the whole diagnostic.
template <class B, class P, class S>
struct check_accelerator_policies {
  using rules = detail::policy_rules<B, P, S>;
  // Each policy's own check first. Only a complete class runs its
  // static_asserts (an initializer of a static member is not instantiated
  // until used), and sizeof needs one: always true, no error of its own.
  static_assert(sizeof(check_backend_policy<B>) && sizeof(check_precision_policy<P>) &&
                sizeof(check_shard_policy<S>));
  static constexpr bool policies_ok = check_backend_policy<B>::value &&
                                      check_precision_policy<P>::value &&
                                      check_shard_policy<S>::value;
  static_assert(rules::nccl_ok,
                "accel: backend::Nccl is not available in this build (ACCEL_WITH_NCCL is 0): "
                "LibTorch was built without CUDA/NCCL. Use backend::Gloo, or link a CUDA build "
                "of LibTorch.");
  static_assert(rules::mpi_ok,
                "accel: backend::Mpi is not available in this build (ACCEL_WITH_MPI is 0): no MPI "
                "was found. Install an MPI (Debian: libopenmpi-dev) and reconfigure, or use "
                "backend::Gloo.");
  static_assert(rules::shard_ok,
                "accel: shard::ShardOptimizer and shard::ShardGradients need more than one "
                "process. Use shard::Replicate with backend::SingleDevice, or choose "
                "backend::Gloo, Mpi or Nccl.");
  static constexpr bool value = policies_ok && rules::value;
  /// Always true: naming it instantiates the checks above without adding an
  /// error of its own.
  static constexpr bool checked = true;
};

}  // namespace accel

#endif  // ACCEL_COMPATIBILITY_HPP
