// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::C10dCommunicator: the one Communicator over a
/// PyTorch c10d process group, shared by Gloo and NCCL (error translation,
/// timeouts, work handles, host staging, the collectives both run alike).
#ifndef ACCEL_RUNTIME_C10D_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_C10D_COMMUNICATOR_HPP

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/torch.h>

#include <accel/detail/torch_version.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/detail/slow_collective.hpp>
#include <accel/runtime/detail/wait_reports.hpp>
#include <accel/runtime/heartbeat.hpp>
#include <accel/runtime/process_env.hpp>

namespace accel::runtime {

namespace detail {

// What ProcessGroupGloo and ProcessGroupNCCL derive from: c10d::ProcessGroup
// in LibTorch 1.13, c10d::Backend from 2.0 on. Both declare the collectives
// used here as virtual members.
#if ACCEL_TORCH_AT_LEAST(2, 0)
using C10dGroup = c10d::Backend;
#else
using C10dGroup = c10d::ProcessGroup;
#endif

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Sum: break;
  }
  return c10d::ReduceOp::SUM;
}

/// Names the op and the rank, keeps c10d's first line, says what to do.
[[noreturn]] inline void rethrow_collective_error(const std::exception& e, std::string_view backend,
                                                  std::string_view op, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  std::string msg = e.what();
  msg = msg.substr(0, msg.find('\n'));
  const std::string head = "accel: " + std::string(backend) + " " + std::string(op) +
                           " failed on rank " + std::to_string(rank) + " of " +
                           std::to_string(size) + ": ";
  if (msg.find("imed out") != std::string::npos || msg.find("timeout") != std::string::npos)
    throw TimeoutError(head + msg + " (timeout " + std::to_string(timeout.count()) +
                       " ms). Another rank did not reach the same collective: check that every "
                       "rank calls the collectives in the same order, or raise the timeout.");
  throw Error(accel::detail::concat(head, msg, ". ", accel::detail::kPeerVanished,
                                    " or crashed: look at the other ranks' errors."));
}

/// A c10d work plus what must happen after it (copy out of a temporary or a
/// host staging buffer); wait() honours the timeout and names the backend and
/// op. With a watch (Gloo), a wait longer than 5 s says who is missing.
class C10dWork final : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string_view backend, std::string op, int rank,
           int size, std::chrono::milliseconds timeout, std::function<void()> then = {},
           std::shared_ptr<SlowCollectiveWatch> watch = {})
      : work_(std::move(work)), backend_(backend), op_(std::move(op)), rank_(rank), size_(size),
        timeout_(timeout), then_(std::move(then)), watch_(std::move(watch)),
        seq_(watch_ ? watch_->next_seq() : 0) {}

  void wait() override {
    if (done_) return;
    try {
      if (watch_) wait_watched();
      else work_->wait(timeout_);
    } catch (const std::exception& e) {
      rethrow_collective_error(e, backend_, op_, rank_, size_, timeout_);
    }
    if (then_) then_();
    done_ = true;
    heartbeat();  // progress, for the launcher's hang detection
  }

  bool is_completed() override { return done_ || work_->isCompleted(); }

 private:
  using Clock = SlowCollectiveWatch::Clock;

  /// Waits in slices of 5 s (c10d's timed wait throws "Operation timed out!"
  /// at the end of a slice and leaves the work running); between slices the
  /// watch reports. The backend's own timeout still ends a collective that
  /// never completes; past it (and a margin), so does this loop.
  void wait_watched() {
    const auto start = Clock::now();
    WaitReports reports(start, std::chrono::seconds(10));
    bool published = false;
    for (;;) {
      try {
        if (work_->wait(std::chrono::milliseconds(5000)) || work_->isCompleted()) return;
      } catch (const c10::Error& e) {
        if (std::string(e.what()).find("Operation timed out") == std::string::npos || work_->isCompleted())
          throw;
      }
      const auto waited = Clock::now() - start;
      if (waited > timeout_ + std::chrono::seconds(10))
        throw std::runtime_error("Timed out: the collective did not complete");
      watch_->waiting(op_, seq_, waited, published, reports);
    }
  }

  c10::intrusive_ptr<c10d::Work> work_;
  std::string_view backend_;
  std::string op_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::function<void()> then_;
  std::shared_ptr<SlowCollectiveWatch> watch_;
  std::uint64_t seq_;
  bool done_ = false;
};

}  // namespace detail

/// How a C10dCommunicator treats a tensor that is not on its device().
enum class Staging {
  Refuse,        ///< an error naming the device (NCCL: tensors must be on the GPU)
  ThroughHost,   ///< copied to device() before, and back after the collective (Gloo)
  Always,        ///< every tensor goes through a copy, native ones too (tests of the path)
};

/// The Communicator over a c10d process group. Derived classes create the
/// group (make_group) and may replace the collectives their backend runs
/// differently (LibTorch 1.13's Gloo has no flat all_gather or reduce_scatter).
class C10dCommunicator : public Communicator {
 public:
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return name_; }
  torch::Device device() const override { return device_; }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    auto io = stage(tensor, "all_reduce", true);
    std::vector<at::Tensor> ts{io};
    c10d::AllreduceOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    return launch("all_reduce", [&] { return group_->allreduce(ts, o); }, unstage(tensor, io));
  }

  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    runtime::detail::check_world_multiple("all_gather", output, input, size_);
    auto in = stage(input, "all_gather", true).reshape(-1);
    auto out = stage(output, "all_gather", false);
    auto flat = out.view(-1);
    return launch("all_gather", [&] { return group_->_allgather_base(flat, in); },
                  unstage(output, out));
  }

  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    runtime::detail::check_world_multiple("reduce_scatter", input, output, size_);
    auto in = stage(input, "reduce_scatter", true).reshape(-1);
    auto out = stage(output, "reduce_scatter", false);
    auto flat = out.view(-1);
    c10d::ReduceScatterOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    return launch("reduce_scatter", [&] { return group_->_reduce_scatter_base(flat, in, o); },
                  unstage(output, out));
  }

  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    ACCEL_CHECK(src >= 0 && src < size_, "accel: broadcast from rank ", src,
                " but the world size is ", size_, ". Give a source rank in [0, size()).");
    auto io = stage(tensor, "broadcast", true);
    std::vector<at::Tensor> ts{io};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    o.timeout = timeout_;
    return launch("broadcast", [&] { return group_->broadcast(ts, o); }, unstage(tensor, io));
  }

  void barrier() override {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    launch("barrier", [&] { return group_->barrier(o); })->wait();
  }

  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

 protected:
  C10dCommunicator(std::string_view name, c10::intrusive_ptr<c10d::Store> store,
                   const ProcessEnv& env, torch::Device device, Staging staging,
                   std::chrono::milliseconds timeout)
      : name_(name), store_(std::move(store)), rank_(env.rank), size_(env.world_size),
        device_(device), staging_(staging), timeout_(timeout) {}

  /// Creates the group inside accel's error translation ("rendezvous" errors).
  template <class Make>
  void make_group(Make&& make) {
    try {
      group_ = make();
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, name_, "rendezvous", rank_, size_, timeout_);
    }
  }

  /// The tensor the collective works on: `t` itself when it is on device(),
  /// else a copy there (with `copy_in`, holding t's values) when this
  /// communicator stages, else an error.
  torch::Tensor stage(const torch::Tensor& t, const char* op, bool copy_in) const {
    runtime::detail::check_dense(name_, op, t);
    const bool native = t.device() == device_;
    if (native && staging_ != Staging::Always) return t;
    ACCEL_CHECK(native || staging_ != Staging::Refuse, "accel: ", name_, " ", op,
                " needs a tensor on ", device_, ", not ", t.device(),
                ". Move it with .to(accelerator.device()).");
    return copy_in ? t.to(device_, /*non_blocking=*/false, /*copy=*/true)
                   : torch::empty(t.sizes(), t.options().device(device_));
  }
  /// After the collective: the result copied back from a staging buffer.
  static std::function<void()> unstage(const torch::Tensor& dst, const torch::Tensor& io) {
    if (io.is_same(dst)) return {};
    return [dst, io]() mutable { dst.copy_(io); };
  }

  template <class Start>
  std::shared_ptr<Work> launch(const char* op, Start&& start, std::function<void()> then = {}) {
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = start();
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, name_, op, rank_, size_, timeout_);
    }
    return std::make_shared<detail::C10dWork>(std::move(w), name_, op, rank_, size_, timeout_,
                                              std::move(then), watch_);
  }

  std::string_view name_;
  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  torch::Device device_;
  Staging staging_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<detail::C10dGroup> group_;
  /// Set by backends whose waits block on the host (Gloo): reports slow waits.
  std::shared_ptr<detail::SlowCollectiveWatch> watch_;
};

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_C10D_COMMUNICATOR_HPP
