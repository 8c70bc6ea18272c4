// SPDX-License-Identifier: Apache-2.0
/// @file Defines how the data loader reads a map-style dataset: its size and
/// the samples (or ready batch) of a list of indices.
#ifndef ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP
#define ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP

#include <accel/errors.hpp>

#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::data::detail {

template <class D>
concept HasGet = requires(D& d, size_t i) { d.get(i); };
template <class D>
concept HasGetBatch = requires(D& d, const std::vector<size_t>& idx) { d.get_batch(idx); };
template <class D>
concept HasSize = requires(const D& d) { d.size(); };

// torch datasets return optional<size_t> (c10::optional in LibTorch 1.x,
// std::optional in 2.x); plain integers are accepted as well.
template <class D>
size_t dataset_size(const D& dataset) {
  auto size = dataset.size();
  if constexpr (std::is_integral_v<decltype(size)>) {
    return static_cast<size_t>(size);
  } else {
    ACCEL_CHECK(size.has_value(),
                "accel: the dataset's size() returned no value, but a data loader must know how "
                "many samples there are. Give the dataset a size(), or batch it yourself.");
    return static_cast<size_t>(*size);
  }
}

// Per-sample get() is preferred (it is what a torch::data::Dataset subclass
// defines); a dataset with only get_batch() (dataset.map(...)) is asked for
// the whole batch at once.
template <class D>
auto fetch(D& dataset, const std::vector<size_t>& indices) {
  if constexpr (HasGet<D>) {
    std::vector<std::decay_t<decltype(dataset.get(size_t{}))>> samples;
    samples.reserve(indices.size());
    for (size_t i : indices) samples.push_back(dataset.get(i));
    return samples;
  } else {
    return dataset.get_batch(indices);
  }
}

template <class D>
using raw_batch_t = decltype(fetch(std::declval<D&>(), std::declval<const std::vector<size_t>&>()));

}  // namespace accel::data::detail

namespace accel::data {

/// What make_data_loader accepts: a map-style dataset (get(size_t) or
/// get_batch(indices), and size()), e.g. any torch::data::Dataset subclass,
/// torch::data::datasets::MNIST, TensorDataset, or dataset.map(transform).
template <class D>
concept MapStyleDataset = (detail::HasGet<D> || detail::HasGetBatch<D>) && detail::HasSize<D>;

}  // namespace accel::data

#endif  // ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP
