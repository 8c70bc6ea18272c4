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

#include <accel/precision/autocast.hpp>

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
