// SPDX-License-Identifier: Apache-2.0
/// @file Defines make_data_loader(): the entry point that turns a map-style
/// dataset and LoaderOptions into a DataLoader.
#ifndef ACCEL_DATA_MAKE_DATA_LOADER_HPP
#define ACCEL_DATA_MAKE_DATA_LOADER_HPP

#include <accel/data/collate.hpp>
#include <accel/data/data_loader.hpp>
#include <accel/data/detail/dataset_access.hpp>
#include <accel/data/loader_options.hpp>

#include <memory>
#include <type_traits>
#include <utility>

namespace accel::data {
namespace detail {

template <class T>
struct dataset_of {
  using type = std::remove_cvref_t<T>;
  static std::shared_ptr<type> share(T&& d) { return std::make_shared<type>(std::forward<T>(d)); }
};
template <class T>
struct dataset_of<std::shared_ptr<T>> {
  using type = T;
  static std::shared_ptr<T> share(std::shared_ptr<T> d) { return d; }
};
template <class T>
struct dataset_of<std::shared_ptr<T>&> : dataset_of<std::shared_ptr<T>> {};
template <class T>
struct dataset_of<const std::shared_ptr<T>&> : dataset_of<std::shared_ptr<T>> {};

template <class T>
using dataset_t = typename dataset_of<T>::type;

template <class D>
constexpr void check_dataset() {
  static_assert(MapStyleDataset<D>,
                "accel: make_data_loader needs a map-style dataset: get(size_t) (or "
                "get_batch(indices)) and size(). Derive from torch::data::datasets::Dataset<Self>, "
                "or pass a std::shared_ptr to such a dataset.");
}

}  // namespace detail

/// A loader over `dataset` (held by value, or shared when given a
/// std::shared_ptr) whose batches are made by DefaultCollate.
template <class D>
auto make_data_loader(D&& dataset, LoaderOptions options = {}) {
  using Dataset = detail::dataset_t<D>;
  detail::check_dataset<Dataset>();
  return DataLoader<Dataset, DefaultCollate>(detail::dataset_of<D>::share(std::forward<D>(dataset)),
                                             options);
}

/// A loader whose batches are `collate(samples)`, where samples is the
/// std::vector of what dataset.get(i) returns for the batch's indices (or what
/// get_batch() returns, for a dataset without get()). The collate is called
/// from the worker threads when num_workers > 0.
template <class D, class Collate>
auto make_data_loader(D&& dataset, LoaderOptions options, Collate collate) {
  using Dataset = detail::dataset_t<D>;
  detail::check_dataset<Dataset>();
  static_assert(std::is_invocable_v<Collate&, detail::raw_batch_t<Dataset>&&>,
                "accel: the collate passed to make_data_loader cannot be called with the samples "
                "of one batch. Make it accept std::vector<Example> (Example: what the dataset's "
                "get() returns).");
  return DataLoader<Dataset, std::decay_t<Collate>>(
      detail::dataset_of<D>::share(std::forward<D>(dataset)), options, std::move(collate));
}

}  // namespace accel::data

#endif  // ACCEL_DATA_MAKE_DATA_LOADER_HPP
