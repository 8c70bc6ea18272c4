// SPDX-License-Identifier: Apache-2.0
/// @file Defines accel::comm::PowerSGDHook, CommHook::PowerSGD: each
/// matrix-shaped gradient travels as two thin factors (Vogels et al., 2019,
/// "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
/// Optimization"), with error feedback and warm start.
#ifndef ACCEL_COMM_POWERSGD_HOOK_HPP
#define ACCEL_COMM_POWERSGD_HOOK_HPP

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <accel/comm/hook.hpp>
#include <accel/errors.hpp>
#include <accel/options.hpp>
#include <accel/runtime/communicator.hpp>

namespace accel::comm {

namespace detail {

/// Gram-Schmidt on the columns of m (rows x r), in place. A zero column
/// stays zero (the epsilon), where PyTorch's default would divide by zero.
inline void orthogonalize(torch::Tensor m) {
  const auto cols = m.size(1);
  for (int64_t i = 0; i < cols; ++i) {
    auto col = m.narrow(1, i, 1);
    col.div_(col.norm() + 1e-8);
    if (i + 1 < cols) {
      auto rest = m.narrow(1, i + 1, cols - i - 1);
      rest.sub_((col * rest).sum(0, /*keepdim=*/true) * col);
    }
  }
}

}  // namespace detail

/// Per bucket and step, after start_powerSGD_iter plain steps:
/// 1. error feedback: the bucket gets what compression lost on this rank at
///    the previous step added to it (the error of the whole bucket, as PyTorch);
/// 2. each gradient viewed as a rows x cols matrix (dim 0 x the rest) that
///    compression makes at least 2x smaller becomes M; the others (biases,
///    small matrices, padding) are averaged as they are;
/// 3. P = M Q (Q: the last step's, or seeded random, orthogonalized), summed
///    across ranks in one all-reduce together with the uncompressed values;
///    P orthogonalized; Q = M^T P, summed across ranks and divided by N;
///    M is replaced by P Q^T.
/// Two collectives per bucket: the second starts when the first is waited
/// for (runtime::ThenWork). State (step count, errors, Qs) is saved by
/// save_state() so that resume stays bit-exact.
class PowerSGDHook final : public Hook {
 public:
  explicit PowerSGDHook(PowerSGDOptions options) : options_(options) {
    ACCEL_CHECK(options_.matrix_approximation_rank >= 1, "accel: PowerSGDOptions::matrix_approximation_rank is ",
                options_.matrix_approximation_rank, "; it must be at least 1.");
    ACCEL_CHECK(options_.start_powerSGD_iter >= 0, "accel: PowerSGDOptions::start_powerSGD_iter is ",
                options_.start_powerSGD_iter, "; it must be 0 or more.");
  }

  std::shared_ptr<runtime::Work> all_reduce(GradBucket& bucket, runtime::Communicator& comm) override {
    const bool compress = step_ >= options_.start_powerSGD_iter;
    if (bucket.is_last) ++step_;  // buckets are reduced in index order: one step per last bucket
    if (!compress) return mean_.all_reduce(bucket, comm);
    torch::NoGradGuard no_grad;
    auto buffer = bucket.buffer;
    const auto index = bucket.index;
    const int world = comm.size();

    torch::Tensor before;  // the bucket with the last error added: what this rank wanted to send
    if (options_.use_error_feedback) {
      auto& error = error_[index];
      if (error.defined() && error.sizes() == buffer.sizes())
        buffer.add_(error);
      else
        error = torch::zeros_like(buffer);
      before = buffer.clone();
    }

    // Which gradients are compressed; everything else of the buffer is "rest".
    std::vector<Matrix> ms;
    int64_t p_len = 0, q_len = 0;
    const auto base = static_cast<const char*>(buffer.data_ptr());
    const auto item = static_cast<int64_t>(buffer.element_size());
    for (const auto& g : bucket.gradients) {
      if (g.dim() < 2 || g.numel() == 0) continue;
      const int64_t rows = g.size(0), cols = g.numel() / rows;
      const int64_t r = std::min<int64_t>({options_.matrix_approximation_rank, rows, cols});
      if ((rows + cols) * r * 2 >= rows * cols) continue;  // less than 2x smaller: not worth it
      const int64_t offset = (static_cast<const char*>(g.data_ptr()) - base) / item;
      ms.push_back(Matrix{offset, rows, cols, r, p_len, q_len});
      p_len += rows * r;
      q_len += cols * r;
    }
    std::sort(ms.begin(), ms.end(), [](const Matrix& a, const Matrix& b) { return a.offset < b.offset; });
    std::vector<std::pair<int64_t, int64_t>> rest;  // [offset, length) not compressed
    int64_t at = 0;
    for (const auto& m : ms) {
      if (m.offset > at) rest.emplace_back(at, m.offset - at);
      at = m.offset + m.rows * m.cols;
    }
    if (at < buffer.numel()) rest.emplace_back(at, buffer.numel() - at);
    int64_t rest_len = 0;
    for (const auto& [o, n] : rest) rest_len += n;

    // Q: warm from the last step, or seeded random (the same on every rank).
    auto& q = q_[index];
    if (!options_.warm_start || !q.defined() || q.numel() != q_len) {
      auto gen = at::detail::createCPUGenerator(0x5eed + 7919 * static_cast<uint64_t>(index) +
                                                (options_.warm_start ? 0 : static_cast<uint64_t>(step_)));
      q = torch::randn({q_len}, gen, torch::TensorOptions().dtype(torch::kFloat)).to(buffer.options());
      for (const auto& m : ms) detail::orthogonalize(q_of(q, m));
    }

    // First collective: the uncompressed values and every P, in one buffer.
    auto first = torch::empty({rest_len + p_len}, buffer.options());
    int64_t w = 0;
    for (const auto& [o, n] : rest) {
      first.narrow(0, w, n).copy_(buffer.narrow(0, o, n));
      w += n;
    }
    for (const auto& m : ms) {
      auto p = p_of(first, rest_len, m);
      torch::mm_out(p, matrix(buffer, m), q_of(q, m));
    }
    auto work = comm.all_reduce(first, runtime::ReduceOp::Sum);

    // Then: P orthogonalized, Q = M^T P summed, M = P Q^T / N.
    auto finish = [this, buffer, first, rest, rest_len, ms, q, before, index, world,
                   comm_ptr = &comm]() mutable {
      torch::NoGradGuard no_grad;
      int64_t w = 0;
      for (const auto& [o, n] : rest) {
        buffer.narrow(0, o, n).copy_(first.narrow(0, w, n)).div_(world);
        w += n;
      }
      if (ms.empty()) return finish_error(index, buffer, before);
      for (const auto& m : ms) {
        auto p = p_of(first, rest_len, m);
        detail::orthogonalize(p);
        auto qm = q_of(q, m);
        torch::mm_out(qm, matrix(buffer, m).t(), p);
      }
      comm_ptr->all_reduce(q, runtime::ReduceOp::Sum)->wait();
      q.div_(world);
      for (const auto& m : ms) {
        auto out = matrix(buffer, m);
        torch::mm_out(out, p_of(first, rest_len, m), q_of(q, m).t());
      }
      finish_error(index, buffer, before);
    };
    return std::make_shared<runtime::ThenWork>(std::move(work), std::move(finish));
  }

  bool has_state() const override { return true; }
  void save(torch::serialize::OutputArchive& archive) const override {
    archive.write("step", torch::tensor(step_, torch::kLong));
    for (const auto& [b, e] : error_) archive.write("error_" + std::to_string(b), e);
    if (options_.warm_start)
      for (const auto& [b, q] : q_) archive.write("q_" + std::to_string(b), q);
  }
  void load(torch::serialize::InputArchive& archive) override {
    torch::Tensor t;
    archive.read("step", t);
    step_ = t.item<int64_t>();
    error_.clear();
    q_.clear();
    for (std::size_t b = 0;; ++b) {
      torch::Tensor e, q;
      const bool has_e = archive.try_read("error_" + std::to_string(b), e);
      const bool has_q = archive.try_read("q_" + std::to_string(b), q);
      if (!has_e && !has_q) break;
      if (has_e) error_[b] = e;
      if (has_q) q_[b] = q;
    }
  }

  /// Optimizer steps seen (plain ones included); for tests.
  int64_t steps() const { return step_; }

 private:
  struct Matrix {
    int64_t offset, rows, cols, rank, p_at, q_at;
  };
  static torch::Tensor matrix(const torch::Tensor& buffer, const Matrix& m) {
    return buffer.narrow(0, m.offset, m.rows * m.cols).view({m.rows, m.cols});
  }
  static torch::Tensor p_of(const torch::Tensor& first, int64_t rest_len, const Matrix& m) {
    return first.narrow(0, rest_len + m.p_at, m.rows * m.rank).view({m.rows, m.rank});
  }
  static torch::Tensor q_of(const torch::Tensor& q, const Matrix& m) {
    return q.narrow(0, m.q_at, m.cols * m.rank).view({m.cols, m.rank});
  }
  void finish_error(std::size_t index, const torch::Tensor& buffer, const torch::Tensor& before) {
    if (options_.use_error_feedback) error_[index] = before - buffer;
    if (!options_.warm_start) q_.erase(index);
  }

  PowerSGDOptions options_;
  int64_t step_ = 0;
  std::map<std::size_t, torch::Tensor> error_;  ///< per bucket
  std::map<std::size_t, torch::Tensor> q_;      ///< per bucket, all matrices' Qs back to back
  MeanHook mean_;
};

}  // namespace accel::comm

#endif  // ACCEL_COMM_POWERSGD_HOOK_HPP
