// SPDX-License-Identifier: Apache-2.0
/// @file Defines the object collectives gather_object / broadcast_object over
/// any runtime::Communicator: a value of a supported type is encoded once
/// (ops::encode_object: type-directed, to nlohmann::json and then CBOR bytes),
/// the bytes travel as a uint8 tensor of the largest length across ranks, and
/// each receiver decodes them back into the same type.
#ifndef ACCEL_OPS_OBJECTS_HPP
#define ACCEL_OPS_OBJECTS_HPP

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::ops {

namespace detail {
template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_map : std::false_type {};
template <class K, class V, class C, class A> struct is_map<std::map<K, V, C, A>> : std::true_type {};
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_pair : std::false_type {};
template <class A, class B> struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T> struct is_tuple : std::false_type {};
template <class... T> struct is_tuple<std::tuple<T...>> : std::true_type {};

/// A type nlohmann converts both ways: its own conversions, or the user's
/// to_json/from_json found by ADL (or an adl_serializer specialisation).
template <class T>
concept JsonConvertible = requires(nlohmann::json& j, const T& t) {
  nlohmann::json(t);
  std::as_const(j).template get<T>();
};

template <class T> struct always_false : std::false_type {};
}  // namespace detail

/// Whether gather_object / broadcast_object can send a T (checked recursively
/// into the containers below).
template <class T>
constexpr bool is_object_transferable() {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor> || std::is_same_v<U, nlohmann::json> ||
                std::is_arithmetic_v<U> || std::is_same_v<U, std::string>)
    return true;
  else if constexpr (detail::is_optional<U>::value || detail::is_vector<U>::value)
    return is_object_transferable<typename U::value_type>();
  else if constexpr (detail::is_map<U>::value)
    return is_object_transferable<typename U::key_type>() &&
           is_object_transferable<typename U::mapped_type>();
  else if constexpr (detail::is_pair<U>::value)
    return is_object_transferable<typename U::first_type>() &&
           is_object_transferable<typename U::second_type>();
  else if constexpr (detail::is_tuple<U>::value)
    return []<class... E>(std::type_identity<std::tuple<E...>>) {
      return (is_object_transferable<E>() && ...);
    }(std::type_identity<U>{});
  else
    return detail::JsonConvertible<U>;
}

/// Encodes a value as JSON, keeping its structure: containers become arrays
/// (maps: arrays of [key, value], so any key type works), std::nullopt is
/// null, a tensor is {dtype, shape, data (the raw bytes, a binary value)}.
template <class T>
nlohmann::json encode_object(const T& value) {
  static_assert(is_object_transferable<T>(),
                "accel: gather_object/broadcast_object cannot send this type. Use arithmetic "
                "types, std::string, torch::Tensor, nlohmann::json, std::vector/map/optional/"
                "pair/tuple of those, or give the type to_json/from_json (nlohmann, found by ADL).");
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    if (!value.defined()) return nullptr;
    ACCEL_CHECK(value.layout() == torch::kStrided && !value.is_quantized(),
                "accel: gather_object/broadcast_object sends dense tensors only; got layout ",
                value.layout(), ". Call .to_dense() (or dequantize()) first.");
    auto t = value.detach().to(torch::kCPU).contiguous();
    const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
    const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    return {{"dtype", static_cast<int>(t.scalar_type())},
            {"shape", t.sizes().vec()},
            {"data", nlohmann::json::binary(std::vector<std::uint8_t>(p, p + bytes))}};
  } else if constexpr (std::is_same_v<U, nlohmann::json>) {
    return value;
  } else if constexpr (std::is_arithmetic_v<U> || std::is_same_v<U, std::string>) {
    return value;
  } else if constexpr (detail::is_optional<U>::value) {
    return value ? encode_object(*value) : nlohmann::json(nullptr);
  } else if constexpr (detail::is_vector<U>::value) {
    auto out = nlohmann::json::array();
    for (const auto& e : value) {
      if constexpr (std::is_same_v<typename U::value_type, bool>)  // vector<bool>'s proxies
        out.push_back(static_cast<bool>(e));
      else
        out.push_back(encode_object(e));
    }
    return out;
  } else if constexpr (detail::is_map<U>::value) {
    auto out = nlohmann::json::array();
    for (const auto& [k, v] : value) out.push_back({encode_object(k), encode_object(v)});
    return out;
  } else if constexpr (detail::is_pair<U>::value) {
    return {encode_object(value.first), encode_object(value.second)};
  } else if constexpr (detail::is_tuple<U>::value) {
    auto out = nlohmann::json::array();
    std::apply([&](const auto&... e) { (out.push_back(encode_object(e)), ...); }, value);
    return out;
  } else {
    return nlohmann::json(value);
  }
}

/// The inverse of encode_object<T>; tensors are made on `device`.
template <class T>
T decode_object(const nlohmann::json& j, const torch::Device& device = torch::kCPU) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    if (j.is_null()) return {};
    const auto& data = j.at("data").get_binary();
    auto t = torch::empty(j.at("shape").get<std::vector<int64_t>>(),
                          torch::TensorOptions().dtype(static_cast<at::ScalarType>(j.at("dtype").get<int>())));
    ACCEL_CHECK(data.size() == static_cast<std::size_t>(t.numel()) * t.element_size(),
                "accel: a received tensor has ", data.size(), " bytes for shape ", t.sizes(),
                ". Call the object collective with the same type on every rank.");
    if (!data.empty()) std::memcpy(t.data_ptr(), data.data(), data.size());
    return device.is_cpu() ? t : t.to(device);
  } else if constexpr (std::is_same_v<U, nlohmann::json>) {
    return j;
  } else if constexpr (std::is_arithmetic_v<U> || std::is_same_v<U, std::string>) {
    return j.get<U>();
  } else if constexpr (detail::is_optional<U>::value) {
    if (j.is_null()) return std::nullopt;
    return decode_object<typename U::value_type>(j, device);
  } else if constexpr (detail::is_vector<U>::value) {
    U out;
    out.reserve(j.size());
    for (const auto& e : j) out.push_back(decode_object<typename U::value_type>(e, device));
    return out;
  } else if constexpr (detail::is_map<U>::value) {
    U out;
    for (const auto& kv : j)
      out.emplace(decode_object<typename U::key_type>(kv.at(0), device),
                  decode_object<typename U::mapped_type>(kv.at(1), device));
    return out;
  } else if constexpr (detail::is_pair<U>::value) {
    return U(decode_object<typename U::first_type>(j.at(0), device),
             decode_object<typename U::second_type>(j.at(1), device));
  } else if constexpr (detail::is_tuple<U>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return U(decode_object<std::tuple_element_t<I, U>>(j.at(I), device)...);
    }(std::make_index_sequence<std::tuple_size_v<U>>{});
  } else {
    return j.get<U>();
  }
}

/// A value as bytes (CBOR of encode_object), and back.
template <class T>
std::vector<std::uint8_t> to_bytes(const T& value) {
  return nlohmann::json::to_cbor(encode_object(value));
}
template <class T>
T from_bytes(const std::uint8_t* data, std::size_t size, const torch::Device& device = torch::kCPU) {
  nlohmann::json j;
  try {
    j = nlohmann::json::from_cbor(data, data + size);
    return decode_object<T>(j, device);
  } catch (const nlohmann::json::exception& e) {
    throw Error(accel::detail::concat("accel: an object collective received data that does not "
                                      "decode as the requested type (", e.what(),
                                      "). Call it with the same type on every rank."));
  }
}

namespace detail {
inline torch::Tensor bytes_tensor(const std::vector<std::uint8_t>& bytes, int64_t size,
                                  const torch::Device& device) {
  auto t = torch::zeros({size}, torch::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return device.is_cpu() ? t : t.to(device);
}
}  // namespace detail

/// Every rank's `obj`, in rank order (two all-gathers: the lengths, then the
/// bytes padded to the longest). Tensors come back on `device`, detached.
template <class T>
std::vector<T> gather_object(runtime::Communicator& comm, const T& obj,
                             const torch::Device& device = torch::kCPU) {
  const auto mine = to_bytes(obj);
  const int world = comm.size();
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto len = torch::tensor({static_cast<int64_t>(mine.size())}, on);
  auto lens = torch::empty({world}, on);
  comm.all_gather(lens, len)->wait();
  lens = lens.cpu();
  const int64_t longest = lens.max().item<int64_t>();
  auto all = torch::empty({world * longest}, torch::TensorOptions().dtype(torch::kByte).device(comm.device()));
  comm.all_gather(all, detail::bytes_tensor(mine, longest, comm.device()))->wait();
  all = all.cpu();
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(world));
  const auto* base = static_cast<const std::uint8_t*>(all.data_ptr());
  for (int r = 0; r < world; ++r)
    out.push_back(from_bytes<T>(base + r * longest, static_cast<std::size_t>(lens[r].item<int64_t>()), device));
  return out;
}

/// Rank src's `obj` on every rank (two broadcasts: the length, then the
/// bytes). src gets its own obj back unchanged; the others decode theirs,
/// tensors on `device`.
template <class T>
T broadcast_object(runtime::Communicator& comm, T obj, int src = 0,
                   const torch::Device& device = torch::kCPU) {
  ACCEL_CHECK(src >= 0 && src < comm.size(), "accel: broadcast_object() source rank ", src,
              " is outside world size ", comm.size(), ". Use a rank in [0, ", comm.size(), ").");
  if (comm.size() == 1) return obj;
  std::vector<std::uint8_t> bytes;
  if (comm.rank() == src) bytes = to_bytes(obj);
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, on);
  comm.broadcast(len, src)->wait();
  const int64_t n = len.cpu().item<int64_t>();
  auto data = detail::bytes_tensor(bytes, n, comm.device());
  comm.broadcast(data, src)->wait();
  if (comm.rank() == src) return obj;
  data = data.cpu();
  return from_bytes<T>(static_cast<const std::uint8_t*>(data.data_ptr()), static_cast<std::size_t>(n), device);
}

/// The two object collectives as one class: what Accelerator::gather_object()
/// and broadcast_object() call, named through detail::deferred_t, so that
/// accelerator.hpp need not include this header (nor nlohmann's json).
struct ObjectCollectives {
  template <class T>
  static std::vector<T> gather(runtime::Communicator& comm, const T& obj, const torch::Device& device) {
    return gather_object(comm, obj, device);
  }
  template <class T>
  static T broadcast(runtime::Communicator& comm, T obj, int src, const torch::Device& device) {
    return broadcast_object(comm, std::move(obj), src, device);
  }
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_OBJECTS_HPP
