// SPDX-License-Identifier: Apache-2.0
/// @file Defines the plain option structs of accel's data loader: LoaderOptions,
/// ShardSpec and LoaderCheckpoint.
#ifndef ACCEL_DATA_LOADER_OPTIONS_HPP
#define ACCEL_DATA_LOADER_OPTIONS_HPP

#include <chrono>
#include <cstdint>

namespace accel::data {

/// How make_data_loader() batches a dataset. Designated-initializer friendly:
/// `LoaderOptions{.batch_size = 64, .shuffle = true, .seed = 42}`.
struct LoaderOptions {
  int64_t batch_size = 1;
  /// Shuffle with a private generator seeded with `seed + epoch`: the same
  /// seed and epoch give the same order on every rank and in every run, and
  /// the global LibTorch RNG is neither read nor advanced.
  bool shuffle = false;
  /// Drop the last incomplete batch (sharded: the last incomplete round).
  bool drop_last = false;
  /// 0: batches are produced on the consuming thread. N > 0: N background
  /// threads prefetch batches; the batches and their order are the same.
  int num_workers = 0;
  uint64_t seed = 0;
  /// With workers: at most prefetch_factor * num_workers batches are ready
  /// or being produced ahead of the consumer.
  int prefetch_factor = 2;
  /// With workers: the longest the consumer waits for one batch before it
  /// raises accel::Error (a dataset that hangs must not hang training).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
};

/// Which share of every global batch this loader yields: Accelerate's
/// BatchSamplerShard(num_processes = world_size, process_index = rank, ...).
struct ShardSpec {
  int rank = 0;
  int world_size = 1;
  /// false: whole batches go to the ranks in turn (global batch = batch_size
  /// * world_size). true: every batch is sliced (global batch = batch_size;
  /// batch_size must be a multiple of world_size).
  bool split_batches = false;
  /// true: the tail wraps around to the start of the epoch so that every
  /// rank gets the same number of full batches (with duplicates).
  bool even_batches = true;
};

/// Where a loader stands: enough to continue an interrupted epoch exactly.
struct LoaderCheckpoint {
  int64_t epoch = 0;
  int64_t batches_yielded = 0;  // per-rank batches of `epoch` already handed out
};

}  // namespace accel::data

#endif  // ACCEL_DATA_LOADER_OPTIONS_HPP
