// SPDX-License-Identifier: Apache-2.0
/// @file Defines DefaultCollate: turns the samples of one batch into one
/// batch by stacking tensors along a new dimension 0 (PyTorch's default_collate
/// for the types a LibTorch dataset returns).
#ifndef ACCEL_DATA_COLLATE_HPP
#define ACCEL_DATA_COLLATE_HPP

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <accel/detail/dependent_false.hpp>

namespace accel::data {
namespace detail {

template <class T>
struct is_std_vector : std::false_type {};
template <class T, class A>
struct is_std_vector<std::vector<T, A>> : std::true_type {};

// Collated<T>::apply(samples) stacks one field of every sample.
template <class T, class = void>
struct Collated {
  static_assert(accel::detail::dependent_false<T>,
                "accel: the default collate cannot stack this sample type (it stacks torch::Tensor, "
                "arithmetic values, torch::data::Example, std::pair and std::tuple of those). Pass "
                "your own collate to make_data_loader(dataset, options, collate).");
};

template <>
struct Collated<torch::Tensor> {
  using type = torch::Tensor;
  static type apply(const std::vector<torch::Tensor>& samples) { return torch::stack(samples); }
};

template <class T>
struct Collated<T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>>> {
  using type = torch::Tensor;  // the dtype of T (double -> float64, as default_collate)
  static type apply(const std::vector<T>& samples) {
    return torch::tensor(at::ArrayRef<T>(samples.data(), samples.size()),
                         torch::dtype(c10::CppTypeToScalarType<T>::value));
  }
};

template <class T, class Get>
auto field(const std::vector<T>& samples, Get get) {
  using F = std::decay_t<decltype(get(samples.front()))>;
  std::vector<F> out;
  out.reserve(samples.size());
  for (const auto& s : samples) out.push_back(get(s));
  return out;
}

template <class D, class T>
struct Collated<torch::data::Example<D, T>> {
  using type = torch::data::Example<typename Collated<D>::type, typename Collated<T>::type>;
  static type apply(const std::vector<torch::data::Example<D, T>>& samples) {
    return type(Collated<D>::apply(field(samples, [](const auto& e) { return e.data; })),
                Collated<T>::apply(field(samples, [](const auto& e) { return e.target; })));
  }
};

template <class D>
struct Collated<torch::data::Example<D, torch::data::example::NoTarget>> {
  using type = torch::data::Example<typename Collated<D>::type, torch::data::example::NoTarget>;
  static type apply(const std::vector<torch::data::Example<D, torch::data::example::NoTarget>>& s) {
    return type(Collated<D>::apply(field(s, [](const auto& e) { return e.data; })));
  }
};

template <class A, class B>
struct Collated<std::pair<A, B>> {
  using type = std::pair<typename Collated<A>::type, typename Collated<B>::type>;
  static type apply(const std::vector<std::pair<A, B>>& s) {
    return type(Collated<A>::apply(field(s, [](const auto& p) { return p.first; })),
                Collated<B>::apply(field(s, [](const auto& p) { return p.second; })));
  }
};

template <class... Ts>
struct Collated<std::tuple<Ts...>> {
  using type = std::tuple<typename Collated<Ts>::type...>;
  static type apply(const std::vector<std::tuple<Ts...>>& s) {
    return apply_impl(s, std::index_sequence_for<Ts...>{});
  }
  template <std::size_t... I>
  static type apply_impl(const std::vector<std::tuple<Ts...>>& s, std::index_sequence<I...>) {
    return type(Collated<Ts>::apply(field(s, [](const auto& t) { return std::get<I>(t); }))...);
  }
};

}  // namespace detail

/// The collate make_data_loader uses unless given another. Samples:
/// torch::Tensor -> stacked tensor; torch::data::Example<D, T> -> Example of
/// the collated fields (so Example<> -> Example<> with data [B, ...] and
/// target [B, ...]; TensorExample keeps having no target); arithmetic values
/// -> a 1-d tensor; std::pair / std::tuple -> collated element-wise. A value
/// that is not a std::vector (a dataset whose get_batch() already returns a
/// batch, e.g. `dataset.map(Stack<>())`) passes through unchanged.
struct DefaultCollate {
  template <class T>
  typename detail::Collated<T>::type operator()(const std::vector<T>& samples) const {
    return detail::Collated<T>::apply(samples);
  }
  template <class Batch, std::enable_if_t<!detail::is_std_vector<std::decay_t<Batch>>::value, int> = 0>
  std::decay_t<Batch> operator()(Batch&& batch) const {
    return std::forward<Batch>(batch);
  }
};

}  // namespace accel::data

#endif  // ACCEL_DATA_COLLATE_HPP
