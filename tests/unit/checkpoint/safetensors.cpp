// Tests of the safetensors reader/writer: round trips, the exact byte layout,
// every corrupt-input case and interoperability with an independent Python
// reader/writer (safetensors_reference.py, struct + json only).
#include <accel/checkpoint/safetensors.hpp>

#include "catch.hpp"
#include "paths.hpp"
#include "xxhsum.hpp"
#include <torch/torch.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>

namespace fs = std::filesystem;
using accel::ckpt::load_safetensors;
using accel::ckpt::NamedTensors;
using accel::ckpt::save_safetensors;

namespace {

fs::path scratch(const std::string& name) { return accel_test::scratch("safetensors", name); }

fs::path source_dir() { return accel_test::source_dir() / "unit" / "checkpoint"; }

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string le64(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

/// A file with the given header text and data (header length from the text).
fs::path write_raw(const std::string& name, const std::string& header, const std::string& data) {
  const fs::path p = scratch(name);
  std::ofstream(p, std::ios::binary) << le64(header.size()) << header << data;
  return p;
}

/// Loading p must throw accel::Error naming the file and containing `needle`.
void require_rejected(const fs::path& p, const std::string& needle) {
  INFO("file " << p << ", expecting: " << needle);
  try {
    load_safetensors(p);
    FAIL("no error");
  } catch (const accel::Error& e) {
    const std::string what = e.what();
    INFO("message: " << what);
    CHECK(what.rfind("accel: ", 0) == 0);
    CHECK(what.find(p.string()) != std::string::npos);
    CHECK(what.find(needle) != std::string::npos);
  }
}

const std::string k8(8, '\0');  // 8 data bytes

}  // namespace

TEST_CASE("safetensors round-trips every supported dtype", "[checkpoint][safetensors]") {
  torch::manual_seed(0);
  const auto r = torch::randn({3, 4}, torch::kFloat64);
  NamedTensors in{
      {"f64", r},
      {"f32", r.to(torch::kFloat32).t()},  // not contiguous: written contiguous
      {"f16", r.to(torch::kFloat16)},
      {"bf16", r.to(torch::kBFloat16)},
      {"i64", torch::randint(-(int64_t{1} << 40), int64_t{1} << 40, {5}, torch::kInt64)},
      {"i32", torch::randint(-100000, 100000, {2, 2}, torch::kInt32)},
      {"i16", torch::randint(-30000, 30000, {7}, torch::kInt16)},
      {"i8", torch::randint(-128, 127, {2, 3, 1}, torch::kInt8)},
      {"u8", torch::randint(0, 255, {4}, torch::kUInt8)},
      {"bool", torch::rand({6}) > 0.5},
      {"scalar", torch::tensor(3.25)},
      {"empty", torch::empty({0, 5})},
      {"slice", r.index({torch::indexing::Slice(1, 3)})},  // view with a storage offset
  };
  const fs::path p = scratch("all_dtypes.safetensors");
  save_safetensors(p, in, {{"note", "round trip"}});
  const auto contents = accel::ckpt::read_safetensors(p);
  CHECK(contents.metadata.at("format") == "pt");
  CHECK(contents.metadata.at("note") == "round trip");
  const NamedTensors& out = contents.tensors;
  REQUIRE(out.size() == in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    INFO(in[i].first);
    CHECK(out[i].first == in[i].first);  // file order = the order given
    CHECK(out[i].second.scalar_type() == in[i].second.scalar_type());
    CHECK(out[i].second.sizes() == in[i].second.sizes());
    CHECK(out[i].second.device().is_cpu());
    CHECK(torch::equal(out[i].second, in[i].second));
  }
  // Loaded tensors own their memory: no two share bytes.
  CHECK(out[0].second.data_ptr() != out[2].second.data_ptr());
  // The file is complete and no temporary file is left behind.
  std::size_t leftovers = 0;
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    leftovers += e.path().filename().string().find(".tmp.") != std::string::npos;
  CHECK(leftovers == 0);
}

TEST_CASE("safetensors writes the exact Hugging Face byte layout", "[checkpoint][safetensors]") {
  const fs::path p = scratch("layout.safetensors");
  save_safetensors(p, {{"x", torch::tensor({1.0f, 2.0f})}}, {}, /*checksum=*/false);
  // Hand-computed: 85 bytes of JSON (keys sorted), padded with 3 spaces to 88
  // = 0x58 so the data starts 8-aligned, then 1.0f and 2.0f little-endian.
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"x":{"data_offsets":[0,8],"dtype":"F32","shape":[2]}})";
  REQUIRE(json.size() == 85);
  const std::string expected = std::string("\x58\0\0\0\0\0\0\0", 8) + json + "   " +
                               std::string("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);
  CHECK(read_bytes(p) == expected);
}

TEST_CASE("safetensors records the XXH64 of its data, and a flipped bit is an error",
          "[checkpoint][safetensors][checksum]") {
  const fs::path p = scratch("checksum.safetensors");
  torch::manual_seed(3);
  const auto w = torch::randn({64, 33});
  const auto digest = save_safetensors(p, {{"w", w}, {"b", torch::arange(5)}}, {{"k", "v"}});
  const auto header = accel::ckpt::detail::read_safetensors_header(p);
  // The header keeps Hugging Face's layout, one more metadata string.
  CHECK(header.metadata.at("format") == "pt");
  CHECK(header.metadata.at("accel.data_xxh64") == accel::ckpt::detail::to_hex(digest));
  CHECK(header.metadata.at("accel.data_xxh64") == accel_test::xxhsum(p, header.data_start));
  CHECK(torch::equal(load_safetensors(p).at(0).second, w));

  std::string bytes = read_bytes(p);
  bytes[header.data_start + header.data_size / 2] ^= 0x10;  // one bit in the middle of w
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  require_rejected(p, "is corrupt: its tensor data changed after it was written");

  // Without the entry (files of other writers) the same bytes load unchecked.
  const fs::path plain = scratch("no_checksum.safetensors");
  save_safetensors(plain, {{"w", w}}, {}, /*checksum=*/false);
  CHECK(accel::ckpt::detail::read_safetensors_header(plain).metadata.count("accel.data_xxh64") == 0);
  CHECK(torch::equal(load_safetensors(plain).at(0).second, w));
}

TEST_CASE("safetensors saves storage-sharing tensors once", "[checkpoint][safetensors]") {
  const auto w = torch::arange(6, torch::kFloat32).reshape({2, 3});
  const fs::path p = scratch("tied.safetensors");
  save_safetensors(p, {{"a", w}, {"b", w}, {"c", w.clone()}});
  const auto header = accel::ckpt::detail::read_safetensors_header(p);
  REQUIRE(header.tensors.size() == 2);  // a and c stored; b recorded as tied to a
  CHECK(header.metadata.at("accel.tied.b") == "a");
  CHECK(header.data_size == 2 * 6 * 4);
  const auto out = load_safetensors(p);
  REQUIRE(out.size() == 3);
  CHECK(out[2].first == "b");
  CHECK(out[2].second.data_ptr() == out[0].second.data_ptr());
  CHECK(out[1].second.data_ptr() != out[0].second.data_ptr());
  CHECK(torch::equal(out[2].second, w));
}

TEST_CASE("safetensors writer rejects what the format cannot hold", "[checkpoint][safetensors]") {
  const fs::path p = scratch("bad_write.safetensors");
  const auto t = torch::ones({2});
  CHECK_THROWS_WITH(save_safetensors(p, {{"a", t}, {"a", t}}),
                    Catch::Matchers::ContainsSubstring("appears twice"));
  CHECK_THROWS_WITH(save_safetensors(p, {{"__metadata__", t}}), Catch::Matchers::ContainsSubstring("reserved"));
  CHECK_THROWS_WITH(save_safetensors(p, {{"c", torch::ones({2}, torch::kComplexFloat)}}),
                    Catch::Matchers::ContainsSubstring("cannot hold"));
  CHECK_THROWS_WITH(save_safetensors(p, {{"u", torch::Tensor()}}), Catch::Matchers::ContainsSubstring("undefined"));
  CHECK_THROWS_WITH(save_safetensors(p, {{"a", t}}, {{"accel.tied.x", "a"}}),
                    Catch::Matchers::ContainsSubstring("is reserved by accel"));
  CHECK_THROWS_WITH(save_safetensors(p, {{"a", t}}, {{"accel.data_xxh64", "0"}}),
                    Catch::Matchers::ContainsSubstring("is reserved by accel"));
  CHECK_FALSE(fs::exists(p));
  CHECK_THROWS_WITH(save_safetensors(scratch("no/such/dir/x.safetensors"), {{"a", t}}),
                    Catch::Matchers::StartsWith("accel: cannot create a temporary file"));
}

TEST_CASE("safetensors reader rejects corrupt files with a specific message",
          "[checkpoint][safetensors]") {
  const std::string good = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  SECTION("valid control") {
    const auto out = load_safetensors(write_raw("ok.safetensors", good, k8));
    REQUIRE(out.size() == 1);
    CHECK(out[0].second.sizes() == torch::IntArrayRef{2});
  }
  SECTION("truncated below the length prefix") {
    const fs::path p = scratch("short.safetensors");
    std::ofstream(p, std::ios::binary) << std::string("\x10\0\0", 3);
    require_rejected(p, "the file has 3 bytes, fewer than the 8-byte header length");
  }
  SECTION("header length past the end of the file") {
    const fs::path p = scratch("past_end.safetensors");
    std::ofstream(p, std::ios::binary) << le64(1000) << good;
    require_rejected(p, "the header length 1000 runs past the end of the file");
  }
  SECTION("header of gigabytes is refused before allocating") {
    const fs::path p = scratch("huge_header.safetensors");
    std::ofstream(p, std::ios::binary) << le64(std::uint64_t{5} << 30) << good;
    require_rejected(p, "the header length 5368709120 exceeds the limit of 100000000 bytes");
  }
  SECTION("invalid JSON") {
    require_rejected(write_raw("json.safetensors", R"({"w":{"dtype":)", ""),
                     "the header is not valid JSON");
  }
  SECTION("header not an object") {
    require_rejected(write_raw("array.safetensors", "[1,2]", ""), "the header is not a JSON object");
  }
  SECTION("missing field") {
    require_rejected(write_raw("field.safetensors", R"({"w":{"shape":[2],"data_offsets":[0,8]}})", k8),
                     "tensor 'w' has no \"dtype\" field");
  }
  SECTION("overlapping offsets") {
    require_rejected(
        write_raw("overlap.safetensors",
                  R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                  std::string(12, '\0')),
        "tensors 'a' and 'b' have overlapping data_offsets");
  }
  SECTION("reversed offsets") {
    require_rejected(
        write_raw("reversed.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", k8),
        "tensor 'w' has reversed data_offsets [8, 0]");
  }
  SECTION("offsets leaving the data buffer") {
    require_rejected(
        write_raw("leave.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234"),
        "tensor 'w' has data_offsets [0, 8] that leave the data buffer (4 bytes)");
  }
  SECTION("hole in the data buffer") {
    require_rejected(
        write_raw("hole.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", k8),
        "bytes [0, 4) of the data buffer belong to no tensor");
  }
  SECTION("bytes after the last tensor") {
    require_rejected(
        write_raw("tail.safetensors", R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", k8),
        "the data buffer has 4 bytes after the last tensor");
  }
  SECTION("unknown dtype") {
    require_rejected(
        write_raw("dtype.safetensors", R"({"w":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})", k8),
        "tensor 'w' has unknown dtype 'F33'");
  }
  SECTION("dtype the format knows but LibTorch 1.13 does not") {
    require_rejected(
        write_raw("u16.safetensors", R"({"w":{"dtype":"U16","shape":[4],"data_offsets":[0,8]}})", k8),
        "has dtype U16, which LibTorch 1.13 has no type for");
  }
  SECTION("shape that does not match the byte count") {
    require_rejected(
        write_raw("shape.safetensors", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", k8),
        "tensor 'w' has shape [3] and dtype F32, which need 12 bytes, but its data_offsets span 8 bytes");
  }
  SECTION("negative dimension") {
    require_rejected(
        write_raw("negative.safetensors", R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", k8),
        "tensor 'w': a shape dimension is -2, not a non-negative integer");
  }
  SECTION("dimension larger than int64") {
    require_rejected(write_raw("bigdim.safetensors",
                               R"({"w":{"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,8]}})", k8),
                     "has shape dimension 9223372036854775808, larger than a tensor can have");
  }
  SECTION("element count overflowing 64 bits") {
    require_rejected(write_raw("overflow.safetensors",
                               R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", k8),
                     "whose byte size overflows 64 bits");
    // 2^62 elements of 4 bytes: the count fits, the byte size does not.
    require_rejected(write_raw("overflow2.safetensors",
                               R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]}})", k8),
                     "whose byte size overflows 64 bits");
  }
  SECTION("zero dimension next to huge ones") {
    // Valid for the format (0 bytes), but no tensor can have these strides.
    namespace d = accel::ckpt::detail;
    const std::string header =
        R"({"w":{"dtype":"F32","shape":[0,9223372036854775807,9223372036854775807],"data_offsets":[0,0]}})";
    const std::string file = le64(header.size()) + header;
    CHECK(d::parse_safetensors(file.data(), file.size(), "zero").tensors.at(0).end == 0);
    const fs::path p = write_raw("zero_huge.safetensors", header, "");
    try {
      const auto out = load_safetensors(p);
      CHECK(out.at(0).second.numel() == 0);
    } catch (const accel::Error& e) {
      CHECK_THAT(e.what(), Catch::Matchers::ContainsSubstring("has a shape LibTorch cannot allocate"));
    }
  }
  SECTION("duplicate tensor names") {
    require_rejected(write_raw("dup.safetensors",
                               R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", k8),
                     "the tensor name 'w' appears twice in the header");
  }
  SECTION("non-string metadata") {
    require_rejected(write_raw("meta.safetensors", R"({"__metadata__":{"k":1}})", ""),
                     "__metadata__ value of 'k' is not a string");
  }
  SECTION("hostile nesting") {
    require_rejected(write_raw("nest.safetensors", std::string(50, '[') + std::string(50, ']'), ""),
                     "the header nests deeper than 8 levels");
  }
  SECTION("bool bytes other than 0/1") {
    require_rejected(write_raw("bool.safetensors", R"({"b":{"dtype":"BOOL","shape":[2],"data_offsets":[0,2]}})",
                               std::string("\x01\x02", 2)),
                     "BOOL tensor 'b' holds a byte other than 0 or 1");
  }
  SECTION("tied alias pointing nowhere") {
    require_rejected(write_raw("alias.safetensors", R"({"__metadata__":{"accel.tied.x":"nope"}})", ""),
                     "tied tensor 'x' refers to 'nope', which is not in the file");
  }
  SECTION("missing file") {
    CHECK_THROWS_WITH(load_safetensors(scratch("does_not_exist.safetensors")),
                      Catch::Matchers::ContainsSubstring("does not exist"));
  }
}

TEST_CASE("safetensors validator works on buffers", "[checkpoint][safetensors]") {
  namespace d = accel::ckpt::detail;
  const std::string file = le64(8) + R"({}     )" + " ";
  const auto h = d::parse_safetensors(file.data(), file.size(), "buffer");
  CHECK(h.tensors.empty());
  CHECK(h.data_start == 16);
  CHECK(h.data_size == 0);
  // Every strict prefix of a valid file is rejected, never read past.
  const std::string valid = read_bytes(source_dir() / "data" / "reference.safetensors");
  REQUIRE(valid.size() > 100);
  for (std::size_t n = 0; n < valid.size(); ++n)
    CHECK_THROWS_AS(d::parse_safetensors(valid.data(), n, "prefix"), accel::Error);
  CHECK(d::parse_safetensors(valid.data(), valid.size(), "whole").tensors.size() == 12);
}

TEST_CASE("safetensors reads a file written by an independent Python writer",
          "[checkpoint][safetensors][interop]") {
  const auto contents = accel::ckpt::read_safetensors(source_dir() / "data" / "reference.safetensors");
  CHECK(contents.metadata.at("writer") == "python struct");
  std::map<std::string, torch::Tensor> t(contents.tensors.begin(), contents.tensors.end());
  REQUIRE(t.size() == 12);
  CHECK(torch::equal(t["f64"], torch::tensor({1.5, -2.25}, torch::kFloat64)));
  CHECK(torch::equal(t["f32"], torch::tensor({0.0f, 1.0f, -3.5f, 1e-3f}).reshape({2, 2})));
  CHECK(torch::equal(t["f16"], torch::tensor({0.5, -1.0, 65504.0}).to(torch::kFloat16)));
  CHECK(torch::equal(t["bf16"], torch::tensor({1.0, -0.5}).to(torch::kBFloat16)));
  CHECK(torch::equal(t["i64"], torch::tensor({-(int64_t{1} << 40), int64_t{7}}, torch::kInt64)));
  CHECK(torch::equal(t["i32"], torch::tensor({-5, 2147483647}, torch::kInt32).reshape({1, 2})));
  CHECK(torch::equal(t["i16"], torch::tensor({-32768, 123}, torch::kInt16)));
  CHECK(torch::equal(t["i8"], torch::tensor({-128, 0, 127}, torch::kInt8)));
  CHECK(torch::equal(t["u8"], torch::tensor({0, 255}, torch::kUInt8)));
  CHECK(torch::equal(t["bool"], torch::tensor({true, false, true})));
  CHECK(t["scalar"].dim() == 0);
  CHECK(t["scalar"].item<float>() == 42.0f);
  CHECK(t["empty"].sizes() == torch::IntArrayRef{0, 3});
}

TEST_CASE("an independent Python reader agrees with accel's file",
          "[checkpoint][safetensors][interop]") {
  const char* python = "/usr/bin/python3";
  if (!fs::exists(python)) {
    ACCEL_TEST_SKIP(python << " not found");
  }
  const auto a = torch::arange(6, torch::kFloat32).reshape({2, 3});
  const fs::path p = scratch("for_python.safetensors");
  save_safetensors(p,
                   {{"a", a},
                    {"b", torch::tensor({int64_t{-1}, int64_t{1} << 40})},
                    {"c", torch::tensor({1.0, -0.5}).to(torch::kBFloat16)},
                    {"t", a}},
                   {{"k", "v"}});
  const std::string cmd = std::string(python) + " " +
                          (source_dir() / "safetensors_reference.py").string() + " check " +
                          p.string();
  CHECK(std::system(cmd.c_str()) == 0);
}
