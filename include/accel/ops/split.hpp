// SPDX-License-Identifier: Apache-2.0
/// @file Defines split_between_processes (each rank's contiguous share of a
/// vector or of a tensor's dim 0) and drop_split_padding, its inverse after a
/// gather. Pure functions of (rank, world): no communication.
#ifndef ACCEL_OPS_SPLIT_HPP
#define ACCEL_OPS_SPLIT_HPP

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>

namespace accel::ops {

/// Rank `rank`'s slice [start, start + count) of n items over `world` ranks:
/// contiguous, in rank order, sizes differing by at most one (the first
/// n % world ranks get one more; with n < world the last ranks get none).
struct SplitRange {
  int64_t start = 0;
  int64_t count = 0;
};

inline SplitRange split_range(int64_t n, int rank, int world) {
  ACCEL_CHECK(world >= 1 && rank >= 0 && rank < world, "accel: split_between_processes() got rank ",
              rank, " of world size ", world, ". Use a rank in [0, world).");
  const int64_t base = n / world, extra = n % world;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

/// The count every rank gets with apply_padding: the largest share, ceil(n / world).
inline int64_t padded_count(int64_t n, int world) { return (n + world - 1) / world; }

/// Rank `rank`'s share of `items`. With apply_padding every rank gets
/// padded_count(n, world) items: its slice, then its last item repeated (a
/// rank whose slice is empty gets the input's last item).
template <class T>
std::vector<T> split_between_processes(const std::vector<T>& items, int rank, int world,
                                       bool apply_padding = false) {
  const int64_t n = static_cast<int64_t>(items.size());
  const auto [start, count] = split_range(n, rank, world);
  std::vector<T> out(items.begin() + start, items.begin() + start + count);
  if (apply_padding && n > 0) {
    const T last = count > 0 ? out.back() : items.back();
    out.resize(static_cast<std::size_t>(padded_count(n, world)), last);
  }
  return out;
}

/// The same along dim 0 of a tensor: a view of its rows without padding.
inline torch::Tensor split_between_processes(const torch::Tensor& tensor, int rank, int world,
                                             bool apply_padding = false) {
  ACCEL_CHECK(tensor.defined() && tensor.dim() >= 1,
              "accel: split_between_processes() splits dim 0 and got a 0-d or undefined tensor. "
              "Pass a tensor of rows.");
  const int64_t n = tensor.size(0);
  const auto [start, count] = split_range(n, rank, world);
  auto slice = tensor.narrow(0, start, count);
  const int64_t want = padded_count(n, world);
  if (!apply_padding || n == 0 || count == want) return slice;
  auto last = count > 0 ? slice.narrow(0, count - 1, 1) : tensor.narrow(0, n - 1, 1);
  std::vector<int64_t> reps(static_cast<std::size_t>(tensor.dim()), 1);
  reps[0] = want - count;
  return torch::cat({slice, last.repeat(reps)});
}

/// After a padded split of `total` items over `world` ranks, every rank's
/// padded part gathered in rank order (world * padded_count rows) holds
/// padding in the middle; this keeps each rank's real rows: the original items.
inline torch::Tensor drop_split_padding(const torch::Tensor& gathered, int64_t total, int world) {
  const int64_t k = padded_count(total, world);
  ACCEL_CHECK(gathered.dim() >= 1 && gathered.size(0) == k * world,
              "accel: drop_split_padding() expects ", k * world, " rows (", world, " ranks x ", k,
              "). Pass the gather of every rank's padded split.");
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r) {
    const auto count = split_range(total, r, world).count;
    if (count > 0) parts.push_back(gathered.narrow(0, r * k, count));
  }
  return parts.empty() ? gathered.narrow(0, 0, 0) : torch::cat(parts);
}

template <class T>
std::vector<T> drop_split_padding(const std::vector<T>& gathered, int64_t total, int world) {
  const int64_t k = padded_count(total, world);
  ACCEL_CHECK(static_cast<int64_t>(gathered.size()) == k * world,
              "accel: drop_split_padding() expects ", k * world, " items (", world, " ranks x ", k,
              "). Pass the gather of every rank's padded split.");
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(total));
  for (int r = 0; r < world; ++r) {
    const auto begin = gathered.begin() + r * k;
    out.insert(out.end(), begin, begin + split_range(total, r, world).count);
  }
  return out;
}

/// What the Accelerator remembers of its latest padded split, so that
/// gather_for_metrics can drop the padding again.
struct SplitPadding {
  int64_t total = 0;
  int world = 1;
  /// Whether a gather with these per-rank row counts is of such a split.
  bool matches(const std::vector<int64_t>& rows) const {
    const int64_t k = padded_count(total, world);
    return total > 0 && static_cast<int>(rows.size()) == world &&
           std::all_of(rows.begin(), rows.end(), [k](int64_t r) { return r == k; }) &&
           total % world != 0;
  }
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_SPLIT_HPP
