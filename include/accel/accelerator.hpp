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

#include <accel/backend/concept.hpp>
#include <accel/backend/single_device.hpp>
#include <accel/checkpoint/state_registry.hpp>
#include <accel/comm.hpp>
#include <accel/compatibility.hpp>
#include <accel/data.hpp>
#include <accel/detail/cores.hpp>
#include <accel/detail/deferred.hpp>
#include <accel/detail/training_state.hpp>
#include <accel/errors.hpp>
#include <accel/ops/batch_size.hpp>
#include <accel/ops/collectives.hpp>
#include <accel/ops/join.hpp>
#include <accel/ops/split.hpp>
#include <accel/ops/trigger.hpp>
#include <accel/options.hpp>
#include <accel/precision.hpp>
#include <accel/prepare.hpp>
#include <accel/profiling/events.hpp>
#include <accel/runtime/process_env.hpp>
#include <accel/shard.hpp>
#include <accel/shard/detail/bucket_reducer.hpp>
#include <accel/shard/detail/zero_binding.hpp>
#include <accel/tracking/progress.hpp>
#include <accel/tracking/tracker_options.hpp>
#include <accel/tracking/value.hpp>

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
