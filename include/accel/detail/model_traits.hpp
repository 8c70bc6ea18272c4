// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::model_traits, is_model_v and module_ptr: which
/// handles prepare() accepts as a model, and the module behind one. Shared by
/// prepared/ and checkpoint/ (the registry keeps the prepared models).
#ifndef ACCEL_DETAIL_MODEL_TRAITS_HPP
#define ACCEL_DETAIL_MODEL_TRAITS_HPP

#include <memory>
#include <type_traits>

#include <torch/torch.h>

namespace accel::detail {

/// Models prepare() accepts: torch::nn::ModuleHolder<T> (Linear, Sequential,
/// TORCH_MODULE types) or std::shared_ptr<T>, with T derived from Module.
template <class M>
struct model_traits : std::false_type {};
template <class T>
  requires std::is_base_of_v<torch::nn::Module, T>
struct model_traits<torch::nn::ModuleHolder<T>> : std::true_type {
  using module_type = T;
};
template <class T>
  requires std::is_base_of_v<torch::nn::Module, T>
struct model_traits<std::shared_ptr<T>> : std::true_type {
  using module_type = T;
};
// A TORCH_MODULE(Net) holder is a class derived from ModuleHolder<NetImpl>.
template <class M>
  requires(!std::is_same_v<M, torch::nn::ModuleHolder<typename M::ContainedType>> &&
           std::is_base_of_v<torch::nn::ModuleHolder<typename M::ContainedType>, M>)
struct model_traits<M> : std::true_type {
  using module_type = typename M::ContainedType;
};

template <class M>
inline constexpr bool is_model_v = model_traits<std::remove_cvref_t<M>>::value;

template <class M>
auto* module_ptr(const M& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr().get();  // ModuleHolder: get() const would add const
  } else {
    return m.get();
  }
}

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_MODEL_TRAITS_HPP
