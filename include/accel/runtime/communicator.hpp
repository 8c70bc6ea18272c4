// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::runtime::Communicator, the one collective interface every
/// backend implements, and LocalCommunicator (world size 1).
#ifndef ACCEL_RUNTIME_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_COMMUNICATOR_HPP

#include <chrono>
#include <memory>
#include <string_view>

#include <torch/torch.h>

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

/// Collectives across the processes of one job. Tensors are contiguous and on
/// the communicator's device; results are written in place (all_reduce,
/// broadcast) or into the given output (all_gather, reduce_scatter).
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend_name() const = 0;

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

/// The communicator of a single process: every collective is the identity.
class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend_name() const override { return "local"; }
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
