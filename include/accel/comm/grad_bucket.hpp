// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::GradBucket, what a communication hook is given:
/// one bucket of gradients of one optimizer step.
#ifndef ACCEL_COMM_GRAD_BUCKET_HPP
#define ACCEL_COMM_GRAD_BUCKET_HPP

#include <cstddef>
#include <vector>

#include <torch/torch.h>

namespace accel::comm {

/// One bucket of this rank's gradients. Buckets are numbered in the order
/// they are reduced (the same on every rank, and the same every step), so a
/// hook may keep state per bucket index.
struct GradBucket {
  std::size_t index = 0;
  /// Flat, contiguous: this rank's gradients (and, under ZeRO, zero padding
  /// at the end). The hook leaves the mean over ranks here.
  torch::Tensor buffer;
  /// One per parameter of the bucket: a view of `buffer` with the
  /// parameter's shape (what PowerSGD compresses).
  std::vector<torch::Tensor> gradients;
  /// The last bucket of this step.
  bool is_last = false;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_GRAD_BUCKET_HPP
