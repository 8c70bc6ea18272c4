// Generated from include/accel by tools/amalgamate.py - do not edit
// accel 0.1.0, single-header form of include/accel/accel.hpp; regenerate with
// `python3 tools/amalgamate.py` or `cmake --build <dir> --target accel_amalgamate`.
// SPDX-License-Identifier: Apache-2.0
// begin <accel/accel.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella: everything in API.md.
#ifndef ACCEL_ACCEL_HPP
#define ACCEL_ACCEL_HPP

// begin <accel/config.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Every build-availability macro of accel, documented in one place.
///
/// ACCEL_WITH_NCCL  1 when LibTorch was built with CUDA and NCCL (CMake sets it
///                  from the Torch package); enables backend::Nccl.
/// ACCEL_WITH_MPI   1 when an MPI implementation is linked (CMake sets it when
///                  find_package(MPI) succeeds); enables backend::Mpi.
/// ACCEL_WITH_CUDA  1 when LibTorch has CUDA (implied by ACCEL_WITH_NCCL).
#ifndef ACCEL_CONFIG_HPP
#define ACCEL_CONFIG_HPP

#ifndef ACCEL_WITH_NCCL
#define ACCEL_WITH_NCCL 0
#endif
#ifndef ACCEL_WITH_MPI
#define ACCEL_WITH_MPI 0
#endif
#ifndef ACCEL_WITH_CUDA
#define ACCEL_WITH_CUDA ACCEL_WITH_NCCL
#endif

#endif  // ACCEL_CONFIG_HPP
// end <accel/config.hpp>
// begin <accel/version.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the accel version macros (CMake reads them from here).
#ifndef ACCEL_VERSION_HPP
#define ACCEL_VERSION_HPP

#define ACCEL_VERSION_MAJOR 0
#define ACCEL_VERSION_MINOR 1
#define ACCEL_VERSION_PATCH 0

namespace accel {
inline constexpr const char* version_string = "0.1.0";
}  // namespace accel

#endif  // ACCEL_VERSION_HPP
// end <accel/version.hpp>
// begin <accel/errors.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel's run-time exceptions and the ACCEL_CHECK macro.
#ifndef ACCEL_ERRORS_HPP
#define ACCEL_ERRORS_HPP

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace accel {

/// Base of every run-time error accel raises. Messages follow one form:
/// "accel: <what is wrong>. <what to do instead>."
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

/// A launched worker failed: names the rank and carries its message; `others`
/// says what became of the other processes ("process 0 failed because of it").
class LaunchError : public Error {
 public:
  LaunchError(int rank, std::string message, const std::string& others = {})
      : Error("accel: process " + std::to_string(rank) + " failed: " + message +
              (others.empty() ? "" : "; " + others)),
        rank_(rank), message_(std::move(message)) {}
  /// The failure that used up the last restart (LaunchOptions::max_restarts):
  /// "accel: process 1 failed on attempt 2 of 2 (max_restarts = 1): ...".
  LaunchError(int rank, std::string message, const std::string& others, int attempt, int attempts)
      : Error("accel: process " + std::to_string(rank) + " failed on attempt " +
              std::to_string(attempt) + " of " + std::to_string(attempts) + " (max_restarts = " +
              std::to_string(attempts - 1) + "): " + message + (others.empty() ? "" : "; " + others)),
        rank_(rank), message_(std::move(message)), attempt_(attempt) {}
  int rank() const noexcept { return rank_; }
  const std::string& message() const noexcept { return message_; }
  /// Which attempt failed, from 1 (a launch without restarts has only attempt 1).
  int attempt() const noexcept { return attempt_; }

 private:
  int rank_;
  std::string message_;
  int attempt_ = 1;
};

/// A configuration file or value is wrong: names the key (and line, when known).
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// A collective or rendezvous did not finish within the timeout.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <class... A>
std::string concat(A&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<A>(parts));
  return out.str();
}

// Phrases of the errors a process raises because another process failed (it
// saw the failure, or its peer vanished). Launchers report the process that
// failed by itself as the cause, not these.
inline constexpr std::string_view kFailedElsewhere = "(its own error says why)";
inline constexpr std::string_view kPeerVanished = "A peer process probably exited";

inline bool caused_by_another_process(std::string_view message) {
  return message.find(kFailedElsewhere) != std::string_view::npos ||
         message.find(kPeerVanished) != std::string_view::npos;
}
}  // namespace detail

}  // namespace accel

/// Throws accel::Error with the streamed message parts when cond is false.
#define ACCEL_CHECK(cond, ...)                                              \
  do {                                                                      \
    if (!(cond)) throw ::accel::Error(::accel::detail::concat(__VA_ARGS__)); \
  } while (false)

#endif  // ACCEL_ERRORS_HPP
// end <accel/errors.hpp>
// begin <accel/options.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the run-time options of accel::Accelerator and of its
/// save_model (numbers are options, not template parameters).
#ifndef ACCEL_OPTIONS_HPP
#define ACCEL_OPTIONS_HPP

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace accel {

/// Dynamic loss scaling (precision::Fp16); defaults are Accelerate's/PyTorch's.
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

/// How gradient buckets travel between processes (shard::Replicate, and the
/// ZeRO reductions): as they are, cast to float16 / bfloat16 for the wire
/// (PyTorch's fp16_compress_hook / bf16_compress_hook), or PowerSGD's
/// low-rank approximation (Vogels et al., 2019; PyTorch's powerSGD_hook).
/// docs/comm_hooks.md.
enum class CommHook { None, Fp16, Bf16, PowerSGD };

/// CommHook::PowerSGD, with PyTorch's names and defaults.
struct PowerSGDOptions {
  int matrix_approximation_rank = 1;  ///< r: each m x n gradient travels as m x r and n x r
  int start_powerSGD_iter = 1000;     ///< plain all-reduce for this many optimizer steps first
  bool use_error_feedback = true;     ///< add what compression lost to the next step's gradient
  bool warm_start = true;             ///< start each step's power iteration from the last Q
};

struct AcceleratorOptions {
  int gradient_accumulation_steps = 1;
  bool split_batches = false;  ///< true: loader batch size is the global batch, split across ranks
  bool even_batches = true;    ///< pad the last batches by wrapping around so every rank gets the same count
  bool step_scheduler_with_optimizer = true;
  std::optional<std::string> project_dir{};  ///< where save_state(), trackers write by default
  std::chrono::seconds timeout{1800};      ///< collective / rendezvous timeout
  // --- accel additions (after the API.md fields, so designated initializers keep working) ---
  double bucket_cap_mb = 25.0;             ///< gradient all-reduce bucket size (Replicate, ZeRO)
  /// shard::Replicate: start each bucket's all-reduce from backward as soon as
  /// it is full (true) or all of them after backward (false). Unset: overlap
  /// on CUDA, and on CPU when each process of this machine has a core to
  /// spare (cores / local processes > 1); on fewer cores the all-reduce only
  /// takes CPU time from backward (bench/README.md).
  std::optional<bool> overlap_gradient_sync{};
  /// shard::ShardParameters: start all-gathering the next unit's parameters
  /// while the current unit computes (forward and backward), holding two
  /// units whole instead of one. Unset: as overlap_gradient_sync.
  std::optional<bool> prefetch_parameters{};
  GradScalerOptions grad_scaler{};         ///< precision::Fp16 only
  std::optional<std::string> file_store{};   ///< rendezvous through a c10d FileStore at this path instead of TCP
  bool automatic_checkpoint_naming = false;  ///< save_state() -> project_dir/checkpoints/checkpoint_N
  std::optional<int> total_limit{};          ///< keep at most this many automatic checkpoints
  // --- second round (API.md section 7) ---
  CommHook comm_hook = CommHook::None;       ///< gradient compression on the wire
  PowerSGDOptions powersgd{};                ///< CommHook::PowerSGD's settings
};

enum class Reduction { Sum, Mean };

/// Options of Accelerator::save_model.
struct SaveModelOptions {
  /// Largest shard, in Accelerate's units: "10GB"/"500MB"/"100KB" (powers of
  /// 10), "2GiB"/"64MiB"/"512KiB" (powers of 2), a lowercase final b means bits
  /// ("80Mb" = 10 MB), a plain integer is bytes. A tensor larger than this gets
  /// a shard of its own.
  std::string max_shard_size = "10GB";
  /// Each file's header records the XXH64 of its data (metadata entry
  /// accel.data_xxh64, ignored by other readers), checked when accel loads it.
  bool checksum = true;
};

}  // namespace accel

#endif  // ACCEL_OPTIONS_HPP
// end <accel/options.hpp>
// begin <accel/random.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::set_seed: one seed for every generator a training run uses.
#ifndef ACCEL_RANDOM_HPP
#define ACCEL_RANDOM_HPP

#include <cstdint>
#include <cstdlib>
#include <random>

#include <torch/torch.h>

// begin <accel/runtime/process_env.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::ProcessEnv: who am I among the processes.
#ifndef ACCEL_RUNTIME_PROCESS_ENV_HPP
#define ACCEL_RUNTIME_PROCESS_ENV_HPP

#include <cctype>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>


namespace accel::runtime {

/// Rank and world of this process, read from the environment.
struct ProcessEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "none";  ///< which convention supplied the values

  bool distributed() const { return world_size > 1; }

  /// Discovery order (API.md section 5): torchrun (RANK/WORLD_SIZE/LOCAL_RANK),
  /// OpenMPI (OMPI_COMM_WORLD_*), PMI (PMI_RANK/PMI_SIZE), Slurm
  /// (SLURM_PROCID/SLURM_NTASKS); none of them: a single process.
  static ProcessEnv discover();
};

namespace detail {

inline std::optional<std::string> getenv_str(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

inline std::optional<int> getenv_int(const char* name) {
  auto s = getenv_str(name);
  if (!s) return std::nullopt;
  try {
    std::size_t used = 0;
    int v = std::stoi(*s, &used);
    if (used != s->size()) throw std::invalid_argument(*s);
    return v;
  } catch (const std::exception&) {
    throw Error(std::string("accel: environment variable ") + name + "='" + *s +
                "' is not an integer. Unset it or give it a whole number.");
  }
}

/// A yes/no variable, spelled as Accelerate's parse_flag_from_env accepts
/// (1/y/yes/t/true/on, 0/n/no/f/false/off, any case); unset or empty is no,
/// anything else is an error rather than a silent no.
inline bool getenv_flag(const char* name) {
  auto v = getenv_str(name);
  if (!v) return false;
  std::string s = *v;
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* yes : {"1", "y", "yes", "t", "true", "on"})
    if (s == yes) return true;
  for (const char* no : {"0", "n", "no", "f", "false", "off"})
    if (s == no) return false;
  throw Error(std::string("accel: environment variable ") + name + "='" + v->substr(0, 100) +
              "' is neither yes nor no. Set it to 1/yes/true/on or 0/no/false/off, or unset it.");
}

}  // namespace detail

inline ProcessEnv ProcessEnv::discover() {
  using detail::getenv_int;
  using detail::getenv_str;
  ProcessEnv env;
  auto take = [&](const char* rank, const char* size, const char* local_rank,
                  const char* local_size, const char* source) {
    auto r = getenv_int(rank);
    auto s = getenv_int(size);
    // torchrun's pair set by half is a broken launch, not one process (other
    // launchers' variables are left to their launchers).
    if (std::string_view(source) == "torchrun" && r.has_value() != s.has_value())
      throw Error(accel::detail::concat(
          "accel: ", r ? rank : size, "=", r ? *r : *s, " is set but ", r ? size : rank,
          " is not. Set both (accel launch and torchrun do), or neither to run one process."));
    if (!r || !s) return false;
    env.rank = *r;
    env.world_size = *s;
    env.local_rank = local_rank ? getenv_int(local_rank).value_or(env.rank) : env.rank;
    env.local_world_size =
        local_size ? getenv_int(local_size).value_or(env.world_size) : env.world_size;
    env.source = source;
    return true;
  };
  take("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun") ||
      take("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE", "openmpi") ||
      take("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "pmi") ||
      take("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "slurm");
  if (auto a = getenv_str("MASTER_ADDR")) env.master_addr = *a;
  if (auto p = getenv_int("MASTER_PORT")) env.master_port = *p;
  if (env.world_size < 1)
    throw Error("accel: world size " + std::to_string(env.world_size) + " (from " + env.source +
                " variables) is not a number of processes. Check the launcher's RANK/WORLD_SIZE "
                "settings.");
  if (env.rank < 0 || env.rank >= env.world_size)
    throw Error("accel: rank " + std::to_string(env.rank) + " is outside world size " +
                std::to_string(env.world_size) + " (from " + env.source +
                " variables). Check the launcher's RANK/WORLD_SIZE settings.");
  if (env.local_world_size < 1) env.local_world_size = 1;
  return env;
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_PROCESS_ENV_HPP
// end <accel/runtime/process_env.hpp>

namespace accel {

/// A std::mt19937_64 owned by accel and seeded by set_seed, for user code that
/// wants std generators to follow the same seed (std::rand is seeded too).
inline std::mt19937_64& std_generator() {
  static std::mt19937_64 gen{0};
  return gen;
}

/// Seeds LibTorch's CPU (and every CUDA) generator, std::rand and
/// accel::std_generator(). With `device_specific` the seed is offset by the
/// global rank, so ranks draw different numbers (dropout, augmentation).
inline void set_seed(uint64_t seed, bool device_specific = false) {
  if (device_specific) seed += static_cast<uint64_t>(runtime::ProcessEnv::discover().rank);
  torch::manual_seed(seed);  // also seeds every CUDA device when CUDA is available
  std::srand(static_cast<unsigned>(seed));
  std_generator().seed(seed);
}

}  // namespace accel

#endif  // ACCEL_RANDOM_HPP
// end <accel/random.hpp>
// begin <accel/runtime.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the runtime area's public surface: ProcessEnv (who am I),
/// restart_count() (which attempt of an elastic launch), heartbeat() (progress
/// for the launcher's hang detection),
/// the Communicator interface, the rendezvous store (make_store), and the
/// Gloo and MPI communicators (make_gloo_communicator, make_mpi_communicator;
/// the MPI one only when ACCEL_WITH_MPI).
#ifndef ACCEL_RUNTIME_HPP
#define ACCEL_RUNTIME_HPP

// begin <accel/runtime/communicator.hpp>
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
// end <accel/runtime/communicator.hpp>
// begin <accel/runtime/counting_communicator.hpp>
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
// end <accel/runtime/counting_communicator.hpp>
// begin <accel/runtime/gloo_communicator.hpp>
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

// begin <accel/detail/torch_version.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file The one place that knows LibTorch versions: ACCEL_TORCH_AT_LEAST(major, minor).
/// accel builds against LibTorch 1.13 (Debian 12, in CI) and 2.x (2.6 on
/// Debian 13, tools/test-libtorch2.sh); code that differs between them tests
/// this macro, nothing else.
#ifndef ACCEL_DETAIL_TORCH_VERSION_HPP
#define ACCEL_DETAIL_TORCH_VERSION_HPP

#include <torch/version.h>

#define ACCEL_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#endif  // ACCEL_DETAIL_TORCH_VERSION_HPP
// end <accel/detail/torch_version.hpp>
// begin <accel/runtime/c10d_communicator.hpp>
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

// begin <accel/runtime/detail/slow_collective.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines SlowCollectiveWatch: a rank that waits long in a collective
/// says so, and names the processes that have not reached it (one that hangs
/// in its own code, loads data forever, or skipped the collective), instead of
/// waiting silently until the backend's timeout. Nothing happens on the fast
/// path: a wait that ends within 5 s costs what it did before.
#ifndef ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP
#define ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP

#include <atomic>
#include <chrono>
#include <cstdint>
#include <iostream>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

// begin <accel/runtime/detail/wait_reports.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines WaitReports: when a wait that goes on (a rendezvous, machines
/// that have not joined) is reported. Free of LibTorch (the launchers use it).
#ifndef ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP
#define ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP

#include <algorithm>
#include <chrono>

namespace accel::runtime::detail {

/// When a wait that goes on is reported: after 5, 10, 20, 40 ... s (or from
/// `first` on, doubling), then every 5 minutes.
class WaitReports {
 public:
  using Clock = std::chrono::steady_clock;
  explicit WaitReports(Clock::time_point start, std::chrono::seconds first = std::chrono::seconds(5))
      : start_(start), next_(first) {}
  bool due() {
    if (Clock::now() - start_ < next_) return false;
    next_ = std::min(next_ * 2, next_ + std::chrono::seconds(300));
    return true;
  }
  /// Whole seconds waited, rounded.
  long long seconds() const {
    return (std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start_).count() + 500) / 1000;
  }

 private:
  Clock::time_point start_;
  std::chrono::seconds next_;
};

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_WAIT_REPORTS_HPP
// end <accel/runtime/detail/wait_reports.hpp>

namespace accel::runtime::detail {

/// Shared by a communicator's work handles. Each rank that has waited 5 s in
/// its collective number `seq` writes "seq op" under its key in the
/// rendezvous store; at 10, 20, 40 ... s it reads the others' keys: a process
/// whose key is missing or lower has not reached this collective, and one at
/// the same number in another operation runs the collectives in another
/// order (one called on some processes only).
class SlowCollectiveWatch {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kPublishAfter{5};

  SlowCollectiveWatch(c10::intrusive_ptr<c10d::Store> store, std::string backend, int rank, int size,
                      std::chrono::milliseconds timeout, std::ostream& log = std::cerr)
      : store_(std::move(store)), backend_(std::move(backend)), rank_(rank), size_(size),
        timeout_(timeout), log_(log) {}

  /// The number the next collective gets (all ranks issue them in one order).
  std::uint64_t next_seq() { return seq_.fetch_add(1) + 1; }

  /// Called when a wait has gone on for `waited`: publish once, report when due.
  void waiting(const std::string& op, std::uint64_t seq, Clock::duration waited, bool& published,
               WaitReports& reports) {
    if (!published && waited >= kPublishAfter) {
      published = true;
      try {
        const std::string value = std::to_string(seq) + " " + op;
        store_->set(key(rank_), std::vector<uint8_t>(value.begin(), value.end()));
      } catch (const std::exception&) {
        // The store's host (rank 0) is gone: the collective fails by itself soon.
      }
    }
    if (!reports.due()) return;
    std::string missing, elsewhere;
    int absent = 0;
    try {
      for (int r = 0; r < size_; ++r) {
        if (r == rank_) continue;
        const auto [at, their_op] = progress(r);
        if (at < seq) {
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          ++absent;
        } else if (at == seq && their_op != op) {
          elsewhere += (elsewhere.empty() ? "" : ", ") + ("process " + std::to_string(r) + " is in " + their_op);
        }
      }
    } catch (const std::exception&) {
      missing.clear();
      elsewhere.clear();
    }
    log_ << "accel: rank " << rank_ << " has waited " << reports.seconds() << " s in " << backend_ << " "
         << op << " (its collective #" << seq << ") for the other processes; ";
    if (!elsewhere.empty())
      log_ << "at that collective " << elsewhere << ": the processes call collectives in different "
           << "orders (one called on some processes only, as a save_model() or gather inside "
           << "`if (is_main_process())`; every process must make the same calls)";
    else if (!missing.empty())
      log_ << (absent == 1 ? "process " : "processes ") << missing << (absent == 1 ? " has" : " have")
           << " not reached it (still computing or loading data, hung, or skipped this collective)";
    else
      log_ << "all have reached it (a slow network or a large tensor?)";
    log_ << ". It gives up after " << timeout_.count() / 1000 << " s." << std::endl;
  }

 private:
  static std::string key(int rank) { return "accel/collective_progress/" + std::to_string(rank); }

  /// Rank r's published collective number and operation (0 when none yet).
  std::pair<std::uint64_t, std::string> progress(int r) {
    if (!store_->check({key(r)})) return {0, ""};
    const auto v = store_->get(key(r));
    const std::string text(v.begin(), v.end());
    const auto space = text.find(' ');
    return {std::stoull(text.substr(0, space)), space == std::string::npos ? "" : text.substr(space + 1)};
  }

  c10::intrusive_ptr<c10d::Store> store_;
  std::string backend_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
  std::ostream& log_;
  std::atomic<std::uint64_t> seq_{0};  // collectives may be launched from autograd's threads
};

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_SLOW_COLLECTIVE_HPP
// end <accel/runtime/detail/slow_collective.hpp>
// begin <accel/runtime/heartbeat.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::heartbeat(): a worker's sign of progress for
/// the hang detection of accel's launchers (LaunchOptions::monitor_interval,
/// `accel launch --monitor_interval`). The launcher gives each worker a file
/// (ACCEL_HEARTBEAT_FILE); a heartbeat advances its modification time. A
/// file, not a pipe: it survives exec, and a worker in any language (a shell
/// script: `touch "$ACCEL_HEARTBEAT_FILE"`) can beat.
#ifndef ACCEL_RUNTIME_HEARTBEAT_HPP
#define ACCEL_RUNTIME_HEARTBEAT_HPP

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>

namespace accel::runtime {

/// Tells the launcher that this process makes progress. accel calls it for
/// every batch a prepared data loader yields and every collective that
/// completes; call it yourself in long stretches without either (a long
/// evaluation written by hand). Cheap: at most one file-time update per
/// 100 ms; does nothing when no launcher watches (ACCEL_HEARTBEAT_FILE unset).
inline void heartbeat() noexcept {
  // Lock-free: a child forked while another thread was here must not inherit a held lock.
  static std::atomic<pid_t> owner{-1};  // the process the file was opened for
  static std::atomic<int> fd{-1};
  static std::atomic<std::int64_t> last_ms{0};
  const pid_t me = ::getpid();
  pid_t seen = owner.load();
  if (seen != me) {
    if (!owner.compare_exchange_strong(seen, me)) return;  // another thread opens it
    const int inherited = fd.exchange(-1);
    if (inherited >= 0) ::close(inherited);  // a forked child's copy of its parent's file
    const char* path = std::getenv("ACCEL_HEARTBEAT_FILE");
    if (path != nullptr && *path != '\0') fd.store(::open(path, O_WRONLY | O_CLOEXEC));
    last_ms.store(0);
  }
  const int f = fd.load();
  if (f < 0) return;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::milliseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  std::int64_t prev = last_ms.load();
  if (now - prev < 100 || !last_ms.compare_exchange_strong(prev, now)) return;
  ::futimens(f, nullptr);  // modification time := now
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_HEARTBEAT_HPP
// end <accel/runtime/heartbeat.hpp>

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
// end <accel/runtime/c10d_communicator.hpp>
// begin <accel/runtime/store.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::make_store: the rendezvous key-value store
/// (c10d TCPStore on MASTER_ADDR:MASTER_PORT, or a c10d FileStore).
#ifndef ACCEL_RUNTIME_STORE_HPP
#define ACCEL_RUNTIME_STORE_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

// begin <accel/runtime/detail/tcp_probe.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines connect_tcp and try_connect (one TCP connection attempt with a
/// timeout: does a rendezvous address answer before c10d is asked to use it;
/// the launchers of several machines) and bind_tcp (a listening socket on the
/// address given, not on every interface).
#ifndef ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
#define ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <string>

namespace accel::runtime::detail {

/// Connects to host:port (each address it resolves to, in order) within
/// `timeout`. Returns the connected non-blocking, close-on-exec descriptor,
/// or -1 with `err` set to the errno of the last attempt: ECONNREFUSED (the
/// host answered, nobody listens there), ETIMEDOUT (no answer within
/// `timeout`), EHOSTUNREACH ..., or EADDRNOTAVAIL when the host does not resolve.
inline int connect_tcp(const std::string& host, int port, std::chrono::milliseconds timeout, int& err) {
  ::addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  err = EADDRNOTAVAIL;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int connected = -1;
  for (const ::addrinfo* a = found; a != nullptr && connected < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      err = errno;
      continue;
    }
    err = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (err == EINPROGRESS) {
      ::pollfd p{fd, POLLOUT, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(timeout.count()));
      socklen_t len = sizeof err;
      if (ready == 0) err = ETIMEDOUT;
      else if (ready < 0 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
    }
    if (err == 0) connected = fd;
    else ::close(fd);
  }
  ::freeaddrinfo(found);
  return connected;
}

/// Connects to host:port and closes again: 0 when something accepted, else
/// connect_tcp's errno.
inline int try_connect(const std::string& host, int port, std::chrono::milliseconds timeout) {
  int err = 0;
  const int fd = connect_tcp(host, port, timeout, err);
  if (fd >= 0) ::close(fd);
  return err;
}

/// An IPv4 TCP socket bound to addr:port (SO_REUSEADDR, as c10d's TCPStore
/// sets it, so sockets in TIME_WAIT do not count as taken). Returns the fd
/// or -errno.
inline int bind_tcp(const std::string& addr, int port) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  // An address of this machine we cannot bind to (a hostname, another host's
  // address) still tells us whether the port is free on all interfaces.
  if (addr.empty() || ::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1)
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  if (rc != 0 && errno == EADDRNOTAVAIL) {  // not one of our addresses: try all of them
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  }
  if (rc != 0 || ::listen(fd, 1) != 0) {
    const int err = errno;
    ::close(fd);
    return -err;
  }
  return fd;
}

}  // namespace accel::runtime::detail

#endif  // ACCEL_RUNTIME_DETAIL_TCP_PROBE_HPP
// end <accel/runtime/detail/tcp_probe.hpp>
// begin <accel/runtime/restart_count.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::restart_count(): which attempt of an elastic launch
/// this process belongs to (torchrun's TORCHELASTIC_RESTART_COUNT).
#ifndef ACCEL_RUNTIME_RESTART_COUNT_HPP
#define ACCEL_RUNTIME_RESTART_COUNT_HPP


namespace accel {

/// 0 on the first attempt of a launch, N after the N-th restart of the worker
/// group (LaunchOptions::max_restarts, `accel launch --max_restarts`); read
/// from TORCHELASTIC_RESTART_COUNT, which accel's launchers and torchrun set.
/// Unset (a plain run, mpirun): 0.
inline int restart_count() {
  const auto n = runtime::detail::getenv_int("TORCHELASTIC_RESTART_COUNT");
  ACCEL_CHECK(!n || *n >= 0, "accel: TORCHELASTIC_RESTART_COUNT=", *n,
              " is negative. Unset it, or let the launcher set it.");
  return n.value_or(0);
}

}  // namespace accel

#endif  // ACCEL_RUNTIME_RESTART_COUNT_HPP
// end <accel/runtime/restart_count.hpp>

namespace accel::runtime {

struct StoreOptions {
  /// How long a rank waits for the master (and rank 0 for every rank to join).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  /// When set, a c10d FileStore at this path (shared file system) replaces
  /// the TCP store; the file must not be left over from another job. After
  /// a restart (restart_count() N > 0) the path gets ".restart<N>" appended.
  std::optional<std::string> file_path;
};

namespace detail {

inline bool contains(const std::string& text, const char* what) {
  return text.find(what) != std::string::npos;
}

/// c10d reports failures as c10::Error with free text; turn them into
/// accel's errors that say what to do.
[[noreturn]] inline void rethrow_store_error(const std::exception& e, const ProcessEnv& env,
                                             std::chrono::milliseconds timeout) {
  const std::string msg = e.what();
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  if (env.rank == 0 && (contains(msg, "ddress already in use") || contains(msg, "failed to listen") ||
                        contains(msg, "failed to bind")))
    throw Error("accel: rank 0 cannot listen on " + where + ": port " +
                std::to_string(env.master_port) +
                " is already in use (another job, or a previous run still exiting). Choose "
                "another --main_process_port (MASTER_PORT), or 0 to let accel pick a free one.");
  if (contains(msg, "timed out") || contains(msg, "Timed out") || contains(msg, "timeout"))
    throw TimeoutError("accel: rank " + std::to_string(env.rank) + " could not rendezvous with " +
                       where + " within " + std::to_string(timeout.count()) +
                       " ms (" + msg.substr(0, msg.find('\n')) +
                       "). Check that rank 0 is running and MASTER_ADDR/MASTER_PORT are the same "
                       "on every rank, or raise the timeout.");
  throw Error("accel: rendezvous through " + where + " failed on rank " + std::to_string(env.rank) +
              ": " + msg.substr(0, msg.find('\n')) +
              ". Check MASTER_ADDR/MASTER_PORT and that every rank can reach rank 0.");
}

/// Rank 0's store listens on MASTER_ADDR only, not on every interface, where
/// LibTorch lets accel hand it the listening socket (TCPStoreOptions::
/// masterListenFd, LibTorch 2.x; 1.13 has none and listens everywhere). Only
/// for an IPv4 literal: a host name may resolve to IPv6 first, which the
/// clients would then try. An address that is not this machine's (behind
/// NAT) falls back to every interface, as before; a busy port is left to
/// c10d, whose error says so.
template <class Options>
void listen_on_given_address(Options& opts, const ProcessEnv& env) {
  if constexpr (requires { opts.masterListenFd = 0; }) {
    in_addr literal{};
    if (env.master_port == 0 || ::inet_pton(AF_INET, env.master_addr.c_str(), &literal) != 1) return;
    const int fd = bind_tcp(env.master_addr, env.master_port);
    if (fd < 0) return;
    ::listen(fd, 2048);  // every rank connects at once
    opts.masterListenFd = fd;  // the store owns it from here
  }
}

/// Text from the environment as messages quote it: at most 80 characters.
inline std::string shown(const std::string& text) {
  return "'" + (text.size() <= 80 ? text : text.substr(0, 80) + "...") + "'" +
         (text.size() <= 80 ? "" : " (" + std::to_string(text.size()) + " characters)");
}

/// An address that does not resolve is an error now, not a retry loop (c10d
/// retries it until the timeout, logging every second).
inline void check_resolves(const ProcessEnv& env) {
  const std::string& host = env.master_addr;
  const auto fail = [&](const std::string& why) {
    throw Error("accel: rank " + std::to_string(env.rank) + " cannot use MASTER_ADDR " +
                shown(host) + ": " + why + ". Give the host name or IP address of the machine "
                "running rank 0 (accel launch --main_process_ip).");
  };
  if (host.empty() || host.size() > 253) fail("it is not a host name");
  ::addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  ::addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc == 0) {
    ::freeaddrinfo(found);
    return;
  }
  fail(std::string(rc == EAI_AGAIN ? "it cannot be resolved now (" : "it does not resolve (") +
       ::gai_strerror(rc) + ")");
}

// Keys of accel's own join protocol (c10d's ProcessGroups use others).
inline constexpr const char* kJoinedKey = "accel/rendezvous/joined";
inline constexpr const char* kJobKey = "accel/rendezvous/job";
inline std::string joined_key(int rank) {
  std::string key(kJoinedKey);  // appended piecewise: GCC 12 at -O3 warns falsely on temporaries
  key += '/';
  key += std::to_string(rank);
  return key;
}

/// The ranks that have not joined yet, as "ranks 2, 3 (machine 1)".
inline std::string missing_ranks(c10d::Store& store, const ProcessEnv& env) {
  std::vector<int> missing;
  for (int r = 0; r < env.world_size && missing.size() < 16; ++r)
    if (!store.check({joined_key(r)})) missing.push_back(r);
  if (missing.empty()) return "none";
  std::string ranks, machines;
  int last_machine = -1;
  for (int r : missing) {
    ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    const int machine = r / std::max(1, env.local_world_size);
    if (machine != last_machine) machines += (machines.empty() ? "" : ", ") + std::to_string(machine);
    last_machine = machine;
  }
  return (missing.size() == 1 ? "rank " : "ranks ") + ranks + (missing.size() == 16 ? ", ..." : "") +
         " (machine " + machines + ")";
}

/// Rank 0: every rank has joined, or a TimeoutError saying who has not.
inline void wait_for_ranks(c10d::Store& store, const ProcessEnv& env, std::chrono::milliseconds timeout,
                           const std::string& where, std::ostream& log) {
  WaitReports reports(WaitReports::Clock::now());
  const auto deadline = WaitReports::Clock::now() + timeout;
  while (true) {
    const auto joined = store.add(kJoinedKey, 0);
    if (joined >= env.world_size) return;
    if (WaitReports::Clock::now() >= deadline)
      throw TimeoutError("accel: rank 0 waited " + std::to_string(reports.seconds()) + " s at " +
                         where + " and " + std::to_string(joined) + " of " +
                         std::to_string(env.world_size) + " processes joined; missing: " +
                         missing_ranks(store, env) + ". Start every machine's launch with the "
                         "same --main_process_ip and --main_process_port (MASTER_ADDR/MASTER_PORT), "
                         "check that they can reach this one, or raise --rdzv_timeout.");
    if (reports.due())
      log << "accel: rank 0 waiting at " << where << " for the other processes (" << joined
          << " of " << env.world_size << " joined, missing " << missing_ranks(store, env) << ", "
          << reports.seconds() << " s of " << timeout.count() / 1000 << " s)" << std::endl;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

/// This launch's job id (ACCEL_JOB_ID, set by accel's launchers), if any.
inline std::optional<std::string> job_id() { return getenv_str("ACCEL_JOB_ID"); }

/// A rank that reached another job's store (two launches on one port) leaves
/// before it touches anything there.
inline void check_same_job(c10d::Store& store, const ProcessEnv& env, const std::string& where) {
  const auto mine = job_id();
  if (!mine) return;
  // Rank 0 sets the key right after it starts serving; a store without it
  // after a while belongs to a launch that does not set job ids.
  const auto until = WaitReports::Clock::now() + std::chrono::seconds(10);
  while (!store.check({kJobKey}) && WaitReports::Clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::string theirs = "(none)";
  if (store.check({kJobKey})) {
    const auto bytes = store.get(kJobKey);
    theirs.assign(bytes.begin(), bytes.end());
  }
  if (theirs != *mine)
    throw Error("accel: rank " + std::to_string(env.rank) + " reached the store of another job at " +
                where + " (job " + shown(theirs) + "; this is job " + shown(*mine) +
                "): two launches use port " + std::to_string(env.master_port) +
                ". Give each job its own --main_process_port (MASTER_PORT), or 0 to let accel pick.");
}

}  // namespace detail

/// The store every rank of `env` meets in. Rank 0 serves a TCPStore on
/// env.master_port and waits (up to the timeout) for all ranks to connect;
/// the others connect to env.master_addr:env.master_port. With
/// options.file_path, a FileStore instead (no network).
inline c10::intrusive_ptr<c10d::Store> make_store(const ProcessEnv& env, StoreOptions options = {}) {
  if (options.file_path) {
    // A restarted group (elastic launch) must not meet in the file of the
    // attempt that failed: its counters and keys are stale.
    if (const int n = restart_count(); n > 0) *options.file_path += ".restart" + std::to_string(n);
    try {
      auto store = c10::make_intrusive<c10d::FileStore>(*options.file_path, env.world_size);
      store->setTimeout(options.timeout);
      return store;
    } catch (const std::exception& e) {
      throw Error("accel: cannot open the file store '" + *options.file_path + "': " + e.what() +
                  ". Give a path in a writable directory shared by all ranks.");
    }
  }
  ACCEL_CHECK(env.master_port >= 0 && env.master_port <= 65535, "accel: MASTER_PORT ",
              env.master_port, " is not a TCP port. Give a port between 1 and 65535.");
  if (const auto t = detail::getenv_int("ACCEL_RDZV_TIMEOUT")) {
    ACCEL_CHECK(*t > 0, "accel: ACCEL_RDZV_TIMEOUT=", *t, " is not a number of seconds. Give a "
                "positive timeout (accel launch --rdzv_timeout).");
    options.timeout = std::chrono::seconds(*t);
  }
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  detail::check_resolves(env);
  // TCPStore(host, TCPStoreOptions) exists from LibTorch 1.13 through 2.x; the
  // positional constructor is deprecated in 1.13 and gone later.
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(env.master_port);
  opts.isServer = env.rank == 0;
  opts.numWorkers = static_cast<std::size_t>(env.world_size);
  // accel waits for the ranks itself (below), saying who is missing; c10d's
  // own wait is silent for the whole timeout.
  opts.waitWorkers = false;
  opts.timeout = options.timeout;
#if ACCEL_TORCH_AT_LEAST(2, 4)
  // From 2.4 TCPStore defaults to a libuv server, which Debian's and other
  // source builds of LibTorch lack ("use_libuv was requested but PyTorch was
  // build without libuv support"); the classic server is in every build.
  opts.useLibUV = false;
#endif
  if (opts.isServer) detail::listen_on_given_address(opts, env);
  std::ostream& log = std::cerr;
  detail::WaitReports reports(detail::WaitReports::Clock::now());
  const auto deadline = detail::WaitReports::Clock::now() + options.timeout;
  if (!opts.isServer) {
    // Until rank 0's port answers, say what we wait for (c10d's own connect
    // retries are silent, and differ between LibTorch versions).
    while (true) {
      const int err = detail::try_connect(env.master_addr, env.master_port, std::chrono::seconds(1));
      if (err == 0) break;
      if (detail::WaitReports::Clock::now() >= deadline)
        throw TimeoutError("accel: rank " + std::to_string(env.rank) + " could not rendezvous with " +
                           where + " within " + std::to_string(options.timeout.count()) +
                           " ms (nothing accepted a connection there: " + std::strerror(err) +
                           "). Check that rank 0 is running and MASTER_ADDR/MASTER_PORT are the "
                           "same on every rank, or raise the timeout (--rdzv_timeout).");
      if (reports.due())
        log << "accel: rank " << env.rank << " waiting for rank 0 at " << where << " ("
            << reports.seconds() << " s of " << options.timeout.count() / 1000
            << " s): is rank 0 started, and is this its address?" << std::endl;
      if (err == ECONNREFUSED) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    opts.timeout = std::max(std::chrono::milliseconds(1000),
                            std::chrono::duration_cast<std::chrono::milliseconds>(
                                deadline - detail::WaitReports::Clock::now()));
  }
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  } catch (const std::exception& e) {
    detail::rethrow_store_error(e, env, options.timeout);
  }
  store->setTimeout(options.timeout);
  try {
    if (env.rank == 0) {
      if (const auto job = detail::job_id()) store->set(detail::kJobKey, std::vector<uint8_t>(job->begin(), job->end()));
    } else {
      detail::check_same_job(*store, env, where);
    }
    store->set(detail::joined_key(env.rank), std::vector<uint8_t>{1});
    store->add(detail::kJoinedKey, 1);
    if (env.rank == 0) detail::wait_for_ranks(*store, env, options.timeout, where, log);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    detail::rethrow_store_error(e, env, options.timeout);
  }
  return store;
}

}  // namespace accel::runtime

#endif  // ACCEL_RUNTIME_STORE_HPP
// end <accel/runtime/store.hpp>

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
// end <accel/runtime/gloo_communicator.hpp>
// begin <accel/runtime/mpi_communicator.hpp>
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

// begin <accel/runtime/detail/mpi.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Includes MPI's C interface, the only one accel uses. Without the
/// SKIP macros OpenMPI's and MPICH's mpi.h also define the C++ bindings
/// (removed from the MPI standard in 3.0), whose classes and vtables every
/// translation unit would compile: about a second each.
#ifndef ACCEL_RUNTIME_DETAIL_MPI_HPP
#define ACCEL_RUNTIME_DETAIL_MPI_HPP

#if ACCEL_WITH_MPI
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#endif

#endif  // ACCEL_RUNTIME_DETAIL_MPI_HPP
// end <accel/runtime/detail/mpi.hpp>
// begin <accel/runtime/detail/mpi_runtime.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::detail::MpiRuntime: MPI initialised once per
/// process (finalised at exit unless the user initialised it), and the join of
/// processes that mpirun did not start (OpenMPI singletons + ompi-server).
#ifndef ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP
#define ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP

#if ACCEL_WITH_MPI

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>


namespace accel::runtime::detail {

inline std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(len));
}

/// True when an MPI launcher (mpirun/mpiexec, srun with PMI/PMIx) started us.
inline bool started_by_mpi_launcher() {
  return getenv_str("OMPI_COMM_WORLD_SIZE") || getenv_str("PMIX_RANK") || getenv_str("PMI_SIZE") ||
         getenv_str("PMI_RANK");
}

/// Process-wide MPI state: one MPI_Init_thread, one MPI_Finalize at exit.
class MpiRuntime {
 public:
  static MpiRuntime& instance() {
    static MpiRuntime runtime;
    return runtime;
  }

  /// Initialises MPI unless someone (the user, or an earlier call) did.
  void ensure_initialized() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    ACCEL_CHECK(!finalized, "accel: MPI was already finalised in this process. Create the MPI "
                            "communicator before MPI_Finalize.");
    if (!initialized) {
      int provided = 0;
      int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      ACCEL_CHECK(rc == MPI_SUCCESS, "accel: MPI_Init_thread failed: ", mpi_error_string(rc),
                  ". Check the MPI installation (try `mpirun -np 2 hostname`).");
      owns_mpi_ = true;
    }
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    multiple_ = level >= MPI_THREAD_MULTIPLE;
  }

  /// Locks MPI calls unless MPI is thread-safe (MPI_THREAD_MULTIPLE).
  std::unique_lock<std::mutex> lock() {
    return multiple_ ? std::unique_lock<std::mutex>(call_mutex_, std::defer_lock)
                     : std::unique_lock<std::mutex>(call_mutex_);
  }

  bool thread_multiple() const { return multiple_; }
  bool owns_mpi() const { return owns_mpi_; }

  /// An ompi-server this process started for the singleton join; ended at exit.
  void adopt_server(pid_t pid) { server_pid_ = pid; }

  /// MPI_Finalize (if accel initialised MPI) and stop ompi-server. Runs at
  /// exit; call it yourself only before leaving through _exit.
  void shutdown() {
    std::lock_guard<std::mutex> guard(init_mutex_);
    int initialized = 0, finalized = 1;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (owns_mpi_ && initialized && !finalized) MPI_Finalize();
    if (server_pid_ > 0) {
      ::kill(server_pid_, SIGTERM);
      ::waitpid(server_pid_, nullptr, 0);
      server_pid_ = -1;
    }
  }

  ~MpiRuntime() { shutdown(); }

  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

 private:
  MpiRuntime() = default;
  std::mutex init_mutex_, call_mutex_;
  bool owns_mpi_ = false, multiple_ = false;
  pid_t server_pid_ = -1;
};

inline std::string store_get_string(c10d::Store& store, const std::string& key) {
  auto v = store.get(key);
  return std::string(v.begin(), v.end());
}

inline void store_set_string(c10d::Store& store, const std::string& key, const std::string& value) {
  store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

inline std::string find_program(const std::string& name) {
  auto path = getenv_str("PATH").value_or("/usr/bin:/bin");
  std::size_t start = 0;
  while (start <= path.size()) {
    auto end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::filesystem::path p = std::filesystem::path(path.substr(start, end - start)) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
    start = end + 1;
  }
  return {};
}

/// Rank 0: starts `ompi-server` and returns its URI (read from --report-uri).
inline std::string start_ompi_server(std::chrono::milliseconds timeout) {
  const std::string exe = find_program("ompi-server");
  ACCEL_CHECK(!exe.empty(), "accel: backend::Mpi in processes not started by mpirun needs "
                            "OpenMPI's ompi-server, which is not on PATH (OpenMPI 5 no longer "
                            "ships it). Start the program with `mpirun -np N`, or use "
                            "backend::Gloo with notebook_launcher and `accel launch`.");
  const auto uri_file = std::filesystem::temp_directory_path() /
                        ("accel-ompi-server-" + std::to_string(::getpid()) + ".uri");
  std::filesystem::remove(uri_file);
  pid_t pid = ::fork();
  ACCEL_CHECK(pid >= 0, "accel: cannot fork ompi-server. Start the program with `mpirun -np N`.");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlives rank 0
    ::execl(exe.c_str(), exe.c_str(), "--no-daemonize", "--report-uri", uri_file.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  MpiRuntime::instance().adopt_server(pid);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string uri;
  while (uri.empty()) {
    std::ifstream in(uri_file);
    if (in) std::getline(in, uri);
    if (!uri.empty()) break;
    int status = 0;
    ACCEL_CHECK(::waitpid(pid, &status, WNOHANG) == 0,
                "accel: ompi-server exited before reporting its address. Start the program with "
                "`mpirun -np N` instead.");
    ACCEL_CHECK(std::chrono::steady_clock::now() < deadline,
                "accel: ompi-server did not report its address in time. Start the program with "
                "`mpirun -np N` instead.");
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::filesystem::remove(uri_file);
  return uri;
}

/// Joins `world_size` OpenMPI singletons into one intra-communicator whose
/// ranks equal env.rank: rank 0 opens a port, then rank k connects while
/// ranks 0..k-1 accept, and each step merges (the newcomer last). The port
/// name and ompi-server's URI travel through the c10d store. Must run before
/// MPI_Init: OMPI_MCA_pmix_server_uri is read there.
inline MPI_Comm join_singletons(const ProcessEnv& env, c10d::Store& store,
                                std::chrono::milliseconds timeout) {
  auto& rt = MpiRuntime::instance();
  int initialized = 0;
  MPI_Initialized(&initialized);
  ACCEL_CHECK(!initialized, "accel: MPI is already initialised but this process was not started "
                            "by mpirun, so its ranks cannot be joined. Start the program with "
                            "`mpirun -np N`, or let accel initialise MPI.");
  if (env.rank == 0) {
    std::string uri;
    try {
      uri = start_ompi_server(timeout);
    } catch (...) {
      store_set_string(store, "accel/mpi/uri", "");
      throw;
    }
    store_set_string(store, "accel/mpi/uri", uri);
  }
  std::string uri;
  try {
    uri = store_get_string(store, "accel/mpi/uri");
  } catch (const std::exception& e) {
    // Rank 0 serves the store: when it fails here, its exit cuts the
    // connection, and the launcher must report rank 0's error, not this one.
    const std::string what = e.what();
    throw Error(accel::detail::concat("accel: backend::Mpi: rank ", env.rank, " lost the rendezvous "
                                      "store on rank 0 while joining (", what.substr(0, what.find('\n')),
                                      "). ", accel::detail::kPeerVanished, " or failed: look at rank 0's error."));
  }
  ACCEL_CHECK(!uri.empty(), "accel: rank 0 could not start ompi-server for backend::Mpi ",
              accel::detail::kFailedElsewhere, ". Start the program with `mpirun -np N`.");
  ::setenv("OMPI_MCA_pmix_server_uri", uri.c_str(), 1);
  rt.ensure_initialized();

  char port[MPI_MAX_PORT_NAME] = {0};
  if (env.rank == 0) {
    MPI_Open_port(MPI_INFO_NULL, port);
    store_set_string(store, "accel/mpi/port", port);
  }
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_SELF, &comm);
  for (int k = 1; k < env.world_size; ++k) {
    if (env.rank > k) continue;  // not started yet: joins at step env.rank
    MPI_Comm inter = MPI_COMM_NULL, merged = MPI_COMM_NULL;
    int rc;
    if (env.rank < k) {
      if (env.rank == 0) store_set_string(store, "accel/mpi/accepting/" + std::to_string(k), "1");
      rc = MPI_Comm_accept(port, MPI_INFO_NULL, 0, comm, &inter);
    } else {
      store.wait({"accel/mpi/accepting/" + std::to_string(k)}, timeout);
      const std::string name = store_get_string(store, "accel/mpi/port");
      rc = MPI_Comm_connect(name.c_str(), MPI_INFO_NULL, 0, MPI_COMM_SELF, &inter);
    }
    ACCEL_CHECK(rc == MPI_SUCCESS, "accel: rank ", env.rank, " could not join MPI rank ", k, ": ",
                mpi_error_string(rc), ". Start the program with `mpirun -np N`.");
    MPI_Intercomm_merge(inter, env.rank == k ? 1 : 0, &merged);
    MPI_Comm_free(&inter);
    MPI_Comm_free(&comm);
    comm = merged;
  }
  if (env.rank == 0) MPI_Close_port(port);
  int r = -1, n = 0;
  MPI_Comm_rank(comm, &r);
  MPI_Comm_size(comm, &n);
  ACCEL_CHECK(r == env.rank && n == env.world_size, "accel: joined MPI ranks disagree with the "
              "environment (rank ", r, " of ", n, " vs ", env.rank, " of ", env.world_size,
              "). Start the program with `mpirun -np N`.");
  return comm;
}

}  // namespace accel::runtime::detail

#endif  // ACCEL_WITH_MPI

#endif  // ACCEL_RUNTIME_DETAIL_MPI_RUNTIME_HPP
// end <accel/runtime/detail/mpi_runtime.hpp>
// begin <accel/runtime/detail/mpi_work.hpp>
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
// end <accel/runtime/detail/mpi_work.hpp>

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
// end <accel/runtime/mpi_communicator.hpp>

#endif  // ACCEL_RUNTIME_HPP
// end <accel/runtime.hpp>
// begin <accel/logging.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the logging area: accel::get_logger (Accelerate's
/// get_logger over spdlog), Logger, LogOptions, and the ACCEL_LOG_LEVEL
/// levels (docs/logging.md).
#ifndef ACCEL_LOGGING_HPP
#define ACCEL_LOGGING_HPP

// begin <accel/logging/level.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::logging::Level (spdlog's levels), their names, and
/// the level a new logger gets: ACCEL_LOG_LEVEL, else info.
#ifndef ACCEL_LOGGING_LEVEL_HPP
#define ACCEL_LOGGING_LEVEL_HPP

#include <array>
#include <cctype>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include <spdlog/common.h>


namespace accel::logging {

/// spdlog's levels: spdlog::level::trace, debug, info, warn, err, critical, off.
using Level = spdlog::level::level_enum;

namespace detail {

/// The names ACCEL_LOG_LEVEL accepts (any case), least to most severe.
inline constexpr std::array<std::pair<std::string_view, Level>, 7> kLevelNames{{
    {"trace", Level::trace},
    {"debug", Level::debug},
    {"info", Level::info},
    {"warning", Level::warn},
    {"error", Level::err},
    {"critical", Level::critical},
    {"off", Level::off},
}};

}  // namespace detail

/// The level named `name` (trace, debug, info, warning, error, critical or
/// off, any case); empty when it names none.
inline std::optional<Level> parse_level(std::string_view name) {
  std::string lower(name);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const auto& [n, level] : detail::kLevelNames)
    if (lower == n) return level;
  return std::nullopt;
}

/// The name parse_level() reads for `level` ("warning", not spdlog's "warn").
inline std::string_view level_name(Level level) {
  for (const auto& [n, l] : detail::kLevelNames)
    if (l == level) return n;
  return "off";
}

/// The level ACCEL_LOG_LEVEL names; info when it is unset or empty. Any
/// other value is a ConfigError that names the variable and the choices.
inline Level level_from_env() {
  auto value = runtime::detail::getenv_str("ACCEL_LOG_LEVEL");
  if (!value) return Level::info;
  if (auto level = parse_level(*value)) return *level;
  // The choices spelled out (as kLevelNames has them) so that docs/errors.md shows them.
  throw ConfigError(accel::detail::concat(
      "accel: environment variable ACCEL_LOG_LEVEL='", value->substr(0, 100),
      "' is not a log level. Set it to one of trace, debug, info, warning, error, critical, off "
      "(any case), or unset it for info."));
}

}  // namespace accel::logging

#endif  // ACCEL_LOGGING_LEVEL_HPP
// end <accel/logging/level.hpp>
// begin <accel/logging/logger.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::logging::Logger and get_logger: Accelerate's
/// get_logger / MultiProcessAdapter over spdlog. A message is logged on the
/// main process only unless LogOptions say otherwise; every line carries
/// "[rank r/n] "; the level of a new logger comes from ACCEL_LOG_LEVEL.
#ifndef ACCEL_LOGGING_LOGGER_HPP
#define ACCEL_LOGGING_LOGGER_HPP

#include <concepts>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#ifdef SPDLOG_USE_STD_FORMAT
#include <format>
#endif

#include <spdlog/logger.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>


namespace accel::logging {

/// Per-call choices, as Accelerate's log(..., main_process_only=, in_order=).
struct LogOptions {
  /// true: only the main process (rank 0) logs; false: every process does.
  bool main_process_only = true;
  /// true: every process logs, one after another in rank order (rank 0's
  /// line first), whatever main_process_only says. Collective: every process
  /// must make the call, and the logger needs a barrier (get_logger(name,
  /// accelerator)) when there is more than one process.
  bool in_order = false;
};

/// A named spdlog logger seen from one process of the job. Cheap to copy:
/// copies share the spdlog logger (its sinks and level).
class Logger {
 public:
  /// `barrier` may be null: then in_order is only possible in a job of one process.
  Logger(std::shared_ptr<::spdlog::logger> logger, int process_index, int num_processes,
         runtime::Communicator* barrier = nullptr)
      : logger_(std::move(logger)),
        rank_(process_index),
        world_(num_processes),
        barrier_(barrier),
        prefix_("[rank " + std::to_string(process_index) + "/" + std::to_string(num_processes) + "] ") {}

  // log.info("loss {}", x): main process only. log.info({.main_process_only = false}, ...):
  // every process. log.info({.in_order = true}, ...): every process, in rank order.
  template <class... A>
  void trace(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::trace, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void trace(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::trace, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void debug(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::debug, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void debug(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::debug, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void info(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::info, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void info(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::info, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void warning(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::warn, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void warning(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::warn, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void error(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::err, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void error(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::err, options, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void critical(::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::critical, LogOptions{}, fmt, std::forward<A>(args)...);
  }
  template <class... A>
  void critical(const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    log(Level::critical, options, fmt, std::forward<A>(args)...);
  }

  /// The message at `level`, on the processes `options` choose. Below the
  /// logger's level nothing happens, not even in_order's barriers (so every
  /// process needs the same level: ACCEL_LOG_LEVEL is inherited by launched
  /// processes).
  template <class... A>
  void log(Level level, const LogOptions& options, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    if (!logger_->should_log(level)) return;
    if (options.in_order) {
      check_barrier();
      // Every process takes its turn, then all wait: rank 0 writes (and
      // flushes) first, rank 1 after the first barrier, and so on. A process
      // whose write fails still joins the barriers, so no one hangs on it.
      std::exception_ptr failure;
      for (int r = 0; r < world_; ++r) {
        if (r == rank_) {
          try {
            write(level, fmt, std::forward<A>(args)...);
            logger_->flush();
          } catch (...) {
            failure = std::current_exception();
          }
        }
        if (world_ > 1) barrier_->barrier();
      }
      if (failure) std::rethrow_exception(failure);
      return;
    }
    if (options.main_process_only && rank_ != 0) return;
    write(level, fmt, std::forward<A>(args)...);
  }

  /// Whether a message at `level` would be written (on a process that logs it).
  bool enabled(Level level) const { return logger_->should_log(level); }
  Level level() const { return logger_->level(); }
  /// This process's level for this name (every copy, every get_logger of it).
  void set_level(Level level) { logger_->set_level(level); }
  const std::string& name() const { return logger_->name(); }
  int process_index() const { return rank_; }
  int num_processes() const { return world_; }
  /// "[rank r/n] ", what every message starts with.
  const std::string& prefix() const { return prefix_; }
  void flush() { logger_->flush(); }
  /// The spdlog logger underneath: its sinks (add a file, replace the
  /// console), pattern, flush policy. Shared with every Logger of this name.
  const std::shared_ptr<::spdlog::logger>& spdlog_logger() const { return logger_; }

 private:
  void check_barrier() const {
    if (world_ > 1 && barrier_ == nullptr)
      throw Error(accel::detail::concat(
          "accel: logger '", logger_->name(), "' cannot log in_order: it has no barrier across the ",
          world_, " processes. Get it with accel::get_logger(\"", logger_->name(),
          "\", accelerator) to log in rank order."));
  }

  template <class... A>
  void write(Level level, ::spdlog::format_string_t<A...> fmt, A&&... args) {
    ::spdlog::memory_buf_t buf;
    buf.append(prefix_.data(), prefix_.data() + prefix_.size());
#ifdef SPDLOG_USE_STD_FORMAT
    std::vformat_to(std::back_inserter(buf), fmt, std::make_format_args(args...));
#else
    ::fmt::format_to(std::back_inserter(buf), fmt, std::forward<A>(args)...);
#endif
    logger_->log(level, ::spdlog::string_view_t(buf.data(), buf.size()));
  }

  std::shared_ptr<::spdlog::logger> logger_;
  int rank_;
  int world_;
  runtime::Communicator* barrier_;
  std::string prefix_;
};

namespace detail {

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

/// spdlog's logger of that name (registered in spdlog's registry, so
/// spdlog::get(name) finds it too); made when there is none: a colored
/// stderr sink, spdlog's default pattern, `level`.
inline std::shared_ptr<::spdlog::logger> named_logger(std::string_view name, Level level) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::string key(name);
  if (auto existing = ::spdlog::get(key)) return existing;
  auto logger = std::make_shared<::spdlog::logger>(key, std::make_shared<::spdlog::sinks::stderr_color_sink_mt>());
  logger->set_level(level);
  ::spdlog::register_logger(logger);
  return logger;
}

template <class A>
concept HasCommunicator = requires(A& a) {
  { a.communicator() } -> std::convertible_to<runtime::Communicator&>;
};

}  // namespace detail

/// The logger `name` of this process, rank and world from the environment
/// (API.md section 5). Made on first use with ACCEL_LOG_LEVEL's level (info
/// when unset); later calls share it and keep its level. ACCEL_LOG_LEVEL is
/// checked on every call: a value that is not a level is a ConfigError.
/// in_order needs the overload with an accelerator when there is more than
/// one process.
inline Logger get_logger(std::string_view name) {
  const Level level = level_from_env();
  const auto env = runtime::ProcessEnv::discover();
  return Logger(detail::named_logger(name, level), env.rank, env.world_size);
}

/// The same, rank and world from `comm`, whose barrier orders in_order
/// messages. The logger must not outlive the communicator.
inline Logger get_logger(std::string_view name, runtime::Communicator& comm) {
  const Level level = level_from_env();
  return Logger(detail::named_logger(name, level), comm.rank(), comm.size(), &comm);
}

/// The same, bound to an Accelerator (its communicator): what in_order
/// needs. The logger must not outlive the accelerator.
template <detail::HasCommunicator A>
Logger get_logger(std::string_view name, A& accelerator) {
  return get_logger(name, accelerator.communicator());
}

}  // namespace accel::logging

namespace accel {
using logging::get_logger;
using logging::Logger;
using logging::LogOptions;
}  // namespace accel

#endif  // ACCEL_LOGGING_LOGGER_HPP
// end <accel/logging/logger.hpp>

#endif  // ACCEL_LOGGING_HPP
// end <accel/logging.hpp>
// begin <accel/backend.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the backend policies.
#ifndef ACCEL_BACKEND_HPP
#define ACCEL_BACKEND_HPP

// begin <accel/backend/concept.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a backend policy is: the trait, the concept and the
/// asserting check whose messages say what is missing.
#ifndef ACCEL_BACKEND_CONCEPT_HPP
#define ACCEL_BACKEND_CONCEPT_HPP

#include <concepts>
#include <memory>
#include <string_view>
#include <type_traits>


namespace accel {

/// A backend policy says where tensors live and how ranks talk:
///   static constexpr std::string_view name;
///   static constexpr bool multi_process;   // false: one process whatever the environment says
///   static constexpr bool available;       // compiled into this build
///   static torch::Device device(const runtime::ProcessEnv&);
///   static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv&,
///                                                                   const AcceleratorOptions&);
namespace backend::detail {
// One concept per member, so that check_backend_policy names the missing one.
template <class B>
concept has_name = requires { { B::name } -> std::convertible_to<std::string_view>; };
template <class B>
concept has_multi_process = requires { { B::multi_process } -> std::convertible_to<bool>; };
template <class B>
concept has_available = requires { { B::available } -> std::convertible_to<bool>; };
template <class B>
concept has_device = requires(const runtime::ProcessEnv& env) {
  { B::device(env) } -> std::same_as<torch::Device>;
};
template <class B>
concept has_make_communicator = requires(const runtime::ProcessEnv& env, const AcceleratorOptions& opts) {
  { B::make_communicator(env, opts) } -> std::same_as<std::shared_ptr<runtime::Communicator>>;
};
}  // namespace backend::detail

template <class B>
concept BackendPolicy = backend::detail::has_name<B> && backend::detail::has_multi_process<B> &&
                        backend::detail::has_available<B> && backend::detail::has_device<B> &&
                        backend::detail::has_make_communicator<B>;

template <class B>
struct is_backend_policy : std::bool_constant<BackendPolicy<B>> {};
template <class B>
inline constexpr bool is_backend_policy_v = is_backend_policy<B>::value;

/// A type with none of a backend's own members (every policy has a name) is
/// not meant as one, say a precision in the wrong place: one message says
/// which to use. A backend that lacks some gets one message per member.
template <class B>
struct check_backend_policy {
  static constexpr bool own_member = backend::detail::has_multi_process<B> || backend::detail::has_available<B> ||
                                     backend::detail::has_device<B> || backend::detail::has_make_communicator<B>;
  static_assert(own_member,
                "accel: the Backend parameter of Accelerator is not a backend policy. Use "
                "accel::backend::SingleDevice, Gloo, Mpi or Nccl (or see docs/backends.md to write one).");
  static_assert(!own_member || backend::detail::has_name<B>,
                "accel: this backend policy has no `static constexpr std::string_view name`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_multi_process<B>,
                "accel: this backend policy has no `static constexpr bool multi_process`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_available<B>,
                "accel: this backend policy has no `static constexpr bool available`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_device<B>,
                "accel: this backend policy has no `static torch::Device device(const runtime::ProcessEnv&)`. "
                "Add it (docs/backends.md, \"Writing a backend\").");
  static_assert(!own_member || backend::detail::has_make_communicator<B>,
                "accel: this backend policy has no `static std::shared_ptr<runtime::Communicator> "
                "make_communicator(const runtime::ProcessEnv&, const AcceleratorOptions&)`. Add it "
                "(docs/backends.md, \"Writing a backend\").");
  static constexpr bool value = is_backend_policy_v<B>;
};

}  // namespace accel

#endif  // ACCEL_BACKEND_CONCEPT_HPP
// end <accel/backend/concept.hpp>
// begin <accel/backend/gloo.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Gloo: PyTorch's c10d Gloo process group.
#ifndef ACCEL_BACKEND_GLOO_HPP
#define ACCEL_BACKEND_GLOO_HPP

#include <memory>
#include <string_view>


namespace accel::backend {

/// CPU tensors (and CUDA) across processes and machines; rendezvous through
/// a c10d TCPStore at MASTER_ADDR:MASTER_PORT, or a FileStore
/// (AcceleratorOptions::file_store).
struct Gloo {
  static constexpr std::string_view name = runtime::GlooCommunicator::name;
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "gloo";
  static constexpr bool multi_process = true;
  static constexpr bool available = true;

  static torch::Device device(const runtime::ProcessEnv& env) {
    if (torch::cuda::is_available())
      return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                             env.local_rank % static_cast<int>(torch::cuda::device_count())));
    return torch::Device(torch::kCPU);
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv& env,
                                                                  const AcceleratorOptions& opts) {
    if (env.world_size == 1) return std::make_shared<runtime::LocalCommunicator>();
    runtime::GlooOptions g;
    g.timeout = opts.timeout;
    g.file_store = opts.file_store;
    return runtime::make_gloo_communicator(env, g);
  }
};

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_GLOO_HPP
// end <accel/backend/gloo.hpp>
// begin <accel/backend/mpi.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Mpi: MPI's shared-memory collectives, run on a progress thread.
#ifndef ACCEL_BACKEND_MPI_HPP
#define ACCEL_BACKEND_MPI_HPP

#include <cstdlib>
#include <memory>
#include <string_view>

#if ACCEL_WITH_MPI
#endif

namespace accel::backend {

/// CPU tensors; ranks from mpirun/srun (OMPI_COMM_WORLD_*, PMI_*). Shared
/// memory all-reduce on one machine is several times faster than Gloo's TCP.
struct Mpi {
  static constexpr std::string_view name = "Mpi";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "mpi";
  static constexpr bool multi_process = true;
  static constexpr bool available = ACCEL_WITH_MPI;

  static torch::Device device(const runtime::ProcessEnv&) { return torch::Device(torch::kCPU); }
  static std::shared_ptr<runtime::Communicator> make_communicator(
      [[maybe_unused]] const runtime::ProcessEnv& env,
      [[maybe_unused]] const AcceleratorOptions& opts) {
#if ACCEL_WITH_MPI
    runtime::MpiOptions m;
    m.timeout = opts.timeout;
    m.file_store = opts.file_store;
    // ACCEL_MPI_PROGRESS=thread|test (default thread): see runtime::MpiProgress.
    if (const char* v = std::getenv("ACCEL_MPI_PROGRESS"); v && *v) {
      const std::string_view s(v);
      ACCEL_CHECK(s == "thread" || s == "test", "accel: ACCEL_MPI_PROGRESS='", s,
                  "' is not a progress mode. Use thread or test, or unset it.");
      m.progress = s == "thread" ? runtime::MpiProgress::Thread : runtime::MpiProgress::Test;
    }
    return runtime::make_mpi_communicator(env, m);
#else
    throw Error("accel: backend::Mpi is not available in this build. Use backend::Gloo.");
#endif
  }
};

#if ACCEL_WITH_MPI
static_assert(Mpi::name == runtime::MpiCommunicator::name);
#endif

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_MPI_HPP
// end <accel/backend/mpi.hpp>
// begin <accel/backend/nccl.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::Nccl: c10d's NCCL process group, one CUDA
/// device per process. Usable only where ACCEL_WITH_NCCL is 1 (a CUDA build of
/// LibTorch); elsewhere Accelerator<backend::Nccl> is a compile error.
#ifndef ACCEL_BACKEND_NCCL_HPP
#define ACCEL_BACKEND_NCCL_HPP

#include <memory>
#include <string_view>

// begin <accel/runtime/nccl_communicator.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::runtime::NcclCommunicator: the Communicator over c10d's
/// ProcessGroupNCCL, one CUDA device per process. Only in CUDA builds of
/// LibTorch (ACCEL_WITH_NCCL); backend::Nccl is its only user.
#ifndef ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP
#define ACCEL_RUNTIME_NCCL_COMMUNICATOR_HPP

#if ACCEL_WITH_NCCL

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <torch/torch.h>


namespace accel::runtime {

/// Communicator over c10d::ProcessGroupNCCL on this process's CUDA device;
/// tensors elsewhere are refused with a message (NCCL reads GPU memory only).
class NcclCommunicator final : public C10dCommunicator {
 public:
  static constexpr std::string_view name = "Nccl";

  NcclCommunicator(c10::intrusive_ptr<c10d::Store> store, const ProcessEnv& env,
                   torch::Device device, std::chrono::milliseconds timeout)
      : C10dCommunicator(name, std::move(store), env, device, Staging::Refuse, timeout) {
    c10::cuda::set_device(device_.index());
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout_;
    make_group([&] { return c10::make_intrusive<c10d::ProcessGroupNCCL>(store_, rank_, size_, opts); });
  }

  void barrier() override {
    // A one-element all-reduce on this rank's device: NCCL's own barrier
    // guesses the device from the rank, which is wrong with several nodes.
    auto t = torch::zeros({1}, torch::TensorOptions().device(device_));
    all_reduce(t)->wait();
    torch::cuda::synchronize(device_.index());
  }
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
// end <accel/runtime/nccl_communicator.hpp>

namespace accel::backend {

struct Nccl {
  static constexpr std::string_view name = "Nccl";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "nccl";
  static constexpr bool multi_process = true;
  static constexpr bool available = ACCEL_WITH_NCCL;

  static torch::Device device(const runtime::ProcessEnv& env) {
    ACCEL_CHECK(torch::cuda::is_available(),
                "accel: backend::Nccl needs a CUDA device, and none is visible. Use backend::Gloo "
                "on CPU, or check CUDA_VISIBLE_DEVICES and the driver.");
    return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(
                                           env.local_rank % static_cast<int>(torch::cuda::device_count())));
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(
      [[maybe_unused]] const runtime::ProcessEnv& env,
      [[maybe_unused]] const AcceleratorOptions& opts) {
#if ACCEL_WITH_NCCL
    return runtime::make_nccl_communicator(env, device(env), opts.timeout, opts.file_store);
#else
    throw Error("accel: backend::Nccl is not available in this build. Use backend::Gloo.");
#endif
  }
};

#if ACCEL_WITH_NCCL
static_assert(Nccl::name == runtime::NcclCommunicator::name);
#endif

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_NCCL_HPP
// end <accel/backend/nccl.hpp>
// begin <accel/backend/single_device.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::backend::SingleDevice: one process, one device.
#ifndef ACCEL_BACKEND_SINGLE_DEVICE_HPP
#define ACCEL_BACKEND_SINGLE_DEVICE_HPP

#include <memory>
#include <string_view>


namespace accel::backend {

/// One process on CUDA device 0 when available, else the CPU. The rank
/// variables of a launcher are ignored: every process trains on its own.
struct SingleDevice {
  static constexpr std::string_view name = "SingleDevice";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "single";
  static constexpr bool multi_process = false;
  static constexpr bool available = true;

  static torch::Device device(const runtime::ProcessEnv&) {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
  }
  static std::shared_ptr<runtime::Communicator> make_communicator(const runtime::ProcessEnv&,
                                                                  const AcceleratorOptions&) {
    return std::make_shared<runtime::LocalCommunicator>();
  }
};

}  // namespace accel::backend

#endif  // ACCEL_BACKEND_SINGLE_DEVICE_HPP
// end <accel/backend/single_device.hpp>

#endif  // ACCEL_BACKEND_HPP
// end <accel/backend.hpp>
// begin <accel/precision.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the precision policies.
#ifndef ACCEL_PRECISION_HPP
#define ACCEL_PRECISION_HPP

// begin <accel/precision/autocast.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::AutocastGuard: RAII autocast for one device type.
#ifndef ACCEL_PRECISION_AUTOCAST_HPP
#define ACCEL_PRECISION_AUTOCAST_HPP

#include <ATen/autocast_mode.h>
#include <torch/torch.h>


namespace accel::precision {

/// Turns autocast on for `device_type` with `dtype` for its lifetime and
/// restores the previous state after, as `torch.autocast(...)` does in Python.
/// Disabled guards (Fp32) do nothing.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, at::ScalarType dtype, bool enabled = true)
      : device_type_(device_type), active_(enabled) {
    if (!active_) return;
    prev_enabled_ = is_enabled(device_type_);
    prev_dtype_ = dtype_of(device_type_);
    set(device_type_, true, dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    // Leaving the outermost region drops the cache of casted weights, so an
    // optimizer step on the fp32 weights is seen by the next forward.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set(device_type_, prev_enabled_, prev_dtype_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&& other) noexcept
      : device_type_(other.device_type_), active_(other.active_),
        prev_enabled_(other.prev_enabled_), prev_dtype_(other.prev_dtype_) {
    other.active_ = false;
  }
  AutocastGuard& operator=(AutocastGuard&&) = delete;

  // The thread's autocast state for one device type (public for
  // memory::checkpoint, which replays a forward's state in backward).
  // LibTorch 2.4 replaced the per-device functions (is_enabled, is_cpu_enabled,
  // get_autocast_gpu_dtype, ...) by ones taking the device type, and
  // deprecated the old ones.
#if ACCEL_TORCH_AT_LEAST(2, 4)
  static bool is_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
  static at::ScalarType dtype_of(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }
  static void set(c10::DeviceType d, bool enabled, at::ScalarType dtype) {
    at::autocast::set_autocast_enabled(d, enabled);
    at::autocast::set_autocast_dtype(d, dtype);
  }
#else
  static bool is_enabled(c10::DeviceType d) {
    return d == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
  }
  static at::ScalarType dtype_of(c10::DeviceType d) {
    return d == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                      : at::autocast::get_autocast_cpu_dtype();
  }
  static void set(c10::DeviceType d, bool enabled, at::ScalarType dtype) {
    if (d == c10::DeviceType::CUDA) {
      at::autocast::set_enabled(enabled);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      at::autocast::set_cpu_enabled(enabled);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
  }
#endif

 private:
  c10::DeviceType device_type_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kFloat;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_AUTOCAST_HPP
// end <accel/precision/autocast.hpp>
// begin <accel/precision/bf16.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Bf16: autocast to bfloat16 on CPU and CUDA; no loss scaling (bfloat16 has fp32's range).
#ifndef ACCEL_PRECISION_BF16_HPP
#define ACCEL_PRECISION_BF16_HPP

#include <string_view>

// begin <accel/precision/concept.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a precision policy is: the trait, the concept and the check.
#ifndef ACCEL_PRECISION_CONCEPT_HPP
#define ACCEL_PRECISION_CONCEPT_HPP

#include <concepts>
#include <string_view>
#include <type_traits>

#include <torch/torch.h>

namespace accel {

/// A precision policy is a set of compile-time facts:
///   static constexpr std::string_view name;          // "no" | "fp16" | "bf16" (Accelerate's names)
///   static constexpr bool autocast;                  // forward runs under autocast
///   static constexpr at::ScalarType autocast_dtype;  // its lower-precision type
///   static constexpr bool loss_scaling;              // dynamic loss scaling (Fp16)
namespace precision::detail {
// One concept per member, so that check_precision_policy names the missing one.
template <class P>
concept has_name = requires { { P::name } -> std::convertible_to<std::string_view>; };
template <class P>
concept has_autocast = requires { { P::autocast } -> std::convertible_to<bool>; };
template <class P>
concept has_autocast_dtype = requires { { P::autocast_dtype } -> std::convertible_to<at::ScalarType>; };
template <class P>
concept has_loss_scaling = requires { { P::loss_scaling } -> std::convertible_to<bool>; };
}  // namespace precision::detail

template <class P>
concept PrecisionPolicy = precision::detail::has_name<P> && precision::detail::has_autocast<P> &&
                          precision::detail::has_autocast_dtype<P> && precision::detail::has_loss_scaling<P>;

template <class P>
struct is_precision_policy : std::bool_constant<PrecisionPolicy<P>> {};
template <class P>
inline constexpr bool is_precision_policy_v = is_precision_policy<P>::value;

/// A type with none of a precision's own members (every policy has a name)
/// is not meant as one: one message says which to use. A precision that
/// lacks some gets one message per member.
template <class P>
struct check_precision_policy {
  static constexpr bool own_member = precision::detail::has_autocast<P> || precision::detail::has_autocast_dtype<P> ||
                                     precision::detail::has_loss_scaling<P>;
  static_assert(own_member,
                "accel: the Precision parameter of Accelerator is not a precision policy. Use "
                "accel::precision::Fp32, Fp16 or Bf16.");
  static_assert(!own_member || precision::detail::has_name<P>,
                "accel: this precision policy has no `static constexpr std::string_view name`. Add it "
                "(\"no\", \"fp16\" or \"bf16\", Accelerate's names).");
  static_assert(!own_member || precision::detail::has_autocast<P>,
                "accel: this precision policy has no `static constexpr bool autocast`. Add it (true: the "
                "forward runs under autocast).");
  static_assert(!own_member || precision::detail::has_autocast_dtype<P>,
                "accel: this precision policy has no `static constexpr at::ScalarType autocast_dtype`. Add "
                "it (the lower-precision type autocast uses).");
  static_assert(!own_member || precision::detail::has_loss_scaling<P>,
                "accel: this precision policy has no `static constexpr bool loss_scaling`. Add it (true: "
                "dynamic loss scaling, as Fp16).");
  static constexpr bool value = is_precision_policy_v<P>;
};

}  // namespace accel

#endif  // ACCEL_PRECISION_CONCEPT_HPP
// end <accel/precision/concept.hpp>

namespace accel::precision {

struct Bf16 {
  static constexpr std::string_view name = "bf16";
  static constexpr bool autocast = true;
  static constexpr at::ScalarType autocast_dtype = at::kBFloat16;
  static constexpr bool loss_scaling = false;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_BF16_HPP
// end <accel/precision/bf16.hpp>
// begin <accel/precision/fp16.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Fp16: autocast to float16 with dynamic loss scaling; CUDA only (on CPU a run-time accel::Error suggests Bf16).
#ifndef ACCEL_PRECISION_FP16_HPP
#define ACCEL_PRECISION_FP16_HPP

#include <string_view>


namespace accel::precision {

struct Fp16 {
  static constexpr std::string_view name = "fp16";
  static constexpr bool autocast = true;
  static constexpr at::ScalarType autocast_dtype = at::kHalf;
  static constexpr bool loss_scaling = true;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_FP16_HPP
// end <accel/precision/fp16.hpp>
// begin <accel/precision/fp32.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::Fp32: no autocast, no loss scaling.
#ifndef ACCEL_PRECISION_FP32_HPP
#define ACCEL_PRECISION_FP32_HPP

#include <string_view>


namespace accel::precision {

struct Fp32 {
  static constexpr std::string_view name = "no";
  static constexpr bool autocast = false;
  static constexpr at::ScalarType autocast_dtype = at::kFloat;
  static constexpr bool loss_scaling = false;
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_FP32_HPP
// end <accel/precision/fp32.hpp>
// begin <accel/precision/loss_scaler.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::precision::LossScaler: dynamic loss scaling for fp16,
/// with the inf/NaN decision agreed by every rank.
#ifndef ACCEL_PRECISION_LOSS_SCALER_HPP
#define ACCEL_PRECISION_LOSS_SCALER_HPP

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>


namespace accel::precision {

/// The loss is multiplied by scale() before backward so small fp16 gradients
/// do not flush to zero. Before an optimizer step the gradients are divided
/// by the scale (each gradient once per iteration, whoever asks first:
/// clip_grad_norm_ or a step) and checked for inf/NaN; the finding is
/// all-reduced (MAX) so every rank skips the same steps. update(), once per
/// iteration, backs the scale off after an overflow and grows it after
/// growth_interval clean iterations, as torch.cuda.amp.GradScaler.
class LossScaler {
 public:
  explicit LossScaler(GradScalerOptions opts = {}) : opts_(opts), scale_(opts.init_scale) {
    ACCEL_CHECK(opts.init_scale > 0 && opts.growth_factor > 1 && opts.backoff_factor > 0 &&
                    opts.backoff_factor < 1 && opts.growth_interval > 0,
                "accel: invalid GradScalerOptions (need init_scale > 0, growth_factor > 1, 0 < "
                "backoff_factor < 1, growth_interval > 0). Fix the options.");
  }

  double scale() const { return scale_; }
  torch::Tensor scale(const torch::Tensor& loss) const { return loss * scale_; }

  /// Divides the gradients of `params` not yet unscaled in this iteration
  /// by the scale; returns true when any rank found inf/NaN in the gradients
  /// of `params` (those unscaled earlier count with what their call found).
  bool unscale(const std::vector<torch::Tensor>& params, runtime::Communicator& comm) {
    torch::NoGradGuard no_grad;
    bool known_inf = false;
    std::vector<torch::Tensor> todo;
    for (const auto& p : params) {
      const auto it = unscaled_.find(p.unsafeGetTensorImpl());
      if (it == unscaled_.end())
        todo.push_back(p);
      else
        known_inf = known_inf || it->second;
    }
    if (todo.empty()) return known_inf;
    const double inv = 1.0 / scale_;
    auto found = torch::zeros({1}, torch::kFloat);
    for (const auto& p : todo) {
      if (!p.grad().defined()) continue;
      auto g = p.grad();
      g.mul_(inv);
      found = found.to(g.device()) + (g.isfinite().all().logical_not()).to(torch::kFloat);
    }
    found = found.to(torch::kCPU).contiguous();
    if (comm.size() > 1) {
      // The flag travels on the communicator's device (CUDA for NCCL).
      auto flag = found.to(comm_device_);
      comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
      found = flag.to(torch::kCPU);
    }
    const bool inf = found.item<float>() > 0;
    for (const auto& p : todo) unscaled_.emplace(p.unsafeGetTensorImpl(), inf);
    found_inf_ = found_inf_ || inf;
    return known_inf || inf;
  }

  /// End of an iteration: adjust the scale, forget what was unscaled.
  void update() {
    if (found_inf_) {
      scale_ *= opts_.backoff_factor;
      growth_tracker_ = 0;
    } else if (++growth_tracker_ >= opts_.growth_interval) {
      scale_ *= opts_.growth_factor;
      growth_tracker_ = 0;
    }
    unscaled_.clear();
    found_inf_ = false;
  }

  /// Whether any gradient was unscaled in this iteration.
  bool unscaled() const { return !unscaled_.empty(); }
  int64_t growth_tracker() const { return growth_tracker_; }
  void set_comm_device(torch::Device d) { comm_device_ = d; }

  /// For checkpoints: scale and growth tracker.
  void load(double scale, int64_t growth_tracker) {
    scale_ = scale;
    growth_tracker_ = growth_tracker;
  }

 private:
  GradScalerOptions opts_;
  double scale_;
  int64_t growth_tracker_ = 0;
  /// This iteration's unscaled gradients (by parameter), with whether the
  /// call that unscaled them found inf/NaN.
  std::unordered_map<const c10::TensorImpl*, bool> unscaled_;
  bool found_inf_ = false;  ///< any call of this iteration
  torch::Device comm_device_{torch::kCPU};
};

}  // namespace accel::precision

#endif  // ACCEL_PRECISION_LOSS_SCALER_HPP
// end <accel/precision/loss_scaler.hpp>

#endif  // ACCEL_PRECISION_HPP
// end <accel/precision.hpp>
// begin <accel/comm.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the gradient communication hooks (AcceleratorOptions::comm_hook,
/// Accelerator::register_comm_hook).
#ifndef ACCEL_COMM_HPP
#define ACCEL_COMM_HPP

// begin <accel/comm/cast_hook.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::CastHook, CommHook::Fp16 and CommHook::Bf16:
/// gradients travel as 16-bit floats, half the bytes of float32.
#ifndef ACCEL_COMM_CAST_HOOK_HPP
#define ACCEL_COMM_CAST_HOOK_HPP

#include <memory>
#include <utility>

#include <torch/torch.h>

// begin <accel/comm/hook.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::comm::Hook, how a bucket of gradients is averaged
/// across processes, and the two simplest hooks: MeanHook (what accel does
/// without a hook) and FunctionHook (a user's callable).
#ifndef ACCEL_COMM_HOOK_HPP
#define ACCEL_COMM_HOOK_HPP

#include <functional>
#include <memory>
#include <string_view>
#include <utility>

#include <torch/torch.h>

// begin <accel/comm/grad_bucket.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::GradBucket, what a communication hook is given:
/// one bucket of gradients of one optimizer step.
#ifndef ACCEL_COMM_GRAD_BUCKET_HPP
#define ACCEL_COMM_GRAD_BUCKET_HPP

#include <cstddef>
#include <vector>

#include <torch/torch.h>

namespace accel::comm {

/// One bucket of this rank's gradients. Buckets are numbered in the order
/// they are reduced (the same on every rank, and the same every step), so a
/// hook may keep state per bucket index.
struct GradBucket {
  std::size_t index = 0;
  /// Flat, contiguous: this rank's gradients (and, under ZeRO, zero padding
  /// at the end). The hook leaves the mean over ranks here.
  torch::Tensor buffer;
  /// One per parameter of the bucket: a view of `buffer` with the
  /// parameter's shape (what PowerSGD compresses).
  std::vector<torch::Tensor> gradients;
  /// The last bucket of this step.
  bool is_last = false;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_GRAD_BUCKET_HPP
// end <accel/comm/grad_bucket.hpp>

namespace accel::comm {

/// A user's hook: start averaging bucket.buffer across ranks and return the
/// work to wait for; when that work's wait() returns, bucket.buffer must hold
/// the mean. It runs on every rank for the same buckets in the same order, so
/// it must issue the same collectives everywhere. Return a runtime::ThenWork
/// to decompress (or start a second collective) after the first one.
using HookFunction = std::function<std::shared_ptr<runtime::Work>(GradBucket&, runtime::Communicator&)>;

/// What a gradient sync calls where a bucket's reduction starts. One object
/// per prepared model (hooks with state keep it per bucket index).
class Hook {
 public:
  virtual ~Hook() = default;
  /// Replicate and ZeRO-1: when the returned work is done, bucket.buffer holds
  /// the mean over ranks.
  virtual std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) = 0;
  /// ZeRO-2: `output` (1/N of bucket.buffer's elements) receives the mean of
  /// every rank's chunk `comm.rank()`. By default the whole bucket is
  /// all-reduced through all_reduce() and this rank's chunk kept.
  virtual std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                        runtime::Communicator& comm) {
    auto work = all_reduce(bucket, comm);
    const auto n = output.numel();
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [out = std::move(output), buf = bucket.buffer, r = comm.rank(), n]() mutable {
          torch::NoGradGuard no_grad;
          out.view(-1).copy_(buf.view(-1).narrow(0, r * n, n));
        });
  }
  /// State that save_state() keeps and load_state() restores (PowerSGD's).
  virtual bool has_state() const { return false; }
  virtual void save(torch::serialize::OutputArchive& /*archive*/) const {}
  virtual void load(torch::serialize::InputArchive& /*archive*/) {}
};

/// No compression: divide by the world size, sum across ranks.
class MeanHook final : public Hook {
 public:
  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    bucket.buffer.mul_(1.0 / comm.size());
    return comm.all_reduce(bucket.buffer, runtime::ReduceOp::Sum);
  }
  std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                runtime::Communicator& comm) override {
    bucket.buffer.mul_(1.0 / comm.size());
    return comm.reduce_scatter(output, bucket.buffer, runtime::ReduceOp::Sum);
  }
};

/// A user's callable (Accelerator::register_comm_hook).
class FunctionHook final : public Hook {
 public:
  explicit FunctionHook(HookFunction fn) : fn_(std::move(fn)) {
    ACCEL_CHECK(fn_ != nullptr, "accel: register_comm_hook() was given an empty function. Pass a "
                "callable (GradBucket&, Communicator&) -> std::shared_ptr<Work>.");
  }
  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    auto work = fn_(bucket, comm);
    return work ? work : std::make_shared<runtime::CompletedWork>();
  }

 private:
  HookFunction fn_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_HOOK_HPP
// end <accel/comm/hook.hpp>

namespace accel::comm {

/// As PyTorch's fp16_compress_hook / bf16_compress_hook: the bucket is cast
/// to `wire` and divided by the world size, summed across ranks in `wire`,
/// and cast back. Where the backend cannot sum `wire` as it is (Gloo has no
/// bfloat16 sum; MPI has no 16-bit float types and would widen to float32,
/// saving nothing), the 16-bit values are all-gathered instead (moved as raw
/// 16-bit words) and summed here in float32, in rank order, so every rank
/// gets the same result. All-gather sends (N - 1) / 2 times a ring
/// all-reduce's bytes: equal for 2 processes, more beyond.
class CastHook final : public Hook {
 public:
  explicit CastHook(torch::ScalarType wire) : wire_(wire) {}

  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    auto compressed = bucket.buffer.to(wire_).div_(comm.size());
    auto buffer = bucket.buffer;
    if (comm.sums_natively(wire_)) {
      auto work = comm.all_reduce(compressed, runtime::ReduceOp::Sum);
      return std::make_shared<runtime::ThenWork>(std::move(work), [buffer, compressed]() mutable {
        torch::NoGradGuard no_grad;
        buffer.copy_(compressed);
      });
    }
    return gather_and_sum(std::move(compressed), std::move(buffer), comm);
  }

  std::shared_ptr<runtime::Work> reduce_scatter(torch::Tensor output, GradBucket& bucket,
                                                runtime::Communicator& comm) override {
    if (!comm.sums_natively(wire_)) return Hook::reduce_scatter(std::move(output), bucket, comm);
    auto compressed = bucket.buffer.to(wire_).div_(comm.size());
    auto received = torch::empty({output.numel()}, compressed.options());
    auto work = comm.reduce_scatter(received, compressed, runtime::ReduceOp::Sum);
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [output = std::move(output), received, compressed]() mutable {
          torch::NoGradGuard no_grad;
          output.view(-1).copy_(received);
        });
  }

 private:
  // Every rank's 16-bit values, moved as float16 words (Gloo gathers
  // float16 but not bfloat16; the bits are the same size), summed in float32.
  static std::shared_ptr<runtime::Work> gather_and_sum(torch::Tensor compressed, torch::Tensor buffer,
                                                       runtime::Communicator& comm) {
    const auto dtype = compressed.scalar_type();
    auto words = compressed.view(torch::kHalf);
    auto gathered = torch::empty({comm.size() * words.numel()}, words.options());
    auto work = comm.all_gather(gathered, words);
    return std::make_shared<runtime::ThenWork>(
        std::move(work), [buffer, gathered, words, dtype, world = comm.size()]() mutable {
          torch::NoGradGuard no_grad;
          auto values = gathered.view(dtype).view({world, -1}).to(torch::kFloat);
          buffer.copy_(values.sum(0));
        });
  }

  torch::ScalarType wire_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_CAST_HOOK_HPP
// end <accel/comm/cast_hook.hpp>
// begin <accel/comm/make_hook.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::make_hook, the hook AcceleratorOptions ask for.
#ifndef ACCEL_COMM_MAKE_HOOK_HPP
#define ACCEL_COMM_MAKE_HOOK_HPP

#include <memory>

// begin <accel/comm/powersgd_hook.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::PowerSGDHook, CommHook::PowerSGD: each
/// matrix-shaped gradient travels as two thin factors (Vogels et al., 2019,
/// "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
/// Optimization"), with error feedback and warm start.
#ifndef ACCEL_COMM_POWERSGD_HOOK_HPP
#define ACCEL_COMM_POWERSGD_HOOK_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace accel::comm {

namespace detail {

/// Gram-Schmidt on the columns of m (rows x r), in place. A zero column
/// stays zero (the epsilon), where PyTorch's default would divide by zero.
inline void orthogonalize(torch::Tensor m) {
  const auto cols = m.size(1);
  for (int64_t i = 0; i < cols; ++i) {
    auto col = m.narrow(1, i, 1);
    col.div_(col.norm() + 1e-8);
    if (i + 1 < cols) {
      auto rest = m.narrow(1, i + 1, cols - i - 1);
      rest.sub_((col * rest).sum(0, /*keepdim=*/true) * col);
    }
  }
}

}  // namespace detail

/// Per bucket and step, after start_powerSGD_iter plain steps:
/// 1. error feedback: the bucket gets what compression lost on this rank at
///    the previous step added to it (the error of the whole bucket, as PyTorch);
/// 2. each gradient viewed as a rows x cols matrix (dim 0 x the rest) that
///    compression makes at least 2x smaller becomes M; the others (biases,
///    small matrices, padding) are averaged as they are;
/// 3. P = M Q (Q: the last step's, or seeded random, orthogonalized), summed
///    across ranks in one all-reduce together with the uncompressed values;
///    P orthogonalized; Q = M^T P, summed across ranks and divided by N;
///    M is replaced by P Q^T.
/// Two collectives per bucket: the second starts when the first is waited
/// for (runtime::ThenWork). State (step count, errors, Qs) is saved by
/// save_state() so that resume stays bit-exact.
class PowerSGDHook final : public Hook {
 public:
  explicit PowerSGDHook(PowerSGDOptions options) : options_(options) {
    ACCEL_CHECK(options_.matrix_approximation_rank >= 1, "accel: PowerSGDOptions::matrix_approximation_rank is ",
                options_.matrix_approximation_rank, "; it must be at least 1.");
    ACCEL_CHECK(options_.start_powerSGD_iter >= 0, "accel: PowerSGDOptions::start_powerSGD_iter is ",
                options_.start_powerSGD_iter, "; it must be 0 or more.");
  }

  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    const bool compress = step_ >= options_.start_powerSGD_iter;
    if (bucket.is_last) ++step_;  // buckets are reduced in index order: one step per last bucket
    if (!compress) return mean_.all_reduce(bucket, comm);
    torch::NoGradGuard no_grad;
    auto buffer = bucket.buffer;
    const auto index = bucket.index;
    const int world = comm.size();

    torch::Tensor before;  // the bucket with the last error added: what this rank wanted to send
    if (options_.use_error_feedback) {
      auto& error = error_[index];
      if (error.defined() && error.sizes() == buffer.sizes())
        buffer.add_(error);
      else
        error = torch::zeros_like(buffer);
      before = buffer.clone();
    }

    // Which gradients are compressed; everything else of the buffer is "rest".
    std::vector<Matrix> ms;
    int64_t p_len = 0, q_len = 0;
    const auto base = static_cast<const char*>(buffer.data_ptr());
    const auto item = static_cast<int64_t>(buffer.element_size());
    for (const auto& g : bucket.gradients) {
      if (g.dim() < 2 || g.numel() == 0) continue;
      const int64_t rows = g.size(0), cols = g.numel() / rows;
      const int64_t r = std::min<int64_t>({options_.matrix_approximation_rank, rows, cols});
      if ((rows + cols) * r * 2 >= rows * cols) continue;  // less than 2x smaller: not worth it
      const int64_t offset = (static_cast<const char*>(g.data_ptr()) - base) / item;
      ms.push_back(Matrix{offset, rows, cols, r, p_len, q_len});
      p_len += rows * r;
      q_len += cols * r;
    }
    std::sort(ms.begin(), ms.end(), [](const Matrix& a, const Matrix& b) { return a.offset < b.offset; });
    std::vector<std::pair<int64_t, int64_t>> rest;  // [offset, length) not compressed
    int64_t at = 0;
    for (const auto& m : ms) {
      if (m.offset > at) rest.emplace_back(at, m.offset - at);
      at = m.offset + m.rows * m.cols;
    }
    if (at < buffer.numel()) rest.emplace_back(at, buffer.numel() - at);
    int64_t rest_len = 0;
    for (const auto& [o, n] : rest) rest_len += n;

    // Q: warm from the last step, or seeded random (the same on every rank).
    auto& q = q_[index];
    if (!options_.warm_start || !q.defined() || q.numel() != q_len) {
      auto gen = at::detail::createCPUGenerator(0x5eed + 7919 * static_cast<uint64_t>(index) +
                                                (options_.warm_start ? 0 : static_cast<uint64_t>(step_)));
      q = torch::randn({q_len}, gen, torch::TensorOptions().dtype(torch::kFloat)).to(buffer.options());
      for (const auto& m : ms) detail::orthogonalize(q_of(q, m));
    }

    // First collective: the uncompressed values and every P, in one buffer.
    auto first = torch::empty({rest_len + p_len}, buffer.options());
    int64_t w = 0;
    for (const auto& [o, n] : rest) {
      first.narrow(0, w, n).copy_(buffer.narrow(0, o, n));
      w += n;
    }
    for (const auto& m : ms) {
      auto p = p_of(first, rest_len, m);
      torch::mm_out(p, matrix(buffer, m), q_of(q, m));
    }
    auto work = comm.all_reduce(first, runtime::ReduceOp::Sum);

    // Then: P orthogonalized, Q = M^T P summed, M = P Q^T / N.
    auto finish = [this, buffer, first, rest, rest_len, ms, q, before, index, world,
                   comm_ptr = &comm]() mutable {
      torch::NoGradGuard no_grad;
      int64_t w = 0;
      for (const auto& [o, n] : rest) {
        buffer.narrow(0, o, n).copy_(first.narrow(0, w, n)).div_(world);
        w += n;
      }
      if (ms.empty()) return finish_error(index, buffer, before);
      for (const auto& m : ms) {
        auto p = p_of(first, rest_len, m);
        detail::orthogonalize(p);
        auto qm = q_of(q, m);
        torch::mm_out(qm, matrix(buffer, m).t(), p);
      }
      comm_ptr->all_reduce(q, runtime::ReduceOp::Sum)->wait();
      q.div_(world);
      for (const auto& m : ms) {
        auto out = matrix(buffer, m);
        torch::mm_out(out, p_of(first, rest_len, m), q_of(q, m).t());
      }
      finish_error(index, buffer, before);
    };
    return std::make_shared<runtime::ThenWork>(std::move(work), std::move(finish));
  }

  bool has_state() const override { return true; }
  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("step", torch::tensor(step_, torch::kLong));
    for (const auto& [b, e] : error_) archive.write("error_" + std::to_string(b), e);
    if (options_.warm_start)
      for (const auto& [b, q] : q_) archive.write("q_" + std::to_string(b), q);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::Tensor t;
    archive.read("step", t);
    step_ = t.item<int64_t>();
    error_.clear();
    q_.clear();
    for (std::size_t b = 0;; ++b) {
      torch::Tensor e, q;
      const bool has_e = archive.try_read("error_" + std::to_string(b), e);
      const bool has_q = archive.try_read("q_" + std::to_string(b), q);
      if (!has_e && !has_q) break;
      if (has_e) error_[b] = e;
      if (has_q) q_[b] = q;
    }
  }

  /// Optimizer steps seen (plain ones included); for tests.
  int64_t steps() const { return step_; }

 private:
  struct Matrix {
    int64_t offset, rows, cols, rank, p_at, q_at;
  };
  static torch::Tensor matrix(const torch::Tensor& buffer, const Matrix& m) {
    return buffer.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
  }
  static torch::Tensor p_of(const torch::Tensor& first, int64_t rest_len, const Matrix& m) {
    return first.narrow(0, rest_len + m.p_at, m.rows * m.rank).view({m.rows, m.rank});
  }
  static torch::Tensor q_of(const torch::Tensor& q, const Matrix& m) {
    return q.narrow(0, m.q_at, m.cols * m.rank).view({m.cols, m.rank});
  }
  void finish_error(std::size_t index, const torch::Tensor& buffer, const torch::Tensor& before) {
    if (options_.use_error_feedback) error_[index] = before - buffer;
    if (!options_.warm_start) q_.erase(index);
  }

  PowerSGDOptions options_;
  int64_t step_ = 0;
  std::map<std::size_t, torch::Tensor> error_;  ///< per bucket
  std::map<std::size_t, torch::Tensor> q_;      ///< per bucket, all matrices' Qs back to back
  MeanHook mean_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_POWERSGD_HOOK_HPP
// end <accel/comm/powersgd_hook.hpp>

namespace accel::comm {

/// A new hook object (one per prepared model: PowerSGD keeps state per bucket).
inline std::shared_ptr<Hook> make_hook(CommHook kind, const PowerSGDOptions& powersgd = {}) {
  switch (kind) {
    case CommHook::Fp16: return std::make_shared<CastHook>(torch::kHalf);
    case CommHook::Bf16: return std::make_shared<CastHook>(torch::kBFloat16);
    case CommHook::PowerSGD: return std::make_shared<PowerSGDHook>(powersgd);
    case CommHook::None: break;
  }
  return std::make_shared<MeanHook>();
}

}  // namespace accel::comm

#endif  // ACCEL_COMM_MAKE_HOOK_HPP
// end <accel/comm/make_hook.hpp>

#endif  // ACCEL_COMM_HPP
// end <accel/comm.hpp>
// begin <accel/shard.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the shard policies.
#ifndef ACCEL_SHARD_HPP
#define ACCEL_SHARD_HPP

// begin <accel/shard/concept.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Declares what a shard policy is: the trait, the concept and the check.
#ifndef ACCEL_SHARD_CONCEPT_HPP
#define ACCEL_SHARD_CONCEPT_HPP

#include <concepts>
#include <string_view>
#include <type_traits>

namespace accel {

/// A shard policy says what each rank keeps:
///   static constexpr std::string_view name;
///   static constexpr bool shards_optimizer_state;  // ZeRO-1
///   static constexpr bool shards_gradients;        // ZeRO-2
///   static constexpr bool shards_parameters;       // ZeRO-3 (optional: false when absent)
namespace shard::detail {
// One concept per member, so that check_shard_policy names the missing one.
template <class S>
concept has_name = requires { { S::name } -> std::convertible_to<std::string_view>; };
template <class S>
concept has_shards_optimizer_state = requires { { S::shards_optimizer_state } -> std::convertible_to<bool>; };
template <class S>
concept has_shards_gradients = requires { { S::shards_gradients } -> std::convertible_to<bool>; };
}  // namespace shard::detail

template <class S>
concept ShardPolicy = shard::detail::has_name<S> && shard::detail::has_shards_optimizer_state<S> &&
                      shard::detail::has_shards_gradients<S>;

/// Whether S partitions the parameters themselves (ZeRO-3).
template <class S>
inline constexpr bool shards_parameters_v = [] {
  if constexpr (requires { S::shards_parameters; }) return static_cast<bool>(S::shards_parameters);
  else return false;
}();

template <class S>
struct is_shard_policy : std::bool_constant<ShardPolicy<S>> {};
template <class S>
inline constexpr bool is_shard_policy_v = is_shard_policy<S>::value;

/// A type with none of a shard policy's own members (every policy has a
/// name) is not meant as one: one message says which to use. A shard policy
/// that lacks some gets one message per member.
template <class S>
struct check_shard_policy {
  static constexpr bool own_member =
      shard::detail::has_shards_optimizer_state<S> || shard::detail::has_shards_gradients<S>;
  static_assert(own_member,
                "accel: the Shard parameter of Accelerator is not a shard policy. Use "
                "accel::shard::Replicate, ShardOptimizer, ShardGradients or ShardParameters.");
  static_assert(!own_member || shard::detail::has_name<S>,
                "accel: this shard policy has no `static constexpr std::string_view name`. Add it.");
  static_assert(!own_member || shard::detail::has_shards_optimizer_state<S>,
                "accel: this shard policy has no `static constexpr bool shards_optimizer_state`. Add it "
                "(true: ZeRO-1, each rank keeps 1/N of the optimizer state).");
  static_assert(!own_member || shard::detail::has_shards_gradients<S>,
                "accel: this shard policy has no `static constexpr bool shards_gradients`. Add it (true: "
                "ZeRO-2, each rank keeps 1/N of the gradients).");
  static constexpr bool value = is_shard_policy_v<S>;
};

}  // namespace accel

#endif  // ACCEL_SHARD_CONCEPT_HPP
// end <accel/shard/concept.hpp>
// begin <accel/shard/replicate.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::Replicate: data parallel, every rank holds everything.
#ifndef ACCEL_SHARD_REPLICATE_HPP
#define ACCEL_SHARD_REPLICATE_HPP

#include <string_view>


namespace accel::shard {

/// Data parallel (DDP): parameters broadcast from rank 0 at prepare(),
/// gradients averaged in buckets whose all-reduce starts during backward.
struct Replicate {
  static constexpr std::string_view name = "Replicate";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "replicate";
  static constexpr bool shards_optimizer_state = false;
  static constexpr bool shards_gradients = false;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_REPLICATE_HPP
// end <accel/shard/replicate.hpp>
// begin <accel/shard/shard_gradients.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardGradients (ZeRO stage 2).
#ifndef ACCEL_SHARD_SHARD_GRADIENTS_HPP
#define ACCEL_SHARD_SHARD_GRADIENTS_HPP

#include <string_view>


namespace accel::shard {

/// ZeRO-2: as ShardOptimizer, and each rank keeps only its partition's
/// gradients (reduce-scatter instead of all-reduce).
struct ShardGradients {
  static constexpr std::string_view name = "ShardGradients";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_gradients";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = true;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_GRADIENTS_HPP
// end <accel/shard/shard_gradients.hpp>
// begin <accel/shard/shard_optimizer.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardOptimizer (ZeRO stage 1).
#ifndef ACCEL_SHARD_SHARD_OPTIMIZER_HPP
#define ACCEL_SHARD_SHARD_OPTIMIZER_HPP

#include <string_view>


namespace accel::shard {

/// ZeRO-1: optimizer state partitioned across ranks; each rank steps the
/// parameters it owns, then the updated parameters are all-gathered.
struct ShardOptimizer {
  static constexpr std::string_view name = "ShardOptimizer";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_optimizer";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = false;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_OPTIMIZER_HPP
// end <accel/shard/shard_optimizer.hpp>
// begin <accel/shard/shard_parameters.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::ShardParameters (ZeRO stage 3).
#ifndef ACCEL_SHARD_SHARD_PARAMETERS_HPP
#define ACCEL_SHARD_SHARD_PARAMETERS_HPP

#include <string_view>


namespace accel::shard {

/// ZeRO-3: as ShardGradients, and each rank keeps only its partition of the
/// parameters too. A unit's parameters are all-gathered just before its
/// forward and freed after it, gathered again for its backward and freed
/// once their gradients are reduce-scattered. Units: the children of a
/// torch::nn::Sequential, or the modules wrapped in shard::Unit (any model);
/// any other model is one unit (docs/sharding.md).
struct ShardParameters {
  static constexpr std::string_view name = "ShardParameters";
  /// The value of Accelerate-style config files and `accel launch` flags.
  static constexpr std::string_view config_name = "shard_parameters";
  static constexpr bool shards_optimizer_state = true;
  static constexpr bool shards_gradients = true;
  static constexpr bool shards_parameters = true;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_SHARD_PARAMETERS_HPP
// end <accel/shard/shard_parameters.hpp>
// begin <accel/shard/unit.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::Unit: a submodule the user names as a unit of
/// shard::ShardParameters (the wrapping policy of FSDP, by hand), for models
/// that are not a torch::nn::Sequential.
#ifndef ACCEL_SHARD_UNIT_HPP
#define ACCEL_SHARD_UNIT_HPP

#include <type_traits>
#include <utility>

#include <torch/torch.h>

// begin <accel/shard/detail/unit_slot.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::UnitSlot, what prepare() finds of a
/// unit the user names with shard::Unit, and named_units(), which finds them.
#ifndef ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP
#define ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/gradient_sync.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Declares accel::shard::detail::GradientSync, what a prepared model's
/// shard policy does with gradients, as seen by the optimizer and the Accelerator.
#ifndef ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
#define ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace accel::shard::detail {

class ParameterGather;

class GradientSync {
 public:
  /// sync_now: the Accelerator's one "synchronise gradients now" flag
  /// (TrainingState::sync_gradients, false on the non-sync micro-steps of
  /// accumulate()); null: always.
  explicit GradientSync(std::shared_ptr<const bool> sync_now = nullptr) : sync_now_(std::move(sync_now)) {}
  virtual ~GradientSync() = default;

  /// Inside accumulate(model) the model follows the sync flag; outside it,
  /// every backward synchronises.
  void set_accumulating(bool accumulating) { accumulating_ = accumulating; }
  /// Whether this backward communicates: no communication at all otherwise.
  bool sync_now() const { return !accumulating_ || sync_now_ == nullptr || *sync_now_; }

  /// Starts what backward did not start (buckets of parameters that got no
  /// gradient), waits for everything in flight: afterwards every gradient on
  /// this rank is the average over ranks.
  virtual void finalize() = 0;
  /// Before each forward of the prepared model: re-attach what the user may
  /// have detached since (Module::load replaces gradient accumulators).
  virtual void before_forward() {}
  /// join_uneven_inputs() on a rank out of data, while the others run a
  /// backward: contribute zero gradients to every bucket's reduction, in the
  /// same order, and wait (afterwards the gradients are the others' average).
  virtual void shadow_backward() {}
  /// How buckets are averaged across ranks (AcceleratorOptions::comm_hook,
  /// Accelerator::register_comm_hook); null where nothing is communicated.
  virtual comm::Hook* comm_hook() const { return nullptr; }
  virtual void set_comm_hook(std::shared_ptr<comm::Hook> /*hook*/) {}
  /// Under shard::ShardParameters, how the model's forward gathers its
  /// parameters; null where every rank holds them whole.
  virtual ParameterGather* parameter_gather() { return nullptr; }

 private:
  std::shared_ptr<const bool> sync_now_;
  bool accumulating_ = false;
};

/// What a sharded model's policy does around the optimizer whose parameters
/// are this rank's partitions (shard::ShardOptimizer, ShardGradients).
class OptimizerPartition {
 public:
  virtual ~OptimizerPartition() = default;
  /// Zeroes (or releases) every gradient the model holds, not only the
  /// partitions' that the optimizer sees.
  virtual void zero_grad() = 0;
  /// After the inner optimizer step: make every rank's full parameters the
  /// updated ones again (all-gather). stepped is false when it was skipped.
  virtual void after_step(bool stepped) = 0;
};

/// ZeRO-3 (shard::ShardParameters): each rank holds a partition of the
/// parameters; the whole values exist only while a unit computes. Units are
/// numbered as units_of() (parameter_units.hpp) numbers them. Every call is a
/// collective where it gathers: all ranks make the same calls in the same order.
class ParameterGather {
 public:
  virtual ~ParameterGather() = default;
  /// Makes unit u's parameters (and any tied parameter it uses) whole.
  virtual void gather_unit(std::size_t u) = 0;
  /// Frees what gather_unit(u) made whole.
  virtual void release_unit(std::size_t u) = 0;
  /// Unit u's backward is next (units run as a chain): the units after it
  /// are done with theirs and are freed; unit u is gathered.
  virtual void gather_for_backward(std::size_t u) = 0;
  /// The model's forward begins: with shard::Unit modules, the parameters
  /// outside them become whole (until backward); without, all of them.
  virtual void gather_for_forward() = 0;
  /// The model names its units with shard::Unit (units_of()).
  virtual bool has_named_units() const = 0;
  virtual void gather_all() = 0;
  virtual void release_all() = 0;
  /// Streaming save_model: makes whole the bucket holding t, when t is one
  /// of this model's sharded parameters (not a buffer, a frozen parameter or
  /// another model's), and frees the bucket the previous call made whole
  /// (release_all() ends the stream).
  virtual void gather_holding(const torch::Tensor& t) = 0;
  /// After the parameters were written while whole (load_state): each
  /// rank's partition takes the new values.
  virtual void keep_written_values() = 0;
};

/// The policy for one process: gradients are already complete.
class NoSync final : public GradientSync {
 public:
  void finalize() override {}
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_GRADIENT_SYNC_HPP
// end <accel/shard/detail/gradient_sync.hpp>

namespace accel::shard::detail {

/// A unit's number in its model and the model's gradient sync, set by
/// prepare(). Unbound (one process, or another shard policy), a unit
/// computes as the module it wraps.
class UnitSlot {
 public:
  virtual ~UnitSlot() = default;
  void bind(std::weak_ptr<GradientSync> sync, std::size_t index) {
    sync_ = std::move(sync);
    index_ = index;
  }

 protected:
  /// The model's ParameterGather (ShardParameters on several processes), or null.
  ParameterGather* gather() const {
    const auto sync = sync_.lock();
    return sync ? sync->parameter_gather() : nullptr;
  }
  const std::weak_ptr<GradientSync>& sync() const { return sync_; }
  std::size_t index() const { return index_; }

 private:
  std::weak_ptr<GradientSync> sync_;
  std::size_t index_ = 0;
};

/// The modules of `model` that are shard::Unit, in named_modules() order
/// (the model itself excluded). A unit inside another is refused: its
/// parameters would belong to both.
inline std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named_units(
    const torch::nn::Module& model) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> out;
  for (const auto& item : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) {
    if (dynamic_cast<UnitSlot*>(item.value().get()) == nullptr) continue;
    for (const auto& [outer, unit] : out)
      ACCEL_CHECK(item.key().rfind(outer + ".", 0) != 0, "accel: shard::Unit '", item.key(),
                  "' is inside shard::Unit '", outer, "'. Units must not nest: wrap either the "
                  "outer module or the modules inside it.");
    out.emplace_back(item.key(), item.value());
  }
  return out;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_UNIT_SLOT_HPP
// end <accel/shard/detail/unit_slot.hpp>

namespace accel::shard {

namespace detail {
/// R(A...) for a member function R (C::*)(A...), const or not.
template <class Method>
struct forward_signature;
template <class C, class R, class... A>
struct forward_signature<R (C::*)(A...)> {
  using type = R(A...);
};
template <class C, class R, class... A>
struct forward_signature<R (C::*)(A...) const> {
  using type = R(A...);
};
}  // namespace detail

/// Wraps a module (a ModuleHolder: torch::nn::Linear, a TORCH_MODULE type)
/// so that under ShardParameters its parameters are gathered just for its
/// forward, and again for its backward, as a Sequential's modules are. The
/// wrapper registers the wrapped module's parameters, buffers and children
/// under their own names, so state dicts, save_model() and checkpoints name
/// them as without it, and its forward has the wrapped module's signature
/// (one forward, not a template or overloaded: a Sequential cannot be
/// wrapped, wrap its modules), so a Unit can live in a Sequential or a
/// ModuleList too. Under any other policy, and on one process, it only
/// forwards.
template <class Holder, class Signature = typename detail::forward_signature<
                            decltype(&Holder::ContainedType::forward)>::type>
class UnitImpl;

template <class Holder, class R, class... A>
class UnitImpl<Holder, R(A...)> : public torch::nn::Module, public detail::UnitSlot {
 public:
  explicit UnitImpl(Holder inner) : inner_(std::move(inner)) {
    ACCEL_CHECK(!inner_.is_empty(), "accel: shard::Unit of an empty module holder. Construct the "
                "module first: shard::Unit<Block>(Block(...)).");
    for (const auto& p : inner_->named_parameters(/*recurse=*/false))
      register_parameter(p.key(), p.value(), p.value().requires_grad());
    for (const auto& b : inner_->named_buffers(/*recurse=*/false)) register_buffer(b.key(), b.value());
    for (const auto& c : inner_->named_children()) register_module(c.key(), c.value());
  }

  R forward(A... args) {
    auto* gather = this->gather();
    if (gather == nullptr) return inner_->forward(std::forward<A>(args)...);
    const bool grad = torch::GradMode::is_enabled();
    gather->gather_unit(index());
    // Freed after the forward, also when it throws; a result that backward
    // reaches without a hook to gather for it (not one tensor) keeps the
    // parameters until their gradients are reduce-scattered.
    struct Release {
      detail::ParameterGather* gather;
      std::size_t unit;
      bool keep = false;
      ~Release() {
        if (!keep) gather->release_unit(unit);
      }
    } release{gather, index()};
    if constexpr (std::is_void_v<R>) {
      inner_->forward(std::forward<A>(args)...);
    } else {
      R out = inner_->forward(std::forward<A>(args)...);
      if constexpr (std::is_same_v<R, torch::Tensor>) {
        if (grad && out.defined() && out.requires_grad())
          out.register_hook([weak = sync(), unit = index()](const torch::Tensor&) {
            if (auto s = weak.lock())
              if (auto* g = s->parameter_gather()) g->gather_for_backward(unit);
          });
      } else {
        release.keep = grad;
      }
      return out;
    }
  }

  /// train()/eval() reach the wrapped module itself, not only its children.
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    inner_->train(on);
  }

  Holder& module() { return inner_; }

 private:
  Holder inner_;
};

/// The holder of UnitImpl<Holder>: declare a member as
/// `accel::shard::Unit<Block> block{nullptr};` and register
/// `accel::shard::Unit<Block>(Block(...))` where Block was registered.
template <class Holder>
class Unit : public torch::nn::ModuleHolder<UnitImpl<Holder>> {
 public:
  using torch::nn::ModuleHolder<UnitImpl<Holder>>::ModuleHolder;
};

}  // namespace accel::shard

#endif  // ACCEL_SHARD_UNIT_HPP
// end <accel/shard/unit.hpp>

#endif  // ACCEL_SHARD_HPP
// end <accel/shard.hpp>
// begin <accel/compatibility.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the cross-policy rules of Accelerator<B, P, S>, in one place:
/// a trait that asserts nothing (dispatch_accelerator filters with it) and
/// the check whose static_asserts say what is wrong.
#ifndef ACCEL_COMPATIBILITY_HPP
#define ACCEL_COMPATIBILITY_HPP

#include <type_traits>


// Named by the rules below, not used: their headers (and c10d, Gloo, MPI)
// come with the user's choice of them, not with every Accelerator.
namespace accel::backend {
struct Mpi;
struct Nccl;
}  // namespace accel::backend

namespace accel {

namespace detail {

/// Each rule of Accelerator<B, P, S> as a constant; nothing fires.
template <class B, class P, class S>
struct policy_rules {
  static constexpr bool kinds_ok =
      is_backend_policy_v<B> && is_precision_policy_v<P> && is_shard_policy_v<S>;
  static constexpr bool nccl_ok = !std::is_same_v<B, backend::Nccl> || ACCEL_WITH_NCCL;
  static constexpr bool mpi_ok = !std::is_same_v<B, backend::Mpi> || ACCEL_WITH_MPI;
  static constexpr bool shard_ok = [] {
    if constexpr (kinds_ok)
      return B::multi_process || !(S::shards_optimizer_state || S::shards_gradients);
    else
      return true;  // not policies: their own checks say so, B::multi_process may not exist
  }();
  static constexpr bool value = kinds_ok && nccl_ok && mpi_ok && shard_ok;
};

}  // namespace detail

/// True when Accelerator<B, P, S> is valid; asserts nothing.
template <class B, class P, class S>
inline constexpr bool accelerator_policies_valid_v = detail::policy_rules<B, P, S>::value;

/// One static_assert per rule (each policy's own check first); `value` is true
/// when the combination is valid. Instantiating it is the whole diagnostic.
template <class B, class P, class S>
struct check_accelerator_policies {
  using rules = detail::policy_rules<B, P, S>;
  // Each policy's own check first. Only a complete class runs its
  // static_asserts (an initializer of a static member is not instantiated
  // until used), and sizeof needs one: always true, no error of its own.
  static_assert(sizeof(check_backend_policy<B>) && sizeof(check_precision_policy<P>) &&
                sizeof(check_shard_policy<S>));
  static constexpr bool policies_ok = check_backend_policy<B>::value &&
                                      check_precision_policy<P>::value &&
                                      check_shard_policy<S>::value;
  static_assert(rules::nccl_ok,
                "accel: backend::Nccl is not available in this build (ACCEL_WITH_NCCL is 0): "
                "LibTorch was built without CUDA/NCCL. Use backend::Gloo, or link a CUDA build "
                "of LibTorch.");
  static_assert(rules::mpi_ok,
                "accel: backend::Mpi is not available in this build (ACCEL_WITH_MPI is 0): no MPI "
                "was found. Install an MPI (Debian: libopenmpi-dev) and reconfigure, or use "
                "backend::Gloo.");
  static_assert(rules::shard_ok,
                "accel: shard::ShardOptimizer and shard::ShardGradients need more than one "
                "process. Use shard::Replicate with backend::SingleDevice, or choose "
                "backend::Gloo, Mpi or Nccl.");
  static constexpr bool value = policies_ok && rules::value;
  /// Always true: naming it instantiates the checks above without adding an
  /// error of its own.
  static constexpr bool checked = true;
};

}  // namespace accel

#endif  // ACCEL_COMPATIBILITY_HPP
// end <accel/compatibility.hpp>
// begin <accel/data.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella header of accel::data: make_data_loader, DataLoader,
/// sharding, collate, to_device and the active-loader state.
#ifndef ACCEL_DATA_HPP
#define ACCEL_DATA_HPP

// begin <accel/data/batch_sampler_shard.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the index side of the data loader: the epoch order (seeded
/// shuffle), plain batching, and Accelerate's BatchSamplerShard assignment of
/// batches to ranks, reproduced exactly (including its wrap-around padding).
#ifndef ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP
#define ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP

// begin <accel/data/loader_options.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the plain option structs of accel's data loader: LoaderOptions,
/// ShardSpec and LoaderCheckpoint.
#ifndef ACCEL_DATA_LOADER_OPTIONS_HPP
#define ACCEL_DATA_LOADER_OPTIONS_HPP

#include <chrono>
#include <cstdint>

namespace accel::data {

/// How make_data_loader() batches a dataset. Designated-initializer friendly:
/// `LoaderOptions{.batch_size = 64, .shuffle = true, .seed = 42}`.
struct LoaderOptions {
  int64_t batch_size = 1;
  /// Shuffle with a private generator seeded with `seed + epoch`: the same
  /// seed and epoch give the same order on every rank and in every run, and
  /// the global LibTorch RNG is neither read nor advanced.
  bool shuffle = false;
  /// Drop the last incomplete batch (sharded: the last incomplete round).
  bool drop_last = false;
  /// 0: batches are produced on the consuming thread. N > 0: N background
  /// threads prefetch batches; the batches and their order are the same.
  int num_workers = 0;
  uint64_t seed = 0;
  /// With workers: at most prefetch_factor * num_workers batches are ready
  /// or being produced ahead of the consumer.
  int prefetch_factor = 2;
  /// With workers: the longest the consumer waits for one batch before it
  /// raises accel::Error (a dataset that hangs must not hang training).
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
};

/// Which share of every global batch this loader yields: Accelerate's
/// BatchSamplerShard(num_processes = world_size, process_index = rank, ...).
struct ShardSpec {
  int rank = 0;
  int world_size = 1;
  /// false: whole batches go to the ranks in turn (global batch = batch_size
  /// * world_size). true: every batch is sliced (global batch = batch_size;
  /// batch_size must be a multiple of world_size).
  bool split_batches = false;
  /// true: the tail wraps around to the start of the epoch so that every
  /// rank gets the same number of full batches (with duplicates).
  bool even_batches = true;
};

/// Where a loader stands: enough to continue an interrupted epoch exactly.
struct LoaderCheckpoint {
  int64_t epoch = 0;
  int64_t batches_yielded = 0;  // per-rank batches of `epoch` already handed out
};

}  // namespace accel::data

#endif  // ACCEL_DATA_LOADER_OPTIONS_HPP
// end <accel/data/loader_options.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

namespace accel::data {

/// Dataset indices of one batch.
using IndexBatch = std::vector<size_t>;

/// The order in which an epoch visits the dataset: 0..n-1, or, shuffled,
/// torch.randperm(n, generator) with a fresh CPU generator seeded with
/// `seed + epoch` (exactly what Accelerate's SeedableRandomSampler draws, so
/// the same seed gives the same order as PyTorch in Python).
inline std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(n);
  if (!shuffle || n == 0) {
    std::iota(order.begin(), order.end(), size_t{0});
    return order;
  }
  auto gen = at::detail::createCPUGenerator(seed + static_cast<uint64_t>(epoch));
  const torch::Tensor perm =
      torch::randperm(static_cast<int64_t>(n), gen, torch::TensorOptions().dtype(torch::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) order[i] = static_cast<size_t>(p[i]);
  return order;
}

/// PyTorch's BatchSampler: consecutive slices of `order`; the short tail is
/// kept unless drop_last.
inline std::vector<IndexBatch> make_batches(const std::vector<size_t>& order, int64_t batch_size,
                                            bool drop_last) {
  ACCEL_CHECK(batch_size > 0, "accel: batch_size must be positive (got ", batch_size,
              "). Pass LoaderOptions{.batch_size = N} with N >= 1.");
  const size_t bs = static_cast<size_t>(batch_size);
  std::vector<IndexBatch> batches;
  batches.reserve(order.size() / bs + 1);
  for (size_t start = 0; start < order.size(); start += bs) {
    const size_t stop = std::min(order.size(), start + bs);
    if (drop_last && stop - start < bs) break;
    batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(start),
                         order.begin() + static_cast<std::ptrdiff_t>(stop));
  }
  return batches;
}

/// Throws accel::Error when `spec` cannot shard batches of `batch_size`.
inline void check_shard_spec(const ShardSpec& spec, int64_t batch_size) {
  ACCEL_CHECK(spec.world_size >= 1, "accel: ShardSpec::world_size must be at least 1 (got ",
              spec.world_size, "). Pass the number of processes.");
  ACCEL_CHECK(spec.rank >= 0 && spec.rank < spec.world_size, "accel: ShardSpec::rank ", spec.rank,
              " is outside [0, ", spec.world_size, "). Pass this process's index.");
  ACCEL_CHECK(!spec.split_batches || batch_size % spec.world_size == 0,
              "accel: with split_batches the batch size (", batch_size,
              ") must be a multiple of the number of processes (", spec.world_size,
              "). Use a batch size that divides evenly, or split_batches = false.");
}

namespace detail {

inline IndexBatch slice(const IndexBatch& b, size_t from, size_t to) {
  to = std::min(to, b.size());
  if (from >= to) return {};
  return IndexBatch(b.begin() + static_cast<std::ptrdiff_t>(from),
                    b.begin() + static_cast<std::ptrdiff_t>(to));
}

// BatchSamplerShard._iter_with_split: every full batch is sliced; the short
// tail is completed from the first batch (even) or sliced as it is.
inline std::vector<IndexBatch> shard_split(const std::vector<IndexBatch>& batches, size_t bs,
                                           bool drop_last, size_t P, size_t r, bool even) {
  std::vector<IndexBatch> out;
  const size_t bl = bs / P;
  for (const auto& b : batches)
    if (b.size() == bs) out.push_back(slice(b, bl * r, bl * (r + 1)));
  const IndexBatch& last = batches.back();
  if (drop_last || last.size() >= bs) return out;
  if (!even) {
    if (last.size() > bl * r) out.push_back(slice(last, bl * r, bl * (r + 1)));
    return out;
  }
  IndexBatch initial = batches.front();
  while (initial.size() < bs) initial.insert(initial.end(), initial.begin(), initial.end());
  IndexBatch padded = last;
  padded.insert(padded.end(), initial.begin(), initial.end());
  out.push_back(slice(padded, bl * r, bl * (r + 1)));
  return out;
}

// BatchSamplerShard._iter_with_no_split: batch i goes to rank i % P; a round
// is yielded only once all P batches of it are full; the last round is then
// completed with indices from the first P batches (even) or left uneven.
inline std::vector<IndexBatch> shard_round_robin(const std::vector<IndexBatch>& batches, size_t bs,
                                                 bool drop_last, size_t P, size_t r, bool even) {
  std::vector<IndexBatch> out;
  IndexBatch initial, to_yield;
  for (size_t idx = 0; idx < batches.size(); ++idx) {
    const IndexBatch& batch = batches[idx];
    if (!drop_last && idx < P) initial.insert(initial.end(), batch.begin(), batch.end());
    if (idx % P == r) to_yield = batch;
    if (idx % P == P - 1 && batch.size() == bs) {
      out.push_back(std::move(to_yield));
      to_yield.clear();
    }
  }
  if (drop_last || initial.empty()) return out;
  if (!even) {
    if (!to_yield.empty()) out.push_back(std::move(to_yield));
    return out;
  }
  if (to_yield.size() == bs) out.push_back(std::move(to_yield));
  while (initial.size() < P * bs) initial.insert(initial.end(), initial.begin(), initial.end());
  IndexBatch batch = batches.back();
  size_t idx = batches.size() - 1;
  if (batch.size() == bs) {
    batch.clear();
    ++idx;
  }
  size_t cycle = 0;
  while (idx % P != 0 || !batch.empty()) {
    const size_t end = cycle + bs - batch.size();
    const IndexBatch fill = slice(initial, cycle, end);
    batch.insert(batch.end(), fill.begin(), fill.end());
    if (idx % P == r) out.push_back(batch);
    cycle = end;
    batch.clear();
    ++idx;
  }
  return out;
}

}  // namespace detail

/// The batches rank `spec.rank` yields, given all batches of the epoch
/// (made by make_batches with the same batch_size and drop_last). Equals
/// Accelerate's BatchSamplerShard; with world_size 1 the batches are returned
/// unchanged (Accelerate does not shard a single process either).
inline std::vector<IndexBatch> shard_batches(const std::vector<IndexBatch>& batches,
                                             int64_t batch_size, bool drop_last,
                                             const ShardSpec& spec) {
  check_shard_spec(spec, batch_size);
  if (spec.world_size == 1 || batches.empty()) return batches;
  const auto bs = static_cast<size_t>(batch_size);
  const auto P = static_cast<size_t>(spec.world_size);
  const auto r = static_cast<size_t>(spec.rank);
  return spec.split_batches ? detail::shard_split(batches, bs, drop_last, P, r, spec.even_batches)
                            : detail::shard_round_robin(batches, bs, drop_last, P, r,
                                                        spec.even_batches);
}

/// How many batches shard_batches() yields on this rank, without building
/// them. Unlike Accelerate's len() it is exact in every mode (Accelerate
/// over-reports with split_batches and even_batches = false).
inline int64_t sharded_num_batches(int64_t dataset_size, int64_t batch_size, bool drop_last,
                                   const ShardSpec& spec) {
  check_shard_spec(spec, batch_size);
  const int64_t full = dataset_size / batch_size;
  const int64_t tail = drop_last ? 0 : dataset_size % batch_size;
  const int64_t B = full + (tail > 0 ? 1 : 0);  // batches of the unsharded epoch
  const int64_t P = spec.world_size, r = spec.rank;
  if (P == 1) return B;
  if (spec.split_batches) {
    if (spec.even_batches) return B;
    return full + (tail > (batch_size / P) * r ? 1 : 0);
  }
  if (drop_last) return full / P;
  if (spec.even_batches) return (B + P - 1) / P;
  return B / P + (r < B % P ? 1 : 0);
}

}  // namespace accel::data

#endif  // ACCEL_DATA_BATCH_SAMPLER_SHARD_HPP
// end <accel/data/batch_sampler_shard.hpp>
// begin <accel/data/collate.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines DefaultCollate: turns the samples of one batch into one
/// batch by stacking tensors along a new dimension 0 (PyTorch's default_collate
/// for the types a LibTorch dataset returns).
#ifndef ACCEL_DATA_COLLATE_HPP
#define ACCEL_DATA_COLLATE_HPP

#include <torch/data/example.h>
#include <torch/types.h>

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// begin <accel/detail/dependent_false.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::dependent_false, the one false that depends on
/// a template argument: a static_assert in a primary template fires only when
/// that template is instantiated.
#ifndef ACCEL_DETAIL_DEPENDENT_FALSE_HPP
#define ACCEL_DETAIL_DEPENDENT_FALSE_HPP

namespace accel::detail {

template <class...>
inline constexpr bool dependent_false = false;

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_DEPENDENT_FALSE_HPP
// end <accel/detail/dependent_false.hpp>

namespace accel::data {
namespace detail {

template <class T>
struct is_std_vector : std::false_type {};
template <class T, class A>
struct is_std_vector<std::vector<T, A>> : std::true_type {};

// Collated<T>::apply(samples) stacks one field of every sample.
template <class T, class = void>
struct Collated {
  static_assert(accel::detail::dependent_false<T>,
                "accel: the default collate cannot stack this sample type (it stacks torch::Tensor, "
                "arithmetic values, torch::data::Example, std::pair and std::tuple of those). Pass "
                "your own collate to make_data_loader(dataset, options, collate).");
};

template <>
struct Collated<torch::Tensor> {
  using type = torch::Tensor;
  static type apply(const std::vector<torch::Tensor>& samples) { return torch::stack(samples); }
};

template <class T>
struct Collated<T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>>> {
  using type = torch::Tensor;  // the dtype of T (double -> float64, as default_collate)
  static type apply(const std::vector<T>& samples) {
    return torch::tensor(at::ArrayRef<T>(samples.data(), samples.size()),
                         torch::dtype(c10::CppTypeToScalarType<T>::value));
  }
};

template <class T, class Get>
auto field(const std::vector<T>& samples, Get get) {
  using F = std::decay_t<decltype(get(samples.front()))>;
  std::vector<F> out;
  out.reserve(samples.size());
  for (const auto& s : samples) out.push_back(get(s));
  return out;
}

template <class D, class T>
struct Collated<torch::data::Example<D, T>> {
  using type = torch::data::Example<typename Collated<D>::type, typename Collated<T>::type>;
  static type apply(const std::vector<torch::data::Example<D, T>>& samples) {
    return type(Collated<D>::apply(field(samples, [](const auto& e) { return e.data; })),
                Collated<T>::apply(field(samples, [](const auto& e) { return e.target; })));
  }
};

template <class D>
struct Collated<torch::data::Example<D, torch::data::example::NoTarget>> {
  using type = torch::data::Example<typename Collated<D>::type, torch::data::example::NoTarget>;
  static type apply(const std::vector<torch::data::Example<D, torch::data::example::NoTarget>>& s) {
    return type(Collated<D>::apply(field(s, [](const auto& e) { return e.data; })));
  }
};

template <class A, class B>
struct Collated<std::pair<A, B>> {
  using type = std::pair<typename Collated<A>::type, typename Collated<B>::type>;
  static type apply(const std::vector<std::pair<A, B>>& s) {
    return type(Collated<A>::apply(field(s, [](const auto& p) { return p.first; })),
                Collated<B>::apply(field(s, [](const auto& p) { return p.second; })));
  }
};

template <class... Ts>
struct Collated<std::tuple<Ts...>> {
  using type = std::tuple<typename Collated<Ts>::type...>;
  static type apply(const std::vector<std::tuple<Ts...>>& s) {
    return apply_impl(s, std::index_sequence_for<Ts...>{});
  }
  template <std::size_t... I>
  static type apply_impl(const std::vector<std::tuple<Ts...>>& s, std::index_sequence<I...>) {
    return type(Collated<Ts>::apply(field(s, [](const auto& t) { return std::get<I>(t); }))...);
  }
};

}  // namespace detail

/// The collate make_data_loader uses unless given another. Samples:
/// torch::Tensor -> stacked tensor; torch::data::Example<D, T> -> Example of
/// the collated fields (so Example<> -> Example<> with data [B, ...] and
/// target [B, ...]; TensorExample keeps having no target); arithmetic values
/// -> a 1-d tensor; std::pair / std::tuple -> collated element-wise. A value
/// that is not a std::vector (a dataset whose get_batch() already returns a
/// batch, e.g. `dataset.map(Stack<>())`) passes through unchanged.
struct DefaultCollate {
  template <class T>
  typename detail::Collated<T>::type operator()(const std::vector<T>& samples) const {
    return detail::Collated<T>::apply(samples);
  }
  template <class Batch, std::enable_if_t<!detail::is_std_vector<std::decay_t<Batch>>::value, int> = 0>
  std::decay_t<Batch> operator()(Batch&& batch) const {
    return std::forward<Batch>(batch);
  }
};

}  // namespace accel::data

#endif  // ACCEL_DATA_COLLATE_HPP
// end <accel/data/collate.hpp>
// begin <accel/data/data_loader.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines DataLoader<Dataset, Collate>: a range over the batches of a
/// map-style dataset, with seeded shuffling, Accelerate's sharding across
/// ranks, device placement, prefetching threads, end-of-data bookkeeping and
/// exact resume.
#ifndef ACCEL_DATA_DATA_LOADER_HPP
#define ACCEL_DATA_DATA_LOADER_HPP

// begin <accel/data/detail/dataset_access.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines how the data loader reads a map-style dataset: its size and
/// the samples (or ready batch) of a list of indices.
#ifndef ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP
#define ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP


#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::data::detail {

template <class D>
concept HasGet = requires(D& d, size_t i) { d.get(i); };
template <class D>
concept HasGetBatch = requires(D& d, const std::vector<size_t>& idx) { d.get_batch(idx); };
template <class D>
concept HasSize = requires(const D& d) { d.size(); };

// torch datasets return optional<size_t> (c10::optional in LibTorch 1.x,
// std::optional in 2.x); plain integers are accepted as well.
template <class D>
size_t dataset_size(const D& dataset) {
  auto size = dataset.size();
  if constexpr (std::is_integral_v<decltype(size)>) {
    return static_cast<size_t>(size);
  } else {
    ACCEL_CHECK(size.has_value(),
                "accel: the dataset's size() returned no value, but a data loader must know how "
                "many samples there are. Give the dataset a size(), or batch it yourself.");
    return static_cast<size_t>(*size);
  }
}

// Per-sample get() is preferred (it is what a torch::data::Dataset subclass
// defines); a dataset with only get_batch() (dataset.map(...)) is asked for
// the whole batch at once.
template <class D>
auto fetch(D& dataset, const std::vector<size_t>& indices) {
  if constexpr (HasGet<D>) {
    std::vector<std::decay_t<decltype(dataset.get(size_t{}))>> samples;
    samples.reserve(indices.size());
    for (size_t i : indices) samples.push_back(dataset.get(i));
    return samples;
  } else {
    return dataset.get_batch(indices);
  }
}

template <class D>
using raw_batch_t = decltype(fetch(std::declval<D&>(), std::declval<const std::vector<size_t>&>()));

}  // namespace accel::data::detail

namespace accel::data {

/// What make_data_loader accepts: a map-style dataset (get(size_t) or
/// get_batch(indices), and size()), e.g. any torch::data::Dataset subclass,
/// torch::data::datasets::MNIST, TensorDataset, or dataset.map(transform).
template <class D>
concept MapStyleDataset = (detail::HasGet<D> || detail::HasGetBatch<D>) && detail::HasSize<D>;

}  // namespace accel::data

#endif  // ACCEL_DATA_DETAIL_DATASET_ACCESS_HPP
// end <accel/data/detail/dataset_access.hpp>
// begin <accel/data/detail/prefetcher.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines detail::Prefetcher: worker threads that produce the batches
/// of one epoch ahead of the consumer, handed out strictly in order.
#ifndef ACCEL_DATA_DETAIL_PREFETCHER_HPP
#define ACCEL_DATA_DETAIL_PREFETCHER_HPP


#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

namespace accel::data::detail {

// Workers claim batch numbers in increasing order, at most `capacity` ahead of
// the consumer, and file each result (or the exception that producing it
// threw) under its number: so the consumer sees exactly the sequential
// batches, an exception surfaces at the batch that raised it, and memory is
// bounded. stop() (also run by the destructor) makes idle workers exit and
// joins them; a worker inside produce() finishes that one batch first.
template <class Batch>
class Prefetcher {
 public:
  using Produce = std::function<Batch(int64_t)>;

  Prefetcher(int64_t first, int64_t end, int workers, int64_t capacity, Produce produce,
             std::chrono::milliseconds timeout)
      : produce_(std::move(produce)),
        next_claim_(first),
        next_consume_(first),
        end_(end),
        capacity_(capacity < 1 ? 1 : capacity),
        timeout_(timeout) {
    alive_ = workers;
    threads_.reserve(static_cast<size_t>(workers));
    try {
      for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
    } catch (...) {
      alive_ = static_cast<int>(threads_.size());
      stop();
      throw;
    }
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;
  ~Prefetcher() { stop(); }

  // Batch number j; must be called for first, first+1, ... in order.
  Batch get(int64_t j) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (;;) {
      if (auto it = ready_.find(j); it != ready_.end()) {
        Slot slot = std::move(it->second);
        ready_.erase(it);
        next_consume_ = j + 1;
        lock.unlock();
        space_.notify_all();
        if (auto* error = std::get_if<std::exception_ptr>(&slot)) std::rethrow_exception(*error);
        return std::move(std::get<Batch>(slot));
      }
      ACCEL_CHECK(alive_ > 0, "accel: the data loader's worker threads stopped before batch ", j,
                  " was produced. Report this as a bug; use num_workers = 0 meanwhile.");
      if (ready_cv_.wait_until(lock, deadline) == std::cv_status::timeout && !ready_.count(j))
        throw Error(::accel::detail::concat("accel: a data loader worker took more than ", timeout_.count(),
                           " ms to produce batch ", j,
                           ". Check the dataset's get() for a hang, or raise "
                           "LoaderOptions::timeout."));
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    space_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
    threads_.clear();
  }

 private:
  using Slot = std::variant<Batch, std::exception_ptr>;

  void work() {
    for (;;) {
      int64_t j = 0;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        space_.wait(lock, [&] {
          return stopping_ || next_claim_ >= end_ || next_claim_ < next_consume_ + capacity_;
        });
        if (stopping_ || next_claim_ >= end_) break;
        j = next_claim_++;
      }
      Slot slot = [&]() -> Slot {
        try {
          return Slot(std::in_place_index<0>, produce_(j));
        } catch (...) {
          return Slot(std::in_place_index<1>, std::current_exception());
        }
      }();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ready_.emplace(j, std::move(slot));
      }
      ready_cv_.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --alive_;
    }
    ready_cv_.notify_all();
  }

  Produce produce_;
  std::mutex mutex_;
  std::condition_variable space_;     // workers wait for room in the window
  std::condition_variable ready_cv_;  // the consumer waits for its batch
  std::map<int64_t, Slot> ready_;
  int64_t next_claim_, next_consume_, end_, capacity_;
  std::chrono::milliseconds timeout_;
  int alive_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace accel::data::detail

#endif  // ACCEL_DATA_DETAIL_PREFETCHER_HPP
// end <accel/data/detail/prefetcher.hpp>
// begin <accel/data/loader_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines LoaderState and active_loader_state(): which data loader is
/// being iterated and whether its current batch is the last one (Accelerate's
/// GradientState.end_of_dataloader / remainder, used by gather_for_metrics and
/// gradient accumulation).
#ifndef ACCEL_DATA_LOADER_STATE_HPP
#define ACCEL_DATA_LOADER_STATE_HPP

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace accel::data {

/// The state of one iteration (epoch) of a data loader.
struct LoaderState {
  /// True while the last batch of the epoch (on this rank) is being
  /// processed: it is set before that batch is handed out.
  bool end_of_dataloader = false;
  /// dataset_size % total_batch_size (total = batch_size with split_batches,
  /// else batch_size * world_size); 0 with drop_last. On the last batch,
  /// gather_for_metrics keeps only the first `remainder` gathered samples
  /// when it is > 0: the rest are the wrap-around duplicates of even_batches.
  int64_t remainder = 0;
  /// Index (0-based, per rank, counting skipped batches) of the batch being
  /// processed; -1 before the first.
  int64_t batch_index = -1;
  /// Batches of this epoch on this rank.
  int64_t num_batches = 0;
};

namespace detail {

// Per-thread stack of the loaders being iterated, innermost last: a thread
// sees only the loops it runs itself (two threads training side by side do
// not see each other's loader). An entry is removed by identity so that
// out-of-order ends cannot corrupt it; an iteration keeps its stack alive and
// removes itself from it even when it ends on another thread (hence the lock).
class ActiveLoaders {
 public:
  static const std::shared_ptr<ActiveLoaders>& instance() {
    thread_local const auto stack = std::make_shared<ActiveLoaders>();
    return stack;
  }
  void push(const LoaderState* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    states_.push_back(s);
  }
  void remove(const LoaderState* s) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find(states_.rbegin(), states_.rend(), s);
    if (it != states_.rend()) states_.erase(std::next(it).base());
  }
  const LoaderState* top() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return states_.empty() ? nullptr : states_.back();
  }
  std::size_t depth() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return states_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::vector<const LoaderState*> states_;
};

}  // namespace detail

/// The state of the innermost data loader being iterated, or nullptr when no
/// loader is. An evaluation loader iterated inside the training loop is the
/// active one until its loop ends (or is left by break/exception); then the
/// training loader is active again. The pointer is valid until that loop ends.
inline const LoaderState* active_loader_state() { return detail::ActiveLoaders::instance()->top(); }

}  // namespace accel::data

#endif  // ACCEL_DATA_LOADER_STATE_HPP
// end <accel/data/loader_state.hpp>
// begin <accel/data/to_device.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines to_device(batch, device): moves every tensor of a batch to a
/// device (Accelerate's send_to_device), with DeviceMover<T> as the
/// customization point for user types.
#ifndef ACCEL_DATA_TO_DEVICE_HPP
#define ACCEL_DATA_TO_DEVICE_HPP

#include <torch/data/example.h>
#include <torch/types.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::data {

/// Specialize for a batch type that to_device() does not know:
///   template <> struct accel::data::DeviceMover<MyBatch> {
///     static MyBatch apply(MyBatch b, const torch::Device& d, bool non_blocking);
///   };
/// Types with a member `.to(torch::Device)` need no specialization.
template <class T>
struct DeviceMover {};

template <class T>
T to_device(T batch, const torch::Device& device, bool non_blocking = false);

namespace detail {

template <class T>
concept HasDeviceMover = requires(T t, const torch::Device& d) {
  { DeviceMover<T>::apply(std::move(t), d, false) } -> std::convertible_to<T>;
};
template <class T>
concept HasToReturning = requires(T t, const torch::Device& d) {
  { t.to(d) } -> std::convertible_to<T>;
};
template <class T>
concept HasToInPlace = requires(T t, const torch::Device& d) {
  { t.to(d) } -> std::same_as<void>;
};

template <class T>
struct is_example : std::false_type {};
template <class D, class Tg>
struct is_example<torch::data::Example<D, Tg>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_tuple : std::false_type {};
template <class... Ts>
struct is_tuple<std::tuple<Ts...>> : std::true_type {};
template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_string_map : std::false_type {};
template <class V, class C, class A>
struct is_string_map<std::map<std::string, V, C, A>> : std::true_type {};

template <class>
inline constexpr bool unmovable_v = false;

}  // namespace detail

/// Returns `batch` with every tensor in it on `device`. Knows torch::Tensor,
/// torch::data::Example, std::pair, std::tuple, std::vector, std::optional,
/// std::map<std::string, T>, arithmetic values and strings (unchanged), types
/// with a `.to(device)` member (returning the moved value, or moving in
/// place), and any T with a DeviceMover<T> specialization (checked first).
template <class T>
T to_device(T batch, const torch::Device& device, bool non_blocking) {
  if constexpr (detail::HasDeviceMover<T>) {
    return DeviceMover<T>::apply(std::move(batch), device, non_blocking);
  } else if constexpr (std::is_same_v<T, torch::Tensor>) {
    if (!batch.defined() || batch.device() == device) return batch;
    return batch.to(torch::TensorOptions().device(device), non_blocking);
  } else if constexpr (detail::is_example<T>::value) {
    batch.data = to_device(std::move(batch.data), device, non_blocking);
    if constexpr (!std::is_void_v<typename T::TargetType>)
      batch.target = to_device(std::move(batch.target), device, non_blocking);
    return batch;
  } else if constexpr (detail::is_pair<T>::value) {
    batch.first = to_device(std::move(batch.first), device, non_blocking);
    batch.second = to_device(std::move(batch.second), device, non_blocking);
    return batch;
  } else if constexpr (detail::is_tuple<T>::value) {
    std::apply([&](auto&... e) { ((e = to_device(std::move(e), device, non_blocking)), ...); },
               batch);
    return batch;
  } else if constexpr (detail::is_vector<T>::value || detail::is_string_map<T>::value) {
    for (auto& e : batch) {
      if constexpr (detail::is_vector<T>::value)
        e = to_device(std::move(e), device, non_blocking);
      else
        e.second = to_device(std::move(e.second), device, non_blocking);
    }
    return batch;
  } else if constexpr (detail::is_optional<T>::value) {
    if (batch) *batch = to_device(std::move(*batch), device, non_blocking);
    return batch;
  } else if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                       std::is_same_v<T, std::string>) {
    return batch;
  } else if constexpr (detail::HasToReturning<T>) {
    return batch.to(device);
  } else if constexpr (detail::HasToInPlace<T>) {
    batch.to(device);
    return batch;
  } else {
    static_assert(detail::unmovable_v<T>,
                  "accel: to_device() does not know how to move this batch type to a device. Give "
                  "it a member `.to(torch::Device)` or specialize accel::data::DeviceMover<T>.");
    return batch;
  }
}

}  // namespace accel::data

#endif  // ACCEL_DATA_TO_DEVICE_HPP
// end <accel/data/to_device.hpp>
// begin <accel/profiling/events.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::profiling::Events, accel's own trace events (gradient
/// bucket reductions, waits for them, data loading, checkpoints) recorded
/// beside LibTorch's operators while an Accelerator::profile() object lives,
/// and profiling::Span, the scope that records one of them.
#ifndef ACCEL_PROFILING_EVENTS_HPP
#define ACCEL_PROFILING_EVENTS_HPP

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>


namespace accel::profiling {

/// One recorded event in Chrome trace terms. Plain data, so that the hot
/// path (bucket rounds, optimizer steps, loaders) compiles no JSON: trace.hpp
/// writes it out.
struct Event {
  using Arg = std::pair<std::string, std::variant<int64_t, double, std::string>>;
  std::string name;
  const char* category;  // a string literal at every call site
  char phase;            // 'X' complete; 'b', 'n', 'e' an asynchronous span
  int64_t ts_us;
  int64_t dur_us = 0;    // 'X' only
  int64_t id = -1;       // asynchronous spans only
  int64_t tid = 0;
  std::vector<Arg> args;
};

/// An argument shown with an event: integers, floating point, else a string.
template <class V>
Event::Arg event_arg(std::string key, V&& value) {
  using U = std::remove_cvref_t<V>;
  if constexpr (std::is_integral_v<U>)
    return {std::move(key), static_cast<int64_t>(value)};
  else if constexpr (std::is_floating_point_v<U>)
    return {std::move(key), static_cast<double>(value)};
  else
    return {std::move(key), std::string(std::forward<V>(value))};
}

/// The process's recording of accel events. When nothing records, every
/// call site costs one relaxed atomic load: no clock read, no allocation.
class Events {
 public:
  /// Whether a profile() object is recording on this process.
  static bool recording() noexcept { return on_.load(std::memory_order_relaxed); }
  /// Microseconds since the epoch: every rank's clock, so merged traces line up.
  static int64_t now_us() noexcept {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  /// Chrome trace tid of the calling thread: the id LibTorch's profiler gives
  /// it, so accel's events share the track of the operators around them.
  static int64_t thread_id() { return static_cast<int64_t>(at::RecordFunction::currentThreadId()); }

  /// A complete ("X") event on the calling thread.
  static void complete(const char* name, const char* category, int64_t begin_us, int64_t end_us,
                       std::vector<Event::Arg> args = {}) {
    add(Event{name, category, 'X', begin_us, end_us - begin_us, -1, thread_id(), std::move(args)});
  }
  /// One end of an asynchronous span ("b" or "e", or "n" a mark inside it): a
  /// bucket's reduction runs while the thread that started it goes on, so it
  /// gets its own row.
  static void async(char phase, std::string name, const char* category, int64_t id, int64_t ts_us,
                    std::vector<Event::Arg> args = {}) {
    add(Event{std::move(name), category, phase, ts_us, 0, id, thread_id(), std::move(args)});
  }

  /// Starts recording (Trace's constructor); one recording at a time.
  static void start() {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    ACCEL_CHECK(!on_.load(), "accel: profile() was called while another profile() object of this "
                "process is still recording. Let the first one go out of scope (or stop() it) first.");
    s.events.clear();
    on_.store(true);
  }
  /// Stops recording and hands over what was recorded (Trace's stop()).
  static std::vector<Event> stop() {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    on_.store(false);
    return std::exchange(s.events, {});
  }

 private:
  // Constant-initialised: reading it needs no guard of a function's static.
  inline static std::atomic<bool> on_{false};
  struct State {
    std::mutex mutex;  // reductions finish and loaders prefetch on other threads
    std::vector<Event> events;
  };
  static State& state() {
    static State s;  // one per program: an inline function's static
    return s;
  }
  static void add(Event event) {
    auto& s = state();
    std::lock_guard lock(s.mutex);
    if (on_.load()) s.events.push_back(std::move(event));  // a span that outlived stop() is dropped
  }
};

/// RAII: records [construction, destruction) as a complete event when a
/// profile() object records at construction; otherwise does nothing else.
class Span {
 public:
  Span(const char* name, const char* category) noexcept
      : name_(name), category_(category), begin_us_(Events::recording() ? Events::now_us() : -1) {}
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;
  ~Span() {
    if (begin_us_ < 0) return;
    try {
      Events::complete(name_, category_, begin_us_, Events::now_us(), std::move(args_));
    } catch (...) {  // profiling never breaks training
    }
  }
  /// Adds an argument shown with the event (only evaluated while recording).
  template <class V>
  void arg(const char* key, V&& value) {
    if (begin_us_ >= 0) args_.push_back(event_arg(key, std::forward<V>(value)));
  }

 private:
  const char* name_;
  const char* category_;
  int64_t begin_us_;
  std::vector<Event::Arg> args_;  // empty until an argument is set: no allocation when not recording
};

}  // namespace accel::profiling

#endif  // ACCEL_PROFILING_EVENTS_HPP
// end <accel/profiling/events.hpp>

#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::data {

/// Batches of a map-style dataset; made by make_data_loader().
///
/// Epochs: iterating the loader runs one epoch. The order of epoch e is fixed
/// by (seed, e) alone (see LoaderOptions::shuffle). As Accelerate's
/// SeedableRandomSampler, a loop that runs to the end advances epoch() by one,
/// so a second loop without set_epoch() sees a new order; a loop left early
/// (break, exception) does not, and the next loop starts that epoch again.
///
/// Copies share the dataset and the collate (both are used from the worker
/// threads concurrently when num_workers > 0: their get()/call must be safe to
/// run concurrently). Plain copies also share the position (epoch, batches
/// yielded, batches to skip): prepare() hands the user a copy, and the
/// Accelerator's save_state() must see where the user's loop stands.
/// sharded(), skip_first_batches() and detached() return loaders with a
/// position of their own. Each copy has its own device. The loader must
/// outlive its loops.
template <class Dataset, class Collate = DefaultCollate>
class DataLoader {
 public:
  using dataset_type = Dataset;
  using collate_type = Collate;
  using sample_batch_type = detail::raw_batch_t<Dataset>;
  using batch_type = std::decay_t<std::invoke_result_t<Collate&, sample_batch_type&&>>;

  DataLoader(std::shared_ptr<Dataset> dataset, LoaderOptions options, Collate collate = Collate{})
      : dataset_(std::move(dataset)),
        collate_(std::make_shared<Collate>(std::move(collate))),
        options_(options) {
    ACCEL_CHECK(dataset_ != nullptr, "accel: make_data_loader got a null dataset pointer. ",
                "Pass a dataset object or a non-null std::shared_ptr to one.");
    ACCEL_CHECK(options_.batch_size >= 1, "accel: LoaderOptions::batch_size must be at least 1 (got ",
                options_.batch_size, "). Set .batch_size to the number of samples per batch.");
    ACCEL_CHECK(options_.num_workers >= 0, "accel: LoaderOptions::num_workers must not be negative",
                " (got ", options_.num_workers, "). Use 0 to load on the calling thread.");
    ACCEL_CHECK(options_.num_workers == 0 || options_.prefetch_factor >= 1,
                "accel: LoaderOptions::prefetch_factor must be at least 1 with workers (got ",
                options_.prefetch_factor, "). Use the default 2.");
    dataset_size_ = static_cast<int64_t>(detail::dataset_size(*dataset_));
  }

  class iterator;

  /// Starts an epoch: registers this loop as the active loader (see
  /// active_loader_state()) until it ends, and yields the first batch.
  iterator begin();
  iterator end() { return iterator(); }

  /// The epoch the next loop runs (seeds its shuffle). Call before each loop,
  /// as in Accelerate, or rely on the automatic advance after a full loop.
  /// Also calls dataset().set_epoch(epoch) when the dataset has one (as
  /// Accelerate's DataLoaderShard.set_epoch does).
  void set_epoch(int64_t epoch) {
    progress_->epoch = epoch;
    if constexpr (requires(Dataset& d) { d.set_epoch(epoch); }) dataset_->set_epoch(epoch);
  }
  int64_t epoch() const { return progress_->epoch; }

  /// Batches this rank yields per epoch (exact, also for uneven shards).
  int64_t size() const {
    return sharded_num_batches(dataset_size_, options_.batch_size, options_.drop_last, shard_);
  }
  /// Samples in a full batch of this rank (batch_size / world with split_batches).
  int64_t batch_size() const {
    return shard_.split_batches ? options_.batch_size / shard_.world_size : options_.batch_size;
  }
  /// Samples in one global batch, over all ranks.
  int64_t total_batch_size() const {
    return shard_.split_batches ? options_.batch_size : options_.batch_size * shard_.world_size;
  }
  int64_t dataset_size() const { return dataset_size_; }
  /// dataset_size % total_batch_size, 0 with drop_last (Accelerate's remainder).
  int64_t remainder() const { return options_.drop_last ? 0 : dataset_size_ % total_batch_size(); }

  const LoaderOptions& options() const { return options_; }
  const ShardSpec& shard_spec() const { return shard_; }
  Dataset& dataset() const { return *dataset_; }
  const std::shared_ptr<Dataset>& dataset_ptr() const { return dataset_; }
  Collate& collate() const { return *collate_; }

  /// A copy of this loader that yields rank spec.rank's share of every global
  /// batch, exactly as Accelerate's BatchSamplerShard. Throws accel::Error for
  /// a bad rank/world or split_batches with batch_size % world_size != 0.
  DataLoader sharded(const ShardSpec& spec) const {
    check_shard_spec(spec, options_.batch_size);
    DataLoader copy = detached();
    copy.shard_ = spec;
    return copy;
  }

  /// Batches are moved there (to_device) before they are handed out.
  void set_device(torch::Device device, bool non_blocking = false) {
    device_ = device;
    non_blocking_ = non_blocking;
  }
  std::optional<torch::Device> device() const { return device_; }

  /// Batches of the current epoch handed out on this rank so far (skipped
  /// ones included); 0 after a loop ran to its end.
  int64_t batches_yielded() const { return progress_->yielded; }

  /// A copy with a position of its own (same epoch and position now; loops of
  /// one no longer move the other).
  DataLoader detached() const {
    DataLoader copy(*this);
    copy.progress_ = std::make_shared<Progress>(*progress_);
    return copy;
  }

  /// A copy whose next loop leaves out the first n batches (per rank) of its
  /// epoch, without loading them; later loops are whole epochs again.
  DataLoader skip_first_batches(int64_t n) const {
    ACCEL_CHECK(n >= 0, "accel: skip_first_batches needs a non-negative count (got ", n,
                "). Pass the number of batches already processed in this epoch.");
    DataLoader copy = detached();
    copy.progress_->pending_skip = n;
    copy.progress_->yielded = n;
    return copy;
  }

  /// Where the loader stands; restore() of it makes the next loop continue
  /// with the next batch of the same epoch, in the same order.
  LoaderCheckpoint checkpoint() const {
    return LoaderCheckpoint{progress_->epoch, progress_->yielded};
  }
  void restore(const LoaderCheckpoint& c) {
    ACCEL_CHECK(c.batches_yielded >= 0, "accel: a LoaderCheckpoint with batches_yielded = ",
                c.batches_yielded, " cannot be restored. Pass one made by checkpoint().");
    progress_->epoch = c.epoch;
    progress_->pending_skip = c.batches_yielded;
    progress_->yielded = c.batches_yielded;
  }

  /// The dataset indices of the batches this rank yields in `epoch`.
  std::vector<IndexBatch> epoch_batches(int64_t epoch) const {
    const auto order = epoch_order(static_cast<size_t>(dataset_size_), options_.shuffle,
                                   options_.seed, epoch);
    return shard_batches(make_batches(order, options_.batch_size, options_.drop_last),
                         options_.batch_size, options_.drop_last, shard_);
  }

 private:
  class Run;

  std::shared_ptr<Dataset> dataset_;
  std::shared_ptr<Collate> collate_;
  LoaderOptions options_;
  ShardSpec shard_{};
  int64_t dataset_size_ = 0;
  // Where the loop stands; shared by plain copies (see the class comment).
  struct Progress {
    int64_t epoch = 0;
    int64_t yielded = 0;
    int64_t pending_skip = 0;
  };
  std::shared_ptr<Progress> progress_ = std::make_shared<Progress>();
  std::optional<torch::Device> device_;
  bool non_blocking_ = false;
};

/// One loop over the loader: the epoch's index batches, the prefetch
/// workers, and the LoaderState registered as active. Ends (unregisters,
/// joins workers) when exhausted or when the last iterator is destroyed.
template <class Dataset, class Collate>
class DataLoader<Dataset, Collate>::Run {
 public:
  explicit Run(DataLoader& loader)
      : loader_(&loader), progress_(loader.progress_), dataset_(loader.dataset_),
        collate_(loader.collate_),
        device_(loader.device_), non_blocking_(loader.non_blocking_) {}
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;
  ~Run() { finish(false); }

  void start() {
    batches_ = loader_->epoch_batches(progress_->epoch);
    const auto count = static_cast<int64_t>(batches_.size());
    next_ = std::min(progress_->pending_skip, count);
    progress_->pending_skip = 0;
    progress_->yielded = next_;
    state_.remainder = loader_->remainder();
    state_.num_batches = count;
    const LoaderOptions& o = loader_->options_;
    if (o.num_workers > 0 && next_ < count) {
      prefetcher_ = std::make_unique<detail::Prefetcher<batch_type>>(
          next_, count, o.num_workers, static_cast<int64_t>(o.prefetch_factor) * o.num_workers,
          [this](int64_t j) { return produce(j); }, o.timeout);
    }
    active_ = detail::ActiveLoaders::instance();
    active_->push(&state_);
  }

  // Moves to the next batch; false (and the loop is over) when there is none.
  bool advance() {
    const auto count = static_cast<int64_t>(batches_.size());
    if (next_ >= count) {
      finish(true);
      return false;
    }
    current_.reset();
    profiling::Span span("accel: data loading", "accel.data");
    batch_type batch = prefetcher_ ? prefetcher_->get(next_) : produce(next_);
    if (device_) batch = to_device(std::move(batch), *device_, non_blocking_);
    current_.emplace(std::move(batch));
    state_.batch_index = next_;
    state_.end_of_dataloader = next_ == count - 1;
    progress_->yielded = ++next_;
    return true;
  }

  batch_type& current() { return *current_; }
  bool finished() const { return finished_; }

 private:
  batch_type produce(int64_t j) const {
    return std::invoke(*collate_, detail::fetch(*dataset_, batches_[static_cast<size_t>(j)]));
  }

  void finish(bool completed) {
    if (finished_) return;
    finished_ = true;
    prefetcher_.reset();  // joins the workers
    if (active_) active_->remove(&state_);
    active_.reset();
    if (completed) {
      progress_->epoch += 1;
      progress_->yielded = 0;
    }
  }

  DataLoader* loader_;
  std::shared_ptr<Progress> progress_;
  std::shared_ptr<Dataset> dataset_;
  std::shared_ptr<Collate> collate_;
  std::optional<torch::Device> device_;
  bool non_blocking_;
  std::vector<IndexBatch> batches_;
  int64_t next_ = 0;
  LoaderState state_;
  std::optional<batch_type> current_;
  std::unique_ptr<detail::Prefetcher<batch_type>> prefetcher_;
  std::shared_ptr<detail::ActiveLoaders> active_;  // the stack of the thread that started it
  bool finished_ = false;
};

/// Input iterator over one loop; all copies share the loop.
template <class Dataset, class Collate>
class DataLoader<Dataset, Collate>::iterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = batch_type;
  using difference_type = std::ptrdiff_t;
  using pointer = batch_type*;
  using reference = batch_type&;

  iterator() = default;

  reference operator*() const { return run_->current(); }
  pointer operator->() const { return &run_->current(); }
  iterator& operator++() {
    if (!run_->advance()) run_.reset();
    runtime::heartbeat();  // progress, for the launcher's hang detection
    return *this;
  }
  void operator++(int) { ++*this; }
  friend bool operator==(const iterator& a, const iterator& b) { return a.done() == b.done(); }

 private:
  friend class DataLoader;
  explicit iterator(std::shared_ptr<Run> run) : run_(std::move(run)) {}
  bool done() const { return !run_ || run_->finished(); }
  std::shared_ptr<Run> run_;
};

template <class Dataset, class Collate>
typename DataLoader<Dataset, Collate>::iterator DataLoader<Dataset, Collate>::begin() {
  auto run = std::make_shared<Run>(*this);
  run->start();
  if (!run->advance()) return iterator();
  return iterator(std::move(run));
}

/// True for the DataLoader types of accel::data (after removing cv/ref).
template <class T>
struct is_data_loader : std::false_type {};
template <class D, class C>
struct is_data_loader<DataLoader<D, C>> : std::true_type {};
template <class T>
inline constexpr bool is_data_loader_v = is_data_loader<std::remove_cvref_t<T>>::value;

}  // namespace accel::data

#endif  // ACCEL_DATA_DATA_LOADER_HPP
// end <accel/data/data_loader.hpp>
// begin <accel/data/make_data_loader.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines make_data_loader(): the entry point that turns a map-style
/// dataset and LoaderOptions into a DataLoader.
#ifndef ACCEL_DATA_MAKE_DATA_LOADER_HPP
#define ACCEL_DATA_MAKE_DATA_LOADER_HPP


#include <memory>
#include <type_traits>
#include <utility>

namespace accel::data {
namespace detail {

template <class T>
struct dataset_of {
  using type = std::remove_cvref_t<T>;
  static std::shared_ptr<type> share(T&& d) { return std::make_shared<type>(std::forward<T>(d)); }
};
template <class T>
struct dataset_of<std::shared_ptr<T>> {
  using type = T;
  static std::shared_ptr<T> share(std::shared_ptr<T> d) { return d; }
};
template <class T>
struct dataset_of<std::shared_ptr<T>&> : dataset_of<std::shared_ptr<T>> {};
template <class T>
struct dataset_of<const std::shared_ptr<T>&> : dataset_of<std::shared_ptr<T>> {};

template <class T>
using dataset_t = typename dataset_of<T>::type;

template <class D>
constexpr void check_dataset() {
  static_assert(MapStyleDataset<D>,
                "accel: make_data_loader needs a map-style dataset: get(size_t) (or "
                "get_batch(indices)) and size(). Derive from torch::data::datasets::Dataset<Self>, "
                "or pass a std::shared_ptr to such a dataset.");
}

}  // namespace detail

/// A loader over `dataset` (held by value, or shared when given a
/// std::shared_ptr) whose batches are made by DefaultCollate.
template <class D>
auto make_data_loader(D&& dataset, LoaderOptions options = {}) {
  using Dataset = detail::dataset_t<D>;
  detail::check_dataset<Dataset>();
  return DataLoader<Dataset, DefaultCollate>(detail::dataset_of<D>::share(std::forward<D>(dataset)),
                                             options);
}

/// A loader whose batches are `collate(samples)`, where samples is the
/// std::vector of what dataset.get(i) returns for the batch's indices (or what
/// get_batch() returns, for a dataset without get()). The collate is called
/// from the worker threads when num_workers > 0.
template <class D, class Collate>
auto make_data_loader(D&& dataset, LoaderOptions options, Collate collate) {
  using Dataset = detail::dataset_t<D>;
  detail::check_dataset<Dataset>();
  static_assert(std::is_invocable_v<Collate&, detail::raw_batch_t<Dataset>&&>,
                "accel: the collate passed to make_data_loader cannot be called with the samples "
                "of one batch. Make it accept std::vector<Example> (Example: what the dataset's "
                "get() returns).");
  return DataLoader<Dataset, std::decay_t<Collate>>(
      detail::dataset_of<D>::share(std::forward<D>(dataset)), options, std::move(collate));
}

}  // namespace accel::data

#endif  // ACCEL_DATA_MAKE_DATA_LOADER_HPP
// end <accel/data/make_data_loader.hpp>
// begin <accel/data/tensor_dataset.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines TensorDataset: in-memory tensors indexed along dimension 0,
/// read a whole batch at a time (one index_select per tensor instead of one
/// get() per sample and a stack).
#ifndef ACCEL_DATA_TENSOR_DATASET_HPP
#define ACCEL_DATA_TENSOR_DATASET_HPP


#include <torch/data/example.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace accel::data {

/// Samples are rows of `data` and `target` (same length along dimension 0).
/// make_data_loader(TensorDataset(x, y), ...) yields torch::data::Example<>
/// batches identical to a per-sample dataset's stacked ones, built with one
/// index_select per tensor. Batches are copies: changing one in place does not
/// change the dataset. Safe to read from several worker threads.
class TensorDataset {
 public:
  TensorDataset(torch::Tensor data, torch::Tensor target)
      : data_(std::move(data)), target_(std::move(target)) {
    ACCEL_CHECK(data_.defined() && target_.defined() && data_.dim() >= 1 && target_.dim() >= 1,
                "accel: TensorDataset needs two defined tensors with at least one dimension. "
                "Pass the samples and their targets stacked along dimension 0.");
    ACCEL_CHECK(data_.size(0) == target_.size(0), "accel: TensorDataset got ", data_.size(0),
                " samples but ", target_.size(0),
                " targets. Pass tensors of the same length along dimension 0.");
  }

  torch::data::Example<> get_batch(const std::vector<size_t>& indices) const {
    const torch::Tensor idx =
        torch::tensor(std::vector<int64_t>(indices.begin(), indices.end()), torch::kLong)
            .to(data_.device());
    return {data_.index_select(0, idx), target_.index_select(0, idx.to(target_.device()))};
  }

  std::optional<size_t> size() const { return static_cast<size_t>(data_.size(0)); }

  const torch::Tensor& data() const { return data_; }
  const torch::Tensor& target() const { return target_; }

 private:
  torch::Tensor data_, target_;
};

}  // namespace accel::data

#endif  // ACCEL_DATA_TENSOR_DATASET_HPP
// end <accel/data/tensor_dataset.hpp>

#endif  // ACCEL_DATA_HPP
// end <accel/data.hpp>
// begin <accel/sched.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines nothing itself: includes the learning-rate schedulers
/// (accel::sched::OneCycleLR, accel::sched::LinearWarmup).
#ifndef ACCEL_SCHED_HPP
#define ACCEL_SCHED_HPP

// begin <accel/sched/linear_warmup.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::sched::LinearWarmup: a linear learning-rate warm-up,
/// optionally followed by a linear decay to zero (Hugging Face's
/// get_linear_schedule_with_warmup when start_factor is 0).
#ifndef ACCEL_SCHED_LINEAR_WARMUP_HPP
#define ACCEL_SCHED_LINEAR_WARMUP_HPP

// begin <accel/sched/detail/param_groups.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines PerGroup (one value or one per parameter group) and the
/// helpers the schedulers use to read and write learning rate and momentum of
/// an optimizer's parameter groups, whatever the optimizer type.
#ifndef ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP
#define ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP


#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace accel::sched {

/// A scheduler argument given either once for all parameter groups
/// (`.max_lr = 0.1`) or once per group (`.max_lr = {0.1, 0.01}`), as Python's
/// schedulers accept a float or a list.
struct PerGroup {
  std::vector<double> values;

  PerGroup() = default;
  PerGroup(double v) : values{v} {}  // NOLINT: implicit on purpose
  PerGroup(std::initializer_list<double> v) : values(v) {}
  PerGroup(std::vector<double> v) : values(std::move(v)) {}  // NOLINT

  /// One value per group: a single value is repeated; a list must match.
  std::vector<double> expand(std::size_t groups, const char* scheduler,
                             const char* name) const {
    ACCEL_CHECK(!values.empty(), "accel: ", scheduler, " needs a value for ", name,
                ". Set it in the options (one number, or one per parameter group).");
    if (values.size() == 1) return std::vector<double>(groups, values.front());
    ACCEL_CHECK(values.size() == groups, "accel: ", scheduler, " expected ", groups,
                " values for ", name, " (one per parameter group), got ", values.size(),
                ". Pass one number or exactly one per parameter group.");
    return values;
  }
};

namespace detail {

/// Which optimizer field OneCycleLR cycles: Python cycles `momentum` when the
/// optimizer has one (SGD, RMSprop) and beta1 when it has `betas` (Adam, AdamW).
enum class MomentumField { None, Momentum, Beta1 };

inline MomentumField momentum_field(const torch::optim::OptimizerOptions& o) {
  if (dynamic_cast<const torch::optim::SGDOptions*>(&o) ||
      dynamic_cast<const torch::optim::RMSpropOptions*>(&o))
    return MomentumField::Momentum;
  if (dynamic_cast<const torch::optim::AdamOptions*>(&o) ||
      dynamic_cast<const torch::optim::AdamWOptions*>(&o))
    return MomentumField::Beta1;
  return MomentumField::None;
}

inline void set_momentum(torch::optim::OptimizerOptions& o, double m) {
  if (auto* p = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
    p->momentum(m);
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&o)) {
    r->momentum(m);
  } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
    a->betas(std::make_tuple(m, std::get<1>(a->betas())));
  } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
    w->betas(std::make_tuple(m, std::get<1>(w->betas())));
  }
}

inline double get_momentum(const torch::optim::OptimizerOptions& o) {
  if (auto* p = dynamic_cast<const torch::optim::SGDOptions*>(&o)) return p->momentum();
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return r->momentum();
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return std::get<0>(a->betas());
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return std::get<0>(w->betas());
  return 0.0;
}

/// Writes lrs (one per group) into the optimizer; the base class's own setter
/// is private, and construction and set_step_count() need one.
inline void set_lrs(torch::optim::Optimizer& opt, const std::vector<double>& lrs) {
  auto& groups = opt.param_groups();
  for (std::size_t i = 0; i < groups.size() && i < lrs.size(); ++i)
    groups[i].options().set_lr(lrs[i]);
}

inline void check_group_count(const torch::optim::Optimizer& opt, std::size_t expected,
                              const char* scheduler) {
  ACCEL_CHECK(opt.param_groups().size() == expected, "accel: ", scheduler, " was built for ",
              expected, " parameter groups but the optimizer now has ",
              opt.param_groups().size(),
              ". Add all parameter groups before constructing the scheduler.");
}

/// Scheduler position in a torch::serialize archive (int64 scalar tensors).
inline void write_int(torch::serialize::OutputArchive& a, const std::string& key, int64_t v) {
  a.write(key, torch::tensor(v, torch::kInt64));
}
inline int64_t read_int(torch::serialize::InputArchive& a, const std::string& key) {
  torch::Tensor t;
  a.read(key, t);
  return t.item<int64_t>();
}
inline void write_doubles(torch::serialize::OutputArchive& a, const std::string& key,
                          const std::vector<double>& v) {
  a.write(key, torch::tensor(v, torch::kFloat64));
}
inline std::vector<double> read_doubles(torch::serialize::InputArchive& a,
                                        const std::string& key) {
  torch::Tensor t;
  a.read(key, t);
  t = t.contiguous();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

}  // namespace detail
}  // namespace accel::sched

#endif  // ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP
// end <accel/sched/detail/param_groups.hpp>

#include <torch/optim/schedulers/lr_scheduler.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace accel::sched {

/// Arguments of LinearWarmup.
struct LinearWarmupOptions {
  int64_t warmup_steps = 0;            ///< W: steps to go from start_factor to 1
  double start_factor = 0.0;           ///< s in [0, 1]: lr factor at step 0
  std::optional<int64_t> total_steps{};  ///< T >= W: decay linearly to 0 at step T; unset: hold
};

/// lr of group g at step n (n = step() calls since construction) is
/// base_lr[g] * factor(n), base_lr[g] being the group's lr at construction:
///
///   n <  W:                 factor = s + (1 - s) * (n / W)
///   n >= W, no total_steps: factor = 1
///   n >= W, total_steps T:  factor = max(0, (T - n) / max(1, T - W))
///
/// With s = 0 and T set this is transformers' get_linear_schedule_with_warmup;
/// without T it is torch's LinearLR(start_factor = s, end_factor = 1,
/// total_iters = W) (there computed recursively, here in closed form).
/// Steps past T keep lr at 0; stepping never throws.
class LinearWarmup : public torch::optim::LRScheduler {
 public:
  using Options = LinearWarmupOptions;

  LinearWarmup(torch::optim::Optimizer& optimizer, Options options)
      : torch::optim::LRScheduler(optimizer), optimizer_(&optimizer), options_(options) {
    ACCEL_CHECK(options_.warmup_steps >= 0, "accel: LinearWarmup expected warmup_steps >= 0, got ",
                options_.warmup_steps, ". Pass the number of warm-up steps (0 for none).");
    ACCEL_CHECK(options_.start_factor >= 0.0 && options_.start_factor <= 1.0,
                "accel: LinearWarmup expected start_factor between 0 and 1, got ",
                options_.start_factor, ". Pass the fraction of the lr to start from.");
    ACCEL_CHECK(!options_.total_steps || *options_.total_steps >= options_.warmup_steps,
                "accel: LinearWarmup expected total_steps >= warmup_steps, got total_steps ",
                options_.total_steps.value_or(0), " and warmup_steps ", options_.warmup_steps,
                ". Pass a total that includes the warm-up, or leave total_steps unset.");
    ACCEL_CHECK(!optimizer.param_groups().empty(),
                "accel: LinearWarmup got an optimizer without parameter groups. "
                "Construct the optimizer with its parameters first.");
    for (auto& g : optimizer.param_groups()) base_lrs_.push_back(g.options().get_lr());
    apply(0);
  }
  LinearWarmup(torch::optim::Optimizer& optimizer, int64_t warmup_steps,
               double start_factor = 0.0)
      : LinearWarmup(optimizer, Options{.warmup_steps = warmup_steps,
                                        .start_factor = start_factor}) {}

  /// The multiplier of base_lr at step n (formula above).
  double factor(int64_t n) const {
    const auto& o = options_;
    if (n < o.warmup_steps)
      return o.start_factor +
             (1.0 - o.start_factor) * (static_cast<double>(n) / static_cast<double>(o.warmup_steps));
    if (!o.total_steps) return 1.0;
    const int64_t t = *o.total_steps;
    return std::max(0.0, static_cast<double>(t - n) /
                             static_cast<double>(std::max<int64_t>(1, t - o.warmup_steps)));
  }

  /// step() calls since construction.
  int64_t step_count() const { return static_cast<int64_t>(step_count_); }

  /// Moves to position n >= 0 and writes that step's lrs into the optimizer.
  void set_step_count(int64_t n) {
    ACCEL_CHECK(n >= 0, "accel: LinearWarmup cannot move to step ", n,
                ". Pass a step count >= 0.");
    apply(n);
    step_count_ = static_cast<decltype(step_count_)>(n);
  }

  std::vector<double> get_last_lr() const { return last_lr_; }
  /// The lrs the schedule scales (the groups' lrs when it was constructed).
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  const Options& options() const { return options_; }

  /// Saves position and base lrs, so a scheduler rebuilt around an optimizer
  /// whose lr was already changed still resumes exactly.
  void save(torch::serialize::OutputArchive& archive) const {
    detail::write_int(archive, "step_count", step_count());
    detail::write_doubles(archive, "base_lrs", base_lrs_);
  }
  void load(torch::serialize::InputArchive& archive) {
    auto lrs = detail::read_doubles(archive, "base_lrs");
    ACCEL_CHECK(lrs.size() == base_lrs_.size(), "accel: the saved LinearWarmup state has ",
                lrs.size(), " parameter groups but the optimizer has ", base_lrs_.size(),
                ". Load it into a scheduler over the same optimizer layout.");
    base_lrs_ = std::move(lrs);
    set_step_count(detail::read_int(archive, "step_count"));
  }

 protected:
  /// Called by LRScheduler::step() before it increments step_count_.
  std::vector<double> get_lrs() override { return compute(step_count() + 1); }

 private:
  std::vector<double> compute(int64_t n) {
    detail::check_group_count(*optimizer_, base_lrs_.size(), "LinearWarmup");
    const double f = factor(n);
    std::vector<double> lrs;
    lrs.reserve(base_lrs_.size());
    for (double b : base_lrs_) lrs.push_back(b * f);
    last_lr_ = lrs;
    return lrs;
  }
  void apply(int64_t n) { detail::set_lrs(*optimizer_, compute(n)); }

  torch::optim::Optimizer* optimizer_;
  Options options_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lr_;
};

}  // namespace accel::sched

#endif  // ACCEL_SCHED_LINEAR_WARMUP_HPP
// end <accel/sched/linear_warmup.hpp>
// begin <accel/sched/one_cycle_lr.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::sched::OneCycleLR, the 1cycle policy with the same
/// learning-rate and momentum sequence as torch.optim.lr_scheduler.OneCycleLR.
#ifndef ACCEL_SCHED_ONE_CYCLE_LR_HPP
#define ACCEL_SCHED_ONE_CYCLE_LR_HPP


#include <torch/optim/schedulers/lr_scheduler.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <utility>
#include <vector>

namespace accel::sched {

/// How OneCycleLR moves between two anchors (Python's anneal_strategy).
enum class AnnealStrategy { Cos, Linear };

/// Arguments of OneCycleLR, named and defaulted as in Python. Give either
/// total_steps, or epochs and steps_per_epoch (total_steps wins when both are set).
struct OneCycleLROptions {
  PerGroup max_lr{};                       ///< required: peak lr, one or one per group
  std::optional<int64_t> total_steps{};    ///< number of step() calls in the cycle
  std::optional<int64_t> epochs{};         ///< with steps_per_epoch: total = product
  std::optional<int64_t> steps_per_epoch{};
  double pct_start = 0.3;                  ///< share of the cycle spent increasing lr
  AnnealStrategy anneal_strategy = AnnealStrategy::Cos;
  bool cycle_momentum = true;              ///< cycle SGD/RMSprop momentum or Adam(W) beta1
  PerGroup base_momentum = 0.85;           ///< momentum at peak lr
  PerGroup max_momentum = 0.95;            ///< momentum at the start and the end
  double div_factor = 25.0;                ///< initial_lr = max_lr / div_factor
  double final_div_factor = 1e4;           ///< min_lr = initial_lr / final_div_factor
  bool three_phase = false;                ///< warm up, come back down, then anneal to min_lr
};

/// The 1cycle learning-rate policy (Smith & Topin), a port of PyTorch's Python
/// OneCycleLR (torch 1.13): same phases, same floating-point formulas, so the
/// sequence of lr (and momentum) values is the same for the same arguments.
///
/// Position: construction puts the optimizer at step 0 (lr = max_lr/div_factor
/// up to rounding, momentum = max_momentum); the n-th step() call moves it to
/// step n, for n up to total_steps. Stepping further throws accel::Error
/// (Python raises ValueError) and changes nothing.
class OneCycleLR : public torch::optim::LRScheduler {
 public:
  using Options = OneCycleLROptions;

  OneCycleLR(torch::optim::Optimizer& optimizer, Options options)
      : torch::optim::LRScheduler(optimizer), optimizer_(&optimizer), options_(std::move(options)) {
    init();
  }
  OneCycleLR(torch::optim::Optimizer& optimizer, double max_lr, int64_t total_steps)
      : OneCycleLR(optimizer, Options{.max_lr = max_lr, .total_steps = total_steps}) {}

  /// step() calls since construction (Python's last_epoch).
  int64_t step_count() const { return static_cast<int64_t>(step_count_); }

  /// Moves to position n (0 <= n <= total_steps) and writes that step's lr and
  /// momentum into the optimizer: what resuming from a checkpoint needs.
  void set_step_count(int64_t n) {
    ACCEL_CHECK(n >= 0 && n <= total_steps_, "accel: OneCycleLR cannot move to step ", n,
                ", its schedule has steps 0 to ", total_steps_,
                ". Pass a step count within the schedule.");
    apply(n);
    step_count_ = static_cast<decltype(step_count_)>(n);
  }

  /// The lr of each parameter group set by the last construction/step().
  std::vector<double> get_last_lr() const { return last_lr_; }
  /// The momentum (or beta1) of each group set last; empty without cycle_momentum.
  std::vector<double> get_last_momentum() const { return last_momentum_; }

  int64_t total_steps() const { return total_steps_; }
  const Options& options() const { return options_; }

  /// Saves the position (and total_steps, checked on load) in a torch archive.
  void save(torch::serialize::OutputArchive& archive) const {
    detail::write_int(archive, "step_count", step_count());
    detail::write_int(archive, "total_steps", total_steps_);
  }
  void load(torch::serialize::InputArchive& archive) {
    const int64_t saved_total = detail::read_int(archive, "total_steps");
    ACCEL_CHECK(saved_total == total_steps_, "accel: the saved OneCycleLR state has total_steps ",
                saved_total, " but this scheduler has ", total_steps_,
                ". Construct the scheduler with the same arguments as the saved one.");
    set_step_count(detail::read_int(archive, "step_count"));
  }

 protected:
  /// Called by LRScheduler::step() before it increments step_count_: computes
  /// the next step's lrs (and sets momentum, as Python's get_lr() does).
  std::vector<double> get_lrs() override {
    const int64_t next = step_count() + 1;
    if (next > total_steps_)
      throw Error(::accel::detail::concat(
          "accel: OneCycleLR was stepped ", next, " times but total_steps is ", total_steps_,
          " (Python: \"Tried to step ", next + 1, " times. The specified number of total steps is ",
          total_steps_, "\"). Increase total_steps (or epochs/steps_per_epoch), or stop "
          "calling step() after the last step."));
    return compute_and_set_momentum(next);
  }

 private:
  enum class Anchor { InitialLr, MaxLr, MinLr, MaxMomentum, BaseMomentum };
  struct Phase {
    double end_step;
    Anchor start_lr, end_lr, start_momentum, end_momentum;
  };
  struct Group {
    double initial_lr, max_lr, min_lr, max_momentum, base_momentum;
    double at(Anchor a) const {
      switch (a) {
        case Anchor::InitialLr: return initial_lr;
        case Anchor::MaxLr: return max_lr;
        case Anchor::MinLr: return min_lr;
        case Anchor::MaxMomentum: return max_momentum;
        case Anchor::BaseMomentum: return base_momentum;
      }
      return 0.0;
    }
  };

  void init() {
    const Options& o = options_;
    if (o.total_steps) {
      ACCEL_CHECK(*o.total_steps > 0, "accel: OneCycleLR expected a positive total_steps, got ",
                  *o.total_steps, ". Pass the number of step() calls of the whole run.");
      total_steps_ = *o.total_steps;
    } else {
      ACCEL_CHECK(o.epochs || o.steps_per_epoch,
                  "accel: OneCycleLR needs total_steps or (epochs and steps_per_epoch). "
                  "Set one of them in the options.");
      ACCEL_CHECK(o.epochs && *o.epochs > 0, "accel: OneCycleLR expected a positive epochs, got ",
                  o.epochs ? std::to_string(*o.epochs) : "none",
                  ". Set epochs together with steps_per_epoch, or set total_steps.");
      ACCEL_CHECK(o.steps_per_epoch && *o.steps_per_epoch > 0,
                  "accel: OneCycleLR expected a positive steps_per_epoch, got ",
                  o.steps_per_epoch ? std::to_string(*o.steps_per_epoch) : "none",
                  ". Set steps_per_epoch together with epochs, or set total_steps.");
      total_steps_ = *o.epochs * *o.steps_per_epoch;
    }
    ACCEL_CHECK(o.pct_start >= 0.0 && o.pct_start <= 1.0,
                "accel: OneCycleLR expected pct_start between 0 and 1, got ", o.pct_start,
                ". Pass the share of the cycle spent increasing the learning rate.");
    ACCEL_CHECK(o.div_factor > 0.0 && o.final_div_factor > 0.0,
                "accel: OneCycleLR needs positive div_factor and final_div_factor, got ",
                o.div_factor, " and ", o.final_div_factor, ". Pass positive divisors.");

    // Phase boundaries in Python's float arithmetic: same rounding, same values.
    const double total = static_cast<double>(total_steps_);
    if (o.three_phase) {
      phases_ = {{o.pct_start * total - 1, Anchor::InitialLr, Anchor::MaxLr, Anchor::MaxMomentum,
                  Anchor::BaseMomentum},
                 {2 * o.pct_start * total - 2, Anchor::MaxLr, Anchor::InitialLr,
                  Anchor::BaseMomentum, Anchor::MaxMomentum},
                 {total - 1, Anchor::InitialLr, Anchor::MinLr, Anchor::MaxMomentum,
                  Anchor::MaxMomentum}};
    } else {
      phases_ = {{o.pct_start * total - 1, Anchor::InitialLr, Anchor::MaxLr, Anchor::MaxMomentum,
                  Anchor::BaseMomentum},
                 {total - 1, Anchor::MaxLr, Anchor::MinLr, Anchor::BaseMomentum,
                  Anchor::MaxMomentum}};
    }

    const std::size_t n = optimizer_->param_groups().size();
    ACCEL_CHECK(n > 0, "accel: OneCycleLR got an optimizer without parameter groups. "
                "Construct the optimizer with its parameters first.");
    const auto max_lrs = o.max_lr.expand(n, "OneCycleLR", "max_lr");
    std::vector<double> max_m(n, 0.0), base_m(n, 0.0);
    if (o.cycle_momentum) {
      max_m = o.max_momentum.expand(n, "OneCycleLR", "max_momentum");
      base_m = o.base_momentum.expand(n, "OneCycleLR", "base_momentum");
      for (auto& g : optimizer_->param_groups())
        ACCEL_CHECK(detail::momentum_field(g.options()) != detail::MomentumField::None,
                    "accel: OneCycleLR with cycle_momentum needs an optimizer with momentum "
                    "(SGD, RMSprop) or betas (Adam, AdamW). Set cycle_momentum = false for "
                    "this optimizer.");
    }
    groups_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      const double initial = max_lrs[i] / o.div_factor;
      groups_.push_back({initial, max_lrs[i], initial / o.final_div_factor, max_m[i], base_m[i]});
    }
    apply(0);  // Python's constructor takes the first step, to position 0
  }

  double anneal(double start, double end, double pct) const {
    if (options_.anneal_strategy == AnnealStrategy::Cos) {
      const double cos_out = std::cos(std::numbers::pi * pct) + 1;
      return end + (start - end) / 2.0 * cos_out;
    }
    return (end - start) * pct + start;
  }

  // lr of every group at position step; sets the optimizer's momentum on the way.
  std::vector<double> compute_and_set_momentum(int64_t step) {
    detail::check_group_count(*optimizer_, groups_.size(), "OneCycleLR");
    std::vector<double> lrs, moms;
    auto& param_groups = optimizer_->param_groups();
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      double start_step = 0.0;
      for (std::size_t i = 0; i < phases_.size(); ++i) {
        const Phase& ph = phases_[i];
        if (static_cast<double>(step) <= ph.end_step || i + 1 == phases_.size()) {
          const double span = ph.end_step - start_step;
          ACCEL_CHECK(span != 0.0, "accel: OneCycleLR has an empty phase at step ", step,
                      " (Python raises ZeroDivisionError here). Use a pct_start that leaves "
                      "room for every phase.");
          const double pct = (static_cast<double>(step) - start_step) / span;
          lrs.push_back(anneal(groups_[g].at(ph.start_lr), groups_[g].at(ph.end_lr), pct));
          if (options_.cycle_momentum) {
            moms.push_back(
                anneal(groups_[g].at(ph.start_momentum), groups_[g].at(ph.end_momentum), pct));
            detail::set_momentum(param_groups[g].options(), moms.back());
          }
          break;
        }
        start_step = ph.end_step;
      }
    }
    last_lr_ = lrs;
    last_momentum_ = std::move(moms);
    return lrs;
  }

  void apply(int64_t step) { detail::set_lrs(*optimizer_, compute_and_set_momentum(step)); }

  torch::optim::Optimizer* optimizer_;
  Options options_;
  int64_t total_steps_ = 0;
  std::vector<Phase> phases_;
  std::vector<Group> groups_;
  std::vector<double> last_lr_, last_momentum_;
};

}  // namespace accel::sched

#endif  // ACCEL_SCHED_ONE_CYCLE_LR_HPP
// end <accel/sched/one_cycle_lr.hpp>

#endif  // ACCEL_SCHED_HPP
// end <accel/sched.hpp>
// begin <accel/checkpoint.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the checkpoint area: safetensors I/O, save_model, and
/// save_state/load_state with their registry, pre-hooks and the newest
/// automatic checkpoint. (safetensors.hpp and save_model.hpp alone need
/// neither a communicator nor the training state.)
#ifndef ACCEL_CHECKPOINT_HPP
#define ACCEL_CHECKPOINT_HPP

// begin <accel/checkpoint/latest_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::load_latest_state, the machinery of
/// Accelerator::load_latest_state(): resume from the newest automatic
/// checkpoint that is complete, or start fresh when there is none. What an
/// elastic restart (LaunchOptions::max_restarts) calls first.
///
/// Which checkpoint: the directories project_dir/checkpoints/checkpoint_<N>,
/// newest first, as the main process lists them. One without accel_state.json
/// (save_state writes it last) is not a checkpoint; <dir>.accel-tmp, what a
/// save killed half-way leaves, is never listed. A checkpoint that any process
/// cannot read (a file missing, truncated or not matching its checksum, or
/// not fitting this run) is skipped with a warning and the next older one is
/// tried. Every process reads before anything changes, so nothing is loaded
/// from a checkpoint that fails anywhere.
#ifndef ACCEL_CHECKPOINT_LATEST_STATE_HPP
#define ACCEL_CHECKPOINT_LATEST_STATE_HPP

// begin <accel/checkpoint/detail/state_layout.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the names of save_state's files, the listing of automatic
/// checkpoints, the agreement of the processes on success, and what each
/// process writes.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP

// begin <accel/checkpoint/detail/state_files.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the file side of save_state/load_state: torch archives and
/// JSON files read with errors that name the file, fsync of written files,
/// the atomic directory commit, the generator states of a process, and the
/// test-only crash hook.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP

// begin <accel/checkpoint/detail/file_io.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the POSIX file helpers of checkpointing: atomic writes
/// (temporary file in the same directory, fsync, rename) that checksum what
/// they write, positioned reads, and whole-file reads.
#ifndef ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP
#define ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP

// begin <accel/checkpoint/detail/xxhash64.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines XXH64 (Yann Collet's xxHash, 64-bit, seed 0), streaming: the
/// checksum of every checkpoint file, computed while the file is written. The
/// same digest as `xxhsum -H1 FILE` (Debian's xxhash package), so a user can
/// check a checkpoint by hand. Written from the published specification
/// (doc/xxhash_spec.md of the xxHash repository).
#ifndef ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP
#define ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace accel::ckpt::detail {

class Xxh64 {
 public:
  void update(const void* data, std::size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += size;
    if (buffered_ + size < kStripe) {  // not a whole stripe yet
      std::memcpy(buffer_ + buffered_, p, size);
      buffered_ += size;
      return;
    }
    if (buffered_ > 0) {  // complete the buffered stripe
      const std::size_t fill = kStripe - buffered_;
      std::memcpy(buffer_ + buffered_, p, fill);
      consume_stripe(buffer_);
      p += fill;
      size -= fill;
      buffered_ = 0;
    }
    for (; size >= kStripe; p += kStripe, size -= kStripe) consume_stripe(p);
    std::memcpy(buffer_, p, size);
    buffered_ = size;
  }
  void update(std::string_view text) { update(text.data(), text.size()); }

  /// The digest of everything given so far (the state is left as it is).
  std::uint64_t digest() const {
    std::uint64_t acc;
    if (total_ >= kStripe) {
      acc = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
      for (std::uint64_t v : v_) acc = (acc ^ round(0, v)) * kP1 + kP4;
    } else {
      acc = kP5;  // seed 0
    }
    acc += total_;
    const unsigned char* p = buffer_;
    std::size_t left = buffered_;
    for (; left >= 8; p += 8, left -= 8) acc = rotl(acc ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (left >= 4) {
      acc = rotl(acc ^ (static_cast<std::uint64_t>(read32(p)) * kP1), 23) * kP2 + kP3;
      p += 4;
      left -= 4;
    }
    for (; left > 0; ++p, --left) acc = rotl(acc ^ (*p * kP5), 11) * kP1;
    acc ^= acc >> 33;
    acc *= kP2;
    acc ^= acc >> 29;
    acc *= kP3;
    acc ^= acc >> 32;
    return acc;
  }

 private:
  static constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  static constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
  static constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;
  static constexpr std::size_t kStripe = 32;

  static std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static std::uint64_t round(std::uint64_t acc, std::uint64_t lane) {
    return rotl(acc + lane * kP2, 31) * kP1;
  }
  // Little-endian loads (the format is defined on little-endian lanes).
  template <class U>
  static U read_le(const unsigned char* p) {
    U v;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&v, p, sizeof v);
    } else {
      v = 0;
      for (int i = static_cast<int>(sizeof v) - 1; i >= 0; --i) v = static_cast<U>((v << 8) | p[i]);
    }
    return v;
  }
  static std::uint64_t read64(const unsigned char* p) { return read_le<std::uint64_t>(p); }
  static std::uint32_t read32(const unsigned char* p) { return read_le<std::uint32_t>(p); }
  void consume_stripe(const unsigned char* p) {
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
  }

  std::uint64_t v_[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  unsigned char buffer_[kStripe] = {};
  std::size_t buffered_ = 0;
  std::uint64_t total_ = 0;
};

/// 16 lowercase hex digits, as xxhsum prints them.
inline std::string to_hex(std::uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = kDigits[v & 0xF];
  return s;
}

/// The value of 16 hex digits, or nullopt.
inline std::optional<std::uint64_t> from_hex(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return std::nullopt;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  return v;
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP
// end <accel/checkpoint/detail/xxhash64.hpp>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace accel::ckpt::detail {

[[noreturn]] inline void fail_io(std::string_view what, const std::filesystem::path& path,
                                 int error) {
  throw Error(accel::detail::concat("accel: cannot ", what, " '", path.string(),
                                    "': ", std::strerror(error),
                                    ". Check the path, its permissions and the free disk space."));
}

/// A file written under a temporary name and renamed over `target` on
/// commit(), so readers see the old file or the complete new one, never a
/// partial write. Destroyed uncommitted, it removes the temporary file.
/// checksum() is the XXH64 of the bytes given to write(), in order.
class AtomicFile {
 public:
  explicit AtomicFile(std::filesystem::path target) : target_(std::move(target)) {
    const std::filesystem::path dir = target_.has_parent_path() ? target_.parent_path() : ".";
    // Appended piecewise: GCC 12 at -O3 warns falsely on "." + std::string&&.
    std::string name(1, '.');
    name += target_.filename().string();
    name += ".tmp.XXXXXX";
    std::string tmpl = (dir / name).string();
    fd_ = ::mkstemp(tmpl.data());
    if (fd_ < 0) fail_io("create a temporary file for", target_, errno);
    temp_ = tmpl;
    (void)::fchmod(fd_, 0644);  // mkstemp creates 0600; checkpoints are meant to be shared
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
  }

  void write(const void* data, std::size_t size) {
    hash_.update(data, size);
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ::ssize_t n = ::write(fd_, p, size);
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("write", temp_, errno);
      }
      p += n;
      size -= static_cast<std::size_t>(n);
    }
  }

  /// Overwrites bytes already written (a header field known only at the end);
  /// checksum() does not see them.
  void write_at(std::uint64_t offset, const void* data, std::size_t size) {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const ::ssize_t n = ::pwrite(fd_, p, size, static_cast<::off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("write", temp_, errno);
      }
      p += n;
      size -= static_cast<std::size_t>(n);
      offset += static_cast<std::uint64_t>(n);
    }
  }

  std::uint64_t checksum() const { return hash_.digest(); }
  const std::filesystem::path& temp_path() const { return temp_; }

  /// fsync, rename over the target, then fsync the directory so the rename
  /// itself survives a crash.
  void commit() {
    if (::fsync(fd_) != 0) fail_io("flush", temp_, errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail_io("close", temp_, errno);
    if (::rename(temp_.c_str(), target_.c_str()) != 0) fail_io("rename a temporary file to", target_, errno);
    committed_ = true;
    const std::filesystem::path dir = target_.has_parent_path() ? target_.parent_path() : ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      ::fsync(dfd);  // best effort: some file systems refuse fsync on directories
      ::close(dfd);
    }
  }

 private:
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
  bool committed_ = false;
  Xxh64 hash_;
};

/// Writes `text` to `path` atomically; returns its checksum.
inline std::uint64_t write_file_atomic(const std::filesystem::path& path, std::string_view text) {
  AtomicFile file(path);
  file.write(text.data(), text.size());
  file.commit();
  return file.checksum();
}

/// The XXH64 of a whole file, read in 4 MiB pieces (no copy of it in memory).
inline std::uint64_t file_checksum(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_io("open", path, errno);
  std::string buffer(std::size_t{4} << 20, '\0');
  Xxh64 hash;
  while (true) {
    const ::ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail_io("read", path, err);
    }
    if (n == 0) break;
    hash.update(buffer.data(), static_cast<std::size_t>(n));
  }
  ::close(fd);
  return hash.digest();
}

/// The whole file (one read, for small files that are checked and parsed).
inline std::string read_whole_file(const std::filesystem::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_io("open", path, errno);
  struct ::stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail_io("read", path, err);
  }
  std::string bytes;
  bytes.resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ::ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : EIO;
      ::close(fd);
      fail_io("read", path, err);
    }
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
  return bytes;
}

/// A read-only file descriptor with positioned, complete reads.
class ReadFile {
 public:
  explicit ReadFile(const std::filesystem::path& path) : path_(path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) fail_io("open", path, errno);
  }
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  ~ReadFile() { ::close(fd_); }

  /// Reads exactly size bytes at offset; a short file is an error (it may have
  /// been truncated since its header was validated).
  void read_at(std::uint64_t offset, void* out, std::size_t size) const {
    auto* p = static_cast<char*>(out);
    while (size > 0) {
      const ::ssize_t n = ::pread(fd_, p, size, static_cast<::off_t>(offset));
      if (n < 0) {
        if (errno == EINTR) continue;
        fail_io("read", path_, errno);
      }
      if (n == 0)
        throw Error("accel: invalid safetensors file '" + path_.string() +
                    "': the file ended before its data buffer did. The file is truncated: "
                    "write it again.");
      p += n;
      size -= static_cast<std::size_t>(n);
      offset += static_cast<std::uint64_t>(n);
    }
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_FILE_IO_HPP
// end <accel/checkpoint/detail/file_io.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <exception>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>

#include <fcntl.h>
#include <unistd.h>

namespace accel::ckpt::detail {

namespace fs = std::filesystem;

/// Test-only: ACCEL_TEST_SAVE_STATE_CRASH=<point> makes save_state kill its
/// own process with SIGKILL at that point ("writing": after this process's
/// first file; "before_commit": main process, all files in, before the
/// rename; "between_renames": main process, forces the two-rename commit and
/// dies between the renames). Lets tests check that a killed save leaves the
/// previous checkpoint loadable.
inline void crash_point(std::string_view point) {
  const char* want = std::getenv("ACCEL_TEST_SAVE_STATE_CRASH");
  if (want != nullptr && point == want) ::kill(::getpid(), SIGKILL);
}
inline bool crash_requested(std::string_view point) {
  const char* want = std::getenv("ACCEL_TEST_SAVE_STATE_CRASH");
  return want != nullptr && point == want;
}

/// fsync a file or directory (best effort for directories: some file
/// systems refuse it).
inline void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    if (directory) return;
    fail_io("open for flushing", p, errno);
  }
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && !directory) fail_io("flush", p, err);
}

/// Writes an archive atomically through accel's own file, so that a failed
/// write (a full disk) is an error naming the path and errno rather than
/// LibTorch's "unexpected pos" (and its abort: its writer's destructor throws
/// again), and the checksum comes with the write.
inline std::uint64_t save_archive(torch::serialize::OutputArchive& archive, const fs::path& path) {
  AtomicFile file(path);
  std::exception_ptr io_error;
  const auto write = [&](const void* data, std::size_t size) -> std::size_t {
    // After a failed write the rest is dropped but reported as written, so
    // that LibTorch finishes its archive normally; the error is thrown below.
    if (io_error) return size;
    try {
      if (data != nullptr) {
        file.write(data, size);
      } else {  // LibTorch's "skip ahead": a hole, zeros in a new file
        const std::string zeros(size, '\0');
        file.write(zeros.data(), size);
      }
      return size;
    } catch (...) {
      io_error = std::current_exception();
      return size;
    }
  };
  try {
    archive.save_to(write);
  } catch (const c10::Error& e) {
    if (io_error) std::rethrow_exception(io_error);
    throw Error(accel::detail::concat("accel: cannot write '", path.string(), "': ",
                                      e.what_without_backtrace(),
                                      ". Check the path, its permissions and the free disk space."));
  }
  if (io_error) std::rethrow_exception(io_error);
  file.commit();
  return file.checksum();
}

[[noreturn]] inline void fail_missing(const fs::path& path) {
  throw Error("accel: the checkpoint file '" + path.string() +
              "' is missing. Load a directory written completely by save_state().");
}

[[noreturn]] inline void fail_checksum(const fs::path& path, std::uint64_t actual, std::uint64_t expected) {
  throw Error(accel::detail::concat(
      "accel: the checkpoint file '", path.string(),
      "' is corrupt: its bytes changed after save_state() wrote them (XXH64 ", to_hex(actual),
      ", recorded ", to_hex(expected), "). Load another checkpoint, or restore this file from a copy."));
}

/// The file's bytes (a small file), checked against the checksum save_state
/// recorded for it (none: a checkpoint written before accel recorded them).
inline std::string read_checked(const fs::path& path, std::optional<std::uint64_t> expected) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_missing(path);
  std::string bytes = read_whole_file(path);
  if (expected) {
    Xxh64 hash;
    hash.update(bytes);
    if (hash.digest() != *expected) fail_checksum(path, hash.digest(), *expected);
  }
  return bytes;
}

/// A whole archive, checked and parsed; a truncated or corrupt file is an
/// accel::Error. The check reads the file once more (from the page cache)
/// rather than holding a copy of it in memory: optimizer files are large.
inline void load_archive(torch::serialize::InputArchive& archive, const fs::path& path,
                         std::optional<std::uint64_t> expected,
                         c10::optional<torch::Device> device = c10::nullopt) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) fail_missing(path);
  if (expected) {
    const auto actual = file_checksum(path);
    if (actual != *expected) fail_checksum(path, actual, *expected);
  }
  try {
    archive.load_from(path.string(), device);
  } catch (const c10::Error& e) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", path.string(),
                                      "' is truncated or corrupt (", e.what_without_backtrace(),
                                      "). Load another checkpoint, or save this one again."));
  }
}

inline std::uint64_t write_json(const fs::path& path, const nlohmann::json& j) {
  return write_file_atomic(path, j.dump(2) + "\n");
}

inline nlohmann::json read_json(const fs::path& path,
                                std::optional<std::uint64_t> expected = std::nullopt) {
  const std::string text = read_checked(path, expected);
  try {
    auto j = nlohmann::json::parse(text);
    if (!j.is_object()) throw std::runtime_error("not a JSON object");
    return j;
  } catch (const std::exception& e) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", path.string(),
                                      "' is truncated or corrupt (", e.what(),
                                      "). Load another checkpoint, or save this one again."));
  }
}

/// j[key] as T, or an accel::Error naming the file and the key.
template <class T>
T json_field(const nlohmann::json& j, const char* key, const fs::path& source) {
  try {
    return j.at(key).get<T>();
  } catch (const std::exception&) {
    throw Error(accel::detail::concat("accel: the checkpoint file '", source.string(),
                                      "' has no valid '", key,
                                      "' entry. Load a directory written by save_state()."));
  }
}

/// Puts `stage` (complete, flushed) in place of `target`. A reader sees the
/// old or the new checkpoint at every instant: renameat2(RENAME_EXCHANGE)
/// swaps them in one step; where that is unavailable, target moves aside to
/// target.accel-old first (load_state() falls back to it if target is gone).
inline void commit_directory(const fs::path& stage, const fs::path& target) {
  std::error_code ec;
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const fs::path old = target.string() + ".accel-old";
  if (!fs::exists(target, ec)) {
    if (::rename(stage.c_str(), target.c_str()) != 0)
      fail_io("rename the finished checkpoint to", target, errno);
    fsync_path(parent, true);
    fs::remove_all(old, ec);
    return;
  }
#if defined(RENAME_EXCHANGE)
  if (!crash_requested("between_renames") &&
      ::renameat2(AT_FDCWD, stage.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_path(parent, true);
    fs::remove_all(stage, ec);  // now the previous checkpoint
    return;
  }
#endif
  fs::remove_all(old, ec);
  if (::rename(target.c_str(), old.c_str()) != 0)
    fail_io("move the previous checkpoint aside from", target, errno);
  fsync_path(parent, true);
  crash_point("between_renames");
  if (::rename(stage.c_str(), target.c_str()) != 0)
    fail_io("rename the finished checkpoint to", target, errno);
  fsync_path(parent, true);
  fs::remove_all(old, ec);
}

/// The directory to read: target, or target.accel-old when a commit was
/// interrupted between its two renames.
inline fs::path readable_checkpoint(const fs::path& target) {
  std::error_code ec;
  if (fs::is_directory(target, ec)) return target;
  const fs::path old = target.string() + ".accel-old";
  if (!fs::exists(target, ec) && fs::is_directory(old, ec)) return old;
  if (fs::exists(target, ec))
    throw Error("accel: the checkpoint path '" + target.string() +
                "' is a file, not a directory. Pass the directory save_state() wrote (the one "
                "holding accel_state.json).");
  throw Error("accel: the checkpoint directory '" + target.string() +
              "' does not exist. Pass a directory written by save_state().");
}

// ---- generator states ----

inline torch::Tensor generator_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}
inline void set_generator_state(at::Generator gen, const torch::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

inline int cuda_device_count() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

/// This process's generators: LibTorch's CPU generator, every CUDA device's,
/// and accel::std_generator(). std::rand has no readable state and is not saved.
inline void save_generators(torch::serialize::OutputArchive& out) {
  out.write("cpu", generator_state(at::detail::getDefaultCPUGenerator()));
  const int n = cuda_device_count();
  out.write("cuda_count", torch::tensor(static_cast<int64_t>(n)));
  for (int i = 0; i < n; ++i)
    out.write("cuda_" + std::to_string(i),
              generator_state(at::globalContext().defaultGenerator(
                  c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)))));
  std::ostringstream mt;
  mt << std_generator();
  out.write("std_generator", c10::IValue(mt.str()));
}

/// The generator states read from an archive, checked; apply() sets them.
struct GeneratorStates {
  torch::Tensor cpu;
  std::vector<torch::Tensor> cuda;
  std::mt19937_64 std_gen;

  static GeneratorStates read(torch::serialize::InputArchive& in, const fs::path& source) {
    GeneratorStates s;
    try {
      in.read("cpu", s.cpu);
      torch::Tensor count;
      in.read("cuda_count", count);
      const auto n = count.item<int64_t>();
      for (int64_t i = 0; i < n; ++i) {
        torch::Tensor t;
        in.read("cuda_" + std::to_string(i), t);
        s.cuda.push_back(t);
      }
      c10::IValue mt;
      in.read("std_generator", mt);
      std::istringstream text(mt.toStringRef());
      text >> s.std_gen;
      if (!text) throw std::runtime_error("std_generator state does not parse");
    } catch (const std::exception& e) {
      throw Error(accel::detail::concat("accel: the checkpoint file '", source.string(),
                                        "' is truncated or corrupt (", e.what(),
                                        "). Load another checkpoint, or save this one again."));
    }
    const auto expect = generator_state(at::detail::getDefaultCPUGenerator());
    ACCEL_CHECK(s.cpu.scalar_type() == torch::kByte && s.cpu.numel() == expect.numel(),
                "accel: the CPU generator state in '", source.string(),
                "' has the wrong size. Load a checkpoint saved by this LibTorch.");
    return s;
  }

  void apply() const {
    set_generator_state(at::detail::getDefaultCPUGenerator(), cpu);
    const int n = std::min<int>(cuda_device_count(), static_cast<int>(cuda.size()));
    for (int i = 0; i < n; ++i)
      set_generator_state(at::globalContext().defaultGenerator(
                              c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))),
                          cuda[static_cast<std::size_t>(i)]);
    std_generator() = std_gen;
  }
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_FILES_HPP
// end <accel/checkpoint/detail/state_files.hpp>
// begin <accel/checkpoint/safetensors.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines save_safetensors / load_safetensors: LibTorch tensors to and
/// from the safetensors format, files written atomically and read through the
/// validating parser of detail/safetensors_format.hpp.
#ifndef ACCEL_CHECKPOINT_SAFETENSORS_HPP
#define ACCEL_CHECKPOINT_SAFETENSORS_HPP

// begin <accel/checkpoint/detail/safetensors_format.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the torch-free safetensors header parser: every file is
/// untrusted, so each field is validated before anything is read through it.
///
/// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian
/// header length N, N bytes of JSON
///   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
///    "__metadata__": {"key": "value"}}
/// (optionally padded with spaces), then the data buffer. Offsets are relative
/// to the start of the data buffer, which the tensors cover without holes or
/// overlaps (as the reference reader requires, so no polyglot files).
#ifndef ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP
#define ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP


#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

/// Same cap as the reference reader: a header beyond it is rejected before any
/// allocation, so a forged length cannot make us allocate gigabytes.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
/// A valid header nests three deep (root, tensor entry, shape); anything much
/// deeper is hostile.
inline constexpr int kMaxJsonDepth = 8;
inline constexpr std::string_view kMetadataKey = "__metadata__";

/// One tensor entry of a validated header. begin/end are byte offsets into the
/// data buffer; end - begin == product(shape) * dtype_size(dtype).
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A validated header: tensors sorted by their offsets (file order).
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  ///< absolute file offset of the data buffer (8 + N)
  std::uint64_t data_size = 0;   ///< bytes in the data buffer
};

/// Byte size of one element of a safetensors dtype, or nullopt if unknown.
/// Sub-byte formats (F4, F6) are not listed: their sizes are not whole bytes.
inline std::optional<std::size_t> dtype_size(std::string_view dtype) {
  static constexpr std::array<std::pair<std::string_view, std::size_t>, 15> kSizes{{
      {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
      {"I32", 4}, {"U32", 4}, {"F32", 4},
      {"I64", 8}, {"U64", 8}, {"F64", 8},
  }};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return std::nullopt;
}

[[noreturn]] inline void fail_format(std::string_view source, const std::string& problem) {
  throw Error(accel::detail::concat(
      "accel: invalid safetensors file '", source, "': ", problem,
      ". The file is corrupt, truncated or not a safetensors file: write it again "
      "with accel::ckpt::save_safetensors or a safetensors library."));
}

/// Reads the little-endian header length from the first 8 bytes and checks it
/// against the cap and the file size. Returns N.
inline std::uint64_t parse_header_length(const unsigned char* prefix, std::uint64_t file_size,
                                         std::string_view source) {
  if (file_size < 8)
    fail_format(source, accel::detail::concat("the file has ", file_size,
                                              " bytes, fewer than the 8-byte header length"));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes)
    fail_format(source, accel::detail::concat("the header length ", n, " exceeds the limit of ",
                                              kMaxHeaderBytes, " bytes"));
  if (n > file_size - 8)
    fail_format(source, accel::detail::concat("the header length ", n,
                                              " runs past the end of the file (", file_size,
                                              " bytes)"));
  return n;
}

namespace json_check {

using json = nlohmann::json;

/// Parses with a callback that rejects duplicate keys (nlohmann would keep the
/// last one silently) and nesting deeper than kMaxJsonDepth.
inline json parse_strict(std::string_view text, std::string_view source) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth)
          fail_format(source, accel::detail::concat("the header nests deeper than ",
                                                    kMaxJsonDepth, " levels"));
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          fail_format(source, accel::detail::concat(
                                  depth == 1 ? "the tensor name '" : "the key '",
                                  parsed.get<std::string>(), "' appears twice in the header"));
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    fail_format(source, accel::detail::concat("the header is not valid JSON (", e.what(), ")"));
  }
}

inline std::uint64_t to_u64(const json& v, std::string_view source, const std::string& what) {
  if (!v.is_number_unsigned())
    fail_format(source, what + " is " + v.dump() + ", not a non-negative integer");
  return v.get<std::uint64_t>();
}

inline TensorInfo parse_entry(const std::string& name, const json& entry, std::uint64_t data_size,
                              std::string_view source) {
  const std::string where = "tensor '" + name + "'";
  if (!entry.is_object()) fail_format(source, where + " is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field)) fail_format(source, where + " has no \"" + field + "\" field");

  TensorInfo info;
  info.name = name;
  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) fail_format(source, where + " has a dtype that is not a string");
  info.dtype = dtype.get<std::string>();
  const auto elem = dtype_size(info.dtype);
  if (!elem)
    fail_format(source, where + " has unknown dtype '" + info.dtype +
                            "' (known: BOOL U8 I8 F8_E4M3 F8_E5M2 I16 U16 F16 BF16 I32 U32 "
                            "F32 I64 U64 F64)");

  const json& shape = entry["shape"];
  if (!shape.is_array()) fail_format(source, where + " has a shape that is not an array");
  // Element count with overflow checks: a dimension must also fit int64_t,
  // which is what LibTorch's sizes are.
  std::uint64_t numel = 1;
  bool overflow = false, zero = false;
  for (const json& d : shape) {
    const std::uint64_t dim = to_u64(d, source, where + ": a shape dimension");
    if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_format(source, where + " has shape dimension " + std::to_string(dim) +
                              ", larger than a tensor can have");
    info.shape.push_back(static_cast<std::int64_t>(dim));
    if (dim == 0) zero = true;
    else if (numel > std::numeric_limits<std::uint64_t>::max() / dim) overflow = true;
    numel *= dim;  // may wrap: then overflow is recorded
  }
  if (zero) {  // a zero dimension makes the count exactly 0
    numel = 0;
    overflow = false;
  }
  if (overflow || numel > std::numeric_limits<std::uint64_t>::max() / *elem)
    fail_format(source, where + " has shape " + shape.dump() +
                            " whose byte size overflows 64 bits");

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    fail_format(source, where + " has data_offsets " + offsets.dump() +
                            ", not an array [begin, end]");
  info.begin = to_u64(offsets[0], source, where + ": data_offsets begin");
  info.end = to_u64(offsets[1], source, where + ": data_offsets end");
  if (info.begin > info.end)
    fail_format(source, where + " has reversed data_offsets [" + std::to_string(info.begin) +
                            ", " + std::to_string(info.end) + "] (begin after end)");
  if (info.end > data_size)
    fail_format(source, where + " has data_offsets [" + std::to_string(info.begin) + ", " +
                            std::to_string(info.end) + "] that leave the data buffer (" +
                            std::to_string(data_size) + " bytes)");
  const std::uint64_t bytes = numel * *elem;
  if (bytes != info.end - info.begin)
    fail_format(source, where + " has shape " + shape.dump() + " and dtype " + info.dtype +
                            ", which need " + std::to_string(bytes) +
                            " bytes, but its data_offsets span " +
                            std::to_string(info.end - info.begin) + " bytes");
  return info;
}

}  // namespace json_check

/// Validates the JSON header text against a data buffer of data_size bytes
/// that starts at file offset data_start. Throws accel::Error naming source.
inline SafetensorsHeader parse_header_json(std::string_view text, std::uint64_t data_start,
                                           std::uint64_t data_size, std::string_view source) {
  using json = nlohmann::json;
  const json root = json_check::parse_strict(text, source);
  if (!root.is_object()) fail_format(source, "the header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = data_start;
  header.data_size = data_size;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) fail_format(source, "__metadata__ is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          fail_format(source, "__metadata__ value of '" + mk + "' is not a string");
        header.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    header.tensors.push_back(json_check::parse_entry(key, value, data_size, source));
  }

  // The tensors must tile the data buffer exactly: no overlap, no hole, no tail.
  auto& ts = header.tensors;
  std::sort(ts.begin(), ts.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : ts) {
    if (t.begin < covered)
      fail_format(source, "tensors '" + previous->name + "' and '" + t.name +
                              "' have overlapping data_offsets");
    if (t.begin > covered)
      fail_format(source, "bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                              ") of the data buffer belong to no tensor");
    covered = t.end;
    previous = &t;
  }
  if (covered != data_size)
    fail_format(source, "the data buffer has " + std::to_string(data_size - covered) +
                            " bytes after the last tensor");
  return header;
}

/// Validates a whole in-memory safetensors file.
inline SafetensorsHeader parse_safetensors(const void* data, std::size_t size,
                                           std::string_view source) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const std::uint64_t n = parse_header_length(bytes, size, source);
  const std::string_view text(reinterpret_cast<const char*>(bytes) + 8, static_cast<std::size_t>(n));
  return parse_header_json(text, 8 + n, size - 8 - n, source);
}

/// Reads and validates only the header of a safetensors file.
inline SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  const std::string source = path.string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error("accel: cannot read safetensors file '" + source +
                "': it does not exist or is not a regular file. Check the path.");
  const std::uint64_t file_size = std::filesystem::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in)
    throw Error("accel: cannot open safetensors file '" + source + "'. Check its permissions.");
  unsigned char prefix[8] = {};
  in.read(reinterpret_cast<char*>(prefix), file_size < 8 ? static_cast<std::streamsize>(file_size) : 8);
  const std::uint64_t n = parse_header_length(prefix, file_size, source);
  std::string text(static_cast<std::size_t>(n), '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != n)
    fail_format(source, "the file ended while reading the header");
  return parse_header_json(text, 8 + n, file_size - 8 - n, source);
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP
// end <accel/checkpoint/detail/safetensors_format.hpp>

#include <torch/torch.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::ckpt {

static_assert(std::endian::native == std::endian::little,
              "accel: safetensors I/O copies tensor bytes as they are in memory. Build for a "
              "little-endian target.");

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Metadata key prefix of a tied (storage-sharing) tensor saved once:
/// "accel.tied.<alias>" -> "<name of the stored tensor>".
inline constexpr std::string_view kTiedPrefix = "accel.tied.";
/// Metadata key of the XXH64 (16 hex digits) of the data buffer, the bytes
/// after the header. Other safetensors readers ignore it; read_safetensors
/// checks it when present.
inline constexpr std::string_view kDataChecksumKey = "accel.data_xxh64";

/// Called with each tensor a save stores, in the order its bytes are read,
/// just before they are read: shard::ShardParameters makes the tensor's
/// bucket whole there, so a model is saved without being whole at once.
using BeforeRead = std::function<void(const torch::Tensor&)>;

/// Everything in one safetensors file: tensors (file order, then the tied
/// aliases, which share the tensor they alias) and the metadata.
struct SafetensorsContents {
  NamedTensors tensors;
  std::map<std::string, std::string> metadata;
};

namespace detail {

inline std::optional<std::string> to_safetensors_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat64: return "F64";
    case torch::kFloat32: return "F32";
    case torch::kFloat16: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kInt16: return "I16";
    case torch::kInt8: return "I8";
    case torch::kUInt8: return "U8";
    case torch::kBool: return "BOOL";
    default: return std::nullopt;
  }
}

inline std::optional<torch::ScalarType> to_torch_dtype(std::string_view d) {
  if (d == "F64") return torch::kFloat64;
  if (d == "F32") return torch::kFloat32;
  if (d == "F16") return torch::kFloat16;
  if (d == "BF16") return torch::kBFloat16;
  if (d == "I64") return torch::kInt64;
  if (d == "I32") return torch::kInt32;
  if (d == "I16") return torch::kInt16;
  if (d == "I8") return torch::kInt8;
  if (d == "U8") return torch::kUInt8;
  if (d == "BOOL") return torch::kBool;
  return std::nullopt;
}

/// True when a and b are the same view of the same storage (a tied weight),
/// which is what is saved once. Empty tensors never count: they own no bytes.
/// The storage's identity, not its address: under shard::ShardParameters a
/// parameter may have no memory behind it until it is read.
inline bool same_view(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() > 0 && a.has_storage() && b.has_storage() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.scalar_type() == b.scalar_type() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

/// Per entry: the index of the earlier entry it is the same view of (stored
/// once, there), or the entry's own index.
inline std::vector<std::size_t> stored_as(const NamedTensors& tensors) {
  std::vector<std::size_t> out(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    out[i] = i;
    for (std::size_t j = 0; j < i; ++j)
      if (out[j] == j && same_view(tensors[j].second, tensors[i].second)) {
        out[i] = j;
        break;
      }
  }
  return out;
}

}  // namespace detail

/// Writes `tensors` to `path` in the safetensors format, atomically (temporary
/// file in the same directory, fsync, rename). Tensors are written from CPU
/// and contiguous, in the given order. Entries that are the same view of the
/// same memory as an earlier entry are stored once and recorded in metadata
/// under kTiedPrefix, so load_safetensors returns one shared tensor for both.
/// metadata gets "format": "pt" unless it sets "format" itself. With
/// `checksum`, metadata gets kDataChecksumKey, computed as the data is written.
/// Each tensor is copied to CPU just before it is written: a GPU model costs
/// host memory for one tensor at a time, not for all of them. before_read,
/// when given, runs for each stored tensor just before that copy.
/// Returns the XXH64 of the data buffer.
inline std::uint64_t save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                      const std::map<std::string, std::string>& metadata = {},
                                      bool checksum = true, const BeforeRead& before_read = {}) {
  const std::string source = path.string();
  nlohmann::json header = nlohmann::json::object();
  nlohmann::json meta = nlohmann::json::object();
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) {
    ACCEL_CHECK(k.rfind(kTiedPrefix, 0) != 0 && k != kDataChecksumKey, "accel: metadata key '", k,
                "' for '", source, "' is reserved by accel (", kTiedPrefix, "*, ",
                kDataChecksumKey, "). Rename the key.");
    meta[k] = v;
  }

  std::set<std::string> names;
  std::vector<const torch::Tensor*> stored;  // in file order
  const auto stored_index = detail::stored_as(tensors);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& entry = tensors[i];
    // Named references, not a structured binding: lambdas below capture them
    // (clang 14 cannot capture structured bindings).
    const std::string& name = entry.first;
    const torch::Tensor& tensor = entry.second;
    ACCEL_CHECK(name != ckpt::detail::kMetadataKey, "accel: cannot save a tensor named '",
                name, "' to '", source, "': the name is reserved by the format. Rename it.");
    ACCEL_CHECK(names.insert(name).second, "accel: the tensor name '", name,
                "' appears twice in what is saved to '", source, "'. Give each tensor one name.");
    ACCEL_CHECK(tensor.defined(), "accel: tensor '", name, "' saved to '", source,
                "' is undefined. Leave it out or initialise it.");
    ACCEL_CHECK(tensor.layout() == torch::kStrided, "accel: tensor '", name, "' saved to '",
                source, "' is not dense (layout ", tensor.layout(),
                "). Convert it with to_dense() first.");
    const auto dtype = detail::to_safetensors_dtype(tensor.scalar_type());
    ACCEL_CHECK(dtype.has_value(), "accel: tensor '", name, "' saved to '", source,
                "' has dtype ", tensor.scalar_type(),
                ", which safetensors cannot hold here. Convert it to one of float64, float32, "
                "float16, bfloat16, int64, int32, int16, int8, uint8, bool.");
    if (stored_index[i] != i) {
      meta[std::string(kTiedPrefix) + name] = tensors[stored_index[i]].first;
      continue;
    }
    const auto bytes = static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
    header[name] = {{"dtype", *dtype},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    stored.push_back(&tensor);
  }
  // A placeholder of the digest's width, filled in once the data is written.
  const std::string placeholder(16, '0');
  if (checksum) meta[std::string(kDataChecksumKey)] = placeholder;
  header[std::string(ckpt::detail::kMetadataKey)] = std::move(meta);

  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-aligned, as Hugging Face writes it
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  ckpt::detail::AtomicFile file(path);
  file.write(prefix, sizeof prefix);
  file.write(text.data(), text.size());
  ckpt::detail::Xxh64 data_hash;
  for (const torch::Tensor* tensor : stored) {
    if (before_read) before_read(*tensor);
    const torch::Tensor t = tensor->detach().to(torch::kCPU).contiguous();
    const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    data_hash.update(t.data_ptr(), bytes);
    file.write(t.data_ptr(), bytes);
  }
  if (checksum) {
    // Keys are JSON strings, so `"key":"` with bare quotes is the entry itself.
    const std::string field = "\"" + std::string(kDataChecksumKey) + "\":\"" + placeholder;
    const auto at = text.find(field);
    ACCEL_CHECK(at != std::string::npos, "accel: internal error: no checksum field in the header of '",
                source, "'");
    const std::string digest = ckpt::detail::to_hex(data_hash.digest());
    file.write_at(sizeof prefix + at + field.size() - placeholder.size(), digest.data(), digest.size());
  }
  file.commit();
  return data_hash.digest();
}

/// Reads a safetensors file after validating its header (see
/// detail/safetensors_format.hpp). The tensors live on CPU and own their memory.
inline SafetensorsContents read_safetensors(const std::filesystem::path& path) {
  const std::string source = path.string();
  const auto header = ckpt::detail::read_safetensors_header(path);
  ckpt::detail::ReadFile file(path);
  SafetensorsContents out;
  out.metadata = header.metadata;
  std::optional<std::uint64_t> expected;
  if (const auto it = header.metadata.find(std::string(kDataChecksumKey)); it != header.metadata.end()) {
    expected = ckpt::detail::from_hex(it->second);
    if (!expected)
      ckpt::detail::fail_format(source, "its " + std::string(kDataChecksumKey) +
                                                  " entry is not 16 hex digits");
  }
  ckpt::detail::Xxh64 data_hash;  // the tensors cover the data buffer in order
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& info : header.tensors) {
    const auto dtype = detail::to_torch_dtype(info.dtype);
    ACCEL_CHECK(dtype.has_value(), "accel: tensor '", info.name, "' in '", source,
                "' has dtype ", info.dtype,
                ", which LibTorch 1.13 has no type for. Convert it before saving.");
    torch::Tensor t;
    try {
      t = torch::empty(info.shape, torch::TensorOptions().dtype(*dtype));
    } catch (const c10::Error&) {  // e.g. an empty shape whose strides overflow
      ckpt::detail::fail_format(source, "tensor '" + info.name +
                                                  "' has a shape LibTorch cannot allocate");
    }
    file.read_at(header.data_start + info.begin, t.data_ptr(),
                 static_cast<std::size_t>(info.end - info.begin));
    data_hash.update(t.data_ptr(), static_cast<std::size_t>(info.end - info.begin));
    if (*dtype == torch::kBool) {
      // Any byte other than 0/1 in a bool tensor is undefined behaviour in ATen.
      const auto* b = static_cast<const std::uint8_t*>(t.data_ptr());
      for (std::uint64_t i = 0; i < info.end - info.begin; ++i)
        if (b[i] > 1)
          ckpt::detail::fail_format(source, "BOOL tensor '" + info.name +
                                                      "' holds a byte other than 0 or 1");
    }
    by_name.emplace(info.name, t);
    out.tensors.emplace_back(info.name, std::move(t));
  }
  if (expected && data_hash.digest() != *expected)
    throw Error(accel::detail::concat(
        "accel: the safetensors file '", source, "' is corrupt: its tensor data changed after it "
        "was written (XXH64 ", ckpt::detail::to_hex(data_hash.digest()), ", its header records ",
        ckpt::detail::to_hex(*expected), "). Load another copy, or write it again."));
  for (const auto& [key, target] : header.metadata) {
    if (key.rfind(kTiedPrefix, 0) != 0) continue;
    const std::string alias = key.substr(kTiedPrefix.size());
    const auto it = by_name.find(target);
    if (it == by_name.end())
      ckpt::detail::fail_format(source, "tied tensor '" + alias + "' refers to '" + target +
                                                  "', which is not in the file");
    if (by_name.count(alias) != 0)
      ckpt::detail::fail_format(source, "tied tensor '" + alias +
                                                  "' is also stored as a tensor");
    out.tensors.emplace_back(alias, it->second);
  }
  return out;
}

/// The tensors of a safetensors file, tied names sharing one tensor.
inline NamedTensors load_safetensors(const std::filesystem::path& path) {
  return read_safetensors(path).tensors;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAFETENSORS_HPP
// end <accel/checkpoint/safetensors.hpp>
// begin <accel/checkpoint/save_model.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the file side of save_model: a module's parameters and
/// buffers to safetensors shards plus Hugging Face's index, and back into a
/// module (its options, SaveModelOptions, are in accel/options.hpp).
#ifndef ACCEL_CHECKPOINT_SAVE_MODEL_HPP
#define ACCEL_CHECKPOINT_SAVE_MODEL_HPP


#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace accel::ckpt {

inline constexpr std::string_view kModelFile = "model.safetensors";
inline constexpr std::string_view kIndexFile = "model.safetensors.index.json";
/// Metadata key (every shard's and the index's) naming the save_model call
/// that wrote them: load_index refuses shards of another save.
inline constexpr std::string_view kSaveIdKey = "accel_save_id";

/// Bytes meant by a size string such as "10GB" (see SaveModelOptions).
inline std::uint64_t parse_size(std::string_view text) {
  const auto bad = [&](const char* why) {
    return Error(accel::detail::concat("accel: max_shard_size '", text, "' ", why,
                                       ". Write a positive size such as \"10GB\", \"500MB\", "
                                       "\"2GiB\" or a number of bytes."));
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  const auto ends_with_ci = [&](std::string_view suffix) {
    if (s.size() < suffix.size()) return false;
    for (std::size_t i = 0; i < suffix.size(); ++i)
      if (std::toupper(static_cast<unsigned char>(s[s.size() - suffix.size() + i])) != suffix[i])
        return false;
    return true;
  };
  long double unit = 1;
  std::size_t unit_len = 0;
  static constexpr std::pair<std::string_view, long double> kUnits[] = {
      {"GIB", 1073741824.0L}, {"MIB", 1048576.0L}, {"KIB", 1024.0L},
      {"GB", 1e9L}, {"MB", 1e6L}, {"KB", 1e3L}};
  for (const auto& [suffix, factor] : kUnits) {
    if (ends_with_ci(suffix)) {
      unit = factor;
      unit_len = suffix.size();
      break;
    }
  }
  const bool bits = unit_len == 2 && s.back() == 'b';  // Accelerate: "Gb" etc. are bits
  std::string_view number = s.substr(0, s.size() - unit_len);
  while (!number.empty() && std::isspace(static_cast<unsigned char>(number.back())))
    number.remove_suffix(1);
  // Digits with at most one decimal point: no sign, exponent, inf or nan.
  long double value = 0, scale = 1;
  bool digits = false, point = false;
  for (const char c : number) {
    if (c == '.' && !point && unit_len != 0) {
      point = true;
    } else if (c >= '0' && c <= '9') {
      digits = true;
      if (point) value += (scale /= 10) * (c - '0');
      else value = value * 10 + (c - '0');
    } else {
      throw bad("is not a size");
    }
  }
  if (!digits) throw bad("is not a size");
  long double bytes = value * unit;
  if (bits) bytes /= 8;
  if (bytes >= 9.2e18L) throw bad("is too large");
  const auto result = static_cast<std::uint64_t>(bytes);
  if (result == 0) throw bad("is zero");
  return result;
}

/// The module's parameters and buffers under the names the module gives them
/// ("0.weight" in a Sequential), in state_dict order: each module's own
/// parameters, then its buffers, then its children.
inline NamedTensors module_state(const torch::nn::Module& module) {
  NamedTensors out;
  module.apply(torch::nn::Module::ConstNamedModuleApplyFunction(
      [&](const std::string& prefix, const torch::nn::Module& m) {
        const auto add = [&](const torch::OrderedDict<std::string, torch::Tensor>& dict) {
          for (const auto& item : dict)
            if (item.value().defined())
              out.emplace_back(prefix.empty() ? item.key() : prefix + "." + item.key(),
                               item.value());
        };
        add(m.named_parameters(/*recurse=*/false));
        add(m.named_buffers(/*recurse=*/false));
      }));
  return out;
}

namespace detail {

/// "model-00001-of-00003.safetensors"
inline std::string shard_name(std::size_t index, std::size_t count) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "model-%05zu-of-%05zu.safetensors", index, count);
  return buffer;
}

inline bool is_shard_name(std::string_view name) {
  if (name.size() != shard_name(1, 1).size()) return false;
  for (std::size_t i = 0; i < name.size(); ++i) {
    const bool digit_slot = (i >= 6 && i < 11) || (i >= 15 && i < 20);
    const char expected = shard_name(1, 1)[i];
    if (digit_slot ? !std::isdigit(static_cast<unsigned char>(name[i])) : name[i] != expected)
      return false;
  }
  return true;
}

/// Where save_model writes a shard before the set is put in place.
inline std::string staging_name(const std::string& shard) { return "." + shard + ".accel-new"; }
inline bool is_staging_name(std::string_view name) {
  constexpr std::string_view suffix = ".accel-new";
  return name.size() > suffix.size() + 1 && name.front() == '.' &&
         name.substr(name.size() - suffix.size()) == suffix &&
         is_shard_name(name.substr(1, name.size() - suffix.size() - 1));
}

/// A save id: 16 hex digits, different for every save_model call.
inline std::string new_save_id() {
  std::random_device rd;
  const auto now = static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32 ^ rd()) ^ now;
  char buffer[17];
  std::snprintf(buffer, sizeof buffer, "%016llx", static_cast<unsigned long long>(v));
  return buffer;
}

/// Greedy split in key order, as Accelerate/Hugging Face: a new shard starts
/// when the next tensor would push the current one past `limit` (a tensor
/// larger than the limit thus gets its own shard); a tensor tied to an earlier
/// one costs nothing and joins that one's shard, where it is saved once.
inline std::vector<NamedTensors> split_shards(const NamedTensors& state, std::uint64_t limit,
                                              std::uint64_t& total_size) {
  std::vector<NamedTensors> shards(1);
  const auto stored_index = ckpt::detail::stored_as(state);
  std::vector<std::size_t> shard_of(state.size());
  std::uint64_t current = 0;
  total_size = 0;
  for (std::size_t i = 0; i < state.size(); ++i) {
    const auto& entry = state[i];
    if (stored_index[i] != i) {  // tied: goes with the tensor it shares
      shard_of[i] = shard_of[stored_index[i]];
      shards[shard_of[i]].push_back(entry);
      continue;
    }
    const auto bytes =
        static_cast<std::uint64_t>(entry.second.numel()) * entry.second.element_size();
    if (current + bytes > limit && !shards.back().empty()) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(entry);
    shard_of[i] = shards.size() - 1;
    current += bytes;
    total_size += bytes;
  }
  return shards;
}

inline std::string read_small_file(const std::filesystem::path& path) {
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) fail_io("read", path, ec.value());
  ACCEL_CHECK(size <= ckpt::detail::kMaxHeaderBytes, "accel: index file '", path.string(),
              "' has ", size, " bytes, more than an index can need. Check the file.");
  std::string text(static_cast<std::size_t>(size), '\0');
  ckpt::detail::ReadFile(path).read_at(0, text.data(), text.size());
  return text;
}

/// Tensors of a Hugging Face index and its shards, checked against each other.
inline NamedTensors load_index(const std::filesystem::path& index_path) {
  const std::string source = index_path.string();
  const auto fail = [&](const std::string& problem) -> Error {
    return Error("accel: invalid safetensors index '" + source + "': " + problem +
                 ". Save the model again.");
  };
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(read_small_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    throw fail(std::string("it is not valid JSON (") + e.what() + ")");
  }
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw fail("it has no \"weight_map\" object");
  std::vector<std::string> files;  // in order of first mention
  std::map<std::string, std::string> where;
  for (const auto& [key, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw fail("the entry of '" + key + "' is not a file name");
    const std::string name = file.get<std::string>();
    // Only plain names in the index's directory: an index must not reach elsewhere.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos)
      throw fail("the file name '" + name + "' of '" + key + "' is not a plain file name");
    if (std::find(files.begin(), files.end(), name) == files.end()) files.push_back(name);
    where.emplace(key, name);
  }
  // Written by accel: every shard must come from the same save_model call.
  std::optional<std::string> save_id;
  if (index.contains("metadata") && index["metadata"].is_object() &&
      index["metadata"].contains(std::string(kSaveIdKey)) && index["metadata"][std::string(kSaveIdKey)].is_string())
    save_id = index["metadata"][std::string(kSaveIdKey)].get<std::string>();
  NamedTensors out;
  std::map<std::string, std::string> found;  // tensor -> file it came from
  for (const auto& name : files) {
    auto contents = read_safetensors(index_path.parent_path() / name);
    if (save_id) {
      const auto it = contents.metadata.find(std::string(kSaveIdKey));
      if (it == contents.metadata.end() || it->second != *save_id)
        throw fail("'" + name + "' was written by another save_model() than the index (save " +
                   (it == contents.metadata.end() ? std::string("unknown") : it->second) + ", index " +
                   *save_id + "): a save was interrupted while it put its files in place, or files "
                   "of two saves were copied together; loading would mix two models");
    }
    for (auto& entry : contents.tensors) {
      if (!found.emplace(entry.first, name).second)
        throw fail("tensor '" + entry.first + "' is in both '" + found[entry.first] + "' and '" +
                   name + "'");
      out.push_back(std::move(entry));
    }
  }
  for (const auto& [key, file] : where)
    if (found.count(key) == 0 || found[key] != file)
      throw fail("it places '" + key + "' in '" + file + "', which does not hold it");
  return out;
}

inline std::string list(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : ", ") + s;
  return "[" + out + "]";
}

/// Throws accel::Error, before anything is copied, when `loaded` and the
/// module's state `targets` differ: every missing, unexpected and mismatched
/// (shape or dtype) key listed. `what` names the module in the mismatches
/// ("model", "module"), `into` in the message ("the prepared model", ...).
inline void check_state_matches(const NamedTensors& loaded, const NamedTensors& targets,
                                const std::string& source, std::string_view what,
                                std::string_view into) {
  std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> expected;
  for (const auto& [key, target] : targets) {
    expected.insert(key);
    const auto it = by_name.find(key);
    if (it == by_name.end()) {
      missing.push_back(key);
    } else if (it->second.sizes() != target.sizes() ||
               it->second.scalar_type() != target.scalar_type()) {
      std::ostringstream why;
      why << key << " (checkpoint " << it->second.scalar_type() << it->second.sizes() << ", "
          << what << " " << target.scalar_type() << target.sizes() << ")";
      mismatched.push_back(why.str());
    }
  }
  for (const auto& entry : loaded)
    if (expected.count(entry.first) == 0) unexpected.push_back(entry.first);
  if (missing.empty() && unexpected.empty() && mismatched.empty()) return;
  std::string problem;
  if (!missing.empty()) problem += "; missing keys " + list(missing);
  if (!unexpected.empty()) problem += "; unexpected keys " + list(unexpected);
  if (!mismatched.empty()) problem += "; mismatched keys " + list(mismatched);
  throw Error("accel: cannot load '" + source + "' into " + std::string(into) + problem +
              ". Nothing was loaded: load a checkpoint saved from the same model.");
}

}  // namespace detail

/// Every tensor of a checkpoint: a directory (holding model.safetensors or
/// model.safetensors.index.json), a .safetensors file or an index file.
inline NamedTensors load_checkpoint(const std::filesystem::path& dir_or_file) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(dir_or_file, ec)) {
    if (fs::exists(dir_or_file / kModelFile, ec)) return load_safetensors(dir_or_file / kModelFile);
    if (fs::exists(dir_or_file / kIndexFile, ec)) return detail::load_index(dir_or_file / kIndexFile);
    throw Error("accel: directory '" + dir_or_file.string() + "' holds neither " +
                std::string(kModelFile) + " nor " + std::string(kIndexFile) +
                ". Pass the directory save_model wrote to, or a .safetensors file.");
  }
  const std::string name = dir_or_file.filename().string();
  if (name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0)
    return detail::load_index(dir_or_file);
  return load_safetensors(dir_or_file);
}

namespace detail {

/// The tensors save_module stores (a tied tensor once), in the order it reads
/// their bytes: state order, which the split into shards keeps.
inline std::vector<torch::Tensor> read_order(const NamedTensors& state) {
  const auto stored_index = ckpt::detail::stored_as(state);
  std::vector<torch::Tensor> out;
  for (std::size_t i = 0; i < state.size(); ++i)
    if (stored_index[i] == i) out.push_back(state[i].second);
  return out;
}

/// save_module's files for `state`, shards of at most `limit` bytes.
inline void save_tensors(const NamedTensors& state, const std::filesystem::path& dir,
                         std::uint64_t limit, bool checksum, const BeforeRead& before_read) {
  namespace fs = std::filesystem;
  std::uint64_t total_size = 0;
  const auto shards = split_shards(state, limit, total_size);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Error("accel: cannot create the checkpoint directory '" + dir.string() + "': " +
                ec.message() + ". Pass a directory path that can be written.");

  std::set<std::string> written;
  if (shards.size() == 1) {
    save_safetensors(dir / kModelFile, shards[0], {}, checksum, before_read);
    written.insert(std::string(kModelFile));
  } else {
    // The shards are written under staging names first (a failure or a kill
    // while writing leaves the previous save whole), then renamed into place
    // and the index written last. All carry one save id, so a kill during
    // the renames is an error at load time, never a silent mix of two saves.
    const std::string save_id = new_save_id();
    nlohmann::json index = {{"metadata", {{"total_size", total_size}, {std::string(kSaveIdKey), save_id}}},
                            {"weight_map", nlohmann::json::object()}};
    std::vector<std::string> names;
    try {
      for (std::size_t i = 0; i < shards.size(); ++i) {
        names.push_back(shard_name(i + 1, shards.size()));
        save_safetensors(dir / staging_name(names.back()), shards[i],
                         {{std::string(kSaveIdKey), save_id}}, checksum, before_read);
      }
    } catch (...) {
      for (const auto& name : names) fs::remove(dir / staging_name(name), ec);
      throw;
    }
    for (const auto& name : names) {
      fs::rename(dir / staging_name(name), dir / name, ec);
      if (ec)
        throw Error("accel: save_model could not move '" + staging_name(name) + "' to '" + name +
                    "' in '" + dir.string() + "': " + ec.message() + ". The index was not written; "
                    "free the directory and save again.");
    }
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const std::string& name = names[i];
      written.insert(name);
      // Only stored tensors, as Hugging Face lists them; tied names live in
      // the shard's metadata.
      const auto stored_index = ckpt::detail::stored_as(shards[i]);
      for (std::size_t k = 0; k < shards[i].size(); ++k)
        if (stored_index[k] == k) index["weight_map"][shards[i][k].first] = name;
    }
    ckpt::detail::write_file_atomic(dir / kIndexFile, index.dump(2) + "\n");
    written.insert(std::string(kIndexFile));
  }
  // Files of an earlier save that this one did not rewrite would mix two
  // models at load time.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool ours = name == kModelFile || name == kIndexFile || is_shard_name(name) ||
                      is_staging_name(name);  // left by an interrupted save
    if (ours && written.count(name) == 0 && entry.is_regular_file(ec)) fs::remove(entry.path(), ec);
  }
}

}  // namespace detail

/// Saves module's parameters and buffers to dir (created if needed): one
/// model.safetensors, or model-0000i-of-0000N.safetensors shards plus
/// model.safetensors.index.json when they exceed options.max_shard_size.
/// Tied tensors are saved once; stale shards of an earlier save are removed.
inline void save_module(const torch::nn::Module& module, const std::filesystem::path& dir,
                        const SaveModelOptions& options = {}) {
  detail::save_tensors(module_state(module), dir, parse_size(options.max_shard_size),
                       options.checksum, {});
}

/// save_module run by every process of a job, where only `writes` writes and
/// each stored tensor becomes readable through a collective: make_readable
/// runs on every process for the same tensors in the same order (read_order),
/// the writer's calls just before it reads each one. A writer that fails still
/// makes its remaining calls, so that no process waits for it, and returns its
/// error, for the processes to agree on (a bad max_shard_size throws on all,
/// before any call).
inline std::exception_ptr save_module_collectively(const torch::nn::Module& module,
                                                   const std::filesystem::path& dir,
                                                   const SaveModelOptions& options, bool writes,
                                                   const BeforeRead& make_readable) {
  const std::uint64_t limit = parse_size(options.max_shard_size);
  const NamedTensors state = module_state(module);
  const auto order = detail::read_order(state);
  std::size_t next = 0;
  std::exception_ptr err;
  if (writes) {
    try {
      detail::save_tensors(state, dir, limit, options.checksum, [&](const torch::Tensor& t) {
        ACCEL_CHECK(next < order.size() && order[next].unsafeGetTensorImpl() == t.unsafeGetTensorImpl(),
                    "accel: internal error: save_model read tensor ", next, " out of order");
        ++next;
        make_readable(t);
      });
    } catch (...) {
      err = std::current_exception();
    }
  }
  for (; next < order.size(); ++next) make_readable(order[next]);
  return err;
}

/// Copies a checkpoint (see load_checkpoint) into module's existing
/// parameters and buffers. Missing or unexpected keys, or a shape or dtype
/// that differs, throw accel::Error listing every such key, before anything
/// is copied: the module is then left as it was.
inline void load_module(torch::nn::Module& module, const std::filesystem::path& dir_or_file) {
  const NamedTensors loaded = load_checkpoint(dir_or_file);
  const NamedTensors targets = module_state(module);
  detail::check_state_matches(loaded, targets, dir_or_file.string(), "module", "the module");
  std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
  torch::NoGradGuard no_grad;
  for (const auto& [key, target] : targets) {
    torch::Tensor t = target;  // shares the module's tensor
    t.copy_(by_name.at(key));
  }
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAVE_MODEL_HPP
// end <accel/checkpoint/save_model.hpp>
// begin <accel/checkpoint/state_registry.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StateRegistry (what save_state() writes
/// and load_state() restores, recorded as the Accelerator prepares it) and the
/// Checkpointable concept of register_for_checkpointing().
#ifndef ACCEL_CHECKPOINT_STATE_REGISTRY_HPP
#define ACCEL_CHECKPOINT_STATE_REGISTRY_HPP

// begin <accel/checkpoint/detail/optimizer_keys.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Reads optimizer archives written by LibTorch 1.13 on LibTorch 2.x.
///
/// An optimizer archive names each parameter's state by the parameter's
/// TensorImpl address. 1.13 prints it in hex ("0x55d0c3a1b2c0"); 2.x prints
/// it in decimal and reads it back with std::stoull, which reads every 1.13
/// key as 0: all states land on one parameter, and the first step fails on a
/// shape mismatch (or, with equal shapes, trains on another tensor's moments).
/// The keys are rewritten in decimal before 2.x loads such an archive. 1.13
/// compares the keys as strings, so it reads both spellings as they are.
#ifndef ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP
#define ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP


#include <torch/torch.h>

#include <cctype>
#include <sstream>
#include <string>

namespace accel::ckpt::detail {

inline bool is_hex_address(const std::string& key) {
  if (key.size() < 3 || key[0] != '0' || key[1] != 'x') return false;
  for (std::size_t i = 2; i < key.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(key[i]))) return false;
  return true;
}

inline std::string decimal_address(const std::string& hex_key) {
  return std::to_string(std::stoull(hex_key, nullptr, 16));
}

/// One value of an archive as LibTorch stored it: a tensor registered as a
/// parameter or a buffer, or any other value (an attribute).
struct ArchiveValue {
  enum class Kind { parameter, buffer, attribute };
  c10::IValue value;
  Kind kind = Kind::attribute;
};

/// `key` of `in`, which must not be a sub-archive.
inline ArchiveValue read_value(torch::serialize::InputArchive& in, const std::string& key) {
  torch::Tensor t;
  if (in.try_read(key, t, /*is_buffer=*/false)) return {t, ArchiveValue::Kind::parameter};
  if (in.try_read(key, t, /*is_buffer=*/true)) return {t, ArchiveValue::Kind::buffer};
  c10::IValue v;
  in.read(key, v);
  return {std::move(v), ArchiveValue::Kind::attribute};
}

inline void write_value(torch::serialize::OutputArchive& out, const std::string& key, const ArchiveValue& v) {
  if (v.kind == ArchiveValue::Kind::attribute)
    out.write(key, v.value);
  else
    out.write(key, v.value.toTensor(), /*is_buffer=*/v.kind == ArchiveValue::Kind::buffer);
}

/// Copies an archive key by key (sub-archives, parameters, buffers, other
/// values). With decimal_addresses, hex addresses are rewritten in decimal
/// where they name optimizer states: keys directly under "state" and string
/// values under "params".
inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                         bool decimal_addresses = false, const std::string& parent = "");

/// Copies entry `key` of `in` (a sub-archive or a value), as copy_archive does.
inline void copy_entry(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                       const std::string& key, bool decimal_addresses = false, const std::string& parent = "") {
  torch::serialize::InputArchive sub;
  if (in.try_read(key, sub)) {
    torch::serialize::OutputArchive copy(out.compilation_unit());
    copy_archive(sub, copy, decimal_addresses, key);
    const bool rename = decimal_addresses && parent == "state" && is_hex_address(key);
    out.write(rename ? decimal_address(key) : key, copy);
    return;
  }
  auto v = read_value(in, key);
  if (decimal_addresses && v.value.isString() && key.rfind("params/", 0) == 0 &&
      is_hex_address(v.value.toStringRef()))
    v.value = c10::IValue(decimal_address(v.value.toStringRef()));
  write_value(out, key, v);
}

inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                         bool decimal_addresses, const std::string& parent) {
  for (const std::string& key : in.keys()) copy_entry(in, out, key, decimal_addresses, parent);
}

/// True when `in` is an optimizer archive whose state keys are 1.13's hex.
inline bool has_hex_state_keys(torch::serialize::InputArchive& in) {
  torch::serialize::InputArchive state;
  if (!in.try_read("state", state)) return false;
  for (const std::string& key : state.keys())
    if (is_hex_address(key)) return true;
  return false;
}

/// Loads `opt` from `in`, first rewriting 1.13's keys when this is 2.x.
template <class Load>
void load_with_portable_keys(torch::serialize::InputArchive& in, Load&& load) {
#if ACCEL_TORCH_AT_LEAST(2, 0)
  if (has_hex_state_keys(in)) {
    torch::serialize::OutputArchive rewritten;
    copy_archive(in, rewritten, /*decimal_addresses=*/true);
    std::stringstream bytes;
    rewritten.save_to(bytes);
    torch::serialize::InputArchive converted;
    converted.load_from(bytes);
    load(converted);
    return;
  }
#endif
  load(in);
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP
// end <accel/checkpoint/detail/optimizer_keys.hpp>
// begin <accel/checkpoint/state_hooks.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StatePreHooks, what
/// Accelerator::register_save_state_pre_hook / register_load_state_pre_hook
/// keep: callables run by save_state()/load_state() with the prepared models
/// and the checkpoint directory before accel writes or reads its files
/// (Accelerate's hooks of the same names), and the handle that removes one.
#ifndef ACCEL_CHECKPOINT_STATE_HOOKS_HPP
#define ACCEL_CHECKPOINT_STATE_HOOKS_HPP

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace accel::ckpt {

/// The prepared models, in prepare() order. A hook may erase entries: accel
/// then neither writes (save) nor reads (load) those models' files, and the
/// hook saves or loads them itself; it may write or read its own files in dir.
using ModelList = std::vector<std::shared_ptr<torch::nn::Module>>;
/// save: dir is where the checkpoint is being assembled (committed with
/// accel's files, atomically); load: the checkpoint directory being read.
using StatePreHook = std::function<void(ModelList& models, const std::filesystem::path& dir)>;

/// Removes the hook it was returned for (as torch.utils.hooks.RemovableHandle);
/// harmless twice, or after the Accelerator is gone.
class RemovableHandle {
 public:
  RemovableHandle() = default;
  RemovableHandle(std::weak_ptr<std::map<int, StatePreHook>> table, int id) : table_(std::move(table)), id_(id) {}
  void remove() {
    if (auto t = table_.lock()) t->erase(id_);
  }

 private:
  std::weak_ptr<std::map<int, StatePreHook>> table_;
  int id_ = -1;
};

/// Hooks of one kind, run in registration order.
class StatePreHooks {
 public:
  RemovableHandle add(StatePreHook hook) {
    ACCEL_CHECK(static_cast<bool>(hook), "accel: a state pre-hook must be callable (got an empty std::function).");
    const int id = next_++;
    table_->emplace(id, std::move(hook));
    return {table_, id};
  }

  /// Runs every hook on a copy of `models`; returns the indices of the
  /// models a hook erased. `what` names the call in errors.
  std::set<std::size_t> run(const ModelList& models, const std::filesystem::path& dir, const char* what) const {
    if (table_->empty()) return {};
    ModelList kept = models;
    for (const auto& [id, hook] : *table_) hook(kept, dir);
    for (const auto& m : kept)
      ACCEL_CHECK(std::find(models.begin(), models.end(), m) != models.end(), "accel: a ", what,
                  " pre-hook put a model into the list that is not a prepared model of this "
                  "Accelerator. A hook may only erase entries (and save or load those models itself).");
    std::set<std::size_t> erased;
    for (std::size_t i = 0; i < models.size(); ++i)
      if (std::find(kept.begin(), kept.end(), models[i]) == kept.end()) erased.insert(i);
    return erased;
  }

 private:
  std::shared_ptr<std::map<int, StatePreHook>> table_ = std::make_shared<std::map<int, StatePreHook>>();
  int next_ = 0;
};

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_STATE_HOOKS_HPP
// end <accel/checkpoint/state_hooks.hpp>
// begin <accel/detail/model_traits.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::model_traits, is_model_v and module_ptr: which
/// handles prepare() accepts as a model, and the module behind one. Shared by
/// prepared/ and checkpoint/ (the registry keeps the prepared models).
#ifndef ACCEL_DETAIL_MODEL_TRAITS_HPP
#define ACCEL_DETAIL_MODEL_TRAITS_HPP

#include <memory>
#include <type_traits>

#include <torch/torch.h>

namespace accel::detail {

/// Models prepare() accepts: torch::nn::ModuleHolder<T> (Linear, Sequential,
/// TORCH_MODULE types) or std::shared_ptr<T>, with T derived from Module.
template <class M>
struct model_traits : std::false_type {};
template <class T>
  requires std::is_base_of_v<torch::nn::Module, T>
struct model_traits<torch::nn::ModuleHolder<T>> : std::true_type {
  using module_type = T;
};
template <class T>
  requires std::is_base_of_v<torch::nn::Module, T>
struct model_traits<std::shared_ptr<T>> : std::true_type {
  using module_type = T;
};
// A TORCH_MODULE(Net) holder is a class derived from ModuleHolder<NetImpl>.
template <class M>
  requires(!std::is_same_v<M, torch::nn::ModuleHolder<typename M::ContainedType>> &&
           std::is_base_of_v<torch::nn::ModuleHolder<typename M::ContainedType>, M>)
struct model_traits<M> : std::true_type {
  using module_type = typename M::ContainedType;
};

template <class M>
inline constexpr bool is_model_v = model_traits<std::remove_cvref_t<M>>::value;

template <class M>
auto* module_ptr(const M& m) {
  if constexpr (requires { m.ptr(); }) {
    return m.ptr().get();  // ModuleHolder: get() const would add const
  } else {
    return m.get();
  }
}

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_MODEL_TRAITS_HPP
// end <accel/detail/model_traits.hpp>
// begin <accel/detail/training_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::TrainingState, the state an Accelerator shares
/// with the objects it prepared (they outlive no Accelerator copy: shared_ptr),
/// and the step protocol they follow around every optimizer step.
#ifndef ACCEL_DETAIL_TRAINING_STATE_HPP
#define ACCEL_DETAIL_TRAINING_STATE_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <torch/torch.h>

// begin <accel/detail/join_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::JoinState, what a live join_uneven_inputs()
/// guard shares with the prepared models and optimizers: before each
/// communicating forward of a guarded model (a buffer broadcast, or a
/// backward that reduces gradients) and each optimizer step, every
/// rank says what it is about to do (one all-gather of one number), so that a
/// rank that ran out of data can repeat the others' collectives, and ranks
/// that do different things are an error naming them.
#ifndef ACCEL_DETAIL_JOIN_STATE_HPP
#define ACCEL_DETAIL_JOIN_STATE_HPP

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace accel::detail {

class JoinState {
 public:
  /// A guarded model: its gradient sync, and what a joined rank does while
  /// the others run its forward (and backward): broadcast the buffers when
  /// they do, reduce zero gradients when their backward reduces.
  struct Model {
    const shard::detail::GradientSync* sync;
    std::function<void(bool buffers, bool reduce)> shadow;
  };
  /// What the ranks with data are about to do; a rank out of data announces
  /// kJoined instead.
  struct Action {
    enum Kind : int64_t { kForward = 0, kStep = 1 };
    Kind kind;
    std::size_t index;     ///< guarded model (kForward) or prepared optimizer (kStep)
    bool buffers = false;  ///< kForward: the forward broadcasts buffers
    bool reduce = false;   ///< kForward: its backward reduces gradients (a sync step)
  };
  static constexpr int64_t kJoined = -1;

  JoinState(std::shared_ptr<runtime::Communicator> comm, std::vector<Model> models)
      : comm_(std::move(comm)), models_(std::move(models)), exchange_(&JoinState::exchange) {}

  /// Index of a guarded model (-1: the model is not guarded).
  int64_t model_index(const shard::detail::GradientSync* sync) const {
    for (std::size_t i = 0; i < models_.size(); ++i)
      if (models_[i].sync == sync) return static_cast<int64_t>(i);
    return -1;
  }
  const Model& model(std::size_t i) const { return models_[i]; }

  /// A rank with data, before the collectives of `action`: every rank must be
  /// about to do the same, or be out of data.
  void announce(const Action& action) { (void)exchange_(*this, encode(action)); }

  /// A rank out of data: what the ranks with data are about to do, or
  /// nothing once every rank is out of data.
  std::optional<Action> next_action() {
    const auto v = exchange_(*this, kJoined);
    if (v == kJoined) return std::nullopt;
    return decode(v);
  }

 private:
  // index << 3 | step << 2 | reduce << 1 | buffers: one int64 per rank.
  static int64_t encode(const Action& a) {
    return static_cast<int64_t>(a.index) << 3 | (a.kind == Action::kStep ? 4 : 0) | (a.reduce ? 2 : 0) |
           (a.buffers ? 1 : 0);
  }
  static Action decode(int64_t v) {
    return Action{(v & 4) ? Action::kStep : Action::kForward, static_cast<std::size_t>(v >> 3), (v & 1) != 0,
                  (v & 2) != 0};
  }

  static int64_t exchange(JoinState& self, int64_t mine) {
    auto& comm = *self.comm_;
    const int world = comm.size();
    auto in = torch::full({1}, mine, torch::dtype(torch::kLong).device(comm.device()));
    auto all = torch::empty({world}, in.options());
    comm.all_gather(all, in)->wait();
    const auto slots = all.cpu();
    const auto* s = slots.data_ptr<int64_t>();
    int64_t running = kJoined;
    bool agree = true;
    for (int r = 0; r < world; ++r) {
      if (s[r] == kJoined) continue;
      if (running == kJoined) running = s[r];
      agree = agree && s[r] == running;
    }
    if (!agree) {
      std::ostringstream what;
      for (int r = 0; r < world; ++r) what << (r ? "; " : "") << "rank " << r << ": " << describe(s[r]);
      throw Error("accel: under join_uneven_inputs() the ranks are about to run different "
                  "collectives (" + what.str() + "). Every rank that still has data must run the "
                  "same sequence: the forward of the same guarded model (with gradients), then "
                  "its backward, then the same optimizer's step().");
    }
    return running;
  }

  static std::string describe(int64_t v) {
    if (v == kJoined) return "out of data (joined)";
    const auto a = decode(v);
    if (a.kind == Action::kStep) return "step() of prepared optimizer " + std::to_string(a.index);
    return "forward of guarded model " + std::to_string(a.index) +
           (a.reduce ? "" : " without gradient sync") + (a.buffers ? " (broadcasting buffers)" : "");
  }

  std::shared_ptr<runtime::Communicator> comm_;
  std::vector<Model> models_;
  // exchange, called through a pointer the constructor sets: the prepared
  // models and optimizers call announce() on every forward and step, and a
  // direct call would make every translation unit that prepares anything
  // compile the all-gather and its error message at -O3, though only one
  // that starts join_uneven_inputs() (ops/join.hpp) builds a JoinState.
  int64_t (*exchange_)(JoinState&, int64_t);
};

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_JOIN_STATE_HPP
// end <accel/detail/join_state.hpp>

namespace accel::shard::detail {
class ZeroReducer;
}  // namespace accel::shard::detail

namespace accel::detail {

struct TrainingState {
  std::shared_ptr<runtime::Communicator> comm;
  torch::Device device{torch::kCPU};
  int gradient_accumulation_steps = 1;
  /// The one "synchronise gradients now" flag: false on the non-sync
  /// micro-steps of accumulate(); gradient syncs read it (sync_flag()).
  bool sync_gradients = true;
  int64_t micro_step = 0;         ///< counts accumulate() entries (Accelerate's `step`)
  int64_t optimizer_steps = 0;    ///< optimizer steps that really happened
  bool last_step_skipped = false; ///< the last AcceleratedOptimizer::step() did not update
  std::vector<std::shared_ptr<shard::detail::GradientSync>> syncs;  ///< one per prepared model
  /// The sharded models' reducers (also in syncs): where an optimizer or a
  /// clip finds the model that owns its parameters.
  std::vector<std::shared_ptr<shard::detail::ZeroReducer>> sharded;
  /// precision::Fp16's loss scaler. The Accelerator owns it; a prepared
  /// optimizer may outlive the Accelerator, and must then say so.
  std::weak_ptr<precision::LossScaler> scaler;
  bool loss_scaling = false;
  /// join_uneven_inputs(): the live guard's state (null outside one).
  std::shared_ptr<JoinState> join;
  /// Each prepared optimizer's step as a rank out of data repeats it under
  /// join_uneven_inputs() (prepare() order; AcceleratedOptimizer adds it).
  std::vector<std::function<void(TrainingState&)>> optimizer_shadows;

  /// sync_gradients, shared with the gradient syncs of prepared models.
  static std::shared_ptr<const bool> sync_flag(const std::shared_ptr<TrainingState>& self) {
    return std::shared_ptr<const bool>(self, &self->sync_gradients);
  }

  /// Every gradient averaged and ready for the optimizer or for clipping.
  void finalize_gradients() {
    for (auto& s : syncs) s->finalize();
  }

  /// Before an optimizer step (Fp16: unscale the optimizer's gradients, each
  /// once per iteration, and agree on inf/NaN across ranks); false when every
  /// rank must skip it. `index`: the optimizer's place in prepare() order.
  bool before_step(torch::optim::Optimizer& opt, std::size_t index) {
    if (!loss_scaling) return true;
    // Its second step with no backward in between (a rank out of data under
    // join_uneven_inputs()): the last iteration is over.
    if (index < stepped_.size() && stepped_[index]) update_scaler();
    std::vector<torch::Tensor> params;
    for (auto& g : opt.param_groups())
      for (auto& p : g.params()) params.push_back(p);
    return !live_scaler()->unscale(params, *comm);
  }

  /// After a step attempt (Fp16: the scale is updated once per iteration:
  /// now if every prepared optimizer has stepped, else before the next
  /// backward scales a loss, as GradScaler.update() after all steps).
  void after_step(std::size_t index) {
    if (!loss_scaling) return;
    if (stepped_.size() < std::max(optimizer_shadows.size(), index + 1))
      stepped_.resize(std::max(optimizer_shadows.size(), index + 1), false);
    stepped_[index] = true;
    if (std::all_of(stepped_.begin(), stepped_.end(), [](bool b) { return b; })) update_scaler();
  }

  /// Before a backward scales its loss, or before save_state records the
  /// scale: the update an iteration with fewer steps than optimizers left.
  void settle_loss_scale() {
    if (loss_scaling && std::any_of(stepped_.begin(), stepped_.end(), [](bool b) { return b; })) update_scaler();
  }

 private:
  void update_scaler() {
    live_scaler()->update();
    stepped_.assign(stepped_.size(), false);
  }

  std::vector<bool> stepped_;  ///< Fp16: per optimizer, stepped since the last scale update

  std::shared_ptr<precision::LossScaler> live_scaler() const {
    auto s = scaler.lock();
    ACCEL_CHECK(s != nullptr, "accel: optimizer.step() after the Accelerator that prepared the "
                "optimizer was destroyed (its loss scaler went with it). Keep the Accelerator "
                "alive while you train with what it prepared.");
    return s;
  }
};

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_TRAINING_STATE_HPP
// end <accel/detail/training_state.hpp>
// begin <accel/shard/detail/partition_layout.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::PartitionLayout: where each tensor an
/// optimizer steps lies in the flat buckets of a sharded model. save_state
/// records the buckets, so that load_state can re-partition optimizer state
/// saved by another number of processes (checkpoint/detail/optimizer_relayout.hpp).
#ifndef ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP
#define ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP

#include <cstdint>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/bucket_plan.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::plan_buckets, how gradient sync groups
/// parameters into flat buckets, and storage_alias, how a parameter or its
/// gradient lives inside one.
#ifndef ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP

#include <cstddef>
#include <cstdint>
#include <vector>

#include <torch/torch.h>

namespace accel::shard::detail {

/// A tensor sharing `base`'s storage from element `offset` on, that is NOT an
/// autograd view: LibTorch's zero_grad (detach_ + zero_), in-place
/// accumulation, set_data and optimizers treat it as a leaf and keep it.
inline torch::Tensor storage_alias(const torch::Tensor& base, int64_t offset, at::IntArrayRef sizes) {
  return torch::empty({0}, base.options().requires_grad(false))
      .set_(base.storage(), base.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
}

/// Which parameters share a bucket and where each one sits in it. Every
/// reducer (Replicate's, ZeRO's) uses this one plan, so that the order of
/// collectives, and the chunks a sharded optimizer checkpoints, follow one rule.
struct BucketPlan {
  struct Slot {
    std::size_t bucket = 0;
    int64_t offset = 0;          ///< first element of the parameter in its bucket
    std::vector<int64_t> shape;  ///< the parameter's shape when it was planned
  };
  std::vector<std::vector<std::size_t>> buckets;  ///< parameter indices, in bucket order
  std::vector<int64_t> numel;                     ///< elements of each bucket (unpadded)
  std::vector<Slot> slots;                        ///< one per parameter

  std::size_t size() const { return buckets.size(); }
};

/// Buckets hold parameters in reverse registration order (roughly the order
/// backward produces their gradients); a new bucket starts when the next
/// parameter would take it past bucket_bytes, or has another dtype, device or
/// group (group_of: e.g. the optimizer's parameter group; empty: one group).
inline BucketPlan plan_buckets(const std::vector<torch::Tensor>& params, int64_t bucket_bytes,
                               const std::vector<int>& group_of = {}) {
  const auto group = [&](std::size_t k) { return group_of.empty() ? 0 : group_of[k]; };
  BucketPlan plan;
  plan.slots.resize(params.size());
  int64_t bytes = 0;
  for (std::size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    bool start = plan.buckets.empty() || bytes + static_cast<int64_t>(p.nbytes()) > bucket_bytes;
    if (!start) {
      const auto first = plan.buckets.back().front();
      const auto& q = params[first];
      start = q.scalar_type() != p.scalar_type() || q.device() != p.device() || group(first) != group(k);
    }
    if (start) {
      plan.buckets.emplace_back();
      plan.numel.push_back(0);
      bytes = 0;
    }
    plan.slots[k] = BucketPlan::Slot{plan.buckets.size() - 1, plan.numel.back(), p.sizes().vec()};
    plan.buckets.back().push_back(k);
    plan.numel.back() += p.numel();
    bytes += static_cast<int64_t>(p.nbytes());
  }
  return plan;
}

/// Views of `buffer` (bucket b's flat storage, laid out as the plan says)
/// with each of its parameters' shapes: what a communication hook sees.
inline std::vector<torch::Tensor> member_views(const BucketPlan& plan, std::size_t b, const torch::Tensor& buffer) {
  std::vector<torch::Tensor> views;
  for (auto k : plan.buckets[b]) views.push_back(storage_alias(buffer, plan.slots[k].offset, plan.slots[k].shape));
  return views;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_PLAN_HPP
// end <accel/shard/detail/bucket_plan.hpp>

namespace accel::shard::detail {

/// The buckets (BucketPlan: they depend on the model, the optimizer's groups
/// and bucket_cap_mb, not on the number of processes) and, for every
/// parameter k of optimizer group g, the range of its bucket it holds.
struct PartitionLayout {
  struct Piece {
    std::size_t bucket = 0;
    int64_t offset = 0;          ///< first element in the bucket (may lie in its padding)
    int64_t numel = 0;
    std::vector<int64_t> shape;  ///< of the tensor the optimizer holds
  };
  std::vector<int64_t> bucket_numel;  ///< unpadded, in bucket order
  std::vector<int> bucket_group;      ///< the optimizer group of each bucket
  std::vector<std::vector<Piece>> groups;
};

/// ZeRO's partition on `rank` of `world`: group g holds, in bucket order,
/// chunk `rank` (ceil(numel / world) elements) of each of its buckets.
inline PartitionLayout chunk_layout(std::vector<int64_t> numel, std::vector<int> group, std::size_t groups,
                                    int world, int rank) {
  PartitionLayout l;
  l.groups.resize(groups);
  for (std::size_t b = 0; b < numel.size(); ++b) {
    const int64_t chunk = (numel[b] + world - 1) / world;
    l.groups[static_cast<std::size_t>(group[b])].push_back({b, rank * chunk, chunk, {chunk}});
  }
  l.bucket_numel = std::move(numel);
  l.bucket_group = std::move(group);
  return l;
}

/// The unpartitioned optimizer over the same buckets: each group holds its
/// parameters (`group_params`, as the optimizer lists them) whole.
/// `trainable` and `group_of` are what the plan was made from.
inline PartitionLayout parameter_layout(const std::vector<torch::Tensor>& trainable, const BucketPlan& plan,
                                        const std::vector<int>& group_of,
                                        const std::vector<std::vector<torch::Tensor>>& group_params) {
  std::unordered_map<const c10::TensorImpl*, std::size_t> index;
  for (std::size_t k = 0; k < trainable.size(); ++k) index[trainable[k].unsafeGetTensorImpl()] = k;
  PartitionLayout l;
  l.bucket_numel = plan.numel;
  for (const auto& members : plan.buckets) l.bucket_group.push_back(group_of[members.front()]);
  for (const auto& params : group_params) {
    auto& pieces = l.groups.emplace_back();
    for (const auto& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      ACCEL_CHECK(it != index.end(), "accel: the optimizer holds a parameter that is not a trainable "
                  "parameter of its prepared model; a shard policy needs exactly those.");
      const auto& slot = plan.slots[it->second];
      pieces.push_back({slot.bucket, slot.offset, p.numel(), slot.shape});
    }
  }
  return l;
}

/// group_of for plan_buckets: the optimizer group of each trainable parameter
/// (-1: in none).
inline std::vector<int> groups_of(const std::vector<torch::Tensor>& trainable,
                                  const std::vector<std::vector<torch::Tensor>>& group_params) {
  std::unordered_map<const c10::TensorImpl*, int> group;
  for (std::size_t g = 0; g < group_params.size(); ++g)
    for (const auto& p : group_params[g]) group[p.unsafeGetTensorImpl()] = static_cast<int>(g);
  std::vector<int> out;
  for (const auto& p : trainable) {
    const auto it = group.find(p.unsafeGetTensorImpl());
    out.push_back(it == group.end() ? -1 : it->second);
  }
  return out;
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_PARTITION_LAYOUT_HPP
// end <accel/shard/detail/partition_layout.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace accel::ckpt {

/// save(OutputArchive&) const and load(InputArchive&): torch::nn modules,
/// torch::optim optimizers, accel::sched schedulers, or a user type.
template <class T>
concept ArchiveCheckpointable = requires(T& t, const T& ct, torch::serialize::OutputArchive& out,
                                         torch::serialize::InputArchive& in) {
  ct.save(out);
  t.load(in);
};

/// state_dict() returning a value a c10::IValue can hold (torch::Tensor,
/// std::vector<torch::Tensor>, int64_t, double, std::string, c10::Dict, ...)
/// and load_state_dict() taking that value back.
template <class T>
concept StateDictCheckpointable = requires(T& t, const c10::IValue& v) {
  c10::IValue(t.state_dict());
  t.load_state_dict(v.to<std::remove_cvref_t<decltype(t.state_dict())>>());
};

namespace detail {
template <class T>
inline constexpr bool is_lr_scheduler_v = std::is_base_of_v<torch::optim::LRScheduler, T>;

template <class T>
struct is_shared_ptr : std::false_type {};
template <class T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {
  using element = T;
};
}  // namespace detail

/// What register_for_checkpointing() accepts: an ArchiveCheckpointable or
/// StateDictCheckpointable object, a torch::nn module holder or shared_ptr, a
/// torch::optim::LRScheduler (its step count is saved: the learning rates
/// themselves live in the optimizer's state), or a std::shared_ptr to any of
/// these. The first that applies, in this order: module, archive, state_dict,
/// LRScheduler.
template <class T>
concept Checkpointable =
    accel::detail::is_model_v<T> || ArchiveCheckpointable<T> || StateDictCheckpointable<T> ||
    detail::is_lr_scheduler_v<T> ||
    (detail::is_shared_ptr<T>::value &&
     (ArchiveCheckpointable<typename detail::is_shared_ptr<T>::element> ||
      StateDictCheckpointable<typename detail::is_shared_ptr<T>::element> ||
      detail::is_lr_scheduler_v<typename detail::is_shared_ptr<T>::element>));

namespace detail {

// LRScheduler keeps its step count in a protected member and offers no
// accessor (LibTorch 1.13 and 2.x); a pointer to member formed through a
// derived class reads it for any scheduler.
struct LRSchedulerAccess : torch::optim::LRScheduler {
  static auto step_count_member() { return &LRSchedulerAccess::step_count_; }
};

// LibTorch's Optimizer::load restores the per-parameter state but keeps the
// param-group options (learning rate, momentum...) the optimizer has now;
// they are saved and restored beside it, through the options' own serialize().
inline void save_optimizer(const torch::optim::Optimizer& opt, torch::serialize::OutputArchive& out) {
  opt.save(out);
  const auto& groups = opt.param_groups();
  out.write("accel.param_groups/size", torch::tensor(static_cast<int64_t>(groups.size())));
  for (std::size_t i = 0; i < groups.size(); ++i) {
    torch::serialize::OutputArchive options(out.compilation_unit());
    groups[i].options().serialize(options);
    out.write("accel.param_groups/" + std::to_string(i), options);
  }
}
inline void load_optimizer(torch::optim::Optimizer& opt, torch::serialize::InputArchive& archive) {
  load_with_portable_keys(archive, [&opt](torch::serialize::InputArchive& in) {
    opt.load(in);  // checks the group count and sizes (c10::Error)
    torch::Tensor size;
    in.read("accel.param_groups/size", size);
    auto& groups = opt.param_groups();
    TORCH_CHECK(size.item<int64_t>() == static_cast<int64_t>(groups.size()),
                "the saved optimizer has ", size.item<int64_t>(), " parameter groups, this one ",
                groups.size());
    for (std::size_t i = 0; i < groups.size(); ++i) {
      torch::serialize::InputArchive options;
      in.read("accel.param_groups/" + std::to_string(i), options);
      groups[i].options().serialize(options);
    }
  });
}

/// What load_state() keeps to put an object back if a later load fails:
/// called before loading, returns the closure that restores the object.
using Snapshot = std::function<std::function<void()>()>;

/// save/load closures for one object (the object must outlive them);
/// snapshot is optional (without it, load_state serializes a copy first).
struct Archived {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(torch::serialize::InputArchive&)> load;
  Snapshot snapshot = {};
};

/// An optimizer's snapshot without serializing it: LibTorch's Optimizer::load
/// replaces the per-parameter state objects and the group options with new
/// ones, never writing into the old tensors, so shallow copies of the state
/// (clone() copies tensor handles) and copies of the options restore it. For
/// 100M parameters with Adam this is microseconds instead of the ~10 s a
/// serialized copy took (bench/checkpoint_cost).
inline Snapshot optimizer_snapshot(torch::optim::Optimizer* p) {
  return [p]() -> std::function<void()> {
    using StateMap = std::remove_cvref_t<decltype(p->state())>;
    auto state = std::make_shared<StateMap>();
    for (const auto& [key, value] : p->state()) state->emplace(key, value->clone());
    auto options = std::make_shared<std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>>();
    for (const auto& g : p->param_groups()) options->push_back(g.options().clone());
    return [p, state, options] {
      p->state().clear();
      for (const auto& [key, value] : *state) p->state().emplace(key, value->clone());
      auto& groups = p->param_groups();
      for (std::size_t i = 0; i < groups.size() && i < options->size(); ++i)
        groups[i].set_options((*options)[i]->clone());
    };
  };
}

template <class T>
Archived archived(T& obj) {
  if constexpr (accel::detail::is_model_v<T>) {
    auto* m = accel::detail::module_ptr(obj);
    return {[m](auto& out) { m->save(out); }, [m](auto& in) { m->load(in); }};
  } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, T>) {
    torch::optim::Optimizer* p = &obj;
    return {[p](auto& out) { save_optimizer(*p, out); }, [p](auto& in) { load_optimizer(*p, in); },
            optimizer_snapshot(p)};
  } else if constexpr (ArchiveCheckpointable<T>) {
    T* p = &obj;
    return {[p](auto& out) { p->save(out); }, [p](auto& in) { p->load(in); }};
  } else if constexpr (StateDictCheckpointable<T>) {
    using S = std::remove_cvref_t<decltype(obj.state_dict())>;
    T* p = &obj;
    return {[p](auto& out) { out.write("state_dict", c10::IValue(p->state_dict())); },
            [p](auto& in) {
              c10::IValue v;
              in.read("state_dict", v);
              p->load_state_dict(v.template to<S>());
            }};
  } else if constexpr (is_lr_scheduler_v<T>) {
    torch::optim::LRScheduler* p = &obj;
    return {[p](auto& out) {
              out.write("step_count",
                        torch::tensor(static_cast<int64_t>(p->*LRSchedulerAccess::step_count_member())));
            },
            [p](auto& in) {
              torch::Tensor t;
              in.read("step_count", t);
              using C = std::remove_cvref_t<decltype(p->*LRSchedulerAccess::step_count_member())>;
              p->*LRSchedulerAccess::step_count_member() = static_cast<C>(t.item<int64_t>());
            }};
  } else {
    static_assert(is_shared_ptr<T>::value, "accel: not a Checkpointable type.");
    ACCEL_CHECK(obj != nullptr, "accel: register_for_checkpointing got a null shared_ptr. ",
                "Register the object itself.");
    auto keep = obj;  // holds the object while the registry does
    auto inner = archived(*keep);
    return {[keep, s = inner.save](auto& out) { s(out); },
            [keep, l = inner.load](auto& in) { l(in); }};
  }
}

}  // namespace detail

/// Everything an Accelerator saves, in the order it was prepared/registered.
/// Filled by prepare() and register_for_checkpointing(); read by
/// save_state()/load_state() (save_state.hpp).
struct StateRegistry {
  struct Loader {
    std::function<data::LoaderCheckpoint()> position;
    std::function<void(const data::LoaderCheckpoint&)> restore;
    /// Samples one batch of every process takes together: a position saved
    /// by another number of processes is mapped through it.
    std::function<int64_t()> samples_per_step;
  };

  std::vector<std::shared_ptr<torch::nn::Module>> models;
  /// Their save/load closures are made where a checkpoint is written or
  /// read (optimizer_states() in detail/state_layout.hpp): a translation unit
  /// that prepares an optimizer and never saves compiles no serialization.
  std::vector<std::shared_ptr<torch::optim::Optimizer>> optimizers;
  std::vector<detail::Archived> schedulers;
  std::vector<std::shared_ptr<int64_t>> scheduler_seen_steps;  ///< AcceleratedScheduler pacing
  std::vector<Loader> loaders;
  std::vector<detail::Archived> custom;
  std::shared_ptr<precision::LossScaler> scaler;     ///< precision::Fp16 only
  std::shared_ptr<accel::detail::TrainingState> state;  ///< step counters, communicator, device
  int64_t checkpoint_iteration = 0;  ///< next automatic checkpoint_<N>
  bool shards_optimizer_state = false;  ///< the shard policy partitions optimizer state
  bool optimizer_per_rank = false;   ///< ... and there are several processes to partition it over
  double partition_bucket_cap_mb = 0;  ///< their partitions follow the buckets of this size
  /// Under such a policy, per optimizer: what this process's optimizer steps
  /// (its chunks, or its parameters whole on one process) and what it would
  /// step on one process; load_state re-partitions state saved by another
  /// number of processes with them.
  struct Partition {
    shard::detail::PartitionLayout held, whole;
  };
  std::vector<Partition> partitions;
  StatePreHooks save_pre_hooks, load_pre_hooks;  ///< register_save/load_state_pre_hook
  /// During one save_state()/load_state(): the models its pre-hooks took
  /// out of accel's hands (their files are not written / not read).
  std::set<std::size_t> models_skipped;

  template <class M>
  void add_model(const M& model) {
    auto* m = accel::detail::module_ptr(model);
    // Aliasing pointer to the module the holder owns (and keeps alive).
    if constexpr (requires { model.ptr(); })
      models.push_back(std::shared_ptr<torch::nn::Module>(model.ptr(), m));
    else
      models.push_back(std::shared_ptr<torch::nn::Module>(model, m));
  }

  /// opt is kept alive by the registry.
  void add_optimizer(std::shared_ptr<torch::optim::Optimizer> opt) { optimizers.push_back(std::move(opt)); }

  template <class S>
  void add_scheduler(std::shared_ptr<S> sched, std::shared_ptr<int64_t> seen_steps) {
    auto a = detail::archived(*sched);
    schedulers.push_back({[sched, s = a.save](auto& out) { s(out); },
                          [sched, l = a.load](auto& in) { l(in); }});
    scheduler_seen_steps.push_back(std::move(seen_steps));
  }

  /// A plain copy of the loader shares its position with the user's copy.
  template <class L>
  void add_loader(const L& loader) {
    auto shared = std::make_shared<L>(loader);
    loaders.push_back({[shared] { return shared->checkpoint(); },
                       [shared](const data::LoaderCheckpoint& c) { shared->restore(c); },
                       [shared] { return shared->total_batch_size(); }});
  }

  template <Checkpointable T>
  void add_custom(T& obj) {
    custom.push_back(detail::archived(obj));
  }
};

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_STATE_REGISTRY_HPP
// end <accel/checkpoint/state_registry.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::ckpt {

inline constexpr std::string_view kStateFile = "accel_state.json";
inline constexpr std::string_view kStateFormat = "accel.save_state";
inline constexpr int kStateFormatVersion = 1;

namespace detail {

/// "model.safetensors", "model_1.safetensors", ...
inline std::string indexed_name(const char* stem, std::size_t i, const char* ext) {
  return std::string(stem) + (i == 0 ? "" : "_" + std::to_string(i)) + ext;
}

/// Automatic checkpoints (ProjectConfiguration::automatic_checkpoint_naming)
/// are directories checkpoint_<N> under <project_dir>/checkpoints.
inline constexpr std::string_view kCheckpointPrefix = "checkpoint_";
inline std::string checkpoint_dir_name(int64_t n) {
  return std::string(kCheckpointPrefix) + std::to_string(n);
}

/// The checkpoint number of a directory named checkpoint_<N>.
inline std::optional<int64_t> checkpoint_number(const std::string& name) {
  if (name.size() <= kCheckpointPrefix.size() || name.compare(0, kCheckpointPrefix.size(), kCheckpointPrefix) != 0)
    return std::nullopt;
  const std::string digits = name.substr(kCheckpointPrefix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), [](char c) {
        return c >= '0' && c <= '9';
      }))
    return std::nullopt;
  return std::stoll(digits);
}

/// The complete automatic checkpoints under base, oldest first.
inline std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& base) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(base, ec))
    if (auto n = checkpoint_number(e.path().filename().string()); n && e.is_directory(ec))
      out.emplace_back(*n, e.path());
  std::sort(out.begin(), out.end());
  return out;
}

inline fs::path checkpoints_base(const AcceleratorOptions& o, const char* caller) {
  ACCEL_CHECK(o.project_dir.has_value(), "accel: ", caller,
              "() without a directory needs AcceleratorOptions::project_dir (checkpoints go to "
              "project_dir/checkpoints/checkpoint_<N>). Pass a directory, or set project_dir.");
  return fs::path(*o.project_dir) / "checkpoints";
}

/// Every process says whether its part worked (one all-reduce MAX); returns
/// the highest failing rank, or -1 when all succeeded.
inline int failed_rank(runtime::Communicator& comm, bool ok) {
  float mine = ok ? 0.f : static_cast<float>(comm.rank() + 1);
  if (comm.size() > 1) {
    auto t = torch::full({1}, mine, torch::TensorOptions().device(comm.device()));
    comm.all_reduce(t, runtime::ReduceOp::Max)->wait();
    mine = t.to(torch::kCPU).item<float>();
  }
  return static_cast<int>(mine) - 1;
}

/// Rethrows this process's error, or throws if another process failed.
inline void agree(runtime::Communicator& comm, const std::exception_ptr& err, const char* what,
                  const char* consequence) {
  const int failed = failed_rank(comm, err == nullptr);
  if (err) std::rethrow_exception(err);
  if (failed >= 0)
    throw Error(accel::detail::concat("accel: ", what, " failed on process ", failed, " ",
                                      accel::detail::kFailedElsewhere, "; ", consequence,
                                      ". Fix the cause reported by that process and retry."));
}
inline constexpr const char* kSaveKept = "the previous checkpoint is untouched";
inline constexpr const char* kLoadKept = "nothing was loaded on this process";

/// dir without a trailing separator, so that dir.accel-tmp is a sibling.
inline fs::path normal_dir(const fs::path& dir) {
  fs::path p = dir.lexically_normal();
  if (!p.has_filename() && p.has_parent_path()) p = p.parent_path();
  return p;
}

// --- The layout: one table of file names and keys for the writer
// (write_process_files, save_state) and the reader (read_state,
// load_latest_state). Renaming an entry breaks old checkpoints. ---

inline std::string model_file(std::size_t i) { return indexed_name("model", i, ".safetensors"); }
inline std::string optimizer_file(std::size_t i, int rank, bool per_rank) {
  return per_rank ? indexed_name("optimizer", i, ("_rank" + std::to_string(rank) + ".pt").c_str())
                  : indexed_name("optimizer", i, ".pt");
}
inline std::string scheduler_file(std::size_t i) { return indexed_name("scheduler", i, ".pt"); }
inline std::string custom_file(std::size_t i) { return "custom_checkpoint_" + std::to_string(i) + ".pt"; }
inline constexpr const char* kScalerFile = "scaler.json";
inline std::string random_states_file(int rank) { return "random_states_" + std::to_string(rank) + ".pt"; }
inline std::string loaders_file(int rank) { return "loaders_" + std::to_string(rank) + ".json"; }
inline std::string comm_hook_file(std::size_t i, int rank) {
  return indexed_name("comm_hook", i, ("_rank" + std::to_string(rank) + ".pt").c_str());
}

/// The keys of accel_state.json (kStateFile), of the loaders_<rank>.json
/// files and of scaler.json.
namespace key {
inline constexpr const char *format = "format", *format_version = "format_version",
                            *accel_version = "accel_version", *world_size = "world_size",
                            *micro_step = "micro_step", *optimizer_steps = "optimizer_steps",
                            *checkpoint_iteration = "checkpoint_iteration", *models = "models",
                            *models_skipped = "models_skipped", *optimizers = "optimizers",
                            *optimizer_per_rank = "optimizer_per_rank",
                            *partition_bucket_cap_mb = "partition_bucket_cap_mb",
                            *shards_optimizer_state = "shards_optimizer_state",
                            *partitions = "partitions", *schedulers = "schedulers",
                            *loaders = "loaders", *custom_objects = "custom_objects",
                            *comm_hook_states = "comm_hook_states", *loss_scaler = "loss_scaler",
                            *checksums = "xxh64";
// partitions[i]
inline constexpr const char *bucket_numel = "bucket_numel", *bucket_group = "bucket_group",
                            *groups = "groups";
// loaders_<rank>.json: {rank, loaders: [{epoch, batches_yielded, samples_per_step}]}
inline constexpr const char *rank = "rank", *epoch = "epoch", *batches_yielded = "batches_yielded",
                            *samples_per_step = "samples_per_step";
// scaler.json
inline constexpr const char *scale = "scale", *growth_tracker = "growth_tracker";
}  // namespace key

// --- end of the layout ---

/// The prepared optimizers' save/load closures, in prepare() order.
inline std::vector<Archived> optimizer_states(const StateRegistry& reg) {
  std::vector<Archived> out;
  for (const auto& opt : reg.optimizers) out.push_back(archived(*opt));
  return out;
}

/// The state of the prepared models' communication hooks that keep some
/// (CommHook::PowerSGD: its step, error feedback and Qs differ per process),
/// in prepare order; one file per hook and process.
inline std::vector<Archived> comm_hook_states(const StateRegistry& reg) {
  std::vector<Archived> out;
  for (const auto& sync : reg.state->syncs)
    if (auto* hook = sync->comm_hook(); hook && hook->has_state())
      out.push_back(Archived{[hook](torch::serialize::OutputArchive& a) { hook->save(a); },
                             [hook](torch::serialize::InputArchive& a) { hook->load(a); }});
  return out;
}

/// Clears StateRegistry::models_skipped when a save or load ends, however it ends.
class SkippedModels {
 public:
  explicit SkippedModels(StateRegistry& reg) : reg_(reg) { reg_.models_skipped.clear(); }
  SkippedModels(const SkippedModels&) = delete;
  SkippedModels& operator=(const SkippedModels&) = delete;
  ~SkippedModels() { reg_.models_skipped.clear(); }

 private:
  StateRegistry& reg_;
};

/// The files the main process writes and every process reads.
inline std::vector<std::string> main_files(const StateRegistry& reg) {
  std::vector<std::string> files;
  for (std::size_t i = 0; i < reg.models.size(); ++i)
    if (!reg.models_skipped.count(i)) files.push_back(model_file(i));
  if (!reg.optimizer_per_rank)
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) files.push_back(optimizer_file(i, 0, reg.optimizer_per_rank));
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) files.push_back(scheduler_file(i));
  for (std::size_t i = 0; i < reg.custom.size(); ++i)
    files.push_back(custom_file(i));
  if (reg.scaler) files.push_back(kScalerFile);
  return files;
}

/// The files process `rank` writes and reads itself; as many on every process.
inline std::vector<std::string> own_files(const StateRegistry& reg, int rank) {
  std::vector<std::string> files;
  if (reg.optimizer_per_rank)
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) files.push_back(optimizer_file(i, rank, reg.optimizer_per_rank));
  files.push_back(random_states_file(rank));
  files.push_back(loaders_file(rank));
  for (std::size_t i = 0; i < comm_hook_states(reg).size(); ++i) files.push_back(comm_hook_file(i, rank));
  return files;
}

/// File name -> XXH64, as accel_state.json's "xxh64" records them: of the
/// whole file, except for .safetensors files: of their data buffer (the value
/// their header's accel.data_xxh64 holds too).
using Checksums = std::map<std::string, std::uint64_t>;

/// This process's files of a checkpoint, into stage; returns their checksums.
inline Checksums write_process_files(StateRegistry& reg, const fs::path& stage, int rank) {
  const bool main = rank == 0;
  Checksums sums;
  if (main) {
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      if (reg.models_skipped.count(i)) continue;  // a save_state pre-hook saves it
      const std::string name = model_file(i);
      sums[name] = save_safetensors(stage / name, module_state(*reg.models[i]));
      crash_point("writing");
    }
  }
  const auto archive_all = [&](const std::vector<Archived>& items, auto name_of) {
    for (std::size_t i = 0; i < items.size(); ++i) {
      torch::serialize::OutputArchive out;
      items[i].save(out);
      const std::string name = name_of(i);
      sums[name] = save_archive(out, stage / name);
    }
  };
  if (main || reg.optimizer_per_rank)
    archive_all(optimizer_states(reg), [&](std::size_t i) { return optimizer_file(i, rank, reg.optimizer_per_rank); });
  archive_all(comm_hook_states(reg), [&](std::size_t i) { return comm_hook_file(i, rank); });
  if (main) {
    archive_all(reg.schedulers, scheduler_file);
    archive_all(reg.custom, custom_file);
    if (reg.scaler)
      sums[kScalerFile] = write_json(stage / kScalerFile, {{key::scale, reg.scaler->scale()},
                                                           {key::growth_tracker, reg.scaler->growth_tracker()}});
  }
  torch::serialize::OutputArchive rng;
  save_generators(rng);
  sums[random_states_file(rank)] = save_archive(rng, stage / random_states_file(rank));
  crash_point("writing");
  nlohmann::json loaders = nlohmann::json::array();
  for (const auto& l : reg.loaders) {
    const auto c = l.position();
    loaders.push_back({{key::epoch, c.epoch}, {key::batches_yielded, c.batches_yielded},
                       {key::samples_per_step, l.samples_per_step()}});
  }
  sums[loaders_file(rank)] = write_json(stage / loaders_file(rank), {{key::rank, rank}, {key::loaders, loaders}});
  return sums;
}

/// Every process's checksums, on every process: one all-reduce (sum) of a
/// [processes, own files] table in which each process fills its own row.
inline Checksums gather_checksums(StateRegistry& reg, Checksums mine) {
  auto& comm = *reg.state->comm;
  const int world = comm.size();
  if (world == 1) return mine;
  const auto count = static_cast<int64_t>(own_files(reg, 0).size());
  auto table = torch::zeros({world, count}, torch::kLong);
  {
    const auto names = own_files(reg, comm.rank());
    auto row = table[comm.rank()];
    for (int64_t j = 0; j < count; ++j)
      row[j] = std::bit_cast<int64_t>(mine.at(names[static_cast<std::size_t>(j)]));
  }
  table = table.to(comm.device());
  comm.all_reduce(table, runtime::ReduceOp::Sum)->wait();
  table = table.to(torch::kCPU);
  for (int r = 0; r < world; ++r) {
    const auto names = own_files(reg, r);
    for (int64_t j = 0; j < count; ++j)
      mine[names[static_cast<std::size_t>(j)]] = std::bit_cast<std::uint64_t>(table[r][j].item<int64_t>());
  }
  return mine;
}

/// The buckets each optimizer's partitions follow (shard policies that
/// partition optimizer state; null where they are not known), so that
/// another number of processes can re-partition the state.
inline nlohmann::json partitions_json(const StateRegistry& reg) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& p : reg.partitions) {
    if (p.whole.groups.empty()) {
      out.push_back(nullptr);
      continue;
    }
    out.push_back({{key::bucket_numel, p.whole.bucket_numel},
                   {key::bucket_group, p.whole.bucket_group},
                   {key::groups, p.whole.groups.size()}});
  }
  return out;
}

inline nlohmann::json checksums_json(const Checksums& sums) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, sum] : sums) j[name] = to_hex(sum);
  return j;
}

}  // namespace detail
}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_LAYOUT_HPP
// end <accel/checkpoint/detail/state_layout.hpp>
// begin <accel/checkpoint/detail/state_reader.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines how load_state reads a checkpoint: every file read and
/// validated before anything changes, and archive loads that roll back.
#ifndef ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP
#define ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP

// begin <accel/checkpoint/detail/optimizer_relayout.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Re-partitions the optimizer state of a sharded model saved by another
/// number of processes: load_state on 1, 3 or 4 processes of a checkpoint
/// that 2 wrote under shard::ShardOptimizer or shard::ShardGradients.
///
/// Each process's optimizer archive holds one state per tensor it stepped
/// (its chunk of every bucket, or, on one process, every parameter whole).
/// The buckets do not depend on the number of processes, only the chunks do.
/// So the saved states are laid back into their buckets (every element-wise
/// tensor: Adam's moments, SGD's momentum...), and the pieces this process
/// steps now are cut out of them; state that is not element-wise (a step
/// count) is taken from the first saved piece of the bucket. The result is an
/// archive in LibTorch's own optimizer format, loaded as any other.
#ifndef ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP
#define ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP


#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

using shard::detail::PartitionLayout;

/// One saved optimizer archive, with the layout of what it stepped.
struct SavedPartition {
  torch::serialize::InputArchive* archive = nullptr;
  PartitionLayout layout;
  std::filesystem::path file;  ///< for messages
};

namespace relayout {

/// A parameter's saved state: field name -> value (LibTorch writes each
/// field of a param state as one attribute).
using FieldMap = std::map<std::string, ArchiveValue>;

/// The state of every parameter of every group, by position (an empty map:
/// the optimizer kept no state for it).
inline std::vector<std::vector<FieldMap>> read_states(const SavedPartition& saved) {
  auto& in = *saved.archive;
  const auto fail = [&](const std::string& why) {
    throw Error(accel::detail::concat("accel: cannot re-partition the optimizer state in '", saved.file.string(),
                                      "' (", why, "). Resume with the number of processes that saved it, "
                                      "or load a checkpoint written completely by save_state()."));
  };
  torch::serialize::InputArchive groups_in, states_in;
  if (!in.try_read("param_groups", groups_in) || !in.try_read("state", states_in))
    fail("it is not a LibTorch optimizer archive");
  torch::Tensor size;
  if (!groups_in.try_read("param_groups/size", size)) fail("it lists no parameter groups");
  if (size.item<int64_t>() != static_cast<int64_t>(saved.layout.groups.size()))
    fail(accel::detail::concat("it has ", size.item<int64_t>(), " parameter groups, the saved buckets ",
                               saved.layout.groups.size()));
  std::vector<std::vector<FieldMap>> out(saved.layout.groups.size());
  for (std::size_t g = 0; g < out.size(); ++g) {
    torch::serialize::InputArchive group;
    torch::Tensor count;
    if (!groups_in.try_read("param_groups/" + std::to_string(g), group) || !group.try_read("params/size", count))
      fail(accel::detail::concat("parameter group ", g, " is unreadable"));
    if (count.item<int64_t>() != static_cast<int64_t>(saved.layout.groups[g].size()))
      fail(accel::detail::concat("parameter group ", g, " holds ", count.item<int64_t>(),
                                 " tensors, the saved buckets give it ", saved.layout.groups[g].size()));
    for (std::size_t k = 0; k < saved.layout.groups[g].size(); ++k) {
      c10::IValue key;
      if (!group.try_read("params/" + std::to_string(k), key) || !key.isString())
        fail(accel::detail::concat("parameter ", k, " of group ", g, " has no key"));
      FieldMap fields;
      torch::serialize::InputArchive state;
      if (states_in.try_read(key.toStringRef(), state))
        for (const auto& name : state.keys()) fields[name] = read_value(state, name);
      out[g].push_back(std::move(fields));
    }
  }
  return out;
}

/// Is this field of a piece's state element-wise (a tensor shaped like the piece)?
inline bool elementwise(const ArchiveValue& v, const PartitionLayout::Piece& piece) {
  return v.value.isTensor() && v.value.toTensor().defined() && v.value.toTensor().sizes().vec() == piece.shape;
}

/// One bucket's state laid out flat: element-wise fields over the whole
/// bucket (padding included), other fields as the first saved piece had them.
struct BucketState {
  std::map<std::string, ArchiveValue> flat;  ///< tensors of the bucket's length
  FieldMap other;
  bool any = false;  ///< some saved piece of the bucket had state
};

}  // namespace relayout

/// The archive that an optimizer holding `target` loads: the state of
/// `saved` (every process's archive of the run that saved it) re-cut. The
/// layouts must describe the same buckets (the caller checks).
inline torch::serialize::InputArchive relayout_optimizer(const std::vector<SavedPartition>& saved,
                                                         const PartitionLayout& target,
                                                         c10::optional<torch::Device> device) {
  using namespace relayout;
  const std::size_t buckets = target.bucket_numel.size();
  // Every bucket's length, padding of any layout included.
  std::vector<int64_t> length(target.bucket_numel);
  const auto cover = [&](const PartitionLayout& l) {
    for (const auto& group : l.groups)
      for (const auto& p : group) length[p.bucket] = std::max(length[p.bucket], p.offset + p.numel);
  };
  cover(target);
  for (const auto& s : saved) cover(s.layout);

  std::vector<BucketState> state(buckets);
  for (const auto& s : saved) {
    const auto fields = read_states(s);
    for (std::size_t g = 0; g < s.layout.groups.size(); ++g) {
      for (std::size_t k = 0; k < s.layout.groups[g].size(); ++k) {
        const auto& piece = s.layout.groups[g][k];
        auto& b = state[piece.bucket];
        for (const auto& [name, value] : fields[g][k]) {
          b.any = true;
          if (!elementwise(value, piece)) {
            b.other.emplace(name, value);
            continue;
          }
          const auto t = value.value.toTensor();
          auto& flat = b.flat[name];
          if (flat.value.isNone()) flat = {torch::zeros({length[piece.bucket]}, t.options()), value.kind};
          flat.value.toTensor().narrow(0, piece.offset, piece.numel).copy_(t.reshape({-1}));
        }
      }
    }
  }

  // LibTorch's optimizer format (torch/optim/serialize.h): the states keyed
  // by a name per tensor, and each group listing its tensors' names in order.
  auto& first = *saved.front().archive;
  torch::serialize::OutputArchive out;
  torch::serialize::OutputArchive states(out.compilation_unit()), groups(out.compilation_unit());
  torch::serialize::InputArchive saved_groups;
  first.read("param_groups", saved_groups);
  groups.write("param_groups/size", torch::tensor(static_cast<int64_t>(target.groups.size())));
  int64_t name = 0;
  for (std::size_t g = 0; g < target.groups.size(); ++g) {
    torch::serialize::OutputArchive group(out.compilation_unit());
    group.write("params/size", torch::tensor(static_cast<int64_t>(target.groups[g].size())));
    for (std::size_t k = 0; k < target.groups[g].size(); ++k) {
      const auto& piece = target.groups[g][k];
      const std::string key = std::to_string(++name);  // decimal: read as an address by 2.x
      group.write("params/" + std::to_string(k), c10::IValue(key));
      const auto& b = state[piece.bucket];
      if (!b.any) continue;
      torch::serialize::OutputArchive fields(out.compilation_unit());
      for (const auto& [field, value] : b.other) write_value(fields, field, value);
      for (const auto& [field, flat] : b.flat) {
        auto cut = flat.value.toTensor().narrow(0, piece.offset, piece.numel).reshape(piece.shape).clone();
        write_value(fields, field, {std::move(cut), flat.kind});
      }
      states.write(key, fields);
    }
    torch::serialize::InputArchive saved_group, options;
    saved_groups.read("param_groups/" + std::to_string(g), saved_group);
    saved_group.read("options", options);
    torch::serialize::OutputArchive options_copy(out.compilation_unit());
    copy_archive(options, options_copy);
    group.write("options", options_copy);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  // Everything else as the first archive has it (LibTorch's format version,
  // accel's group options).
  for (const auto& key : first.keys())
    if (key != "state" && key != "param_groups") copy_entry(first, out, key);
  out.write("state", states);
  out.write("param_groups", groups);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive result;
  result.load_from(bytes, device);
  return result;
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP
// end <accel/checkpoint/detail/optimizer_relayout.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

/// Keys, shapes and dtypes of a saved model against the module; the error
/// lists every offending key.
inline void check_model(const NamedTensors& loaded, const torch::nn::Module& module,
                        const fs::path& source) {
  check_state_matches(loaded, module_state(module), source.string(), "model", "the prepared model");
}

inline void check_count(const nlohmann::json& meta, const char* key, std::size_t have,
                        const char* what, const fs::path& source) {
  const auto saved = json_field<int64_t>(meta, key, source);
  ACCEL_CHECK(saved == static_cast<int64_t>(have), "accel: the checkpoint '", source.parent_path().string(),
              "' holds ", saved, " ", what, " but this Accelerator has ", have,
              ". Prepare and register the same objects, in the same order, as the run that saved it.");
}

/// Everything one process reads, validated, before anything is applied.
struct ReadState {
  nlohmann::json meta;
  std::vector<NamedTensors> models;
  std::vector<torch::serialize::InputArchive> optimizers, schedulers, custom, comm_hooks;
  std::optional<GeneratorStates> generators;  ///< none: a process the saving run did not have
  std::vector<data::LoaderCheckpoint> loaders;
  std::optional<std::pair<double, int64_t>> scaler;
};

inline ReadState read_state(StateRegistry& reg, const fs::path& dir) {
  auto& comm = *reg.state->comm;
  const int rank = comm.rank();
  const fs::path state_file = dir / kStateFile;
  ReadState s;
  s.meta = read_json(state_file);
  ACCEL_CHECK(s.meta.value(key::format, "") == kStateFormat, "accel: '", state_file.string(),
              "' is not an accel save_state file. Pass a directory written by save_state().");
  ACCEL_CHECK(json_field<int>(s.meta, key::format_version, state_file) <= kStateFormatVersion,
              "accel: '", dir.string(), "' was written by a newer accel (checkpoint format ",
              s.meta[key::format_version].dump(), "). Load it with that version.");
  const auto saved_world = json_field<int64_t>(s.meta, key::world_size, state_file);
  const bool other_world = saved_world != comm.size();
  ACCEL_CHECK(saved_world >= 1, "accel: '", state_file.string(), "' records ", saved_world,
              " processes. Load a directory written by save_state().");
  check_count(s.meta, key::models, reg.models.size(), "models", state_file);
  check_count(s.meta, key::optimizers, reg.optimizers.size(), "optimizers", state_file);
  check_count(s.meta, key::schedulers, reg.schedulers.size(), "schedulers", state_file);
  check_count(s.meta, key::loaders, reg.loaders.size(), "data loaders", state_file);
  check_count(s.meta, key::custom_objects, reg.custom.size(), "registered objects", state_file);
  // Checkpoints from before communication hooks: none.
  const auto hooks = comm_hook_states(reg).size();
  const auto saved_hooks = s.meta.contains(key::comm_hook_states) ? json_field<int64_t>(s.meta, key::comm_hook_states, state_file) : 0;
  ACCEL_CHECK(saved_hooks == static_cast<int64_t>(hooks), "accel: the checkpoint '", dir.string(),
              "' holds the state of ", saved_hooks, " communication hooks (CommHook::PowerSGD) and "
              "this Accelerator's prepared models have ", hooks, ". Resume with the same "
              "AcceleratorOptions::comm_hook as the run that saved it.");
  ACCEL_CHECK(!other_world || hooks == 0, "accel: the checkpoint '", dir.string(), "' was saved by ",
              saved_world, " processes but this run has ", comm.size(), "; CommHook::PowerSGD's error "
              "feedback and Q matrices are per process and cannot be mapped onto another number of "
              "processes. Resume with ", saved_world, " processes.");
  ACCEL_CHECK(json_field<bool>(s.meta, key::loss_scaler, state_file) == (reg.scaler != nullptr),
              "accel: the checkpoint '", dir.string(), "' was saved ",
              reg.scaler ? "without" : "with", " a loss scaler (precision::Fp16) and this "
              "Accelerator runs ", reg.scaler ? "with" : "without",
              " one. Resume with the same precision policy.");
  const bool saved_per_rank = json_field<bool>(s.meta, key::optimizer_per_rank, state_file);
  // Checkpoints from before re-partitioning record only whether the state was per process.
  const bool saved_shards = s.meta.contains(key::shards_optimizer_state)
                                ? json_field<bool>(s.meta, key::shards_optimizer_state, state_file)
                                : saved_per_rank;
  ACCEL_CHECK(saved_shards == reg.shards_optimizer_state && (other_world || saved_per_rank == reg.optimizer_per_rank),
              "accel: the checkpoint '", dir.string(), "' was saved with another shard policy "
              "(optimizer state per process or not). Resume with the same shard policy.");
  if (reg.optimizer_per_rank && saved_per_rank && s.meta.contains(key::partition_bucket_cap_mb)) {
    // Each rank's optimizer file holds its chunks of the gradient buckets.
    const auto cap = json_field<double>(s.meta, key::partition_bucket_cap_mb, state_file);
    ACCEL_CHECK(cap == reg.partition_bucket_cap_mb, "accel: the checkpoint '", dir.string(),
                "' holds sharded optimizer state partitioned by buckets of ", cap,
                " MB, and this run's bucket_cap_mb is ", reg.partition_bucket_cap_mb,
                ", which splits the parameters differently. Resume with "
                "AcceleratorOptions::bucket_cap_mb = ", cap, ".");
  }
  // Another number of processes: the optimizer files whose state each
  // optimizer is cut from now (all processes' files), with their layouts.
  const bool relayout = other_world && reg.shards_optimizer_state;
  std::vector<std::vector<SavedPartition>> sources(reg.optimizers.size());
  if (relayout) {
    const auto saved = s.meta.find(key::partitions);
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
      const bool known = saved != s.meta.end() && saved->is_array() && saved->size() == reg.optimizers.size() &&
                         (*saved)[i].is_object() && i < reg.partitions.size() &&
                         !reg.partitions[i].whole.groups.empty();
      ACCEL_CHECK(known, "accel: the checkpoint '", dir.string(), "' was saved by ", saved_world,
                  " processes but this run has ", comm.size(), ", and it records no buckets for the "
                  "sharded state of optimizer ", i, " (written by an older accel, or an optimizer "
                  "that does not hold exactly one prepared model's trainable parameters), so that "
                  "state cannot be re-partitioned. Resume with ", saved_world, " processes.");
      const auto& whole = reg.partitions[i].whole;
      const auto& entry = (*saved)[i];
      const auto numel = json_field<std::vector<int64_t>>(entry, key::bucket_numel, state_file);
      const auto group = json_field<std::vector<int>>(entry, key::bucket_group, state_file);
      const auto groups = json_field<std::size_t>(entry, key::groups, state_file);
      ACCEL_CHECK(numel == whole.bucket_numel && group == whole.bucket_group && groups == whole.groups.size(),
                  "accel: the checkpoint '", dir.string(), "' holds the sharded state of optimizer ", i,
                  " in ", numel.size(), " buckets of ", c10::IntArrayRef(numel), " elements, and this "
                  "run's model, optimizer parameter groups and bucket_cap_mb make ", whole.bucket_numel.size(),
                  " buckets of ", c10::IntArrayRef(whole.bucket_numel), ". Resume with the same model, "
                  "parameter groups and AcceleratorOptions::bucket_cap_mb as the run that saved it.");
      if (saved_per_rank) {
        for (int r = 0; r < saved_world; ++r)
          sources[i].push_back({nullptr, shard::detail::chunk_layout(numel, group, groups, static_cast<int>(saved_world), r),
                                dir / optimizer_file(i, r, true)});
      } else {
        sources[i].push_back({nullptr, whole, dir / optimizer_file(i, 0, false)});
      }
    }
  }
  // A process the saving run did not have keeps its random generators and
  // continues the data where process 0 stood (mapped below).
  const bool has_own_files = rank < saved_world;
  const std::string loader_positions = loaders_file(has_own_files ? rank : 0);

  // Every missing file at once.
  std::vector<std::string> files;
  if (!other_world) {
    files = main_files(reg);
    for (auto& f : own_files(reg, rank)) files.push_back(std::move(f));
  } else {
    for (auto& f : main_files(reg))
      if (f.rfind("optimizer", 0) != 0) files.push_back(std::move(f));
    for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
      if (!relayout) files.push_back(optimizer_file(i, 0, false));
      for (const auto& src : sources[i]) files.push_back(src.file.filename().string());
    }
    if (has_own_files) files.push_back(random_states_file(rank));
    files.push_back(loader_positions);
  }
  std::vector<std::string> missing;
  std::error_code ec;
  for (const auto& f : files)
    if (!fs::is_regular_file(dir / f, ec)) missing.push_back(f);
  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    const auto skipped = s.meta.find(key::models_skipped);
    const bool skipped_at_save = skipped != s.meta.end() && skipped->is_array() &&
                                 std::find(skipped->begin(), skipped->end(), i) != skipped->end();
    ACCEL_CHECK(!skipped_at_save || reg.models_skipped.count(i), "accel: the checkpoint '", dir.string(),
                "' holds no file for model ", i, ": a save_state pre-hook took it out when it was "
                "written (and saved it its own way). Register a load_state pre-hook that erases "
                "it from the list and loads it the same way.");
  }
  ACCEL_CHECK(missing.empty(), "accel: the checkpoint '", dir.string(), "' lacks ", list(missing),
              other_world ? ". Another number of processes reads every process's optimizer files: put "
                            "the checkpoint where every process can read all of it (a shared file "
                            "system), or resume with the number of processes that saved it."
                          : ". Load a directory written completely by save_state().");

  // The checksums save_state recorded (none in checkpoints written before it recorded them).
  std::optional<Checksums> sums;
  if (const auto it = s.meta.find(key::checksums); it != s.meta.end()) {
    sums.emplace();
    const bool valid = it->is_object() && std::all_of(it->begin(), it->end(), [&](const auto& v) {
      const auto value = v.is_string() ? from_hex(v.template get<std::string>()) : std::nullopt;
      return value.has_value();
    });
    ACCEL_CHECK(valid, "accel: the checkpoint file '", state_file.string(),
                "' has no valid 'xxh64' entry. Load a directory written by save_state().");
    for (auto e = it->begin(); e != it->end(); ++e) (*sums)[e.key()] = *from_hex(e.value().get<std::string>());
  }
  const auto expected = [&](const std::string& name) -> std::optional<std::uint64_t> {
    if (!sums) return std::nullopt;
    const auto it = sums->find(name);
    ACCEL_CHECK(it != sums->end(), "accel: the checkpoint file '", state_file.string(),
                "' records no checksum for '", name, "'. Load a directory written completely by "
                "save_state().");
    return it->second;
  };

  s.models.resize(reg.models.size());
  for (std::size_t i = 0; i < reg.models.size(); ++i) {
    if (reg.models_skipped.count(i)) continue;  // a load_state pre-hook loads it
    const std::string name = model_file(i);
    const fs::path f = dir / name;
    auto contents = read_safetensors(f);  // checks the data against the header's checksum
    if (const auto want = expected(name)) {
      const auto it = contents.metadata.find(std::string(kDataChecksumKey));
      const auto have = it == contents.metadata.end() ? std::nullopt : from_hex(it->second);
      ACCEL_CHECK(have == want, "accel: the checkpoint file '", f.string(),
                  "' is not the file save_state() wrote there (its data checksum is ",
                  have ? to_hex(*have) : std::string("missing"), ", '", kStateFile, "' records ",
                  to_hex(*want), "). Load another checkpoint, or restore this file from a copy.");
    }
    s.models[i] = std::move(contents.tensors);
    check_model(s.models[i], *reg.models[i], f);
  }
  s.optimizers.resize(reg.optimizers.size());
  for (std::size_t i = 0; i < reg.optimizers.size(); ++i) {
    if (!relayout) {
      const std::string name = other_world ? optimizer_file(i, 0, false) : optimizer_file(i, rank, reg.optimizer_per_rank);
      load_archive(s.optimizers[i], dir / name, expected(name), reg.state->device);
      continue;
    }
    std::vector<torch::serialize::InputArchive> saved(sources[i].size());
    for (std::size_t r = 0; r < saved.size(); ++r) {
      const auto name = sources[i][r].file.filename().string();
      load_archive(saved[r], sources[i][r].file, expected(name), reg.state->device);
      sources[i][r].archive = &saved[r];
    }
    s.optimizers[i] = relayout_optimizer(sources[i], reg.partitions[i].held, reg.state->device);
  }
  s.schedulers.resize(reg.schedulers.size());
  for (std::size_t i = 0; i < reg.schedulers.size(); ++i) {
    const std::string name = scheduler_file(i);
    load_archive(s.schedulers[i], dir / name, expected(name));
  }
  s.custom.resize(reg.custom.size());
  for (std::size_t i = 0; i < reg.custom.size(); ++i) {
    const std::string name = custom_file(i);
    load_archive(s.custom[i], dir / name, expected(name));
  }
  s.comm_hooks.resize(hooks);
  for (std::size_t i = 0; i < hooks; ++i) {
    const std::string name = comm_hook_file(i, rank);
    load_archive(s.comm_hooks[i], dir / name, expected(name), reg.state->device);
  }
  if (has_own_files) {
    const fs::path f = dir / random_states_file(rank);
    torch::serialize::InputArchive rng;
    load_archive(rng, f, expected(random_states_file(rank)));
    s.generators = GeneratorStates::read(rng, f);
  }
  {
    const fs::path f = dir / loader_positions;
    const auto j = read_json(f, expected(loader_positions));
    const auto list_j = j.find(key::loaders);
    ACCEL_CHECK(list_j != j.end() && list_j->is_array() && list_j->size() == reg.loaders.size(),
                "accel: the checkpoint file '", f.string(), "' does not hold ", reg.loaders.size(),
                " loader positions. Load a directory written completely by save_state().");
    for (const auto& l : *list_j) {
      data::LoaderCheckpoint c{json_field<int64_t>(l, key::epoch, f), json_field<int64_t>(l, key::batches_yielded, f)};
      ACCEL_CHECK(c.batches_yielded >= 0 && c.epoch >= 0, "accel: the checkpoint file '", f.string(),
                  "' holds a negative loader position. Save the checkpoint again.");
      if (other_world && c.batches_yielded > 0) {
        // The same samples, in whole steps of this run (the epoch's order
        // does not depend on the number of processes).
        const std::size_t index = s.loaders.size();
        const auto saved_step = l.contains(key::samples_per_step) ? json_field<int64_t>(l, key::samples_per_step, f) : 0;
        const auto step = reg.loaders[index].samples_per_step();
        const auto samples = c.batches_yielded * saved_step;
        ACCEL_CHECK(saved_step > 0, "accel: the checkpoint '", dir.string(), "' was saved by ", saved_world,
                    " processes but this run has ", comm.size(), ", and it does not record how many "
                    "samples a step of data loader ", index, " took (written by an older accel). "
                    "Resume with ", saved_world, " processes.");
        ACCEL_CHECK(samples % step == 0, "accel: the checkpoint '", dir.string(), "' was saved by ",
                    saved_world, " processes after ", c.batches_yielded, " steps of ", saved_step,
                    " samples of data loader ", index, " in epoch ", c.epoch, " (", samples,
                    " samples); this run takes ", step, " samples per step (", comm.size(),
                    " processes), and ", samples, " samples are not a whole number of its steps, so "
                    "the epoch cannot be continued exactly. Use a batch size with which ", samples,
                    " samples are whole steps, or resume with ", saved_world, " processes.");
        c.batches_yielded = samples / step;
      }
      s.loaders.push_back(c);
    }
  }
  if (reg.scaler) {
    const fs::path f = dir / kScalerFile;
    const auto j = read_json(f, expected(kScalerFile));
    s.scaler.emplace(json_field<double>(j, key::scale, f), json_field<int64_t>(j, key::growth_tracker, f));
    ACCEL_CHECK(s.scaler->first > 0 && s.scaler->second >= 0, "accel: '", f.string(),
                "' holds an invalid loss scale. Save the checkpoint again.");
  }
  json_field<int64_t>(s.meta, key::micro_step, state_file);
  json_field<int64_t>(s.meta, key::optimizer_steps, state_file);
  return s;
}

/// Loads archives into objects; on failure puts back the objects already
/// loaded (from in-memory snapshots) and rethrows.
class ArchiveTransaction {
 public:
  void apply(const Archived& target, torch::serialize::InputArchive& in, const char* what,
             std::size_t index) {
    if (target.snapshot) {
      done_.push_back(target.snapshot());
    } else {
      torch::serialize::OutputArchive snap;
      target.save(snap);
      std::ostringstream out;
      snap.save_to(out);
      done_.push_back([&target, bytes = out.str()] {
        std::istringstream in_bytes(bytes);
        torch::serialize::InputArchive in;
        in.load_from(in_bytes);
        target.load(in);
      });
    }
    try {
      target.load(in);
    } catch (const std::exception& e) {
      const std::string msg = e.what();
      rollback();
      throw Error(accel::detail::concat("accel: cannot restore ", what, " ", index,
                                        " from the checkpoint (", msg,
                                        "); nothing was loaded. Prepare the same objects as the "
                                        "run that saved it."));
    }
  }
  void rollback() noexcept {
    for (auto it = done_.rbegin(); it != done_.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {  // best effort: the snapshot was taken from this very object
      }
    }
    done_.clear();
  }

 private:
  std::vector<std::function<void()>> done_;  ///< restores, in the order applied
};

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_STATE_READER_HPP
// end <accel/checkpoint/detail/state_reader.hpp>
// begin <accel/checkpoint/save_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::save_state/load_state, the machinery of
/// Accelerator::save_state()/load_state(): the whole training state in one
/// directory, written atomically by every process, read back exactly.
///
/// Directory layout (docs/checkpoints.md has the details):
///
///   accel_state.json          main   format, accel version, world size, step
///                                    counters, how many of each kind, automatic
///                                    checkpoint number, the XXH64 of every other
///                                    file ("xxh64"); written last
///   model.safetensors         main   prepared model 0 (model_1.safetensors, ...)
///   optimizer.pt              main   optimizer 0, torch archive (optimizer_1.pt, ...;
///                                    optimizer_rank<r>.pt per process when the
///                                    shard policy partitions optimizer state)
///   scheduler.pt              main   scheduler 0 (scheduler_1.pt, ...)
///   custom_checkpoint_<i>.pt  main   objects given to register_for_checkpointing
///   scaler.json               main   loss scale and growth tracker (Fp16 only)
///   random_states_<r>.pt      each   CPU, CUDA and accel::std_generator() states
///   loaders_<r>.json          each   epoch and batches yielded of every prepared loader
///   comm_hook_rank<r>.pt      each   CommHook::PowerSGD's step, errors and Qs
///                                    (comm_hook_1_rank<r>.pt, ...: one per model)
///
/// Atomicity: everything goes to <dir>.accel-tmp first (each file fsynced),
/// the processes agree that all files are in, then the main process renames
/// the directory into place (see detail::commit_directory). A process killed
/// at any point leaves the previous checkpoint complete and loadable.
/// Loading checks every file's checksum and validates it on every process,
/// and the processes agree, before anything is changed; objects restored through torch archives are
/// rolled back if one of them still fails.
#ifndef ACCEL_CHECKPOINT_SAVE_STATE_HPP
#define ACCEL_CHECKPOINT_SAVE_STATE_HPP


#include <exception>
#include <filesystem>
#include <optional>
#include <string>

namespace accel::ckpt {

/// Writes the registry's state to dir, or (no dir) to
/// project_dir/checkpoints/checkpoint_<N> keeping at most options.total_limit
/// of those. Every process must call it. Returns the directory written.
inline std::filesystem::path save_state(StateRegistry& reg, const AcceleratorOptions& options,
                                        std::optional<std::filesystem::path> dir = {}) {
  using namespace detail;
  auto& comm = *reg.state->comm;
  const int rank = comm.rank();
  const bool main = rank == 0;
  const bool automatic = !dir.has_value();
  // Accelerate ignores the directory given when automatic naming is on.
  ACCEL_CHECK(automatic || !options.automatic_checkpoint_naming,
              "accel: AcceleratorOptions::automatic_checkpoint_naming is on, so save_state() "
              "writes project_dir/checkpoints/checkpoint_<N>, not '", dir->string(),
              "'. Call save_state() without a directory, or turn automatic naming off.");
  fs::path base;
  fs::path target;
  if (automatic) {
    base = checkpoints_base(options, "save_state");
    ACCEL_CHECK(!options.total_limit || *options.total_limit >= 1,
                "accel: AcceleratorOptions::total_limit must be at least 1 (got ",
                options.total_limit.value_or(0), "). Leave it unset to keep every checkpoint.");
    target = base / checkpoint_dir_name(reg.checkpoint_iteration);
  } else {
    target = normal_dir(*dir);
  }
  const fs::path stage = target.string() + ".accel-tmp";
  reg.state->finalize_gradients();
  // The scale the next backward would use (an update an iteration left
  // pending), so a resumed run scales its first loss as this run does.
  reg.state->settle_loss_scale();

  std::exception_ptr err;
  if (main) {
    try {
      std::error_code ec;
      if (automatic) {
        // Accelerate's #1601/#3306: a run that did not load numbers from 0
        // again. Refuse anything but a new newest checkpoint.
        const auto all = list_checkpoints(base);
        ACCEL_CHECK(all.empty() || all.back().first < reg.checkpoint_iteration, "accel: '",
                    base.string(), "' already holds checkpoint_", all.empty() ? 0 : all.back().first,
                    ", so checkpoint_", reg.checkpoint_iteration,
                    " would not be the newest. Call load_state() first to continue the numbering "
                    "of an earlier run, or use another project_dir.");
      }
      fs::remove_all(stage, ec);  // left by a killed save
      fs::create_directories(stage, ec);
      if (ec || !fs::is_directory(stage))
        throw Error("accel: cannot create the checkpoint directory '" + stage.string() + "': " +
                    ec.message() + ". Pass a directory that can be written.");
    } catch (...) {
      err = std::current_exception();
    }
  }
  agree(*reg.state->comm, err, "save_state (creating the directory)", kSaveKept);

  // A failed save leaves nothing behind: the previous checkpoint, untouched.
  const auto remove_stage = [&] {
    std::error_code ec;
    if (main) fs::remove_all(stage, ec);
  };
  Checksums sums;
  const SkippedModels skipped(reg);
  try {
    reg.models_skipped = reg.save_pre_hooks.run(reg.models, stage, "save_state");
    sums = write_process_files(reg, stage, rank);
  } catch (...) {
    err = std::current_exception();
  }
  try {
    agree(*reg.state->comm, err, "save_state (writing the files)", kSaveKept);
  } catch (...) {
    remove_stage();
    throw;
  }
  sums = gather_checksums(reg, std::move(sums));

  if (main) {
    try {
      nlohmann::json meta = {
          {key::format, std::string(kStateFormat)},
          {key::format_version, kStateFormatVersion},
          {key::accel_version, version_string},
          {key::world_size, comm.size()},
          {key::micro_step, reg.state->micro_step},
          {key::optimizer_steps, reg.state->optimizer_steps},
          {key::checkpoint_iteration, automatic ? nlohmann::json(reg.checkpoint_iteration) : nlohmann::json()},
          {key::models, reg.models.size()},
          {key::models_skipped, reg.models_skipped},
          {key::optimizers, reg.optimizers.size()},
          {key::optimizer_per_rank, reg.optimizer_per_rank},
          {key::partition_bucket_cap_mb, reg.partition_bucket_cap_mb},
          {key::shards_optimizer_state, reg.shards_optimizer_state},
          {key::partitions, partitions_json(reg)},
          {key::schedulers, reg.schedulers.size()},
          {key::loaders, reg.loaders.size()},
          {key::custom_objects, reg.custom.size()},
          {key::comm_hook_states, comm_hook_states(reg).size()},
          {key::loss_scaler, reg.scaler != nullptr},
          {key::checksums, checksums_json(sums)}};
      write_json(stage / kStateFile, meta);
      fsync_path(stage, true);
      crash_point("before_commit");
      commit_directory(stage, target);
      if (automatic && options.total_limit) {
        auto all = list_checkpoints(base);
        std::error_code ec;
        for (std::size_t i = 0; i + static_cast<std::size_t>(*options.total_limit) < all.size(); ++i)
          fs::remove_all(all[i].second, ec);
      }
    } catch (...) {
      err = std::current_exception();
      remove_stage();
    }
  }
  agree(*reg.state->comm, err, "save_state (committing the directory)", kSaveKept);
  if (automatic) ++reg.checkpoint_iteration;
  return target;
}

namespace detail {

/// load_state's second half: puts what read_state() read (and every process
/// agreed is valid) into the registry's objects. Archive loads that still
/// fail are rolled back on every process, which then all throw.
inline void apply_state(StateRegistry& reg, ReadState& s) {
  std::exception_ptr err;
  const auto optimizers = optimizer_states(reg);  // these outlive tx, which refers to them
  const auto hooks = comm_hook_states(reg);
  ArchiveTransaction tx;
  try {
    for (std::size_t i = 0; i < optimizers.size(); ++i)
      tx.apply(optimizers[i], s.optimizers[i], "optimizer", i);
    for (std::size_t i = 0; i < reg.schedulers.size(); ++i)
      tx.apply(reg.schedulers[i], s.schedulers[i], "scheduler", i);
    for (std::size_t i = 0; i < reg.custom.size(); ++i)
      tx.apply(reg.custom[i], s.custom[i], "registered object", i);
    for (std::size_t i = 0; i < hooks.size(); ++i)
      tx.apply(hooks[i], s.comm_hooks[i], "communication hook", i);
  } catch (...) {
    err = std::current_exception();
  }
  if (failed_rank(*reg.state->comm, err == nullptr) >= 0) {
    tx.rollback();
    agree(*reg.state->comm, err, "load_state (restoring optimizers, schedulers and registered objects)",
          kLoadKept);
  }

  // Validated above: nothing below can fail.
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < reg.models.size(); ++i) {
      if (reg.models_skipped.count(i)) continue;
      std::map<std::string, torch::Tensor> by_name(s.models[i].begin(), s.models[i].end());
      for (auto& [key, t] : module_state(*reg.models[i])) {
        torch::Tensor target_tensor = t;
        target_tensor.copy_(by_name.at(key));
      }
    }
  }
  if (reg.scaler) reg.scaler->load(s.scaler->first, s.scaler->second);
  if (s.generators) s.generators->apply();
  reg.state->micro_step = s.meta.at(key::micro_step).get<int64_t>();
  reg.state->optimizer_steps = s.meta.at(key::optimizer_steps).get<int64_t>();
  for (auto& seen : reg.scheduler_seen_steps) *seen = reg.state->optimizer_steps;
  for (std::size_t i = 0; i < reg.loaders.size(); ++i) reg.loaders[i].restore(s.loaders[i]);
}

}  // namespace detail

/// Restores the registry's state from dir, or (no dir) from the newest
/// project_dir/checkpoints/checkpoint_<N>, whose N+1 becomes the next
/// automatic number. Every process must call it. A bad checkpoint throws
/// accel::Error on every process and changes nothing. Returns the directory read.
inline std::filesystem::path load_state(StateRegistry& reg, const AcceleratorOptions& options,
                                        std::optional<std::filesystem::path> dir = {}) {
  using namespace detail;
  fs::path target;
  std::optional<int64_t> number;
  std::exception_ptr err;
  ReadState s;
  const SkippedModels skipped(reg);
  try {
    if (dir) {
      target = normal_dir(*dir);
    } else {
      const fs::path base = checkpoints_base(options, "load_state");
      const auto all = list_checkpoints(base);
      ACCEL_CHECK(!all.empty(), "accel: load_state() found no checkpoint_<N> directory in '",
                  base.string(), "'. Save one with save_state() first, or pass a directory.");
      target = all.back().second;
      number = all.back().first;
    }
    const auto readable = readable_checkpoint(target);
    reg.models_skipped = reg.load_pre_hooks.run(reg.models, readable, "load_state");
    s = read_state(reg, readable);
  } catch (...) {
    err = std::current_exception();
  }
  agree(*reg.state->comm, err, "load_state (reading the checkpoint)", kLoadKept);
  apply_state(reg, s);
  if (number) {
    reg.checkpoint_iteration = *number + 1;
  } else if (const auto it = s.meta.find(key::checkpoint_iteration);
             it != s.meta.end() && it->is_number_integer()) {
    reg.checkpoint_iteration = it->get<int64_t>() + 1;
  }
  return target;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAVE_STATE_HPP
// end <accel/checkpoint/save_state.hpp>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

namespace accel::ckpt {

namespace detail {

/// The main process's numbers, the same on every process (a file system whose
/// listing differs between processes must not make them read different
/// checkpoints and disagree in the middle of a collective).
inline std::vector<int64_t> share_numbers(StateRegistry& reg, std::vector<int64_t> numbers) {
  auto& comm = *reg.state->comm;
  if (comm.size() == 1) return numbers;
  const auto opts = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto count = torch::full({1}, static_cast<int64_t>(numbers.size()), opts);
  comm.broadcast(count, 0)->wait();
  const auto n = count.to(torch::kCPU).item<int64_t>();
  auto values = comm.rank() == 0 ? torch::tensor(numbers, opts) : torch::zeros({n}, opts);
  if (n > 0) comm.broadcast(values, 0)->wait();
  values = values.to(torch::kCPU);
  return std::vector<int64_t>(values.data_ptr<int64_t>(), values.data_ptr<int64_t>() + n);
}

}  // namespace detail

/// Loads the newest complete checkpoint under project_dir/checkpoints (see
/// the file comment) and returns its directory; without one, changes nothing
/// and returns std::nullopt. Either way the next automatic checkpoint number
/// is past every checkpoint_<N> there, complete or not. When checkpoints exist
/// but none loads, the newest one's error is thrown on every process. Every
/// process must call it.
inline std::optional<std::filesystem::path> load_latest_state(StateRegistry& reg,
                                                              const AcceleratorOptions& options) {
  using namespace detail;
  const fs::path base = checkpoints_base(options, "load_latest_state");
  const bool main = reg.state->comm->rank() == 0;
  // [highest N of any checkpoint_<N>, then the complete-looking ones, newest first]
  std::vector<int64_t> numbers{-1};
  if (main) {
    const auto all = list_checkpoints(base);
    std::error_code ec;
    for (auto it = all.rbegin(); it != all.rend(); ++it)
      if (fs::is_regular_file(it->second / kStateFile, ec)) numbers.push_back(it->first);
    if (!all.empty()) numbers[0] = all.back().first;
  }
  numbers = share_numbers(reg, std::move(numbers));
  const auto after_highest = [&] {
    reg.checkpoint_iteration = std::max(reg.checkpoint_iteration, numbers.front() + 1);
  };

  std::exception_ptr newest_error;
  for (std::size_t i = 1; i < numbers.size(); ++i) {
    const fs::path dir = base / checkpoint_dir_name(numbers[i]);
    std::exception_ptr err;
    ReadState s;
    const SkippedModels skipped(reg);
    try {
      reg.models_skipped = reg.load_pre_hooks.run(reg.models, dir, "load_state");
      s = read_state(reg, dir);
    } catch (...) {
      err = std::current_exception();
    }
    const int failed = failed_rank(*reg.state->comm, err == nullptr);
    if (failed < 0) {
      apply_state(reg, s);
      after_highest();
      return dir;
    }
    if (i == 1) newest_error = err;
    if (failed == reg.state->comm->rank()) {
      std::string why = "unknown error";
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& e) {
        why = e.what();
      } catch (...) {
      }
      std::cerr << "accel: warning: load_latest_state() skips '" << dir.string()
                << "', which process " << failed << " cannot load: " << why
                << (i + 1 < numbers.size() ? " Trying the next older checkpoint."
                                           : " No older checkpoint is left.")
                << std::endl;
    }
  }
  if (numbers.size() > 1)
    agree(*reg.state->comm, newest_error, "load_latest_state (reading the newest checkpoint)",
          "no checkpoint under it loads; nothing was loaded on this process");
  after_highest();
  return std::nullopt;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_LATEST_STATE_HPP
// end <accel/checkpoint/latest_state.hpp>
// begin <accel/checkpoint/state_io.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StateIo, what Accelerator's save_state(),
/// load_state(), load_latest_state() and save_model() call. accelerator.hpp
/// only declares it: a translation unit compiles the checkpoint writer and
/// reader when it includes this header (through checkpoint.hpp or accel.hpp).
#ifndef ACCEL_CHECKPOINT_STATE_IO_HPP
#define ACCEL_CHECKPOINT_STATE_IO_HPP

#include <exception>
#include <filesystem>
#include <optional>
#include <utility>

#include <torch/torch.h>


namespace accel::ckpt {

struct StateIo {
  static std::filesystem::path save_state(StateRegistry& reg, const AcceleratorOptions& options,
                                          std::optional<std::filesystem::path> dir) {
    return ckpt::save_state(reg, options, std::move(dir));
  }
  static std::filesystem::path load_state(StateRegistry& reg, const AcceleratorOptions& options,
                                          std::optional<std::filesystem::path> dir) {
    return ckpt::load_state(reg, options, std::move(dir));
  }
  static std::optional<std::filesystem::path> load_latest_state(StateRegistry& reg,
                                                                const AcceleratorOptions& options) {
    return ckpt::load_latest_state(reg, options);
  }
  /// The main process writes; every process makes the model's tensors
  /// readable in the writer's order, and all throw the same error.
  static void save_model(runtime::Communicator& comm, const torch::nn::Module& module,
                         const std::filesystem::path& dir, const SaveModelOptions& options,
                         bool main, const BeforeRead& make_readable) {
    const auto err = save_module_collectively(module, dir, options, main, make_readable);
    detail::agree(comm, err, "save_model", "the main process writes the files, this one wrote none");
  }
};

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_STATE_IO_HPP
// end <accel/checkpoint/state_io.hpp>

#endif  // ACCEL_CHECKPOINT_HPP
// end <accel/checkpoint.hpp>
// begin <accel/memory.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the memory area: activation checkpointing
/// (accel::checkpoint, accel::checkpoint_sequential).
#ifndef ACCEL_MEMORY_HPP
#define ACCEL_MEMORY_HPP

// begin <accel/memory/checkpoint.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::checkpoint and accel::checkpoint_sequential: activation
/// checkpointing (torch.utils.checkpoint for LibTorch). The forward of a
/// segment keeps none of its intermediate tensors; backward runs the segment
/// again with gradients enabled and back-propagates through that copy.
#ifndef ACCEL_MEMORY_CHECKPOINT_HPP
#define ACCEL_MEMORY_CHECKPOINT_HPP

#include <array>
#include <cstddef>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/custom_function.h>
#include <torch/torch.h>

// begin <accel/memory/detail/replay_state.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::memory::detail::ForwardState: what a checkpointed
/// forward saw (random generators, autocast) so that its recomputation in
/// backward draws the same numbers and computes in the same precision.
#ifndef ACCEL_MEMORY_DETAIL_REPLAY_STATE_HPP
#define ACCEL_MEMORY_DETAIL_REPLAY_STATE_HPP

#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/torch.h>


namespace accel::memory::detail {

/// The state of the default generators a segment may draw from: the CPU one
/// always, and the CUDA one of each device its tensor inputs live on (as
/// torch.utils.checkpoint does; other devices' generators are not forked).
class RngState {
  struct Entry {
    c10::Device device;
    torch::Tensor state;
  };

 public:
  static RngState capture(const std::vector<torch::Tensor>& inputs) {
    RngState s;
    s.entries_.push_back({c10::Device(c10::kCPU), get(c10::Device(c10::kCPU))});
    for (const auto& t : inputs) {
      if (!t.defined() || !t.is_cuda()) continue;
      bool seen = false;
      for (const auto& e : s.entries_) seen = seen || e.device == t.device();
      if (!seen) s.entries_.push_back({t.device(), get(t.device())});
    }
    return s;
  }

  /// RAII: the generators are set to this state for its lifetime, and given
  /// back the state they had before after it, so a recomputation neither
  /// changes what the rest of the program draws nor depends on it.
  class Fork {
   public:
    explicit Fork(const RngState& s) {
      for (const auto& e : s.entries_) previous_.push_back({e.device, get(e.device)});
      for (const auto& e : s.entries_) set(e.device, e.state);
    }
    ~Fork() {
      for (const auto& e : previous_) set(e.device, e.state);
    }
    Fork(const Fork&) = delete;
    Fork& operator=(const Fork&) = delete;

   private:
    std::vector<Entry> previous_;
  };

 private:
  // The generator's mutex is held only while reading or writing its state:
  // the operators of the segment take it themselves.
  static torch::Tensor get(c10::Device d) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    return gen.get_state();
  }
  static void set(c10::Device d, const torch::Tensor& state) {
    auto gen = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }

  std::vector<Entry> entries_;
};

/// Autocast as the forward had it, for CPU and CUDA.
class AutocastState {
  struct PerDevice {
    c10::DeviceType type;
    bool enabled;
    at::ScalarType dtype;
  };

 public:
  static AutocastState capture() {
    AutocastState s;
    for (auto d : {c10::DeviceType::CPU, c10::DeviceType::CUDA})
      s.devices_.push_back({d, precision::AutocastGuard::is_enabled(d),
                            precision::AutocastGuard::dtype_of(d)});
    return s;
  }

  /// RAII: autocast exactly as captured (on with its dtype, or off) for its
  /// lifetime, whatever the thread running backward has; restored after.
  class Replay {
   public:
    explicit Replay(const AutocastState& s) {
      guards_.reserve(s.devices_.size());
      for (const auto& d : s.devices_) {
        if (d.enabled) {
          guards_.emplace_back(d.type, d.dtype, true);
        } else if (precision::AutocastGuard::is_enabled(d.type)) {
          disabled_.push_back({d.type, true, precision::AutocastGuard::dtype_of(d.type)});
          precision::AutocastGuard::set(d.type, false, d.dtype);
        }
      }
    }
    ~Replay() {
      for (const auto& d : disabled_) precision::AutocastGuard::set(d.type, true, d.dtype);
    }
    Replay(const Replay&) = delete;
    Replay& operator=(const Replay&) = delete;

   private:
    std::vector<precision::AutocastGuard> guards_;
    std::vector<PerDevice> disabled_;
  };

  bool any_enabled() const {
    for (const auto& d : devices_)
      if (d.enabled) return true;
    return false;
  }

 private:
  std::vector<PerDevice> devices_;
};

/// RAII: no autocast cache while the forward runs without gradients. Casts
/// cached there would have no autograd history, and a later use of the same
/// weight outside the checkpoint (in the same autocast region) would silently
/// get no gradient through them.
class NoAutocastCache {
 public:
  NoAutocastCache() : previous_(at::autocast::is_autocast_cache_enabled()) {
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~NoAutocastCache() { at::autocast::set_autocast_cache_enabled(previous_); }
  NoAutocastCache(const NoAutocastCache&) = delete;
  NoAutocastCache& operator=(const NoAutocastCache&) = delete;

 private:
  bool previous_;
};

}  // namespace accel::memory::detail

#endif  // ACCEL_MEMORY_DETAIL_REPLAY_STATE_HPP
// end <accel/memory/detail/replay_state.hpp>

namespace accel::memory::detail {

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::remove_cvref_t<T>, torch::Tensor>;

/// What a segment may return: a Tensor, a std::tuple of Tensors or a
/// std::vector of them; flattened to a list for autograd and back.
template <class R>
struct Outputs {
  static constexpr bool valid = false;
};
template <>
struct Outputs<torch::Tensor> {
  static constexpr bool valid = true;
  static std::vector<torch::Tensor> flatten(torch::Tensor t) { return {std::move(t)}; }
  static torch::Tensor unflatten(std::vector<torch::Tensor> v) { return std::move(v.at(0)); }
};
template <>
struct Outputs<std::vector<torch::Tensor>> {
  static constexpr bool valid = true;
  static std::vector<torch::Tensor> flatten(std::vector<torch::Tensor> v) { return v; }
  static std::vector<torch::Tensor> unflatten(std::vector<torch::Tensor> v) { return v; }
};
template <class... T>
struct Outputs<std::tuple<T...>> {
  static constexpr bool valid = (std::is_same_v<T, torch::Tensor> && ...);
  static std::vector<torch::Tensor> flatten(std::tuple<T...> t) {
    return std::apply([](auto&... e) { return std::vector<torch::Tensor>{std::move(e)...}; }, t);
  }
  static std::tuple<T...> unflatten(std::vector<torch::Tensor> v) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return std::tuple<T...>{std::move(v.at(I))...};
    }(std::index_sequence_for<T...>{});
  }
};

/// One checkpointed call, type-erased: the function, its non-tensor
/// arguments (stored by value: they must be the same when backward runs it
/// again) and the state of the forward. Held by the autograd node.
struct Segment : torch::CustomClassHolder {
  virtual std::vector<torch::Tensor> run(const std::vector<torch::Tensor>& tensors) = 0;
  bool needs_backward = true;  ///< false when autograd will not record the call
  RngState rng;
  AutocastState autocast;
};

/// How fn sees argument A: tensors as const references to the tensors of
/// this run, anything else as a reference to the stored copy.
template <class A>
using arg_ref_t = std::conditional_t<is_tensor_v<A>, const torch::Tensor&, std::remove_cvref_t<A>&>;

template <class F, class... Args>
class SegmentOf final : public Segment {
 public:
  using result_type = std::remove_cvref_t<std::invoke_result_t<F&, arg_ref_t<Args>...>>;

  template <class G, class... A>
  explicit SegmentOf(G&& fn, A&&... args)
      : fn_(std::forward<G>(fn)), args_(keep(std::forward<A>(args))...) {}

  std::vector<torch::Tensor> run(const std::vector<torch::Tensor>& tensors) override {
    return Outputs<result_type>::flatten(call(tensors, std::index_sequence_for<Args...>{}));
  }

 private:
  // Tensor arguments are not stored (autograd saves them); their slots stay empty.
  template <class A>
  static std::remove_cvref_t<A> keep(A&& a) {
    if constexpr (is_tensor_v<A>)
      return torch::Tensor();
    else
      return std::forward<A>(a);
  }

  // Position of argument I among the tensor arguments.
  template <std::size_t I>
  static constexpr std::size_t tensor_index() {
    constexpr bool is_tensor[] = {is_tensor_v<Args>..., false};
    std::size_t n = 0;
    for (std::size_t j = 0; j < I; ++j) n += is_tensor[j] ? 1 : 0;
    return n;
  }

  template <std::size_t... I>
  result_type call(const std::vector<torch::Tensor>& tensors, std::index_sequence<I...>) {
    return std::invoke(fn_, pick<I>(tensors)...);
  }
  template <std::size_t I>
  arg_ref_t<std::tuple_element_t<I, std::tuple<Args...>>> pick(const std::vector<torch::Tensor>& tensors) {
    if constexpr (is_tensor_v<std::tuple_element_t<I, std::tuple<Args...>>>)
      return tensors.at(tensor_index<I>());
    else
      return std::get<I>(args_);
  }

  F fn_;
  std::tuple<std::remove_cvref_t<Args>...> args_;
};

/// The autograd node of one checkpointed call: forward without gradients
/// (autograd saves only the tensor inputs), backward recomputes with them.
struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static constexpr const char* kSegmentKey = "accel.checkpoint.segment";

  template <class... T>
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<Segment> segment,
                                                const torch::Tensor& /*anchor*/,
                                                const T&... tensors) {
    std::vector<torch::Tensor> inputs{tensors...};
    if (segment->needs_backward) {
      segment->rng = RngState::capture(inputs);
      segment->autocast = AutocastState::capture();
    }
    std::vector<torch::Tensor> outputs;
    {
      torch::NoGradGuard no_grad;
      NoAutocastCache no_cache;
      outputs = segment->run(inputs);
    }
    torch::autograd::variable_list constant;
    for (const auto& o : outputs) {
      ACCEL_CHECK(o.defined(), "accel: checkpoint()'s function returned an undefined tensor. "
                  "Return only defined tensors from a checkpointed function.");
      if (!o.is_floating_point() && !o.is_complex()) constant.push_back(o);
    }
    if (!constant.empty()) ctx->mark_non_differentiable(constant);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward(inputs);
    ctx->saved_data[kSegmentKey] = c10::IValue::make_capsule(std::move(segment));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto segment =
        c10::static_intrusive_pointer_cast<Segment>(ctx->saved_data.at(kSegmentKey).toCapsule());
    // Leaves of a graph of their own, requiring gradients like the originals.
    std::vector<torch::Tensor> inputs;
    for (const auto& saved : ctx->get_saved_variables()) {
      auto d = saved.detach();
      if (saved.requires_grad()) d.requires_grad_(true);
      inputs.push_back(std::move(d));
    }
    std::vector<torch::Tensor> outputs;
    {
      RngState::Fork rng(segment->rng);
      AutocastState::Replay autocast(segment->autocast);
      torch::AutoGradMode grad(true);
      outputs = segment->run(inputs);
    }
    ACCEL_CHECK(outputs.size() == grad_outputs.size(), "accel: checkpoint()'s function returned ",
                outputs.size(), " tensors when recomputed in backward, ", grad_outputs.size(),
                " in forward. Make the checkpointed function return the same tensors every time.");
    torch::autograd::variable_list roots, grads;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined()) continue;
      if (!outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      grads.push_back(grad_outputs[i]);
    }
    // Parameters get their gradients from here, through their accumulators
    // (and a prepared model's gradient hooks, once per parameter).
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    torch::autograd::variable_list result{torch::Tensor(), torch::Tensor()};  // segment, anchor
    for (const auto& in : inputs) result.push_back(in.requires_grad() ? in.grad() : torch::Tensor());
    return result;
  }
};

}  // namespace accel::memory::detail

namespace accel {

/// Activation checkpointing: calls fn(inputs...) without keeping the tensors
/// it computes in between, and calls it again during backward to get them
/// (torch.utils.checkpoint, reentrant variant). Trades one more forward of
/// fn for the memory of its activations.
///
/// fn returns a torch::Tensor, a std::tuple of tensors or a
/// std::vector<torch::Tensor>; checkpoint() returns the same. Tensor
/// arguments are the inputs autograd tracks; any other argument is copied
/// and given to fn again, unchanged, in backward. Parameters fn uses (a
/// module it captures) get their gradients as without checkpointing. The
/// recomputation draws the same random numbers (CPU generator, and the CUDA
/// generators of the inputs' devices) and runs under the autocast state of
/// the forward, so dropout and mixed precision give the same results.
///
/// Restrictions: gradients come from loss.backward() (not torch::autograd::grad,
/// not create_graph); fn must not modify its inputs in place, nor depend
/// on state that changes between forward and backward.
template <class F, class... Args>
auto checkpoint(F&& fn, Args&&... inputs) {
  using segment_type = memory::detail::SegmentOf<std::decay_t<F>, Args...>;
  using result_type = typename segment_type::result_type;
  static_assert(memory::detail::Outputs<result_type>::valid,
                "accel: checkpoint()'s function must return a torch::Tensor, a std::tuple of "
                "tensors or a std::vector<torch::Tensor>. Return the tensors only.");
  static_assert((!std::is_same_v<std::remove_cvref_t<Args>, std::vector<torch::Tensor>> && ...),
                "accel: checkpoint() does not look into a std::vector<torch::Tensor> argument, "
                "so its tensors would get no gradient. Pass each tensor as an argument of its own.");
  // The tensor arguments, collected before the others are moved into the segment.
  constexpr std::size_t n = (std::size_t{0} + ... + (memory::detail::is_tensor_v<Args> ? 1 : 0));
  std::array<torch::Tensor, n> tensors;
  std::size_t k = 0;
  auto collect = [&](const auto& a) {
    if constexpr (memory::detail::is_tensor_v<decltype(a)>) tensors[k++] = a;
  };
  (collect(inputs), ...);
  // When no input requires a gradient (the first layer, fed with data), the
  // parameters fn uses still need one: an empty tensor that requires a
  // gradient makes autograd record the call.
  bool any_requires_grad = false;
  for (const auto& t : tensors) {
    ACCEL_CHECK(t.defined(), "accel: checkpoint() got an undefined tensor argument. Pass defined "
                "tensors only; let fn capture an optional one.");
    any_requires_grad = any_requires_grad || t.requires_grad();
  }
  const bool anchor = torch::GradMode::is_enabled() && !any_requires_grad;
  c10::intrusive_ptr<memory::detail::Segment> segment =
      c10::make_intrusive<segment_type>(std::forward<F>(fn), std::forward<Args>(inputs)...);
  segment->needs_backward = torch::GradMode::is_enabled();
  auto outputs = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return memory::detail::CheckpointFunction::apply(
        segment, anchor ? torch::empty({0}, torch::requires_grad()) : torch::empty({0}), tensors[I]...);
  }(std::make_index_sequence<n>{});
  return memory::detail::Outputs<result_type>::unflatten(std::move(outputs));
}

/// Runs input through the children of seq in order, each one under
/// checkpoint(): backward keeps only what enters each child.
inline torch::Tensor checkpoint_sequential(const torch::nn::Sequential& seq, torch::Tensor input) {
  for (const auto& child : *seq) {
    // A copy of the AnyModule shares the module: backward calls the same one.
    input = checkpoint([m = child](const torch::Tensor& x) mutable { return m.forward(x); },
                       std::move(input));
  }
  return input;
}

}  // namespace accel

#endif  // ACCEL_MEMORY_CHECKPOINT_HPP
// end <accel/memory/checkpoint.hpp>

#endif  // ACCEL_MEMORY_HPP
// end <accel/memory.hpp>
// begin <accel/profiling.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the profiling area: the Chrome trace that
/// Accelerator::profile returns, merge_traces, and accel's own events in it.
#ifndef ACCEL_PROFILING_HPP
#define ACCEL_PROFILING_HPP

// begin <accel/profiling/trace.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::profiling::Trace, what Accelerator::profile returns:
/// LibTorch's operators and accel's own events (profiling::Events) on this
/// process, recorded while it lives and written
/// as a Chrome trace (trace_dir/trace_rank<r>.json); merge_traces puts the
/// ranks' files into one trace with a track per rank.
#ifndef ACCEL_PROFILING_TRACE_HPP
#define ACCEL_PROFILING_TRACE_HPP

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>


namespace accel::profiling {

namespace detail {

inline std::filesystem::path rank_file(const std::filesystem::path& dir, int rank) {
  return dir / ("trace_rank" + std::to_string(rank) + ".json");
}

inline void write_json_atomic(const std::filesystem::path& file, const nlohmann::json& j) {
  auto tmp = file;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ACCEL_CHECK(out.good(), "accel: cannot write the trace file '", tmp.string(),
                "'. Give profile() a directory this process can write to.");
    out << j.dump();
    ACCEL_CHECK(out.good(), "accel: writing the trace file '", tmp.string(), "' failed. Check the free space.");
  }
  std::filesystem::rename(tmp, file);
}

/// Drops the asynchronous spans that recording cut in half (begun before it
/// started or ended after it stopped): every "b" has its "e" in the file.
inline std::vector<Event> matched_spans(std::vector<Event> events) {
  const auto async = [](const Event& e) { return e.phase == 'b' || e.phase == 'n' || e.phase == 'e'; };
  std::set<std::pair<std::string, int64_t>> begun, ended;
  for (const auto& e : events) {
    if (e.phase == 'b') begun.emplace(e.category, e.id);
    if (e.phase == 'e') ended.emplace(e.category, e.id);
  }
  std::erase_if(events, [&](const Event& e) {
    const std::pair key{std::string(e.category), e.id};
    return async(e) && (!begun.count(key) || !ended.count(key));
  });
  return events;
}

/// An accel event as a Chrome trace event of process `pid`.
inline nlohmann::json event_json(const Event& e, int pid) {
  nlohmann::json args = nlohmann::json::object();
  for (const auto& arg : e.args) std::visit([&](const auto& v) { args[arg.first] = v; }, arg.second);
  nlohmann::json j = {{"name", e.name}, {"cat", e.category}, {"ph", std::string(1, e.phase)}, {"ts", e.ts_us},
                      {"pid", pid}, {"tid", e.tid}, {"args", std::move(args)}};
  if (e.phase == 'X')
    j["dur"] = e.dur_us;
  else
    j["id"] = e.id;
  return j;
}

/// LibTorch's legacy profiler events as Chrome "X" events: each push matched
/// with its pop (by handle and node, as LibTorch's RecordProfile writer
/// does), timed from the profiler's start mark plus start_us, with the
/// operator's input shapes in args["Input Dims"] (Kineto's name) when it had
/// tensor inputs. A push without its pop (still open at the end) is dropped.
inline nlohmann::json operator_events(const torch::autograd::profiler::thread_event_lists& lists, double start_us) {
  using torch::autograd::profiler::EventKind;
  using torch::autograd::profiler::LegacyEvent;
  const LegacyEvent* start = nullptr;
  std::map<std::pair<uint64_t, int64_t>, const LegacyEvent*> pushed;
  for (const auto& list : lists)
    for (const auto& e : list) {
      if (e.kind() == EventKind::PushRange) pushed[{e.handle(), e.nodeId()}] = &e;
      if (!start && e.kind() == EventKind::Mark && std::string_view(e.name()) == "__start_profile") start = &e;
    }
  nlohmann::json out = nlohmann::json::array();
  if (!start) return out;  // nothing was recorded
  for (const auto& list : lists)
    for (const auto& e : list) {
      if (e.kind() != EventKind::PopRange) continue;
      const auto it = pushed.find({e.handle(), e.nodeId()});
      if (it == pushed.end()) continue;
      const LegacyEvent& b = *it->second;
      nlohmann::json args = nlohmann::json::object();
      auto shapes = b.shapes();
      const bool any = std::any_of(shapes.begin(), shapes.end(), [](const auto& d) { return !d.empty(); });
      if (any) args["Input Dims"] = std::move(shapes);
      out.push_back({{"name", b.name()}, {"cat", "cpu_op"}, {"ph", "X"}, {"ts", start_us + start->cpuElapsedUs(b)},
                     {"dur", b.cpuElapsedUs(e)}, {"tid", b.threadId()}, {"args", std::move(args)}});
      pushed.erase(it);
    }
  return out;
}

}  // namespace detail

/// RAII: LibTorch's profiler (CPU operators, on every thread that runs them
/// for this process) records while the Trace lives. stop() or the destructor
/// writes trace_dir/trace_rank<r>.json in the Chrome trace event format
/// (operators and accel's scopes as complete "X" events, bucket reductions as
/// asynchronous "b"/"n"/"e" spans; pid = rank; timestamps in microseconds
/// since the epoch, so the ranks' files line up when merged). One per process
/// at a time. Movable, not copyable.
class Trace {
 public:
  Trace(std::filesystem::path trace_dir, int rank)
      : impl_(std::make_unique<Impl>(std::move(trace_dir), rank)) {}
  Trace(Trace&&) noexcept = default;
  Trace& operator=(Trace&&) noexcept = default;
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;
  ~Trace() {
    try {
      stop();
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";  // a destructor must not throw
    }
  }

  /// Stops recording and writes the file (once); returns its path.
  std::filesystem::path stop() {
    if (!impl_) return {};
    auto file = impl_->file;
    impl_->finish();
    impl_.reset();
    return file;
  }

 private:
  struct Impl {
    Impl(std::filesystem::path dir, int r)
        : rank(r), file(detail::rank_file(dir, r)),
          start_us(static_cast<double>(std::chrono::duration_cast<std::chrono::microseconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count())) {
      std::filesystem::create_directories(dir);
      Events::start();
      try {
        // CPU operators with their input shapes (recording shapes costs a
        // few vectors per operator: docs/profiling.md has the measured cost).
        torch::autograd::profiler::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(
            torch::profiler::impl::ProfilerState::CPU, /*report_input_shapes=*/true));
        recording = true;
      } catch (...) {
        Events::stop();
        throw;
      }
    }
    ~Impl() {
      if (!recording) return;
      try {
        Events::stop();
        (void)torch::autograd::profiler::disableProfilerLegacy();
      } catch (...) {
      }
    }
    void finish() {
      auto own = Events::stop();
      recording = false;
      const auto lists = torch::autograd::profiler::disableProfilerLegacy();
      nlohmann::json out = nlohmann::json::array();
      out.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"tid", 0},
                     {"args", {{"name", "rank " + std::to_string(rank)}}}});
      for (auto& e : detail::operator_events(lists, start_us)) {
        e["pid"] = rank;
        out.push_back(std::move(e));
      }
      for (const auto& e : detail::matched_spans(std::move(own)))  // already in us since the epoch
        out.push_back(detail::event_json(e, rank));
      detail::write_json_atomic(file, out);
    }
    int rank;
    std::filesystem::path file;
    double start_us;
    bool recording = false;
  };
  std::unique_ptr<Impl> impl_;
};

/// Merges trace_rank0.json .. trace_rank<world-1>.json of trace_dir into
/// trace_dir/trace.json (one track per rank); call it once every rank's
/// Trace is gone (after wait_for_everyone()), on one process.
inline std::filesystem::path merge_traces(const std::filesystem::path& trace_dir, int world_size) {
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < world_size; ++r) {
    const auto file = detail::rank_file(trace_dir, r);
    std::ifstream in(file);
    ACCEL_CHECK(in.good(), "accel: the trace of rank ", r, " ('", file.string(),
                "') is missing. Merge after every rank's profile() object is gone.");
    for (auto& e : nlohmann::json::parse(in)) events.push_back(std::move(e));
  }
  const auto merged = trace_dir / "trace.json";
  detail::write_json_atomic(merged, {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}});
  return merged;
}

}  // namespace accel::profiling

#endif  // ACCEL_PROFILING_TRACE_HPP
// end <accel/profiling/trace.hpp>

#endif  // ACCEL_PROFILING_HPP
// end <accel/profiling.hpp>
// begin <accel/launch.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the launch area's public surface: accel::LaunchOptions and
/// accel::notebook_launcher / accel::launch (fork-based, one node at a time),
/// and the config file of the `accel` command (accel::LaunchConfig,
/// read_config_file, write_basic_config, default_config_path).
#ifndef ACCEL_LAUNCH_HPP
#define ACCEL_LAUNCH_HPP

// begin <accel/launch/config_file.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::LaunchConfig and the config file it is read from and
/// written to: default_config_path(), read_config_file(), write_config_file(),
/// write_basic_config(). The keys are Accelerate's, so an existing
/// `accelerate config` file is read as it is.
#ifndef ACCEL_LAUNCH_CONFIG_FILE_HPP
#define ACCEL_LAUNCH_CONFIG_FILE_HPP

#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

// begin <accel/launch/detail/config_keys.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the typed, line-aware reading of config file values and the
/// list of Accelerate keys accel accepts but ignores (config_file.hpp uses them).
#ifndef ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP
#define ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include <yaml-cpp/yaml.h>


namespace accel::detail::launch {

/// Converts one value; every failure names file, line, key, what was found and
/// what is allowed.
struct ConfigReader {
  std::string file;
  std::vector<std::string>& warnings;

  static int line_of(const YAML::Node& v) { return v.Mark().line + 1; }

  /// Text from the file as messages quote it: at most 80 characters.
  static std::string clipped(const std::string& text) {
    return text.size() <= 80 ? text
                             : text.substr(0, 80) + "... (" + std::to_string(text.size()) + " characters)";
  }

  static std::string shown(const YAML::Node& v) {
    if (v.IsScalar()) return "'" + clipped(v.Scalar()) + "'";
    if (v.IsSequence()) return "a list";
    if (v.IsMap()) return "a mapping";
    return "nothing";
  }

  [[noreturn]] void fail(const std::string& key, const YAML::Node& v, const std::string& found,
                         const std::string& allowed) const {
    throw ConfigError("accel: " + file + ":" + std::to_string(line_of(v)) + ": key '" +
                      clipped(key) + "' " + found + ". Use " + allowed + ".");
  }

  void warn(const std::string& key, int line, const std::string& why) {
    warnings.push_back("accel: warning: " + file + ":" + std::to_string(line) + ": key '" +
                       clipped(key) + "': " + why + ".");
  }

  std::string choice(const std::string& key, const YAML::Node& v,
                     std::initializer_list<std::string_view> allowed) const {
    std::string list;
    for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
    if (!v.IsScalar()) fail(key, v, "is " + shown(v), "one of: " + list);
    const std::string s = v.Scalar();
    if (std::find(allowed.begin(), allowed.end(), s) == allowed.end())
      fail(key, v, "has the value '" + clipped(s) + "', which is not allowed", "one of: " + list);
    return s;
  }

  bool boolean(const std::string& key, const YAML::Node& v) const {
    bool b = false;
    if (!v.IsScalar() || !YAML::convert<bool>::decode(v, b))
      fail(key, v, "is " + shown(v) + ", not a boolean", "true or false (yes/no also accepted)");
    return b;
  }

  int integer(const std::string& key, const YAML::Node& v, int lo, int hi) const {
    const std::string range = "a whole number in [" + std::to_string(lo) + ", " +
                              std::to_string(hi) + "]";
    long long n = 0;
    if (!v.IsScalar() || !YAML::convert<long long>::decode(v, n))
      fail(key, v, "is " + shown(v) + ", not a whole number", range);
    if (n < lo || n > hi) fail(key, v, "is " + std::to_string(n) + ", out of range", range);
    return static_cast<int>(n);
  }

  std::string string(const std::string& key, const YAML::Node& v) const {
    if (!v.IsScalar()) fail(key, v, "is " + shown(v) + ", not a single value", "a string");
    return v.Scalar();
  }
};

/// Keys of Accelerate features accel does not have (TPU, DeepSpeed, FSDP,
/// SageMaker, ...): accepted so that an Accelerate file reads as it is.
inline bool is_ignored_accelerate_key(std::string_view key) {
  static constexpr std::array<std::string_view, 26> names{
      "deepspeed_config", "fsdp_config", "megatron_lm_config", "fp8_config", "parallelism_config",
      "mpirun_config", "dynamo_config", "ipex_config", "commands", "command_file",
      "use_mps_device", "ipex", "use_xpu", "mpirun_hostfile", "ec2_instance_type",
      "iam_role_name", "image_uri", "profile", "region", "py_version", "pytorch_version",
      "transformers_version", "success_message", "base_job_name", "sagemaker_inputs_file",
      "sagemaker_metrics_file"};
  return key.rfind("tpu_", 0) == 0 || key == "additional_args" ||
         std::find(names.begin(), names.end(), key) != names.end();
}

/// True for values that ask for nothing (null, false, empty, or a mapping of
/// such): an ignored key holding one of them is not worth a warning.
inline bool is_trivial(const YAML::Node& v) {
  if (v.IsNull()) return true;
  if (v.IsScalar()) {
    bool b = true;
    return v.Scalar().empty() || (YAML::convert<bool>::decode(v, b) && !b);
  }
  if (v.IsSequence()) return v.size() == 0;
  for (const auto& kv : v)
    if (!is_trivial(kv.second)) return false;
  return true;
}

/// Writes a whole file, creating its parent directories.
inline void write_text(const std::filesystem::path& path, const std::string& text) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out)
    throw Error("accel: cannot write " + path.string() +
                ". Check that the directory is writable or pass another path.");
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_CONFIG_KEYS_HPP
// end <accel/launch/detail/config_keys.hpp>

#if ACCEL_WITH_CUDA
#include <torch/cuda.h>
#endif

namespace accel {

/// How the processes of a launch are laid out (Accelerate's distributed_type).
/// DEEPSPEED, FSDP and MEGATRON_LM are read as MultiGpu with a warning.
enum class DistributedType { No, MultiCpu, MultiGpu };

inline const char* distributed_type_name(DistributedType t) {
  switch (t) {
    case DistributedType::MultiCpu: return "MULTI_CPU";
    case DistributedType::MultiGpu: return "MULTI_GPU";
    default: return "NO";
  }
}

/// The contents of a config file. Defaults are Accelerate's ClusterConfig ones.
struct LaunchConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::No;
  std::optional<std::string> backend;  ///< accel's own key: gloo | mpi | nccl
  std::string mixed_precision = "no";  ///< no | fp16 | bf16
  bool use_cpu = false;
  bool debug = false;                  ///< exported as ACCEL_DEBUG_MODE=yes
  std::optional<int> num_processes;    ///< total over all machines; unset (or -1): default
  int num_machines = 1;
  int machine_rank = 0;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::string rdzv_backend = "static";
  bool same_network = false;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  bool downcast_bf16 = false;
  std::optional<std::string> gpu_ids;  ///< "all" or "0,1,..."
  int gradient_accumulation_steps = 1;

  std::filesystem::path source;        ///< the file it was read from (empty: defaults)
  std::vector<std::string> warnings;   ///< unknown and ignored keys, one message each
};

namespace detail::launch {
/// The keys a file holds for `c`: Accelerate's, plus accel's `backend` when set.
inline nlohmann::json to_json(const LaunchConfig& c) {
  nlohmann::json j;
  j["compute_environment"] = c.compute_environment;
  j["debug"] = c.debug;
  j["distributed_type"] = distributed_type_name(c.distributed_type);
  j["downcast_bf16"] = c.downcast_bf16;
  j["enable_cpu_affinity"] = c.enable_cpu_affinity;
  j["machine_rank"] = c.machine_rank;
  j["main_training_function"] = c.main_training_function;
  j["mixed_precision"] = c.mixed_precision;
  j["num_machines"] = c.num_machines;
  j["num_processes"] = c.num_processes.value_or(-1);
  j["rdzv_backend"] = c.rdzv_backend;
  j["same_network"] = c.same_network;
  j["use_cpu"] = c.use_cpu;
  if (c.backend) j["backend"] = *c.backend;
  if (c.gpu_ids) j["gpu_ids"] = *c.gpu_ids;
  if (c.main_process_ip) j["main_process_ip"] = *c.main_process_ip;
  if (c.main_process_port) j["main_process_port"] = *c.main_process_port;
  if (c.gradient_accumulation_steps != 1)
    j["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  return j;
}
}  // namespace detail::launch

/// Where the config file lives: $ACCEL_CONFIG_FILE, else
/// $XDG_CONFIG_HOME/accel/default_config.yaml, else ~/.config/accel/default_config.yaml.
inline std::filesystem::path default_config_path() {
  auto env = [](const char* name) -> std::optional<std::string> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::string(v);
  };
  if (auto f = env("ACCEL_CONFIG_FILE")) return *f;
  std::filesystem::path base;
  if (auto x = env("XDG_CONFIG_HOME")) {
    base = *x;
  } else if (auto h = env("HOME")) {
    base = std::filesystem::path(*h) / ".config";
  } else {
    throw ConfigError(
        "accel: cannot find a config directory: none of ACCEL_CONFIG_FILE, XDG_CONFIG_HOME, HOME "
        "is set. Set ACCEL_CONFIG_FILE or pass a path.");
  }
  return base / "accel" / "default_config.yaml";
}

/// Where `accelerate config` saves its file: $HF_HOME/accelerate/default_config.yaml,
/// HF_HOME defaulting to ${XDG_CACHE_HOME:-~/.cache}/huggingface.
inline std::optional<std::filesystem::path> accelerate_config_path() {
  auto env = [](const char* name) -> std::optional<std::filesystem::path> {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return std::nullopt;
    return std::filesystem::path(v);
  };
  std::optional<std::filesystem::path> hf = env("HF_HOME");
  if (!hf) {
    if (auto cache = env("XDG_CACHE_HOME")) hf = *cache / "huggingface";
    else if (auto home = env("HOME")) hf = *home / ".cache" / "huggingface";
    else return std::nullopt;
  }
  return *hf / "accelerate" / "default_config.yaml";
}

/// The file `accel launch` and `accel env` use when given none:
/// default_config_path() when it exists, else Accelerate's own file when that
/// exists (so a machine set up with `accelerate config` needs nothing more),
/// else nullopt (built-in defaults).
inline std::optional<std::filesystem::path> config_file_in_effect() {
  if (auto own = default_config_path(); std::filesystem::exists(own)) return own;
  if (auto theirs = accelerate_config_path(); theirs && std::filesystem::exists(*theirs))
    return theirs;
  return std::nullopt;
}

/// Reads a YAML (or JSON: Accelerate writes JSON into .yaml files) config file.
/// Unknown keys and keys of features accel does not have are warnings
/// (collected in .warnings and written to `warn` unless it is null); a wrong
/// type or value is a ConfigError naming the key, its line and what is allowed.
inline LaunchConfig read_config_file(const std::filesystem::path& path,
                                     std::ostream* warn = &std::cerr) {
  if (!std::filesystem::exists(path))
    throw ConfigError("accel: config file " + path.string() +
                      " does not exist. Run `accel config` to create it or pass another path.");
  if (std::filesystem::is_directory(path))
    throw ConfigError("accel: config file " + path.string() +
                      " is a directory. Pass the YAML file itself (`accel config` writes " +
                      default_config_path().filename().string() + ").");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path.string());
  } catch (const YAML::Exception& e) {
    throw ConfigError("accel: " + path.string() + ":" + std::to_string(e.mark.line + 1) +
                      ": not valid YAML or JSON (" + e.msg + "). Fix the file or run `accel config`.");
  }
  LaunchConfig c;
  c.source = path;
  if (root.IsNull()) {  // Accelerate reads an empty file as all defaults: so do we, aloud
    c.warnings.push_back("accel: warning: " + path.string() +
                         " is empty; every setting takes its default.");
    if (warn != nullptr) *warn << c.warnings.back() << '\n';
    return c;
  }
  if (!root.IsMap())
    throw ConfigError("accel: " + path.string() +
                      ": the top level must be a mapping of keys to values. Run `accel config` to "
                      "write a valid file.");
  detail::launch::ConfigReader r{path.string(), c.warnings};
  std::map<std::string, int> seen;  // key -> line: YAML readers disagree on duplicates
  for (const auto& kv : root) {
    const std::string key = kv.first.as<std::string>();
    const YAML::Node& v = kv.second;
    const int line = kv.first.Mark().line + 1;
    if (const auto [it, fresh] = seen.emplace(key, line); !fresh)
      throw ConfigError("accel: " + path.string() + ":" + std::to_string(line) + ": key '" +
                        detail::launch::ConfigReader::clipped(key) + "' appears twice (lines " +
                        std::to_string(it->second) + " and " + std::to_string(line) +
                        "). Keep one of them.");
    if (v.IsNull()) continue;  // Accelerate drops None values; a null means "unset"
    if (key == "compute_environment") {
      c.compute_environment = r.choice(key, v, {"LOCAL_MACHINE", "AMAZON_SAGEMAKER"});
      if (c.compute_environment != "LOCAL_MACHINE")
        r.warn(key, line, "accel runs on the local machine only; the value is ignored");
    } else if (key == "distributed_type") {
      const std::string t = r.choice(key, v, {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP",
                                              "MEGATRON_LM"});
      if (t == "NO") c.distributed_type = DistributedType::No;
      else if (t == "MULTI_CPU") c.distributed_type = DistributedType::MultiCpu;
      else {
        c.distributed_type = DistributedType::MultiGpu;
        if (t != "MULTI_GPU")
          r.warn(key, line, "accel does not support " + t + "; it is read as MULTI_GPU");
      }
    } else if (key == "backend") {
      c.backend = r.choice(key, v, {"gloo", "mpi", "nccl"});
    } else if (key == "mixed_precision") {
      c.mixed_precision = r.choice(key, v, {"no", "fp16", "bf16"});
    } else if (key == "use_cpu") {
      c.use_cpu = r.boolean(key, v);
    } else if (key == "debug") {
      c.debug = r.boolean(key, v);
    } else if (key == "num_processes") {
      const int n = r.integer(key, v, -1, 1 << 20);
      if (n == 0) r.fail(key, v, "is 0", "a positive number of processes (or -1 for the default)");
      c.num_processes = n < 0 ? std::nullopt : std::optional<int>(n);
    } else if (key == "num_machines") {
      c.num_machines = r.integer(key, v, 1, 1 << 16);
    } else if (key == "machine_rank") {
      c.machine_rank = r.integer(key, v, 0, (1 << 16) - 1);
    } else if (key == "main_process_ip") {
      c.main_process_ip = r.string(key, v);
    } else if (key == "main_process_port") {
      c.main_process_port = r.integer(key, v, 0, 65535);
    } else if (key == "rdzv_backend") {
      c.rdzv_backend = r.choice(key, v, {"static", "c10d", "etcd", "etcd-v2"});
      if (c.rdzv_backend != "static")
        r.warn(key, line, "accel always uses a static rendezvous (c10d TCPStore at main_process_ip:"
                          "main_process_port)");
    } else if (key == "same_network") {
      c.same_network = r.boolean(key, v);
    } else if (key == "main_training_function") {
      c.main_training_function = r.string(key, v);
    } else if (key == "enable_cpu_affinity") {
      c.enable_cpu_affinity = r.boolean(key, v);
    } else if (key == "downcast_bf16") {
      c.downcast_bf16 = r.boolean(key, v);  // Accelerate writes 'no' as a string
    } else if (key == "gpu_ids") {
      c.gpu_ids = r.string(key, v);
    } else if (key == "gradient_accumulation_steps") {
      c.gradient_accumulation_steps = r.integer(key, v, 1, 1 << 30);
    } else if (detail::launch::is_ignored_accelerate_key(key)) {
      if (!detail::launch::is_trivial(v))
        r.warn(key, line, "accel does not support this Accelerate feature; the key is ignored");
    } else {
      r.warn(key, line, "unknown key, ignored. Check its spelling (keys are Accelerate's)");
    }
  }
  if (c.machine_rank >= c.num_machines)
    throw ConfigError("accel: " + path.string() + ": machine_rank " +
                      std::to_string(c.machine_rank) + " is not below num_machines " +
                      std::to_string(c.num_machines) + ". Use a machine_rank in [0, num_machines).");
  if (warn != nullptr)
    for (const auto& w : c.warnings) *warn << w << '\n';
  return c;
}

/// Writes `c` as YAML (sorted keys, Accelerate's names; accel's `backend` only
/// when set), creating parent directories and replacing an existing file.
inline void write_config_file(const LaunchConfig& c, const std::filesystem::path& path) {
  nlohmann::json j = detail::launch::to_json(c);
  YAML::Emitter out;
  out << YAML::BeginMap;
  for (const auto& [k, v] : j.items()) {  // nlohmann::json keeps keys sorted
    out << YAML::Key << k << YAML::Value;
    if (v.is_boolean()) out << v.get<bool>();
    else if (v.is_number_integer()) out << v.get<int>();
    else out << v.get<std::string>();
  }
  out << YAML::EndMap;
  detail::launch::write_text(path, std::string(out.c_str()) + "\n");
}

/// Writes the basic config Accelerate's write_basic_config writes (JSON, sorted
/// keys, two-space indent, into the .yaml path): all CUDA devices of this
/// machine when the build has CUDA, else one CPU process. An existing file is
/// left alone (a note on stderr says so). Throws ConfigError for a
/// mixed_precision other than no, fp16, bf16.
inline void write_basic_config(std::string_view mixed_precision = "no",
                               std::optional<std::filesystem::path> path = {}) {
  std::string mp(mixed_precision);
  for (auto& ch : mp) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (mp != "no" && mp != "fp16" && mp != "bf16")
    throw ConfigError("accel: mixed_precision '" + std::string(mixed_precision) +
                      "' is not supported. Use one of: no, fp16, bf16.");
  const std::filesystem::path where = path ? *path : default_config_path();
  if (std::filesystem::exists(where)) {
    std::cerr << "accel: configuration already exists at " << where.string()
              << ", will not override. Run `accel config` or pass another path.\n";
    return;
  }
  LaunchConfig c;
  c.mixed_precision = mp;
  c.use_cpu = true;
  c.num_processes = 1;
#if ACCEL_WITH_CUDA
  if (const int gpus = static_cast<int>(torch::cuda::device_count()); gpus > 0) {
    c.use_cpu = false;
    c.num_processes = gpus;
    c.distributed_type = gpus > 1 ? DistributedType::MultiGpu : DistributedType::No;
  }
#endif
  nlohmann::json j = detail::launch::to_json(c);
  j["tpu_use_cluster"] = false;  // Accelerate's ClusterConfig writes these defaults too
  j["tpu_use_sudo"] = false;
  detail::launch::write_text(where, j.dump(2) + "\n");
}

}  // namespace accel

#endif  // ACCEL_LAUNCH_CONFIG_FILE_HPP
// end <accel/launch/config_file.hpp>
// begin <accel/launch/launch_options.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::LaunchOptions, what notebook_launcher (and the `accel
/// launch` command) needs to know to start the processes of one node.
#ifndef ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP
#define ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP

#include <chrono>
#include <optional>
#include <string>

namespace accel {

/// Where and how many workers to start. The first six fields are the API.md
/// contract; the ones after them are accel extensions with neutral defaults.
struct LaunchOptions {
  int num_processes = 1;  ///< workers on this node
  int num_nodes = 1;      ///< nodes taking part (each runs its own launcher)
  int node_rank = 0;      ///< this node's index, 0 .. num_nodes-1
  std::string master_addr = "127.0.0.1";  ///< rendezvous host (node 0)
  int master_port = 29500;  ///< rendezvous port; 0: pick a free one (several nodes: see rendezvous_file)
  std::chrono::seconds timeout{1800};  ///< bound on the whole launch

  /// Exported as ACCEL_MIXED_PRECISION ("no", "fp16", "bf16") when set.
  std::optional<std::string> mixed_precision = std::nullopt;
  /// Prefix each worker's output lines with "[rank N] " (captured through pipes).
  bool prefix_output = false;
  /// Between SIGTERM and SIGKILL when the other workers are stopped.
  std::chrono::milliseconds stop_grace{std::chrono::seconds{5}};
  /// With several nodes and master_port 0: a file path every node can read
  /// (a shared filesystem). Node 0 picks a free port and writes it there;
  /// the other nodes wait for it. Node 0 removes the file when its launch ends.
  std::optional<std::string> rendezvous_file = std::nullopt;

  // --- elastic restarts (API.md section 7; docs/launching.md "Fault tolerance") ---
  /// When a worker fails (throws, exits non-zero, dies by a signal, or hangs:
  /// monitor_interval), every worker is stopped and the whole group started
  /// again, up to this many times; each attempt sees TORCHELASTIC_RESTART_COUNT
  /// (accel::restart_count()). Several nodes: every node's launcher restarts
  /// together (node 0's coordinates on master_port; docs/launching.md).
  int max_restarts = 0;
  /// Hang detection: a worker that made progress (runtime::heartbeat(): each
  /// batch of a prepared loader, each completed collective) and then makes
  /// none for this long is killed and counts as failed. Unset: none.
  std::optional<std::chrono::seconds> monitor_interval = std::nullopt;
};

}  // namespace accel

#endif  // ACCEL_LAUNCH_LAUNCH_OPTIONS_HPP
// end <accel/launch/launch_options.hpp>
// begin <accel/launch/notebook_launcher.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::notebook_launcher (also named accel::launch): run a
/// function in num_processes forked workers of this node, as Accelerate's
/// notebook_launcher does, and fail loudly and completely when one fails.
#ifndef ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP
#define ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

// begin <accel/launch/detail/elastic.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the elastic loop shared by notebook_launcher and `accel
/// launch`: start the worker group, and when a worker fails start the whole
/// group again, up to LaunchOptions::max_restarts times. The worker pool
/// already stops a failed group; this only decides whether to go again, with
/// which port, and says so. Over several machines the machines' launchers
/// decide together through their agents (node_agent.hpp). Free of LibTorch
/// (the `accel` command uses it).
#ifndef ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
#define ACCEL_LAUNCH_DETAIL_ELASTIC_HPP

#include <chrono>
#include <functional>
#include <iostream>
#include <optional>
#include <ostream>
#include <string>
#include <utility>

// begin <accel/launch/detail/node_agent.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the agents through which the launchers of several machines
/// run one elastic launch (LaunchOptions::max_restarts with num_nodes > 1):
/// machine 0's launcher hosts the rendezvous on master_addr:master_port, the
/// others connect to it; each attempt starts on every machine together, a
/// failure anywhere stops every machine's workers within seconds, and
/// machine 0 decides whether the group starts again. A machine whose launcher
/// is started again after it died rejoins the next attempt. Free of LibTorch.
///
/// Messages (agent_channel.hpp), client -> machine 0:
///   HELLO protocol node num_nodes processes_per_node max_restarts
///   RESULT attempt <workers>       this machine's workers after the attempt
///   ABORT text                     this launch was interrupted or timed out
/// machine 0 -> client:
///   START attempt worker_port job_id restart_reason
///   STOP attempt why               another machine failed: stop the workers
///   FINISH ok|failed|aborted attempt <workers> | text
///   REFUSE text                    this launcher cannot join (and why)
#ifndef ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP
#define ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

// begin <accel/launch/detail/agent_channel.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the connection between the launchers of several machines
/// (launch/detail/node_agent.hpp): one TCP stream carrying messages, each a
/// list of text fields on one line. Free of LibTorch (`accel launch` uses it).
#ifndef ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP
#define ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <string_view>
#include <vector>

// begin <accel/launch/detail/posix.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the small POSIX helpers the launcher is built on: owned file
/// descriptors, pipes, signal names, CPU count, scoped environment variables.
#ifndef ACCEL_LAUNCH_DETAIL_POSIX_HPP
#define ACCEL_LAUNCH_DETAIL_POSIX_HPP

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

// begin <accel/detail/cores.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::available_cores(): the CPUs this process may use.
#ifndef ACCEL_DETAIL_CORES_HPP
#define ACCEL_DETAIL_CORES_HPP

#include <sched.h>

#include <algorithm>
#include <thread>

namespace accel::detail {

/// CPUs this process may run on (its affinity mask: what taskset, cgroups
/// cpusets, Slurm and mpirun's binding allow), not the machine's total.
inline int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
}

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_CORES_HPP
// end <accel/detail/cores.hpp>

namespace accel::detail::launch {

/// Environment variables to set in a worker, in order (later entries win).
using EnvList = std::vector<std::pair<std::string, std::string>>;

/// An owned file descriptor (closed on destruction, movable).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

/// A close-on-exec pipe; `read` is non-blocking because the parent multiplexes
/// many of them with poll() and must never block on one.
struct Pipe {
  Fd read;
  Fd write;

  static Pipe make() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0)
      throw Error(std::string("accel: cannot create a pipe for a worker (") + std::strerror(errno) +
                  "). Raise the open-file limit (ulimit -n) or launch fewer processes.");
    Pipe p{Fd(fds[0]), Fd(fds[1])};
    ::fcntl(p.read.get(), F_SETFL, ::fcntl(p.read.get(), F_GETFL) | O_NONBLOCK);
    return p;
  }
};

/// Writes all of `data` to `fd`, retrying on EINTR and short writes.
/// Async-signal-safe (used in forked children before exit).
inline void write_all(int fd, const char* data, std::size_t size) noexcept {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data += n;
    size -= static_cast<std::size_t>(n);
  }
}

/// Reads what is available on a non-blocking fd into `out`.
/// Returns false once the writer side is closed (EOF) or the fd failed.
inline bool read_available(int fd, std::string& out) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

/// "SIGSEGV" for 11 and so on; the names users see in crash reports.
inline std::string signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return "signal " + std::to_string(sig);
  }
}

using accel::detail::available_cores;

/// Parses a positive integer environment variable; nullopt when unset/invalid.
inline std::optional<int> positive_env_int(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || n < 1 || n > 1 << 20) return std::nullopt;
  return static_cast<int>(n);
}

/// Sets variables for a scope and puts back the previous values (or unsets
/// them) on destruction, also when an exception leaves the scope.
class ScopedEnv {
 public:
  explicit ScopedEnv(const EnvList& vars) {
    for (const auto& [k, v] : vars) {
      const char* old = std::getenv(k.c_str());
      saved_.emplace_back(k, old ? std::optional<std::string>(old) : std::nullopt);
      ::setenv(k.c_str(), v.c_str(), 1);
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    // Reverse order so a key listed twice ends with its original value.
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

/// While alive, SIGINT, SIGTERM and SIGHUP sent to this process do not kill it
/// but are recorded and wake up poll() through a self-pipe, so the launcher can
/// stop its workers first. The previous handlers are restored on destruction.
/// Only one guard is active at a time; a nested one does nothing.
class StopSignalGuard {
 public:
  StopSignalGuard() {
    if (active().exchange(true)) return;
    owner_ = true;
    pipe_ = Pipe::make();
    ::fcntl(pipe_.write.get(), F_SETFL, ::fcntl(pipe_.write.get(), F_GETFL) | O_NONBLOCK);
    caught() = 0;
    write_fd().store(pipe_.write.get());
    struct sigaction sa {};
    sa.sa_handler = &StopSignalGuard::on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
  }
  StopSignalGuard(const StopSignalGuard&) = delete;
  StopSignalGuard& operator=(const StopSignalGuard&) = delete;
  ~StopSignalGuard() {
    if (!owner_) return;
    for (std::size_t i = 0; i < kSignals.size(); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
    write_fd().store(-1);
    active().store(false);
  }

  /// The fd that becomes readable when a signal arrived (-1 when not the owner).
  int fd() const noexcept { return owner_ ? pipe_.read.get() : -1; }
  /// The first signal received since construction, 0 if none.
  static int received() noexcept { return caught(); }
  /// In a forked child: the parent's guard is not the child's, so a launcher
  /// started inside a worker can install its own.
  static void forget_after_fork() noexcept {
    write_fd().store(-1);
    active().store(false);
    caught() = 0;
  }

  static constexpr std::array<int, 3> kSignals{SIGINT, SIGTERM, SIGHUP};

 private:
  static void on_signal(int sig) {
    int saved = errno;
    if (caught() == 0) caught() = sig;
    int fd = write_fd().load();
    if (fd >= 0) {
      char c = 1;
      [[maybe_unused]] ssize_t n = ::write(fd, &c, 1);
    }
    errno = saved;
  }
  static std::atomic<bool>& active() {
    static std::atomic<bool> a{false};
    return a;
  }
  static std::atomic<int>& write_fd() {
    static std::atomic<int> fd{-1};
    return fd;
  }
  static volatile std::sig_atomic_t& caught() {
    static volatile std::sig_atomic_t sig = 0;
    return sig;
  }

  bool owner_ = false;
  Pipe pipe_;
  std::array<struct sigaction, kSignals.size()> old_{};
};

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_POSIX_HPP
// end <accel/launch/detail/posix.hpp>

namespace accel::detail::launch {

using AgentMessage = std::vector<std::string>;

/// One line: fields joined by tabs; backslash, tab and newline escaped, so a
/// worker's multi-line error travels as one field.
inline std::string encode_message(const AgentMessage& fields) {
  std::string line;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i > 0) line.push_back('\t');
    for (char c : fields[i]) {
      if (c == '\\') line += "\\\\";
      else if (c == '\t') line += "\\t";
      else if (c == '\n') line += "\\n";
      else line.push_back(c);
    }
  }
  line.push_back('\n');
  return line;
}

inline AgentMessage decode_message(std::string_view line) {
  AgentMessage fields(1);
  for (std::size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (c == '\t') {
      fields.emplace_back();
    } else if (c == '\\' && i + 1 < line.size()) {
      const char e = line[++i];
      fields.back().push_back(e == 't' ? '\t' : e == 'n' ? '\n' : e);
    } else {
      fields.back().push_back(c);
    }
  }
  return fields;
}

/// A non-blocking TCP connection to another launcher. The kernel's keepalive
/// probes notice a machine that vanished without closing it (power loss, a
/// cut cable) within about 15 s; a process that dies closes it at once.
class AgentChannel {
 public:
  AgentChannel() = default;
  explicit AgentChannel(Fd fd) : fd_(std::move(fd)) {
    ::fcntl(fd_.get(), F_SETFL, ::fcntl(fd_.get(), F_GETFL) | O_NONBLOCK);
    int one = 1, idle = 5, interval = 2, count = 5;
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
    ::setsockopt(fd_.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }

  bool open() const { return fd_.valid(); }
  int fd() const { return fd_.get(); }
  void close() { fd_.reset(); }

  /// Sends one message (waiting up to 5 s for room); false, and closed, if
  /// the peer is gone. Never raises SIGPIPE.
  bool send(const AgentMessage& fields) {
    const std::string line = encode_message(fields);
    std::size_t done = 0;
    while (fd_.valid() && done < line.size()) {
      const ssize_t n = ::send(fd_.get(), line.data() + done, line.size() - done, MSG_NOSIGNAL);
      if (n > 0) {
        done += static_cast<std::size_t>(n);
      } else if (n < 0 && errno == EINTR) {
        continue;
      } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        ::pollfd p{fd_.get(), POLLOUT, 0};
        if (::poll(&p, 1, 5000) <= 0) close();
      } else {
        close();
      }
    }
    return fd_.valid();
  }

  /// Appends the messages that have arrived to `out`; false once the peer
  /// closed the connection or it failed (the messages before that still count).
  /// A peer that sends more than 1 MiB without a line end is not a launcher.
  bool receive(std::vector<AgentMessage>& out) {
    if (!fd_.valid()) return false;
    const bool alive = read_available(fd_.get(), in_);
    std::size_t start = 0;
    for (std::size_t nl; (nl = in_.find('\n', start)) != std::string::npos; start = nl + 1)
      out.push_back(decode_message(std::string_view(in_).substr(start, nl - start)));
    in_.erase(0, start);
    if (!alive || in_.size() > (1u << 20)) close();
    return fd_.valid();
  }

  /// Waits up to `ms` for something to read (or the peer closing).
  bool wait_readable(int ms) const {
    if (!fd_.valid()) return true;
    ::pollfd p{fd_.get(), POLLIN, 0};
    return ::poll(&p, 1, ms) != 0;
  }

 private:
  Fd fd_;
  std::string in_;
};

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_AGENT_CHANNEL_HPP
// end <accel/launch/detail/agent_channel.hpp>
// begin <accel/launch/detail/ports.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines free-port selection and the "is this port taken" check used
/// before a rendezvous is hosted on main_process_port.
#ifndef ACCEL_LAUNCH_DETAIL_PORTS_HPP
#define ACCEL_LAUNCH_DETAIL_PORTS_HPP

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <utility>


namespace accel::detail::launch {

using runtime::detail::bind_tcp;

/// A port that is free on addr now (the kernel's choice for port 0). Another
/// process may take it before we use it; the window is short, and the
/// rendezvous then fails with the port in its message.
inline int pick_free_port(const std::string& addr = "127.0.0.1") {
  const int fd = bind_tcp(addr, 0);
  if (fd < 0)
    throw Error("accel: cannot find a free port on " + addr + " (" + std::strerror(-fd) +
                "). Pass a fixed --main_process_port.");
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  const int rc = ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  if (rc != 0)
    throw Error("accel: cannot read back the free port chosen on " + addr +
                ". Pass a fixed --main_process_port.");
  return ntohs(sa.sin_port);
}

/// 0 when addr:port can be listened on now (bound and released at once),
/// else -errno: -EADDRINUSE when something holds it.
inline int bind_error(const std::string& addr, int port) {
  const int fd = bind_tcp(addr, port);
  if (fd < 0) return fd;
  ::close(fd);
  return 0;
}

/// Throws when addr:port cannot be listened on because something holds it.
inline void ensure_port_free(const std::string& addr, int port) {
  const int err = bind_error(addr, port);
  if (err == -EADDRINUSE)
    throw Error("accel: port " + std::to_string(port) + " on " + addr +
                " is already in use. Pick another --main_process_port, or pass "
                "--main_process_port 0 to let accel choose a free one.");
  if (err == -EACCES)
    throw Error("accel: port " + std::to_string(port) + " needs privileges to listen on. Pick " +
                "a --main_process_port above 1023, or 0 to let accel choose.");
}

/// Removes a file on scope exit (node 0's rendezvous file, once its launch ends).
class RemoveAtExit {
 public:
  explicit RemoveAtExit(std::string path) : path_(std::move(path)) {}
  RemoveAtExit(const RemoveAtExit&) = delete;
  RemoveAtExit& operator=(const RemoveAtExit&) = delete;
  ~RemoveAtExit() { std::remove(path_.c_str()); }

 private:
  std::string path_;
};

/// Several nodes: node 0 takes `preferred` if it is free on addr (0: none),
/// else a free port, and publishes it in `file` (written beside it, then
/// renamed: readers see all of it or nothing); every other node waits for the
/// file until `deadline`. A file left by an earlier launch is replaced.
inline int agree_on_free_port(const std::string& file, int node_rank, const std::string& addr,
                              std::chrono::steady_clock::time_point deadline, int preferred = 0) {
  namespace fs = std::filesystem;
  constexpr const char* kTag = "accel-rendezvous-port";
  if (node_rank == 0) {
    int port = preferred;
    if (port != 0 && bind_error(addr, port) != 0) port = 0;
    if (port == 0) port = pick_free_port(addr);
    const fs::path tmp = file + ".tmp" + std::to_string(::getpid());
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << kTag << ' ' << port << '\n';
      out.flush();
      if (!out)
        throw Error("accel: cannot write the rendezvous file '" + tmp.string() +
                    "'. Give a rendezvous_file in a writable directory that all nodes share.");
    }
    std::error_code ec;
    fs::rename(tmp, file, ec);
    if (ec)
      throw Error("accel: cannot create the rendezvous file '" + file + "' (" + ec.message() +
                  "). Give a rendezvous_file in a writable directory that all nodes share.");
    return port;
  }
  for (;;) {
    std::ifstream in(file);
    std::string tag;
    int port = 0;
    if (in >> tag >> port) {
      if (tag != kTag || port < 1 || port > 65535)
        throw Error("accel: '" + file + "' is not an accel rendezvous file (read '" + tag + " " +
                    std::to_string(port) + "'). Give a path that only accel launches use.");
      return port;
    }
    if (std::chrono::steady_clock::now() > deadline)
      throw TimeoutError("accel: node " + std::to_string(node_rank) +
                         " waited for node 0 to write the port it chose to '" + file +
                         "' until the launch timeout. Start node 0 with the same rendezvous_file "
                         "(a path all nodes see), or pass the same fixed master_port everywhere.");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_PORTS_HPP
// end <accel/launch/detail/ports.hpp>
// begin <accel/launch/detail/rank_env.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines what any accel launcher decides before starting workers: the
/// option checks, each worker's rank variables, its thread count, free ports,
/// the CUDA-before-fork check and the ACCEL_DEBUG_MODE worker check. Free of
/// LibTorch so that the `accel` command can use it too.
#ifndef ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP
#define ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <string_view>


namespace accel::detail::launch {

/// More processes on one machine than this is a typo (num_processes: 100000),
/// not a plan: 4 per core, at least 8; ACCEL_MAX_LOCAL_PROCESSES raises it.
inline int max_local_processes() {
  if (const auto n = positive_env_int("ACCEL_MAX_LOCAL_PROCESSES")) return *n;
  return std::max(8, 4 * available_cores());
}

inline void check_local_process_count(int n) {
  const int limit = max_local_processes();
  ACCEL_CHECK(n <= limit, "accel: ", n, " processes on this machine is more than ", limit,
              " (4 per CPU core, ", available_cores(), " cores): each would get a sliver of a "
              "core and its own copy of the model. Launch fewer, or set "
              "ACCEL_MAX_LOCAL_PROCESSES=", n, " if you mean it.");
}

/// Throws accel::Error when the options cannot describe a launch.
inline void validate(const LaunchOptions& o) {
  ACCEL_CHECK(o.num_processes >= 1, "accel: num_processes is ", o.num_processes,
              ". Launch at least 1 process.");
  check_local_process_count(o.num_processes);
  ACCEL_CHECK(o.num_nodes >= 1, "accel: num_nodes is ", o.num_nodes, ". Use at least 1 node.");
  ACCEL_CHECK(o.node_rank >= 0 && o.node_rank < o.num_nodes, "accel: node_rank ", o.node_rank,
              " is outside 0..", o.num_nodes - 1, " (num_nodes = ", o.num_nodes,
              "). Give every node a distinct node_rank below num_nodes.");
  ACCEL_CHECK(o.master_port >= 0 && o.master_port <= 65535, "accel: master_port ", o.master_port,
              " is not a TCP port. Use 1..65535, or 0 to pick a free port.");
  ACCEL_CHECK(o.master_port != 0 || o.num_nodes == 1 || o.rendezvous_file, "accel: master_port 0 "
              "(pick a free port) with num_nodes = ", o.num_nodes, " needs a rendezvous_file "
              "through which node 0 tells the others the port. Pass the same fixed master_port on "
              "every node, or the same rendezvous_file on a filesystem all nodes share.");
  ACCEL_CHECK(!o.master_addr.empty(), "accel: master_addr is empty. Give the host name or IP "
              "address of node 0 (\"127.0.0.1\" on one machine).");
  ACCEL_CHECK(o.timeout.count() > 0, "accel: the launch timeout is ", o.timeout.count(),
              " s. Give a positive timeout.");
  ACCEL_CHECK(o.max_restarts >= 0, "accel: max_restarts is ", o.max_restarts,
              ". Give 0 (a failure ends the launch) or the number of restarts allowed.");
  ACCEL_CHECK(!o.monitor_interval || o.monitor_interval->count() > 0,
              "accel: monitor_interval is ", o.monitor_interval ? o.monitor_interval->count() : 0,
              " s. Give a positive number of seconds, or leave it unset (no hang detection).");
  if (o.mixed_precision) {
    const auto& m = *o.mixed_precision;
    ACCEL_CHECK(m == "no" || m == "fp16" || m == "bf16", "accel: mixed_precision '", m,
                "' is unknown. Use \"no\", \"fp16\" or \"bf16\".");
  }
}

/// The torchrun-style variables of the worker `local_rank` on this node.
/// RANK = node_rank * num_processes + local_rank; WORLD_SIZE = num_nodes * num_processes.
/// job_id (ACCEL_JOB_ID): shared by the workers of one launch, so that a
/// worker reaching another job's store leaves (runtime/store.hpp).
/// restart: the attempt (TORCHELASTIC_RESTART_COUNT, 0 first), as torchrun sets
/// it together with TORCHELASTIC_MAX_RESTARTS.
inline EnvList rank_environment(const LaunchOptions& o, int local_rank, const std::string& job_id = {},
                                int restart = 0) {
  EnvList env{
      {"RANK", std::to_string(o.node_rank * o.num_processes + local_rank)},
      {"WORLD_SIZE", std::to_string(o.num_nodes * o.num_processes)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(o.num_processes)},
      {"NODE_RANK", std::to_string(o.node_rank)},
      {"MASTER_ADDR", o.master_addr},
      {"MASTER_PORT", std::to_string(o.master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts)},
  };
  if (o.mixed_precision) env.emplace_back("ACCEL_MIXED_PRECISION", *o.mixed_precision);
  if (!job_id.empty()) env.emplace_back("ACCEL_JOB_ID", job_id);
  return env;
}

/// A fresh random id for the workers of one launch (ACCEL_JOB_ID).
inline std::string random_job_id() {
  std::random_device rd;
  const auto v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ static_cast<std::uint64_t>(::getpid());
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string id(16, '0');
  for (int i = 0; i < 16; ++i) id[static_cast<std::size_t>(i)] = kDigits[(v >> (4 * i)) & 0xF];
  return id;
}

/// The job id of a launch whose workers all start here (one node); a launch
/// over several nodes without restarts has none, as each node's launcher would
/// draw its own (with restarts machine 0's agent draws it for all).
inline std::string new_job_id(const LaunchOptions& o) { return o.num_nodes == 1 ? random_job_id() : ""; }

/// Intra-op threads per worker: OMP_NUM_THREADS when set to a positive number
/// (the user's choice wins), else max(1, cores / local workers).
inline int threads_per_worker(int local_workers, int cores = available_cores()) {
  if (auto n = positive_env_int("OMP_NUM_THREADS")) return *n;
  return std::max(1, cores / std::max(1, local_workers));
}

/// Resolves host to an IPv4 address (the rendezvous store listens on IPv4).
inline sockaddr_in resolve_ipv4(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  ACCEL_CHECK(rc == 0 && res != nullptr, "accel: cannot resolve master_addr '", host, "' (",
              ::gai_strerror(rc), "). Give an IP address or a host name this machine can resolve.");
  sockaddr_in addr = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

/// --debug's check of another machine's rendezvous address: resolves it and
/// tries one TCP connection. A refusal passes (machine 0's launch may simply
/// not have started yet); no route, or no answer within `timeout` (a firewall,
/// the wrong address), is an accel::Error saying so.
inline void check_reachable(const std::string& host, int port, std::chrono::milliseconds timeout) {
  (void)resolve_ipv4(host, port);  // a clear error when it does not resolve
  const int err = runtime::detail::try_connect(host, port, timeout);
  if (err == 0 || err == ECONNREFUSED) return;
  throw Error(concat("accel: debug launch: the rendezvous address ", host, ":", port,
                     " cannot be reached from this machine (",
                     err == ETIMEDOUT ? "no answer within " + std::to_string(timeout.count() / 1000) + " s"
                                      : std::string(std::strerror(err)),
                     "). Check --main_process_ip (MASTER_ADDR) and that no firewall sits between "
                     "the machines."));
}

/// True when /proc/self/maps text shows the CUDA driver (libcuda.so) loaded:
/// the CUDA runtime loads it on its first call, and a forked child can then no
/// longer use CUDA. Reading the maps never initialises CUDA itself, which no
/// LibTorch 1.13/2.x C++ query guarantees (device_count() calls cuInit).
inline bool cuda_driver_loaded(std::string_view maps) {
  for (std::size_t pos = 0; (pos = maps.find("libcuda.so", pos)) != std::string_view::npos; ++pos)
    if (pos == 0 || maps[pos - 1] == '/') return true;
  return false;
}

inline bool cuda_driver_loaded_in_this_process() {
  std::ifstream in("/proc/self/maps");
  std::stringstream ss;
  ss << in.rdbuf();
  return cuda_driver_loaded(ss.str());
}

/// Accelerate's most reported notebook failure, refused before forking.
inline void refuse_fork_after_cuda() {
  ACCEL_CHECK(!cuda_driver_loaded_in_this_process(),
              "accel: CUDA has already been initialised in this process, and forked workers "
              "cannot use it (\"Cannot re-initialize CUDA in forked subprocess\"). Do not touch "
              "CUDA (tensors, models or devices on the GPU, torch::cuda calls) before "
              "notebook_launcher: create them inside the launched function.");
}

/// ACCEL_DEBUG_MODE worker check: the variables this worker sees are the ones
/// the launcher meant to give it, and form a consistent world.
inline void check_worker_environment(const LaunchOptions& o, int local_rank) {
  const auto env = runtime::ProcessEnv::discover();
  const int rank = o.node_rank * o.num_processes + local_rank;
  ACCEL_CHECK(env.source == "torchrun", "accel: debug launch: worker ", rank,
              " found no RANK/WORLD_SIZE variables (source: ", env.source,
              "). Do not clear the environment before the launched function runs.");
  ACCEL_CHECK(env.rank == rank && env.world_size == o.num_nodes * o.num_processes &&
                  env.local_rank == local_rank && env.local_world_size == o.num_processes,
              "accel: debug launch: worker ", rank, " sees RANK=", env.rank, " WORLD_SIZE=",
              env.world_size, " LOCAL_RANK=", env.local_rank, " LOCAL_WORLD_SIZE=",
              env.local_world_size, ", expected ", rank, "/", o.num_nodes * o.num_processes, "/",
              local_rank, "/", o.num_processes, ". Check what overrides these variables.");
  ACCEL_CHECK(env.master_addr == o.master_addr && env.master_port == o.master_port,
              "accel: debug launch: worker ", rank, " sees MASTER_ADDR:MASTER_PORT ",
              env.master_addr, ":", env.master_port, ", expected ", o.master_addr, ":",
              o.master_port, ". Check what overrides these variables.");
  resolve_ipv4(env.master_addr, env.master_port);  // throws a clear error when unresolvable
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_RANK_ENV_HPP
// end <accel/launch/detail/rank_env.hpp>
// begin <accel/launch/detail/worker_pool.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::launch::WorkerPool, the process supervisor shared
/// by notebook_launcher (fork and run a C++ function) and the `accel launch`
/// command (fork and exec a program): it starts workers, waits for them with a
/// deadline, stops all of them when one fails, and never leaves one behind.
#ifndef ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP
#define ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>


extern char** environ;

namespace accel::detail::launch {

/// How a worker ended (or that it has not yet).
enum class WorkerStatus { Running, Succeeded, Threw, Exited, Signaled, Stopped };

struct WorkerResult {
  int rank = -1;
  pid_t pid = -1;
  WorkerStatus status = WorkerStatus::Running;
  int code = 0;         ///< exit status, or the signal number (Signaled, Stopped)
  std::string message;  ///< exception text, "exited with status N", "killed by signal SIGSEGV"

  bool failed() const {
    return status == WorkerStatus::Threw || status == WorkerStatus::Exited ||
           status == WorkerStatus::Signaled;
  }
  /// Shell convention: 0, the exit status, or 128 + signal.
  int exit_code() const {
    if (status == WorkerStatus::Signaled || status == WorkerStatus::Stopped) return 128 + code;
    return code;
  }
};

struct PoolOutcome {
  std::vector<WorkerResult> workers;          ///< in spawn order
  /// The cause: the first worker seen failing by itself, not because another
  /// one did (accel::detail::caused_by_another_process); else the first seen.
  std::optional<WorkerResult> first_failure;
  bool timed_out = false;                     ///< the pool's deadline passed first
  int interrupted_by = 0;                     ///< signal this process received (SIGINT...), 0 if none
  /// PoolOptions::stop_requested stopped the workers (another machine failed): why.
  std::optional<std::string> stopped_because;

  bool ok() const { return !first_failure && !timed_out && interrupted_by == 0 && !stopped_because; }
  /// For a command-line launcher: 128+signal if interrupted, 124 on timeout,
  /// else the first failure's exit code (at least 1), else 0.
  int exit_code() const {
    if (interrupted_by != 0) return 128 + interrupted_by;
    if (timed_out) return 124;
    if (first_failure) return std::max(1, first_failure->exit_code());
    return stopped_because ? 1 : 0;
  }
  /// What became of the others: "process 0 failed because of it; process 2
  /// was stopped", or "" when there were no others. A process that failed by
  /// itself too is listed with its own message.
  std::string others_summary() const {
    std::vector<int> because, stopped;
    std::string independent;
    for (const auto& w : workers) {
      if (first_failure && w.rank == first_failure->rank) continue;
      if (w.status == WorkerStatus::Stopped || w.status == WorkerStatus::Running) {
        stopped.push_back(w.rank);
      } else if (w.failed() && accel::detail::caused_by_another_process(w.message)) {
        because.push_back(w.rank);
      } else if (w.failed()) {
        const std::string msg = w.message.size() > 300 ? w.message.substr(0, 300) + "..." : w.message;
        independent += (independent.empty() ? "" : "; ") + std::string("process ") +
                       std::to_string(w.rank) + " failed too: " + msg;
      }
    }
    const auto join = [](const std::vector<int>& ranks, const char* one, const char* many) {
      std::string s = ranks.size() == 1 ? "process " : "processes ";
      for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
      return s + (ranks.size() == 1 ? one : many);
    };
    std::string out;
    const auto add = [&out](const std::string& part) { out += (out.empty() ? "" : "; ") + part; };
    if (!because.empty()) add(join(because, " failed because of it", " failed because of it"));
    if (!independent.empty()) add(independent);
    if (!stopped.empty()) add(join(stopped, " was stopped", " were stopped"));
    return out;
  }
  /// Ranks that were still running when the pool stopped them.
  std::vector<int> stopped_ranks() const {
    std::vector<int> r;
    for (const auto& w : workers)
      if (w.status == WorkerStatus::Stopped || w.status == WorkerStatus::Running) r.push_back(w.rank);
    return r;
  }
};

struct PoolOptions {
  /// Bound on the whole run, from the pool's construction to the end of wait().
  std::chrono::milliseconds timeout{std::chrono::seconds{1800}};
  /// Between SIGTERM and SIGKILL when stopping workers.
  std::chrono::milliseconds grace{std::chrono::seconds{5}};
  /// After a first failure, how long the others may take to end by
  /// themselves before they are stopped: processes that fail because of it
  /// then say so, and the report names the one that failed first by itself.
  std::chrono::milliseconds settle{std::chrono::seconds{2}};
  /// Capture each worker's stdout/stderr and forward it line by line, prefixed.
  bool prefix_output = false;
  /// Where captured lines go (stream 1 or 2); default: "[rank N] line" to this
  /// process's stdout/stderr, one write per line so ranks never interleave mid-line.
  std::function<void(int rank, int stream, std::string_view line)> on_output;
  /// SIGINT/SIGTERM/SIGHUP to this process stop the workers and end wait().
  bool handle_signals = true;
  /// Hang detection (LaunchOptions::monitor_interval): each worker gets a file
  /// (ACCEL_HEARTBEAT_FILE) whose time runtime::heartbeat() advances. A worker
  /// that has beaten and then does not for this long is killed (SIGKILL) and
  /// counts as failed. Workers that never beat are never judged.
  std::optional<std::chrono::milliseconds> heartbeat_timeout;
  /// Polled while the workers run (every 20 ms at most): a reason stops them
  /// all, as a failure would (a launch over several machines, another failed).
  std::function<std::optional<std::string>()> stop_requested;
};

/// "[rank 3] " + line: the default prefix of forwarded output.
inline std::string prefixed_line(int rank, std::string_view line) {
  std::string s = "[rank " + std::to_string(rank) + "] ";
  s.append(line);
  s.push_back('\n');
  return s;
}

class WorkerPool {
 public:
  explicit WorkerPool(PoolOptions options = {})
      : options_(std::move(options)), start_(Clock::now()) {
    if (options_.handle_signals) signals_.emplace();
    if (options_.heartbeat_timeout) make_heartbeat_dir();
    // With SIGCHLD ignored the kernel reaps children itself and waitpid could
    // not report how they ended: use the default while the pool lives.
    struct sigaction current {};
    if (::sigaction(SIGCHLD, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) {
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      sigemptyset(&dfl.sa_mask);
      ::sigaction(SIGCHLD, &dfl, &old_sigchld_);
      restore_sigchld_ = true;
    }
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  /// Stops and reaps whatever is still running.
  ~WorkerPool() {
    try {
      if (running() > 0) stop_all();
    } catch (...) {
    }
    if (restore_sigchld_) ::sigaction(SIGCHLD, &old_sigchld_, nullptr);
    if (!heartbeat_dir_.empty()) {
      for (const auto& w : workers_)
        if (!w.heartbeat.empty()) ::unlink(w.heartbeat.c_str());
      ::rmdir(heartbeat_dir_.c_str());
    }
  }

  /// Forks a worker that sets `env`, runs `fn` and exits: 0 on return; on an
  /// exception, its what() goes to the parent and the exit status is 1. The
  /// child never returns into the caller and never runs atexit handlers.
  pid_t spawn(int rank, const EnvList& given, std::function<void()> fn) {
    const EnvList env = with_heartbeat(rank, given);
    return fork_worker(rank, [&](int err_fd) {
      for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
      int code = 0;
      try {
        fn();
      } catch (const std::exception& e) {
        report(err_fd, e.what());
        code = 1;
      } catch (...) {
        report(err_fd, "unknown exception (not derived from std::exception)");
        code = 1;
      }
      flush_stdio();
      ::_exit(code);
    });
  }

  /// Forks a worker that execs argv (argv[0] searched in PATH) with this
  /// process's environment plus `env`. Exec failure: status 127 and a message.
  pid_t spawn_exec(int rank, const EnvList& given, const std::vector<std::string>& argv) {
    if (argv.empty())
      throw Error("accel: spawn_exec() got an empty command line. Pass the program to run first.");
    const EnvList env = with_heartbeat(rank, given);
    // Everything is prepared before fork: the child only makes async-signal-safe calls.
    std::vector<std::string> envs;
    for (char** e = environ; e && *e; ++e) {
      std::string_view entry(*e);
      std::string_view key = entry.substr(0, entry.find('='));
      bool overridden = false;
      for (const auto& kv : env) overridden = overridden || kv.first == key;
      if (!overridden) envs.emplace_back(entry);
    }
    for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
    std::vector<char*> cargv, cenv;
    for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
    for (const auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
    cargv.push_back(nullptr);
    cenv.push_back(nullptr);
    const std::string failure = "cannot execute '" + argv[0] + "': ";
    return fork_worker(rank, [&](int err_fd) {
      ::execvpe(cargv[0], cargv.data(), cenv.data());
      const char* why = std::strerror(errno);
      write_all(err_fd, failure.data(), failure.size());
      write_all(err_fd, why, std::strlen(why));
      ::_exit(127);
    });
  }

  /// Waits until every worker has ended, one failed (the others are then
  /// stopped), the deadline passed, or this process got SIGINT/SIGTERM/SIGHUP.
  /// Everything has been reaped when it returns (unless stuck in the kernel).
  PoolOutcome wait() {
    PoolOutcome out;
    const auto deadline = start_ + options_.timeout;
    std::vector<std::size_t> failed;  // in the order seen
    while (running() > 0) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      pump(static_cast<int>(std::clamp<long long>(left.count(), 0, 20)));
      for (std::size_t i : reap())
        if (workers_[i].result.failed()) failed.push_back(i);
      if (failed.empty() && options_.heartbeat_timeout) check_heartbeats();
      if (!failed.empty()) {
        settle(failed);
        stop_all();
        break;
      }
      if (int sig = signals_ ? StopSignalGuard::received() : 0; sig != 0) {
        out.interrupted_by = sig;
        stop_all(sig);  // forwarded as received: Ctrl-C reaches the workers as SIGINT
        break;
      }
      if (running() > 0 && Clock::now() >= deadline) {
        out.timed_out = true;
        stop_all();
        break;
      }
      if (options_.stop_requested && running() > 0) {
        if (auto why = options_.stop_requested()) {
          out.stopped_because = std::move(why);
          stop_all();
          break;
        }
      }
    }
    pump(0);
    for (auto& w : workers_) {
      flush_partial(w);
      out.workers.push_back(w.result);
    }
    if (!failed.empty()) {
      const auto cause = std::find_if(failed.begin(), failed.end(), [&](std::size_t i) {
        return !accel::detail::caused_by_another_process(workers_[i].result.message);
      });
      out.first_failure = workers_[cause != failed.end() ? *cause : failed.front()].result;
    }
    return out;
  }

  /// Lets the other workers end by themselves for up to options_.settle,
  /// adding those that fail to `failed`.
  void settle(std::vector<std::size_t>& failed) {
    const auto until = Clock::now() + options_.settle;
    while (running() > 0 && Clock::now() < until) {
      pump(10);
      for (std::size_t i : reap())
        if (workers_[i].result.failed()) failed.push_back(i);
    }
  }

  /// `first` (SIGTERM) to every running worker's process group, SIGKILL to
  /// those still there after the grace period, and reap them (bounded wait).
  void stop_all(int first = SIGTERM) {
    stopping_ = true;
    signal_running(first);
    wait_until(Clock::now() + options_.grace);
    if (running() > 0) {
      signal_running(SIGKILL);
      wait_until(Clock::now() + std::chrono::seconds(10));
    }
  }

  std::size_t running() const {
    std::size_t n = 0;
    for (const auto& w : workers_) n += w.result.status == WorkerStatus::Running;
    return n;
  }
  std::size_t size() const { return workers_.size(); }
  std::vector<pid_t> pids() const {
    std::vector<pid_t> p;
    for (const auto& w : workers_) p.push_back(w.result.pid);
    return p;
  }

 private:
  using Clock = std::chrono::steady_clock;

  struct Worker {
    WorkerResult result;
    Fd err, out, errout;  // parent's read ends: error report, captured stdout/stderr
    std::string err_text, out_buf, errout_buf;
    std::string heartbeat;   ///< its ACCEL_HEARTBEAT_FILE, "" without hang detection
    timespec created{};      ///< the file's time before the worker started
    bool beating = false;    ///< it has beaten at least once
    double hung_for = 0;     ///< > 0: killed as hung after this many seconds without a beat
  };

  using RealClock = std::chrono::system_clock;

  void make_heartbeat_dir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                          "/accel-heartbeat-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr)
      throw Error(std::string("accel: cannot create a directory for the heartbeat files of hang "
                              "detection (") + std::strerror(errno) + "). Set TMPDIR to a "
                  "writable directory, or launch without a monitor interval.");
    heartbeat_dir_ = pattern;
  }

  /// env plus this worker's heartbeat file (created now, its time remembered).
  EnvList with_heartbeat(int rank, const EnvList& env) {
    pending_heartbeat_.clear();
    if (heartbeat_dir_.empty()) return env;
    const std::string path = heartbeat_dir_ + "/rank_" + std::to_string(rank) + "_" +
                             std::to_string(workers_.size());
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    struct stat st {};
    if (fd < 0 || ::fstat(fd, &st) != 0) {
      const int e = errno;
      if (fd >= 0) ::close(fd);
      throw Error("accel: cannot create the heartbeat file '" + path + "' (" + std::strerror(e) +
                  "). Set TMPDIR to a writable directory, or launch without a monitor interval.");
    }
    ::close(fd);
    pending_heartbeat_ = path;
    pending_created_ = st.st_mtim;
    EnvList out = env;
    out.emplace_back("ACCEL_HEARTBEAT_FILE", path);
    return out;
  }

  /// Kills the worker that has gone longest without a beat, if that is more
  /// than the timeout (one at a time: the others, blocked in a collective
  /// with it, stop beating too, and are the ones that failed because of it).
  void check_heartbeats() {
    const auto now = Clock::now();
    if (now - last_heartbeat_check_ < std::chrono::milliseconds(100)) return;
    last_heartbeat_check_ = now;
    const double limit = std::chrono::duration<double>(*options_.heartbeat_timeout).count();
    const double wall = std::chrono::duration<double>(RealClock::now().time_since_epoch()).count();
    Worker* worst = nullptr;
    double worst_age = limit;
    for (auto& w : workers_) {
      if (w.result.status != WorkerStatus::Running || w.heartbeat.empty() || w.hung_for > 0) continue;
      struct stat st {};
      if (::stat(w.heartbeat.c_str(), &st) != 0) continue;
      if (!w.beating) {
        w.beating = st.st_mtim.tv_sec != w.created.tv_sec || st.st_mtim.tv_nsec != w.created.tv_nsec;
        if (!w.beating) continue;
      }
      const double age = wall - (static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec * 1e-9);
      if (age > worst_age) {
        worst = &w;
        worst_age = age;
      }
    }
    if (worst == nullptr) return;
    worst->hung_for = worst_age;
    if (::kill(-worst->result.pid, SIGKILL) != 0) ::kill(worst->result.pid, SIGKILL);
  }

  static void report(int fd, const char* what) noexcept {
    std::size_t n = std::min<std::size_t>(std::strlen(what), 64 * 1024);
    if (n == 0) {
      what = "an exception with an empty message";
      n = std::strlen(what);
    }
    write_all(fd, what, n);
  }

  static void flush_stdio() noexcept {
    try {
      std::cout.flush();
      std::cerr.flush();
      std::clog.flush();
    } catch (...) {
    }
    std::fflush(nullptr);
  }

  template <class Child>
  pid_t fork_worker(int rank, Child&& child) {
    // Unflushed parent output would be duplicated by every child that flushes.
    flush_stdio();
    Pipe err = Pipe::make();
    std::optional<Pipe> out, errout;
    if (options_.prefix_output) {
      out = Pipe::make();
      errout = Pipe::make();
    }
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) {
      int e = errno;
      stop_all();
      throw Error(std::string("accel: cannot fork worker ") + std::to_string(rank) + " (" +
                  std::strerror(e) + "). Launch fewer processes or raise the process limit.");
    }
    if (pid == 0) {
      // Own process group: stopping a worker also stops whatever it started.
      ::setpgid(0, 0);
#ifdef __linux__
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher died: do not linger
      if (::getppid() != parent) ::_exit(1);
#endif
      // Default dispositions: the launcher, not inherited test-framework or
      // user handlers, reports a worker's crash.
      for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL})
        ::signal(sig, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      StopSignalGuard::forget_after_fork();
      if (out) {
        ::dup2(out->write.get(), STDOUT_FILENO);
        ::dup2(errout->write.get(), STDERR_FILENO);
      }
      child(err.write.get());
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from the parent, so signalling the group never races
    Worker w;
    w.result.rank = rank;
    w.result.pid = pid;
    w.err = std::move(err.read);
    w.heartbeat = std::move(pending_heartbeat_);
    w.created = pending_created_;
    if (out) {
      w.out = std::move(out->read);
      w.errout = std::move(errout->read);
    }
    workers_.push_back(std::move(w));
    return pid;
  }

  void signal_running(int sig) {
    for (const auto& w : workers_) {
      if (w.result.status != WorkerStatus::Running) continue;
      if (::kill(-w.result.pid, sig) != 0) ::kill(w.result.pid, sig);
    }
  }

  void wait_until(Clock::time_point until) {
    while (running() > 0 && Clock::now() < until) {
      pump(10);
      reap();
    }
  }

  /// Polls the signal pipe and every open worker pipe for up to timeout_ms,
  /// and consumes what is readable.
  void pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Worker*, int>> owner;  // which worker, which stream (0 err, 1, 2)
    if (signals_ && signals_->fd() >= 0) {
      fds.push_back({signals_->fd(), POLLIN, 0});
      owner.emplace_back(nullptr, 0);
    }
    for (auto& w : workers_) {
      for (auto [fd, stream] : {std::pair{&w.err, 0}, {&w.out, 1}, {&w.errout, 2}}) {
        if (!fd->valid()) continue;
        fds.push_back({fd->get(), POLLIN, 0});
        owner.emplace_back(&w, stream);
      }
    }
    if (fds.empty()) {
      if (timeout_ms > 0) ::usleep(static_cast<useconds_t>(timeout_ms) * 1000);
      return;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      if (owner[i].first == nullptr) {
        std::string drop;
        read_available(fds[i].fd, drop);
        continue;
      }
      consume(*owner[i].first, owner[i].second);
    }
  }

  void consume(Worker& w, int stream) {
    Fd& fd = stream == 0 ? w.err : stream == 1 ? w.out : w.errout;
    std::string& buf = stream == 0 ? w.err_text : stream == 1 ? w.out_buf : w.errout_buf;
    bool open = read_available(fd.get(), buf);
    if (!open) fd.reset();
    if (stream == 0) {
      if (buf.size() > 64 * 1024) buf.resize(64 * 1024);
      return;
    }
    std::size_t start = 0;
    for (std::size_t nl; (nl = buf.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(w.result.rank, stream, std::string_view(buf).substr(start, nl - start));
    buf.erase(0, start);
    if (buf.size() > 64 * 1024 || (!open && !buf.empty())) {
      emit(w.result.rank, stream, buf);
      buf.clear();
    }
  }

  void emit(int rank, int stream, std::string_view line) {
    if (options_.on_output) {
      options_.on_output(rank, stream, line);
      return;
    }
    std::string s = prefixed_line(rank, line);
    write_all(stream == 1 ? STDOUT_FILENO : STDERR_FILENO, s.data(), s.size());
  }

  void flush_partial(Worker& w) {
    for (int stream : {1, 2}) {
      std::string& buf = stream == 1 ? w.out_buf : w.errout_buf;
      if (!buf.empty()) emit(w.result.rank, stream, buf);
      buf.clear();
    }
  }

  /// Reaps the workers that ended; returns their indices in spawn order.
  std::vector<std::size_t> reap() {
    std::vector<std::size_t> ended;
    for (std::size_t i = 0; i < workers_.size(); ++i) {
      Worker& w = workers_[i];
      if (w.result.status != WorkerStatus::Running) continue;
      int st = 0;
      pid_t r = ::waitpid(w.result.pid, &st, WNOHANG);
      if (r == 0 || (r < 0 && errno == EINTR)) continue;
      // The child is gone: whatever it wrote before exiting is in the pipes.
      for (int stream : {0, 1, 2})
        if ((stream == 0 ? w.err : stream == 1 ? w.out : w.errout).valid()) consume(w, stream);
      classify(w, r < 0 ? -1 : st);
      ended.push_back(i);
    }
    return ended;
  }

  void classify(Worker& w, int st) {
    WorkerResult& r = w.result;
    if (st < 0) {  // not our child any more (someone else reaped it)
      r.status = WorkerStatus::Exited;
      r.code = 1;
      r.message = "vanished (reaped by someone else)";
    } else if (WIFEXITED(st)) {
      r.code = WEXITSTATUS(st);
      if (r.code == 0) {
        r.status = WorkerStatus::Succeeded;  // it returned normally, even if a stop was under way
      } else if (!w.err_text.empty()) {
        r.status = WorkerStatus::Threw;
        r.message = w.err_text;
      } else {
        r.status = WorkerStatus::Exited;
        r.message = "exited with status " + std::to_string(r.code);
      }
      if (stopping_ && r.status == WorkerStatus::Exited) r.status = WorkerStatus::Stopped;
    } else if (WIFSIGNALED(st) && w.hung_for > 0) {
      r.code = WTERMSIG(st);
      r.status = WorkerStatus::Signaled;  // a failure of its own, even if a stop began since
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", w.hung_for);
      r.message = std::string("made no progress (no heartbeat) for ") + secs +
                  " s, more than the monitor interval of " +
                  std::to_string(std::chrono::duration_cast<std::chrono::seconds>(
                                     *options_.heartbeat_timeout).count()) +
                  " s; it was killed as hung";
    } else if (WIFSIGNALED(st)) {
      r.code = WTERMSIG(st);
      r.status = stopping_ ? WorkerStatus::Stopped : WorkerStatus::Signaled;
      r.message = (stopping_ ? "stopped by signal " : "killed by signal ") + signal_name(r.code);
      if (!stopping_ && !w.err_text.empty()) r.message = w.err_text + " (then " + r.message + ")";
    }
  }

  PoolOptions options_;
  Clock::time_point start_;
  std::optional<StopSignalGuard> signals_;
  std::vector<Worker> workers_;
  bool stopping_ = false;
  bool restore_sigchld_ = false;
  std::string heartbeat_dir_;       ///< "" without hang detection
  std::string pending_heartbeat_;   ///< with_heartbeat() -> fork_worker()
  timespec pending_created_{};
  Clock::time_point last_heartbeat_check_{};
  struct sigaction old_sigchld_ {};
};

/// Runs f() on a new thread, waits for it and returns its result (or rethrows).
/// Fork C++-function workers from such a thread: a child inherits the forking
/// thread's GNU OpenMP pool, whose threads do not exist in the child, so its
/// first parallel region would hang; a fresh thread has no pool. The thread must
/// outlive the workers, because PR_SET_PDEATHSIG follows the forking thread.
template <class F>
auto on_fresh_thread(F&& f) -> decltype(f()) {
  std::optional<decltype(f())> result;
  std::exception_ptr error;
  std::thread t([&] {
    try {
      result.emplace(f());
    } catch (...) {
      error = std::current_exception();
    }
  });
  t.join();
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_WORKER_POOL_HPP
// end <accel/launch/detail/worker_pool.hpp>

namespace accel::detail::launch {

inline constexpr const char* kAgentProtocol = "accel-agent-1";

/// What the launchers agreed to do next.
struct AgentStep {
  bool finished = false;       ///< the launch is over; `outcome` says how
  int attempt = 0;             ///< the attempt to start (0 first), or the last one
  int worker_port = 0;         ///< where this attempt's workers meet (MASTER_PORT)
  std::string job_id;          ///< ACCEL_JOB_ID of every worker of the attempt
  std::string restart_reason;  ///< attempt > 0: why, as every machine prints it
  PoolOutcome outcome;         ///< finished: every machine's workers, and the cause
};

/// "process 1 failed on attempt 1 of 3: killed by signal SIGKILL; process 0 was stopped".
inline std::string attempt_failure(const PoolOutcome& out, int attempt, int attempts) {
  const auto& w = *out.first_failure;
  std::string msg = w.message.size() > 500 ? w.message.substr(0, 500) + "..." : w.message;
  const std::string others = out.others_summary();
  return "process " + std::to_string(w.rank) + " failed on attempt " + std::to_string(attempt + 1) +
         " of " + std::to_string(attempts) + ": " + msg + (others.empty() ? "" : "; " + others);
}

/// "Restarting all 4 processes on 2 machines (restart 1 of 3)."
inline std::string restarting(const LaunchOptions& o, int restart) {
  const int all = o.num_processes * o.num_nodes;
  return "Restarting " + (all == 1 ? std::string("the process") : "all " + std::to_string(all) + " processes") +
         (o.num_nodes > 1 ? " on " + std::to_string(o.num_nodes) + " machines" : "") + " (restart " +
         std::to_string(restart) + " of " + std::to_string(o.max_restarts) + ").";
}

namespace agent {

using Clock = std::chrono::steady_clock;

/// Workers as message fields: the count, then rank, pid, status, code, message of each.
inline void put_workers(AgentMessage& m, const std::vector<WorkerResult>& workers) {
  m.push_back(std::to_string(workers.size()));
  for (const auto& w : workers) {
    m.push_back(std::to_string(w.rank));
    m.push_back(std::to_string(w.pid));
    m.push_back(std::to_string(static_cast<int>(w.status)));
    m.push_back(std::to_string(w.code));
    m.push_back(w.message);
  }
}

inline int to_int(const std::string& s) {
  std::size_t used = 0;
  const int v = std::stoi(s, &used);
  if (used != s.size()) throw std::invalid_argument(s);
  return v;
}

/// The inverse of put_workers from field `at`; throws std::exception on a malformed message.
inline std::vector<WorkerResult> get_workers(const AgentMessage& m, std::size_t at) {
  const int n = to_int(m.at(at));
  if (n < 0 || m.size() < at + 1 + 5 * static_cast<std::size_t>(n)) throw std::out_of_range("workers");
  std::vector<WorkerResult> out(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) {
    const std::size_t f = at + 1 + 5 * static_cast<std::size_t>(i);
    auto& w = out[static_cast<std::size_t>(i)];
    w.rank = to_int(m[f]);
    w.pid = to_int(m[f + 1]);
    const int status = to_int(m[f + 2]);
    if (status < 0 || status > static_cast<int>(WorkerStatus::Stopped)) throw std::out_of_range("status");
    w.status = static_cast<WorkerStatus>(status);
    w.code = to_int(m[f + 3]);
    w.message = m[f + 4];
  }
  return out;
}

/// One machine's part of an attempt, in the order machine 0 learned of them.
struct MachineResult {
  int node = 0;
  std::vector<WorkerResult> workers;
  std::optional<int> cause_rank;  ///< the machine's own first failure
};

/// Every machine's workers as one outcome, rank order; the cause is the first
/// failure (in the order reported) that did not fail because of another process.
inline PoolOutcome combine(const std::vector<MachineResult>& results) {
  PoolOutcome out;
  std::vector<WorkerResult> candidates;
  for (const auto& r : results) {
    for (const auto& w : r.workers) out.workers.push_back(w);
    for (const auto& w : r.workers)
      if (r.cause_rank && w.rank == *r.cause_rank) candidates.push_back(w);
  }
  for (const auto& r : results)
    for (const auto& w : r.workers)
      if (w.failed() && !(r.cause_rank && w.rank == *r.cause_rank)) candidates.push_back(w);
  std::sort(out.workers.begin(), out.workers.end(),
            [](const WorkerResult& a, const WorkerResult& b) { return a.rank < b.rank; });
  const auto own = std::find_if(candidates.begin(), candidates.end(), [](const WorkerResult& w) {
    return !accel::detail::caused_by_another_process(w.message);
  });
  if (own != candidates.end()) out.first_failure = *own;
  else if (!candidates.empty()) out.first_failure = candidates.front();
  return out;
}

inline MachineResult local_result(int node, const PoolOutcome& out) {
  MachineResult r{node, out.workers, std::nullopt};
  if (out.first_failure) r.cause_rank = out.first_failure->rank;
  return r;
}

/// A machine whose launcher disappeared during an attempt: one failed worker
/// (its first rank) that says so.
inline MachineResult lost_machine(const LaunchOptions& o, int node, const std::string& why) {
  WorkerResult w;
  w.rank = node * o.num_processes;
  w.status = WorkerStatus::Exited;
  w.code = 1;
  const int last = w.rank + o.num_processes - 1;
  w.message = "machine " + std::to_string(node) + " (process" +
              (last == w.rank ? " " + std::to_string(w.rank)
                              : "es " + std::to_string(w.rank) + "-" + std::to_string(last)) +
              ") was lost: " + why;
  return {node, {w}, w.rank};
}

/// "1, 3" (machines not yet there).
inline std::string list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace agent

/// The launcher's side of a launch over several machines.
class NodeAgent {
 public:
  virtual ~NodeAgent() = default;
  /// Blocks until the next attempt starts on every machine, or the launch is over.
  virtual AgentStep next() = 0;
  /// Polled while this machine's workers run: why they must stop (another
  /// machine failed or was lost), or nothing.
  virtual std::optional<std::string> stop_requested() = 0;
  /// This machine's workers after the attempt (ended, failed or stopped).
  virtual void finish_attempt(const PoolOutcome& local) = 0;
  /// This launch was interrupted or timed out: tell the others to stop.
  virtual void abort(const std::string& why) = 0;
};

/// Machine 0: hosts the rendezvous, collects every machine's result, decides.
class AgentServer final : public NodeAgent {
 public:
  AgentServer(LaunchOptions o, bool any_port, agent::Clock::time_point deadline,
              std::chrono::seconds rdzv_timeout, std::ostream& log)
      : o_(std::move(o)), any_port_(any_port), deadline_(deadline), rdzv_timeout_(rdzv_timeout),
        log_(log), members_(static_cast<std::size_t>(o_.num_nodes), -1) {
    const int fd = bind_tcp(o_.master_addr, o_.master_port);
    if (fd < 0)
      throw Error("accel: machine 0 cannot host the rendezvous of the launchers on " + o_.master_addr +
                  ":" + std::to_string(o_.master_port) + " (" + std::strerror(-fd) + "). " +
                  (fd == -EADDRINUSE ? "Another program holds the port: pick another "
                                       "--main_process_port (master_port) on every machine."
                                     : "Check --main_process_ip (master_addr): it must be an "
                                       "address of machine 0."));
    listener_ = Fd(fd);
    ::listen(fd, 64);
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  }

  AgentStep next() override {
    if (attempt_ >= 0) {
      collect_results();
      if (abort_) {
        broadcast({"FINISH", "aborted", *abort_});
        throw Error("accel: " + *abort_ + "; every machine's processes were stopped.");
      }
      PoolOutcome all = agent::combine(results_);
      if (all.ok() || attempt_ >= o_.max_restarts) {
        AgentMessage m{"FINISH", all.ok() ? "ok" : "failed", std::to_string(attempt_)};
        agent::put_workers(m, all.workers);
        m.push_back(all.first_failure ? std::to_string(all.first_failure->rank) : "-1");
        broadcast(m);
        return finished(std::move(all));
      }
      reason_ = attempt_failure(all, attempt_, o_.max_restarts + 1) + ". " + restarting(o_, attempt_ + 1);
    }
    wait_for_machines();
    ++attempt_;
    results_.clear();
    stop_sent_ = false;
    const int port = worker_port();
    const std::string job = random_job_id();
    broadcast({"START", std::to_string(attempt_), std::to_string(port), job, reason_});
    AgentStep s;
    s.attempt = attempt_;
    s.worker_port = port;
    s.job_id = job;
    s.restart_reason = reason_;
    return s;
  }

  std::optional<std::string> stop_requested() override {
    accept_and_read(0);
    if (!stop_sent_) return std::nullopt;
    return why_stop_;
  }

  void finish_attempt(const PoolOutcome& local) override {
    results_.push_back(agent::local_result(0, local));
    note_failures();
  }

  void abort(const std::string& why) override { broadcast({"FINISH", "aborted", "machine 0's " + why}); }

 private:
  struct Peer {
    AgentChannel channel;
    int node = -1;  ///< -1 until its HELLO
  };

  AgentStep finished(PoolOutcome all) {
    AgentStep s;
    s.finished = true;
    s.attempt = attempt_;
    s.outcome = std::move(all);
    return s;
  }

  bool has_result(int node) const {
    return std::any_of(results_.begin(), results_.end(),
                       [&](const agent::MachineResult& r) { return r.node == node; });
  }

  /// Waits until every machine reported this attempt (or was lost).
  void collect_results() {
    for (;;) {
      // A machine that left without a result (its launch was interrupted) has none to give.
      bool all = has_result(0);
      for (int n = 1; n < o_.num_nodes; ++n)
        all = all && (has_result(n) || members_[static_cast<std::size_t>(n)] < 0);
      if (all) return;
      if (agent::Clock::now() >= deadline_)
        throw TimeoutError("accel: machine 0 waited for the other machines to report attempt " +
                           std::to_string(attempt_ + 1) + " until the launch timeout. Check that "
                           "their launchers still run.");
      accept_and_read(50);
    }
  }

  /// Before an attempt: every machine's launcher is connected.
  void wait_for_machines() {
    const auto start = agent::Clock::now();
    const auto until = std::min(deadline_, start + rdzv_timeout_);
    const auto bound = std::chrono::duration_cast<std::chrono::seconds>(until - start).count();
    runtime::detail::WaitReports reports(start);
    for (;;) {
      accept_and_read(0);
      std::vector<int> missing;
      for (int n = 1; n < o_.num_nodes; ++n)
        if (members_[static_cast<std::size_t>(n)] < 0) missing.push_back(n);
      if (missing.empty()) return;
      const std::string who = std::string(missing.size() == 1 ? "machine " : "machines ") +
                              agent::list(missing);
      if (agent::Clock::now() >= until) {
        const std::string text = who + " did not " + (attempt_ < 0 ? "join" : "rejoin") +
                                 " the launch at " + o_.master_addr + ":" + std::to_string(o_.master_port) +
                                 " within " + std::to_string(reports.seconds()) + " s";
        broadcast({"FINISH", "aborted", text});
        throw TimeoutError("accel: " + text + " (the rendezvous timeout, --rdzv_timeout / "
                           "ACCEL_RDZV_TIMEOUT). Start the launch on " + who + " with the same "
                           "--main_process_ip and --main_process_port, or launch on fewer machines.");
      }
      if (reports.due())
        log_ << "accel: machine 0 waiting at " << o_.master_addr << ":" << o_.master_port << " for "
             << who << (attempt_ < 0 ? " to join" : " to rejoin for restart " + std::to_string(attempt_ + 1))
             << " (" << (o_.num_nodes - static_cast<int>(missing.size())) << " of " << o_.num_nodes
             << " machines there, " << reports.seconds() << " s of " << bound << " s)." << std::endl;
      accept_and_read(50);
    }
  }

  /// Where the workers of the next attempt meet: master_port + 1 when it is
  /// free (the usual second port to open in a firewall), else a free port.
  int worker_port() const {
    if (!any_port_ && o_.master_port < 65535) {
      const int fd = bind_tcp(o_.master_addr, o_.master_port + 1);
      if (fd >= 0) {
        ::close(fd);
        return o_.master_port + 1;
      }
    }
    return pick_free_port(o_.master_addr);
  }

  void broadcast(const AgentMessage& m) {
    for (auto& p : peers_)
      if (p.node > 0) p.channel.send(m);
  }

  void accept_and_read(int ms) {
    std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}};
    for (auto& p : peers_) fds.push_back({p.channel.fd(), POLLIN, 0});
    if (::poll(fds.data(), fds.size(), ms) <= 0) return;
    // Existing connections first: a machine that died and was started again
    // is seen gone before its new launcher says hello.
    for (std::size_t i = 0; i < peers_.size(); ++i) {
      Peer& p = peers_[i];
      std::vector<AgentMessage> msgs;
      const bool open = p.channel.receive(msgs);
      for (const auto& m : msgs) handle(p, m);
      if (!open || !p.channel.open()) drop(p);
    }
    peers_.erase(std::remove_if(peers_.begin(), peers_.end(), [](const Peer& p) { return !p.channel.open(); }),
                 peers_.end());
    reindex();
    for (;;) {
      const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) break;
      peers_.push_back(Peer{AgentChannel(Fd(fd)), -1});
    }
    reindex();
    note_failures();
  }

  void reindex() {
    std::fill(members_.begin(), members_.end(), -1);
    for (std::size_t i = 0; i < peers_.size(); ++i)
      if (peers_[i].node > 0 && peers_[i].channel.open()) members_[static_cast<std::size_t>(peers_[i].node)] = static_cast<int>(i);
  }

  void refuse(Peer& p, const std::string& why) {
    p.channel.send({"REFUSE", why});
    p.channel.close();
  }

  void handle(Peer& p, const AgentMessage& m) {
    try {
      if (m.at(0) == "HELLO") {
        const int node = agent::to_int(m.at(2));
        if (m.at(1) != kAgentProtocol) return refuse(p, "it speaks another protocol (" + m[1] + ")");
        if (agent::to_int(m.at(3)) != o_.num_nodes || agent::to_int(m.at(4)) != o_.num_processes)
          return refuse(p, "machine " + m[2] + " was started for " + m[3] + " machines with " + m[4] +
                               " processes each; machine 0 for " + std::to_string(o_.num_nodes) +
                               " with " + std::to_string(o_.num_processes) + ". Give every machine the "
                               "same --num_machines and --num_processes");
        if (node < 1 || node >= o_.num_nodes)
          return refuse(p, "machine rank " + m[2] + " is not in 1.." + std::to_string(o_.num_nodes - 1));
        reindex();
        if (members_[static_cast<std::size_t>(node)] >= 0)
          return refuse(p, "machine " + m[2] + " is already in this launch. Give every machine its own "
                           "--machine_rank (node_rank)");
        p.node = node;
        if (attempt_ >= 0)
          log_ << "accel: machine " << node << " joined; it takes part from the next attempt." << std::endl;
      } else if (m.at(0) == "RESULT" && p.node > 0) {
        if (agent::to_int(m.at(1)) != attempt_ || has_result(p.node)) return;
        agent::MachineResult r{p.node, agent::get_workers(m, 2), std::nullopt};
        const std::size_t at = 3 + 5 * r.workers.size();
        if (m.size() > at && m[at] != "-1") r.cause_rank = agent::to_int(m[at]);
        results_.push_back(std::move(r));
      } else if (m.at(0) == "ABORT" && p.node > 0) {
        abort_ = "machine " + std::to_string(p.node) + "'s " + m.at(1);
        stop_everyone("machine " + std::to_string(p.node) + "'s launch was stopped");
      }
    } catch (const std::exception&) {
      p.channel.close();  // not an accel launcher, or a different version
    }
  }

  /// A member's connection closed: during an attempt that it has not
  /// reported, the machine is lost (a failure of that attempt).
  void drop(Peer& p) {
    p.channel.close();
    if (p.node <= 0 || attempt_ < 0 || has_result(p.node) || abort_) return;
    results_.push_back(agent::lost_machine(o_, p.node,
                                           "its launcher's connection to machine 0 closed (the "
                                           "machine died, or its launch was killed)"));
  }

  /// The first failure of an attempt stops every machine's workers.
  void note_failures() {
    if (stop_sent_ || attempt_ < 0) return;
    for (const auto& r : results_) {
      if (!r.cause_rank) continue;
      stop_everyone("process " + std::to_string(*r.cause_rank) + " on machine " + std::to_string(r.node) +
                    " failed");
      return;
    }
  }

  void stop_everyone(const std::string& why) {
    if (stop_sent_) return;
    stop_sent_ = true;
    why_stop_ = why;
    broadcast({"STOP", std::to_string(attempt_), why});
  }

  LaunchOptions o_;
  bool any_port_;
  agent::Clock::time_point deadline_;
  std::chrono::seconds rdzv_timeout_;
  std::ostream& log_;
  Fd listener_;
  std::vector<Peer> peers_;
  std::vector<int> members_;  ///< node -> index in peers_, -1 if not connected
  int attempt_ = -1;
  std::vector<agent::MachineResult> results_;  ///< this attempt's, in the order learned
  bool stop_sent_ = false;
  std::string why_stop_;
  std::string reason_;                ///< why the attempt about to start is a restart
  std::optional<std::string> abort_;  ///< a machine's launch was interrupted or timed out
};

/// Machines 1..N-1: connect to machine 0's launcher, follow its decisions.
class AgentClient final : public NodeAgent {
 public:
  AgentClient(LaunchOptions o, agent::Clock::time_point deadline, std::chrono::seconds rdzv_timeout,
              std::ostream& log)
      : o_(std::move(o)), deadline_(deadline), log_(log) {
    const auto until = std::min(deadline_, agent::Clock::now() + rdzv_timeout);
    runtime::detail::WaitReports reports(agent::Clock::now());
    for (;;) {
      int err = 0;
      const int fd = runtime::detail::connect_tcp(o_.master_addr, o_.master_port, std::chrono::seconds(2), err);
      if (fd >= 0) {
        channel_ = AgentChannel(Fd(fd));
        break;
      }
      if (err == EADDRNOTAVAIL)
        throw Error("accel: machine " + std::to_string(o_.node_rank) + " cannot resolve the address of "
                    "machine 0, '" + o_.master_addr + "'. Give --main_process_ip (master_addr) as an IP "
                    "address or a host name this machine resolves.");
      if (agent::Clock::now() >= until)
        throw TimeoutError("accel: machine " + std::to_string(o_.node_rank) + " could not reach machine "
                           "0's launcher at " + where() + " within " + std::to_string(reports.seconds()) +
                           " s (" + std::strerror(err) + "; the rendezvous timeout, --rdzv_timeout / "
                           "ACCEL_RDZV_TIMEOUT). Start the launch on machine 0 too, and check "
                           "--main_process_ip and --main_process_port.");
      if (reports.due())
        log_ << "accel: machine " << o_.node_rank << " waiting for machine 0's launcher at " << where()
             << " (" << std::strerror(err) << ", " << reports.seconds() << " s)." << std::endl;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    channel_.send({"HELLO", kAgentProtocol, std::to_string(o_.node_rank), std::to_string(o_.num_nodes),
                   std::to_string(o_.num_processes), std::to_string(o_.max_restarts)});
  }

  AgentStep next() override {
    for (;;) {
      for (; !pending_.empty(); pending_.erase(pending_.begin())) {
        const AgentMessage& m = pending_.front();
        if (m.empty()) continue;
        if (m[0] == "REFUSE")
          throw Error("accel: machine 0 refused machine " + std::to_string(o_.node_rank) + ": " +
                      m.at(1) + ".");
        if (m[0] == "START" && agent::to_int(m.at(1)) > attempt_) {
          attempt_ = agent::to_int(m[1]);
          stop_.reset();
          AgentStep s;
          s.attempt = attempt_;
          s.worker_port = agent::to_int(m.at(2));
          s.job_id = m.at(3);
          s.restart_reason = m.at(4);
          pending_.erase(pending_.begin());
          return s;
        }
        if (m[0] == "FINISH") return finish(m);
      }
      if (!channel_.open()) throw lost();
      if (agent::Clock::now() >= deadline_)
        throw TimeoutError("accel: machine " + std::to_string(o_.node_rank) + " waited for machine 0 "
                           "until the launch timeout.");
      channel_.wait_readable(100);
      channel_.receive(pending_);
    }
  }

  std::optional<std::string> stop_requested() override {
    if (stop_) return stop_;
    const bool open = channel_.receive(pending_);
    for (const auto& m : pending_) {
      if (m.size() >= 3 && m[0] == "STOP" && m[1] == std::to_string(attempt_)) stop_ = m[2];
      if (m.size() >= 3 && m[0] == "FINISH" && m[1] == "aborted") stop_ = m[2];
    }
    if (!stop_ && !open) stop_ = "lost the connection to machine 0's launcher";
    return stop_;
  }

  void finish_attempt(const PoolOutcome& local) override {
    AgentMessage m{"RESULT", std::to_string(attempt_)};
    agent::put_workers(m, local.workers);
    m.push_back(local.first_failure ? std::to_string(local.first_failure->rank) : "-1");
    channel_.send(m);
  }

  void abort(const std::string& why) override {
    channel_.send({"ABORT", why});
    channel_.close();
  }

 private:
  std::string where() const { return o_.master_addr + ":" + std::to_string(o_.master_port); }

  Error lost() const {
    return Error("accel: machine " + std::to_string(o_.node_rank) + " lost the connection to machine "
                 "0's launcher at " + where() + " (machine 0 died, or its launch was stopped); this "
                 "machine's processes were stopped. Look at machine 0's output, and start the launch "
                 "again on every machine (load_latest_state() resumes from the newest checkpoint).");
  }

  AgentStep finish(const AgentMessage& m) {
    if (m.at(1) == "aborted")
      throw Error("accel: the launch was ended: " + m.at(2) + "; machine " + std::to_string(o_.node_rank) +
                  "'s processes were stopped.");
    AgentStep s;
    s.finished = true;
    s.attempt = agent::to_int(m.at(2));
    s.outcome.workers = agent::get_workers(m, 3);
    const std::size_t at = 4 + 5 * s.outcome.workers.size();
    const int cause = m.size() > at ? agent::to_int(m[at]) : -1;
    for (const auto& w : s.outcome.workers)
      if (w.rank == cause) s.outcome.first_failure = w;
    if (m[1] == "failed" && !s.outcome.first_failure)
      throw Error("accel: machine 0 reported a failed launch without its cause. Look at machine 0's output.");
    return s;
  }

  LaunchOptions o_;
  agent::Clock::time_point deadline_;
  std::ostream& log_;
  AgentChannel channel_;
  std::vector<AgentMessage> pending_;
  int attempt_ = -1;
  std::optional<std::string> stop_;
};

/// Machine 0's agent on node 0, a client of it on the others.
inline std::unique_ptr<NodeAgent> make_node_agent(const LaunchOptions& o, bool any_port,
                                                  agent::Clock::time_point deadline,
                                                  std::chrono::seconds rdzv_timeout, std::ostream& log) {
  if (o.node_rank == 0) return std::make_unique<AgentServer>(o, any_port, deadline, rdzv_timeout, log);
  return std::make_unique<AgentClient>(o, deadline, rdzv_timeout, log);
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_NODE_AGENT_HPP
// end <accel/launch/detail/node_agent.hpp>

namespace accel::detail::launch {

/// One attempt of a launch, as the start callback of run_elastic gets it.
struct Attempt {
  LaunchOptions options;  ///< master_port: where this attempt's workers meet
  int index = 0;          ///< 0 first (TORCHELASTIC_RESTART_COUNT)
  std::string job_id;     ///< ACCEL_JOB_ID of every worker of the attempt ("" : none)
  /// Several machines: why this machine's workers must stop now (another
  /// machine failed), polled by the pool (PoolOptions::stop_requested).
  std::function<std::optional<std::string>()> stop_requested;
};

/// The last attempt's outcome, and which attempt it was (0 = the first).
struct ElasticOutcome {
  PoolOutcome outcome;
  int attempt = 0;
};

/// The rendezvous port of a restart. The workers of the failed attempt are
/// gone, but the port may still be held (their connections in TIME_WAIT are
/// not a problem: the store binds with SO_REUSEADDR; another program that
/// took it meanwhile is). One node owns all workers, so it can move them to
/// a free port: always when any port would do (master_port 0), else only
/// when the given one cannot be listened on.
inline int restart_port(const LaunchOptions& o, bool any_port) {
  if (any_port) return pick_free_port(o.master_addr);
  const int fd = bind_tcp(o.master_addr, o.master_port);
  if (fd >= 0) {
    ::close(fd);
    return o.master_port;
  }
  return pick_free_port(o.master_addr);
}

/// The rendezvous timeout of the launchers of several machines: how long
/// machine 0 waits for the others to join (or rejoin after a restart), as
/// the workers' own (ACCEL_RDZV_TIMEOUT, default 30 minutes).
inline std::chrono::seconds launcher_rdzv_timeout() {
  if (const auto t = positive_env_int("ACCEL_RDZV_TIMEOUT")) return std::chrono::seconds(*t);
  return std::chrono::minutes(30);
}

/// Several machines: every attempt starts on all of them together, a failure
/// on one stops the workers of all within seconds, and machine 0's launcher
/// decides whether to go again.
template <class Start>
ElasticOutcome run_elastic_machines(const LaunchOptions& o, bool any_port, Start&& start,
                                    std::chrono::steady_clock::time_point deadline,
                                    std::chrono::seconds rdzv_timeout, std::ostream& log) {
  const auto agent = make_node_agent(o, any_port, deadline, rdzv_timeout, log);
  for (;;) {
    AgentStep step = agent->next();
    if (step.finished) return {std::move(step.outcome), step.attempt};
    if (!step.restart_reason.empty()) log << "accel: " << step.restart_reason << std::endl;
    Attempt a{o, step.attempt, step.job_id, [&agent] { return agent->stop_requested(); }};
    a.options.master_port = step.worker_port;
    PoolOutcome out = start(static_cast<const Attempt&>(a));
    if (out.interrupted_by != 0 || out.timed_out) {
      agent->abort(out.timed_out ? std::string("launch ran past its timeout")
                                 : "launcher received " + signal_name(out.interrupted_by));
      return {std::move(out), step.attempt};
    }
    agent->finish_attempt(out);
  }
}

/// Runs start(Attempt) -> PoolOutcome, and again, with a new attempt number
/// (and maybe port), while a worker failed and restarts are left. A timeout
/// or a signal to the launcher ends the loop at once. any_port: the user
/// left the port to accel (master_port 0). deadline: the launch timeout.
template <class Start>
ElasticOutcome run_elastic(LaunchOptions o, bool any_port, Start&& start,
                           std::chrono::steady_clock::time_point deadline,
                           std::chrono::seconds rdzv_timeout = launcher_rdzv_timeout(),
                           std::ostream& log = std::cerr) {
  if (o.num_nodes > 1 && o.max_restarts > 0)
    return run_elastic_machines(o, any_port, start, deadline, rdzv_timeout, log);
  const int attempts = o.max_restarts + 1;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      const int port = restart_port(o, any_port);
      if (port != o.master_port && !any_port)
        log << "accel: port " << o.master_port << " is taken; the restarted processes meet on "
            << "port " << port << "." << std::endl;
      o.master_port = port;
    }
    PoolOutcome out = start(Attempt{o, attempt, new_job_id(o), {}});
    const bool failed = out.first_failure && !out.timed_out && out.interrupted_by == 0;
    if (!failed || attempt + 1 >= attempts) return {std::move(out), attempt};
    log << "accel: " << attempt_failure(out, attempt, attempts) << ". " << restarting(o, attempt + 1)
        << std::endl;
  }
}

}  // namespace accel::detail::launch

#endif  // ACCEL_LAUNCH_DETAIL_ELASTIC_HPP
// end <accel/launch/detail/elastic.hpp>

namespace accel {

namespace detail::launch {

/// Restores the intra-op thread count of the calling process on scope exit.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : old_(at::get_num_threads()) { at::set_num_threads(n); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;
  ~ScopedThreads() { at::set_num_threads(old_); }

 private:
  int old_;
};

/// A worker's LibTorch error as users should read it. From LibTorch 2.0 on,
/// a process that ran backward() before forking has children whose autograd
/// refuses to run; say so in accel's terms, not only autograd's.
inline std::string worker_error_message(const c10::Error& e) {
  std::string msg = e.what_without_backtrace();
  if (msg.find("autograd's threading in combination with fork") == std::string::npos) return msg;
  return "accel: backward() cannot run in a worker forked by notebook_launcher: this process "
         "ran backward() before it launched, and LibTorch 2.x refuses autograd in processes "
         "forked after that. Call notebook_launcher before any backward() in this process, or "
         "start the processes with `accel launch` or mpirun. (LibTorch: " + msg + ")";
}

/// Runs body in one worker per local rank (one attempt of an elastic
/// launch) and waits until the pool's outcome.
template <class Body>
PoolOutcome run_pool(const Attempt& a, std::chrono::steady_clock::time_point deadline, Body& body) {
  const LaunchOptions& o = a.options;
  PoolOptions po;
  po.timeout = std::max(std::chrono::milliseconds(1),
                        std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now()));
  po.grace = o.stop_grace;
  po.prefix_output = o.prefix_output;
  if (o.monitor_interval) po.heartbeat_timeout = *o.monitor_interval;
  po.stop_requested = a.stop_requested;
  // Fork from a fresh thread that stays until the workers are reaped: GNU
  // OpenMP's thread pool lives in the forking thread, and a child forked from a
  // thread that already ran a parallel region hangs in its first one.
  return on_fresh_thread([&] {
    WorkerPool pool(po);
    for (int local = 0; local < o.num_processes; ++local) {
      EnvList env = rank_environment(o, local, a.job_id, a.index);
      env.emplace_back("ACCEL_FORK_LAUNCHED", "1");
      pool.spawn(o.node_rank * o.num_processes + local, env, [&, local] {
        at::set_num_threads(threads_per_worker(o.num_processes));
        try {
          body(local);
        } catch (const c10::Error& e) {
          // LibTorch's what() carries a C++ backtrace; the message is what users need.
          throw std::runtime_error(worker_error_message(e));
        }
      });
    }
    return pool.wait();
  });  // the pool restored the parent's signal handlers here
}

/// Turns the pool's outcome into the launcher's exceptions. `what` names the
/// launch in messages; `attempt` (0 first) is named when restarts were allowed.
inline void throw_on_failure(const PoolOutcome& out, const LaunchOptions& o, const char* what,
                             int attempt = 0) {
  if (out.interrupted_by != 0) {
    // Workers are stopped; now let the signal do what it would have done.
    std::raise(out.interrupted_by);
    throw Error(std::string("accel: ") + what + " was interrupted by " +
                signal_name(out.interrupted_by) + "; all " + std::to_string(o.num_processes) +
                " workers were stopped. Launch again when ready.");
  }
  if (out.first_failure && o.max_restarts > 0)
    throw LaunchError(out.first_failure->rank, out.first_failure->message, out.others_summary(),
                      attempt + 1, o.max_restarts + 1);
  if (out.first_failure)
    throw LaunchError(out.first_failure->rank, out.first_failure->message, out.others_summary());
  if (out.timed_out) {
    std::string ranks;
    for (int r : out.stopped_ranks()) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    throw TimeoutError(std::string("accel: ") + what + " timed out after " +
                       std::to_string(o.timeout.count()) + " s (LaunchOptions::timeout) with " +
                       (ranks.empty() ? "no process" : "process(es) " + ranks) +
                       " still running; they were stopped. Raise the timeout or find why they "
                       "hang (ACCEL_DEBUG_MODE=yes checks the launch).");
  }
}

/// One attempt, its outcome turned into exceptions.
template <class Body>
void run_workers(const LaunchOptions& o, std::chrono::steady_clock::time_point deadline,
                 const char* what, Body&& body) {
  throw_on_failure(run_pool(Attempt{o, 0, new_job_id(o), {}}, deadline, body), o, what);
}

}  // namespace detail::launch

/// Runs fn(args...) in opts.num_processes forked workers on this node and
/// returns when all have finished. Each worker sees RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT and
/// ACCEL_FORK_LAUNCHED=1, and uses max(1, cores / num_processes) intra-op
/// threads unless OMP_NUM_THREADS is set. If a worker throws, exits non-zero
/// or dies by a signal, the others are stopped (SIGTERM, then SIGKILL after
/// stop_grace) and accel::LaunchError names the first failing rank and its
/// message; past opts.timeout accel::TimeoutError. One process on one node
/// runs fn in this process (no fork) with the same variables, restored after;
/// an exception then arrives as LaunchError(0, ...) nesting the original.
/// With opts.max_restarts = N > 0, a failure stops every worker and forks
/// the whole group again, up to N times, each attempt with
/// TORCHELASTIC_RESTART_COUNT = 0, 1, ... (accel::restart_count()) and a
/// usable port; the failure of attempt N+1 is the LaunchError, "process R
/// failed on attempt N+1 of N+1 (max_restarts = N): ...". Over several nodes
/// the launchers decide together: node 0's hosts their rendezvous on
/// master_port, the workers meet on master_port + 1 (or a free port), and a
/// failure on any node restarts all (docs/launching.md, "Fault tolerance"). With
/// opts.monitor_interval a worker that stops heart-beating is killed as hung
/// (a failure). With either, even one process is a forked worker.
template <class F, class... Args>
void notebook_launcher(F&& fn, std::tuple<Args...> args, LaunchOptions opts = {}) {
  namespace dl = detail::launch;
  // The timeout bounds the whole call, debug dry launch included.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::min<std::chrono::seconds>(opts.timeout, std::chrono::hours(24 * 36500));
  dl::validate(opts);
  std::optional<dl::RemoveAtExit> published;  // node 0's rendezvous file, removed when done
  const bool any_port = opts.master_port == 0;
  if (opts.master_port == 0 && opts.num_nodes > 1) {
    opts.master_port = dl::agree_on_free_port(*opts.rendezvous_file, opts.node_rank,
                                              opts.master_addr, deadline);
    if (opts.node_rank == 0) published.emplace(*opts.rendezvous_file);
  } else if (opts.master_port == 0) {
    opts.master_port = dl::pick_free_port(opts.master_addr);
  }

  // In this process unless a crash must be survivable (max_restarts) or a
  // hang detectable (monitor_interval).
  if (opts.num_processes == 1 && opts.num_nodes == 1 && opts.max_restarts == 0 &&
      !opts.monitor_interval) {
    dl::EnvList env = dl::rank_environment(opts, 0);
    dl::ScopedEnv scoped_env(env);
    dl::ScopedThreads threads(dl::threads_per_worker(1));
    try {
      std::apply(std::forward<F>(fn), std::move(args));
    } catch (const c10::Error& e) {
      std::throw_with_nested(LaunchError(0, e.what_without_backtrace()));
    } catch (const std::exception& e) {
      std::throw_with_nested(LaunchError(0, e.what()));
    }
    return;
  }

#if ACCEL_WITH_CUDA
  dl::refuse_fork_after_cuda();
#endif
  if (runtime::detail::getenv_flag("ACCEL_DEBUG_MODE")) {
    // Dry run first, as Accelerate's debug mode: spawn-time problems show up
    // as a clear error before any real work starts.
    if (opts.node_rank != 0) dl::check_reachable(opts.master_addr, opts.master_port, std::chrono::seconds(5));
    if (opts.node_rank == 0 && dl::bind_error(opts.master_addr, opts.master_port) == -EADDRINUSE)
      throw Error("accel: debug launch: master_port " + std::to_string(opts.master_port) +
                  " on " + opts.master_addr +
                  " is already in use. Pass another master_port, or 0 to pick a free one.");
    dl::run_workers(opts, deadline, "notebook_launcher's debug launch (ACCEL_DEBUG_MODE)",
                    [&](int local) { dl::check_worker_environment(opts, local); });
  }
  // Each attempt forks fresh workers from this process, so every attempt
  // starts from the same state: what the workers did (moving the arguments
  // out included) dies with them.
  auto body = [&](int) { std::apply(fn, std::move(args)); };
  const auto r = dl::run_elastic(
      opts, any_port, [&](const dl::Attempt& a) { return dl::run_pool(a, deadline, body); }, deadline);
  dl::throw_on_failure(r.outcome, opts, "notebook_launcher", r.attempt);
}

/// The same as notebook_launcher: the name to use outside notebooks.
template <class F, class... Args>
void launch(F&& fn, std::tuple<Args...> args, LaunchOptions opts = {}) {
  notebook_launcher(std::forward<F>(fn), std::move(args), std::move(opts));
}

}  // namespace accel

#endif  // ACCEL_LAUNCH_NOTEBOOK_LAUNCHER_HPP
// end <accel/launch/notebook_launcher.hpp>

#endif  // ACCEL_LAUNCH_HPP
// end <accel/launch.hpp>
// begin <accel/prepare.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the compile-time side of prepare(): the kind of each argument,
/// the prepared type at each position (computed with Boost.Hana) and the
/// diagnostics for arguments of any other kind.
#ifndef ACCEL_PREPARE_HPP
#define ACCEL_PREPARE_HPP

#include <cstddef>
#include <memory>
#include <tuple>
#include <type_traits>

#include <boost/hana/basic_tuple.hpp>
#include <boost/hana/transform.hpp>
#include <boost/hana/type.hpp>
#include <boost/hana/unpack.hpp>

// begin <accel/prepared/model.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::PreparedModel<M>: the user's module, on device(), run
/// under the precision policy's autocast, with its gradients synchronised by
/// the shard policy.
#ifndef ACCEL_PREPARED_MODEL_HPP
#define ACCEL_PREPARED_MODEL_HPP

#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>


namespace accel {

namespace detail {

/// Autocast computes in 16 bits; what leaves the model is float32 again, as
/// Accelerate's convert_outputs_to_fp32 does, so losses and metrics keep
/// their precision.
template <class T>
T outputs_to_fp32(T&& out) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    if (out.defined() && out.is_floating_point() && out.scalar_type() != torch::kFloat &&
        out.scalar_type() != torch::kDouble)
      return out.to(torch::kFloat);
    return std::forward<T>(out);
  } else if constexpr (requires { std::tuple_size<U>::value; }) {
    std::apply([](auto&... e) { ((e = outputs_to_fp32(std::move(e))), ...); }, out);
    return std::forward<T>(out);
  } else if constexpr (std::is_same_v<U, std::vector<torch::Tensor>>) {
    for (auto& e : out) e = outputs_to_fp32(std::move(e));
    return std::forward<T>(out);
  } else {
    return std::forward<T>(out);
  }
}

/// Whether autograd may run backward through out (ShardParameters keeps a
/// model's parameters gathered until then); unknown types: assume so.
template <class T>
bool may_need_backward(const T& out) {
  if constexpr (std::is_same_v<T, torch::Tensor>) {
    return out.defined() && out.requires_grad();
  } else if constexpr (requires { std::tuple_size<T>::value; }) {
    return std::apply([](const auto&... e) { return (may_need_backward(e) || ... || false); }, out);
  } else if constexpr (std::is_same_v<T, std::vector<torch::Tensor>>) {
    for (const auto& e : out)
      if (may_need_backward(e)) return true;
    return false;
  } else {
    return true;
  }
}

}  // namespace detail

template <class M>
class PreparedModel {
 public:
  using model_type = M;
  using module_type = typename detail::model_traits<M>::module_type;

  PreparedModel(M model, std::shared_ptr<detail::TrainingState> state,
                std::shared_ptr<shard::detail::GradientSync> sync, bool autocast,
                at::ScalarType autocast_dtype)
      : model_(std::move(model)), state_(std::move(state)), sync_(std::move(sync)),
        autocast_(autocast), autocast_dtype_(autocast_dtype) {
    for (const auto& b : get()->buffers()) buffers_.push_back(b);
  }

  /// Calls the module's forward under the precision policy's autocast.
  template <class... A>
  auto operator()(A&&... args) {
    sync_->before_forward();
    const bool buffers = state_->comm->size() > 1 && !buffers_.empty() && get()->is_training();
    // Under join_uneven_inputs(), a forward that communicates (now, or in its
    // backward) first tells the ranks that ran out of data, which repeat it.
    if (state_->join) {
      const bool reduce = torch::GradMode::is_enabled() && sync_->sync_now();
      if (const auto i = state_->join->model_index(sync_.get()); i >= 0 && (buffers || reduce))
        state_->join->announce({accel::detail::JoinState::Action::kForward, static_cast<std::size_t>(i), buffers, reduce});
    }
    if (buffers) broadcast_buffers();
    precision::AutocastGuard guard(state_->device.type(), autocast_dtype_, autocast_);
    if constexpr (std::is_void_v<decltype(get()->forward(std::forward<A>(args)...))>) {
      module_forward(std::forward<A>(args)...);
    } else if (autocast_) {
      return detail::outputs_to_fp32(module_forward(std::forward<A>(args)...));
    } else {
      return module_forward(std::forward<A>(args)...);
    }
  }

  module_type* operator->() const { return get(); }
  module_type& operator*() const { return *get(); }
  module_type* get() const { return detail::module_ptr(model_); }

  /// The user's original module handle (what unwrap_model returns).
  M& module() { return model_; }
  const M& module() const { return model_; }
  shard::detail::GradientSync& gradient_sync() const { return *sync_; }

  /// join_uneven_inputs() on a rank out of data, while the others run this
  /// model's forward and backward: the same collectives, with zero gradients.
  void join_shadow(bool buffers, bool reduce) {
    if (buffers) broadcast_buffers();
    if (reduce) sync_->shadow_backward();
  }

 private:
  template <class... A>
  auto module_forward(A&&... args) -> decltype(get()->forward(std::forward<A>(args)...)) {
    if (auto* gather = sync_->parameter_gather()) return gathered_forward(*gather, std::forward<A>(args)...);
    return get()->forward(std::forward<A>(args)...);
  }

  // shard::ShardParameters: a Sequential runs module by module, each one's
  // parameters gathered just for its forward and again, from a hook on its
  // output's gradient, for its backward. In a model with shard::Unit modules
  // they do the same (shard/unit.hpp), and the parameters outside them are
  // gathered here. Any other model is gathered whole. When the output carries
  // gradients, what is gathered here stays until backward hands each
  // bucket's gradients to the reduce-scatter.
  template <class... A>
  auto gathered_forward(shard::detail::ParameterGather& gather, A&&... args)
      -> decltype(get()->forward(std::forward<A>(args)...)) {
    using R = decltype(get()->forward(std::forward<A>(args)...));
    if constexpr (std::is_same_v<module_type, torch::nn::SequentialImpl> && std::is_same_v<R, torch::Tensor>) {
      if (!gather.has_named_units()) return forward_by_unit(gather, std::forward<A>(args)...);
    }
    gather.gather_for_forward();
    if constexpr (std::is_void_v<R>) {
      get()->forward(std::forward<A>(args)...);
      if (!torch::GradMode::is_enabled()) gather.release_all();
    } else {
      R out = get()->forward(std::forward<A>(args)...);
      if (!torch::GradMode::is_enabled() || !detail::may_need_backward(out)) gather.release_all();
      return out;
    }
  }

  template <class... A>
  torch::Tensor forward_by_unit(shard::detail::ParameterGather& gather, A&&... args) {
    auto& seq = *get();
    ACCEL_CHECK(!seq.is_empty(), "accel: forward of an empty torch::nn::Sequential.");
    const bool grad = torch::GradMode::is_enabled();
    std::weak_ptr<shard::detail::GradientSync> sync = sync_;
    std::optional<torch::nn::AnyValue> value;
    std::size_t u = 0;
    for (auto it = seq.begin(); it != seq.end(); ++it, ++u) {
      gather.gather_unit(u);
      if (u == 0)
        value.emplace(it->any_forward(std::forward<A>(args)...));
      else
        value.emplace(it->any_forward(std::move(*value)));
      if (auto* out = value->template try_get<torch::Tensor>(); grad && out && out->requires_grad())
        out->register_hook([sync, u](const torch::Tensor&) {
          if (auto s = sync.lock())
            if (auto* g = s->parameter_gather()) g->gather_for_backward(u);
        });
      gather.release_unit(u);
    }
    return value->template get<torch::Tensor>();
  }

  // Buffers (BatchNorm statistics) follow rank 0 before each training forward,
  // as DDP's broadcast_buffers does, so every replica computes the same thing.
  void broadcast_buffers() {
    torch::NoGradGuard no_grad;
    for (auto& b : buffers_) {
      if (!b.defined() || b.numel() == 0) continue;
      auto t = b.is_contiguous() ? b : b.contiguous();
      state_->comm->broadcast(t, 0)->wait();
      if (!t.is_same(b)) b.copy_(t);
    }
  }

  M model_;
  std::shared_ptr<detail::TrainingState> state_;
  std::shared_ptr<shard::detail::GradientSync> sync_;
  bool autocast_;
  at::ScalarType autocast_dtype_;
  std::vector<torch::Tensor> buffers_;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_MODEL_HPP
// end <accel/prepared/model.hpp>
// begin <accel/prepared/optimizer.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::AcceleratedOptimizer<O>: steps only when gradients are
/// synchronised and finite on every rank.
#ifndef ACCEL_PREPARED_OPTIMIZER_HPP
#define ACCEL_PREPARED_OPTIMIZER_HPP

#include <cstddef>
#include <memory>
#include <type_traits>
#include <utility>

#include <torch/torch.h>


namespace accel {

namespace detail {
template <class O>
inline constexpr bool is_optimizer_v =
    std::is_base_of_v<torch::optim::Optimizer, std::remove_cvref_t<O>>;
}  // namespace detail

template <class O>
class AcceleratedOptimizer {
 public:
  using optimizer_type = O;

  AcceleratedOptimizer(std::shared_ptr<O> optimizer, std::shared_ptr<detail::TrainingState> state)
      : core_(std::make_shared<Core>(Core{std::move(optimizer), nullptr})), state_(std::move(state)),
        index_(state_->optimizer_shadows.size()) {
    // A rank out of data under join_uneven_inputs() repeats this step (weak:
    // the state must not keep the optimizer alive).
    state_->optimizer_shadows.push_back([core = std::weak_ptr<Core>(core_), i = index_](detail::TrainingState& s) {
      if (auto c = core.lock()) run_step(s, *c, i, nullptr);
    });
  }

  /// No-op on the non-sync micro-steps of accumulate(); otherwise waits for
  /// the gradient all-reduce still in flight, then steps unless the loss
  /// scaler found inf/NaN on any rank (step_was_skipped() says so).
  torch::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr) {
    if (!state_->sync_gradients) {
      skipped_ = true;
      return {};
    }
    {
      profiling::Span wait("accel: optimizer.step waits for gradients", "accel.comm");
      state_->finalize_gradients();
    }
    // After the reductions: a rank out of data repeats them from the
    // announcement of the forward, before this one.
    if (state_->join) state_->join->announce({accel::detail::JoinState::Action::kStep, index_});
    auto [ok, loss] = run_step(*state_, *core_, index_, std::move(closure));
    skipped_ = !ok;
    return loss;
  }

  /// Zeroes the gradients in place (keeping them in the gradient buckets);
  /// a no-op while accumulate() is on a non-sync step, as in Accelerate.
  void zero_grad() {
    if (!state_->sync_gradients) return;
    torch::NoGradGuard no_grad;
    for (auto& group : core_->opt->param_groups())
      for (auto& p : group.params())
        if (p.grad().defined()) p.mutable_grad().zero_();
    if (core_->partition) core_->partition->zero_grad();
  }

  /// Shard policies: the optimizer's parameters are this rank's partitions of
  /// a model's; the partition gathers the update and zeroes the full gradients.
  void set_partition(std::shared_ptr<shard::detail::OptimizerPartition> partition) {
    core_->partition = std::move(partition);
  }

  bool step_was_skipped() const { return skipped_; }

  O* operator->() const { return core_->opt.get(); }
  O& operator*() const { return *core_->opt; }
  O& optimizer() const { return *core_->opt; }

 private:
  /// What copies of one prepared optimizer share.
  struct Core {
    std::shared_ptr<O> opt;
    std::shared_ptr<shard::detail::OptimizerPartition> partition;
  };

  // With the gradients reduced: steps unless the loss scaler found inf/NaN
  // on any rank; returns whether it stepped, and the loss.
  static std::pair<bool, torch::Tensor> run_step(detail::TrainingState& state, Core& c, std::size_t index,
                                                 torch::optim::Optimizer::LossClosure closure) {
    const bool ok = state.before_step(*c.opt, index);
    torch::Tensor loss;
    if (ok) loss = c.opt->step(std::move(closure));
    if (c.partition) c.partition->after_step(ok);
    state.after_step(index);
    state.last_step_skipped = !ok;
    if (ok) ++state.optimizer_steps;
    return {ok, loss};
  }

  std::shared_ptr<Core> core_;
  std::shared_ptr<detail::TrainingState> state_;
  std::size_t index_;  ///< in TrainingState::optimizer_shadows
  bool skipped_ = false;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_OPTIMIZER_HPP
// end <accel/prepared/optimizer.hpp>
// begin <accel/prepared/scheduler.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::AcceleratedScheduler<S>: advances once per optimizer
/// step that really happened, whatever the number of processes.
#ifndef ACCEL_PREPARED_SCHEDULER_HPP
#define ACCEL_PREPARED_SCHEDULER_HPP

#include <cstdint>
#include <memory>
#include <type_traits>

#include <torch/torch.h>


namespace accel {

namespace detail {
template <class S>
inline constexpr bool is_scheduler_v =
    std::is_base_of_v<torch::optim::LRScheduler, std::remove_cvref_t<S>>;
}  // namespace detail

/// Accelerate steps a scheduler num_processes times per optimizer step (so
/// schedules sized in optimizer steps end N times too early); accel steps it
/// exactly once for each optimizer step that happened: not on the non-sync
/// micro-steps of accumulate(), not when the loss scaler skipped the step.
template <class S>
class AcceleratedScheduler {
 public:
  using scheduler_type = S;

  AcceleratedScheduler(std::shared_ptr<S> scheduler, std::shared_ptr<detail::TrainingState> state,
                       bool step_with_optimizer)
      : sched_(std::move(scheduler)), state_(std::move(state)),
        step_with_optimizer_(step_with_optimizer),
        seen_steps_(std::make_shared<int64_t>(state_->optimizer_steps)) {}

  void step() {
    if (step_with_optimizer_) {
      if (state_->optimizer_steps == *seen_steps_) return;  // no real optimizer step since the last call
      *seen_steps_ = state_->optimizer_steps;
    }
    sched_->step();
  }

  S* operator->() const { return sched_.get(); }
  S& operator*() const { return *sched_; }
  S& scheduler() const { return *sched_; }
  /// The optimizer step count this scheduler last stepped at, shared by
  /// copies; load_state() sets it to the restored count.
  const std::shared_ptr<int64_t>& seen_steps() const { return seen_steps_; }

 private:
  std::shared_ptr<S> sched_;
  std::shared_ptr<detail::TrainingState> state_;
  bool step_with_optimizer_;
  std::shared_ptr<int64_t> seen_steps_;
};

}  // namespace accel

#endif  // ACCEL_PREPARED_SCHEDULER_HPP
// end <accel/prepared/scheduler.hpp>

namespace accel {

enum class PrepareKind { Model, Optimizer, DataLoader, Scheduler, Unsupported };

namespace detail {

template <class T>
struct shared_element {
  using type = T;
};
template <class T>
struct shared_element<std::shared_ptr<T>> {
  using type = T;
};

/// What prepare() makes of an argument of type T (decayed). Optimizers and
/// schedulers may also come as std::shared_ptr.
template <class T>
consteval PrepareKind prepare_kind() {
  using E = typename shared_element<T>::type;
  if constexpr (is_model_v<T>)
    return PrepareKind::Model;
  else if constexpr (is_optimizer_v<E>)
    return PrepareKind::Optimizer;
  else if constexpr (data::is_data_loader_v<T>)
    return PrepareKind::DataLoader;
  else if constexpr (is_scheduler_v<E>)
    return PrepareKind::Scheduler;
  else
    return PrepareKind::Unsupported;
}

/// Named after the problem so the compiler prints position and type:
/// "incomplete type prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<2, int>".
/// Fix: pass a torch::nn module holder, a torch::optim optimizer, a loader from
/// accel::data::make_data_loader or a torch::optim::LRScheduler at that position.
template <std::size_t Position, class T>
struct prepare_argument_is_not_a_model_optimizer_loader_or_scheduler;

template <std::size_t Position, class T, PrepareKind K = prepare_kind<T>()>
struct prepared_type {
  static_assert(dependent_false<T>,
                "accel: prepare() argument is not a model, an optimizer, a data loader or an LR "
                "scheduler. Pass a torch::nn module (holder or shared_ptr), a torch::optim "
                "optimizer, a loader made by accel::data::make_data_loader, or a "
                "torch::optim::LRScheduler; the next error names the position and the type");
  using type = typename prepare_argument_is_not_a_model_optimizer_loader_or_scheduler<Position, T>::type;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Model> {
  using type = PreparedModel<T>;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Optimizer> {
  using type = AcceleratedOptimizer<typename shared_element<T>::type>;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::DataLoader> {
  using type = T;
};
template <std::size_t P, class T>
struct prepared_type<P, T, PrepareKind::Scheduler> {
  using type = AcceleratedScheduler<typename shared_element<T>::type>;
};

/// The tuple prepare() returns for arguments Ts..., computed with Hana: the
/// i-th element is the prepared form of the i-th argument.
template <class... Ts>
struct prepare_result {
  template <std::size_t... I>
  static auto compute(std::index_sequence<I...>) {
    namespace hana = boost::hana;
    auto args = hana::make_basic_tuple(hana::type_c<std::pair<std::integral_constant<std::size_t, I>, Ts>>...);
    auto prepared = hana::transform(args, [](auto t) {
      using P = typename decltype(t)::type;
      return hana::type_c<typename prepared_type<P::first_type::value, typename P::second_type>::type>;
    });
    return hana::unpack(prepared, hana::template_<std::tuple>);
  }
  using type = typename decltype(compute(std::index_sequence_for<Ts...>{}))::type;
};

template <class... Ts>
using prepare_result_t = typename prepare_result<std::remove_cvref_t<Ts>...>::type;

/// An object handed to prepare() as an lvalue stays owned by the caller (the
/// prepared wrapper refers to it); an rvalue is moved into shared ownership; a
/// shared_ptr is shared.
template <class A>
auto share(A&& a) {
  using T = std::remove_cvref_t<A>;
  if constexpr (!std::is_same_v<typename shared_element<T>::type, T>)
    return T(a);
  else if constexpr (std::is_lvalue_reference_v<A>)
    return std::shared_ptr<T>(std::shared_ptr<T>{}, &a);
  else
    return std::make_shared<T>(std::move(a));
}

}  // namespace detail
}  // namespace accel

#endif  // ACCEL_PREPARE_HPP
// end <accel/prepare.hpp>
// begin <accel/accelerator.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::Accelerator<Backend, Precision, Shard>: composes the
/// three policies and exposes Accelerate's everyday API.
#ifndef ACCEL_ACCELERATOR_HPP
#define ACCEL_ACCELERATOR_HPP

#include <algorithm>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <iostream>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

// begin <accel/detail/deferred.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::detail::deferred_t and complete_type: how the
/// Accelerator names a class of an area it does not include (the checkpoint
/// writer and reader, the trackers, the profiler's Trace), so that only a
/// translation unit that calls into that area compiles its header.
#ifndef ACCEL_DETAIL_DEFERRED_HPP
#define ACCEL_DETAIL_DEFERRED_HPP

namespace accel::detail {

/// T, named so that it depends on D: in a member of a class template over D,
/// T's members are looked up when that member is used, not where it is
/// written, so T may be only declared there.
template <class T, class D>
struct deferred {
  using type = T;
};
template <class T, class D>
using deferred_t = typename deferred<T, D>::type;

/// Whether T is defined here (its header was included).
template <class T>
concept complete_type = requires { sizeof(T); };

}  // namespace accel::detail

#endif  // ACCEL_DETAIL_DEFERRED_HPP
// end <accel/detail/deferred.hpp>
// begin <accel/ops/batch_size.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines find_executable_batch_size: call fn(batch_size), lowering the
/// size after an out-of-memory error, with every rank on the same size at each
/// attempt.
#ifndef ACCEL_OPS_BATCH_SIZE_HPP
#define ACCEL_OPS_BATCH_SIZE_HPP

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include <c10/util/Exception.h>
#include <torch/torch.h>


#if ACCEL_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace accel {

namespace ops {

/// Whether `e` is an allocation failure that a smaller batch may avoid:
/// c10::OutOfMemoryError (CUDA), std::bad_alloc, or the c10::Error messages
/// of LibTorch's CPU allocator and of CUDA/cuDNN running out of memory.
inline bool is_out_of_memory(std::exception_ptr e) {
  try {
    std::rethrow_exception(std::move(e));
  } catch (const c10::OutOfMemoryError&) {
    return true;
  } catch (const std::bad_alloc&) {
    return true;
  } catch (const c10::Error& err) {
    const std::string_view what = err.what();
    for (std::string_view m : {"DefaultCPUAllocator: can't allocate memory",
                               "DefaultCPUAllocator: not enough memory", "CUDA out of memory",
                               "CUDNN_STATUS_NOT_SUPPORTED"})
      if (what.find(m) != std::string_view::npos) return true;
    return false;
  } catch (...) {
    return false;
  }
}

/// find_executable_batch_size over `comm`: every rank calls fn(size), then
/// one all-reduce (max) of the outcome (0 ran, 1 out of memory, 2 another
/// error) decides for all: return fn's result, retry at int(size * 0.9), or
/// rethrow (the ranks whose fn did not fail throw an accel::Error saying so).
template <class F>
auto find_executable_batch_size(runtime::Communicator& comm, F&& fn, int64_t starting_batch_size) {
  using R = std::invoke_result_t<F&, int64_t>;
  ACCEL_CHECK(starting_batch_size >= 1, "accel: find_executable_batch_size() needs a starting "
              "batch size of at least 1 (got ", starting_batch_size, "). Pass the largest size to try.");
  for (int64_t size = starting_batch_size;; size = static_cast<int64_t>(static_cast<double>(size) * 0.9)) {
    ACCEL_CHECK(size > 0, "accel: find_executable_batch_size() found no batch size that fits: "
                "every size from ", starting_batch_size, " down to 1 ran out of memory. "
                "Reduce the model or the sequence length, or use a larger device.");
    std::exception_ptr error;
    std::optional<std::conditional_t<std::is_void_v<R>, bool, std::remove_cvref_t<R>>> result;
    try {
      if constexpr (std::is_void_v<R>) {
        fn(size);
        result.emplace(true);
      } else {
        result.emplace(fn(size));
      }
    } catch (...) {
      error = std::current_exception();
    }
    const int outcome = !error ? 0 : is_out_of_memory(error) ? 1 : 2;
    int agreed = outcome;
    if (comm.size() > 1) {
      auto flag = torch::tensor({outcome}, torch::TensorOptions().dtype(torch::kInt).device(comm.device()));
      comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
      agreed = flag.cpu().item<int>();
    }
    if (agreed == 0) {
      if constexpr (std::is_void_v<R>)
        return;
      else
        return std::move(*result);
    }
    if (agreed == 2) {
      if (outcome == 2) std::rethrow_exception(error);
      throw Error(accel::detail::concat(
          "accel: find_executable_batch_size() stopped at batch size ", size,
          ": fn failed with an error other than out of memory on another process ",
          accel::detail::kFailedElsewhere, ". Fix that error."));
    }
    // Out of memory somewhere: free what this process holds before the retry.
    error = nullptr;
    result.reset();
#if ACCEL_WITH_CUDA
    c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  }
}

}  // namespace ops

/// Calls fn(batch_size) starting at starting_batch_size; after an
/// out-of-memory error (ops::is_out_of_memory) retries at int(size * 0.9),
/// until fn returns (its result is returned) or the size reaches 0 (an
/// accel::Error). Other errors propagate at once. This overload is for a
/// single process; in a multi-process job use Accelerator::
/// find_executable_batch_size, which keeps every rank on the same size.
template <class F>
auto find_executable_batch_size(F&& fn, int64_t starting_batch_size) {
  runtime::LocalCommunicator local;
  return ops::find_executable_batch_size(local, std::forward<F>(fn), starting_batch_size);
}

}  // namespace accel

#endif  // ACCEL_OPS_BATCH_SIZE_HPP
// end <accel/ops/batch_size.hpp>
// begin <accel/ops/collectives.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the tensor collectives the Accelerator exposes (gather,
/// reduce, broadcast, pad_across_processes), over any runtime::Communicator.
#ifndef ACCEL_OPS_COLLECTIVES_HPP
#define ACCEL_OPS_COLLECTIVES_HPP

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

#include <torch/torch.h>


namespace accel::ops {

namespace detail {
/// Every rank's sizes of `t` (dims must agree), as a [world, ndim] int64 tensor.
inline torch::Tensor all_sizes(runtime::Communicator& comm, const torch::Tensor& t) {
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto mine = torch::tensor(t.sizes().vec(), on);
  auto all = torch::empty({comm.size() * t.dim()}, on);
  comm.all_gather(all, mine)->wait();
  return all.view({comm.size(), t.dim()});
}
}  // namespace detail

/// Concatenation along dim 0 of every rank's tensor (rank order). A 0-d tensor
/// counts as shape [1]. With `check_shapes` (ACCEL_DEBUG_MODE) ranks whose
/// shapes differ get an error listing every rank's shape instead of a hang or
/// garbage.
inline torch::Tensor gather(runtime::Communicator& comm, const torch::Tensor& tensor,
                            bool check_shapes = false) {
  auto t = (tensor.dim() == 0 ? tensor.reshape({1}) : tensor).contiguous();
  if (comm.size() == 1) return t.clone();
  if (check_shapes) {
    const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
    auto dims = torch::tensor({static_cast<int64_t>(t.dim())}, on);
    auto all_dims = torch::empty({comm.size()}, on);
    comm.all_gather(all_dims, dims)->wait();
    bool same = all_dims.eq(t.dim()).all().item<bool>();
    auto sizes = same ? detail::all_sizes(comm, t) : torch::Tensor();
    if (!same || !sizes.eq(sizes[0]).all().item<bool>()) {
      std::ostringstream msg;
      msg << "accel: gather() needs the same shape on every rank; rank " << comm.rank()
          << " has " << t.sizes() << (same ? ", all ranks: " : "; ranks differ in dimensions")
          << (same ? sizes : torch::Tensor()) << ". Call pad_across_processes() first.";
      throw Error(msg.str());
    }
  }
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] *= comm.size();
  auto out = torch::empty(shape, t.options());
  comm.all_gather(out, t)->wait();
  return out;
}

/// gather() for tensors whose dim 0 differs across ranks (the other
/// dimensions must agree): every rank's rows, in rank order, nothing added.
/// One small all-gather of the shapes first; when dim 0 differs, each rank's
/// rows travel padded to the longest. `rows`, when given, receives every
/// rank's dim 0.
inline torch::Tensor gather_ragged(runtime::Communicator& comm, const torch::Tensor& tensor,
                                   std::vector<int64_t>* rows = nullptr) {
  auto t = (tensor.dim() == 0 ? tensor.reshape({1}) : tensor).contiguous();
  const int world = comm.size();
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto head = torch::tensor({static_cast<int64_t>(t.dim()), t.size(0)}, on);
  auto heads = torch::empty({world, 2}, on);
  comm.all_gather(heads, head)->wait();
  heads = heads.cpu();
  const bool same_dims = heads.select(1, 0).eq(t.dim()).all().item<bool>();
  bool same_rest = same_dims;
  torch::Tensor sizes;
  if (same_dims && t.dim() > 1) {
    sizes = detail::all_sizes(comm, t).cpu();
    same_rest = sizes.narrow(1, 1, t.dim() - 1).eq(sizes.narrow(1, 1, t.dim() - 1)[0]).all().item<bool>();
  }
  if (!same_rest) {
    std::ostringstream msg;
    msg << "accel: gather_for_metrics() needs the same shape on every rank apart from dim 0; rank "
        << comm.rank() << " has " << t.sizes()
        << (same_dims ? ", all ranks: " : "; ranks differ in dimensions: ")
        << (same_dims ? sizes : heads.select(1, 0)) << ". Pad those dimensions with "
        << "pad_across_processes() first.";
    throw Error(msg.str());
  }
  std::vector<int64_t> counts(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) counts[static_cast<std::size_t>(r)] = heads[r][1].item<int64_t>();
  if (rows) *rows = counts;
  const int64_t longest = *std::max_element(counts.begin(), counts.end());
  if (longest == t.size(0) && std::all_of(counts.begin(), counts.end(),
                                          [&](int64_t c) { return c == longest; }))
    return gather(comm, t);
  auto shape = t.sizes().vec();
  shape[0] = longest;
  auto padded = torch::zeros(shape, t.options());
  padded.narrow(0, 0, t.size(0)).copy_(t);
  auto all = gather(comm, padded);
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r)
    parts.push_back(all.narrow(0, r * longest, counts[static_cast<std::size_t>(r)]));
  return torch::cat(parts);
}

inline torch::Tensor reduce(runtime::Communicator& comm, const torch::Tensor& tensor,
                            Reduction reduction = Reduction::Sum) {
  auto t = tensor.contiguous().clone();
  comm.all_reduce(t, runtime::ReduceOp::Sum)->wait();
  if (reduction == Reduction::Mean) {
    if (t.is_floating_point())
      t.div_(comm.size());
    else
      t = t.div(comm.size(), "floor");
  }
  return t;
}

inline torch::Tensor broadcast(runtime::Communicator& comm, const torch::Tensor& tensor,
                               int src = 0) {
  ACCEL_CHECK(src >= 0 && src < comm.size(), "accel: broadcast() source rank ", src,
              " is outside world size ", comm.size(), ". Use a rank in [0, ", comm.size(), ").");
  auto t = tensor.contiguous().clone();
  comm.broadcast(t, src)->wait();
  return t;
}

/// Pads `dim` of every rank's tensor to the largest size across ranks with
/// `pad_index` (at the front when pad_first), so they can be gathered.
inline torch::Tensor pad_across_processes(runtime::Communicator& comm, const torch::Tensor& tensor,
                                          int64_t dim = 0, double pad_index = 0,
                                          bool pad_first = false) {
  if (tensor.dim() == 0) return tensor;
  if (dim < 0) dim += tensor.dim();
  ACCEL_CHECK(dim >= 0 && dim < tensor.dim(), "accel: pad_across_processes() dim ", dim,
              " is outside a tensor of ", tensor.dim(), " dimensions. Pass a valid dim.");
  auto sizes = detail::all_sizes(comm, tensor);
  int64_t max_size = sizes.select(1, dim).max().item<int64_t>();
  int64_t own = tensor.size(dim);
  if (own == max_size) return tensor;
  auto shape = tensor.sizes().vec();
  shape[dim] = max_size;
  auto out = torch::full(shape, pad_index, tensor.options());
  out.narrow(dim, pad_first ? max_size - own : 0, own).copy_(tensor);
  return out;
}

}  // namespace accel::ops

#endif  // ACCEL_OPS_COLLECTIVES_HPP
// end <accel/ops/collectives.hpp>
// begin <accel/ops/join.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines ops::Join, what Accelerator::join_uneven_inputs() returns:
/// ranks with fewer batches than the others finish training without a hang
/// (as torch.distributed.algorithms.Join with DDP and ZeroRedundancyOptimizer).
#ifndef ACCEL_OPS_JOIN_HPP
#define ACCEL_OPS_JOIN_HPP

#include <exception>
#include <memory>
#include <utility>
#include <vector>


namespace accel::ops {

/// RAII: while it lives, every communicating forward of a guarded model and
/// every prepared optimizer's step() first tells the other ranks (one
/// all-gather of one number). When this rank's data ends, the guard's end
/// (destructor, or finish()) repeats what the other ranks do — the buffer
/// broadcast and gradient reductions of their forward and backward, with
/// zero gradients, and each optimizer step with the gradients so averaged
/// (loss-scaler agreement and ZeRO's all-gather included) — until every
/// rank is out of data. So every rank makes the same updates: the replicas,
/// and their optimizer states, stay equal. Gradients are divided by the
/// whole world size, ranks out of data counting as zeros (torch's default,
/// divide_by_initial_world_size=True).
class Join {
 public:
  Join(std::shared_ptr<accel::detail::TrainingState> state, std::vector<accel::detail::JoinState::Model> models)
      : state_(std::move(state)), exceptions_(std::uncaught_exceptions()) {
    ACCEL_CHECK(state_->join == nullptr, "accel: join_uneven_inputs() while another "
                "join_uneven_inputs() guard of this Accelerator lives. Use one guard, listing "
                "every model.");
    state_->join = std::make_shared<accel::detail::JoinState>(state_->comm, std::move(models));
  }
  Join(const Join&) = delete;
  Join& operator=(const Join&) = delete;

  /// Leaving the training loop by an exception does not shadow anything:
  /// the other ranks then see this rank fail (the launcher stops them).
  ~Join() noexcept(false) {
    if (done_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      state_->join.reset();
      return;
    }
    finish();
  }

  /// This rank is out of data: repeats the other ranks' collectives until
  /// every rank is; then the guard is over.
  void finish() {
    if (done_) return;
    done_ = true;
    auto join = state_->join;
    try {
      while (const auto action = join->next_action()) {
        if (action->kind == accel::detail::JoinState::Action::kForward)
          join->model(action->index).shadow(action->buffers, action->reduce);
        else
          state_->optimizer_shadows.at(action->index)(*state_);
      }
    } catch (...) {
      state_->join.reset();
      throw;
    }
    state_->join.reset();
  }

 private:
  std::shared_ptr<accel::detail::TrainingState> state_;
  int exceptions_;
  bool done_ = false;
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_JOIN_HPP
// end <accel/ops/join.hpp>
// begin <accel/ops/split.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines split_between_processes (each rank's contiguous share of a
/// vector or of a tensor's dim 0) and drop_split_padding, its inverse after a
/// gather. Pure functions of (rank, world): no communication.
#ifndef ACCEL_OPS_SPLIT_HPP
#define ACCEL_OPS_SPLIT_HPP

#include <algorithm>
#include <cstdint>
#include <vector>

#include <torch/torch.h>


namespace accel::ops {

/// Rank `rank`'s slice [start, start + count) of n items over `world` ranks:
/// contiguous, in rank order, sizes differing by at most one (the first
/// n % world ranks get one more; with n < world the last ranks get none).
struct SplitRange {
  int64_t start = 0;
  int64_t count = 0;
};

inline SplitRange split_range(int64_t n, int rank, int world) {
  ACCEL_CHECK(world >= 1 && rank >= 0 && rank < world, "accel: split_between_processes() got rank ",
              rank, " of world size ", world, ". Use a rank in [0, world).");
  const int64_t base = n / world, extra = n % world;
  return {rank * base + std::min<int64_t>(rank, extra), base + (rank < extra ? 1 : 0)};
}

/// The count every rank gets with apply_padding: the largest share, ceil(n / world).
inline int64_t padded_count(int64_t n, int world) { return (n + world - 1) / world; }

/// Rank `rank`'s share of `items`. With apply_padding every rank gets
/// padded_count(n, world) items: its slice, then its last item repeated (a
/// rank whose slice is empty gets the input's last item).
template <class T>
std::vector<T> split_between_processes(const std::vector<T>& items, int rank, int world,
                                       bool apply_padding = false) {
  const int64_t n = static_cast<int64_t>(items.size());
  const auto [start, count] = split_range(n, rank, world);
  std::vector<T> out(items.begin() + start, items.begin() + start + count);
  if (apply_padding && n > 0) {
    const T last = count > 0 ? out.back() : items.back();
    out.resize(static_cast<std::size_t>(padded_count(n, world)), last);
  }
  return out;
}

/// The same along dim 0 of a tensor: a view of its rows without padding.
inline torch::Tensor split_between_processes(const torch::Tensor& tensor, int rank, int world,
                                             bool apply_padding = false) {
  ACCEL_CHECK(tensor.defined() && tensor.dim() >= 1,
              "accel: split_between_processes() splits dim 0 and got a 0-d or undefined tensor. "
              "Pass a tensor of rows.");
  const int64_t n = tensor.size(0);
  const auto [start, count] = split_range(n, rank, world);
  auto slice = tensor.narrow(0, start, count);
  const int64_t want = padded_count(n, world);
  if (!apply_padding || n == 0 || count == want) return slice;
  auto last = count > 0 ? slice.narrow(0, count - 1, 1) : tensor.narrow(0, n - 1, 1);
  std::vector<int64_t> reps(static_cast<std::size_t>(tensor.dim()), 1);
  reps[0] = want - count;
  return torch::cat({slice, last.repeat(reps)});
}

/// After a padded split of `total` items over `world` ranks, every rank's
/// padded part gathered in rank order (world * padded_count rows) holds
/// padding in the middle; this keeps each rank's real rows: the original items.
inline torch::Tensor drop_split_padding(const torch::Tensor& gathered, int64_t total, int world) {
  const int64_t k = padded_count(total, world);
  ACCEL_CHECK(gathered.dim() >= 1 && gathered.size(0) == k * world,
              "accel: drop_split_padding() expects ", k * world, " rows (", world, " ranks x ", k,
              "). Pass the gather of every rank's padded split.");
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r) {
    const auto count = split_range(total, r, world).count;
    if (count > 0) parts.push_back(gathered.narrow(0, r * k, count));
  }
  return parts.empty() ? gathered.narrow(0, 0, 0) : torch::cat(parts);
}

template <class T>
std::vector<T> drop_split_padding(const std::vector<T>& gathered, int64_t total, int world) {
  const int64_t k = padded_count(total, world);
  ACCEL_CHECK(static_cast<int64_t>(gathered.size()) == k * world,
              "accel: drop_split_padding() expects ", k * world, " items (", world, " ranks x ", k,
              "). Pass the gather of every rank's padded split.");
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(total));
  for (int r = 0; r < world; ++r) {
    const auto begin = gathered.begin() + r * k;
    out.insert(out.end(), begin, begin + split_range(total, r, world).count);
  }
  return out;
}

/// What the Accelerator remembers of its latest padded split, so that
/// gather_for_metrics can drop the padding again.
struct SplitPadding {
  int64_t total = 0;
  int world = 1;
  /// Whether a gather with these per-rank row counts is of such a split.
  bool matches(const std::vector<int64_t>& rows) const {
    const int64_t k = padded_count(total, world);
    return total > 0 && static_cast<int>(rows.size()) == world &&
           std::all_of(rows.begin(), rows.end(), [k](int64_t r) { return r == k; }) &&
           total % world != 0;
  }
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_SPLIT_HPP
// end <accel/ops/split.hpp>
// begin <accel/ops/trigger.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines ops::Trigger, the flag behind the Accelerator's
/// set_trigger() / check_trigger() (early stopping decided by any rank).
#ifndef ACCEL_OPS_TRIGGER_HPP
#define ACCEL_OPS_TRIGGER_HPP

#include <torch/torch.h>


namespace accel::ops {

/// One flag any rank may set; check() is one all-reduce (max) after which
/// every rank knows whether some rank set it, and the flag is cleared.
class Trigger {
 public:
  void set() { set_ = true; }
  bool check(runtime::Communicator& comm) {
    auto flag = torch::tensor({set_ ? 1 : 0}, torch::TensorOptions().dtype(torch::kInt).device(comm.device()));
    comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
    const bool seen = flag.cpu().item<int>() != 0;
    if (seen) set_ = false;
    return seen;
  }

 private:
  bool set_ = false;
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_TRIGGER_HPP
// end <accel/ops/trigger.hpp>
// begin <accel/shard/detail/bucket_reducer.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::BucketReducer: averages gradients across
/// ranks in buckets whose all-reduce starts from autograd hooks while backward
/// is still running (shard::Replicate).
#ifndef ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP

#include <cstdint>
#include <memory>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/bucket_round.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::BucketRound, one step's gradient
/// reduction over planned buckets (ready flags, in-order launch, work in
/// flight, closing), and BucketReduction, what a reducer does at each point.
#ifndef ACCEL_SHARD_DETAIL_BUCKET_ROUND_HPP
#define ACCEL_SHARD_DETAIL_BUCKET_ROUND_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/accumulator_hooks.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::AccumulatorHooks: callbacks before and
/// after each parameter's gradient is accumulated, kept attached across
/// Module::load.
#ifndef ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
#define ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>


namespace accel::shard::detail {

/// Post-hooks on the AccumulateGrad nodes of leaf parameters: on_ready(k) runs
/// once parameter k's gradient has been accumulated in backward. LibTorch
/// gives a parameter a new accumulator when its storage is replaced (the
/// user's Module::load after prepare() does Tensor::set_), and the old one,
/// with the hook, is then never run: gradients would silently stop being
/// synchronised. refresh() (before every forward of a prepared model) hooks
/// the parameter's current accumulator when it changed.
/// Whether a hook's owner still exists: read on autograd's threads, cleared
/// by the owner's destructor.
using Alive = std::atomic<bool>;

/// before(k) runs just before parameter k's gradient is added into .grad:
/// the last moment to wait for a collective still working on that memory.
class AccumulatorHooks {
 public:
  /// The callbacks must not run after their owner is destroyed: hooks check `alive`.
  AccumulatorHooks(std::vector<torch::Tensor> params, std::function<void(std::size_t)> before,
                   std::function<void(std::size_t)> on_ready, std::weak_ptr<Alive> alive)
      : params_(std::move(params)), before_(std::move(before)), on_ready_(std::move(on_ready)),
        alive_(std::move(alive)), nodes_(params_.size()) {
    for (std::size_t k = 0; k < params_.size(); ++k) hook(k);
  }

  void refresh() {
    for (std::size_t k = 0; k < params_.size(); ++k)
      if (torch::autograd::impl::try_get_grad_accumulator(params_[k]) != nodes_[k]) hook(k);
  }

 private:
  void hook(std::size_t k) {
    auto node = torch::autograd::impl::grad_accumulator(params_[k]);
    ACCEL_CHECK(node, "accel: parameter ", k, " has no gradient accumulator. Give the shard policy "
                "leaf parameters that require gradients.");
    node->add_pre_hook(std::make_unique<PreHook>([before = before_, alive = alive_, k] {
      if (auto a = alive.lock(); a && *a) before(k);
    }));
    node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [on_ready = on_ready_, alive = alive_, k](const torch::autograd::variable_list& outputs,
                                                  const torch::autograd::variable_list&) {
          if (auto a = alive.lock(); a && *a) on_ready(k);
          return outputs;
        }));
    nodes_[k] = std::move(node);  // keeps the node (and its hook) alive
  }

  struct PreHook final : torch::autograd::FunctionPreHook {
    explicit PreHook(std::function<void()> f) : fn(std::move(f)) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
      fn();
      return grads;
    }
    std::function<void()> fn;
  };

  std::vector<torch::Tensor> params_;
  std::function<void(std::size_t)> before_;
  std::function<void(std::size_t)> on_ready_;
  std::weak_ptr<Alive> alive_;
  std::vector<std::shared_ptr<torch::autograd::Node>> nodes_;
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ACCUMULATOR_HOOKS_HPP
// end <accel/shard/detail/accumulator_hooks.hpp>

namespace accel::shard::detail {

/// What a reducer does with its buckets; BucketRound decides when.
class BucketReduction {
 public:
  virtual ~BucketReduction() = default;
  /// Starts the collective that reduces bucket `bucket` across ranks and
  /// returns its work (nullptr: nothing to wait for). The one place where a
  /// bucket's reduction starts: a communication hook plugs in here.
  virtual std::shared_ptr<runtime::Work> launch_reduction(std::size_t bucket) = 0;
  /// Parameter k's gradient is complete for this round, or the round closes
  /// and k got none: the reducer may move it into its bucket.
  virtual void take_gradient(std::size_t /*k*/) {}
  /// Bucket `bucket`'s reduction has finished (its work was waited for).
  virtual void on_reduced(std::size_t /*bucket*/) {}
  /// The round is about to close (finalize, or a second backward reaching a
  /// gradient that is already being reduced).
  virtual void before_close() {}
  /// Bytes of bucket `bucket`'s gradients (before a hook compresses them),
  /// shown in profile() traces.
  virtual int64_t bucket_bytes(std::size_t /*bucket*/) const { return 0; }
};

struct RoundOptions {
  /// Start a bucket's reduction from backward once its gradients are
  /// complete; otherwise all of them when the round closes.
  bool overlap = true;
  /// At most this many reductions in flight (0: no limit): launching bucket b
  /// first completes bucket b - max_in_flight.
  std::size_t max_in_flight = 0;
};

/// One round per optimizer step: autograd hooks mark parameters ready; a
/// bucket whose parameters are all ready may launch, but buckets launch
/// strictly in index order, so every rank issues the same sequence of
/// collectives even when gradients become ready in different orders.
/// close() launches what backward did not (parameters without a gradient
/// contribute their current value) and waits for every reduction.
///
/// The round is a member of its reducer, declared last: it is destroyed
/// first, while the reducer it calls still exists.
class BucketRound {
 public:
  /// sync: whose sync_now() says whether this backward communicates.
  /// hook: how the reducer reduces each bucket (null: comm::MeanHook).
  BucketRound(std::vector<torch::Tensor> params, BucketReduction& reduction, const GradientSync& sync,
              RoundOptions options, std::shared_ptr<comm::Hook> hook)
      : reduction_(reduction), sync_(sync), options_(options),
        hook_(hook ? std::move(hook) : std::make_shared<comm::MeanHook>()), ready_(params.size(), false) {
    hooks_.emplace(
        std::move(params), [this](std::size_t k) { before_accumulate(k); },
        [this](std::size_t k) { on_ready(k); }, alive_);
  }
  BucketRound(const BucketRound&) = delete;
  BucketRound& operator=(const BucketRound&) = delete;
  ~BucketRound() {
    *alive_ = false;  // hooks capture `this`: they must never run after destruction
    try {
      complete_all();
    } catch (...) {
    }
  }

  /// The buckets (between rounds only: when the plan changes before training).
  void set_plan(const BucketPlan& plan) {
    bucket_of_.resize(plan.slots.size());
    for (std::size_t k = 0; k < plan.slots.size(); ++k) bucket_of_[k] = plan.slots[k].bucket;
    params_of_ = plan.buckets;
    pending_.resize(params_of_.size());
    work_.assign(params_of_.size(), nullptr);
    trace_id_.assign(params_of_.size(), -1);
    reset();
  }

  /// Before each forward: hook accumulators that Module::load replaced.
  void refresh_hooks() { hooks_->refresh(); }

  /// Launches what backward did not start, waits for everything in flight.
  void close() {
    reduction_.before_close();
    if (!started_) return;
    for (std::size_t b = next_launch_; b < params_of_.size(); ++b)
      for (auto k : params_of_[b])
        if (!ready_[k]) reduction_.take_gradient(k);
    for (std::size_t b = next_launch_; b < params_of_.size(); ++b) pending_[b] = 0;
    launch_ready();
    complete_all();
    reset();
    ++rounds_;
  }

  /// Closes a round that no backward started: every bucket with its
  /// parameters' current gradients (join_uneven_inputs' zero contribution).
  void close_without_backward() {
    started_ = true;
    close();
  }

  /// Waits for bucket b's reduction, if one is in flight.
  void complete(std::size_t b) {
    if (!work_[b]) return;
    auto w = std::move(work_[b]);
    {
      profiling::Span wait("accel: wait for bucket reduction", "accel.comm");
      wait.arg("bucket", b);
      w->wait();
    }
    reduction_.on_reduced(b);
    trace_finished(b);
  }

  bool started() const { return started_; }
  /// The communication hook launch_reduction() reduces buckets with.
  comm::Hook& hook() const { return *hook_; }
  /// It may change only before the first backward.
  void set_hook(std::shared_ptr<comm::Hook> hook) {
    ACCEL_CHECK(rounds_ == 0 && !started_, "accel: register_comm_hook() after a backward of the "
                "prepared model: every rank must reduce every step's buckets the same way. "
                "Register the hook before training starts.");
    hook_ = std::move(hook);
  }
  /// Rounds closed so far.
  int64_t rounds() const { return rounds_; }
  /// Buckets whose reduction started from a backward hook (the overlap that
  /// happened), summed over rounds; for tests and benchmarks.
  std::size_t launched_during_backward() const { return launched_in_hooks_; }

 private:
  // A second backward before the optimizer step: close the first round before
  // autograd adds into a bucket whose reduction may still run (the average of
  // averages is still the average); the hook then starts a new round.
  void before_accumulate(std::size_t k) {
    if (sync_.sync_now() && ready_[k]) close();
  }

  void on_ready(std::size_t k) {
    if (!sync_.sync_now()) return;  // a non-sync micro-step: no communication at all
    started_ = true;
    ready_[k] = true;
    reduction_.take_gradient(k);
    if (--pending_[bucket_of_[k]] == 0) trace_queued(bucket_of_[k]);
    if (pending_[bucket_of_[k]] == 0 && options_.overlap) {
      const std::size_t before = next_launch_;
      started_in_hook_ = true;
      launch_ready();
      started_in_hook_ = false;
      launched_in_hooks_ += next_launch_ - before;
    }
  }

  void launch_ready() {
    while (next_launch_ < params_of_.size() && pending_[next_launch_] == 0) {
      const std::size_t b = next_launch_++;
      if (options_.max_in_flight > 0 && b >= options_.max_in_flight) complete(b - options_.max_in_flight);
      if (trace_id_[b] < 0) trace_queued(b);  // queued by close(), not by backward
      const int64_t started = profiling::Events::recording() ? profiling::Events::now_us() : 0;
      work_[b] = reduction_.launch_reduction(b);
      trace_started(b, started);
      if (!work_[b]) trace_finished(b);  // nothing to wait for (one process)
    }
  }

  // profile() traces: one asynchronous span per bucket and round, from the
  // moment its gradients are complete (queued) through the launch of its
  // collective (started) to the moment a wait saw it done (finished). Only
  // when recording: otherwise each costs one relaxed atomic load.
  void trace_queued(std::size_t b) {
    if (!profiling::Events::recording()) return;
    trace_id_[b] = rounds_ * static_cast<int64_t>(params_of_.size()) + static_cast<int64_t>(b);
    using profiling::event_arg;
    profiling::Events::async('b', bucket_name(b), "accel.comm", trace_id_[b], profiling::Events::now_us(),
                             {event_arg("bucket", b), event_arg("bytes", reduction_.bucket_bytes(b)),
                              event_arg("round", rounds_)});
  }
  void trace_started(std::size_t b, int64_t started_us) {
    if (trace_id_[b] < 0 || !profiling::Events::recording()) return;
    profiling::Events::async('n', "started: " + bucket_name(b), "accel.comm", trace_id_[b], started_us,
                             {profiling::event_arg("from", started_in_hook_ ? "backward" : "close")});
  }
  void trace_finished(std::size_t b) {
    if (trace_id_[b] < 0) return;
    if (profiling::Events::recording())
      profiling::Events::async('e', bucket_name(b), "accel.comm", trace_id_[b], profiling::Events::now_us());
    trace_id_[b] = -1;
  }
  static std::string bucket_name(std::size_t b) { return "reduce bucket " + std::to_string(b); }

  void complete_all() {
    for (std::size_t b = 0; b < work_.size(); ++b) complete(b);
  }

  void reset() {
    for (std::size_t b = 0; b < params_of_.size(); ++b) pending_[b] = params_of_[b].size();
    std::fill(ready_.begin(), ready_.end(), false);
    next_launch_ = 0;
    started_ = false;
  }

  BucketReduction& reduction_;
  const GradientSync& sync_;
  RoundOptions options_;
  std::shared_ptr<comm::Hook> hook_;
  std::vector<std::size_t> bucket_of_;              ///< per parameter
  std::vector<std::vector<std::size_t>> params_of_;  ///< per bucket
  std::vector<std::size_t> pending_;                 ///< per bucket: parameters not ready yet
  std::vector<std::shared_ptr<runtime::Work>> work_;  ///< per bucket: its reduction in flight
  std::vector<bool> ready_;                          ///< per parameter
  std::vector<int64_t> trace_id_;                    ///< per bucket: its open trace span, or -1
  bool started_in_hook_ = false;                     ///< launch_ready() runs from backward
  std::size_t next_launch_ = 0;
  std::size_t launched_in_hooks_ = 0;
  int64_t rounds_ = 0;
  bool started_ = false;
  std::shared_ptr<Alive> alive_ = std::make_shared<Alive>(true);
  std::optional<AccumulatorHooks> hooks_;  ///< after alive_: hooks check it
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_ROUND_HPP
// end <accel/shard/detail/bucket_round.hpp>

namespace accel::shard::detail {

/// Gradients live in a few flat buffers (buckets, planned by plan_buckets)
/// that are allocated once and reused every step: each parameter's .grad is
/// re-pointed at its slice, so autograd accumulates straight into the buffer
/// and no copy is needed after the first step. BucketRound decides when each
/// bucket is all-reduced.
class BucketReducer final : public GradientSync, private BucketReduction {
 public:
  /// overlap: start a bucket's all-reduce from backward once it is full;
  /// otherwise all of them in finalize(), after backward. sync_now: see GradientSync.
  /// hook: how each bucket is averaged (null: comm::MeanHook).
  BucketReducer(std::vector<torch::Tensor> params, std::shared_ptr<runtime::Communicator> comm,
                int64_t bucket_bytes, bool overlap = true, std::shared_ptr<const bool> sync_now = nullptr,
                std::shared_ptr<comm::Hook> hook = nullptr)
      : GradientSync(std::move(sync_now)), params_(std::move(params)), comm_(std::move(comm)),
        plan_(plan_buckets(params_, bucket_bytes)),
        overlap_(overlap), round_(params_, *this, *this, RoundOptions{.overlap = overlap}, std::move(hook)) {
    for (std::size_t b = 0; b < plan_.size(); ++b) {
      buffers_.push_back(torch::zeros({plan_.numel[b]}, params_[plan_.buckets[b].front()].options().requires_grad(false)));
      views_.push_back(member_views(plan_, b, buffers_.back()));
    }
    round_.set_plan(plan_);
  }

  void before_forward() override { round_.refresh_hooks(); }
  comm::Hook* comm_hook() const override { return &round_.hook(); }
  void set_comm_hook(std::shared_ptr<comm::Hook> hook) override { round_.set_hook(std::move(hook)); }
  void finalize() override { round_.close(); }
  void shadow_backward() override {
    {
      torch::NoGradGuard no_grad;
      for (auto& p : params_)
        if (p.grad().defined()) p.mutable_grad().zero_();
    }
    round_.close_without_backward();
  }

  std::size_t num_buckets() const { return plan_.size(); }
  bool overlaps() const { return overlap_; }
  /// Buckets whose all-reduce was started from a backward hook (the overlap
  /// that happened); exposed for tests/benchmarks.
  std::size_t launched_during_backward() const { return round_.launched_during_backward(); }

 private:
  std::shared_ptr<runtime::Work> launch_reduction(std::size_t b) override {
    if (comm_->size() == 1) return nullptr;
    comm::GradBucket bucket{b, buffers_[b], views_[b], b + 1 == plan_.size()};
    return round_.hook().all_reduce(bucket, *comm_);
  }

  int64_t bucket_bytes(std::size_t b) const override { return static_cast<int64_t>(buffers_[b].nbytes()); }

  // Points .grad at the parameter's slice of its bucket (autograd then adds
  // into the bucket); a parameter without a gradient contributes its current
  // value (zero after zero_grad).
  void take_gradient(std::size_t k) override {
    const auto& slot = plan_.slots[k];
    auto& grad = params_[k].mutable_grad();
    auto slice = storage_alias(buffers_[slot.bucket], slot.offset, params_[k].sizes());
    if (grad.defined() && grad.data_ptr() == slice.data_ptr() && grad.is_contiguous()) return;
    torch::NoGradGuard no_grad;
    if (grad.defined())
      slice.copy_(grad);
    else
      slice.zero_();
    grad = slice;
  }

  std::vector<torch::Tensor> params_;
  std::shared_ptr<runtime::Communicator> comm_;
  BucketPlan plan_;
  std::vector<torch::Tensor> buffers_;  ///< one flat buffer per bucket
  std::vector<std::vector<torch::Tensor>> views_;  ///< per bucket: its parameters' gradients in it
  bool overlap_;
  BucketRound round_;  ///< last: destroyed first, while what it calls exists
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_BUCKET_REDUCER_HPP
// end <accel/shard/detail/bucket_reducer.hpp>
// begin <accel/shard/detail/zero_binding.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines how the Accelerator ties an optimizer to a sharded model and
/// clips sharded gradients (shard::ShardOptimizer, shard::ShardGradients).
#ifndef ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP
#define ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/zero_reducer.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::ZeroReducer: the gradient and parameter
/// traffic of shard::ShardOptimizer (ZeRO-1), shard::ShardGradients (ZeRO-2)
/// and shard::ShardParameters (ZeRO-3).
#ifndef ACCEL_SHARD_DETAIL_ZERO_REDUCER_HPP
#define ACCEL_SHARD_DETAIL_ZERO_REDUCER_HPP

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

// begin <accel/shard/detail/parameter_units.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::detail::ParameterUnits: which parameters each
/// unit of a model computes with, the granularity at which
/// shard::ShardParameters gathers them.
#ifndef ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
#define ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <torch/torch.h>


namespace accel::shard::detail {

/// Without shard::Unit in the model, unit u is the model's u-th child (one
/// level: a Sequential's modules in order) and parameters registered on the
/// model itself form one more unit. With them (named_units()), unit 0 is
/// every parameter outside them, held whole from the start of the model's
/// forward until backward reduce-scatters its gradients, and unit u is the
/// u-th shard::Unit.
struct ParameterUnits {
  std::vector<std::vector<std::size_t>> uses;  ///< per unit: the trainable parameters it computes with
  std::vector<int> owner;                      ///< per parameter: the first unit using it (its buckets' unit)
  bool named = false;                          ///< units are shard::Unit modules, and unit 0 is held
};

inline ParameterUnits units_of(const torch::nn::Module& model, const std::vector<torch::Tensor>& trainable) {
  std::unordered_map<const c10::TensorImpl*, std::size_t> index;
  for (std::size_t k = 0; k < trainable.size(); ++k) index[trainable[k].unsafeGetTensorImpl()] = k;
  ParameterUnits units;
  units.owner.assign(trainable.size(), -1);
  const auto add = [&](std::size_t u, const std::vector<torch::Tensor>& params) {
    if (units.uses.size() <= u) units.uses.resize(u + 1);
    for (const auto& p : params) {
      const auto it = index.find(p.unsafeGetTensorImpl());
      if (it == index.end()) continue;  // frozen: every rank keeps it whole
      units.uses[u].push_back(it->second);
      if (units.owner[it->second] < 0) units.owner[it->second] = static_cast<int>(u);
    }
  };
  if (const auto named = named_units(model); !named.empty()) {
    units.named = true;
    // Unit 0: the parameters of the modules outside every unit.
    std::vector<torch::Tensor> outside = model.parameters(/*recurse=*/false);
    for (const auto& item : model.named_modules("", /*include_self=*/false)) {
      bool inside = false;
      for (const auto& [name, unit] : named)
        inside = inside || item.key() == name || item.key().rfind(name + ".", 0) == 0;
      if (inside) continue;
      const auto own = item.value()->parameters(/*recurse=*/false);
      outside.insert(outside.end(), own.begin(), own.end());
    }
    add(0, outside);
    for (std::size_t u = 0; u < named.size(); ++u) add(u + 1, named[u].second->parameters());
    return units;
  }
  const auto children = model.children();
  for (std::size_t u = 0; u < children.size(); ++u) add(u, children[u]->parameters());
  add(children.size(), model.parameters(/*recurse=*/false));
  return units;
}

/// prepare(): tells each shard::Unit of the model its number and the
/// model's gradient sync.
inline void bind_named_units(const torch::nn::Module& model, const std::shared_ptr<GradientSync>& sync) {
  const auto named = named_units(model);
  for (std::size_t u = 0; u < named.size(); ++u)
    dynamic_cast<UnitSlot&>(*named[u].second).bind(sync, u + 1);
}

/// The buckets of a sharded model: one optimizer group's parameters each
/// and, under ZeRO-3 (units given), one unit's, so that a unit is gathered by
/// whole buckets. The reducer and load_state's one-process layout both use
/// this, so a checkpoint's buckets match on any number of processes.
inline BucketPlan zero_plan(const std::vector<torch::Tensor>& params, int64_t bucket_bytes,
                            const std::vector<int>& group_of, const std::optional<ParameterUnits>& units) {
  if (!units) return plan_buckets(params, bucket_bytes, group_of);
  std::vector<int> keys(group_of.size());
  const auto n = static_cast<int>(units->uses.size());
  for (std::size_t k = 0; k < keys.size(); ++k) keys[k] = group_of[k] * n + units->owner[k];
  return plan_buckets(params, bucket_bytes, keys);
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_PARAMETER_UNITS_HPP
// end <accel/shard/detail/parameter_units.hpp>

namespace accel::shard::detail {

/// Parameters are grouped into buckets as in BucketReducer (reverse
/// registration order, one dtype and one optimizer parameter group per
/// bucket, at most bucket_bytes), each padded to a multiple of the world size
/// N. Every bucket is one flat buffer the model's parameters point into
/// (set_data), and rank r owns chunk r of every bucket: the optimizer is
/// rebound (adopt()) to those chunks, so its state exists for 1/N of the
/// model. A reduce-scatter of a bucket hands each rank exactly its chunk, and
/// an all-gather of the chunks rebuilds the bucket in place.
///
/// ZeRO-1 (shard_gradients = false): full gradients live in padded flat
/// buckets, all-reduced from backward hooks as with Replicate; each chunk's
/// .grad is an alias of its part of the averaged bucket (no copy).
/// ZeRO-2 (shard_gradients = true): each rank keeps only its chunks'
/// gradients (persistent, 1/N). When a bucket's gradients are complete
/// during backward they are copied into a staging buffer, the parameters'
/// .grad tensors are released, and the staging buffer is reduce-scattered and
/// added to the chunk gradients; at most two buckets are in flight, so the
/// transient memory is about two buckets plus the gradients of the bucket
/// being filled. (On the non-sync micro-steps of accumulate() the full
/// gradients accumulate locally, as without sharding.)
/// ZeRO-3 (units given): as ZeRO-2, and a bucket holds one unit's parameters
/// of one optimizer group. Each rank keeps its chunks in storage of their
/// own; a bucket's flat storage is allocated and all-gathered only while its
/// unit computes (ParameterGather), and freed when its unit's forward ends
/// and when its gradients are handed to the reduce-scatter. The parameters
/// keep pointing into the flat storage, so autograd's saved references to
/// them see the values again once the unit is gathered for its backward.
/// With prefetch, gathering a unit also starts the all-gather of the next
/// unit that has parameters (the previous one in backward), so that it runs
/// while this unit computes; then two units are whole at a time.
class ZeroReducer final : public GradientSync,
                          public OptimizerPartition,
                          public ParameterGather,
                          private BucketReduction {
 public:
  /// hook: how each bucket is averaged (null: comm::MeanHook); ZeRO-2 uses
  /// its reduce_scatter. units: ZeRO-3 (needs shard_gradients); prefetch:
  /// ZeRO-3 gathers one unit ahead.
  ZeroReducer(std::vector<torch::Tensor> params, std::shared_ptr<runtime::Communicator> comm,
              int64_t bucket_bytes, bool shard_gradients, std::shared_ptr<const bool> sync_now = nullptr,
              std::shared_ptr<comm::Hook> hook = nullptr, std::optional<ParameterUnits> units = std::nullopt,
              bool prefetch = false)
      : GradientSync(std::move(sync_now)), params_(std::move(params)), comm_(std::move(comm)), bucket_bytes_(bucket_bytes),
        shard_gradients_(shard_gradients || units.has_value()), units_(std::move(units)),
        prefetch_(prefetch && units_.has_value()), world_(comm_->size()),
        rank_(comm_->rank()),
        // ZeRO-2 bounds its staging memory: at most two buckets in flight.
        round_(params_, *this, *this, RoundOptions{.overlap = true, .max_in_flight = shard_gradients_ ? 2u : 0u},
               std::move(hook)) {
    for (std::size_t k = 0; k < params_.size(); ++k) index_[params_[k].unsafeGetTensorImpl()] = k;
    build_layout(std::vector<int>(params_.size(), 0));
  }

  void before_forward() override { round_.refresh_hooks(); }
  void finalize() override { round_.close(); }
  void shadow_backward() override {
    zero_grad();  // the partition's gradients too: the reduction adds into them
    round_.close_without_backward();
  }
  comm::Hook* comm_hook() const override { return &round_.hook(); }
  void set_comm_hook(std::shared_ptr<comm::Hook> hook) override { round_.set_hook(std::move(hook)); }

  void zero_grad() override {
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      if (!p.grad().defined()) continue;
      if (shard_gradients_)
        p.mutable_grad() = torch::Tensor();  // only the partition's gradients persist
      else
        p.mutable_grad().zero_();  // ZeRO-1: the bucket slices, chunks included
    }
    for (auto& b : buckets_) b.shard.mutable_grad().zero_();
  }

  void after_step(bool stepped) override {
    if (units_) {  // the chunks are the parameters now; the next forward gathers them
      release_all();
      return;
    }
    if (!stepped || world_ == 1) return;
    reattach_parameters();
    profiling::Span span("accel: all-gather updated parameters", "accel.comm");
    torch::NoGradGuard no_grad;
    // At most two buckets in flight (Gloo gathers into a temporary as large
    // as the bucket); every rank has the full parameters before the next forward.
    std::vector<std::shared_ptr<runtime::Work>> works(buckets_.size());
    std::vector<torch::Tensor> inputs(buckets_.size());
    for (std::size_t i = 0; i < buckets_.size(); ++i) {
      if (i >= 2) works[i - 2]->wait();
      inputs[i] = buckets_[i].shard.detach().clone();  // input must not alias the output
      works[i] = comm_->all_gather(buckets_[i].flat, inputs[i]);
    }
    for (std::size_t i = buckets_.size() >= 2 ? buckets_.size() - 2 : 0; i < buckets_.size(); ++i)
      works[i]->wait();
  }

  /// Rebinds `opt` to this rank's chunks: each parameter group's parameters
  /// become the chunks of its buckets, keeping the group's options.
  void adopt(torch::optim::Optimizer& opt) {
    ACCEL_CHECK(!adopted_, "accel: two optimizers were prepared for the parameters of one model "
                "under a shard policy. Use one optimizer (with several parameter groups if needed) "
                "per prepared model, or shard::Replicate.");
    ACCEL_CHECK(opt.state().empty(), "accel: the optimizer already has state (it stepped before "
                "prepare()); a shard policy partitions that state. Prepare the optimizer before "
                "its first step.");
    std::vector<int> group_of(params_.size(), -1);
    auto& groups = opt.param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      for (auto& p : groups[g].params()) {
        auto it = index_.find(p.unsafeGetTensorImpl());
        ACCEL_CHECK(it != index_.end(), "accel: the optimizer holds a parameter that is not a "
                    "trainable parameter of the prepared model it shares parameters with. Under a "
                    "shard policy one optimizer covers exactly one prepared model's trainable "
                    "parameters; prepare the model first and give the optimizer only its parameters.");
        ACCEL_CHECK(group_of[it->second] == -1, "accel: a parameter appears twice in the "
                    "optimizer's parameter groups. List each parameter once.");
        group_of[it->second] = static_cast<int>(g);
      }
    }
    for (std::size_t k = 0; k < params_.size(); ++k)
      ACCEL_CHECK(group_of[k] != -1, "accel: parameter ", k, " of the prepared model requires a "
                  "gradient but is in no parameter group of the optimizer; a shard policy steps "
                  "only what the optimizer holds. Add it to the optimizer, or call "
                  "requires_grad_(false) on it before prepare().");
    if (group_of != group_of_) {
      ACCEL_CHECK(round_.rounds() == 0 && !round_.started(), "accel: the optimizer was prepared after a "
                  "backward under a shard policy. Prepare the model and its optimizer before "
                  "training (in the same prepare() call).");
      build_layout(group_of);
    }
    std::vector<std::vector<torch::Tensor>> listed;
    for (auto& g : groups) listed.push_back(g.params());
    whole_layout_ = parameter_layout(params_, plan_, group_of_, listed);
    for (std::size_t g = 0; g < groups.size(); ++g) {
      std::vector<torch::Tensor> chunks;
      for (auto& b : buckets_)
        if (b.group == static_cast<int>(g)) chunks.push_back(b.shard);
      groups[g].params() = std::move(chunks);
    }
    adopted_ = true;
  }

  /// What the adopted optimizer holds (this rank's chunks), and what it
  /// would hold unpartitioned (its parameters whole): for load_state.
  PartitionLayout held_layout() const {
    std::vector<int> group;
    for (const auto& b : buckets_) group.push_back(b.group);
    return chunk_layout(plan_.numel, std::move(group), whole_layout_.groups.size(), world_, rank_);
  }
  const PartitionLayout& whole_layout() const { return whole_layout_; }

  // ZeRO-3 (ParameterGather).
  ParameterGather* parameter_gather() override { return units_ ? this : nullptr; }
  void gather_unit(std::size_t u) override {
    make_whole(unit_buckets_.at(u));
    if (prefetch_)
      for (auto v = u + 1; v < unit_buckets_.size(); ++v)
        if (!unit_buckets_[v].empty()) return start_gathers(unit_buckets_[v]);
  }
  void release_unit(std::size_t u) override {
    for (auto b : unit_buckets_.at(u))
      if (u == 0 || !held(b)) release(b);
  }
  void gather_for_backward(std::size_t u) override {
    // Freed first (on the non-sync micro-steps of accumulate() nothing else
    // frees them), so that at most one unit is whole.
    const auto& mine = unit_buckets_.at(u);
    for (std::size_t v = u + 1; v < unit_buckets_.size(); ++v)
      for (auto b : unit_buckets_[v])
        if (!std::binary_search(mine.begin(), mine.end(), b) && !held(b)) release(b);
    make_whole(mine);
    if (prefetch_)
      for (auto v = u; v-- > 0;)
        if (!unit_buckets_[v].empty()) return start_gathers(unit_buckets_[v]);
  }
  bool has_named_units() const override { return units_ && units_->named; }
  void gather_for_forward() override {
    if (has_named_units()) return gather_unit(0);
    gather_all();
  }
  void gather_all() override {
    std::vector<std::size_t> all(buckets_.size());
    for (std::size_t b = 0; b < all.size(); ++b) all[b] = b;
    make_whole(all);
  }
  void release_all() override {
    for (std::size_t b = 0; b < buckets_.size(); ++b) release(b);
    streamed_.reset();
  }
  void gather_holding(const torch::Tensor& t) override {
    const auto it = index_.find(t.unsafeGetTensorImpl());
    if (!units_ || it == index_.end()) return;
    const auto b = plan_.slots[it->second].bucket;
    if (streamed_ && *streamed_ != b) release(*streamed_);
    streamed_ = b;
    make_whole({b});
  }
  void keep_written_values() override {
    if (!units_) return;  // ZeRO-1/2: the chunks are views of the whole buckets
    reattach_parameters();
    torch::NoGradGuard no_grad;
    for (auto& b : buckets_)
      if (b.whole) b.shard.detach().copy_(b.flat.narrow(0, rank_ * b.chunk, b.chunk));
  }
  /// Bytes of parameter storage this rank holds now (ZeRO-3: its chunks plus
  /// the buckets gathered at the moment), and the most since the last reset;
  /// for tests and the benchmark.
  int64_t parameter_bytes() const {
    int64_t n = 0;
    for (const auto& b : buckets_) {
      if (units_) n += static_cast<int64_t>(b.shard.nbytes());
      if (b.whole) n += static_cast<int64_t>(b.flat.nbytes());
    }
    return n;
  }
  int64_t peak_parameter_bytes() const { return peak_parameter_bytes_; }
  void reset_peak_parameter_bytes() { peak_parameter_bytes_ = parameter_bytes(); }

  bool owns(const torch::Tensor& p) const { return index_.count(p.unsafeGetTensorImpl()) > 0; }
  std::size_t num_params() const { return params_.size(); }
  bool shards_gradients() const { return shard_gradients_; }
  std::size_t num_buckets() const { return buckets_.size(); }
  runtime::Communicator& communicator() const { return *comm_; }
  /// This rank's chunk of every bucket: what the optimizer steps.
  std::vector<torch::Tensor> partitions() const {
    std::vector<torch::Tensor> out;
    for (const auto& b : buckets_) out.push_back(b.shard);
    return out;
  }
  /// Bytes of gradient storage this rank holds between steps (the buckets
  /// for ZeRO-1, the chunks' gradients for ZeRO-2, plus any parameter
  /// gradient not living in them); for tests and the benchmark.
  int64_t gradient_bytes() const {
    int64_t n = 0;
    for (const auto& b : buckets_) {
      const auto& g = shard_gradients_ ? b.shard.grad() : b.grad;
      if (g.defined()) n += static_cast<int64_t>(g.nbytes());
    }
    for (std::size_t k = 0; k < params_.size(); ++k) {
      const auto& g = params_[k].grad();
      if (g.defined() && (shard_gradients_ || !aliases_bucket(k))) n += static_cast<int64_t>(g.nbytes());
    }
    return n;
  }

 private:
  struct Bucket {
    int group = 0;
    int64_t chunk = 0;    ///< padded numel / world
    torch::Tensor flat;   ///< the parameters, world * chunk elements (padding zero)
    torch::Tensor grad;   ///< ZeRO-1: the full gradients, same layout; ZeRO-2: undefined
    std::vector<torch::Tensor> grad_views;  ///< ZeRO-1: each member's slice of grad (for hooks)
    torch::Tensor shard;  ///< chunk rank of flat: a leaf the optimizer steps
    torch::Tensor staging, received;  ///< ZeRO-2, while a reduce-scatter is in flight
    bool whole = true;    ///< flat has storage (ZeRO-3: only while gathered or gathering)
    std::shared_ptr<runtime::Work> gathering;  ///< ZeRO-3: its all-gather, until waited for
  };

  void build_layout(const std::vector<int>& group_of) {
    if (units_ && !buckets_.empty()) gather_all();  // the new buckets take the parameters' values
    torch::NoGradGuard no_grad;
    group_of_ = group_of;
    plan_ = zero_plan(params_, bucket_bytes_, group_of, units_);
    std::vector<Bucket> buckets;
    for (std::size_t i = 0; i < plan_.size(); ++i) {
      const auto& members = plan_.buckets[i];
      Bucket b;
      b.group = group_of[members.front()];
      b.chunk = (plan_.numel[i] + world_ - 1) / world_;
      const auto opts = params_[members.front()].options().requires_grad(false);
      b.flat = torch::zeros({b.chunk * world_}, opts);
      if (!shard_gradients_) {
        b.grad = torch::zeros({b.chunk * world_}, opts);
        b.grad_views = member_views(plan_, i, b.grad);
      }
      for (auto k : members) {
        auto& p = params_[k];
        auto slice = storage_alias(b.flat, plan_.slots[k].offset, p.sizes());
        slice.copy_(p.detach());
        auto old_grad = p.grad();
        p.set_data(slice);  // the module's parameter now lives in the bucket
        if (!shard_gradients_ && old_grad.defined()) {
          auto gslice = storage_alias(b.grad, plan_.slots[k].offset, p.sizes());
          gslice.copy_(old_grad);
          p.mutable_grad() = gslice;
        }
      }
      b.shard = storage_alias(b.flat, rank_ * b.chunk, {b.chunk});
      if (units_) b.shard = b.shard.clone();  // outlives the flat storage
      b.shard.set_requires_grad(true);
      b.shard.mutable_grad() = shard_gradients_ ? torch::zeros({b.chunk}, opts)
                                                : storage_alias(b.grad, rank_ * b.chunk, {b.chunk});
      buckets.push_back(std::move(b));
    }
    buckets_ = std::move(buckets);
    round_.set_plan(plan_);
    unit_buckets_.clear();
    if (units_)
      for (const auto& uses : units_->uses) {
        std::vector<std::size_t> bs;
        for (auto k : uses) bs.push_back(plan_.slots[k].bucket);
        std::sort(bs.begin(), bs.end());
        bs.erase(std::unique(bs.begin(), bs.end()), bs.end());
        unit_buckets_.push_back(std::move(bs));
      }
    reset_peak_parameter_bytes();
  }

  // ZeRO-3 with shard::Unit: bucket b holds parameters outside the units,
  // whole from the model's forward until backward reduce-scatters them.
  bool held(std::size_t b) const {
    return units_ && units_->named && std::binary_search(unit_buckets_[0].begin(), unit_buckets_[0].end(), b);
  }

  // ZeRO-3: buckets bs hold the parameters when this returns.
  void make_whole(const std::vector<std::size_t>& bs) {
    start_gathers(bs);
    profiling::Span span("accel: wait for parameters", "accel.comm");
    for (auto i : bs) finish_gather(i);
  }

  // ZeRO-3: allocates the flat storage of the buckets that are not whole and
  // starts all-gathering every rank's chunk into it.
  void start_gathers(const std::vector<std::size_t>& bs) {
    profiling::Span span("accel: all-gather parameters", "accel.comm");
    torch::NoGradGuard no_grad;
    for (auto i : bs) {
      auto& b = buckets_[i];
      if (b.whole) continue;
      auto* storage = b.flat.storage().unsafeGetStorageImpl();
      const auto bytes = b.flat.nbytes();
      storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
      storage->set_nbytes(bytes);
      b.whole = true;
      b.gathering = comm_->all_gather(b.flat, b.shard.detach());
    }
    peak_parameter_bytes_ = std::max(peak_parameter_bytes_, parameter_bytes());
  }

  void finish_gather(std::size_t i) {
    auto& b = buckets_[i];
    if (!b.gathering) return;
    std::exchange(b.gathering, nullptr)->wait();
  }

  // ZeRO-3: frees bucket i's flat storage (the module's parameters keep their
  // shapes, with no memory behind them until the next make_whole).
  void release(std::size_t i) {
    auto& b = buckets_[i];
    if (!units_ || !b.whole) return;
    finish_gather(i);  // never free memory a collective still writes
    auto* storage = b.flat.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, b.flat.device()));
    storage->set_nbytes(0);
    b.whole = false;
  }

  // Module::load (load_state) and user code may give a parameter new storage
  // (Tensor::set_): its values move back into the bucket, and the parameter
  // points there again, before the optimizer steps the bucket's chunk.
  void reattach_parameters() {
    for (std::size_t i = 0; i < buckets_.size(); ++i) finish_gather(i);  // ZeRO-3: a prefetch may run
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < params_.size(); ++k) {
      auto& p = params_[k];
      const auto& slot = plan_.slots[k];
      const auto& b = buckets_[slot.bucket];
      if (!b.whole) continue;  // ZeRO-3: written only while gathered
      if (p.storage().unsafeGetStorageImpl() == b.flat.storage().unsafeGetStorageImpl() &&
          p.storage_offset() == b.flat.storage_offset() + slot.offset && p.is_contiguous())
        continue;
      // A parameter of another shape would overwrite its neighbours in the bucket.
      ACCEL_CHECK(p.sizes().vec() == slot.shape,
                  "accel: parameter ", k, " of a sharded model changed its shape from ",
                  c10::IntArrayRef(slot.shape), " to ", p.sizes(),
                  " after prepare(). Give parameters their final shapes before prepare().");
      ACCEL_CHECK(p.scalar_type() == b.flat.scalar_type(), "accel: parameter ", k,
                  " of a sharded model changed its dtype from ", b.flat.scalar_type(), " to ",
                  p.scalar_type(), ". Convert the model before prepare().");
      auto slice = storage_alias(b.flat, slot.offset, p.sizes());
      slice.copy_(p.detach());
      p.set_data(slice);
    }
  }

  bool aliases_bucket(std::size_t k) const {
    const auto& g = params_[k].grad();
    const auto& b = buckets_[plan_.slots[k].bucket];
    return g.defined() && b.grad.defined() &&
           g.data_ptr() == static_cast<char*>(b.grad.data_ptr()) +
                               plan_.slots[k].offset * static_cast<int64_t>(b.grad.element_size());
  }

  // The round's steps (BucketReduction).
  void before_close() override { reattach_parameters(); }

  // ZeRO-1: autograd accumulates straight into the bucket from then on (a
  // parameter without a gradient contributes its current value, zero after
  // zero_grad). ZeRO-2 copies the gradients when the bucket launches.
  void take_gradient(std::size_t k) override {
    if (shard_gradients_ || (aliases_bucket(k) && params_[k].grad().is_contiguous())) return;
    torch::NoGradGuard no_grad;
    auto& p = params_[k];
    auto slice = storage_alias(buckets_[plan_.slots[k].bucket].grad, plan_.slots[k].offset, p.sizes());
    if (p.grad().defined())
      slice.copy_(p.grad());
    else
      slice.zero_();
    p.mutable_grad() = slice;
  }

  std::shared_ptr<runtime::Work> launch_reduction(std::size_t index) override {
    torch::NoGradGuard no_grad;
    auto& b = buckets_[index];
    const bool last = index + 1 == buckets_.size();
    if (!shard_gradients_) {
      comm::GradBucket bucket{index, b.grad, b.grad_views, last};
      return round_.hook().all_reduce(bucket, *comm_);
    }
    b.staging = torch::zeros({b.chunk * world_}, b.flat.options());
    for (auto k : plan_.buckets[index]) {
      auto& p = params_[k];
      if (!p.grad().defined()) continue;
      b.staging.narrow(0, plan_.slots[k].offset, p.numel()).copy_(p.grad().reshape(-1));
      p.mutable_grad() = torch::Tensor();  // released: the partition keeps what this rank needs
    }
    release(index);  // ZeRO-3: backward has used these parameters for the last time this step
    b.received = torch::empty({b.chunk}, b.flat.options());
    comm::GradBucket bucket{index, b.staging, member_views(plan_, index, b.staging), last};
    return round_.hook().reduce_scatter(b.received, bucket, *comm_);
  }

  int64_t bucket_bytes(std::size_t index) const override {
    return static_cast<int64_t>(buckets_[index].flat.nbytes());
  }

  void on_reduced(std::size_t index) override {
    if (!shard_gradients_) return;
    auto& b = buckets_[index];
    torch::NoGradGuard no_grad;
    b.shard.mutable_grad().add_(b.received);
    b.staging = torch::Tensor();
    b.received = torch::Tensor();
  }

  std::vector<torch::Tensor> params_;
  std::shared_ptr<runtime::Communicator> comm_;
  int64_t bucket_bytes_;
  bool shard_gradients_;
  std::optional<ParameterUnits> units_;             ///< ZeRO-3
  bool prefetch_;                                   ///< ZeRO-3: gather one unit ahead
  std::vector<std::vector<std::size_t>> unit_buckets_;  ///< ZeRO-3: the buckets each unit computes with
  int64_t peak_parameter_bytes_ = 0;
  std::optional<std::size_t> streamed_;             ///< ZeRO-3: the bucket gather_holding() made whole
  int world_, rank_;
  std::unordered_map<const c10::TensorImpl*, std::size_t> index_;
  std::vector<int> group_of_;
  BucketPlan plan_;
  std::vector<Bucket> buckets_;
  bool adopted_ = false;
  PartitionLayout whole_layout_;  ///< set by adopt()
  BucketRound round_;  ///< last: destroyed first, while what it calls exists
};

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ZERO_REDUCER_HPP
// end <accel/shard/detail/zero_reducer.hpp>

namespace accel::shard::detail {

/// The reducers of the prepared sharded models (TrainingState::sharded).
using ZeroReducers = std::vector<std::shared_ptr<ZeroReducer>>;

/// The sharded model (among the prepared ones) whose parameter `p` is, or null.
inline std::shared_ptr<ZeroReducer> find_zero_reducer(const ZeroReducers& sharded, const torch::Tensor& p) {
  for (const auto& z : sharded)
    if (z->owns(p)) return z;
  return nullptr;
}

/// Rebinds `opt` to the partitions of the prepared model that owns its
/// parameters; the returned partition gathers updates and zeroes gradients.
inline std::shared_ptr<ZeroReducer> bind_optimizer(const ZeroReducers& sharded,
                                                          torch::optim::Optimizer& opt) {
  std::shared_ptr<ZeroReducer> owner;
  for (auto& g : opt.param_groups())
    for (auto& p : g.params())
      if (!owner) owner = find_zero_reducer(sharded, p);
  ACCEL_CHECK(owner != nullptr, "accel: under a shard policy an optimizer must be prepared after "
              "the model whose parameters it holds (no prepared model owns this optimizer's "
              "parameters). Pass the model before the optimizer to prepare(), or prepare the "
              "model first.");
  owner->adopt(opt);
  return owner;
}

/// What clip_grad_norm_/clip_grad_value_ act on: the given parameters, or,
/// when they are a model under ShardGradients (whose full gradients are
/// released), that rank's partitions, with the norm reduced across ranks.
struct ClipTargets {
  std::vector<torch::Tensor> tensors;
  runtime::Communicator* reduce_over = nullptr;  ///< set: the norm spans every rank's tensors
  int64_t param_count = 0;                       ///< for norm_type 0 (count of gradients)
};

inline ClipTargets clip_targets(const ZeroReducers& sharded, std::vector<torch::Tensor> params) {
  ClipTargets t;
  t.param_count = static_cast<int64_t>(params.size());
  std::shared_ptr<ZeroReducer> owner;
  for (const auto& p : params)
    if (auto z = find_zero_reducer(sharded, p); z && z->shards_gradients()) {
      owner = z;
      break;
    }
  if (!owner) {
    t.tensors = std::move(params);
    return t;
  }
  std::size_t owned = 0;
  for (const auto& p : params) owned += owner->owns(p) ? 1 : 0;
  ACCEL_CHECK(owned == params.size() && owned == owner->num_params(),
              "accel: under shard::ShardGradients clipping needs exactly the trainable parameters "
              "of one prepared model (each rank holds only its partition of their gradients; got ",
              params.size(), " parameters, ", owned, " of a model with ", owner->num_params(),
              "). Pass the prepared model or model->parameters().");
  t.tensors = owner->partitions();
  t.reduce_over = &owner->communicator();
  return t;
}

/// torch::nn::utils::clip_grad_norm_ over every rank's partitions: the norm of
/// the concatenation is the p-th root of the all-reduced sums of p-th powers.
inline double clip_grad_norm(const ClipTargets& t, double max_norm, double norm_type) {
  if (t.reduce_over == nullptr) return torch::nn::utils::clip_grad_norm_(t.tensors, max_norm, norm_type);
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  for (const auto& p : t.tensors)
    if (p.grad().defined()) grads.push_back(p.grad());
  const bool inf = norm_type == std::numeric_limits<double>::infinity();
  double total = 0;
  if (norm_type == 0) {
    total = static_cast<double>(t.param_count);
  } else {
    double sum = 0;  // local max (inf) or sum of p-th powers
    for (const auto& g : grads) {
      if (g.numel() == 0) continue;
      const double v = inf ? g.abs().max().item<double>() : std::pow(g.norm(norm_type).item<double>(), norm_type);
      sum = inf ? std::max(sum, v) : sum + v;
    }
    auto local = torch::full({1}, sum, torch::TensorOptions().dtype(torch::kDouble).device(t.tensors.front().device()));
    if (inf) {
      t.reduce_over->all_reduce(local, runtime::ReduceOp::Max)->wait();
      total = local.item<double>();
    } else {
      t.reduce_over->all_reduce(local, runtime::ReduceOp::Sum)->wait();
      total = std::pow(local.item<double>(), 1.0 / norm_type);
    }
  }
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for (auto& g : grads) g.mul_(coef);
  return total;
}

inline void clip_grad_value(const ClipTargets& t, double clip_value) {
  torch::nn::utils::clip_grad_value_(t.tensors, clip_value);  // element-wise: the partitions suffice
}

}  // namespace accel::shard::detail

#endif  // ACCEL_SHARD_DETAIL_ZERO_BINDING_HPP
// end <accel/shard/detail/zero_binding.hpp>
// begin <accel/tracking/progress.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::ProgressBar: a one-line progress bar (steps,
/// rate, elapsed, ETA) redrawn with '\r' on a terminal, silent otherwise.
#ifndef ACCEL_TRACKING_PROGRESS_HPP
#define ACCEL_TRACKING_PROGRESS_HPP

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accel::tracking {

struct ProgressOptions {
  /// nullopt: on when the stream is a terminal and ACCEL_DISABLE_PROGRESS is
  /// not set; true/false force it (forcing on still needs a main process).
  std::optional<bool> enabled{};
  /// Whether this process draws at all (the Accelerator passes
  /// is_local_main_process()).
  bool main_process = true;
  std::FILE* stream = stdout;
  /// At most one redraw per interval (10/s): drawing is cheap, terminals are not.
  double min_interval_s = 0.1;
  int bar_width = 24;
};

namespace detail {

/// "05:07", or "1:02:03" past an hour; "?" for a negative or non-finite time.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  else
    std::snprintf(buf, sizeof buf, "%02lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  return buf;
}

/// "12.34it/s", or "2.50s/it" below one step per second (as tqdm), "?it/s" unknown.
inline std::string format_rate(double steps_per_second) {
  if (!std::isfinite(steps_per_second) || steps_per_second <= 0) return "?it/s";
  char buf[32];
  if (steps_per_second >= 1.0)
    std::snprintf(buf, sizeof buf, "%.2fit/s", steps_per_second);
  else
    std::snprintf(buf, sizeof buf, "%.2fs/it", 1.0 / steps_per_second);
  return buf;
}

/// "[######----]" with width cells; n clamped to [0, total].
inline std::string format_bar(int64_t n, int64_t total, int width) {
  if (width <= 0) return "";
  int64_t filled = 0;
  if (total > 0) filled = std::min<int64_t>(width, std::max<int64_t>(0, n) * width / total);
  std::string s = "[";
  s.append(static_cast<size_t>(filled), '#');
  s.append(static_cast<size_t>(width - filled), '-');
  s += ']';
  return s;
}

/// Values shown after the counters: "loss=0.1235" (4 significant digits).
inline std::string format_postfix(const std::vector<std::pair<std::string, double>>& values) {
  std::string s;
  for (const auto& [k, v] : values) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.4g", v);
    s += (s.empty() ? "" : ", ") + k + "=" + buf;
  }
  return s;
}

/// The whole line, without '\r': "train  40%[####------] 4/10 [00:02<00:03, 2.00it/s, loss=0.5]".
/// total <= 0 means unknown: no percentage, bar or ETA.
inline std::string format_line(const std::string& desc, int64_t n, int64_t total,
                               double elapsed_s, int bar_width,
                               const std::vector<std::pair<std::string, double>>& postfix = {}) {
  const double rate = elapsed_s > 0 ? static_cast<double>(n) / elapsed_s : 0.0;
  std::string line = desc.empty() ? "" : desc + " ";
  if (total > 0) {
    char pct[16];
    std::snprintf(pct, sizeof pct, "%3d%%",
                  static_cast<int>(100 * std::min<int64_t>(n, total) / total));
    line += pct + format_bar(n, total, bar_width) + " " + std::to_string(n) + "/" +
            std::to_string(total) + " [" + format_duration(elapsed_s) + "<" +
            format_duration(rate > 0 ? static_cast<double>(total - n) / rate : -1.0) + ", ";
  } else {
    line += std::to_string(n) + " [" + format_duration(elapsed_s) + ", ";
  }
  line += format_rate(rate);
  if (!postfix.empty()) line += ", " + format_postfix(postfix);
  return line + "]";
}

inline bool env_disables_progress() {
  const char* v = std::getenv("ACCEL_DISABLE_PROGRESS");
  if (v == nullptr) return false;
  std::string s = v;
  return !(s.empty() || s == "0" || s == "no" || s == "false" || s == "off");
}

}  // namespace detail

/// Whether a bar with these options draws: main process, and either forced on
/// or (default) a terminal without ACCEL_DISABLE_PROGRESS.
inline bool progress_enabled(const ProgressOptions& o) {
  if (!o.main_process || o.stream == nullptr) return false;
  if (o.enabled) return *o.enabled;
  if (detail::env_disables_progress()) return false;
  return ::isatty(::fileno(o.stream)) == 1;
}

/// tqdm's everyday subset. update() advances and redraws at most every
/// min_interval_s; close() (or the destructor) draws the final state and ends
/// the line. Disabled bars only count.
class ProgressBar {
 public:
  using clock = std::chrono::steady_clock;
  using Postfix = std::vector<std::pair<std::string, double>>;

  explicit ProgressBar(int64_t total, std::string desc = {}, ProgressOptions options = {})
      : total_(total), desc_(std::move(desc)), options_(options),
        enabled_(progress_enabled(options_)), start_(clock::now()) {
    if (enabled_) draw();
  }
  ProgressBar(ProgressBar&& o) noexcept
      : total_(o.total_), n_(o.n_), desc_(std::move(o.desc_)), options_(o.options_),
        enabled_(std::exchange(o.enabled_, false)), closed_(std::exchange(o.closed_, true)),
        start_(o.start_), last_draw_(o.last_draw_), postfix_(std::move(o.postfix_)),
        width_(o.width_) {}
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ProgressBar& operator=(ProgressBar&&) = delete;
  ~ProgressBar() { close(); }

  /// Advances by steps; values (e.g. {{"loss", x}}) replace the shown postfix.
  void update(int64_t steps = 1, Postfix values = {}) {
    n_ += steps;
    if (!values.empty()) postfix_ = std::move(values);
    if (!enabled_ || closed_) return;
    auto now = clock::now();
    const bool last = total_ > 0 && n_ >= total_;
    if (last || std::chrono::duration<double>(now - last_draw_).count() >= options_.min_interval_s)
      draw();
  }
  void set_postfix(Postfix values) { postfix_ = std::move(values); }
  void set_description(std::string desc) { desc_ = std::move(desc); }

  /// Final redraw and newline; idempotent.
  void close() {
    if (closed_) return;
    closed_ = true;
    if (!enabled_) return;
    draw();
    std::fputc('\n', options_.stream);
    std::fflush(options_.stream);
  }

  int64_t n() const { return n_; }
  int64_t total() const { return total_; }
  bool enabled() const { return enabled_; }
  double elapsed_seconds() const {
    return std::chrono::duration<double>(clock::now() - start_).count();
  }

 private:
  void draw() {
    last_draw_ = clock::now();
    auto line = detail::format_line(desc_, n_, total_, elapsed_seconds(), options_.bar_width,
                                    postfix_);
    // Pad with spaces so a shorter line fully covers the previous one.
    if (line.size() < width_) line.append(width_ - line.size(), ' ');
    width_ = line.size();
    std::fputc('\r', options_.stream);
    std::fputs(line.c_str(), options_.stream);
    std::fflush(options_.stream);
  }

  int64_t total_;
  int64_t n_ = 0;
  std::string desc_;
  ProgressOptions options_;
  bool enabled_;
  bool closed_ = false;
  clock::time_point start_;
  clock::time_point last_draw_{};
  Postfix postfix_;
  size_t width_ = 0;
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_PROGRESS_HPP
// end <accel/tracking/progress.hpp>
// begin <accel/tracking/tracker_options.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::TrackerOptions, which writers
/// init_trackers() starts (apart from trackers.hpp, which holds the writers:
/// accelerator.hpp declares init_trackers() with this alone).
#ifndef ACCEL_TRACKING_TRACKER_OPTIONS_HPP
#define ACCEL_TRACKING_TRACKER_OPTIONS_HPP

namespace accel::tracking {

/// Which writers init_trackers() starts (Accelerate's log_with); all by default.
struct TrackerOptions {
  bool jsonl = true;        ///< metrics.jsonl: one JSON object per log() call
  bool csv = true;          ///< metrics.csv: one row per log() call
  bool tensorboard = true;  ///< events.out.tfevents.<time>.<host>: numeric values
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_TRACKER_OPTIONS_HPP
// end <accel/tracking/tracker_options.hpp>
// begin <accel/tracking/value.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::tracking::Value, the scalar or string that log() and
/// init_trackers() take, and its JSON and CSV spellings.
#ifndef ACCEL_TRACKING_VALUE_HPP
#define ACCEL_TRACKING_VALUE_HPP

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>

#include <nlohmann/json_fwd.hpp>

namespace accel::tracking {

/// bool, integer, floating-point or string. Any arithmetic type converts
/// (size_t, float, int...), so {{"loss", loss.item<double>()}, {"epoch", e}} works.
class Value {
 public:
  using variant_type = std::variant<bool, int64_t, double, std::string>;

  template <class T>
    requires std::is_arithmetic_v<T>
  Value(T v) {  // NOLINT(google-explicit-constructor): brace lists of values
    if constexpr (std::is_same_v<T, bool>)
      v_ = v;
    else if constexpr (std::is_integral_v<T>)
      v_ = static_cast<int64_t>(v);
    else
      v_ = static_cast<double>(v);
  }
  Value(std::string s) : v_(std::move(s)) {}  // NOLINT(google-explicit-constructor)
  Value(const char* s) : v_(std::string(s)) {}  // NOLINT(google-explicit-constructor)

  const variant_type& get() const { return v_; }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }

  /// The number TensorBoard plots (bool as 0/1); nullopt for strings.
  std::optional<double> as_number() const {
    if (auto* b = std::get_if<bool>(&v_)) return *b ? 1.0 : 0.0;
    if (auto* i = std::get_if<int64_t>(&v_)) return static_cast<double>(*i);
    if (auto* d = std::get_if<double>(&v_)) return *d;
    return std::nullopt;
  }

  /// JSON value; NaN and infinities (not JSON) become the strings "nan", "inf", "-inf".
  /// A template so that only its callers compile nlohmann's json (they include it).
  template <class Json = nlohmann::json>
  Json to_json() const {
    return std::visit(
        [](const auto& x) -> Json {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, double>) {
            if (std::isnan(x)) return "nan";
            if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
          }
          return x;
        },
        v_);
  }

  /// CSV cell: numbers with full precision (%.17g round-trips a double),
  /// strings quoted when they hold a comma, quote or line break.
  std::string to_csv() const {
    return std::visit(
        [](const auto& x) -> std::string {
          using X = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<X, bool>) {
            return x ? "true" : "false";
          } else if constexpr (std::is_same_v<X, int64_t>) {
            return std::to_string(x);
          } else if constexpr (std::is_same_v<X, double>) {
            char buf[40];
            std::snprintf(buf, sizeof buf, "%.17g", x);
            return buf;
          } else {
            if (x.find_first_of(",\"\r\n") == std::string::npos) return x;
            std::string q = "\"";
            for (char c : x) q += c == '"' ? std::string("\"\"") : std::string(1, c);
            return q + "\"";
          }
        },
        v_);
  }

 private:
  variant_type v_;
};

/// What log() takes: name -> value (keys in sorted order in every output).
using Values = std::map<std::string, Value>;
/// What init_trackers() takes: the run's hyper-parameters.
using Config = std::map<std::string, Value>;

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_VALUE_HPP
// end <accel/tracking/value.hpp>

// Declared only: save_state() and its kin, init_trackers() and log(),
// profile(), and gather_object() and broadcast_object() reach these through
// detail::deferred_t, so their headers (the checkpoint writer and reader, the
// trackers, LibTorch's profiler, the object encoding with nlohmann's json)
// are compiled only where they are included (checkpoint.hpp, tracking.hpp,
// profiling.hpp, ops.hpp, accel.hpp) and those members are called.
namespace accel {
namespace ckpt { struct StateIo; }
namespace tracking { class Trackers; }
namespace profiling { class Trace; }
namespace ops { struct ObjectCollectives; }
}  // namespace accel

namespace accel {

namespace detail {

/// Erases from ts the tensors already in seen, keeping the first listing of
/// each (and adding it to seen); returns how many it erased. LibTorch's
/// parameters() lists a tied (shared) parameter under each of its names;
/// Python's lists it once, and reducers, clipping and the optimizer must
/// count it once.
inline std::size_t erase_repeats(std::vector<torch::Tensor>& ts, std::unordered_set<const c10::TensorImpl*>& seen) {
  return std::erase_if(ts, [&](const torch::Tensor& t) { return !seen.insert(t.unsafeGetTensorImpl()).second; });
}

/// Each tensor once, in the order first seen.
inline std::vector<torch::Tensor> unique_tensors(std::vector<torch::Tensor> ts) {
  std::unordered_set<const c10::TensorImpl*> seen;
  erase_repeats(ts, seen);
  return ts;
}

/// The parameters of a prepared model, or of a range of tensors.
template <class T>
std::vector<torch::Tensor> parameters_of(T&& params) {
  if constexpr (requires { params.get()->parameters(); })
    return unique_tensors(params.get()->parameters());
  else
    return unique_tensors(std::vector<torch::Tensor>(std::begin(params), std::end(params)));
}

/// What a model's gradients are synchronised for: its parameters that
/// require a gradient, each once.
inline std::vector<torch::Tensor> trainable_parameters(const torch::nn::Module& model) {
  auto ts = unique_tensors(model.parameters());
  std::erase_if(ts, [](const torch::Tensor& t) { return !t.requires_grad(); });
  return ts;
}

/// Removes the repeats of a parameter from an optimizer's groups (the first
/// listing stays), so that a tied parameter is stepped once per step.
/// Returns how many were removed.
inline std::size_t drop_repeated_parameters(torch::optim::Optimizer& opt) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::size_t removed = 0;
  for (auto& g : opt.param_groups()) removed += erase_repeats(g.params(), seen);
  return removed;
}
}  // namespace detail

template <class Backend = backend::SingleDevice, class Precision = precision::Fp32,
          class Shard = shard::Replicate>
class Accelerator {
  // Instantiates the checks: their own static_asserts carry the messages.
  static_assert(check_accelerator_policies<Backend, Precision, Shard>::checked);
  // Areas whose headers only the members that use them need (see the
  // declarations above the class): checkpoint/state_io.hpp, tracking/trackers.hpp.
  using state_io = detail::deferred_t<ckpt::StateIo, Backend>;
  using trackers_type = detail::deferred_t<tracking::Trackers, Backend>;

 public:
  using backend_type = Backend;
  using precision_type = Precision;
  using shard_type = Shard;

  /// Reads rank and world from the environment (API.md section 5) and joins
  /// the other processes through the backend.
  explicit Accelerator(AcceleratorOptions options = {})
      : options_(std::move(options)), state_(std::make_shared<detail::TrainingState>()) {
    ACCEL_CHECK(options_.gradient_accumulation_steps >= 1,
                "accel: gradient_accumulation_steps must be at least 1 (got ",
                options_.gradient_accumulation_steps, "). Use 1 to step on every batch.");
    if constexpr (Backend::multi_process) env_ = runtime::ProcessEnv::discover();
    state_->device = Backend::device(env_);
    // float16 autocast is what needs CUDA; loss scaling itself is device
    // independent (a policy with loss scaling and no autocast runs on CPU).
    if constexpr (Precision::autocast && Precision::autocast_dtype == at::kHalf) {
      ACCEL_CHECK(state_->device.is_cuda(),
                  "accel: precision::Fp16 needs a CUDA device (float16 autocast and loss scaling "
                  "are CUDA features), and this process runs on ", state_->device,
                  ". Use precision::Bf16 on CPU.");
    }
    if (state_->device.is_cuda()) torch::cuda::synchronize(state_->device.index());
    state_->comm = Backend::make_communicator(env_, options_);
    state_->gradient_accumulation_steps = options_.gradient_accumulation_steps;
    debug_ = runtime::detail::getenv_flag("ACCEL_DEBUG_MODE");
    if constexpr (Precision::loss_scaling) install_loss_scaler();
    // What save_state() covers besides what prepare() and
    // register_for_checkpointing() add: known now, set once.
    registry_.state = state_;
    registry_.scaler = scaler_;
    registry_.shards_optimizer_state = Shard::shards_optimizer_state;
    registry_.optimizer_per_rank = Shard::shards_optimizer_state && state_->comm->size() > 1;
    registry_.partition_bucket_cap_mb = registry_.optimizer_per_rank ? options_.bucket_cap_mb : 0;
  }

  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  torch::Device device() const { return state_->device; }
  int process_index() const { return env_.rank; }
  int local_process_index() const { return env_.local_rank; }
  int num_processes() const { return env_.world_size; }
  bool is_main_process() const { return env_.rank == 0; }
  bool is_local_main_process() const { return env_.local_rank == 0; }
  bool is_last_process() const { return env_.rank == env_.world_size - 1; }
  const AcceleratorOptions& options() const { return options_; }
  int gradient_accumulation_steps() const { return options_.gradient_accumulation_steps; }
  /// The communicator every collective of this Accelerator goes through.
  runtime::Communicator& communicator() const { return *state_->comm; }

  /// Hands back each argument prepared, in the order given (see API.md §3):
  /// models on device() with synchronised gradients, optimizers that step
  /// only when they should, loaders sharded across ranks, schedulers that
  /// advance once per real optimizer step.
  template <class... Ts>
  auto prepare(Ts&&... objects) {
    constexpr bool supported =
        ((detail::prepare_kind<std::remove_cvref_t<Ts>>() != PrepareKind::Unsupported) && ...);
    if constexpr (supported) {
      using result = detail::prepare_result_t<Ts...>;
      static_assert(std::tuple_size_v<result> == sizeof...(Ts));
      // Braced initialisation evaluates left to right: models before the
      // optimizers that refer to their parameters.
      return result{prepare_one(std::forward<Ts>(objects))...};
    } else {
      // Instantiates the diagnostic that names the position and type.
      return detail::prepare_result_t<Ts...>{};
    }
  }

  /// Divides the loss by the accumulation steps, scales it (Fp16), runs backward.
  void backward(const torch::Tensor& loss) {
    auto l = loss;
    if (options_.gradient_accumulation_steps > 1) l = l / options_.gradient_accumulation_steps;
    if constexpr (Precision::loss_scaling) {
      state_->settle_loss_scale();
      l = scaler_->scale(l);
    }
    l.backward();
  }

  /// The precision policy's autocast for user code (prepared models already
  /// run under it).
  [[nodiscard]] precision::AutocastGuard autocast() const {
    return precision::AutocastGuard(state_->device.type(), Precision::autocast_dtype,
                                    Precision::autocast);
  }

  class AccumulateGuard {
   public:
    // The models follow TrainingState::sync_gradients while the guard lives.
    explicit AccumulateGuard(std::vector<shard::detail::GradientSync*> syncs) : syncs_(std::move(syncs)) {
      for (auto* s : syncs_) s->set_accumulating(true);
    }
    ~AccumulateGuard() {
      for (auto* s : syncs_) s->set_accumulating(false);
    }
    AccumulateGuard(AccumulateGuard&& o) noexcept : syncs_(std::exchange(o.syncs_, {})) {}
    AccumulateGuard(const AccumulateGuard&) = delete;
    AccumulateGuard& operator=(const AccumulateGuard&) = delete;
    AccumulateGuard& operator=(AccumulateGuard&&) = delete;

   private:
    std::vector<shard::detail::GradientSync*> syncs_;
  };

  /// Gradient accumulation: inside, gradients are synchronised (and the
  /// optimizer steps) only on every gradient_accumulation_steps-th entry or on
  /// the last batch of the loader; other entries do no communication at all.
  /// Several models trained in one step go in one call (one entry, as
  /// Accelerate's accumulate(*models)); a call per model counts each.
  template <class... M>
  [[nodiscard]] AccumulateGuard accumulate(PreparedModel<M>&... models) {
    static_assert(sizeof...(M) > 0, "accel: accumulate() needs the prepared model(s) trained in this step.");
    const auto* loader = data::active_loader_state();
    bool sync;
    if (loader != nullptr && loader->end_of_dataloader) {
      state_->micro_step = 0;
      sync = true;
    } else {
      ++state_->micro_step;
      sync = state_->micro_step % options_.gradient_accumulation_steps == 0;
    }
    state_->sync_gradients = sync;
    return AccumulateGuard({&models.gradient_sync()...});
  }

  bool sync_gradients() const { return state_->sync_gradients; }
  bool optimizer_step_was_skipped() const { return state_->last_step_skipped; }

  /// Clips the global gradient norm (after the gradients are averaged and,
  /// for Fp16, unscaled once). A no-op returning 0 on the non-sync
  /// micro-steps of accumulate(): clipping belongs to the step that syncs.
  template <class Params>
  double clip_grad_norm_(Params&& params, double max_norm, double norm_type = 2.0) {
    if (!state_->sync_gradients) return 0.0;
    // Under ShardGradients: this rank's partitions, the norm reduced across ranks.
    auto t = shard::detail::clip_targets(state_->sharded,
                                         detail::parameters_of(std::forward<Params>(params)));
    prepare_gradients_for_clipping(t.tensors);
    return shard::detail::clip_grad_norm(t, max_norm, norm_type);
  }

  template <class Params>
  void clip_grad_value_(Params&& params, double clip_value) {
    if (!state_->sync_gradients) return;
    auto t = shard::detail::clip_targets(state_->sharded,
                                         detail::parameters_of(std::forward<Params>(params)));
    prepare_gradients_for_clipping(t.tensors);
    shard::detail::clip_grad_value(t, clip_value);
  }

  torch::Tensor gather(const torch::Tensor& t) { return ops::gather(*state_->comm, t, debug_); }

  /// gather(), minus the samples that even_batches duplicated on the last
  /// batch of the loader being iterated, or the padding of the latest padded
  /// split_between_processes(): exactly one result per item. Dim 0 may differ
  /// across ranks (the other dimensions must agree).
  torch::Tensor gather_for_metrics(const torch::Tensor& t) {
    std::vector<int64_t> rows;
    auto all = ops::gather_ragged(*state_->comm, t, &rows);
    return drop_metric_duplicates(std::move(all), rows);
  }

  torch::Tensor reduce(const torch::Tensor& t, Reduction r = Reduction::Sum) {
    return ops::reduce(*state_->comm, t, r);
  }
  torch::Tensor pad_across_processes(const torch::Tensor& t, int64_t dim = 0,
                                     double pad_index = 0, bool pad_first = false) {
    return ops::pad_across_processes(*state_->comm, t, dim, pad_index, pad_first);
  }
  torch::Tensor broadcast(const torch::Tensor& t, int src = 0) {
    return ops::broadcast(*state_->comm, t, src);
  }
  void wait_for_everyone() { state_->comm->barrier(); }

  // ---- Object collectives, work splitting, triggers, batch-size search:
  // thin forwards to ops/objects.hpp, ops/split.hpp, ops/trigger.hpp and
  // ops/batch_size.hpp (docs/collectives.md).

  /// Every rank's obj, in rank order (one element per rank; nested
  /// containers keep their structure). Tensors come back on device().
  template <class T>
  std::vector<T> gather_object(const T& obj) {
    using objects = detail::deferred_t<ops::ObjectCollectives, T>;
    static_assert(detail::complete_type<objects>, "accel: gather_object(), broadcast_object() and "
                  "gather_for_metrics() of a vector need #include <accel/ops.hpp> (or <accel/accel.hpp>).");
    return objects::gather(*state_->comm, obj, state_->device);
  }
  /// Rank src's obj on every rank.
  template <class T>
  T broadcast_object(T obj, int src = 0) {
    using objects = detail::deferred_t<ops::ObjectCollectives, T>;
    static_assert(detail::complete_type<objects>, "accel: gather_object(), broadcast_object() and "
                  "gather_for_metrics() of a vector need #include <accel/ops.hpp> (or <accel/accel.hpp>).");
    return objects::broadcast(*state_->comm, std::move(obj), src, state_->device);
  }
  /// This process's contiguous share of items (sizes differ by at most one).
  /// With apply_padding every rank gets the same count, its last item
  /// repeated; gather_for_metrics() then drops the padding again (until the
  /// next split).
  template <class T>
  std::vector<T> split_between_processes(const std::vector<T>& items, bool apply_padding = false) {
    remember_split(static_cast<int64_t>(items.size()), apply_padding);
    return ops::split_between_processes(items, env_.rank, num_processes(), apply_padding);
  }
  /// The same along dim 0 (a view of the rows without padding).
  torch::Tensor split_between_processes(const torch::Tensor& items, bool apply_padding = false) {
    auto out = ops::split_between_processes(items, env_.rank, num_processes(), apply_padding);
    remember_split(items.size(0), apply_padding);
    return out;
  }
  /// Every rank's items concatenated in rank order, minus what the tensor
  /// version drops (loader duplicates on the last batch, split padding).
  template <class T>
  std::vector<T> gather_for_metrics(const std::vector<T>& items) {
    auto parts = gather_object(items);
    std::vector<int64_t> rows;
    std::vector<T> all;
    for (auto& p : parts) {
      rows.push_back(static_cast<int64_t>(p.size()));
      all.insert(all.end(), std::make_move_iterator(p.begin()), std::make_move_iterator(p.end()));
    }
    return drop_metric_duplicates(std::move(all), rows);
  }
  /// Any rank sets the trigger; the next check_trigger() (one all-reduce,
  /// every rank must call it) is true on every rank, and clears it.
  void set_trigger() { trigger_.set(); }
  bool check_trigger() { return trigger_.check(*state_->comm); }

  /// RAII, as torch's Join: ranks whose data ends before the others' (a
  /// loader with even_batches = false, or your own) leave the loop and the
  /// guard's end repeats the others' collectives until every rank is done;
  /// replicas and optimizer states stay equal. Inside it, every rank with
  /// data must run the same forward (of a model listed here) / backward /
  /// optimizer.step() sequence; ranks that do not are an accel::Error naming
  /// them. docs/collectives.md "Uneven inputs".
  template <class... M>
  [[nodiscard]] ops::Join join_uneven_inputs(PreparedModel<M>&... models) {
    static_assert(sizeof...(M) > 0, "accel: join_uneven_inputs() needs the prepared models whose "
                                    "gradients are synchronised in the loop it guards.");
    static_assert(!shards_parameters_v<Shard>, "accel: join_uneven_inputs() does not support "
                  "shard::ShardParameters (a rank out of data cannot repeat the parameter all-gathers "
                  "of the others' forward). Use shard::ShardGradients, or even_batches.");
    return ops::Join(state_, {detail::JoinState::Model{&models.gradient_sync(), [&models](bool buffers, bool reduce) { models.join_shadow(buffers, reduce); }}...});
  }
  /// Calls fn(batch_size) from starting_batch_size down (x0.9 after an
  /// out-of-memory error on any rank), every rank at the same size.
  template <class F>
  auto find_executable_batch_size(F&& fn, int64_t starting_batch_size) {
    return ops::find_executable_batch_size(*state_->comm, std::forward<F>(fn), starting_batch_size);
  }
  /// Runs fn only on the main process (rank 0) / the local main process / the
  /// last process / process `index`, as Accelerate's decorators of these
  /// names; fn's result comes back as an optional (empty elsewhere). Not
  /// collective: no process waits for another.
  template <class F>
  auto on_main_process(F&& fn) { return run_if(is_main_process(), std::forward<F>(fn)); }
  template <class F>
  auto on_local_main_process(F&& fn) { return run_if(is_local_main_process(), std::forward<F>(fn)); }
  template <class F>
  auto on_last_process(F&& fn) { return run_if(is_last_process(), std::forward<F>(fn)); }
  template <class F>
  auto on_process(int index, F&& fn) {
    ACCEL_CHECK(index >= 0 && index < num_processes(), "accel: on_process() got process ", index,
                " of ", num_processes(), ". Use an index in [0, num_processes()).");
    return run_if(process_index() == index, std::forward<F>(fn));
  }
  // ---- end of object collectives

  /// Records LibTorch's operators on this process while the returned object
  /// lives and writes trace_dir/trace_rank<r>.json (Chrome trace) when it
  /// goes; profiling::merge_traces makes one trace of all ranks.
  [[nodiscard]] auto profile(std::filesystem::path trace_dir) {
    using trace = detail::deferred_t<profiling::Trace, Backend>;
    static_assert(detail::complete_type<trace>,
                  "accel: profile() needs #include <accel/profiling.hpp> (or <accel/accel.hpp>).");
    return trace(std::move(trace_dir), process_index());
  }

  class MainProcessFirst {
   public:
    MainProcessFirst(runtime::Communicator& comm, bool main)
        : comm_(&comm), main_(main), unwinding_(std::uncaught_exceptions()) {
      if (!main_) comm_->barrier();
    }
    /// A block that throws on the main process skips the barrier: a barrier
    /// failing during unwinding would be std::terminate; the others then fail
    /// in theirs, as their peer is gone.
    ~MainProcessFirst() noexcept(false) {
      if (comm_ && main_ && std::uncaught_exceptions() == unwinding_) comm_->barrier();
    }
    MainProcessFirst(MainProcessFirst&& o) noexcept
        : comm_(std::exchange(o.comm_, nullptr)), main_(o.main_), unwinding_(o.unwinding_) {}
    MainProcessFirst(const MainProcessFirst&) = delete;
    MainProcessFirst& operator=(const MainProcessFirst&) = delete;
    MainProcessFirst& operator=(MainProcessFirst&&) = delete;

   private:
    runtime::Communicator* comm_;
    bool main_;
    int unwinding_;  ///< exceptions in flight at construction
  };
  /// The main process runs the block first (downloads, preprocessing), the
  /// others after it finished.
  [[nodiscard]] MainProcessFirst main_process_first() {
    return MainProcessFirst(*state_->comm, is_main_process());
  }

  /// Prints (to std::cout, one line) on the main process only.
  template <class... A>
  void print(A&&... args) {
    if (!is_main_process()) return;
    ((std::cout << std::forward<A>(args)), ...);
    std::cout << std::endl;
  }

  /// The user's module. Under shard::ShardParameters its trainable
  /// parameters have no values outside the prepared model's forward and
  /// backward (each rank holds only its partition): read them through
  /// save_model() or save_state().
  template <class M>
  M& unwrap_model(PreparedModel<M>& model) {
    return model.module();
  }

  /// Writes the model's weights as safetensors (model.safetensors, or shards
  /// plus model.safetensors.index.json), keys as the user's module names
  /// them. The main process writes; everyone returns when the files exist,
  /// and every process throws the same error when the writing fails. Under
  /// shard::ShardParameters it is streamed: each bucket is gathered only
  /// while its tensors are written, so no rank holds the whole model.
  template <class M>
  void save_model(PreparedModel<M>& model, const std::filesystem::path& dir,
                  SaveModelOptions opts = {}) {
    static_assert(detail::complete_type<state_io>, "accel: save_state(), load_state(), "
                  "load_latest_state() and save_model() need #include <accel/checkpoint.hpp> (or <accel/accel.hpp>).");
    state_->finalize_gradients();
    // Without ShardParameters there is nothing to gather: every rank holds its parameters.
    const auto gathers = parameter_gathers();
    const ReleaseParameters release{gathers};
    state_io::save_model(*state_->comm, *model.get(), dir, opts, is_main_process(),
                         [&](const torch::Tensor& t) {
                           for (auto* g : gathers) g->gather_holding(t);
                         });
  }

  /// A loader sharing `loader`'s position whose next loop leaves out the first
  /// num_batches (per process) of the current epoch; loops after it, of either
  /// loader, are whole epochs. (load_state() already positions prepared
  /// loaders; calling this afterwards with the same count changes nothing.)
  template <class L>
    requires data::is_data_loader_v<std::remove_cvref_t<L>>
  auto skip_first_batches(L& loader, int64_t num_batches) {
    ACCEL_CHECK(num_batches >= 0, "accel: skip_first_batches needs a non-negative count (got ",
                num_batches, "). Pass the number of batches already processed in this epoch.");
    std::remove_cvref_t<L> copy = loader;  // plain copies share the position
    copy.restore(data::LoaderCheckpoint{loader.epoch(), num_batches});
    return copy;
  }

  /// Writes models, optimizers, schedulers, loader positions, the loss scaler,
  /// every process's generator states, the step counters and the registered
  /// objects to dir, atomically; without dir, to
  /// project_dir/checkpoints/checkpoint_<N> (at most total_limit kept). Every
  /// process must call it. Layout: include/accel/checkpoint/save_state.hpp.
  void save_state(std::optional<std::filesystem::path> dir = {}) {
    static_assert(detail::complete_type<state_io>, "accel: save_state(), load_state(), "
                  "load_latest_state() and save_model() need #include <accel/checkpoint.hpp> (or <accel/accel.hpp>).");
    profiling::Span span("accel: save_state", "accel.checkpoint");
    with_whole_parameters(false, [&] { state_io::save_state(registry_, options_, std::move(dir)); });
  }
  /// Restores what save_state() wrote (without dir: the newest automatic
  /// checkpoint, and the numbering continues after it). A bad checkpoint is
  /// an accel::Error on every process, with nothing changed.
  void load_state(std::optional<std::filesystem::path> dir = {}) {
    static_assert(detail::complete_type<state_io>, "accel: save_state(), load_state(), "
                  "load_latest_state() and save_model() need #include <accel/checkpoint.hpp> (or <accel/accel.hpp>).");
    profiling::Span span("accel: load_state", "accel.checkpoint");
    with_whole_parameters(true, [&] { state_io::load_state(registry_, options_, std::move(dir)); });
  }
  // --- elastic restarts (docs/launching.md "Fault tolerance") ---
  /// Resumes from the newest complete checkpoint under project_dir/checkpoints
  /// (automatic naming) and returns its directory, or returns std::nullopt
  /// and changes nothing when there is none (a first attempt). A checkpoint a
  /// killed save left incomplete is never chosen; one that cannot be read is
  /// skipped with a warning. save_state() then numbers on past every
  /// checkpoint there. Every process must call it, after prepare() and
  /// register_for_checkpointing(). Layout: include/accel/checkpoint/latest_state.hpp.
  std::optional<std::filesystem::path> load_latest_state() {
    static_assert(detail::complete_type<state_io>, "accel: save_state(), load_state(), "
                  "load_latest_state() and save_model() need #include <accel/checkpoint.hpp> (or <accel/accel.hpp>).");
    return with_whole_parameters(true, [&] { return state_io::load_latest_state(registry_, options_); });
  }
  // --- end of elastic restarts ---
  /// Adds obj to what save_state()/load_state() cover (see
  /// ckpt::Checkpointable); obj must outlive those calls.
  template <ckpt::Checkpointable T>
  void register_for_checkpointing(T& obj) {
    registry_.add_custom(obj);
  }
  /// Runs hook(models, dir) on every process in save_state(), after the
  /// checkpoint directory is created and before accel writes its files; dir
  /// is where the checkpoint is assembled (files the hook writes there are
  /// committed with it, atomically). Models the hook erases from the list are
  /// not written by accel: the hook saves them its own way. As Accelerate's.
  ckpt::RemovableHandle register_save_state_pre_hook(ckpt::StatePreHook hook) {
    return registry_.save_pre_hooks.add(std::move(hook));
  }
  /// Runs hook(models, dir) on every process in load_state() and
  /// load_latest_state(), before accel reads dir; models the hook erases are
  /// not read by accel (the hook loads them). Hooks run in registration order.
  ckpt::RemovableHandle register_load_state_pre_hook(ckpt::StatePreHook hook) {
    return registry_.load_pre_hooks.add(std::move(hook));
  }

  /// Starts the trackers (JSONL, CSV, TensorBoard; see tracking/trackers.hpp)
  /// in project_dir/project_name and writes config there as config.json. Every
  /// process calls it; only the main process writes.
  void init_trackers(const std::string& project_name, const tracking::Config& config = {},
                     tracking::TrackerOptions which = {}) {
    trackers().init(options_.project_dir, project_name, config, which, is_main_process());
  }
  /// Logs values at step (default: the count of earlier log() calls) from the
  /// main process; the others return at once.
  void log(const tracking::Values& values, std::optional<int64_t> step = {}) {
    trackers().log(values, step);
  }
  trackers_type& trackers() {
    static_assert(detail::complete_type<trackers_type>,
                  "accel: init_trackers(), log() and trackers() need #include <accel/tracking.hpp> "
                  "(or <accel/accel.hpp>).");
    if (!trackers_) {
      trackers_ = std::make_shared<trackers_type>();
      finish_trackers_ = [t = trackers_.get()] { t->finish(); };
    }
    return *trackers_;
  }
  /// A progress bar drawn by the local main process only, and only on a
  /// terminal (ACCEL_DISABLE_PROGRESS=1 or options.enabled = false turn it off).
  [[nodiscard]] tracking::ProgressBar progress(int64_t total, std::string description = {},
                                               tracking::ProgressOptions options = {}) {
    options.main_process = options.main_process && is_local_main_process();
    return tracking::ProgressBar(total, std::move(description), options);
  }

  /// Closes the trackers' files, then waits for every process.
  void end_training() {
    if (finish_trackers_) finish_trackers_();
    wait_for_everyone();
  }

  /// The loss scaler of precision::Fp16 (nullptr otherwise).
  precision::LossScaler* loss_scaler() const { return scaler_.get(); }

  /// Averages every gradient bucket of the models prepared so far, and of
  /// those prepared later, with `hook` instead of AcceleratorOptions::comm_hook
  /// (as DDP's register_comm_hook). Call it before training: after a backward
  /// of a prepared model it is an error. With one process nothing is
  /// communicated and the hook is never called. docs/comm_hooks.md.
  void register_comm_hook(comm::HookFunction hook) {
    [[maybe_unused]] comm::FunctionHook checked(hook);  // an empty function fails here
    for (auto& sync : state_->syncs) sync->set_comm_hook(std::make_shared<comm::FunctionHook>(hook));
    user_hook_ = std::move(hook);
  }

 private:
  // A new hook per prepared model: PowerSGD keeps state per bucket.
  std::shared_ptr<comm::Hook> make_comm_hook() const {
    if (user_hook_) return std::make_shared<comm::FunctionHook>(user_hook_);
    return comm::make_hook(options_.comm_hook, options_.powersgd);
  }

  template <class A>
  auto prepare_one(A&& a) {
    using T = std::remove_cvref_t<A>;
    constexpr PrepareKind kind = detail::prepare_kind<T>();
    if constexpr (kind == PrepareKind::Model) {
      return prepare_model(T(std::forward<A>(a)));
    } else if constexpr (kind == PrepareKind::Optimizer) {
      auto opt = detail::share(std::forward<A>(a));
      if (const auto repeats = detail::drop_repeated_parameters(*opt); repeats > 0 && is_main_process())
        std::cerr << "accel: the optimizer listed " << repeats
                  << " parameter(s) more than once (a tied parameter is in model->parameters() under each of"
                     " its names); prepare() keeps the first listing, so each is stepped once per step, as in"
                     " PyTorch.\n";
      registry_.add_optimizer(opt);
      typename detail::prepared_type<0, T>::type prepared(opt, state_);
      if constexpr (Shard::shards_optimizer_state) {  // steps this rank's partition only
        if (state_->comm->size() > 1) {
          auto zero = shard::detail::bind_optimizer(state_->sharded, *opt);
          registry_.partitions.push_back({zero->held_layout(), zero->whole_layout()});
          prepared.set_partition(std::move(zero));
        } else {
          auto whole = unpartitioned_layout(*opt);
          registry_.partitions.push_back({whole, whole});
        }
      }
      return prepared;
    } else if constexpr (kind == PrepareKind::DataLoader) {
      return prepare_loader(T(std::forward<A>(a)));
    } else if constexpr (kind == PrepareKind::Scheduler) {
      auto sched = detail::share(std::forward<A>(a));
      typename detail::prepared_type<0, T>::type prepared(sched, state_,
                                                          options_.step_scheduler_with_optimizer);
      registry_.add_scheduler(std::move(sched), prepared.seen_steps());
      return prepared;
    }
  }

  // On one process a shard policy partitions nothing; load_state still needs
  // the buckets the optimizer's parameters would have on several (none when
  // its parameters are not exactly one prepared model's trainable ones).
  shard::detail::PartitionLayout unpartitioned_layout(torch::optim::Optimizer& opt) const {
    std::vector<std::vector<torch::Tensor>> listed;
    for (auto& g : opt.param_groups()) listed.push_back(g.params());
    const auto bucket_bytes = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
    for (const auto& model : registry_.models) {
      const auto trainable = detail::trainable_parameters(*model);
      const auto group_of = shard::detail::groups_of(trainable, listed);
      if (std::find(group_of.begin(), group_of.end(), -1) != group_of.end() || trainable.empty()) continue;
      std::optional<shard::detail::ParameterUnits> units;
      if constexpr (shards_parameters_v<Shard>) units = shard::detail::units_of(*model, trainable);
      const auto plan = shard::detail::zero_plan(trainable, bucket_bytes, group_of, units);
      return shard::detail::parameter_layout(trainable, plan, group_of, listed);
    }
    return {};  // not one model's trainable parameters: load_state cannot re-partition it
  }

  template <class M>
  PreparedModel<M> prepare_model(M model) {
    auto* module = detail::module_ptr(model);
    module->to(state_->device);
    std::shared_ptr<shard::detail::GradientSync> sync;
    // A single-process backend never instantiates the reducers, the hooks or
    // the broadcast: code it cannot run is not compiled into its users.
    if constexpr (Backend::multi_process) {
      if (state_->comm->size() > 1) sync = synchronise_replicas(*module);
    }
    if (!sync) sync = std::make_shared<shard::detail::NoSync>();
    state_->syncs.push_back(sync);
    registry_.add_model(model);
    return PreparedModel<M>(std::move(model), state_, std::move(sync), Precision::autocast,
                            Precision::autocast_dtype);
  }

  // Several processes: replicas start equal (rank 0's values), and the
  // shard policy's reducer synchronises their gradients from then on.
  std::shared_ptr<shard::detail::GradientSync> synchronise_replicas(torch::nn::Module& module) {
    broadcast_from_main(detail::unique_tensors(module.parameters()));
    broadcast_from_main(module.buffers());
    auto trainable = detail::trainable_parameters(module);
    const auto bucket_bytes = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
    auto sync_now = detail::TrainingState::sync_flag(state_);
    if constexpr (Shard::shards_optimizer_state) {
      std::optional<shard::detail::ParameterUnits> units;
      if constexpr (shards_parameters_v<Shard>) units = shard::detail::units_of(module, trainable);
      auto zero = std::make_shared<shard::detail::ZeroReducer>(
          std::move(trainable), state_->comm, bucket_bytes, Shard::shards_gradients, sync_now,
          make_comm_hook(), std::move(units), prefetch_parameters());
      if constexpr (shards_parameters_v<Shard>) shard::detail::bind_named_units(module, zero);
      state_->sharded.push_back(zero);
      return zero;
    } else {
      return std::make_shared<shard::detail::BucketReducer>(std::move(trainable), state_->comm,
                                                            bucket_bytes, overlap_gradient_sync(),
                                                            sync_now, make_comm_hook());
    }
  }

  template <class L>
  L prepare_loader(L loader) {
    // Its own position, shared with the copies the user iterates (save_state).
    bool sharded = false;
    if constexpr (Backend::multi_process) {
      if (state_->comm->size() > 1) {
        loader = loader.sharded(data::ShardSpec{env_.rank, env_.world_size, options_.split_batches,
                                                options_.even_batches});
        sharded = true;
      }
    }
    if (!sharded) loader = loader.detached();
    loader.set_device(state_->device);
    registry_.add_loader(loader);
    return loader;
  }

  // Replicas start equal: rank 0's values, one flat broadcast per dtype.
  void broadcast_from_main(std::vector<torch::Tensor> tensors) {
    torch::NoGradGuard no_grad;
    std::map<at::ScalarType, std::vector<torch::Tensor>> by_dtype;
    for (auto& t : tensors)
      if (t.defined() && t.numel() > 0) by_dtype[t.scalar_type()].push_back(t);
    for (auto& [dtype, ts] : by_dtype) {
      std::vector<torch::Tensor> flat_parts;
      for (auto& t : ts) flat_parts.push_back(t.reshape(-1));
      auto flat = torch::cat(flat_parts);
      state_->comm->broadcast(flat, 0)->wait();
      int64_t off = 0;
      for (auto& t : ts) {
        t.copy_(flat.narrow(0, off, t.numel()).view_as(t));
        off += t.numel();
      }
    }
  }

  // Communication overlaps computation where it does not take the CPU from
  // it: on CUDA, and on CPU when each local process has a core to spare.
  bool communication_can_overlap() const {
    return state_->device.is_cuda() || detail::available_cores() > std::max(1, env_.local_world_size);
  }
  bool overlap_gradient_sync() const {
    return options_.overlap_gradient_sync.value_or(communication_can_overlap());
  }
  bool prefetch_parameters() const {
    return options_.prefetch_parameters.value_or(communication_can_overlap());
  }

  void prepare_gradients_for_clipping(const std::vector<torch::Tensor>& params) {
    state_->finalize_gradients();
    if constexpr (Precision::loss_scaling) scaler_->unscale(params, *state_->comm);
  }

  void install_loss_scaler() {
    scaler_ = std::make_shared<precision::LossScaler>(options_.grad_scaler);
    scaler_->set_comm_device(state_->comm->device());
    // The prepared optimizer shares the training state, not the Accelerator:
    // it may outlive the loss scaler (TrainingState::before_step says so).
    state_->scaler = scaler_;
    state_->loss_scaling = true;
  }

  // Object collectives (see the block above): the trigger flag and the
  // latest padded split, which gather_for_metrics() undoes.
  ops::Trigger trigger_;
  std::optional<ops::SplitPadding> split_padding_;
  template <class F>
  static auto run_if(bool here, F&& fn) {
    using R = std::remove_cvref_t<std::invoke_result_t<F&>>;
    if constexpr (std::is_void_v<R>) {
      if (here) fn();
    } else {
      return here ? std::optional<R>(fn()) : std::nullopt;
    }
  }
  // gather_for_metrics' one rule, for tensors (dim 0) and vectors: drop what
  // even_batches repeated on the loader's last batch, or the padding of the
  // latest padded split; rows: the count each rank contributed.
  template <class Items>
  Items drop_metric_duplicates(Items all, const std::vector<int64_t>& rows) const {
    int64_t count = 0;
    for (auto r : rows) count += r;
    const auto* loader = data::active_loader_state();
    if (loader != nullptr && loader->end_of_dataloader && loader->remainder > 0 && loader->remainder < count) {
      if constexpr (std::is_same_v<Items, torch::Tensor>) {
        return all.narrow(0, 0, loader->remainder);
      } else {
        all.resize(static_cast<std::size_t>(loader->remainder));
        return all;
      }
    }
    if (split_padding_ && split_padding_->matches(rows))
      return ops::drop_split_padding(all, split_padding_->total, split_padding_->world);
    return all;
  }
  void remember_split(int64_t total, bool padded) {
    split_padding_.reset();
    if (padded) split_padding_ = ops::SplitPadding{total, num_processes()};
  }

  AcceleratorOptions options_;
  runtime::ProcessEnv env_;
  std::shared_ptr<detail::TrainingState> state_;
  std::shared_ptr<precision::LossScaler> scaler_;
  bool debug_ = false;
  ckpt::StateRegistry registry_;  ///< what save_state() covers
  comm::HookFunction user_hook_;  ///< register_comm_hook()
  // init_trackers()/log(): made by the first call, so that an Accelerator
  // that never tracks needs no trackers.hpp.
  std::shared_ptr<trackers_type> trackers_;
  std::function<void()> finish_trackers_;

  std::vector<shard::detail::ParameterGather*> parameter_gathers() const {
    std::vector<shard::detail::ParameterGather*> out;
    for (const auto& z : state_->sharded)
      if (auto* g = z->parameter_gather()) out.push_back(g);
    return out;
  }
  /// ShardParameters: frees what a checkpoint gathered, however it ends.
  struct ReleaseParameters {
    const std::vector<shard::detail::ParameterGather*>& gathers;
    ~ReleaseParameters() {
      for (auto* g : gathers) g->release_all();
    }
  };

  // ShardParameters: every rank makes its models' parameters whole while a
  // checkpoint is written or read (a collective), and frees them afterwards;
  // what a load wrote into them becomes each rank's partition.
  template <class F>
  decltype(auto) with_whole_parameters(bool loads, F&& fn) {
    if constexpr (!shards_parameters_v<Shard>) {
      return fn();
    } else {
      const auto gathers = parameter_gathers();
      const ReleaseParameters release{gathers};
      const auto keep_loaded = [&] {
        if (loads)
          for (auto* g : gathers) g->keep_written_values();
      };
      for (auto* g : gathers) g->gather_all();
      if constexpr (std::is_void_v<decltype(fn())>) {
        fn();
        keep_loaded();
      } else {
        auto result = fn();
        keep_loaded();
        return result;
      }
    }
  }
};

}  // namespace accel

#endif  // ACCEL_ACCELERATOR_HPP
// end <accel/accelerator.hpp>
// begin <accel/ops.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the ops area: the collectives behind the Accelerator's
/// gather/reduce/broadcast, object collectives, work splitting, triggers,
/// uneven inputs and the batch-size search (docs/collectives.md).
#ifndef ACCEL_OPS_HPP
#define ACCEL_OPS_HPP

// begin <accel/ops/objects.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the object collectives gather_object / broadcast_object over
/// any runtime::Communicator: a value of a supported type is encoded once
/// (ops::encode_object: type-directed, to nlohmann::json and then CBOR bytes),
/// the bytes travel as a uint8 tensor of the largest length across ranks, and
/// each receiver decodes them back into the same type.
#ifndef ACCEL_OPS_OBJECTS_HPP
#define ACCEL_OPS_OBJECTS_HPP

#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>


namespace accel::ops {

namespace detail {
template <class T> struct is_vector : std::false_type {};
template <class T, class A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T> struct is_map : std::false_type {};
template <class K, class V, class C, class A> struct is_map<std::map<K, V, C, A>> : std::true_type {};
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};
template <class T> struct is_pair : std::false_type {};
template <class A, class B> struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T> struct is_tuple : std::false_type {};
template <class... T> struct is_tuple<std::tuple<T...>> : std::true_type {};

/// A type nlohmann converts both ways: its own conversions, or the user's
/// to_json/from_json found by ADL (or an adl_serializer specialisation).
template <class T>
concept JsonConvertible = requires(nlohmann::json& j, const T& t) {
  nlohmann::json(t);
  std::as_const(j).template get<T>();
};

template <class T> struct always_false : std::false_type {};
}  // namespace detail

/// Whether gather_object / broadcast_object can send a T (checked recursively
/// into the containers below).
template <class T>
constexpr bool is_object_transferable() {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor> || std::is_same_v<U, nlohmann::json> ||
                std::is_arithmetic_v<U> || std::is_same_v<U, std::string>)
    return true;
  else if constexpr (detail::is_optional<U>::value || detail::is_vector<U>::value)
    return is_object_transferable<typename U::value_type>();
  else if constexpr (detail::is_map<U>::value)
    return is_object_transferable<typename U::key_type>() &&
           is_object_transferable<typename U::mapped_type>();
  else if constexpr (detail::is_pair<U>::value)
    return is_object_transferable<typename U::first_type>() &&
           is_object_transferable<typename U::second_type>();
  else if constexpr (detail::is_tuple<U>::value)
    return []<class... E>(std::type_identity<std::tuple<E...>>) {
      return (is_object_transferable<E>() && ...);
    }(std::type_identity<U>{});
  else
    return detail::JsonConvertible<U>;
}

/// Encodes a value as JSON, keeping its structure: containers become arrays
/// (maps: arrays of [key, value], so any key type works), std::nullopt is
/// null, a tensor is {dtype, shape, data (the raw bytes, a binary value)}.
template <class T>
nlohmann::json encode_object(const T& value) {
  static_assert(is_object_transferable<T>(),
                "accel: gather_object/broadcast_object cannot send this type. Use arithmetic "
                "types, std::string, torch::Tensor, nlohmann::json, std::vector/map/optional/"
                "pair/tuple of those, or give the type to_json/from_json (nlohmann, found by ADL).");
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    if (!value.defined()) return nullptr;
    ACCEL_CHECK(value.layout() == torch::kStrided && !value.is_quantized(),
                "accel: gather_object/broadcast_object sends dense tensors only; got layout ",
                value.layout(), ". Call .to_dense() (or dequantize()) first.");
    auto t = value.detach().to(torch::kCPU).contiguous();
    const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
    const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    return {{"dtype", static_cast<int>(t.scalar_type())},
            {"shape", t.sizes().vec()},
            {"data", nlohmann::json::binary(std::vector<std::uint8_t>(p, p + bytes))}};
  } else if constexpr (std::is_same_v<U, nlohmann::json>) {
    return value;
  } else if constexpr (std::is_arithmetic_v<U> || std::is_same_v<U, std::string>) {
    return value;
  } else if constexpr (detail::is_optional<U>::value) {
    return value ? encode_object(*value) : nlohmann::json(nullptr);
  } else if constexpr (detail::is_vector<U>::value) {
    auto out = nlohmann::json::array();
    for (const auto& e : value) {
      if constexpr (std::is_same_v<typename U::value_type, bool>)  // vector<bool>'s proxies
        out.push_back(static_cast<bool>(e));
      else
        out.push_back(encode_object(e));
    }
    return out;
  } else if constexpr (detail::is_map<U>::value) {
    auto out = nlohmann::json::array();
    for (const auto& [k, v] : value) out.push_back({encode_object(k), encode_object(v)});
    return out;
  } else if constexpr (detail::is_pair<U>::value) {
    return {encode_object(value.first), encode_object(value.second)};
  } else if constexpr (detail::is_tuple<U>::value) {
    auto out = nlohmann::json::array();
    std::apply([&](const auto&... e) { (out.push_back(encode_object(e)), ...); }, value);
    return out;
  } else {
    return nlohmann::json(value);
  }
}

/// The inverse of encode_object<T>; tensors are made on `device`.
template <class T>
T decode_object(const nlohmann::json& j, const torch::Device& device = torch::kCPU) {
  using U = std::remove_cvref_t<T>;
  if constexpr (std::is_same_v<U, torch::Tensor>) {
    if (j.is_null()) return {};
    const auto& data = j.at("data").get_binary();
    auto t = torch::empty(j.at("shape").get<std::vector<int64_t>>(),
                          torch::TensorOptions().dtype(static_cast<at::ScalarType>(j.at("dtype").get<int>())));
    ACCEL_CHECK(data.size() == static_cast<std::size_t>(t.numel()) * t.element_size(),
                "accel: a received tensor has ", data.size(), " bytes for shape ", t.sizes(),
                ". Call the object collective with the same type on every rank.");
    if (!data.empty()) std::memcpy(t.data_ptr(), data.data(), data.size());
    return device.is_cpu() ? t : t.to(device);
  } else if constexpr (std::is_same_v<U, nlohmann::json>) {
    return j;
  } else if constexpr (std::is_arithmetic_v<U> || std::is_same_v<U, std::string>) {
    return j.get<U>();
  } else if constexpr (detail::is_optional<U>::value) {
    if (j.is_null()) return std::nullopt;
    return decode_object<typename U::value_type>(j, device);
  } else if constexpr (detail::is_vector<U>::value) {
    U out;
    out.reserve(j.size());
    for (const auto& e : j) out.push_back(decode_object<typename U::value_type>(e, device));
    return out;
  } else if constexpr (detail::is_map<U>::value) {
    U out;
    for (const auto& kv : j)
      out.emplace(decode_object<typename U::key_type>(kv.at(0), device),
                  decode_object<typename U::mapped_type>(kv.at(1), device));
    return out;
  } else if constexpr (detail::is_pair<U>::value) {
    return U(decode_object<typename U::first_type>(j.at(0), device),
             decode_object<typename U::second_type>(j.at(1), device));
  } else if constexpr (detail::is_tuple<U>::value) {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return U(decode_object<std::tuple_element_t<I, U>>(j.at(I), device)...);
    }(std::make_index_sequence<std::tuple_size_v<U>>{});
  } else {
    return j.get<U>();
  }
}

/// A value as bytes (CBOR of encode_object), and back.
template <class T>
std::vector<std::uint8_t> to_bytes(const T& value) {
  return nlohmann::json::to_cbor(encode_object(value));
}
template <class T>
T from_bytes(const std::uint8_t* data, std::size_t size, const torch::Device& device = torch::kCPU) {
  nlohmann::json j;
  try {
    j = nlohmann::json::from_cbor(data, data + size);
    return decode_object<T>(j, device);
  } catch (const nlohmann::json::exception& e) {
    throw Error(accel::detail::concat("accel: an object collective received data that does not "
                                      "decode as the requested type (", e.what(),
                                      "). Call it with the same type on every rank."));
  }
}

namespace detail {
inline torch::Tensor bytes_tensor(const std::vector<std::uint8_t>& bytes, int64_t size,
                                  const torch::Device& device) {
  auto t = torch::zeros({size}, torch::kByte);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return device.is_cpu() ? t : t.to(device);
}
}  // namespace detail

/// Every rank's `obj`, in rank order (two all-gathers: the lengths, then the
/// bytes padded to the longest). Tensors come back on `device`, detached.
template <class T>
std::vector<T> gather_object(runtime::Communicator& comm, const T& obj,
                             const torch::Device& device = torch::kCPU) {
  const auto mine = to_bytes(obj);
  const int world = comm.size();
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto len = torch::tensor({static_cast<int64_t>(mine.size())}, on);
  auto lens = torch::empty({world}, on);
  comm.all_gather(lens, len)->wait();
  lens = lens.cpu();
  const int64_t longest = lens.max().item<int64_t>();
  auto all = torch::empty({world * longest}, torch::TensorOptions().dtype(torch::kByte).device(comm.device()));
  comm.all_gather(all, detail::bytes_tensor(mine, longest, comm.device()))->wait();
  all = all.cpu();
  std::vector<T> out;
  out.reserve(static_cast<std::size_t>(world));
  const auto* base = static_cast<const std::uint8_t*>(all.data_ptr());
  for (int r = 0; r < world; ++r)
    out.push_back(from_bytes<T>(base + r * longest, static_cast<std::size_t>(lens[r].item<int64_t>()), device));
  return out;
}

/// Rank src's `obj` on every rank (two broadcasts: the length, then the
/// bytes). src gets its own obj back unchanged; the others decode theirs,
/// tensors on `device`.
template <class T>
T broadcast_object(runtime::Communicator& comm, T obj, int src = 0,
                   const torch::Device& device = torch::kCPU) {
  ACCEL_CHECK(src >= 0 && src < comm.size(), "accel: broadcast_object() source rank ", src,
              " is outside world size ", comm.size(), ". Use a rank in [0, ", comm.size(), ").");
  if (comm.size() == 1) return obj;
  std::vector<std::uint8_t> bytes;
  if (comm.rank() == src) bytes = to_bytes(obj);
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto len = torch::tensor({static_cast<int64_t>(bytes.size())}, on);
  comm.broadcast(len, src)->wait();
  const int64_t n = len.cpu().item<int64_t>();
  auto data = detail::bytes_tensor(bytes, n, comm.device());
  comm.broadcast(data, src)->wait();
  if (comm.rank() == src) return obj;
  data = data.cpu();
  return from_bytes<T>(static_cast<const std::uint8_t*>(data.data_ptr()), static_cast<std::size_t>(n), device);
}

/// The two object collectives as one class: what Accelerator::gather_object()
/// and broadcast_object() call, named through detail::deferred_t, so that
/// accelerator.hpp need not include this header (nor nlohmann's json).
struct ObjectCollectives {
  template <class T>
  static std::vector<T> gather(runtime::Communicator& comm, const T& obj, const torch::Device& device) {
    return gather_object(comm, obj, device);
  }
  template <class T>
  static T broadcast(runtime::Communicator& comm, T obj, int src, const torch::Device& device) {
    return broadcast_object(comm, std::move(obj), src, device);
  }
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_OBJECTS_HPP
// end <accel/ops/objects.hpp>

#endif  // ACCEL_OPS_HPP
// end <accel/ops.hpp>
// begin <accel/tracking.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the tracking area: experiment trackers (init_trackers,
/// log) and the progress bar.
#ifndef ACCEL_TRACKING_HPP
#define ACCEL_TRACKING_HPP

// begin <accel/tracking/trackers.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel's experiment trackers (JSONL, CSV, TensorBoard event
/// files) and accel::tracking::Trackers, which the Accelerator's
/// init_trackers()/log()/end_training() drive on the main process.
#ifndef ACCEL_TRACKING_TRACKERS_HPP
#define ACCEL_TRACKING_TRACKERS_HPP

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// begin <accel/tracking/detail/tfevents.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines the TensorBoard event-file encoding: CRC32C, TFRecord framing
/// and a hand-written encoder for the few tf.Event protobuf fields accel writes
/// (no protobuf dependency: Debian has no TensorBoard to pull it in with).
#ifndef ACCEL_TRACKING_DETAIL_TFEVENTS_HPP
#define ACCEL_TRACKING_DETAIL_TFEVENTS_HPP

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::tracking::detail {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
inline uint32_t crc32c(std::string_view data) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1U) ? (c >> 1) ^ 0x82F63B78U : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFU;
  for (unsigned char b : data) crc = table[(crc ^ b) & 0xFFU] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFU;
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant, so that a CRC
/// of data containing CRCs stays well distributed.
inline uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8U;
}

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFU));
}

/// One TFRecord: uint64 length, masked CRC of the length, data, masked CRC of data.
inline std::string tfrecord(std::string_view data) {
  std::string len;
  put_le(len, data.size(), 8);
  std::string out = len;
  put_le(out, masked_crc32c(len), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

// --- protobuf wire format (only what tf.Event needs) ---
inline void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void put_tag(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type);
}
inline void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}
inline void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 1);
  put_le(out, bits, 8);
}
inline void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 5);
  put_le(out, bits, 4);
}

/// tf.Event{wall_time=1, step=2, file_version=3} for the file's first record.
inline std::string encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

/// tf.Event{wall_time=1, step=2, summary=5: Summary{value=1: Value{tag=1, simple_value=2}}}.
inline std::string encode_scalars_event(double wall_time, int64_t step,
                                        const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, value);
    put_bytes(summary, 1, v);
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));  // int64: two's complement, 10 bytes if negative
  put_bytes(e, 5, summary);
  return e;
}

}  // namespace accel::tracking::detail

#endif  // ACCEL_TRACKING_DETAIL_TFEVENTS_HPP
// end <accel/tracking/detail/tfevents.hpp>

namespace accel::tracking {

/// One output format. log() receives the step already resolved.
class Tracker {
 public:
  virtual ~Tracker() = default;
  virtual std::string name() const = 0;
  virtual void log(const Values& values, int64_t step) = 0;
  virtual void finish() = 0;
};

namespace detail {
inline double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

inline std::ofstream open_or_throw(const std::filesystem::path& p, std::ios::openmode mode) {
  std::ofstream f(p, mode);
  ACCEL_CHECK(f.good(), "accel: cannot open ", p, " for writing. Check that project_dir is a "
              "writable directory.");
  return f;
}

inline void write_or_throw(std::ofstream& f, const std::string& data,
                           const std::filesystem::path& p) {
  f << data;
  f.flush();  // each call reaches the file: a crashed run keeps its metrics
  ACCEL_CHECK(f.good(), "accel: writing ", p, " failed (disk full?). Free space in project_dir.");
}
}  // namespace detail

/// {"step": N, "<key>": value, ...} per line; strings kept, NaN/inf as strings.
class JsonlTracker : public Tracker {
 public:
  explicit JsonlTracker(std::filesystem::path path)
      : path_(std::move(path)), out_(detail::open_or_throw(path_, std::ios::trunc)) {}
  std::string name() const override { return "jsonl"; }
  void log(const Values& values, int64_t step) override {
    nlohmann::ordered_json j;
    j["step"] = step;
    for (const auto& [k, v] : values) j[k] = v.to_json();
    detail::write_or_throw(out_, j.dump() + "\n", path_);
  }
  void finish() override { out_.close(); }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// Header "step,<keys of the first call, sorted>". A later call with a key
/// the header lacks widens it: the file is rewritten (to a temporary file,
/// then renamed) with the new column appended and the earlier rows' cells
/// left empty. A key missing from a call leaves its cell empty.
class CsvTracker : public Tracker {
 public:
  explicit CsvTracker(std::filesystem::path path) : path_(std::move(path)) { rewrite(); }
  std::string name() const override { return "csv"; }
  void log(const Values& values, int64_t step) override {
    bool widened = false;
    for (const auto& [k, v] : values)
      if (std::find(columns_.begin(), columns_.end(), k) == columns_.end()) {
        columns_.push_back(k);
        widened = true;
      }
    std::vector<std::string> row{std::to_string(step)};
    for (size_t c = 1; c < columns_.size(); ++c) {
      auto it = values.find(columns_[c]);
      row.push_back(it == values.end() ? std::string() : it->second.to_csv());
    }
    rows_.push_back(std::move(row));
    if (widened && header_written_) {
      rewrite();
    } else {
      if (!header_written_) detail::write_or_throw(out_, join(columns_), path_);
      header_written_ = true;
      detail::write_or_throw(out_, join(rows_.back()), path_);
    }
  }
  void finish() override { out_.close(); }
  const std::vector<std::string>& columns() const { return columns_; }

 private:
  static std::string join(const std::vector<std::string>& cells) {
    std::string s;
    for (size_t i = 0; i < cells.size(); ++i) s += (i ? "," : "") + cells[i];
    return s + "\n";
  }
  void rewrite() {
    if (out_.is_open()) out_.close();
    auto tmp = path_;
    tmp += ".tmp";
    {
      auto f = detail::open_or_throw(tmp, std::ios::trunc);
      std::string text = rows_.empty() ? std::string() : join(columns_);
      for (auto row : rows_) {
        row.resize(columns_.size());
        text += join(row);
      }
      detail::write_or_throw(f, text, tmp);
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path_, ec);
    ACCEL_CHECK(!ec, "accel: cannot replace ", path_, ": ", ec.message(),
                ". Check the permissions of project_dir.");
    out_ = detail::open_or_throw(path_, std::ios::app);
    header_written_ = !rows_.empty();
  }

  std::filesystem::path path_;
  std::ofstream out_;
  std::vector<std::string> columns_{"step"};
  std::vector<std::vector<std::string>> rows_;
  bool header_written_ = false;
};

/// TensorBoard event file: TFRecords of tf.Event; numeric values become
/// scalar summaries tagged with their key, strings are left out.
class TensorBoardTracker : public Tracker {
 public:
  explicit TensorBoardTracker(const std::filesystem::path& dir) {
    char host[256] = "localhost";
    ::gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = '\0';
    const double now = detail::wall_time_now();
    auto base = "events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host;
    path_ = dir / base;
    for (int i = 1; std::filesystem::exists(path_); ++i) path_ = dir / (base + "." + std::to_string(i));
    out_ = detail::open_or_throw(path_, std::ios::binary | std::ios::trunc);
    detail::write_or_throw(out_, tracking::detail::tfrecord(
                                     tracking::detail::encode_file_version_event(now)), path_);
  }
  std::string name() const override { return "tensorboard"; }
  void log(const Values& values, int64_t step) override {
    std::vector<std::pair<std::string, float>> scalars;
    for (const auto& [k, v] : values)
      if (auto x = v.as_number()) scalars.emplace_back(k, static_cast<float>(*x));
    if (scalars.empty()) return;
    detail::write_or_throw(out_, tracking::detail::tfrecord(tracking::detail::encode_scalars_event(
                                     detail::wall_time_now(), step, scalars)), path_);
  }
  void finish() override { out_.close(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

/// The trackers of one run, in project_dir/project_name/: config.json,
/// metrics.jsonl, metrics.csv (both started afresh by each init), and
/// events.out.tfevents.* (a new file per init; TensorBoard reads them all). Only the process with
/// `writer` true creates files; the others only check the calls.
class Trackers {
 public:
  void init(const std::optional<std::string>& project_dir, const std::string& project_name,
            const Config& config, TrackerOptions options, bool writer) {
    ACCEL_CHECK(project_dir && !project_dir->empty(),
                "accel: init_trackers() needs a directory to write to, and "
                "AcceleratorOptions::project_dir is not set. Construct the Accelerator with "
                "AcceleratorOptions{.project_dir = \"runs\"} (any writable directory).");
    ACCEL_CHECK(!project_name.empty() && project_name.find('/') == std::string::npos &&
                    project_name != "." && project_name != "..",
                "accel: init_trackers() needs a project name that is one directory name (got \"",
                project_name, "\"). Pass a name such as \"my_run\".");
    finish();
    initialised_ = true;
    step_ = 0;
    dir_ = std::filesystem::path(*project_dir) / project_name;
    if (!writer) return;
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    ACCEL_CHECK(!ec, "accel: cannot create the tracking directory ", dir_, ": ", ec.message(),
                ". Set AcceleratorOptions::project_dir to a writable directory.");
    nlohmann::ordered_json j = nlohmann::ordered_json::object();
    for (const auto& [k, v] : config) j[k] = v.to_json();
    {
      auto f = detail::open_or_throw(dir_ / "config.json", std::ios::trunc);
      detail::write_or_throw(f, j.dump(2) + "\n", dir_ / "config.json");
    }
    if (options.jsonl) trackers_.push_back(std::make_unique<JsonlTracker>(dir_ / "metrics.jsonl"));
    if (options.csv) trackers_.push_back(std::make_unique<CsvTracker>(dir_ / "metrics.csv"));
    if (options.tensorboard) trackers_.push_back(std::make_unique<TensorBoardTracker>(dir_));
  }

  /// step: nullopt uses the number of earlier log() calls since init (0, 1, ...).
  void log(const Values& values, std::optional<int64_t> step = {}) {
    ACCEL_CHECK(initialised_, "accel: log() was called before init_trackers(). Call "
                "accelerator.init_trackers(\"project_name\", config) once before logging.");
    const int64_t s = step.value_or(step_);
    ++step_;
    for (auto& t : trackers_) t->log(values, s);
  }

  /// Closes every writer; log() afterwards needs a new init_trackers().
  void finish() {
    for (auto& t : trackers_) t->finish();
    trackers_.clear();
    initialised_ = false;
  }

  bool initialised() const { return initialised_; }
  /// project_dir/project_name (also on processes that do not write).
  const std::filesystem::path& directory() const { return dir_; }
  /// The active writers (empty on processes that do not write).
  const std::vector<std::unique_ptr<Tracker>>& trackers() const { return trackers_; }

 private:
  bool initialised_ = false;
  int64_t step_ = 0;
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<Tracker>> trackers_;
};

}  // namespace accel::tracking

#endif  // ACCEL_TRACKING_TRACKERS_HPP
// end <accel/tracking/trackers.hpp>

#endif  // ACCEL_TRACKING_HPP
// end <accel/tracking.hpp>
// begin <accel/dispatch.hpp>
// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::dispatch_accelerator: chooses the compile-time policies
/// from a run-time choice (a config file, or the variables `accel launch`
/// sets) and calls a generic function with the matching Accelerator<B, P, S>.
#ifndef ACCEL_DISPATCH_HPP
#define ACCEL_DISPATCH_HPP

#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

#include <boost/hana/at.hpp>
#include <boost/hana/bool.hpp>
#include <boost/hana/cartesian_product.hpp>
#include <boost/hana/filter.hpp>
#include <boost/hana/for_each.hpp>
#include <boost/hana/tuple.hpp>
#include <boost/hana/type.hpp>


namespace accel {

/// The three policy names picked at run time. Names: backend "single" | "gloo"
/// | "mpi" | "nccl"; precision "no" | "fp16" | "bf16" (Accelerate's
/// mixed_precision values); shard "replicate" | "shard_optimizer" | "shard_gradients" |
/// "shard_parameters".
struct PolicyChoice {
  std::string backend = "single";
  std::string precision = "no";
  std::string shard = "replicate";

  /// From a config file: the `backend` key when present, else the
  /// distributed_type (NO -> single, MULTI_CPU -> gloo, MULTI_GPU -> nccl);
  /// mixed_precision as is; shard from ACCEL_SHARD (no Accelerate key exists).
  static PolicyChoice from_config(const LaunchConfig& cfg) {
    PolicyChoice c;
    if (cfg.backend)
      c.backend = *cfg.backend;
    else if (cfg.distributed_type == DistributedType::MultiCpu)
      c.backend = "gloo";
    else if (cfg.distributed_type == DistributedType::MultiGpu)
      c.backend = "nccl";
    c.precision = cfg.mixed_precision;
    if (auto s = runtime::detail::getenv_str("ACCEL_SHARD")) c.shard = *s;
    return c;
  }

  /// From the variables `accel launch` / notebook_launcher set: ACCEL_BACKEND
  /// (default: gloo when WORLD_SIZE > 1, else single), ACCEL_MIXED_PRECISION,
  /// ACCEL_SHARD.
  static PolicyChoice from_environment() {
    PolicyChoice c;
    if (auto b = runtime::detail::getenv_str("ACCEL_BACKEND"))
      c.backend = *b;
    else if (runtime::ProcessEnv::discover().world_size > 1)
      c.backend = "gloo";
    if (auto p = runtime::detail::getenv_str("ACCEL_MIXED_PRECISION")) c.precision = *p;
    if (auto s = runtime::detail::getenv_str("ACCEL_SHARD")) c.shard = *s;
    return c;
  }
};

namespace detail {

/// std::tuple<E...> -> hana::tuple_t<E...>: users list policies as std::tuple.
template <class Tuple>
struct hana_types;
template <class... E>
struct hana_types<std::tuple<E...>> {
  static constexpr auto value = boost::hana::tuple_t<E...>;
};

}  // namespace detail

/// Every backend of this build, for dispatch_accelerator's default.
using compiled_backends = std::tuple<backend::SingleDevice, backend::Gloo
#if ACCEL_WITH_MPI
                                     , backend::Mpi
#endif
#if ACCEL_WITH_NCCL
                                     , backend::Nccl
#endif
                                     >;
using all_precisions = std::tuple<precision::Fp32, precision::Fp16, precision::Bf16>;
using all_shards =
    std::tuple<shard::Replicate, shard::ShardOptimizer, shard::ShardGradients, shard::ShardParameters>;

/// Calls `fn(accelerator)` with an Accelerator<B, P, S>& whose policy names
/// equal `choice`, among the combinations of Backends x Precisions x Shards
/// (std::tuple lists; a Boost.Hana cartesian product, minus the invalid
/// combinations). Each combination instantiates `fn`: narrow the lists to what
/// the program needs to keep compile times down. A choice that no compiled
/// combination serves is an accel::ConfigError listing what is available.
template <class Backends = compiled_backends, class Precisions = all_precisions,
          class Shards = all_shards, class F>
void dispatch_accelerator(const PolicyChoice& choice, F&& fn, AcceleratorOptions options = {}) {
  namespace hana = boost::hana;
  auto combos = hana::filter(
      hana::cartesian_product(hana::make_tuple(detail::hana_types<Backends>::value,
                                               detail::hana_types<Precisions>::value,
                                               detail::hana_types<Shards>::value)),
      [](auto combo) {
        using B = typename decltype(+hana::at_c<0>(combo))::type;
        using P = typename decltype(+hana::at_c<1>(combo))::type;
        using S = typename decltype(+hana::at_c<2>(combo))::type;
        return hana::bool_c<accelerator_policies_valid_v<B, P, S>>;
      });
  bool called = false;
  std::ostringstream available;
  hana::for_each(combos, [&](auto combo) {
    using B = typename decltype(+hana::at_c<0>(combo))::type;
    using P = typename decltype(+hana::at_c<1>(combo))::type;
    using S = typename decltype(+hana::at_c<2>(combo))::type;
    const auto b = B::config_name;
    const auto s = S::config_name;
    available << "\n  backend=" << b << " precision=" << P::name << " shard=" << s;
    if (called || choice.backend != b || choice.precision != P::name || choice.shard != s) return;
    called = true;
    Accelerator<B, P, S> accelerator(options);
    fn(accelerator);
  });
  if (!called)
    throw ConfigError("accel: no compiled Accelerator serves backend=" + choice.backend +
                      " precision=" + choice.precision + " shard=" + choice.shard +
                      ". Change the config (or ACCEL_BACKEND / ACCEL_MIXED_PRECISION / "
                      "ACCEL_SHARD), or compile the combination in. Available:" +
                      available.str());
}

}  // namespace accel

#endif  // ACCEL_DISPATCH_HPP
// end <accel/dispatch.hpp>

#endif  // ACCEL_ACCEL_HPP
// end <accel/accel.hpp>
