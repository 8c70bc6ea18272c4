// SPDX-License-Identifier: Apache-2.0
/// @file Defines the tensor collectives the Accelerator exposes (gather,
/// reduce, broadcast, pad_across_processes), over any runtime::Communicator.
#ifndef ACCEL_OPS_COLLECTIVES_HPP
#define ACCEL_OPS_COLLECTIVES_HPP

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <vector>

#include <torch/torch.h>

#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::ops {

namespace detail {
/// Every rank's sizes of `t` (dims must agree), as a [world, ndim] int64 tensor.
inline torch::Tensor all_sizes(runtime::Communicator& comm, const torch::Tensor& t) {
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto mine = torch::tensor(t.sizes().vec(), on);
  auto all = torch::empty({comm.size() * t.dim()}, on);
  comm.all_gather(all, mine)->wait();
  return all.view({comm.size(), t.dim()});
}
}  // namespace detail

/// Concatenation along dim 0 of every rank's tensor (rank order). A 0-d tensor
/// counts as shape [1]. With `check_shapes` (ACCEL_DEBUG_MODE) ranks whose
/// shapes differ get an error listing every rank's shape instead of a hang or
/// garbage.
inline torch::Tensor gather(runtime::Communicator& comm, const torch::Tensor& tensor,
                            bool check_shapes = false) {
  auto t = (tensor.dim() == 0 ? tensor.reshape({1}) : tensor).contiguous();
  if (comm.size() == 1) return t.clone();
  if (check_shapes) {
    const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
    auto dims = torch::tensor({static_cast<int64_t>(t.dim())}, on);
    auto all_dims = torch::empty({comm.size()}, on);
    comm.all_gather(all_dims, dims)->wait();
    bool same = all_dims.eq(t.dim()).all().item<bool>();
    auto sizes = same ? detail::all_sizes(comm, t) : torch::Tensor();
    if (!same || !sizes.eq(sizes[0]).all().item<bool>()) {
      std::ostringstream msg;
      msg << "accel: gather() needs the same shape on every rank; rank " << comm.rank()
          << " has " << t.sizes() << (same ? ", all ranks: " : "; ranks differ in dimensions")
          << (same ? sizes : torch::Tensor()) << ". Call pad_across_processes() first.";
      throw Error(msg.str());
    }
  }
  std::vector<int64_t> shape = t.sizes().vec();
  shape[0] *= comm.size();
  auto out = torch::empty(shape, t.options());
  comm.all_gather(out, t)->wait();
  return out;
}

/// gather() for tensors whose dim 0 differs across ranks (the other
/// dimensions must agree): every rank's rows, in rank order, nothing added.
/// One small all-gather of the shapes first; when dim 0 differs, each rank's
/// rows travel padded to the longest. `rows`, when given, receives every
/// rank's dim 0.
inline torch::Tensor gather_ragged(runtime::Communicator& comm, const torch::Tensor& tensor,
                                   std::vector<int64_t>* rows = nullptr) {
  auto t = (tensor.dim() == 0 ? tensor.reshape({1}) : tensor).contiguous();
  const int world = comm.size();
  const auto on = torch::TensorOptions().dtype(torch::kLong).device(comm.device());
  auto head = torch::tensor({static_cast<int64_t>(t.dim()), t.size(0)}, on);
  auto heads = torch::empty({world, 2}, on);
  comm.all_gather(heads, head)->wait();
  heads = heads.cpu();
  const bool same_dims = heads.select(1, 0).eq(t.dim()).all().item<bool>();
  bool same_rest = same_dims;
  torch::Tensor sizes;
  if (same_dims && t.dim() > 1) {
    sizes = detail::all_sizes(comm, t).cpu();
    same_rest = sizes.narrow(1, 1, t.dim() - 1).eq(sizes.narrow(1, 1, t.dim() - 1)[0]).all().item<bool>();
  }
  if (!same_rest) {
    std::ostringstream msg;
    msg << "accel: gather_for_metrics() needs the same shape on every rank apart from dim 0; rank "
        << comm.rank() << " has " << t.sizes()
        << (same_dims ? ", all ranks: " : "; ranks differ in dimensions: ")
        << (same_dims ? sizes : heads.select(1, 0)) << ". Pad those dimensions with "
        << "pad_across_processes() first.";
    throw Error(msg.str());
  }
  std::vector<int64_t> counts(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) counts[static_cast<std::size_t>(r)] = heads[r][1].item<int64_t>();
  if (rows) *rows = counts;
  const int64_t longest = *std::max_element(counts.begin(), counts.end());
  if (longest == t.size(0) && std::all_of(counts.begin(), counts.end(),
                                          [&](int64_t c) { return c == longest; }))
    return gather(comm, t);
  auto shape = t.sizes().vec();
  shape[0] = longest;
  auto padded = torch::zeros(shape, t.options());
  padded.narrow(0, 0, t.size(0)).copy_(t);
  auto all = gather(comm, padded);
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < world; ++r)
    parts.push_back(all.narrow(0, r * longest, counts[static_cast<std::size_t>(r)]));
  return torch::cat(parts);
}

inline torch::Tensor reduce(runtime::Communicator& comm, const torch::Tensor& tensor,
                            Reduction reduction = Reduction::Sum) {
  auto t = tensor.contiguous().clone();
  comm.all_reduce(t, runtime::ReduceOp::Sum)->wait();
  if (reduction == Reduction::Mean) {
    if (t.is_floating_point())
      t.div_(comm.size());
    else
      t = t.div(comm.size(), "floor");
  }
  return t;
}

inline torch::Tensor broadcast(runtime::Communicator& comm, const torch::Tensor& tensor,
                               int src = 0) {
  ACCEL_CHECK(src >= 0 && src < comm.size(), "accel: broadcast() source rank ", src,
              " is outside world size ", comm.size(), ". Use a rank in [0, ", comm.size(), ").");
  auto t = tensor.contiguous().clone();
  comm.broadcast(t, src)->wait();
  return t;
}

/// Pads `dim` of every rank's tensor to the largest size across ranks with
/// `pad_index` (at the front when pad_first), so they can be gathered.
inline torch::Tensor pad_across_processes(runtime::Communicator& comm, const torch::Tensor& tensor,
                                          int64_t dim = 0, double pad_index = 0,
                                          bool pad_first = false) {
  if (tensor.dim() == 0) return tensor;
  if (dim < 0) dim += tensor.dim();
  ACCEL_CHECK(dim >= 0 && dim < tensor.dim(), "accel: pad_across_processes() dim ", dim,
              " is outside a tensor of ", tensor.dim(), " dimensions. Pass a valid dim.");
  auto sizes = detail::all_sizes(comm, tensor);
  int64_t max_size = sizes.select(1, dim).max().item<int64_t>();
  int64_t own = tensor.size(dim);
  if (own == max_size) return tensor;
  auto shape = tensor.sizes().vec();
  shape[dim] = max_size;
  auto out = torch::full(shape, pad_index, tensor.options());
  out.narrow(dim, pad_first ? max_size - own : 0, own).copy_(tensor);
  return out;
}

}  // namespace accel::ops

#endif  // ACCEL_OPS_COLLECTIVES_HPP
