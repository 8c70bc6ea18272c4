// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::MpiCommunicator and make_mpi_communicator:
/// the Communicator over MPI's non-blocking collectives (ACCEL_WITH_MPI).
#ifndef ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP

#if ACCEL_WITH_MPI

#include <mpi.h>

#include <chrono>
#include <climits>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/detail/mpi_runtime.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/runtime/store.hpp>

namespace accel::runtime {

struct MpiOptions {
  /// Bound on every wait(): past it, accel::TimeoutError (the MPI request is
  /// abandoned, as MPI cannot cancel a collective: end the job).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// Processes not started by mpirun meet through this FileStore (else the
  /// TCPStore on MASTER_ADDR:MASTER_PORT) to join as OpenMPI singletons.
  std::optional<std::string> file_store;
};

namespace detail {

/// MPI has no float16/bfloat16 types: reductions of those run in float32 on
/// a widened copy (exact for the sums of a few values; one conversion each
/// way); all_gather and broadcast move their bits as 16-bit words.
inline bool needs_widening(const torch::Tensor& t) {
  return t.scalar_type() == torch::kHalf || t.scalar_type() == torch::kBFloat16;
}

inline MPI_Datatype mpi_type(torch::ScalarType t, bool reduce) {
  switch (t) {
    case torch::kFloat: return MPI_FLOAT;
    case torch::kDouble: return MPI_DOUBLE;
    case torch::kLong: return MPI_INT64_T;
    case torch::kInt: return MPI_INT32_T;
    case torch::kShort: return MPI_INT16_T;
    case torch::kChar: return MPI_INT8_T;
    case torch::kByte: return MPI_UINT8_T;
    case torch::kHalf:
    case torch::kBFloat16: return reduce ? MPI_DATATYPE_NULL : MPI_UINT16_T;
    default: break;
  }
  throw Error(std::string("accel: MPI collectives do not support tensors of type ") +
              c10::toString(t) + ". Use float, double, half, bfloat16 or an integer type.");
}

inline MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
    case ReduceOp::Sum: break;
  }
  return MPI_SUM;
}

inline int mpi_count(int64_t n, const char* op) {
  ACCEL_CHECK(n <= INT_MAX, "accel: MPI ", op, " of ", n,
              " elements exceeds MPI's int count. Split the tensor into smaller chunks.");
  return static_cast<int>(n);
}

/// An MPI request polled with MPI_Test until done or past the deadline.
/// OpenMPI progresses non-blocking collectives inside MPI_Test, so the loop
/// spins (like MPI_Wait does) and only backs off after a second.
class MpiWork final : public Work {
 public:
  MpiWork(MPI_Request req, std::string op, int rank, int size, std::chrono::milliseconds timeout,
          std::vector<torch::Tensor> keep, std::function<void()> then = {})
      : req_(req), op_(std::move(op)), rank_(rank), size_(size), timeout_(timeout),
        keep_(std::move(keep)), then_(std::move(then)) {}

  void wait() override {
    if (done_) return;
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = start + timeout_;
    while (!test()) {
      const auto now = std::chrono::steady_clock::now();
      if (now > deadline)
        throw TimeoutError("accel: mpi " + op_ + " did not finish on rank " + std::to_string(rank_) +
                           " of " + std::to_string(size_) + " within " +
                           std::to_string(timeout_.count()) +
                           " ms. Another rank did not reach the same collective: check that every "
                           "rank calls the collectives in the same order, or raise the timeout.");
      if (now - start > std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  bool is_completed() override { return done_ || test(); }

 private:
  bool test() {
    if (done_) return true;
    int flag = 0, rc;
    {
      auto lock = MpiRuntime::instance().lock();
      rc = MPI_Test(&req_, &flag, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS)
      throw Error("accel: mpi " + op_ + " failed on rank " + std::to_string(rank_) + " of " +
                  std::to_string(size_) + ": " + mpi_error_string(rc) +
                  ". A peer process probably exited: look at the other ranks' errors.");
    if (!flag) return false;
    done_ = true;
    if (then_) then_();
    keep_.clear();
    return true;
  }

  MPI_Request req_;
  std::string op_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::vector<torch::Tensor> keep_;  // buffers MPI reads or writes until done
  std::function<void()> then_;
  bool done_ = false;
};

}  // namespace detail

/// Communicator over an MPI communicator (its own duplicate, so accel's
/// collectives never match the user's). CPU tensors only.
class MpiCommunicator final : public Communicator {
 public:
  /// Takes ownership of `comm` (freed in the destructor unless MPI is finalised).
  MpiCommunicator(MPI_Comm comm, std::chrono::milliseconds timeout) : comm_(comm), timeout_(timeout) {
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~MpiCommunicator() override {
    int finalized = 1;
    MPI_Finalized(&finalized);
    if (!finalized && comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
  }
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend_name() const override { return "mpi"; }
  MPI_Comm comm() const { return comm_; }

  std::shared_ptr<Work> all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::Sum) override {
    check(tensor, "all_reduce");
    auto buf = detail::needs_widening(tensor) ? tensor.to(torch::kFloat) : tensor;
    const int count = detail::mpi_count(buf.numel(), "all_reduce");
    const auto type = detail::mpi_type(buf.scalar_type(), true);
    std::function<void()> then;
    if (!buf.is_same(tensor)) then = [buf, out = tensor]() mutable { out.copy_(buf); };
    return start("all_reduce", {buf}, std::move(then), [&](MPI_Request* req) {
      return MPI_Iallreduce(MPI_IN_PLACE, buf.data_ptr(), count, type, detail::mpi_op(op), comm_, req);
    });
  }

  std::shared_ptr<Work> all_gather(torch::Tensor& output, const torch::Tensor& input) override {
    check(input, "all_gather");
    check(output, "all_gather");
    ACCEL_CHECK(output.scalar_type() == input.scalar_type(),
                "accel: all_gather output and input types differ. Give both the same dtype.");
    ACCEL_CHECK(output.numel() == input.numel() * size_, "accel: all_gather output has ",
                output.numel(), " elements, expected world size ", size_, " x ", input.numel(),
                ". Allocate the output with size() * input.numel() elements.");
    const int count = detail::mpi_count(input.numel(), "all_gather");
    const auto type = detail::mpi_type(input.scalar_type(), false);
    return start("all_gather", {output, input}, {}, [&](MPI_Request* req) {
      return MPI_Iallgather(input.data_ptr(), count, type, output.data_ptr(), count, type, comm_, req);
    });
  }

  std::shared_ptr<Work> reduce_scatter(torch::Tensor& output, const torch::Tensor& input,
                                       ReduceOp op = ReduceOp::Sum) override {
    check(input, "reduce_scatter");
    check(output, "reduce_scatter");
    ACCEL_CHECK(input.numel() == output.numel() * size_, "accel: reduce_scatter input has ",
                input.numel(), " elements, expected world size ", size_, " x ", output.numel(),
                ". Give an input with size() * output.numel() elements.");
    const bool widen = detail::needs_widening(input) || detail::needs_widening(output);
    auto in = widen ? input.to(torch::kFloat) : input;
    auto out = widen ? torch::empty(output.sizes(), output.options().dtype(torch::kFloat)) : output;
    ACCEL_CHECK(in.scalar_type() == out.scalar_type(),
                "accel: reduce_scatter output and input types differ. Give both the same dtype.");
    const int count = detail::mpi_count(out.numel(), "reduce_scatter");
    const auto type = detail::mpi_type(in.scalar_type(), true);
    std::function<void()> then;
    if (widen) then = [out, dst = output]() mutable { dst.copy_(out); };
    return start("reduce_scatter", {in, out}, std::move(then), [&](MPI_Request* req) {
      return MPI_Ireduce_scatter_block(in.data_ptr(), out.data_ptr(), count, type,
                                       detail::mpi_op(op), comm_, req);
    });
  }

  std::shared_ptr<Work> broadcast(torch::Tensor& tensor, int src = 0) override {
    check(tensor, "broadcast");
    ACCEL_CHECK(src >= 0 && src < size_, "accel: broadcast from rank ", src,
                " but the world size is ", size_, ". Give a source rank in [0, size()).");
    const int count = detail::mpi_count(tensor.numel(), "broadcast");
    const auto type = detail::mpi_type(tensor.scalar_type(), false);
    return start("broadcast", {tensor}, {}, [&](MPI_Request* req) {
      return MPI_Ibcast(tensor.data_ptr(), count, type, src, comm_, req);
    });
  }

  void barrier() override {
    start("barrier", {}, {}, [&](MPI_Request* req) { return MPI_Ibarrier(comm_, req); })->wait();
  }

 private:
  void check(const torch::Tensor& t, const char* op) const {
    ACCEL_CHECK(t.defined() && t.is_contiguous() && t.device().is_cpu(), "accel: mpi ", op,
                " needs a defined, contiguous CPU tensor. Call .contiguous().cpu() first.");
  }

  template <class Post>
  std::shared_ptr<Work> start(const char* op, std::vector<torch::Tensor> keep,
                              std::function<void()> then, Post&& post) {
    MPI_Request req = MPI_REQUEST_NULL;
    int rc;
    {
      auto lock = detail::MpiRuntime::instance().lock();
      rc = post(&req);
    }
    if (rc != MPI_SUCCESS)
      throw Error(std::string("accel: mpi ") + op + " could not start on rank " +
                  std::to_string(rank_) + ": " + detail::mpi_error_string(rc) +
                  ". Check that every rank passes tensors of the same size and type.");
    return std::make_shared<detail::MpiWork>(req, op, rank_, size_, timeout_, std::move(keep),
                                             std::move(then));
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  std::chrono::milliseconds timeout_;
  int rank_ = 0, size_ = 1;
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
  return std::make_shared<MpiCommunicator>(comm, options.timeout);
}

}  // namespace accel::runtime

#endif  // ACCEL_WITH_MPI

#endif  // ACCEL_RUNTIME_MPI_COMMUNICATOR_HPP
