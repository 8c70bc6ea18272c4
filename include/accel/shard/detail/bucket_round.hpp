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

#include <accel/comm/hook.hpp>
#include <accel/errors.hpp>
#include <accel/profiling/events.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/accumulator_hooks.hpp>
#include <accel/shard/detail/bucket_plan.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

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
