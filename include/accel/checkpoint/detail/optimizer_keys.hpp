// SPDX-License-Identifier: Apache-2.0
/// @file Reads optimizer archives written by LibTorch 1.13 on LibTorch 2.x.
///
/// An optimizer archive names each parameter's state by the parameter's
/// TensorImpl address. 1.13 prints it in hex ("0x55d0c3a1b2c0"); 2.x prints
/// it in decimal and reads it back with std::stoull, which reads every 1.13
/// key as 0: all states land on one parameter, and the first step fails on a
/// shape mismatch (or, with equal shapes, trains on another tensor's moments).
/// The keys are rewritten in decimal before 2.x loads such an archive. 1.13
/// compares the keys as strings, so it reads both spellings as they are.
#ifndef ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP
#define ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP

#include <accel/detail/torch_version.hpp>

#include <torch/torch.h>

#include <cctype>
#include <sstream>
#include <string>

namespace accel::ckpt::detail {

inline bool is_hex_address(const std::string& key) {
  if (key.size() < 3 || key[0] != '0' || key[1] != 'x') return false;
  for (std::size_t i = 2; i < key.size(); ++i)
    if (!std::isxdigit(static_cast<unsigned char>(key[i]))) return false;
  return true;
}

inline std::string decimal_address(const std::string& hex_key) {
  return std::to_string(std::stoull(hex_key, nullptr, 16));
}

/// One value of an archive as LibTorch stored it: a tensor registered as a
/// parameter or a buffer, or any other value (an attribute).
struct ArchiveValue {
  enum class Kind { parameter, buffer, attribute };
  c10::IValue value;
  Kind kind = Kind::attribute;
};

/// `key` of `in`, which must not be a sub-archive.
inline ArchiveValue read_value(torch::serialize::InputArchive& in, const std::string& key) {
  torch::Tensor t;
  if (in.try_read(key, t, /*is_buffer=*/false)) return {t, ArchiveValue::Kind::parameter};
  if (in.try_read(key, t, /*is_buffer=*/true)) return {t, ArchiveValue::Kind::buffer};
  c10::IValue v;
  in.read(key, v);
  return {std::move(v), ArchiveValue::Kind::attribute};
}

inline void write_value(torch::serialize::OutputArchive& out, const std::string& key, const ArchiveValue& v) {
  if (v.kind == ArchiveValue::Kind::attribute)
    out.write(key, v.value);
  else
    out.write(key, v.value.toTensor(), /*is_buffer=*/v.kind == ArchiveValue::Kind::buffer);
}

/// Copies an archive key by key (sub-archives, parameters, buffers, other
/// values). With decimal_addresses, hex addresses are rewritten in decimal
/// where they name optimizer states: keys directly under "state" and string
/// values under "params".
inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                         bool decimal_addresses = false, const std::string& parent = "");

/// Copies entry `key` of `in` (a sub-archive or a value), as copy_archive does.
inline void copy_entry(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                       const std::string& key, bool decimal_addresses = false, const std::string& parent = "") {
  torch::serialize::InputArchive sub;
  if (in.try_read(key, sub)) {
    torch::serialize::OutputArchive copy(out.compilation_unit());
    copy_archive(sub, copy, decimal_addresses, key);
    const bool rename = decimal_addresses && parent == "state" && is_hex_address(key);
    out.write(rename ? decimal_address(key) : key, copy);
    return;
  }
  auto v = read_value(in, key);
  if (decimal_addresses && v.value.isString() && key.rfind("params/", 0) == 0 &&
      is_hex_address(v.value.toStringRef()))
    v.value = c10::IValue(decimal_address(v.value.toStringRef()));
  write_value(out, key, v);
}

inline void copy_archive(torch::serialize::InputArchive& in, torch::serialize::OutputArchive& out,
                         bool decimal_addresses, const std::string& parent) {
  for (const std::string& key : in.keys()) copy_entry(in, out, key, decimal_addresses, parent);
}

/// True when `in` is an optimizer archive whose state keys are 1.13's hex.
inline bool has_hex_state_keys(torch::serialize::InputArchive& in) {
  torch::serialize::InputArchive state;
  if (!in.try_read("state", state)) return false;
  for (const std::string& key : state.keys())
    if (is_hex_address(key)) return true;
  return false;
}

/// Loads `opt` from `in`, first rewriting 1.13's keys when this is 2.x.
template <class Load>
void load_with_portable_keys(torch::serialize::InputArchive& in, Load&& load) {
#if ACCEL_TORCH_AT_LEAST(2, 0)
  if (has_hex_state_keys(in)) {
    torch::serialize::OutputArchive rewritten;
    copy_archive(in, rewritten, /*decimal_addresses=*/true);
    std::stringstream bytes;
    rewritten.save_to(bytes);
    torch::serialize::InputArchive converted;
    converted.load_from(bytes);
    load(converted);
    return;
  }
#endif
  load(in);
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_OPTIMIZER_KEYS_HPP
