// SPDX-License-Identifier: Apache-2.0
/// @file Defines the index side of the data loader: the epoch order (seeded
/// shuffle), plain batching, and Accelerate's BatchSamplerShard assignment of
/// batches to ranks, reproduced exactly (including its wrap-around padding).
#ifndef ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP
#define ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP

#include <accel/data/loader_options.hpp>
#include <accel/errors.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace accel::data {

/// Dataset indices of one batch.
using IndexBatch = std::vector<size_t>;

/// The order in which an epoch visits the dataset: 0..n-1, or, shuffled,
/// torch.randperm(n, generator) with a fresh CPU generator seeded with
/// `seed + epoch` (exactly what Accelerate's SeedableRandomSampler draws, so
/// the same seed gives the same order as PyTorch in Python).
inline std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(n);
  if (!shuffle || n == 0) {
    std::iota(order.begin(), order.end(), size_t{0});
    return order;
  }
  auto gen = at::detail::createCPUGenerator(seed + static_cast<uint64_t>(epoch));
  const torch::Tensor perm =
      torch::randperm(static_cast<int64_t>(n), gen, torch::TensorOptions().dtype(torch::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(p[i]);
  return order;
}

/// PyTorch's BatchSampler: consecutive slices of `order`; the short tail is
/// kept unless drop_last.
inline std::vector<IndexBatch> make_batches(const std::vector<size_t>& order, int64_t batch_size,
                                            bool drop_last) {
  ACCEL_CHECK(batch_size > 0, "accel: batch_size must be positive (got ", batch_size,
              "). Pass LoaderOptions{.batch_size = N} with N >= 1.");
  const size_t bs = static_cast<size_t>(batch_size);
  std::vector<IndexBatch> batches;
  batches.reserve(order.size() / bs + 1);
  for (size_t start = 0; start < order.size(); start += bs) {
    const size_t stop = std::min(order.size(), start + bs);
    if (drop_last && stop - start < bs) break;
    batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(start),
                         order.begin() + static_cast<std::ptrdiff_t>(stop));
  }
  return batches;
}

/// Throws accel::Error when `spec` cannot shard batches of `batch_size`.
inline void check_shard_spec(const ShardSpec& spec, int64_t batch_size) {
  ACCEL_CHECK(spec.world_size >= 1, "accel: ShardSpec::world_size must be at least 1 (got ",
              spec.world_size, "). Pass the number of processes.");
  ACCEL_CHECK(spec.rank >= 0 && spec.rank < spec.world_size, "accel: ShardSpec::rank ", spec.rank,
              " is outside [0, ", spec.world_size, "). Pass this process's index.");
  ACCEL_CHECK(!spec.split_batches || batch_size % spec.world_size == 0,
              "accel: with split_batches the batch size (", batch_size,
              ") must be a multiple of the number of processes (", spec.world_size,
              "). Use a batch size that divides evenly, or split_batches = false.");
}

namespace detail {

inline IndexBatch slice(const IndexBatch& b, size_t from, size_t to) {
  to = std::min(to, b.size());
  if (from >= to) return {};
  return IndexBatch(b.begin() + static_cast<std::ptrdiff_t>(from),
                    b.begin() + static_cast<std::ptrdiff_t>(to));
}

// BatchSamplerShard._iter_with_split: every full batch is sliced; the short
// tail is completed from the first batch (even) or sliced as it is.
inline std::vector<IndexBatch> shard_split(const std::vector<IndexBatch>& batches, size_t bs,
                                           bool drop_last, size_t P, size_t r, bool even) {
  std::vector<IndexBatch> out;
  const size_t bl = bs / P;
  for (const auto& b : batches)
    if (b.size() == bs) out.push_back(slice(b, bl * r, bl * (r + 1)));
  const IndexBatch& last = batches.back();
  if (drop_last || last.size() >= bs) return out;
  if (!even) {
    if (last.size() > bl * r) out.push_back(slice(last, bl * r, bl * (r + 1)));
    return out;
  }
  IndexBatch initial = batches.front();
  while (initial.size() < bs) initial.insert(initial.end(), initial.begin(), initial.end());
  IndexBatch padded = last;
  padded.insert(padded.end(), initial.begin(), initial.end());
  out.push_back(slice(padded, bl * r, bl * (r + 1)));
  return out;
}

// BatchSamplerShard._iter_with_no_split: batch i goes to rank i % P; a round
// is yielded only once all P batches of it are full; the last round is then
// completed with indices from the first P batches (even) or left uneven.
inline std::vector<IndexBatch> shard_round_robin(const std::vector<IndexBatch>& batches, size_t bs,
                                                 bool drop_last, size_t P, size_t r, bool even) {
  std::vector<IndexBatch> out;
  IndexBatch initial, to_yield;
  for (size_t idx = 0; idx < batches.size(); ++idx) {
    const IndexBatch& batch = batches[idx];
    if (!drop_last && idx < P) initial.insert(initial.end(), batch.begin(), batch.end());
    if (idx % P == r) to_yield = batch;
    if (idx % P == P - 1 && batch.size() == bs) {
      out.push_back(std::move(to_yield));
      to_yield.clear();
    }
  }
  if (drop_last || initial.empty()) return out;
  if (!even) {
    if (!to_yield.empty()) out.push_back(std::move(to_yield));
    return out;
  }
  if (to_yield.size() == bs) out.push_back(std::move(to_yield));
  while (initial.size() < P * bs) initial.insert(initial.end(), initial.begin(), initial.end());
  IndexBatch batch = batches.back();
  size_t idx = batches.size() - 1;
  if (batch.size() == bs) {
    batch.clear();
    ++idx;
  }
  size_t cycle = 0;
  while (idx % P != 0 || !batch.empty()) {
    const size_t end = cycle + bs - batch.size();
    const IndexBatch fill = slice(initial, cycle, end);
    batch.insert(batch.end(), fill.begin(), fill.end());
    if (idx % P == r) out.push_back(batch);
    cycle = end;
    batch.clear();
    ++idx;
  }
  return out;
}

}  // namespace detail

/// The batches rank `spec.rank` yields, given all batches of the epoch
/// (made by make_batches with the same batch_size and drop_last). Equals
/// Accelerate's BatchSamplerShard; with world_size 1 the batches are returned
/// unchanged (Accelerate does not shard a single process either).
inline std::vector<IndexBatch> shard_batches(const std::vector<IndexBatch>& batches,
                                             int64_t batch_size, bool drop_last,
                                             const ShardSpec& spec) {
  check_shard_spec(spec, batch_size);
  if (spec.world_size == 1 || batches.empty()) return batches;
  const auto bs = static_cast<size_t>(batch_size);
  const auto P = static_cast<size_t>(spec.world_size);
  const auto r = static_cast<size_t>(spec.rank);
  return spec.split_batches ? detail::shard_split(batches, bs, drop_last, P, r, spec.even_batches)
                            : detail::shard_round_robin(batches, bs, drop_last, P, r,
                                                        spec.even_batches);
}

/// How many batches shard_batches() yields on this rank, without building
/// them. Unlike Accelerate's len() it is exact in every mode (Accelerate
/// over-reports with split_batches and even_batches = false).
inline int64_t sharded_num_batches(int64_t dataset_size, int64_t batch_size, bool drop_last,
                                   const ShardSpec& spec) {
  check_shard_spec(spec, batch_size);
  const int64_t full = dataset_size / batch_size;
  const int64_t tail = drop_last ? 0 : dataset_size % batch_size;
  const int64_t B = full + (tail > 0 ? 1 : 0);  // batches of the unsharded epoch
  const int64_t P = spec.world_size, r = spec.rank;
  if (P == 1) return B;
  if (spec.split_batches) {
    if (spec.even_batches) return B;
    return full + (tail > (batch_size / P) * r ? 1 : 0);
  }
  if (drop_last) return full / P;
  if (spec.even_batches) return (B + P - 1) / P;
  return B / P + (r < B % P ? 1 : 0);
}

}  // namespace accel::data

#endif  // ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP
