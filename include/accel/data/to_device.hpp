// SPDX-License-Identifier: Apache-2.0
/// @file Defines to_device(batch, device): moves every tensor of a batch to a
/// device (Accelerate's send_to_device), with DeviceMover<T> as the
/// customization point for user types.
#ifndef ACCEL_DATA_TO_DEVICE_HPP
#define ACCEL_DATA_TO_DEVICE_HPP

#include <torch/data/example.h>
#include <torch/types.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::data {

/// Specialize for a batch type that to_device() does not know:
///   template <> struct accel::data::DeviceMover<MyBatch> {
///     static MyBatch apply(MyBatch b, const torch::Device& d, bool non_blocking);
///   };
/// Types with a member `.to(torch::Device)` need no specialization.
template <class T>
struct DeviceMover {};

template <class T>
T to_device(T batch, const torch::Device& device, bool non_blocking = false);

namespace detail {

template <class T>
concept HasDeviceMover = requires(T t, const torch::Device& d) {
  { DeviceMover<T>::apply(std::move(t), d, false) } -> std::convertible_to<T>;
};
template <class T>
concept HasToReturning = requires(T t, const torch::Device& d) {
  { t.to(d) } -> std::convertible_to<T>;
};
template <class T>
concept HasToInPlace = requires(T t, const torch::Device& d) {
  { t.to(d) } -> std::same_as<void>;
};

template <class T>
struct is_example : std::false_type {};
template <class D, class Tg>
struct is_example<torch::data::Example<D, Tg>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_string_map : std::false_type {};
template <class V, class C, class A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};

template <class>
inline constexpr bool unmovable_v = false;

}  // namespace detail

/// Returns `batch` with every tensor in it on `device`. Knows torch::Tensor,
/// torch::data::Example, std::pair, std::tuple, std::vector, std::optional,
/// std::map<std::string, T>, arithmetic values and strings (unchanged), types
/// with a `.to(device)` member (returning the moved value, or moving in
/// place), and any T with a DeviceMover<T> specialization (checked first).
template <class T>
T to_device(T batch, const torch::Device& device, bool non_blocking) {
  if constexpr (detail::HasDeviceMover<T>) {
    return DeviceMover<T>::apply(std::move(batch), device, non_blocking);
  } else if constexpr (std::is_same_v<T, torch::Tensor>) {
    if (!batch.defined() || batch.device() == device) return batch;
    return batch.to(torch::TensorOptions().device(device), non_blocking);
  } else if constexpr (detail::is_example<T>::value) {
    batch.data = to_device(std::move(batch.data), device, non_blocking);
    if constexpr (!std::is_void_v<typename T::TargetType>)
      batch.target = to_device(std::move(batch.target), device, non_blocking);
    return batch;
  } else if constexpr (detail::is_pair<T>::value) {
    batch.first = to_device(std::move(batch.first), device, non_blocking);
    batch.second = to_device(std::move(batch.second), device, non_blocking);
    return batch;
  } else if constexpr (detail::is_tuple<T>::value) {
    std::apply([&](auto&... e) { ((e = to_device(std::move(e), device, non_blocking)), ...); },
               batch);
    return batch;
  } else if constexpr (detail::is_vector<T>::value || detail::is_string_map<T>::value) {
    for (auto& e : batch) {
      if constexpr (detail::is_vector<T>::value)
        e = to_device(std::move(e), device, non_blocking);
      else
        e.second = to_device(std::move(e.second), device, non_blocking);
    }
    return batch;
  } else if constexpr (detail::is_optional<T>::value) {
    if (batch) *batch = to_device(std::move(*batch), device, non_blocking);
    return batch;
  } else if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                       std::is_same_v<T, std::string>) {
    return batch;
  } else if constexpr (detail::HasToReturning<T>) {
    return batch.to(device);
  } else if constexpr (detail::HasToInPlace<T>) {
    batch.to(device);
    return batch;
  } else {
    static_assert(detail::unmovable_v<T>,
                  "accel: to_device() does not know how to move this batch type to a device. Give "
                  "it a member `.to(torch::Device)` or specialize accel::data::DeviceMover<T>.");
    return batch;
  }
}

}  // namespace accel::data

#endif  // ACCEL_DATA_TO_DEVICE_HPP
