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
namespace backend::detail {
// One concept per member, so that check_backend_policy names the missing one.
template <class B>
concept has_name = requires { { B::name } -> std::convertible_to<std::string_view>; };
template <class B>
concept has_multi_process = requires { { B::multi_process } -> std::convertible_to<bool>; };
template <class B>
concept has_available = requires { { B::available } -> std::convertible_to<bool>; };
template <class B>
concept has_device = requires(const runtime::ProcessEnv& env) {
  { B::device(env) } -> std::same_as<torch::Device>;
};
template <class B>
concept has_make_communicator = requires(const runtime::ProcessEnv& env, const AcceleratorOptions& opts) {
  { B::make_communicator(env, opts) } -> std::same_as<std::shared_ptr<runtime::Communicator>>;
};
}  // namespace backend::detail

template <class B>
concept BackendPolicy = backend::detail::has_name<B> && backend::detail::has_multi_process<B> &&
                        backend::detail::has_available<B> && backend::detail::has_device<B> &&
                        backend::detail::has_make_communicator<B>;

template <class B>
struct is_backend_policy : std::bool_constant<BackendPolicy<B>> {};
template <class B>
inline constexpr bool is_backend_policy_v = is_backend_policy<B>::value;

/// A type with none of a backend's own members (every policy has a name) is
/// not meant as one, say a precision in the wrong place: one message says
/// which to use. A backend that lacks some gets one message per member.
template <class B>
struct check_backend_policy {
  static constexpr bool own_member = backend::detail::has_multi_process<B> || backend::detail::has_available<B> ||
                                     backend::detail::has_device<B> || backend::detail::has_make_communicator<B>;
  static_assert(own_member,
                "accel: the Backend parameter of Accelerator is not a backend policy. Use "
                "accel::backend::SingleDevice, Gloo, Mpi or Nccl (or see docs/backends.md to write one).");
  static_assert(!own_member || backend::detail::has_name<B>,
                "accel: this backend policy has no `static constexpr std::string_view name`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_multi_process<B>,
                "accel: this backend policy has no `static constexpr bool multi_process`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_available<B>,
                "accel: this backend policy has no `static constexpr bool available`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_device<B>,
                "accel: this backend policy has no `static torch::Device device(const runtime::ProcessEnv&)`. "
                "Add it (docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_make_communicator<B>,
                "accel: this backend policy has no `static std::shared_ptr<runtime::Communicator> "
                "make_communicator(const runtime::ProcessEnv&, const AcceleratorOptions&)`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static constexpr bool value = is_backend_policy_v<B>;
};

}  // namespace accel

#endif  // ACCEL_BACKEND_CONCEPT_HPP
