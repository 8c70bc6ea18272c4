// SPDX-License-Identifier: Apache-2.0
/// @file Defines DataLoader<Dataset, Collate>: a range over the batches of a
/// map-style dataset, with seeded shuffling, Accelerate's sharding across
/// ranks, device placement, prefetching threads, end-of-data bookkeeping and
/// exact resume.
#ifndef ACCEL_DATA_DATA_LOADER_HPP
#define ACCEL_DATA_DATA_LOADER_HPP

#include <accel/data/batch_sampler_shard.hpp>
#include <accel/data/collate.hpp>
#include <accel/data/detail/dataset_access.hpp>
#include <accel/data/detail/prefetcher.hpp>
#include <accel/data/loader_options.hpp>
#include <accel/data/loader_state.hpp>
#include <accel/data/to_device.hpp>
#include <accel/errors.hpp>
#include <accel/profiling/events.hpp>
#include <accel/runtime/heartbeat.hpp>

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
