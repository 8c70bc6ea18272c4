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

#include <accel/errors.hpp>
#include <accel/memory/detail/replay_state.hpp>

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
