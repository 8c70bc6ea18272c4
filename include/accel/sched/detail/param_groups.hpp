// SPDX-License-Identifier: Apache-2.0
/// @file Defines PerGroup (one value or one per parameter group) and the
/// helpers the schedulers use to read and write learning rate and momentum of
/// an optimizer's parameter groups, whatever the optimizer type.
#ifndef ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP
#define ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP

#include <accel/errors.hpp>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace accel::sched {

/// A scheduler argument given either once for all parameter groups
/// (`.max_lr = 0.1`) or once per group (`.max_lr = {0.1, 0.01}`), as Python's
/// schedulers accept a float or a list.
struct PerGroup {
  std::vector<double> values;

  PerGroup() = default;
  PerGroup(double v) : values{v} {}  // NOLINT: implicit on purpose
  PerGroup(std::initializer_list<double> v) : values(v) {}
  PerGroup(std::vector<double> v) : values(std::move(v)) {}  // NOLINT

  /// One value per group: a single value is repeated; a list must match.
  std::vector<double> expand(std::size_t groups, const char* scheduler,
                             const char* name) const {
    ACCEL_CHECK(!values.empty(), "accel: ", scheduler, " needs a value for ", name,
                ". Set it in the options (one number, or one per parameter group).");
    if (values.size() == 1) return std::vector<double>(groups, values.front());
    ACCEL_CHECK(values.size() == groups, "accel: ", scheduler, " expected ", groups,
                " values for ", name, " (one per parameter group), got ", values.size(),
                ". Pass one number or exactly one per parameter group.");
    return values;
  }
};

namespace detail {

/// Which optimizer field OneCycleLR cycles: Python cycles `momentum` when the
/// optimizer has one (SGD, RMSprop) and beta1 when it has `betas` (Adam, AdamW).
enum class MomentumField { None, Momentum, Beta1 };

inline MomentumField momentum_field(const torch::optim::OptimizerOptions& o) {
  if (dynamic_cast<const torch::optim::SGDOptions*>(&o) ||
      dynamic_cast<const torch::optim::RMSpropOptions*>(&o))
    return MomentumField::Momentum;
  if (dynamic_cast<const torch::optim::AdamOptions*>(&o) ||
      dynamic_cast<const torch::optim::AdamWOptions*>(&o))
    return MomentumField::Beta1;
  return MomentumField::None;
}

inline void set_momentum(torch::optim::OptimizerOptions& o, double m) {
  if (auto* p = dynamic_cast<torch::optim::SGDOptions*>(&o)) {
    p->momentum(m);
  } else if (auto* r = dynamic_cast<torch::optim::RMSpropOptions*>(&o)) {
    r->momentum(m);
  } else if (auto* a = dynamic_cast<torch::optim::AdamOptions*>(&o)) {
    a->betas(std::make_tuple(m, std::get<1>(a->betas())));
  } else if (auto* w = dynamic_cast<torch::optim::AdamWOptions*>(&o)) {
    w->betas(std::make_tuple(m, std::get<1>(w->betas())));
  }
}

inline double get_momentum(const torch::optim::OptimizerOptions& o) {
  if (auto* p = dynamic_cast<const torch::optim::SGDOptions*>(&o)) return p->momentum();
  if (auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) return r->momentum();
  if (auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) return std::get<0>(a->betas());
  if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) return std::get<0>(w->betas());
  return 0.0;
}

/// Writes lrs (one per group) into the optimizer; the base class's own setter
/// is private, and construction and set_step_count() need one.
inline void set_lrs(torch::optim::Optimizer& opt, const std::vector<double>& lrs) {
  auto& groups = opt.param_groups();
  for (std::size_t i = 0; i < groups.size() && i < lrs.size(); ++i)
    groups[i].options().set_lr(lrs[i]);
}

inline void check_group_count(const torch::optim::Optimizer& opt, std::size_t expected,
                              const char* scheduler) {
  ACCEL_CHECK(opt.param_groups().size() == expected, "accel: ", scheduler, " was built for ",
              expected, " parameter groups but the optimizer now has ",
              opt.param_groups().size(),
              ". Add all parameter groups before constructing the scheduler.");
}

/// Scheduler position in a torch::serialize archive (int64 scalar tensors).
inline void write_int(torch::serialize::OutputArchive& a, const std::string& key, int64_t v) {
  a.write(key, torch::tensor(v, torch::kInt64));
}
inline int64_t read_int(torch::serialize::InputArchive& a, const std::string& key) {
  torch::Tensor t;
  a.read(key, t);
  return t.item<int64_t>();
}
inline void write_doubles(torch::serialize::OutputArchive& a, const std::string& key,
                          const std::vector<double>& v) {
  a.write(key, torch::tensor(v, torch::kFloat64));
}
inline std::vector<double> read_doubles(torch::serialize::InputArchive& a,
                                        const std::string& key) {
  torch::Tensor t;
  a.read(key, t);
  t = t.contiguous();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

}  // namespace detail
}  // namespace accel::sched

#endif  // ACCEL_SCHED_DETAIL_PARAM_GROUPS_HPP
