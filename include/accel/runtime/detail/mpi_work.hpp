// SPDX-License-Identifier: Apache-2.0
/// @file Defines the MPI communicator's internals: dtype and op mapping, and
/// the two kinds of Work (MPI_Test polling, or a progress thread that runs
/// blocking collectives).
#ifndef ACCEL_RUNTIME_DETAIL_MPI_WORK_HPP
#define ACCEL_RUNTIME_DETAIL_MPI_WORK_HPP

#if ACCEL_WITH_MPI

#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/runtime/detail/mpi.hpp>
#include <accel/runtime/detail/mpi_runtime.hpp>

namespace accel::runtime::detail {

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

inline std::string mpi_timeout_message(const std::string& op, int rank, int size,
                                       std::chrono::milliseconds timeout) {
  return "accel: Mpi " + op + " did not finish on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " within " + std::to_string(timeout.count()) +
         " ms. Another rank did not reach the same collective: check that every rank calls the "
         "collectives in the same order, or raise the timeout.";
}

inline std::string mpi_failure_message(const std::string& op, int rank, int size, int rc) {
  return "accel: Mpi " + op + " failed on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + ": " + mpi_error_string(rc) + ". " +
         std::string(accel::detail::kPeerVanished) +
         ", or the ranks passed different sizes or types: look at the other ranks' errors.";
}

/// Buffers of MPI requests that may still be in flight when accel gives up on
/// them (a post that failed after earlier pieces were posted, a collective
/// abandoned after a timeout). MPI can still write into them and collective
/// requests cannot be cancelled, so they live until the process ends instead
/// of being freed under MPI's feet; the job is broken by then anyway.
inline void keep_until_exit(std::vector<torch::Tensor> buffers) {
  static std::mutex m;
  static auto* kept = new std::vector<torch::Tensor>();  // never freed, on purpose
  std::lock_guard<std::mutex> l(m);
  for (auto& b : buffers) kept->push_back(std::move(b));
}

/// MPI requests (one per chunk of a collective) polled with MPI_Testall
/// until done or past the deadline. OpenMPI progresses non-blocking
/// collectives inside MPI_Test, so the loop spins (like MPI_Wait does) and
/// only backs off after a second.
class MpiTestWork final : public Work {
 public:
  MpiTestWork(std::vector<MPI_Request> reqs, std::string op, int rank, int size,
              std::chrono::milliseconds timeout, std::vector<torch::Tensor> keep,
              std::function<void()> then)
      : reqs_(std::move(reqs)), op_(std::move(op)), rank_(rank), size_(size), timeout_(timeout),
        keep_(std::move(keep)), then_(std::move(then)) {}
  MpiTestWork(const MpiTestWork&) = delete;
  MpiTestWork& operator=(const MpiTestWork&) = delete;
  ~MpiTestWork() override {
    if (!done_) keep_until_exit(std::move(keep_));
  }

  void wait() override {
    const auto start = std::chrono::steady_clock::now();
    while (!test()) {
      const auto now = std::chrono::steady_clock::now();
      if (now - start > timeout_) throw TimeoutError(mpi_timeout_message(op_, rank_, size_, timeout_));
      if (now - start > std::chrono::seconds(1))
        std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  bool is_completed() override { return test(); }

 private:
  bool test() {
    if (done_) return true;
    int flag = 0, rc;
    {
      auto lock = MpiRuntime::instance().lock();
      rc = MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &flag, MPI_STATUSES_IGNORE);
    }
    if (rc != MPI_SUCCESS) throw Error(mpi_failure_message(op_, rank_, size_, rc));
    if (!flag) return false;
    done_ = true;
    if (then_) then_();
    keep_.clear();
    return true;
  }

  std::vector<MPI_Request> reqs_;
  std::string op_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::vector<torch::Tensor> keep_;  // buffers MPI reads or writes until done
  std::function<void()> then_;
  bool done_ = false;
};

/// Completion of one collective run by the progress thread.
struct MpiOpState {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  int rc = MPI_SUCCESS;
};

/// Runs blocking collectives one after another on its own thread. The queue
/// is shared with the thread, so a thread stuck in MPI (a dead peer) can be
/// detached safely.
class MpiProgressThread {
 public:
  MpiProgressThread() : q_(std::make_shared<Queue>()) {
    thread_ = std::thread([q = q_] { run(*q); });
  }
  MpiProgressThread(const MpiProgressThread&) = delete;
  MpiProgressThread& operator=(const MpiProgressThread&) = delete;

  /// Stops after the queued collectives; waits at most `grace` for them.
  /// Returns false when the thread is still inside MPI (a dead peer) and was
  /// detached: whatever it uses (the communicator) must then stay alive.
  bool stop(std::chrono::milliseconds grace) {
    if (!thread_.joinable()) return !detached_;
    std::unique_lock<std::mutex> l(q_->m);
    q_->stop = true;
    q_->cv.notify_all();
    const bool idle = q_->cv.wait_for(l, grace, [&] { return q_->tasks.empty() && !q_->busy; });
    l.unlock();
    if (idle) {
      thread_.join();
    } else {
      thread_.detach();  // stuck in MPI: the job is broken anyway
      detached_ = true;
    }
    return idle;
  }
  ~MpiProgressThread() { stop(std::chrono::milliseconds(0)); }

  std::shared_ptr<MpiOpState> submit(std::function<int()> fn) {
    auto st = std::make_shared<MpiOpState>();
    {
      std::lock_guard<std::mutex> l(q_->m);
      q_->tasks.push_back({std::move(fn), st});
      q_->pending.fetch_add(1);
    }
    q_->cv.notify_all();
    return st;
  }

 private:
  struct Task {
    std::function<int()> fn;
    std::shared_ptr<MpiOpState> state;
  };
  struct Queue {
    std::mutex m;
    std::condition_variable cv;
    std::deque<Task> tasks;
    bool stop = false, busy = false;
    std::atomic<int> pending{0};  // tasks.size(), readable without the lock
  };

  static void run(Queue& q) {
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> l(q.m);
        if (q.tasks.empty() && !q.stop) {
          // Collectives come in bursts (gradient buckets): stay awake briefly.
          l.unlock();
          const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
          while (std::chrono::steady_clock::now() < spin_until && q.pending.load() == 0)
            std::this_thread::yield();
          l.lock();
        }
        q.cv.wait(l, [&] { return q.stop || !q.tasks.empty(); });
        if (q.tasks.empty()) return;
        task = std::move(q.tasks.front());
        q.tasks.pop_front();
        q.pending.fetch_sub(1);
        q.busy = true;
      }
      const int rc = task.fn();
      task.fn = nullptr;  // release the buffers before reporting completion
      {
        std::lock_guard<std::mutex> l(task.state->m);
        task.state->rc = rc;
        task.state->done = true;
      }
      task.state->cv.notify_all();
      {
        std::lock_guard<std::mutex> l(q.m);
        q.busy = false;
      }
      q.cv.notify_all();
    }
  }

  std::shared_ptr<Queue> q_;
  std::thread thread_;
  bool detached_ = false;
};

class MpiThreadWork final : public Work {
 public:
  MpiThreadWork(std::shared_ptr<MpiOpState> state, std::string op, int rank, int size,
                std::chrono::milliseconds timeout, std::function<void()> then)
      : state_(std::move(state)), op_(std::move(op)), rank_(rank), size_(size), timeout_(timeout),
        then_(std::move(then)) {}

  void wait() override {
    if (done_) return;
    // Sleep, do not spin: the progress thread usually shares this core
    // (mpirun binds a rank to one core) and needs it to progress MPI.
    {
      std::unique_lock<std::mutex> l(state_->m);
      if (!state_->cv.wait_for(l, timeout_, [&] { return state_->done; }))
        throw TimeoutError(mpi_timeout_message(op_, rank_, size_, timeout_));
    }
    finish();
  }

  bool is_completed() override {
    if (done_) return true;
    {
      std::lock_guard<std::mutex> l(state_->m);
      if (!state_->done) return false;
    }
    finish();
    return true;
  }

 private:
  void finish() {
    if (state_->rc != MPI_SUCCESS) throw Error(mpi_failure_message(op_, rank_, size_, state_->rc));
    if (then_) then_();
    then_ = nullptr;
    done_ = true;
  }

  std::shared_ptr<MpiOpState> state_;
  std::string op_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::function<void()> then_;
  bool done_ = false;
};

}  // namespace accel::runtime::detail

#endif  // ACCEL_WITH_MPI

#endif  // ACCEL_RUNTIME_DETAIL_MPI_WORK_HPP
