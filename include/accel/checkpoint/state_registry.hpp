// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::ckpt::StateRegistry (what save_state() writes
/// and load_state() restores, recorded as the Accelerator prepares it) and the
/// Checkpointable concept of register_for_checkpointing().
#ifndef ACCEL_CHECKPOINT_STATE_REGISTRY_HPP
#define ACCEL_CHECKPOINT_STATE_REGISTRY_HPP

#include <accel/checkpoint/detail/optimizer_keys.hpp>
#include <accel/checkpoint/state_hooks.hpp>
#include <accel/data/loader_options.hpp>
#include <accel/data/data_loader.hpp>
#include <accel/detail/model_traits.hpp>
#include <accel/detail/training_state.hpp>
#include <accel/precision/loss_scaler.hpp>
#include <accel/shard/detail/partition_layout.hpp>

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
