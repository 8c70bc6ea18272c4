// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::GlooCommunicator and make_gloo_communicator:
/// the Communicator over PyTorch's c10d ProcessGroupGloo (CPU tensors).
#ifndef ACCEL_RUNTIME_GLOO_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_GLOO_COMMUNICATOR_HPP

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// The header guards its content with USE_C10D_GLOO, which LibTorch's CMake
// config does not export; the library itself is always built with Gloo.
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/store.hpp>

namespace accel::runtime {

struct GlooOptions {
  /// Bound on rendezvous and on every collective: a dead or stuck rank makes
  /// the others fail with accel::Error / accel::TimeoutError after at most this.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Rendezvous through a c10d FileStore at this path instead of TCP.
  std::optional<std::string> file_store;
  /// Gloo worker threads (collectives that may run at the same time).
  int threads = 2;
};

namespace detail {

inline c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
    case ReduceOp::Min: return c10d::ReduceOp::MIN;
    case ReduceOp::Sum: break;
  }
  return c10d::ReduceOp::SUM;
}

/// Names the op and the rank, keeps c10d's first line, says what to do.
[[noreturn]] inline void rethrow_collective_error(const std::exception& e, const std::string& backend,
                                                  const std::string& op, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  std::string msg = e.what();
  msg = msg.substr(0, msg.find('\n'));
  const std::string head = "accel: " + backend + " " + op + " failed on rank " +
                           std::to_string(rank) + " of " + std::to_string(size) + ": ";
  if (msg.find("imed out") != std::string::npos || msg.find("timeout") != std::string::npos)
    throw TimeoutError(head + msg + " (timeout " + std::to_string(timeout.count()) +
                       " ms). Another rank did not reach the same collective: check that every "
                       "rank calls the collectives in the same order, or raise the timeout.");
  throw Error(head + msg +
              ". A peer process probably exited or crashed: look at the other ranks' errors.");
}

inline std::shared_ptr<::gloo::transport::Device> make_gloo_device(const ProcessEnv& env) {
  if (auto ifname = getenv_str("GLOO_SOCKET_IFNAME"))
    return c10d::ProcessGroupGloo::createDeviceForInterface(*ifname);
  // Every rank on this host (or a loopback master): loopback needs no DNS.
  const bool loopback = env.master_addr == "127.0.0.1" || env.master_addr == "localhost" ||
                        env.master_addr == "::1";
  if (loopback || env.local_world_size >= env.world_size)
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

/// A c10d work (Gloo or NCCL) plus what must happen after it (copy out of a
/// temporary); wait() honours the timeout and names the backend and op.
class C10dWork final : public Work {
 public:
  C10dWork(c10::intrusive_ptr<c10d::Work> work, std::string backend, std::string op, int rank,
           int size, std::chrono::milliseconds timeout, std::function<void()> then = {})
      : work_(std::move(work)), backend_(std::move(backend)), op_(std::move(op)), rank_(rank),
        size_(size), timeout_(timeout), then_(std::move(then)) {}

  void wait() override {
    if (done_) return;
    try {
      work_->wait(timeout_);
    } catch (const std::exception& e) {
      rethrow_collective_error(e, backend_, op_, rank_, size_, timeout_);
    }
    if (then_) then_();
    done_ = true;
  }

  bool is_completed() override { return done_ || work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::string backend_, op_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::function<void()> then_;
  bool done_ = false;
};

}  // namespace detail

/// Communicator over c10d::ProcessGroupGloo. Tensors must be dense,
/// contiguous CPU tensors (Gloo's CUDA path is not used by accel).
class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, const ProcessEnv& env, GlooOptions options)
      : store_(std::move(store)), rank_(env.rank), size_(env.world_size), timeout_(options.timeout) {
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    opts->devices.push_back(detail::make_gloo_device(env));
    opts->threads = options.threads;
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, size_, opts);
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, "gloo", "rendezvous", rank_, size_, timeout_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "gloo"; }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    check(tensor, "all_reduce");
    std::vector<at::Tensor> ts{tensor};
    c10d::AllreduceOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    return launch("all_reduce", [&] { return pg_->allreduce(ts, o); });
  }

  /// Gloo's allgather into per-rank views of `output` (LibTorch 1.13's Gloo
  /// has no _allgather_base); Gloo gathers into its own flat buffer and
  /// copies into the views: one extra copy of the output.
  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    check(input, "all_gather");
    check(output, "all_gather");
    const auto n = input.numel();
    ACCEL_CHECK(output.numel() == n * size_, "accel: all_gather output has ", output.numel(),
                " elements, expected world size ", size_, " x ", n,
                ". Allocate the output with size() * input.numel() elements.");
    std::vector<std::vector<at::Tensor>> outs(1);
    auto flat = output.view(-1);
    for (int r = 0; r < size_; ++r) outs[0].push_back(flat.narrow(0, r * n, n).view(input.sizes()));
    std::vector<at::Tensor> ins{input};
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    return launch("all_gather", [&] { return pg_->allgather(outs, ins, o); });
  }

  /// LibTorch 1.13's Gloo has no reduce_scatter: all-reduce a copy of the
  /// input and keep this rank's chunk. Costs one copy of the input and about
  /// twice the traffic of a true reduce-scatter (an all-reduce is a
  /// reduce-scatter followed by an all-gather).
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    check(input, "reduce_scatter");
    check(output, "reduce_scatter");
    const auto n = output.numel();
    ACCEL_CHECK(input.numel() == n * size_, "accel: reduce_scatter input has ", input.numel(),
                " elements, expected world size ", size_, " x ", n,
                ". Give an input with size() * output.numel() elements.");
    std::vector<at::Tensor> ts{input.reshape(-1).clone()};
    c10d::AllreduceOptions o;
    o.reduceOp = detail::to_c10d(op);
    o.timeout = timeout_;
    auto tmp = ts[0];
    auto out = output;
    const int r = rank_;
    return launch("reduce_scatter", [&] { return pg_->allreduce(ts, o); },
                  [tmp, out, r, n]() mutable { out.view(-1).copy_(tmp.narrow(0, r * n, n)); });
  }

  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    check(tensor, "broadcast");
    ACCEL_CHECK(src >= 0 && src < size_, "accel: broadcast from rank ", src,
                " but the world size is ", size_, ". Give a source rank in [0, size()).");
    std::vector<at::Tensor> ts{tensor};
    c10d::BroadcastOptions o;
    o.rootRank = src;
    o.timeout = timeout_;
    return launch("broadcast", [&] { return pg_->broadcast(ts, o); });
  }

  void barrier() override {
    c10d::BarrierOptions o;
    o.timeout = timeout_;
    launch("barrier", [&] { return pg_->barrier(o); })->wait();
  }

  /// The underlying process group (for benchmarks and advanced use).
  const c10::intrusive_ptr<c10d::ProcessGroupGloo>& process_group() const { return pg_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

 private:
  void check(const torch::Tensor& t, const char* op) const {
    ACCEL_CHECK(t.defined() && t.is_contiguous() && t.device().is_cpu(), "accel: gloo ", op,
                " needs a defined, contiguous CPU tensor. Call .contiguous().cpu() first.");
  }

  template <class Start>
  std::shared_ptr<Work> launch(const char* op, Start&& start, std::function<void()> then = {}) {
    c10::intrusive_ptr<c10d::Work> w;
    try {
      w = start();
    } catch (const std::exception& e) {
      detail::rethrow_collective_error(e, "gloo", op, rank_, size_, timeout_);
    }
    return std::make_shared<detail::C10dWork>(std::move(w), "gloo", op, rank_, size_, timeout_,
                                              std::move(then));
  }

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
};

/// Gloo communicator over an existing store (shared with other users of it).
inline std::shared_ptr<GlooCommunicator> make_gloo_communicator(
    const ProcessEnv& env, c10::intrusive_ptr<c10d::Store> store, GlooOptions options = {}) {
  return std::make_shared<GlooCommunicator>(std::move(store), env, std::move(options));
}

/// Rendezvous (TCPStore on MASTER_ADDR:MASTER_PORT, or options.file_store)
/// and a Gloo process group over all ranks of `env`.
inline std::shared_ptr<Communicator> make_gloo_communicator(const ProcessEnv& env,
                                                            GlooOptions options = {}) {
  auto store = make_store(env, StoreOptions{options.timeout, options.file_store});
  return make_gloo_communicator(env, std::move(store), std::move(options));
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_GLOO_COMMUNICATOR_HPP
