// SPDX-License-Identifier: Apache-2.0
/// @file Defines find_executable_batch_size: call fn(batch_size), lowering the
/// size after an out-of-memory error, with every rank on the same size at each
/// attempt.
#ifndef ACCEL_OPS_BATCH_SIZE_HPP
#define ACCEL_OPS_BATCH_SIZE_HPP

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <accel/config.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>

#if ACCEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace accel {

namespace ops {

/// Whether `e` is an allocation failure that a smaller batch may avoid:
/// c10::OutOfMemoryError (CUDA), std::bad_alloc, or the c10::Error messages
/// of LibTorch's CPU allocator and of CUDA/cuDNN running out of memory.
inline bool is_out_of_memory(std::exception_ptr e) {
  try {
    std::rethrow_exception(std::move(e));
  } catch (const c10::OutOfMemoryError&) {
    return true;
  } catch (const std::bad_alloc&) {
    return true;
  } catch (const c10::Error& err) {
    const std::string_view what = err.what();
    for (std::string_view m : {"DefaultCPUAllocator: can't allocate memory",
                               "DefaultCPUAllocator: not enough memory", "CUDA out of memory",
                               "CUDNN_STATUS_NOT_SUPPORTED"})
      if (what.find(m) != std::string_view::npos) return true;
    return false;
  } catch (...) {
    return false;
  }
}

/// find_executable_batch_size over `comm`: every rank calls fn(size), then
/// one all-reduce (max) of the outcome (0 ran, 1 out of memory, 2 another
/// error) decides for all: return fn's result, retry at int(size * 0.9), or
/// rethrow (the ranks whose fn did not fail throw an accel::Error saying so).
template <class F>
auto find_executable_batch_size(runtime::Communicator& comm, F&& fn, int64_t starting_batch_size) {
  using R = std::invoke_result_t<F&, int64_t>;
  ACCEL_CHECK(starting_batch_size >= 1, "accel: find_executable_batch_size() needs a starting "
              "batch size of at least 1 (got ", starting_batch_size, "). Pass the largest size to try.");
  for (int64_t size = starting_batch_size;; size = static_cast<int64_t>(static_cast<double>(size) * 0.9)) {
    ACCEL_CHECK(size > 0, "accel: find_executable_batch_size() found no batch size that fits: "
                "every size from ", starting_batch_size, " down to 1 ran out of memory. "
                "Reduce the model or the sequence length, or use a larger device.");
    std::exception_ptr error;
    std::optional<std::conditional_t<std::is_void_v<R>, bool, std::remove_cvref_t<R>>> result;
    try {
      if constexpr (std::is_void_v<R>) {
        fn(size);
        result.emplace(true);
      } else {
        result.emplace(fn(size));
      }
    } catch (...) {
      error = std::current_exception();
    }
    const int outcome = !error ? 0 : is_out_of_memory(error) ? 1 : 2;
    int agreed = outcome;
    if (comm.size() > 1) {
      auto flag = torch::tensor({outcome}, torch::TensorOptions().dtype(torch::kInt).device(comm.device()));
      comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
      agreed = flag.cpu().item<int>();
    }
    if (agreed == 0) {
      if constexpr (std::is_void_v<R>)
        return;
      else
        return std::move(*result);
    }
    if (agreed == 2) {
      if (outcome == 2) std::rethrow_exception(error);
      throw Error(accel::detail::concat(
          "accel: find_executable_batch_size() stopped at batch size ", size,
          ": fn failed with an error other than out of memory on another process ",
          accel::detail::kFailedElsewhere, ". Fix that error."));
    }
    // Out of memory somewhere: free what this process holds before the retry.
    error = nullptr;
    result.reset();
#if ACCEL_WITH_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }
}

}  // namespace ops

/// Calls fn(batch_size) starting at starting_batch_size; after an
/// out-of-memory error (ops::is_out_of_memory) retries at int(size * 0.9),
/// until fn returns (its result is returned) or the size reaches 0 (an
/// accel::Error). Other errors propagate at once. This overload is for a
/// single process; in a multi-process job use Accelerator::
/// find_executable_batch_size, which keeps every rank on the same size.
template <class F>
auto find_executable_batch_size(F&& fn, int64_t starting_batch_size) {
  runtime::LocalCommunicator local;
  return ops::find_executable_batch_size(local, std::forward<F>(fn), starting_batch_size);
}

}  // namespace accel

#endif  // ACCEL_OPS_BATCH_SIZE_HPP
