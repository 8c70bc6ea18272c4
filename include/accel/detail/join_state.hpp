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

#include <accel/errors.hpp>
#include <accel/runtime/communicator.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

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
