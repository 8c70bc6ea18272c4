// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::load_latest_state, the machinery of
/// Accelerator::load_latest_state(): resume from the newest automatic
/// checkpoint that is complete, or start fresh when there is none. What an
/// elastic restart (LaunchOptions::max_restarts) calls first.
///
/// Which checkpoint: the directories project_dir/checkpoints/checkpoint_<N>,
/// newest first, as the main process lists them. One without accel_state.json
/// (save_state writes it last) is not a checkpoint; <dir>.accel-tmp, what a
/// save killed half-way leaves, is never listed. A checkpoint that any process
/// cannot read (a file missing, truncated or not matching its checksum, or
/// not fitting this run) is skipped with a warning and the next older one is
/// tried. Every process reads before anything changes, so nothing is loaded
/// from a checkpoint that fails anywhere.
#ifndef ACCEL_CHECKPOINT_LATEST_STATE_HPP
#define ACCEL_CHECKPOINT_LATEST_STATE_HPP

#include <accel/checkpoint/detail/state_layout.hpp>
#include <accel/checkpoint/detail/state_reader.hpp>
#include <accel/checkpoint/save_state.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace accel::ckpt {

namespace detail {

/// The main process's numbers, the same on every process (a file system whose
/// listing differs between processes must not make them read different
/// checkpoints and disagree in the middle of a collective).
inline std::vector<int64_t> share_numbers(StateRegistry& reg, std::vector<int64_t> numbers) {
  auto& comm = *reg.state->comm;
  if (comm.size() == 1) return numbers;
  const auto opts = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto count = torch::full({1}, static_cast<int64_t>(numbers.size()), opts);
  comm.broadcast(count, 0)->wait();
  const auto n = count.to(torch::kCPU).item<int64_t>();
  auto values = comm.rank() == 0 ? torch::tensor(numbers, opts) : torch::zeros({n}, opts);
  if (n > 0) comm.broadcast(values, 0)->wait();
  values = values.to(torch::kCPU);
  return std::vector<int64_t>(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + n);
}

}  // namespace detail

/// Loads the newest complete checkpoint under project_dir/checkpoints (see
/// the file comment) and returns its directory; without one, changes nothing
/// and returns std::nullopt. Either way the next automatic checkpoint number
/// is past every checkpoint_<N> there, complete or not. When checkpoints exist
/// but none loads, the newest one's error is thrown on every process. Every
/// process must call it.
inline std::optional<std::filesystem::path> load_latest_state(StateRegistry& reg,
                                                              const AcceleratorOptions& options) {
  using namespace detail;
  const fs::path base = checkpoints_base(options, "load_latest_state");
  const bool main = reg.state->comm->rank() == 0;
  // [highest N of any checkpoint_<N>, then the complete-looking ones, newest first]
  std::vector<int64_t> numbers{-1};
  if (main) {
    const auto all = list_checkpoints(base);
    std::error_code ec;
    for (auto it = all.rbegin(); it != all.rend(); ++it)
      if (fs::is_regular_file(it->second / kStateFile, ec)) numbers.push_back(it->first);
    if (!all.empty()) numbers[0] = all.back().first;
  }
  numbers = share_numbers(reg, std::move(numbers));
  const auto after_highest = [&] {
    reg.checkpoint_iteration = std::max(reg.checkpoint_iteration, numbers.front() + 1);
  };

  std::exception_ptr newest_error;
  for (std::size_t i = 1; i < numbers.size(); ++i) {
    const fs::path dir = base / checkpoint_dir_name(numbers[i]);
    std::exception_ptr err;
    ReadState s;
    const SkippedModels skipped(reg);
    try {
      reg.models_skipped = reg.load_pre_hooks.run(reg.models, dir, "load_state");
      s = read_state(reg, dir);
    } catch (...) {
      err = std::current_exception();
    }
    const int failed = failed_rank(*reg.state->comm, err == nullptr);
    if (failed < 0) {
      apply_state(reg, s);
      after_highest();
      return dir;
    }
    if (i == 1) newest_error = err;
    if (failed == reg.state->comm->rank()) {
      std::string why = "unknown error";
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      std::cerr << "accel: warning: load_latest_state() skips '" << dir.string()
                << "', which process " << failed << " cannot load: " << why
                << (i + 1 < numbers.size() ? " Trying the next older checkpoint."
                                           : " No older checkpoint is left.")
                << std::endl;
    }
  }
  if (numbers.size() > 1)
    agree(*reg.state->comm, newest_error, "load_latest_state (reading the newest checkpoint)",
          "no checkpoint under it loads; nothing was loaded on this process");
  after_highest();
  return std::nullopt;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_LATEST_STATE_HPP
