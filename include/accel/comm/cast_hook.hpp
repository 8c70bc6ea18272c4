// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::CastHook, CommHook::Fp16 and CommHook::Bf16:
/// gradients travel as 16-bit floats, half the bytes of float32.
#ifndef ACCEL_COMM_CAST_HOOK_HPP
#define ACCEL_COMM_CAST_HOOK_HPP

#include <memory>
#include <utility>

#include <torch/torch.h>

#include <accel/comm/hook.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::comm {

/// As PyTorch's fp16_compress_hook / bf16_compress_hook: the bucket is cast
/// to `wire` and divided by the world size, summed across ranks in `wire`,
/// and cast back. Where the backend cannot sum `wire` as it is (Gloo has no
/// bfloat16 sum; MPI has no 16-bit float types and would widen to float32,
/// saving nothing), the 16-bit values are all-gathered instead (moved as raw
/// 16-bit words) and summed here in float32, in rank order, so every rank
/// gets the same result. All-gather sends (N - 1) / 2 times a ring
/// all-reduce's bytes: equal for 2 processes, more beyond.
class CastHook final : public Hook {
 public:
  explicit CastHook(torch::ScalarType wire) : wire_(wire) {}

  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    auto compressed = bucket.buffer.to(wire_).div_(comm.size());
    auto buffer = bucket.buffer;
    if (comm.sums_natively(wire_)) {
      auto work = comm.all_reduce(compressed, runtime::ReduceOp::Sum);
      return std::make_shared<runtime::ThenWork>(std::move(work), [buffer, compressed]() mutable {
        torch::NoGradGuard no_grad;
        buffer.copy_(compressed);
      });
    }
    return gather_and_sum(std::move(compressed), std::move(buffer), comm);
  }

  std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                runtime::Communicator& comm) override {
    if (!comm.sums_natively(wire_)) return Hook::reduce_scatter(std::move(output), bucket, comm);
    auto compressed = bucket.buffer.to(wire_).div_(comm.size());
    auto received = torch::empty({output.numel()}, compressed.options());
    auto work = comm.reduce_scatter(received, compressed, runtime::ReduceOp::Sum);
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [output = std::move(output), received, compressed]() mutable {
          torch::NoGradGuard no_grad;
          output.view(-1).copy_(received);
        });
  }

 private:
  // Every rank's 16-bit values, moved as float16 words (Gloo gathers
  // float16 but not bfloat16; the bits are the same size), summed in float32.
  static std::shared_ptr<runtime::Work> gather_and_sum(torch::Tensor compressed, torch::Tensor buffer,
                                                       runtime::Communicator& comm) {
    const auto dtype = compressed.scalar_type();
    auto words = compressed.view(torch::kHalf);
    auto gathered = torch::empty({comm.size() * words.numel()}, words.options());
    auto work = comm.all_gather(gathered, words);
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [buffer, gathered, words, dtype, world = comm.size()]() mutable {
          torch::NoGradGuard no_grad;
          auto values = gathered.view(dtype).view({world, -1}).to(torch::kFloat);
          buffer.copy_(values.sum(0));
        });
  }

  torch::ScalarType wire_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_CAST_HOOK_HPP
