// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::CountingCommunicator: another communicator's
/// collectives, with the bytes each rank hands to them counted (what
/// compression saves, for tests and benchmarks).
#ifndef ACCEL_RUNTIME_COUNTING_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_COUNTING_COMMUNICATOR_HPP

#include <cstdint>
#include <memory>
#include <string_view>

#include <torch/torch.h>

#include <accel/runtime/communicator.hpp>

namespace accel::runtime {

/// Forwards to `inner`: a reference that must outlive it, or a shared_ptr it
/// keeps (what a backend's make_communicator wraps). collectives() counts
/// every call, barriers too; bytes() sums, over every
/// collective, the bytes of this rank's contribution: the tensor of
/// all_reduce and broadcast, the input of all_gather and reduce_scatter. A
/// ring all-reduce puts about twice that on the wire, an all-gather N - 1
/// times; the ratio between two runs of the same collectives is what it shows.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner) : owned_(std::move(inner)), inner_(*owned_) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend_name() const override { return inner_.backend_name(); }
  torch::Device device() const override { return inner_.device(); }
  bool sums_natively(torch::ScalarType dtype) const override { return inner_.sums_natively(dtype); }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    count(tensor);
    return inner_.all_reduce(tensor, op);
  }
  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    count(input);
    return inner_.all_gather(output, input);
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    count(input);
    return inner_.reduce_scatter(output, input, op);
  }
  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    count(tensor);
    return inner_.broadcast(tensor, src);
  }
  void barrier() override {
    ++collectives_;
    inner_.barrier();
  }

  int64_t bytes() const { return bytes_; }
  int64_t collectives() const { return collectives_; }
  void reset() { bytes_ = collectives_ = 0; }

 private:
  void count(const torch::Tensor& t) {
    bytes_ += static_cast<int64_t>(t.nbytes());
    ++collectives_;
  }
  std::shared_ptr<Communicator> owned_;  // before inner_, which may refer to it
  Communicator& inner_;
  int64_t bytes_ = 0, collectives_ = 0;
};

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_COUNTING_COMMUNICATOR_HPP
