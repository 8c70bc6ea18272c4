// SPDX-License-Identifier: Apache-2.0
/// @file Defines the TensorBoard event-file encoding: CRC32C, TFRecord framing
/// and a hand-written encoder for the few tf.Event protobuf fields accel writes
/// (no protobuf dependency: Debian has no TensorBoard to pull it in with).
#ifndef ACCEL_TRACKING_DETAIL_TFEVENTS_HPP
#define ACCEL_TRACKING_DETAIL_TFEVENTS_HPP

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accel::tracking::detail {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
inline uint32_t crc32c(std::string_view data) {
  static const auto table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1U) ? (c >> 1) ^ 0x82F63B78U : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  uint32_t crc = 0xFFFFFFFFU;
  for (unsigned char b : data) crc = table[(crc ^ b) & 0xFFU] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFFU;
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant, so that a CRC
/// of data containing CRCs stays well distributed.
inline uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8U;
}

inline void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFFU));
}

/// One TFRecord: uint64 length, masked CRC of the length, data, masked CRC of data.
inline std::string tfrecord(std::string_view data) {
  std::string len;
  put_le(len, data.size(), 8);
  std::string out = len;
  put_le(out, masked_crc32c(len), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

// --- protobuf wire format (only what tf.Event needs) ---
inline void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
inline void put_tag(std::string& out, uint32_t field, uint32_t wire_type) {
  put_varint(out, (static_cast<uint64_t>(field) << 3) | wire_type);
}
inline void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_tag(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}
inline void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 1);
  put_le(out, bits, 8);
}
inline void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_tag(out, field, 5);
  put_le(out, bits, 4);
}

/// tf.Event{wall_time=1, step=2, file_version=3} for the file's first record.
inline std::string encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

/// tf.Event{wall_time=1, step=2, summary=5: Summary{value=1: Value{tag=1, simple_value=2}}}.
inline std::string encode_scalars_event(double wall_time, int64_t step,
                                        const std::vector<std::pair<std::string, float>>& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    put_bytes(v, 1, tag);
    put_float(v, 2, value);
    put_bytes(summary, 1, v);
  }
  std::string e;
  put_double(e, 1, wall_time);
  put_tag(e, 2, 0);
  put_varint(e, static_cast<uint64_t>(step));  // int64: two's complement, 10 bytes if negative
  put_bytes(e, 5, summary);
  return e;
}

}  // namespace accel::tracking::detail

#endif  // ACCEL_TRACKING_DETAIL_TFEVENTS_HPP
