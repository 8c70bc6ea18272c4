// SPDX-License-Identifier: Apache-2.0
/// @file Defines the run-time options of accel::Accelerator and of its
/// save_model (numbers are options, not template parameters).
#ifndef ACCEL_OPTIONS_HPP
#define ACCEL_OPTIONS_HPP

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace accel {

/// Dynamic loss scaling (precision::Fp16); defaults are Accelerate's/PyTorch's.
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

/// How gradient buckets travel between processes (shard::Replicate, and the
/// ZeRO reductions): as they are, cast to float16 / bfloat16 for the wire
/// (PyTorch's fp16_compress_hook / bf16_compress_hook), or PowerSGD's
/// low-rank approximation (Vogels et al., 2019; PyTorch's powerSGD_hook).
/// docs/comm_hooks.md.
enum class CommHook { None, Fp16, Bf16, PowerSGD };

/// CommHook::PowerSGD, with PyTorch's names and defaults.
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;  ///< r: each m x n gradient travels as m x r and n x r
  int start_powerSGD_iter = 1000;     ///< plain all-reduce for this many optimizer steps first
  bool use_error_feedback = true;     ///< add what compression lost to the next step's gradient
  bool warm_start = true;             ///< start each step's power iteration from the last Q
};

struct AcceleratorOptions {
  int gradient_accumulation_steps = 1;
  bool split_batches = false;  ///< true: loader batch size is the global batch, split across ranks
  bool even_batches = true;    ///< pad the last batches by wrapping around so every rank gets the same count
  bool step_scheduler_with_optimizer = true;
  std::optional<std::string> project_dir{};  ///< where save_state(), trackers write by default
  std::chrono::seconds timeout{1800};      ///< collective / rendezvous timeout
  // --- accel additions (after the API.md fields, so designated initializers keep working) ---
  double bucket_cap_mb = 25.0;             ///< gradient all-reduce bucket size (Replicate, ZeRO)
  /// shard::Replicate: start each bucket's all-reduce from backward as soon as
  /// it is full (true) or all of them after backward (false). Unset: overlap
  /// on CUDA, and on CPU when each process of this machine has a core to
  /// spare (cores / local processes > 1); on fewer cores the all-reduce only
  /// takes CPU time from backward (bench/README.md).
  std::optional<bool> overlap_gradient_sync{};
  /// shard::ShardParameters: start all-gathering the next unit's parameters
  /// while the current unit computes (forward and backward), holding two
  /// units whole instead of one. Unset: as overlap_gradient_sync.
  std::optional<bool> prefetch_parameters{};
  GradScalerOptions grad_scaler{};         ///< precision::Fp16 only
  std::optional<std::string> file_store{};   ///< rendezvous through a c10d FileStore at this path instead of TCP
  bool automatic_checkpoint_naming = false;  ///< save_state() -> project_dir/checkpoints/checkpoint_N
  std::optional<int> total_limit{};          ///< keep at most this many automatic checkpoints
  // --- second round (API.md section 7) ---
  CommHook comm_hook = CommHook::None;       ///< gradient compression on the wire
  PowerSGDOptions powersgd{};                ///< CommHook::PowerSGD's settings
};

enum class Reduction { Sum, Mean };

/// Options of Accelerator::save_model.
struct SaveModelOptions {
  /// Largest shard, in Accelerate's units: "10GB"/"500MB"/"100KB" (powers of
  /// 10), "2GiB"/"64MiB"/"512KiB" (powers of 2), a lowercase final b means bits
  /// ("80Mb" = 10 MB), a plain integer is bytes. A tensor larger than this gets
  /// a shard of its own.
  std::string max_shard_size = "10GB";
  /// Each file's header records the XXH64 of its data (metadata entry
  /// accel.data_xxh64, ignored by other readers), checked when accel loads it.
  bool checksum = true;
};

}  // namespace accel

#endif  // ACCEL_OPTIONS_HPP
