// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a backend policy is: the trait, the concept and the
/// asserting check whose messages say what is missing.
#ifndef ACCEL_BACKEND_CONCEPT_HPP
#define ACCEL_BACKEND_CONCEPT_HPP

#include <concepts>
#include <memory>
#include <string_view>
#include <type_traits>

#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel {

/// A backend policy says where tensors live and how ranks talk:
///   static constexpr std::string_view name;
///   static constexpr bool multi_process;   // false: one process whatever the environment says
///   static constexpr bool available;       // compiled into this build
///   static torch::Device device(const runtime::ProcessEnv&);
///   static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv&,
///                                                                   const AcceleratorOptions&);
template <class B>
concept BackendPolicy = requires(const runtime::ProcessEnv& env, const AcceleratorOptions& opts) {
  { B::name } -> std::convertible_to<std::string_view>;
  { B::multi_process } -> std::convertible_to<bool>;
  { B::available } -> std::convertible_to<bool>;
  { B::device(env) } -> std::same_as<torch::Device>;
  { B::make_communicator(env, opts) } -> std::same_as<std::shared_ptr<runtime::Communicator>>;
};

template <class B>
struct is_backend_policy : std::bool_constant<BackendPolicy<B>> {};
template <class B>
inline constexpr bool is_backend_policy_v = is_backend_policy<B>::value;

template <class B>
struct check_backend_policy {
  static_assert(is_backend_policy_v<B>,
                "accel: the Backend parameter of Accelerator is not a backend policy. Use "
                "accel::backend::SingleDevice, Gloo, Mpi or Nccl (or see docs/backends.md to write one).");
  static constexpr bool value = is_backend_policy_v<B>;
};

}  // namespace accel

#endif  // ACCEL_BACKEND_CONCEPT_HPP
