// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::deferred_t and complete_type: how the
/// Accelerator names a class of an area it does not include (the checkpoint
/// writer and reader, the trackers, the profiler's Trace), so that only a
/// translation unit that calls into that area compiles its header.
#ifndef ACCEL_DETAIL_DEFERRED_HPP
#define ACCEL_DETAIL_DEFERRED_HPP

namespace accel::detail {

/// T, named so that it depends on D: in a member of a class template over D,
/// T's members are looked up when that member is used, not where it is
/// written, so T may be only declared there.
template <class T, class D>
struct deferred {
  using type = T;
};
template <class T, class D>
using deferred_t = typename deferred<T, D>::type;

/// Whether T is defined here (its header was included).
template <class T>
concept complete_type = requires { sizeof(T); };

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_DEFERRED_HPP
