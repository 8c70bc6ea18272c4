// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::dependent_false, the one false that depends on
/// a template argument: a static_assert in a primary template fires only when
/// that template is instantiated.
#ifndef ACCEL_DETAIL_DEPENDENT_FALSE_HPP
#define ACCEL_DETAIL_DEPENDENT_FALSE_HPP

namespace accel::detail {

template <class...>
inline constexpr bool dependent_false = false;

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_DEPENDENT_FALSE_HPP
