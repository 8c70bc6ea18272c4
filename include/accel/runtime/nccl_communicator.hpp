// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::NcclCommunicator: the Communicator over c10d's
/// ProcessGroupNCCL, one CUDA device per process. Only in CUDA builds of
/// LibTorch (ACCEL_WITH_NCCL); backend::Nccl is its only user.
#ifndef ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP

#include <accel/config.hpp>
#if ACCEL_WITH_NCCL

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/gloo_communicator.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/store.hpp>

namespace accel::runtime {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, const ProcessEnv& env,
                   torch::Device device, std::chrono::milliseconds timeout)
      : store_(std::move(store)), rank_(env.rank), size_(env.world_size), device_(device),
        timeout_(timeout) {
    c10::cuda::set_device(device_.index());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank_, size_, opts);
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, "nccl", "rendezvous", rank_, size_, timeout_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "Nccl"; }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    check(tensor, "all_reduce");
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    return launch("all_reduce", [&] { return pg_->allreduce(ts, o); });
  }
  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    check(input, "all_gather");
    check(output, "all_gather");
    ACCEL_CHECK(output.numel() == input.numel() * size_, "accel: all_gather output has ",
                output.numel(), " elements, expected world size x ", input.numel(), ".");
    auto out = output.view(-1);
    auto in = input.reshape(-1);
    return launch("all_gather", [&] { return pg_->_allgather_base(out, in); });
  }
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    check(input, "reduce_scatter");
    check(output, "reduce_scatter");
    ACCEL_CHECK(input.numel() == output.numel() * size_, "accel: reduce_scatter input has ",
                input.numel(), " elements, expected world size x ", output.numel(), ".");
    auto out = output.view(-1);
    auto in = input.reshape(-1);
    c10d::ReduceScatterOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    return launch("reduce_scatter", [&] { return pg_->_reduce_scatter_base(out, in, o); });
  }
  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    check(tensor, "broadcast");
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    o.timeout = timeout_;
    return launch("broadcast", [&] { return pg_->broadcast(ts, o); });
  }
  void barrier() override {
    // A one-element all-reduce on this rank's device: NCCL's own barrier
    // guesses the device from the rank, which is wrong with several nodes.
    auto t = torch::zeros({1}, torch::TensorOptions().device(device_));
    all_reduce(t)->wait();
    torch::cuda::synchronize(device_.index());
  }

 private:
  void check(const torch::Tensor& t, const char* op) const {
    ACCEL_CHECK(t.defined() && t.is_contiguous() && t.device() == device_, "accel: nccl ", op,
                " needs a contiguous tensor on ", device_, ". Move it with .to(accelerator.device()).");
  }
  template <class Start>
  std::shared_ptr<Work> launch(const char* op, Start&& start) {
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = start();
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, "nccl", op, rank_, size_, timeout_);
    }
    return std::make_shared<detail::C10dWork>(std::move(w), "nccl", op, rank_, size_, timeout_);
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  torch::Device device_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
};

/// Rendezvous (TCPStore on MASTER_ADDR:MASTER_PORT, or a FileStore) and an
/// NCCL process group over all ranks of `env`, on `device`.
inline std::shared_ptr<Communicator> make_nccl_communicator(const ProcessEnv& env,
                                                            torch::Device device,
                                                            std::chrono::milliseconds timeout,
                                                            std::optional<std::string> file_store) {
  auto store = make_store(env, StoreOptions{timeout, std::move(file_store)});
  return std::make_shared<NcclCommunicator>(std::move(store), env, device, timeout);
}

}  // namespace accel::runtime

#endif  // ACCEL_WITH_NCCL
#endif  // ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP
