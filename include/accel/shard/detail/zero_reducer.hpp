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

#include <accel/comm/grad_bucket.hpp>
#include <accel/comm/hook.hpp>
#include <accel/errors.hpp>
#include <accel/profiling/events.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/bucket_plan.hpp>
#include <accel/shard/detail/bucket_round.hpp>
#include <accel/shard/detail/gradient_sync.hpp>
#include <accel/shard/detail/parameter_units.hpp>
#include <accel/shard/detail/partition_layout.hpp>

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
