// SPDX-License-Identifier: Apache-2.0
/// @file Defines XXH64 (Yann Collet's xxHash, 64-bit, seed 0), streaming: the
/// checksum of every checkpoint file, computed while the file is written. The
/// same digest as `xxhsum -H1 FILE` (Debian's xxhash package), so a user can
/// check a checkpoint by hand. Written from the published specification
/// (doc/xxhash_spec.md of the xxHash repository).
#ifndef ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP
#define ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace accel::ckpt::detail {

class Xxh64 {
 public:
  void update(const void* data, std::size_t size) {
    const auto* p = static_cast<const unsigned char*>(data);
    total_ += size;
    if (buffered_ + size < kStripe) {  // not a whole stripe yet
      std::memcpy(buffer_ + buffered_, p, size);
      buffered_ += size;
      return;
    }
    if (buffered_ > 0) {  // complete the buffered stripe
      const std::size_t fill = kStripe - buffered_;
      std::memcpy(buffer_ + buffered_, p, fill);
      consume_stripe(buffer_);
      p += fill;
      size -= fill;
      buffered_ = 0;
    }
    for (; size >= kStripe; p += kStripe, size -= kStripe) consume_stripe(p);
    std::memcpy(buffer_, p, size);
    buffered_ = size;
  }
  void update(std::string_view text) { update(text.data(), text.size()); }

  /// The digest of everything given so far (the state is left as it is).
  std::uint64_t digest() const {
    std::uint64_t acc;
    if (total_ >= kStripe) {
      acc = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
      for (std::uint64_t v : v_) acc = (acc ^ round(0, v)) * kP1 + kP4;
    } else {
      acc = kP5;  // seed 0
    }
    acc += total_;
    const unsigned char* p = buffer_;
    std::size_t left = buffered_;
    for (; left >= 8; p += 8, left -= 8) acc = rotl(acc ^ round(0, read64(p)), 27) * kP1 + kP4;
    if (left >= 4) {
      acc = rotl(acc ^ (static_cast<std::uint64_t>(read32(p)) * kP1), 23) * kP2 + kP3;
      p += 4;
      left -= 4;
    }
    for (; left > 0; ++p, --left) acc = rotl(acc ^ (*p * kP5), 11) * kP1;
    acc ^= acc >> 33;
    acc *= kP2;
    acc ^= acc >> 29;
    acc *= kP3;
    acc ^= acc >> 32;
    return acc;
  }

 private:
  static constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  static constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr std::uint64_t kP3 = 0x165667B19E3779F9ULL;
  static constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ULL;
  static constexpr std::size_t kStripe = 32;

  static std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static std::uint64_t round(std::uint64_t acc, std::uint64_t lane) {
    return rotl(acc + lane * kP2, 31) * kP1;
  }
  // Little-endian loads (the format is defined on little-endian lanes).
  template <class U>
  static U read_le(const unsigned char* p) {
    U v;
    if constexpr (std::endian::native == std::endian::little) {
      std::memcpy(&v, p, sizeof v);
    } else {
      v = 0;
      for (int i = static_cast<int>(sizeof v) - 1; i >= 0; --i) v = static_cast<U>((v << 8) | p[i]);
    }
    return v;
  }
  static std::uint64_t read64(const unsigned char* p) { return read_le<std::uint64_t>(p); }
  static std::uint32_t read32(const unsigned char* p) { return read_le<std::uint32_t>(p); }
  void consume_stripe(const unsigned char* p) {
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
  }

  std::uint64_t v_[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  unsigned char buffer_[kStripe] = {};
  std::size_t buffered_ = 0;
  std::uint64_t total_ = 0;
};

/// 16 lowercase hex digits, as xxhsum prints them.
inline std::string to_hex(std::uint64_t v) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<std::size_t>(i)] = kDigits[v & 0xF];
  return s;
}

/// The value of 16 hex digits, or nullopt.
inline std::optional<std::uint64_t> from_hex(std::string_view s) {
  if (s.size() != 16) return std::nullopt;
  std::uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return std::nullopt;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  return v;
}

}  // namespace accel::ckpt::detail

#endif  // ACCEL_CHECKPOINT_DETAIL_XXHASH64_HPP
