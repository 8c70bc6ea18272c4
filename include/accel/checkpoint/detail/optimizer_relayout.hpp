// SPDX-License-Identifier: Apache-2.0
/// @file Re-partitions the optimizer state of a sharded model saved by another
/// number of processes: load_state on 1, 3 or 4 processes of a checkpoint
/// that 2 wrote under shard::ShardOptimizer or shard::ShardGradients.
///
/// Each process's optimizer archive holds one state per tensor it stepped
/// (its chunk of every bucket, or, on one process, every parameter whole).
/// The buckets do not depend on the number of processes, only the chunks do.
/// So the saved states are laid back into their buckets (every element-wise
/// tensor: Adam's moments, SGD's momentum...), and the pieces this process
/// steps now are cut out of them; state that is not element-wise (a step
/// count) is taken from the first saved piece of the bucket. The result is an
/// archive in LibTorch's own optimizer format, loaded as any other.
#ifndef ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP
#define ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP

#include <accel/checkpoint/detail/optimizer_keys.hpp>
#include <accel/errors.hpp>
#include <accel/shard/detail/partition_layout.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

using shard::detail::PartitionLayout;

/// One saved optimizer archive, with the layout of what it stepped.
struct SavedPartition {
  torch::serialize::InputArchive* archive = nullptr;
  PartitionLayout layout;
  std::filesystem::path file;  ///< for messages
};

namespace relayout {

/// A parameter's saved state: field name -> value (LibTorch writes each
/// field of a param state as one attribute).
using FieldMap = std::map<std::string, ArchiveValue>;

/// The state of every parameter of every group, by position (an empty map:
/// the optimizer kept no state for it).
inline std::vector<std::vector<FieldMap>> read_states(const SavedPartition& saved) {
  auto& in = *saved.archive;
  const auto fail = [&](const std::string& why) {
    throw Error(accel::detail::concat("accel: cannot re-partition the optimizer state in '", saved.file.string(),
                                      "' (", why, "). Resume with the number of processes that saved it, "
                                      "or load a checkpoint written completely by save_state()."));
  };
  torch::serialize::InputArchive groups_in, states_in;
  if (!in.try_read("param_groups", groups_in) || !in.try_read("state", states_in))
    fail("it is not a LibTorch optimizer archive");
  torch::Tensor size;
  if (!groups_in.try_read("param_groups/size", size)) fail("it lists no parameter groups");
  if (size.item<int64_t>() != static_cast<int64_t>(saved.layout.groups.size()))
    fail(accel::detail::concat("it has ", size.item<int64_t>(), " parameter groups, the saved buckets ",
                               saved.layout.groups.size()));
  std::vector<std::vector<FieldMap>> out(saved.layout.groups.size());
  for (std::size_t g = 0; g < out.size(); ++g) {
    torch::serialize::InputArchive group;
    torch::Tensor count;
    if (!groups_in.try_read("param_groups/" + std::to_string(g), group) || !group.try_read("params/size", count))
      fail(accel::detail::concat("parameter group ", g, " is unreadable"));
    if (count.item<int64_t>() != static_cast<int64_t>(saved.layout.groups[g].size()))
      fail(accel::detail::concat("parameter group ", g, " holds ", count.item<int64_t>(),
                                 " tensors, the saved buckets give it ", saved.layout.groups[g].size()));
    for (std::size_t k = 0; k < saved.layout.groups[g].size(); ++k) {
      c10::IValue key;
      if (!group.try_read("params/" + std::to_string(k), key) || !key.isString())
        fail(accel::detail::concat("parameter ", k, " of group ", g, " has no key"));
      FieldMap fields;
      torch::serialize::InputArchive state;
      if (states_in.try_read(key.toStringRef(), state))
        for (const auto& name : state.keys()) fields[name] = read_value(state, name);
      out[g].push_back(std::move(fields));
    }
  }
  return out;
}

/// Is this field of a piece's state element-wise (a tensor shaped like the piece)?
inline bool elementwise(const ArchiveValue& v, const PartitionLayout::Piece& piece) {
  return v.value.isTensor() && v.value.toTensor().defined() && v.value.toTensor().sizes().vec() == piece.shape;
}

/// One bucket's state laid out flat: element-wise fields over the whole
/// bucket (padding included), other fields as the first saved piece had them.
struct BucketState {
  std::map<std::string, ArchiveValue> flat;  ///< tensors of the bucket's length
  FieldMap other;
  bool any = false;  ///< some saved piece of the bucket had state
};

}  // namespace relayout

/// The archive that an optimizer holding `target` loads: the state of
/// `saved` (every process's archive of the run that saved it) re-cut. The
/// layouts must describe the same buckets (the caller checks).
inline torch::serialize::InputArchive relayout_optimizer(const std::vector<SavedPartition>& saved,
                                                         const PartitionLayout& target,
                                                         c10::optional<torch::Device> device) {
  using namespace relayout;
  const std::size_t buckets = target.bucket_numel.size();
  // Every bucket's length, padding of any layout included.
  std::vector<int64_t> length(target.bucket_numel);
  const auto cover = [&](const PartitionLayout& l) {
    for (const auto& group : l.groups)
      for (const auto& p : group) length[p.bucket] = std::max(length[p.bucket], p.offset + p.numel);
  };
  cover(target);
  for (const auto& s : saved) cover(s.layout);

  std::vector<BucketState> state(buckets);
  for (const auto& s : saved) {
    const auto fields = read_states(s);
    for (std::size_t g = 0; g < s.layout.groups.size(); ++g) {
      for (std::size_t k = 0; k < s.layout.groups[g].size(); ++k) {
        const auto& piece = s.layout.groups[g][k];
        auto& b = state[piece.bucket];
        for (const auto& [name, value] : fields[g][k]) {
          b.any = true;
          if (!elementwise(value, piece)) {
            b.other.emplace(name, value);
            continue;
          }
          const auto t = value.value.toTensor();
          auto& flat = b.flat[name];
          if (flat.value.isNone()) flat = {torch::zeros({length[piece.bucket]}, t.options()), value.kind};
          flat.value.toTensor().narrow(0, piece.offset, piece.numel).copy_(t.reshape({-1}));
        }
      }
    }
  }

  // LibTorch's optimizer format (torch/optim/serialize.h): the states keyed
  // by a name per tensor, and each group listing its tensors' names in order.
  auto& first = *saved.front().archive;
  torch::serialize::OutputArchive out;
  torch::serialize::OutputArchive states(out.compilation_unit()), groups(out.compilation_unit());
  torch::serialize::InputArchive saved_groups;
  first.read("param_groups", saved_groups);
  groups.write("param_groups/size", torch::tensor(static_cast<int64_t>(target.groups.size())));
  int64_t name = 0;
  for (std::size_t g = 0; g < target.groups.size(); ++g) {
    torch::serialize::OutputArchive group(out.compilation_unit());
    group.write("params/size", torch::tensor(static_cast<int64_t>(target.groups[g].size())));
    for (std::size_t k = 0; k < target.groups[g].size(); ++k) {
      const auto& piece = target.groups[g][k];
      const std::string key = std::to_string(++name);  // decimal: read as an address by 2.x
      group.write("params/" + std::to_string(k), c10::IValue(key));
      const auto& b = state[piece.bucket];
      if (!b.any) continue;
      torch::serialize::OutputArchive fields(out.compilation_unit());
      for (const auto& [field, value] : b.other) write_value(fields, field, value);
      for (const auto& [field, flat] : b.flat) {
        auto cut = flat.value.toTensor().narrow(0, piece.offset, piece.numel).reshape(piece.shape).clone();
        write_value(fields, field, {std::move(cut), flat.kind});
      }
      states.write(key, fields);
    }
    torch::serialize::InputArchive saved_group, options;
    saved_groups.read("param_groups/" + std::to_string(g), saved_group);
    saved_group.read("options", options);
    torch::serialize::OutputArchive options_copy(out.compilation_unit());
    copy_archive(options, options_copy);
    group.write("options", options_copy);
    groups.write("param_groups/" + std::to_string(g), group);
  }
  // Everything else as the first archive has it (LibTorch's format version,
  // accel's group options).
  for (const auto& key : first.keys())
    if (key != "state" && key != "param_groups") copy_entry(first, out, key);
  out.write("state", states);
  out.write("param_groups", groups);
  std::stringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive result;
  result.load_from(bytes, device);
  return result;
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_RELAYOUT_HPP
