// Tests of save_module/load_module: the file side of Accelerator::save_model
// (sizes as Accelerate parses them, Hugging Face shard names and index, tied
// weights, stale shards, and loads that fail without touching the module).
#include <accel/checkpoint/save_model.hpp>

#include "catch.hpp"
#include "paths.hpp"
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fs = std::filesystem;
using accel::SaveModelOptions;
using accel::ckpt::load_module;
using accel::ckpt::parse_size;
using accel::ckpt::save_module;

namespace {

fs::path fresh_dir(const std::string& name) { return accel_test::fresh_dir("save_model", name); }

std::set<std::string> files_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

/// 0: Linear(4,3)  1: BatchNorm1d(3)  2: Linear(3,2); 148 bytes of state.
torch::nn::Sequential make_net(int seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3), torch::nn::Linear(3, 2));
  net->train();
  net->forward(torch::randn({8, 4}));  // moves the running stats away from their defaults
  return net;
}

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& [k, t] : accel::ckpt::module_state(m)) out.push_back(t.clone());
  return out;
}

bool same_state(const torch::nn::Module& a, const torch::nn::Module& b) {
  const auto sa = accel::ckpt::module_state(a), sb = accel::ckpt::module_state(b);
  if (sa.size() != sb.size()) return false;
  for (std::size_t i = 0; i < sa.size(); ++i)
    if (sa[i].first != sb[i].first || !torch::equal(sa[i].second, sb[i].second)) return false;
  return true;
}

bool unchanged(const torch::nn::Module& m, const std::vector<torch::Tensor>& before) {
  const auto now = accel::ckpt::module_state(m);
  for (std::size_t i = 0; i < now.size(); ++i)
    if (!torch::equal(now[i].second, before[i])) return false;
  return now.size() == before.size();
}

struct Embed : torch::nn::Module {
  torch::Tensor weight;
  Embed() { weight = register_parameter("weight", torch::randn({10, 4})); }
};
struct Decoder : torch::nn::Module {
  torch::Tensor weight, bias;
  explicit Decoder(torch::Tensor tied) {
    weight = register_parameter("weight", std::move(tied));  // the embedding's own tensor
    bias = register_parameter("bias", torch::randn({10}));
  }
};
/// A language-model head whose decoder weight is the embedding (tied weights).
struct TiedNet : torch::nn::Module {
  std::shared_ptr<Embed> embed;
  std::shared_ptr<Decoder> decoder;
  explicit TiedNet(int seed) {
    torch::manual_seed(seed);
    embed = register_module("embed", std::make_shared<Embed>());
    decoder = register_module("decoder", std::make_shared<Decoder>(embed->weight));
  }
};

}  // namespace

TEST_CASE("max_shard_size is parsed as Accelerate parses it", "[checkpoint][save_model]") {
  CHECK(parse_size("10GB") == 10'000'000'000ull);
  CHECK(parse_size("1.5GB") == 1'500'000'000ull);
  CHECK(parse_size("500MB") == 500'000'000ull);
  CHECK(parse_size("100KB") == 100'000ull);
  CHECK(parse_size("2GiB") == 2ull << 30);
  CHECK(parse_size("64mib") == 64ull << 20);
  CHECK(parse_size("1KiB") == 1024);
  CHECK(parse_size("80Mb") == 10'000'000ull);  // lowercase b: bits
  CHECK(parse_size("1000") == 1000);
  CHECK(parse_size(" 3 MB ") == 3'000'000ull);
  for (const char* bad : {"", "GB", "abc", "-1GB", "1e9", "1.5", "10 TB", "1.2.3MB", "inf"}) {
    INFO(bad);
    CHECK_THROWS_WITH(parse_size(bad), Catch::Matchers::StartsWith(std::string("accel: max_shard_size '") + bad +
                                                         "' is not a size"));
  }
  CHECK_THROWS_WITH(parse_size("0"), Catch::Matchers::ContainsSubstring("is zero"));
  CHECK_THROWS_WITH(parse_size("99999999999GB"), Catch::Matchers::ContainsSubstring("is too large"));
  CHECK(SaveModelOptions{}.max_shard_size == "10GB");
}

TEST_CASE("save_module writes one model.safetensors with the module's own keys",
          "[checkpoint][save_model]") {
  auto net = make_net(1);
  const fs::path dir = fresh_dir("single");
  save_module(*net, dir);
  CHECK(files_in(dir) == std::set<std::string>{"model.safetensors"});
  std::vector<std::string> keys;
  for (const auto& [k, t] : accel::ckpt::load_safetensors(dir / "model.safetensors")) keys.push_back(k);
  // state_dict order: each module's parameters, then its buffers.
  CHECK(keys == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                         "1.running_var", "1.num_batches_tracked", "2.weight", "2.bias"});

  auto other = make_net(2);
  REQUIRE_FALSE(same_state(*net, *other));
  load_module(*other, dir);
  CHECK(same_state(*net, *other));
  auto third = make_net(3);
  load_module(*third, dir / "model.safetensors");  // a file works as well as a directory
  CHECK(same_state(*net, *third));
}

TEST_CASE("save_module shards greedily with Hugging Face names and index",
          "[checkpoint][save_model]") {
  auto net = make_net(4);
  const fs::path dir = fresh_dir("sharded");
  // Bytes in key order: 48 12 | 12 12 12 12 8 | 24 8. Limit 50:
  // [0.weight] [0.bias 1.weight 1.bias 1.running_mean] [1.running_var 1.num_batches_tracked 2.weight] [2.bias]
  save_module(*net, dir, {"50"});
  const std::string s1 = "model-00001-of-00004.safetensors", s2 = "model-00002-of-00004.safetensors",
                    s3 = "model-00003-of-00004.safetensors", s4 = "model-00004-of-00004.safetensors";
  CHECK(files_in(dir) == std::set<std::string>{s1, s2, s3, s4, "model.safetensors.index.json"});
  const std::string expected_index = R"({
  "metadata": {
    "accel_save_id": "SAVE_ID",
    "total_size": 148
  },
  "weight_map": {
    "0.bias": "model-00002-of-00004.safetensors",
    "0.weight": "model-00001-of-00004.safetensors",
    "1.bias": "model-00002-of-00004.safetensors",
    "1.num_batches_tracked": "model-00003-of-00004.safetensors",
    "1.running_mean": "model-00002-of-00004.safetensors",
    "1.running_var": "model-00003-of-00004.safetensors",
    "1.weight": "model-00002-of-00004.safetensors",
    "2.bias": "model-00004-of-00004.safetensors",
    "2.weight": "model-00003-of-00004.safetensors"
  }
}
)";
  // The save id (16 hex digits, random per save) is in every shard too.
  auto index_text = read_text(dir / "model.safetensors.index.json");
  const auto id_at = index_text.find("\"accel_save_id\": \"") + 18;
  const std::string save_id = index_text.substr(id_at, 16);
  CHECK(save_id.find_first_not_of("0123456789abcdef") == std::string::npos);
  index_text.replace(id_at, 16, "SAVE_ID");
  CHECK(index_text == expected_index);
  for (const auto& s : {s1, s2, s3, s4})
    CHECK(accel::ckpt::detail::read_safetensors_header(dir / s).metadata.at("accel_save_id") == save_id);
  CHECK(accel::ckpt::load_safetensors(dir / s3).size() == 3);
  // Every shard records its data's checksum (SaveModelOptions::checksum)...
  for (const auto& s : {s1, s2, s3, s4})
    CHECK(accel::ckpt::detail::read_safetensors_header(dir / s).metadata.count("accel.data_xxh64") == 1);
  // ...unless asked not to.
  const fs::path plain = fresh_dir("no_checksum");
  save_module(*net, plain, {.max_shard_size = "50", .checksum = false});
  CHECK(accel::ckpt::detail::read_safetensors_header(plain / s1).metadata.count("accel.data_xxh64") == 0);

  auto other = make_net(5);
  load_module(*other, dir);
  CHECK(same_state(*net, *other));
  auto third = make_net(6);
  load_module(*third, dir / "model.safetensors.index.json");
  CHECK(same_state(*net, *third));

  SECTION("a tensor larger than the limit gets a shard of its own") {
    const fs::path d2 = fresh_dir("oversized");
    save_module(*net, d2, {"40"});  // 0.weight (48 bytes) > 40
    const auto first = accel::ckpt::load_safetensors(d2 / "model-00001-of-00004.safetensors");
    REQUIRE(first.size() == 1);
    CHECK(first[0].first == "0.weight");
  }
  SECTION("a later save removes the stale shards of an earlier one") {
    std::ofstream(dir / "notes.txt") << "kept";
    save_module(*net, dir, {"100"});  // [48 12 12 12] [12 8 24 8]
    CHECK(files_in(dir) == std::set<std::string>{"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors",
                                                 "model.safetensors.index.json", "notes.txt"});
    save_module(*net, dir);
    CHECK(files_in(dir) == std::set<std::string>{"model.safetensors", "notes.txt"});
    auto again = make_net(7);
    load_module(*again, dir);
    CHECK(same_state(*net, *again));
  }
}

TEST_CASE("tied weights are saved once and restored shared", "[checkpoint][save_model]") {
  TiedNet net(8);
  REQUIRE(net.decoder->weight.data_ptr() == net.embed->weight.data_ptr());
  for (const char* limit : {"10GB", "100"}) {  // one file; embed+tie | decoder.bias
    INFO("max_shard_size " << limit);
    const fs::path dir = fresh_dir(std::string("tied_") + limit);
    save_module(net, dir, {limit});
    const auto loaded = accel::ckpt::load_checkpoint(dir);
    std::map<std::string, torch::Tensor> by_name(loaded.begin(), loaded.end());
    REQUIRE(by_name.size() == 3);
    CHECK(by_name["decoder.weight"].data_ptr() == by_name["embed.weight"].data_ptr());
    CHECK(torch::equal(by_name["embed.weight"], net.embed->weight));
    if (std::string(limit) == "100") {
      const std::string index = read_text(dir / "model.safetensors.index.json");
      CHECK(index.find("\"total_size\": 200") != std::string::npos);  // 160 + 40, the tie once
      CHECK(index.find("decoder.weight") == std::string::npos);
      const auto header = accel::ckpt::detail::read_safetensors_header(dir / "model-00001-of-00002.safetensors");
      CHECK(header.tensors.size() == 1);
      CHECK(header.metadata.at("accel.tied.decoder.weight") == "embed.weight");
    } else {
      const auto header = accel::ckpt::detail::read_safetensors_header(dir / "model.safetensors");
      CHECK(header.tensors.size() == 2);
      CHECK(header.data_size == 200);
    }
    TiedNet other(9);
    REQUIRE_FALSE(torch::equal(other.embed->weight, net.embed->weight));
    load_module(other, dir);
    CHECK(torch::equal(other.embed->weight, net.embed->weight));
    CHECK(torch::equal(other.decoder->bias, net.decoder->bias));
    CHECK(other.decoder->weight.data_ptr() == other.embed->weight.data_ptr());  // still one tensor
  }
}

TEST_CASE("load_module lists the offending keys and leaves the module untouched",
          "[checkpoint][save_model]") {
  torch::manual_seed(10);
  torch::nn::Sequential small(torch::nn::Linear(4, 3));
  const fs::path dir = fresh_dir("errors");
  save_module(*small, dir);

  SECTION("missing keys") {
    torch::nn::Sequential bigger(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    const auto before = snapshot(*bigger);
    CHECK_THROWS_WITH(load_module(*bigger, dir),
                      Catch::Matchers::StartsWith("accel: cannot load '" + dir.string() + "' into the module; "
                                        "missing keys [1.weight, 1.bias]. Nothing was loaded"));
    CHECK(unchanged(*bigger, before));  // 0.weight/0.bias matched but were not copied either
  }
  SECTION("unexpected keys") {
    torch::nn::Sequential two(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    const fs::path d2 = fresh_dir("errors_two");
    save_module(*two, d2);
    const auto before = snapshot(*small);
    CHECK_THROWS_WITH(load_module(*small, d2), Catch::Matchers::ContainsSubstring("; unexpected keys [1.weight, 1.bias]."));
    CHECK(unchanged(*small, before));
  }
  SECTION("shape and dtype mismatches") {
    torch::nn::Sequential wide(torch::nn::Linear(4, 5));
    const auto before = snapshot(*wide);
    CHECK_THROWS_WITH(load_module(*wide, dir),
                      Catch::Matchers::ContainsSubstring("; mismatched keys [0.weight (checkpoint Float[3, 4], module "
                                      "Float[5, 4]), 0.bias (checkpoint Float[3], module Float[5])]"));
    CHECK(unchanged(*wide, before));
    torch::nn::Sequential dbl(torch::nn::Linear(4, 3));
    dbl->to(torch::kFloat64);
    CHECK_THROWS_WITH(load_module(*dbl, dir),
                      Catch::Matchers::ContainsSubstring("0.weight (checkpoint Float[3, 4], module Double[3, 4])"));
  }
  SECTION("no checkpoint in the directory") {
    CHECK_THROWS_WITH(load_module(*small, fresh_dir("empty")),
                      Catch::Matchers::ContainsSubstring("holds neither model.safetensors nor model.safetensors.index.json"));
  }
  SECTION("an index that points outside its directory or at the wrong shard") {
    const fs::path d3 = fresh_dir("bad_index");
    std::ofstream(d3 / "model.safetensors.index.json") << R"({"weight_map":{"0.weight":"../model.safetensors"}})";
    CHECK_THROWS_WITH(load_module(*small, d3), Catch::Matchers::ContainsSubstring("is not a plain file name"));
    fs::copy_file(dir / "model.safetensors", d3 / "model-00001-of-00001.safetensors");
    std::ofstream(d3 / "model.safetensors.index.json")
        << R"({"weight_map":{"0.weight":"model-00001-of-00001.safetensors","0.bias":"other.safetensors"}})";
    CHECK_THROWS_WITH(load_module(*small, d3), Catch::Matchers::ContainsSubstring("other.safetensors"));
    std::ofstream(d3 / "model.safetensors.index.json") << "{not json";
    CHECK_THROWS_WITH(load_module(*small, d3), Catch::Matchers::ContainsSubstring("is not valid JSON"));
  }
}

// Issue 13 B12: save_model's shards and index form one set. A shard of
// another save is refused at load (not mixed in); a save that fails while
// writing leaves the previous set whole; staging files of an interrupted
// save are removed by the next one.
TEST_CASE("save_module: shards of another save are refused, a failed save leaves the previous one",
          "[checkpoint][save_model]") {
  auto a = make_net(11), b = make_net(12);
  const fs::path dir = fresh_dir("set_a"), other = fresh_dir("set_b");
  save_module(*a, dir, {"50"});
  save_module(*b, other, {"50"});
  const std::string s2 = "model-00002-of-00004.safetensors";

  // A save that fails while writing its shards: the third one cannot be
  // staged (a directory holds its staging name). The previous set loads.
  const fs::path blocker = dir / ".model-00003-of-00004.safetensors.accel-new";
  fs::create_directories(blocker / "x");
  CHECK_THROWS(save_module(*b, dir, {"50"}));
  fs::remove_all(blocker);
  for (const auto& entry : fs::directory_iterator(dir))
    CHECK(entry.path().filename().string().find(".accel-new") == std::string::npos);
  auto loaded = make_net(13);
  load_module(*loaded, dir);
  CHECK(same_state(*a, *loaded));

  // One shard from another save (a kill between the renames, or a copy):
  // an error naming it, and the module is left as it was.
  fs::copy_file(other / s2, dir / s2, fs::copy_options::overwrite_existing);
  auto target = make_net(14), untouched = make_net(14);
  CHECK_THROWS_WITH(load_module(*target, dir),
                    Catch::Matchers::ContainsSubstring("'" + s2 + "' was written by another save_model() than the index") &&
                        Catch::Matchers::ContainsSubstring("would mix two models"));
  CHECK(same_state(*target, *untouched));

  // Staging files left by an interrupted save are removed by the next save.
  std::ofstream(dir / ".model-00001-of-00002.safetensors.accel-new") << "partial";
  save_module(*a, dir, {"50"});
  for (const auto& entry : fs::directory_iterator(dir))
    CHECK(entry.path().filename().string().find(".accel-new") == std::string::npos);
  load_module(*loaded, dir);
  CHECK(same_state(*a, *loaded));
}
