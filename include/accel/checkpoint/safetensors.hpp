// SPDX-License-Identifier: Apache-2.0
/// @file Defines save_safetensors / load_safetensors: LibTorch tensors to and
/// from the safetensors format, files written atomically and read through the
/// validating parser of detail/safetensors_format.hpp.
#ifndef ACCEL_CHECKPOINT_SAFETENSORS_HPP
#define ACCEL_CHECKPOINT_SAFETENSORS_HPP

#include <accel/checkpoint/detail/file_io.hpp>
#include <accel/checkpoint/detail/safetensors_format.hpp>
#include <accel/errors.hpp>

#include <torch/torch.h>

#include <bit>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::ckpt {

static_assert(std::endian::native == std::endian::little,
              "accel: safetensors I/O copies tensor bytes as they are in memory. Build for a "
              "little-endian target.");

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

/// Metadata key prefix of a tied (storage-sharing) tensor saved once:
/// "accel.tied.<alias>" -> "<name of the stored tensor>".
inline constexpr std::string_view kTiedPrefix = "accel.tied.";
/// Metadata key of the XXH64 (16 hex digits) of the data buffer, the bytes
/// after the header. Other safetensors readers ignore it; read_safetensors
/// checks it when present.
inline constexpr std::string_view kDataChecksumKey = "accel.data_xxh64";

/// Called with each tensor a save stores, in the order its bytes are read,
/// just before they are read: shard::ShardParameters makes the tensor's
/// bucket whole there, so a model is saved without being whole at once.
using BeforeRead = std::function<void(const torch::Tensor&)>;

/// Everything in one safetensors file: tensors (file order, then the tied
/// aliases, which share the tensor they alias) and the metadata.
struct SafetensorsContents {
  NamedTensors tensors;
  std::map<std::string, std::string> metadata;
};

namespace detail {

inline std::optional<std::string> to_safetensors_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat64: return "F64";
    case torch::kFloat32: return "F32";
    case torch::kFloat16: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kInt16: return "I16";
    case torch::kInt8: return "I8";
    case torch::kUInt8: return "U8";
    case torch::kBool: return "BOOL";
    default: return std::nullopt;
  }
}

inline std::optional<torch::ScalarType> to_torch_dtype(std::string_view d) {
  if (d == "F64") return torch::kFloat64;
  if (d == "F32") return torch::kFloat32;
  if (d == "F16") return torch::kFloat16;
  if (d == "BF16") return torch::kBFloat16;
  if (d == "I64") return torch::kInt64;
  if (d == "I32") return torch::kInt32;
  if (d == "I16") return torch::kInt16;
  if (d == "I8") return torch::kInt8;
  if (d == "U8") return torch::kUInt8;
  if (d == "BOOL") return torch::kBool;
  return std::nullopt;
}

/// True when a and b are the same view of the same storage (a tied weight),
/// which is what is saved once. Empty tensors never count: they own no bytes.
/// The storage's identity, not its address: under shard::ShardParameters a
/// parameter may have no memory behind it until it is read.
inline bool same_view(const torch::Tensor& a, const torch::Tensor& b) {
  return a.numel() > 0 && a.has_storage() && b.has_storage() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
         a.storage_offset() == b.storage_offset() && a.scalar_type() == b.scalar_type() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}

/// Per entry: the index of the earlier entry it is the same view of (stored
/// once, there), or the entry's own index.
inline std::vector<std::size_t> stored_as(const NamedTensors& tensors) {
  std::vector<std::size_t> out(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    out[i] = i;
    for (std::size_t j = 0; j < i; ++j)
      if (out[j] == j && same_view(tensors[j].second, tensors[i].second)) {
        out[i] = j;
        break;
      }
  }
  return out;
}

}  // namespace detail

/// Writes `tensors` to `path` in the safetensors format, atomically (temporary
/// file in the same directory, fsync, rename). Tensors are written from CPU
/// and contiguous, in the given order. Entries that are the same view of the
/// same memory as an earlier entry are stored once and recorded in metadata
/// under kTiedPrefix, so load_safetensors returns one shared tensor for both.
/// metadata gets "format": "pt" unless it sets "format" itself. With
/// `checksum`, metadata gets kDataChecksumKey, computed as the data is written.
/// Each tensor is copied to CPU just before it is written: a GPU model costs
/// host memory for one tensor at a time, not for all of them. before_read,
/// when given, runs for each stored tensor just before that copy.
/// Returns the XXH64 of the data buffer.
inline std::uint64_t save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                                      const std::map<std::string, std::string>& metadata = {},
                                      bool checksum = true, const BeforeRead& before_read = {}) {
  const std::string source = path.string();
  nlohmann::json header = nlohmann::json::object();
  nlohmann::json meta = nlohmann::json::object();
  meta["format"] = "pt";
  for (const auto& [k, v] : metadata) {
    ACCEL_CHECK(k.rfind(kTiedPrefix, 0) != 0 && k != kDataChecksumKey, "accel: metadata key '", k,
                "' for '", source, "' is reserved by accel (", kTiedPrefix, "*, ",
                kDataChecksumKey, "). Rename the key.");
    meta[k] = v;
  }

  std::set<std::string> names;
  std::vector<const torch::Tensor*> stored;  // in file order
  const auto stored_index = detail::stored_as(tensors);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& entry = tensors[i];
    // Named references, not a structured binding: lambdas below capture them
    // (clang 14 cannot capture structured bindings).
    const std::string& name = entry.first;
    const torch::Tensor& tensor = entry.second;
    ACCEL_CHECK(name != ckpt::detail::kMetadataKey, "accel: cannot save a tensor named '",
                name, "' to '", source, "': the name is reserved by the format. Rename it.");
    ACCEL_CHECK(names.insert(name).second, "accel: the tensor name '", name,
                "' appears twice in what is saved to '", source, "'. Give each tensor one name.");
    ACCEL_CHECK(tensor.defined(), "accel: tensor '", name, "' saved to '", source,
                "' is undefined. Leave it out or initialise it.");
    ACCEL_CHECK(tensor.layout() == torch::kStrided, "accel: tensor '", name, "' saved to '",
                source, "' is not dense (layout ", tensor.layout(),
                "). Convert it with to_dense() first.");
    const auto dtype = detail::to_safetensors_dtype(tensor.scalar_type());
    ACCEL_CHECK(dtype.has_value(), "accel: tensor '", name, "' saved to '", source,
                "' has dtype ", tensor.scalar_type(),
                ", which safetensors cannot hold here. Convert it to one of float64, float32, "
                "float16, bfloat16, int64, int32, int16, int8, uint8, bool.");
    if (stored_index[i] != i) {
      meta[std::string(kTiedPrefix) + name] = tensors[stored_index[i]].first;
      continue;
    }
    const auto bytes = static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
    header[name] = {{"dtype", *dtype},
                    {"shape", tensor.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    stored.push_back(&tensor);
  }
  // A placeholder of the digest's width, filled in once the data is written.
  const std::string placeholder(16, '0');
  if (checksum) meta[std::string(kDataChecksumKey)] = placeholder;
  header[std::string(ckpt::detail::kMetadataKey)] = std::move(meta);

  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // data starts 8-aligned, as Hugging Face writes it
  unsigned char prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<unsigned char>(text.size() >> (8 * i));

  ckpt::detail::AtomicFile file(path);
  file.write(prefix, sizeof prefix);
  file.write(text.data(), text.size());
  ckpt::detail::Xxh64 data_hash;
  for (const torch::Tensor* tensor : stored) {
    if (before_read) before_read(*tensor);
    const torch::Tensor t = tensor->detach().to(torch::kCPU).contiguous();
    const auto bytes = static_cast<std::size_t>(t.numel()) * t.element_size();
    data_hash.update(t.data_ptr(), bytes);
    file.write(t.data_ptr(), bytes);
  }
  if (checksum) {
    // Keys are JSON strings, so `"key":"` with bare quotes is the entry itself.
    const std::string field = "\"" + std::string(kDataChecksumKey) + "\":\"" + placeholder;
    const auto at = text.find(field);
    ACCEL_CHECK(at != std::string::npos, "accel: internal error: no checksum field in the header of '",
                source, "'");
    const std::string digest = ckpt::detail::to_hex(data_hash.digest());
    file.write_at(sizeof prefix + at + field.size() - placeholder.size(), digest.data(), digest.size());
  }
  file.commit();
  return data_hash.digest();
}

/// Reads a safetensors file after validating its header (see
/// detail/safetensors_format.hpp). The tensors live on CPU and own their memory.
inline SafetensorsContents read_safetensors(const std::filesystem::path& path) {
  const std::string source = path.string();
  const auto header = ckpt::detail::read_safetensors_header(path);
  ckpt::detail::ReadFile file(path);
  SafetensorsContents out;
  out.metadata = header.metadata;
  std::optional<std::uint64_t> expected;
  if (const auto it = header.metadata.find(std::string(kDataChecksumKey)); it != header.metadata.end()) {
    expected = ckpt::detail::from_hex(it->second);
    if (!expected)
      ckpt::detail::fail_format(source, "its " + std::string(kDataChecksumKey) +
                                                  " entry is not 16 hex digits");
  }
  ckpt::detail::Xxh64 data_hash;  // the tensors cover the data buffer in order
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& info : header.tensors) {
    const auto dtype = detail::to_torch_dtype(info.dtype);
    ACCEL_CHECK(dtype.has_value(), "accel: tensor '", info.name, "' in '", source,
                "' has dtype ", info.dtype,
                ", which LibTorch 1.13 has no type for. Convert it before saving.");
    torch::Tensor t;
    try {
      t = torch::empty(info.shape, torch::TensorOptions().dtype(*dtype));
    } catch (const c10::Error&) {  // e.g. an empty shape whose strides overflow
      ckpt::detail::fail_format(source, "tensor '" + info.name +
                                                  "' has a shape LibTorch cannot allocate");
    }
    file.read_at(header.data_start + info.begin, t.data_ptr(),
                 static_cast<std::size_t>(info.end - info.begin));
    data_hash.update(t.data_ptr(), static_cast<std::size_t>(info.end - info.begin));
    if (*dtype == torch::kBool) {
      // Any byte other than 0/1 in a bool tensor is undefined behaviour in ATen.
      const auto* b = static_cast<const std::uint8_t*>(t.data_ptr());
      for (std::uint64_t i = 0; i < info.end - info.begin; ++i)
        if (b[i] > 1)
          ckpt::detail::fail_format(source, "BOOL tensor '" + info.name +
                                                      "' holds a byte other than 0 or 1");
    }
    by_name.emplace(info.name, t);
    out.tensors.emplace_back(info.name, std::move(t));
  }
  if (expected && data_hash.digest() != *expected)
    throw Error(accel::detail::concat(
        "accel: the safetensors file '", source, "' is corrupt: its tensor data changed after it "
        "was written (XXH64 ", ckpt::detail::to_hex(data_hash.digest()), ", its header records ",
        ckpt::detail::to_hex(*expected), "). Load another copy, or write it again."));
  for (const auto& [key, target] : header.metadata) {
    if (key.rfind(kTiedPrefix, 0) != 0) continue;
    const std::string alias = key.substr(kTiedPrefix.size());
    const auto it = by_name.find(target);
    if (it == by_name.end())
      ckpt::detail::fail_format(source, "tied tensor '" + alias + "' refers to '" + target +
                                                  "', which is not in the file");
    if (by_name.count(alias) != 0)
      ckpt::detail::fail_format(source, "tied tensor '" + alias +
                                                  "' is also stored as a tensor");
    out.tensors.emplace_back(alias, it->second);
  }
  return out;
}

/// The tensors of a safetensors file, tied names sharing one tensor.
inline NamedTensors load_safetensors(const std::filesystem::path& path) {
  return read_safetensors(path).tensors;
}

}  // namespace accel::ckpt

#endif  // ACCEL_CHECKPOINT_SAFETENSORS_HPP
