// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::dispatch_accelerator: chooses the compile-time policies
/// from a run-time choice (a config file, or the variables `accel launch`
/// sets) and calls a generic function with the matching Accelerator<B, P, S>.
#ifndef ACCEL_DISPATCH_HPP
#define ACCEL_DISPATCH_HPP

#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <boost/hana/at.hpp>
#include <boost/hana/bool.hpp>
#include <boost/hana/cartesian_product.hpp>
#include <boost/hana/filter.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>

#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/config_file.hpp>

namespace accel {

/// The three policy names picked at run time. Names: backend "single" | "gloo"
/// | "mpi" | "nccl"; precision "no" | "fp16" | "bf16" (Accelerate's
/// mixed_precision values); shard "replicate" | "shard_optimizer" | "shard_gradients" |
/// "shard_parameters".
struct PolicyChoice {
  std::string backend = "single";
  std::string precision = "no";
  std::string shard = "replicate";

  /// From a config file: the `backend` key when present, else the
  /// distributed_type (NO -> single, MULTI_CPU -> gloo, MULTI_GPU -> nccl);
  /// mixed_precision as is; shard from ACCEL_SHARD (no Accelerate key exists).
  static PolicyChoice from_config(const LaunchConfig& cfg) {
    PolicyChoice c;
    if (cfg.backend)
      c.backend = *cfg.backend;
    else if (cfg.distributed_type == DistributedType::MultiCpu)
      c.backend = "gloo";
    else if (cfg.distributed_type == DistributedType::MultiGpu)
      c.backend = "nccl";
    c.precision = cfg.mixed_precision;
    if (auto s = runtime::detail::getenv_str("ACCEL_SHARD")) c.shard = *s;
    return c;
  }

  /// From the variables `accel launch` / notebook_launcher set: ACCEL_BACKEND
  /// (default: gloo when WORLD_SIZE > 1, else single), ACCEL_MIXED_PRECISION,
  /// ACCEL_SHARD.
  static PolicyChoice from_environment() {
    PolicyChoice c;
    if (auto b = runtime::detail::getenv_str("ACCEL_BACKEND"))
      c.backend = *b;
    else if (runtime::ProcessEnv::discover().world_size > 1)
      c.backend = "gloo";
    if (auto p = runtime::detail::getenv_str("ACCEL_MIXED_PRECISION")) c.precision = *p;
    if (auto s = runtime::detail::getenv_str("ACCEL_SHARD")) c.shard = *s;
    return c;
  }
};

namespace detail {

/// std::tuple<E...> -> hana::tuple_t<E...>: users list policies as std::tuple.
template <class Tuple>
struct hana_types;
template <class... E>
struct hana_types<std::tuple<E...>> {
  static constexpr auto value = boost::hana::tuple_t<E...>;
};

}  // namespace detail

/// Every backend of this build, for dispatch_accelerator's default.
using compiled_backends = std::tuple<backend::SingleDevice, backend::Gloo
#if ACCEL_WITH_MPI
                                     , backend::Mpi
#endif
#if ACCEL_WITH_NCCL
                                     , backend::Nccl
#endif
                                     >;
using all_precisions = std::tuple<precision::Fp32, precision::Fp16, precision::Bf16>;
using all_shards =
    std::tuple<shard::Replicate, shard::ShardOptimizer, shard::ShardGradients, shard::ShardParameters>;

/// Calls `fn(accelerator)` with an Accelerator<B, P, S>& whose policy names
/// equal `choice`, among the combinations of Backends x Precisions x Shards
/// (std::tuple lists; a Boost.Hana cartesian product, minus the invalid
/// combinations). Each combination instantiates `fn`: narrow the lists to what
/// the program needs to keep compile times down. A choice that no compiled
/// combination serves is an accel::ConfigError listing what is available.
template <class Backends = compiled_backends, class Precisions = all_precisions,
          class Shards = all_shards, class F>
void dispatch_accelerator(const PolicyChoice& choice, F&& fn, AcceleratorOptions options = {}) {
  namespace hana = boost::hana;
  auto combos = hana::filter(
      hana::cartesian_product(hana::make_tuple(detail::hana_types<Backends>::value,
                                               detail::hana_types<Precisions>::value,
                                               detail::hana_types<Shards>::value)),
      [](auto combo) {
        using B = typename decltype(+hana::at_c<0>(combo))::type;
        using P = typename decltype(+hana::at_c<1>(combo))::type;
        using S = typename decltype(+hana::at_c<2>(combo))::type;
        return hana::bool_c<accelerator_policies_valid_v<B, P, S>>;
      });
  bool called = false;
  std::ostringstream available;
  hana::for_each(combos, [&](auto combo) {
    using B = typename decltype(+hana::at_c<0>(combo))::type;
    using P = typename decltype(+hana::at_c<1>(combo))::type;
    using S = typename decltype(+hana::at_c<2>(combo))::type;
    const auto b = B::config_name;
    const auto s = S::config_name;
    available << "\n  backend=" << b << " precision=" << P::name << " shard=" << s;
    if (called || choice.backend != b || choice.precision != P::name || choice.shard != s) return;
    called = true;
    Accelerator<B, P, S> accelerator(options);
    fn(accelerator);
  });
  if (!called)
    throw ConfigError("accel: no compiled Accelerator serves backend=" + choice.backend +
                      " precision=" + choice.precision + " shard=" + choice.shard +
                      ". Change the config (or ACCEL_BACKEND / ACCEL_MIXED_PRECISION / "
                      "ACCEL_SHARD), or compile the combination in. Available:" +
                      available.str());
}

}  // namespace accel

#endif  // ACCEL_DISPATCH_HPP
