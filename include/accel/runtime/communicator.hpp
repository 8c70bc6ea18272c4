// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::runtime::Communicator, the one collective interface every
/// backend implements, and LocalCommunicator (world size 1).
#ifndef ACCEL_RUNTIME_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_COMMUNICATOR_HPP

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include <torch/torch.h>

#include <accel/errors.hpp>

namespace accel::runtime {

enum class ReduceOp { Sum, Max, Min };

/// Handle of an asynchronous collective. wait() blocks until the result is in
/// the output tensor, or throws accel::TimeoutError / accel::Error.
class Work {
 public:
  virtual ~Work() = default;
  virtual void wait() = 0;
  virtual bool is_completed() = 0;
};

/// A Work that is already done (world size 1, or a blocking implementation).
class CompletedWork final : public Work {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

/// A Work followed by what must happen after it (decompress, launch the next
/// collective of a chain): wait() waits for `first`, then runs `then` once.
/// The chain is driven by wait(): every rank waits for its works in the same
/// order, so collectives started by `then` are issued in the same order too.
class ThenWork final : public Work {
 public:
  ThenWork(std::shared_ptr<Work> first, std::function<void()> then)
      : first_(std::move(first)), then_(std::move(then)) {}
  void wait() override {
    if (first_) first_->wait();
    if (then_) {
      auto f = std::move(then_);
      then_ = nullptr;
      f();
    }
  }
  bool is_completed() override { return !then_ && (!first_ || first_->is_completed()); }

 private:
  std::shared_ptr<Work> first_;
  std::function<void()> then_;
};

/// Collectives across the processes of one job. Tensors are contiguous and on
/// the communicator's device; results are written in place (all_reduce,
/// broadcast) or into the given output (all_gather, reduce_scatter).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// The backend policy's name: "Gloo", "Mpi", "Nccl" (backend::X::name), or "Local".
  virtual std::string_view backend_name() const = 0;
  /// Where this communicator's collectives take tensors without a copy: the
  /// CPU for Gloo, MPI and Local, the process's CUDA device for NCCL. Helper
  /// tensors (sizes, flags) that feed a collective are made here.
  virtual torch::Device device() const = 0;
  /// Whether all_reduce and reduce_scatter sum tensors of `dtype` as they
  /// are: false where the backend widens them first (MPI's float16 and
  /// bfloat16 go as float32; Gloo has no bfloat16 sum), so compressing to
  /// that dtype would save nothing on the wire (communication hooks then
  /// all-gather the 16-bit values and sum locally).
  virtual bool sums_natively(torch::ScalarType /*dtype*/) const { return true; }

  /// In place: every rank ends with the reduction of everyone's `tensor`.
  virtual std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) = 0;
  /// `output` has size() * input.numel() elements; rank r's input lands at
  /// [r * input.numel(), (r + 1) * input.numel()) of the flattened output.
  virtual std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) = 0;
  /// `input` has size() * output.numel() elements; rank r receives the
  /// reduction of everyone's chunk r.
  virtual std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                               ReduceOp op = ReduceOp::Sum) = 0;
  /// In place: every rank ends with rank `src`'s `tensor`.
  virtual std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) = 0;
  /// Blocks until every rank has reached it (or the timeout passed).
  virtual void barrier() = 0;
};

namespace detail {

/// Every backend's argument checks, one message each: a defined contiguous
/// tensor, and the size rule of all_gather / reduce_scatter.
inline void check_dense(std::string_view backend, const char* op, const torch::Tensor& t) {
  ACCEL_CHECK(t.defined() && t.is_contiguous(), "accel: ", backend, " ", op,
              " needs a defined, contiguous tensor. Call .contiguous() first.");
}
/// all_gather: `whole` is the output, `part` the input; reduce_scatter: the reverse.
inline void check_world_multiple(const char* op, const torch::Tensor& whole,
                                 const torch::Tensor& part, int world_size) {
  const bool gather = std::string_view(op) == "all_gather";
  const char* whole_name = gather ? "output" : "input";
  ACCEL_CHECK(whole.scalar_type() == part.scalar_type(), "accel: ", op, " output is ",
              (gather ? whole : part).scalar_type(), " but the input is ",
              (gather ? part : whole).scalar_type(), ". Give both the same dtype.");
  ACCEL_CHECK(whole.numel() == part.numel() * world_size, "accel: ", op, " ", whole_name, " has ",
              whole.numel(), " elements, expected world size ", world_size, " x ", part.numel(),
              ". Give an ", whole_name, " of size() * ", gather ? "input" : "output",
              ".numel() elements.");
}

}  // namespace detail

/// The communicator of a single process: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend_name() const override { return "Local"; }
  torch::Device device() const override { return torch::kCPU; }
  std::shared_ptr<Work> all_reduce(torch::Tensor&, ReduceOp) override { return done(); }
  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    output.view(-1).copy_(input.reshape(-1));
    return done();
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp) override {
    output.view(-1).copy_(input.reshape(-1));
    return done();
  }
  std::shared_ptr<Work> broadcast(torch::Tensor&, int) override { return done(); }
  void barrier() override {}

 private:
  static std::shared_ptr<Work> done() { return std::make_shared<CompletedWork>(); }
};

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_COMMUNICATOR_HPP
