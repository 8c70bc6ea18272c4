// SPDX-License-Identifier: Apache-2.0
/// @file Defines TensorDataset: in-memory tensors indexed along dimension 0,
/// read a whole batch at a time (one index_select per tensor instead of one
/// get() per sample and a stack).
#ifndef ACCEL_DATA_TENSOR_DATASET_HPP
#define ACCEL_DATA_TENSOR_DATASET_HPP

#include <accel/errors.hpp>

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace accel::data {

/// Samples are rows of `data` and `target` (same length along dimension 0).
/// make_data_loader(TensorDataset(x, y), ...) yields torch::data::Example<>
/// batches identical to a per-sample dataset's stacked ones, built with one
/// index_select per tensor. Batches are copies: changing one in place does not
/// change the dataset. Safe to read from several worker threads.
class TensorDataset {
 public:
  TensorDataset(torch::Tensor data, torch::Tensor target)
      : data_(std::move(data)), target_(std::move(target)) {
    ACCEL_CHECK(data_.defined() && target_.defined() && data_.dim() >= 1 && target_.dim() >= 1,
                "accel: TensorDataset needs two defined tensors with at least one dimension. "
                "Pass the samples and their targets stacked along dimension 0.");
    ACCEL_CHECK(data_.size(0) == target_.size(0), "accel: TensorDataset got ", data_.size(0),
                " samples but ", target_.size(0),
                " targets. Pass tensors of the same length along dimension 0.");
  }

  torch::data::Example<> get_batch(const std::vector<size_t>& indices) const {
    const torch::Tensor idx =
        torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()), torch::kLong)
            .to(data_.device());
    return {data_.index_select(0, idx), target_.index_select(0, idx.to(target_.device()))};
  }

  std::optional<size_t> size() const { return static_cast<size_t>(data_.size(0)); }

  const torch::Tensor& data() const { return data_; }
  const torch::Tensor& target() const { return target_; }

 private:
  torch::Tensor data_, target_;
};

}  // namespace accel::data

#endif  // ACCEL_DATA_TENSOR_DATASET_HPP
