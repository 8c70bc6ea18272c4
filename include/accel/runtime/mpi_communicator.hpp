// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::MpiCommunicator and make_mpi_communicator:
/// the Communicator over MPI's non-blocking collectives (ACCEL_WITH_MPI).
#ifndef ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP

#if ACCEL_WITH_MPI

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/detail/mpi.hpp>
#include <accel/runtime/detail/mpi_runtime.hpp>
#include <accel/runtime/detail/mpi_work.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/store.hpp>

namespace accel::runtime {

/// How collectives make progress between launch and wait().
enum class MpiProgress {
  /// MPI's non-blocking collectives (MPI_Iallreduce...), progressed by the
  /// MPI_Test polling in wait(). No extra thread; but OpenMPI's libnbc moves
  /// data only while someone polls, and copies each buffer into a fresh
  /// temporary: W on 2 processes ran at ~350 ms/step this way vs ~70 with
  /// Thread (bench/README.md). The fallback when MPI lacks THREAD_MULTIPLE.
  Test,
  /// One thread per communicator runs MPI's blocking (tuned, shared-memory)
  /// collectives in launch order, so they progress while the caller
  /// computes. Needs MPI_THREAD_MULTIPLE (else Test). The default.
  Thread,
};

struct MpiOptions {
  /// Bound on every wait(): past it, accel::TimeoutError (the collective
  /// stays in flight, as MPI cannot cancel one: end the job).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Processes not started by mpirun meet through this FileStore (else the
  /// TCPStore on MASTER_ADDR:MASTER_PORT) to join as OpenMPI singletons.
  std::optional<std::string> file_store;
  MpiProgress progress = MpiProgress::Thread;
  /// all_reduce moves at most this many bytes per MPI call. OpenMPI's
  /// shared-memory all-reduce switches to an algorithm ~10x slower above
  /// ~25-32 MiB, and its non-blocking form copies the whole buffer into a
  /// fresh temporary each call; 4 MiB pieces run at full speed
  /// (bench/allreduce_bandwidth). 0: one call, whatever the size.
  int64_t max_chunk_bytes = int64_t{4} << 20;
};

/// Communicator over an MPI communicator (its own duplicate, so accel's
/// collectives never match the user's). CPU tensors only.
class MpiCommunicator final : public Communicator {
 public:
  /// Takes ownership of `comm` (freed in the destructor unless MPI is finalised).
  MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout,
                  MpiProgress progress = MpiProgress::Thread, int64_t max_chunk_bytes = 0)
      : comm_(comm), timeout_(timeout), max_chunk_bytes_(max_chunk_bytes) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    if (progress == MpiProgress::Thread && detail::MpiRuntime::instance().thread_multiple())
      thread_ = std::make_unique<detail::MpiProgressThread>();
  }
  ~MpiCommunicator() override {
    // A progress thread still inside MPI keeps using comm_: it is not freed then.
    const bool thread_done = !thread_ || thread_->stop(timeout_);
    thread_.reset();
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (thread_done && !finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  static constexpr std::string_view name = "Mpi";
  std::string_view backend_name() const override { return name; }
  torch::Device device() const override { return torch::kCPU; }
  bool sums_natively(torch::ScalarType dtype) const override {
    return dtype != torch::kHalf && dtype != torch::kBFloat16;  // widened to float32
  }
  MPI_Comm comm() const { return comm_; }
  MpiProgress progress() const { return thread_ ? MpiProgress::Thread : MpiProgress::Test; }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    check(tensor, "all_reduce");
    auto buf = detail::needs_widening(tensor) ? tensor.to(torch::kFloat) : tensor;
    const auto type = detail::mpi_type(buf.scalar_type(), true);
    const auto mop = detail::mpi_op(op);
    std::function<void()> then;
    if (!buf.is_same(tensor)) then = [buf, out = tensor]() mutable { out.copy_(buf); };
    // Elementwise, so pieces reduce independently: [offset, offset + count) each.
    const int64_t n = buf.numel(), item = static_cast<int64_t>(buf.element_size());
    const int64_t piece = max_chunk_bytes_ > 0 ? std::max<int64_t>(1, max_chunk_bytes_ / item) : n;
    const int pieces = static_cast<int>(std::max<int64_t>(1, (n + piece - 1) / piece));
    detail::mpi_count(std::min(n, piece), "all_reduce");
    auto* p = static_cast<char*>(buf.data_ptr());
    MPI_Comm c = comm_;
    auto at = [=](int k) { return p + k * piece * item; };
    auto count = [=](int k) { return static_cast<int>(std::min(piece, n - k * piece)); };
    return start(
        "all_reduce", {buf}, std::move(then), pieces,
        [=](int k, MPI_Request* r) {
          return MPI_Iallreduce(MPI_IN_PLACE, at(k), count(k), type, mop, c, r);
        },
        [=] {
          for (int k = 0; k < pieces; ++k)
            if (int rc = MPI_Allreduce(MPI_IN_PLACE, at(k), count(k), type, mop, c); rc != MPI_SUCCESS)
              return rc;
          return MPI_SUCCESS;
        });
  }

  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    check(input, "all_gather");
    check(output, "all_gather");
    detail::check_world_multiple("all_gather", output, input, size_);
    const int count = detail::mpi_count(input.numel(), "all_gather");
    const auto type = detail::mpi_type(input.scalar_type(), false);
    void* in = input.data_ptr();
    void* out = output.data_ptr();
    MPI_Comm c = comm_;
    return start(
        "all_gather", {output, input}, {}, 1,
        [=](int, MPI_Request* r) { return MPI_Iallgather(in, count, type, out, count, type, c, r); },
        [=] { return MPI_Allgather(in, count, type, out, count, type, c); });
  }

  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    check(input, "reduce_scatter");
    check(output, "reduce_scatter");
    detail::check_world_multiple("reduce_scatter", input, output, size_);
    const bool widen = detail::needs_widening(input) || detail::needs_widening(output);
    auto in = widen ? input.to(torch::kFloat) : input;
    auto out = widen ? torch::empty(output.sizes(), output.options().dtype(torch::kFloat)) : output;
    const int count = detail::mpi_count(out.numel(), "reduce_scatter");
    const auto type = detail::mpi_type(in.scalar_type(), true);
    const auto mop = detail::mpi_op(op);
    std::function<void()> then;
    if (widen) then = [out, dst = output]() mutable { dst.copy_(out); };
    void* pi = in.data_ptr();
    void* po = out.data_ptr();
    MPI_Comm c = comm_;
    return start(
        "reduce_scatter", {in, out}, std::move(then), 1,
        [=](int, MPI_Request* r) { return MPI_Ireduce_scatter_block(pi, po, count, type, mop, c, r); },
        [=] { return MPI_Reduce_scatter_block(pi, po, count, type, mop, c); });
  }

  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    check(tensor, "broadcast");
    ACCEL_CHECK(src >= 0 && src < size_, "accel: broadcast from rank ", src,
                " but the world size is ", size_, ". Give a source rank in [0, size()).");
    const int count = detail::mpi_count(tensor.numel(), "broadcast");
    const auto type = detail::mpi_type(tensor.scalar_type(), false);
    void* p = tensor.data_ptr();
    MPI_Comm c = comm_;
    return start(
        "broadcast", {tensor}, {}, 1,
        [=](int, MPI_Request* r) { return MPI_Ibcast(p, count, type, src, c, r); },
        [=] { return MPI_Bcast(p, count, type, src, c); });
  }

  void barrier() override {
    MPI_Comm c = comm_;
    start(
        "barrier", {}, {}, 1, [=](int, MPI_Request* r) { return MPI_Ibarrier(c, r); },
        [=] { return MPI_Barrier(c); })
        ->wait();
  }

 private:
  void check(const torch::Tensor& t, const char* op) const {
    detail::check_dense(name, op, t);
    ACCEL_CHECK(t.device().is_cpu(), "accel: Mpi ", op, " needs a CPU tensor, not ", t.device(),
                ". backend::Mpi works on the CPU: call .cpu() first.");
  }

  /// Hands the collective to the progress thread (blocking form) or posts
  /// its non-blocking form, `pieces` requests; `keep` stays alive until it is done.
  template <class Post, class Run>
  std::shared_ptr<Work> start(const char* op, std::vector<torch::Tensor> keep,
                              std::function<void()> then, int pieces, Post post, Run run) {
    if (thread_) {
      auto state = thread_->submit([run, keep = std::move(keep)] { return run(); });
      return std::make_shared<detail::MpiThreadWork>(std::move(state), op, rank_, size_, timeout_,
                                                     std::move(then));
    }
    std::vector<MPI_Request> reqs(static_cast<std::size_t>(pieces), MPI_REQUEST_NULL);
    int rc = MPI_SUCCESS;
    {
      auto lock = detail::MpiRuntime::instance().lock();
      for (int k = 0; k < pieces && rc == MPI_SUCCESS; ++k) rc = post(k, &reqs[k]);
    }
    if (rc != MPI_SUCCESS) {
      // The pieces posted before the failure are in flight with these buffers.
      detail::keep_until_exit(std::move(keep));
      throw Error(detail::mpi_failure_message(op, rank_, size_, rc));
    }
    return std::make_shared<detail::MpiTestWork>(std::move(reqs), op, rank_, size_, timeout_,
                                                 std::move(keep), std::move(then));
  }


  MPI_Comm comm_ = MPI_COMM_NULL;
  std::chrono::milliseconds timeout_;
  int64_t max_chunk_bytes_ = 0;
  int rank_ = 0, size_ = 1;
  std::unique_ptr<detail::MpiProgressThread> thread_;
};

/// MPI communicator over all ranks of `env`. Under mpirun/srun: a duplicate of
/// MPI_COMM_WORLD (its size must equal env.world_size). Otherwise (accel's
/// own launcher, torchrun-style variables): the ranks meet through a c10d
/// store and join as OpenMPI singletons through an ompi-server that rank 0
/// starts; without ompi-server this is an accel::Error asking for mpirun.
inline std::shared_ptr<MpiCommunicator> make_mpi_communicator(const ProcessEnv& env,
                                                              MpiOptions options = {}) {
  auto& rt = detail::MpiRuntime::instance();
  MPI_Comm comm = MPI_COMM_NULL;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (detail::started_by_mpi_launcher() || initialized || env.world_size == 1) {
    rt.ensure_initialized();
    MPI_Comm base = env.world_size == 1 && !detail::started_by_mpi_launcher() ? MPI_COMM_SELF
                                                                              : MPI_COMM_WORLD;
    int size = 0;
    MPI_Comm_size(base, &size);
    ACCEL_CHECK(size == env.world_size, "accel: MPI has ", size, " ranks but the environment says ",
                env.world_size, " (from ", env.source, "). Start the program with `mpirun -np ",
                env.world_size, "` and do not set RANK/WORLD_SIZE yourself.");
    MPI_Comm_dup(base, &comm);
  } else {
    auto store = make_store(env, StoreOptions{options.timeout, options.file_store});
    comm = detail::join_singletons(env, *store, options.timeout);
    // Everyone has read the keys once all ranks are joined; the store may go.
  }
  return std::make_shared<MpiCommunicator>(comm, options.timeout, options.progress,
                                           options.max_chunk_bytes);
}

}  // namespace accel::runtime

#endif  // ACCEL_WITH_MPI

#endif  // ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP
