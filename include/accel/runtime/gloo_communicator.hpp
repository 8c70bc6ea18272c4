// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::GlooCommunicator and make_gloo_communicator:
/// the Communicator over PyTorch's c10d ProcessGroupGloo (CPU and CUDA tensors).
#ifndef ACCEL_RUNTIME_GLOO_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_GLOO_COMMUNICATOR_HPP

#include <chrono>
#include <csignal>
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

#include <accel/detail/torch_version.hpp>
#include <accel/errors.hpp>
#include <accel/runtime/c10d_communicator.hpp>
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
  /// Copy every tensor through a host buffer, CPU tensors too: the path CUDA
  /// tensors take, made testable on a machine without a GPU.
  bool stage_always = false;
};

namespace detail {

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

/// Gloo writes to its sockets with writev, which raises SIGPIPE when the peer
/// has died, and SIGPIPE's default action ends the process before Gloo can
/// report the error (PyTorch never meets this: Python ignores SIGPIPE). So
/// SIGPIPE is ignored, unless the program installed a handler of its own;
/// the dead peer then surfaces as accel::Error from the collective.
inline void ignore_sigpipe_unless_handled() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigemptyset(&ignore.sa_mask);
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

}  // namespace detail

/// Communicator over c10d::ProcessGroupGloo. Gloo reduces in host memory:
/// CPU tensors are used in place, CUDA tensors (backend::Gloo on a GPU
/// machine) are copied to a host buffer and back around each collective.
class GlooCommunicator final : public C10dCommunicator {
 public:
  static constexpr std::string_view name = "Gloo";

  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, const ProcessEnv& env, GlooOptions options)
      : C10dCommunicator(name, std::move(store), env, torch::kCPU,
                         options.stage_always ? Staging::Always : Staging::ThroughHost,
                         options.timeout) {
    detail::ignore_sigpipe_unless_handled();
    auto opts = c10d::ProcessGroupGloo::Options::create(options.timeout);
    opts->devices.push_back(detail::make_gloo_device(env));
    opts->threads = options.threads;
    make_group([&] { return c10::make_intrusive<c10d::ProcessGroupGloo>(store_, rank_, size_, opts); });
    watch_ = std::make_shared<detail::SlowCollectiveWatch>(store_, std::string(name_), rank_, size_, timeout_);
  }

  /// Gloo sums float16 (gloo::float16) but has no bfloat16 sum in 1.13.
  bool sums_natively(torch::ScalarType dtype) const override { return dtype != torch::kBFloat16; }

#if !ACCEL_TORCH_AT_LEAST(2, 6)
  /// LibTorch before 2.6: Gloo has no flat all_gather (_allgather_base).
  /// Gloo gathers into per-rank views of `output` through its own flat
  /// buffer: one extra copy of the output.
  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    runtime::detail::check_world_multiple("all_gather", output, input, size_);
    auto in = stage(input, "all_gather", true);
    auto out = stage(output, "all_gather", false);
    const auto n = in.numel();
    std::vector<std::vector<at::Tensor>> outs(1);
    auto flat = out.view(-1);
    for (int r = 0; r < size_; ++r) outs[0].push_back(flat.narrow(0, r * n, n).view(in.sizes()));
    std::vector<at::Tensor> ins{in};
    c10d::AllgatherOptions o;
    o.timeout = timeout_;
    return launch("all_gather", [&] { return group_->allgather(outs, ins, o); },
                  unstage(output, out));
  }
#endif

  /// LibTorch before 2.6 has no Gloo reduce_scatter, and 2.6's sums whatever
  /// the op (seen: Max gave the sum). Other than a 2.6 Sum: all-reduce a copy
  /// of the input and keep this rank's chunk, one copy of the input and about
  /// twice the traffic of a true reduce-scatter.
  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
#if ACCEL_TORCH_AT_LEAST(2, 6)
    if (op == ReduceOp::Sum) return C10dCommunicator::reduce_scatter(output, input, op);
#endif
    runtime::detail::check_world_multiple("reduce_scatter", input, output, size_);
    runtime::detail::check_dense(name_, "reduce_scatter", output);
    std::vector<at::Tensor> ts{stage(input, "reduce_scatter", true).reshape(-1).clone()};
    c10d::AllreduceOptions o;
    o.reduceOp = runtime::detail::to_c10d(op);
    o.timeout = timeout_;
    const auto n = output.numel();
    return launch("reduce_scatter", [&] { return group_->allreduce(ts, o); },
                  [tmp = ts[0], out = output, r = rank_, n]() mutable {
                    out.view(-1).copy_(tmp.narrow(0, r * n, n));
                  });
  }

  /// The underlying process group (for benchmarks and advanced use).
  c10::intrusive_ptr<c10d::ProcessGroupGloo> process_group() const {
    return c10::static_intrusive_pointer_cast<c10d::ProcessGroupGloo>(group_);
  }
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
