// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::shard::Unit: a submodule the user names as a unit of
/// shard::ShardParameters (the wrapping policy of FSDP, by hand), for models
/// that are not a torch::nn::Sequential.
#ifndef ACCEL_SHARD_UNIT_HPP
#define ACCEL_SHARD_UNIT_HPP

#include <type_traits>
#include <utility>

#include <torch/torch.h>

#include <accel/shard/detail/unit_slot.hpp>

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
