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

#include <accel/detail/model_traits.hpp>
#include <accel/detail/training_state.hpp>
#include <accel/errors.hpp>
#include <accel/precision/autocast.hpp>
#include <accel/shard/detail/gradient_sync.hpp>

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
