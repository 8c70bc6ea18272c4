// SPDX-License-Identifier: Apache-2.0
/// @file Defines the torch-free safetensors header parser: every file is
/// untrusted, so each field is validated before anything is read through it.
///
/// Layout (https://github.com/huggingface/safetensors): an 8-byte little-endian
/// header length N, N bytes of JSON
///   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]},
///    "__metadata__": {"key": "value"}}
/// (optionally padded with spaces), then the data buffer. Offsets are relative
/// to the start of the data buffer, which the tensors cover without holes or
/// overlaps (as the reference reader requires, so no polyglot files).
#ifndef ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP
#define ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP

#include <accel/errors.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace accel::ckpt::detail {

/// Same cap as the reference reader: a header beyond it is rejected before any
/// allocation, so a forged length cannot make us allocate gigabytes.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
/// A valid header nests three deep (root, tensor entry, shape); anything much
/// deeper is hostile.
inline constexpr int kMaxJsonDepth = 8;
inline constexpr std::string_view kMetadataKey = "__metadata__";

/// One tensor entry of a validated header. begin/end are byte offsets into the
/// data buffer; end - begin == product(shape) * dtype_size(dtype).
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
};

/// A validated header: tensors sorted by their offsets (file order).
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string> metadata;
  std::uint64_t data_start = 0;  ///< absolute file offset of the data buffer (8 + N)
  std::uint64_t data_size = 0;   ///< bytes in the data buffer
};

/// Byte size of one element of a safetensors dtype, or nullopt if unknown.
/// Sub-byte formats (F4, F6) are not listed: their sizes are not whole bytes.
inline std::optional<std::size_t> dtype_size(std::string_view dtype) {
  static constexpr std::array<std::pair<std::string_view, std::size_t>, 15> kSizes{{
      {"BOOL", 1}, {"U8", 1}, {"I8", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1},
      {"I16", 2}, {"U16", 2}, {"F16", 2}, {"BF16", 2},
      {"I32", 4}, {"U32", 4}, {"F32", 4},
      {"I64", 8}, {"U64", 8}, {"F64", 8},
  }};
  for (const auto& [name, size] : kSizes)
    if (name == dtype) return size;
  return std::nullopt;
}

[[noreturn]] inline void fail_format(std::string_view source, const std::string& problem) {
  throw Error(accel::detail::concat(
      "accel: invalid safetensors file '", source, "': ", problem,
      ". The file is corrupt, truncated or not a safetensors file: write it again "
      "with accel::ckpt::save_safetensors or a safetensors library."));
}

/// Reads the little-endian header length from the first 8 bytes and checks it
/// against the cap and the file size. Returns N.
inline std::uint64_t parse_header_length(const unsigned char* prefix, std::uint64_t file_size,
                                         std::string_view source) {
  if (file_size < 8)
    fail_format(source, accel::detail::concat("the file has ", file_size,
                                              " bytes, fewer than the 8-byte header length"));
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderBytes)
    fail_format(source, accel::detail::concat("the header length ", n, " exceeds the limit of ",
                                              kMaxHeaderBytes, " bytes"));
  if (n > file_size - 8)
    fail_format(source, accel::detail::concat("the header length ", n,
                                              " runs past the end of the file (", file_size,
                                              " bytes)"));
  return n;
}

namespace json_check {

using json = nlohmann::json;

/// Parses with a callback that rejects duplicate keys (nlohmann would keep the
/// last one silently) and nesting deeper than kMaxJsonDepth.
inline json parse_strict(std::string_view text, std::string_view source) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth)
          fail_format(source, accel::detail::concat("the header nests deeper than ",
                                                    kMaxJsonDepth, " levels"));
        if (event == json::parse_event_t::object_start) keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key:
        if (!keys.empty() && !keys.back().insert(parsed.get<std::string>()).second)
          fail_format(source, accel::detail::concat(
                                  depth == 1 ? "the tensor name '" : "the key '",
                                  parsed.get<std::string>(), "' appears twice in the header"));
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text.begin(), text.end(), callback);
  } catch (const json::exception& e) {
    fail_format(source, accel::detail::concat("the header is not valid JSON (", e.what(), ")"));
  }
}

inline std::uint64_t to_u64(const json& v, std::string_view source, const std::string& what) {
  if (!v.is_number_unsigned())
    fail_format(source, what + " is " + v.dump() + ", not a non-negative integer");
  return v.get<std::uint64_t>();
}

inline TensorInfo parse_entry(const std::string& name, const json& entry, std::uint64_t data_size,
                              std::string_view source) {
  const std::string where = "tensor '" + name + "'";
  if (!entry.is_object()) fail_format(source, where + " is not a JSON object");
  for (const char* field : {"dtype", "shape", "data_offsets"})
    if (!entry.contains(field)) fail_format(source, where + " has no \"" + field + "\" field");

  TensorInfo info;
  info.name = name;
  const json& dtype = entry["dtype"];
  if (!dtype.is_string()) fail_format(source, where + " has a dtype that is not a string");
  info.dtype = dtype.get<std::string>();
  const auto elem = dtype_size(info.dtype);
  if (!elem)
    fail_format(source, where + " has unknown dtype '" + info.dtype +
                            "' (known: BOOL U8 I8 F8_E4M3 F8_E5M2 I16 U16 F16 BF16 I32 U32 "
                            "F32 I64 U64 F64)");

  const json& shape = entry["shape"];
  if (!shape.is_array()) fail_format(source, where + " has a shape that is not an array");
  // Element count with overflow checks: a dimension must also fit int64_t,
  // which is what LibTorch's sizes are.
  std::uint64_t numel = 1;
  bool overflow = false, zero = false;
  for (const json& d : shape) {
    const std::uint64_t dim = to_u64(d, source, where + ": a shape dimension");
    if (dim > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_format(source, where + " has shape dimension " + std::to_string(dim) +
                              ", larger than a tensor can have");
    info.shape.push_back(static_cast<std::int64_t>(dim));
    if (dim == 0) zero = true;
    else if (numel > std::numeric_limits<std::uint64_t>::max() / dim) overflow = true;
    numel *= dim;  // may wrap: then overflow is recorded
  }
  if (zero) {  // a zero dimension makes the count exactly 0
    numel = 0;
    overflow = false;
  }
  if (overflow || numel > std::numeric_limits<std::uint64_t>::max() / *elem)
    fail_format(source, where + " has shape " + shape.dump() +
                            " whose byte size overflows 64 bits");

  const json& offsets = entry["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2)
    fail_format(source, where + " has data_offsets " + offsets.dump() +
                            ", not an array [begin, end]");
  info.begin = to_u64(offsets[0], source, where + ": data_offsets begin");
  info.end = to_u64(offsets[1], source, where + ": data_offsets end");
  if (info.begin > info.end)
    fail_format(source, where + " has reversed data_offsets [" + std::to_string(info.begin) +
                            ", " + std::to_string(info.end) + "] (begin after end)");
  if (info.end > data_size)
    fail_format(source, where + " has data_offsets [" + std::to_string(info.begin) + ", " +
                            std::to_string(info.end) + "] that leave the data buffer (" +
                            std::to_string(data_size) + " bytes)");
  const std::uint64_t bytes = numel * *elem;
  if (bytes != info.end - info.begin)
    fail_format(source, where + " has shape " + shape.dump() + " and dtype " + info.dtype +
                            ", which need " + std::to_string(bytes) +
                            " bytes, but its data_offsets span " +
                            std::to_string(info.end - info.begin) + " bytes");
  return info;
}

}  // namespace json_check

/// Validates the JSON header text against a data buffer of data_size bytes
/// that starts at file offset data_start. Throws accel::Error naming source.
inline SafetensorsHeader parse_header_json(std::string_view text, std::uint64_t data_start,
                                           std::uint64_t data_size, std::string_view source) {
  using json = nlohmann::json;
  const json root = json_check::parse_strict(text, source);
  if (!root.is_object()) fail_format(source, "the header is not a JSON object");

  SafetensorsHeader header;
  header.data_start = data_start;
  header.data_size = data_size;
  for (const auto& [key, value] : root.items()) {
    if (key == kMetadataKey) {
      if (!value.is_object()) fail_format(source, "__metadata__ is not a JSON object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          fail_format(source, "__metadata__ value of '" + mk + "' is not a string");
        header.metadata.emplace(mk, mv.get<std::string>());
      }
      continue;
    }
    header.tensors.push_back(json_check::parse_entry(key, value, data_size, source));
  }

  // The tensors must tile the data buffer exactly: no overlap, no hole, no tail.
  auto& ts = header.tensors;
  std::sort(ts.begin(), ts.end(), [](const TensorInfo& a, const TensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& t : ts) {
    if (t.begin < covered)
      fail_format(source, "tensors '" + previous->name + "' and '" + t.name +
                              "' have overlapping data_offsets");
    if (t.begin > covered)
      fail_format(source, "bytes [" + std::to_string(covered) + ", " + std::to_string(t.begin) +
                              ") of the data buffer belong to no tensor");
    covered = t.end;
    previous = &t;
  }
  if (covered != data_size)
    fail_format(source, "the data buffer has " + std::to_string(data_size - covered) +
                            " bytes after the last tensor");
  return header;
}

/// Validates a whole in-memory safetensors file.
inline SafetensorsHeader parse_safetensors(const void* data, std::size_t size,
                                           std::string_view source) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  const std::uint64_t n = parse_header_length(bytes, size, source);
  const std::string_view text(reinterpret_cast<const char*>(bytes) + 8, static_cast<std::size_t>(n));
  return parse_header_json(text, 8 + n, size - 8 - n, source);
}

/// Reads and validates only the header of a safetensors file.
inline SafetensorsHeader read_safetensors_header(const std::filesystem::path& path) {
  const std::string source = path.string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error("accel: cannot read safetensors file '" + source +
                "': it does not exist or is not a regular file. Check the path.");
  const std::uint64_t file_size = std::filesystem::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  if (ec || !in)
    throw Error("accel: cannot open safetensors file '" + source + "'. Check its permissions.");
  unsigned char prefix[8] = {};
  in.read(reinterpret_cast<char*>(prefix), file_size < 8 ? static_cast<std::streamsize>(file_size) : 8);
  const std::uint64_t n = parse_header_length(prefix, file_size, source);
  std::string text(static_cast<std::size_t>(n), '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != n)
    fail_format(source, "the file ended while reading the header");
  return parse_header_json(text, 8 + n, file_size - 8 - n, source);
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_SAFETENSORS_FORMAT_HPP
