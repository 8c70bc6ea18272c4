// SPDX-License-Identifier: Apache-2.0
/// @file Defines the cross-policy rules of Accelerator<B, P, S>, in one place.
#ifndef ACCEL_COMPATIBILITY_HPP
#define ACCEL_COMPATIBILITY_HPP

#include <type_traits>

#include <accel/backend.hpp>
#include <accel/config.hpp>
#include <accel/precision.hpp>
#include <accel/shard.hpp>

namespace accel {

/// One static_assert per rule; `value` is true when the combination is valid.
template <class B, class P, class S>
struct check_accelerator_policies {
  static constexpr bool policies_ok = check_backend_policy<B>::value &&
                                      check_precision_policy<P>::value &&
                                      check_shard_policy<S>::value;

  static constexpr bool nccl_ok = !std::is_same_v<B, backend::Nccl> || ACCEL_WITH_NCCL;
  static_assert(nccl_ok,
                "accel: backend::Nccl is not available in this build (ACCEL_WITH_NCCL is 0): "
                "LibTorch was built without CUDA/NCCL. Use backend::Gloo, or link a CUDA build "
                "of LibTorch.");

  static constexpr bool mpi_ok = !std::is_same_v<B, backend::Mpi> || ACCEL_WITH_MPI;
  static_assert(mpi_ok,
                "accel: backend::Mpi is not available in this build (ACCEL_WITH_MPI is 0): no MPI "
                "was found. Install an MPI (Debian: libopenmpi-dev) and reconfigure, or use "
                "backend::Gloo.");

  static constexpr bool shard_ok = !(policies_ok && !B::multi_process &&
                                     (S::shards_optimizer_state || S::shards_gradients));
  static_assert(shard_ok,
                "accel: shard::ShardOptimizer and shard::ShardGradients need more than one "
                "process. Use shard::Replicate with backend::SingleDevice, or choose "
                "backend::Gloo, Mpi or Nccl.");

  static constexpr bool value = policies_ok && nccl_ok && mpi_ok && shard_ok;
};

}  // namespace accel

#endif  // ACCEL_COMPATIBILITY_HPP
