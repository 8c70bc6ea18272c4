// SPDX-License-Identifier: Apache-2.0
/// @file Defines ops::Trigger, the flag behind the Accelerator's
/// set_trigger() / check_trigger() (early stopping decided by any rank).
#ifndef ACCEL_OPS_TRIGGER_HPP
#define ACCEL_OPS_TRIGGER_HPP

#include <torch/torch.h>

#include <accel/runtime/communicator.hpp>

namespace accel::ops {

/// One flag any rank may set; check() is one all-reduce (max) after which
/// every rank knows whether some rank set it, and the flag is cleared.
class Trigger {
 public:
  void set() { set_ = true; }
  bool check(runtime::Communicator& comm) {
    auto flag = torch::tensor({set_ ? 1 : 0}, torch::TensorOptions().dtype(torch::kInt).device(comm.device()));
    comm.all_reduce(flag, runtime::ReduceOp::Max)->wait();
    const bool seen = flag.cpu().item<int>() != 0;
    if (seen) set_ = false;
    return seen;
  }

 private:
  bool set_ = false;
};

}  // namespace accel::ops

#endif  // ACCEL_OPS_TRIGGER_HPP
