// SPDX-License-Identifier: Apache-2.0
/// @file Defines the compile-time side of prepare(): the kind of each argument,
/// the prepared type at each position (computed with Boost.Hana) and the
/// diagnostics for arguments of any other kind.
#ifndef ACCEL_PREPARE_HPP
#define ACCEL_PREPARE_HPP

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>

#include <boost/hana/basic_tuple.hpp>
#include <boost/hana/transform.hpp>
#include <boost/hana/type.hpp>
#include <boost/hana/unpack.hpp>

#include <accel/detail/dependent_false.hpp>
#include <accel/data.hpp>
#include <accel/prepared/model.hpp>
#include <accel/prepared/optimizer.hpp>
#include <accel/prepared/scheduler.hpp>

namespace accel {

enum class PrepareKind { Model, Optimizer, DataLoader, Scheduler, Unsupported };

namespace detail {

template <class T>
struct shared_element {
  using type = T;
};
template <class T>
struct shared_element<std::shared_ptr<T>> {
  using type = T;
};

/// What prepare() makes of an argument of type T (decayed). Optimizers and
/// schedulers may also come as std::shared_ptr.
template <class T>
consteval PrepareKind prepare_kind() {
  using E = typename shared_element<T>::type;
  if constexpr (is_model_v<T>)
    return PrepareKind::Model;
  else if constexpr (is_optimizer_v<E>)
    return PrepareKind::Optimizer;
  else if constexpr (data::is_data_loader_v<T>)
    return PrepareKind::DataLoader;
  else if constexpr (is_scheduler_v<E>)
    return PrepareKind::Scheduler;
  else
    return PrepareKind::Unsupported;
}

/// Named after the problem so the compiler prints position and type:
/// "incomplete type prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<2, int>".
/// Fix: pass a torch::nn module holder, a torch::optim optimizer, a loader from
/// accel::data::make_data_loader or a torch::optim::LRScheduler at that position.
template <std::size_t Position, class T>
struct prepare_argument_is_not_a_model_optimizer_loader_or_scheduler;

template <std::size_t Position, class T, PrepareKind K = prepare_kind<T>()>
struct prepared_type {
  static_assert(dependent_false<T>,
                "accel: prepare() argument is not a model, an optimizer, a data loader or an LR "
                "scheduler. Pass a torch::nn module (holder or shared_ptr), a torch::optim "
                "optimizer, a loader made by accel::data::make_data_loader, or a "
                "torch::optim::LRScheduler; the next error names the position and the type");
  using type = typename prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<Position, T>::type;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Model> {
  using type = PreparedModel<T>;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Optimizer> {
  using type = AcceleratedOptimizer<typename shared_element<T>::type>;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::DataLoader> {
  using type = T;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Scheduler> {
  using type = AcceleratedScheduler<typename shared_element<T>::type>;
};

/// The tuple prepare() returns for arguments Ts..., computed with Hana: the
/// i-th element is the prepared form of the i-th argument.
template <class... Ts>
struct prepare_result {
  template <std::size_t... I>
  static auto compute(std::index_sequence<I...>) {
    namespace hana = boost::hana;
    auto args = hana::make_basic_tuple(hana::type_c<std::pair<std::integral_constant<std::size_t, I>, Ts>>...);
    auto prepared = hana::transform(args, [](auto t) {
      using P = typename decltype(t)::type;
      return hana::type_c<typename prepared_type<P::first_type::value, typename P::second_type>::type>;
    });
    return hana::unpack(prepared, hana::template_<std::tuple>);
  }
  using type = typename decltype(compute(std::index_sequence_for<Ts...>{}))::type;
};

template <class... Ts>
using prepare_result_t = typename prepare_result<std::remove_cvref_t<Ts>...>::type;

/// An object handed to prepare() as an lvalue stays owned by the caller (the
/// prepared wrapper refers to it); an rvalue is moved into shared ownership; a
/// shared_ptr is shared.
template <class A>
auto share(A&& a) {
  using T = std::remove_cvref_t<A>;
  if constexpr (!std::is_same_v<typename shared_element<T>::type, T>)
    return T(a);
  else if constexpr (std::is_lvalue_reference_v<A>)
    return std::shared_ptr<T>(std::shared_ptr<T>{}, &a);
  else
    return std::make_shared<T>(std::move(a));
}

}  // namespace detail
}  // namespace accel

#endif  // ACCEL_PREPARE_HPP
